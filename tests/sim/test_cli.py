"""``nicswitch-agent sim``: argument parsing and a served switch (run() embedded with a stop event)."""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import threading
from collections.abc import Callable

import pytest

from nicswitch_agent.sim import SimJob, SimSettings, cli

from .conftest import WAIT, Client

pytestmark = pytest.mark.timeout(20)


class _Lines(io.StringIO):
    """An ``out`` stream that signals each written line."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def write(self, text: str) -> int:
        with self.changed:
            written = super().write(text)
            self.changed.notify_all()
        return written

    def wait_for(self, pattern: str) -> re.Match[str]:
        with self.changed:
            found: list[re.Match[str]] = []

            def seen() -> bool:
                match = re.search(pattern, self.getvalue())
                if match:
                    found.append(match)
                return bool(match)

            assert self.changed.wait_for(seen, WAIT), f"{pattern!r} not in {self.getvalue()!r}"
            return found[0]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_parse_nodes() -> None:
    assert cli.parse_nodes(["node-0:0,1", "node-1: 2 , 3"]) == {"node-0": ["0", "1"], "node-1": ["2", "3"]}
    for bad in (["node-0"], ["node-0:"], [":0"], ["n:0", "n:1"]):
        with pytest.raises(ValueError):
            cli.parse_nodes(bad)


def test_inconsistent_arguments_return_2() -> None:
    """What only makes sense together is checked when the simulator is built: still exit 2."""
    for argv in (("--nodes", "n:0", "--nodes", "n:1"), ("--superpod", "node-9:1"), ("--tls-key", "k.pem")):
        assert cli.run(_parse(*argv), stop_event=threading.Event(), out=io.StringIO()) == 2, argv


def test_run_serves_until_stopped() -> None:
    args = _parse("--port", "0", "--job", "job-1", "--nodes", "node-0:0,1", "--nodes", "node-1:0,1", "--standin", "-v")
    out, stop = _Lines(), threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(cli.run(args, stop_event=stop, out=out)))
    thread.start()
    try:
        address = out.wait_for(r"listening on (\S+)").group(1)
        out.wait_for(r"node node-1: device->rank 0->2 1->3")
        worker, om = Client(address, job_id="job-1", role="worker"), Client(address, job_id="job-1", role="om")
        stream = worker.subscribe_notify()
        out.wait_for(r"SubscribeNotifySwitch opened")
        assert om.track({"node-1": (["1"], [True])}).code == 0
        assert list(stream.get().rankID) == ["3"]
        worker.reply(True)
        out.wait_for(r"WaitContinueTrainState\(switchNicRecvContinue\)-->INIT")
        worker.close()
        om.close()
    finally:
        stop.set()
        thread.join(WAIT)
    assert result == [0]


def test_module_entry_point_stops_on_sigint() -> None:
    """``python -m nicswitch_agent.sim`` serves, then exits 0 on SIGINT (the operator's Ctrl-C)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "nicswitch_agent.sim", "--port", "0", "--job", "job-9"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = None
        for line in proc.stdout:  # log lines first, then the address line
            address = re.search(r"listening on (\S+)", line)
            if address:
                break
        assert address
        assert Client(address.group(1), job_id="job-9").init().info == "job(uid=job-9) init success"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # a bound, not a timing: interpreter exit is slow on a loaded box
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- options, help and validation


def _parser(prog: str = "nicswitch-agent sim") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    cli.add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (("--port", "99999"), "argument --port: 99999 is not a port (0-65535"),
        (("--port", "-5"), "argument --port: -5 is not a port"),
        (("--port", "http"), "argument --port: 'http' is not a port number"),
        (("--strategies", "foo,bar"), "argument --strategies: unknown strategy 'foo', 'bar' (known: retry, recover"),
        (("--report-timeout", "0"), "argument --report-timeout: '0' must be a positive number of seconds"),
        (("--keepalive", "nan"), "argument --keepalive: 'nan' is not a finite number of seconds"),
        (("--enqueue-timeout", "1e20"), "argument --enqueue-timeout: '1e20' is above the limit of 604800 s (7 days)"),
        (("--fault-flush", "-1"), "argument --fault-flush: '-1' must be a non-negative number of seconds"),
        (("--framework", "tensorflow"), "argument --framework: invalid choice: 'tensorflow'"),
        (("--max-workers", "4"), "argument --max-workers: 4: at least 8"),
        (("--superpod", "node-0"), "argument --superpod: 'node-0': expected NODE:SUPERPOD_ID"),
        (("--nodes", "broken"), "argument --nodes: --nodes 'broken': expected NODE:DEV[,DEV...]"),
    ],
)
def test_bad_values_are_usage_errors(
    argv: tuple[str, ...], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11: ranges and names are checked by the parser: a clear message, exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(list(argv))
    assert exit_.value.code == 2
    assert f"nicswitch-agent sim: error: {complaint}" in capsys.readouterr().err


# Every SimSettings and SimJob field, and the flag that sets it (job_id and nodes: --job, --nodes).
FLAGS = {
    "report_timeout_s": ("--report-timeout", "3"),
    "keepalive_interval_s": ("--keepalive", "2"),
    "enqueue_timeout_s": ("--enqueue-timeout", "0.5"),
    "fault_flush_s": ("--fault-flush", "0.01"),
    "force_release_s": ("--force-release", "0.02"),
    "schedule_wait_s": ("--schedule-wait", "0.03"),
    "restart_wait_s": ("--restart-wait", "0.04"),
    "list_delay_s": ("--list-delay", "0.05"),
    "shuffle_nodes": ("--no-shuffle",),
    "seed": ("--seed", "11"),
    "max_workers": ("--max-workers", "16"),
    "crash_like_clusterd": ("--crash-like-clusterd",),
    "job_id": ("--job", "job-7"),
    "nodes": ("--nodes", "a:0,1", "--nodes", "b:0,1"),
    "running": ("--not-running",),
    "superpod_ids": ("--superpod", "a:-1", "--superpod", "b:3"),
    "recover_strategies": ("--strategies", "recover,dump"),
    "framework": ("--framework", "mindspore"),
    "process_recover_enable": ("--process-recover-off",),
    "in_job_cache": ("--no-job-cache",),
}


def test_every_simulator_setting_is_reachable_from_the_cli() -> None:
    """Issue 12 item 8: each SimSettings/SimJob field has an option (a new field without one fails)."""
    fields = {f.name for f in dataclasses.fields(SimSettings)} | {f.name for f in dataclasses.fields(SimJob)}
    assert fields == set(FLAGS)
    argv = [word for flag in FLAGS.values() for word in flag]
    job, settings = cli.settings_from(_parser().parse_args(argv))
    assert settings == SimSettings(
        report_timeout_s=3.0, keepalive_interval_s=2.0, enqueue_timeout_s=0.5, fault_flush_s=0.01,
        force_release_s=0.02, schedule_wait_s=0.03, restart_wait_s=0.04, list_delay_s=0.05, shuffle_nodes=False,
        seed=11, max_workers=16, crash_like_clusterd=True,
    )
    assert job == SimJob(
        "job-7", {"a": ["0", "1"], "b": ["0", "1"]}, running=False, superpod_ids={"a": -1, "b": 3},
        recover_strategies=("recover", "dump"), framework="mindspore", process_recover_enable=False,
        in_job_cache=False,
    )


def test_defaults_are_the_real_servers() -> None:
    job, settings = cli.settings_from(_parser().parse_args([]))
    assert settings == SimSettings()
    assert job == SimJob("job-1", {"node-0": ["0", "1"], "node-1": ["0", "1"]})


def test_quick_recovery_shrinks_the_recovery_waits_unless_one_is_given() -> None:
    _, settings = cli.settings_from(_parser().parse_args(["--quick-recovery", "--restart-wait", "2"]))
    assert (settings.fault_flush_s, settings.force_release_s, settings.schedule_wait_s, settings.restart_wait_s) == (
        0.05, 0.1, 0.1, 2.0,
    )


def _help_of_the_subcommand(capsys: pytest.CaptureFixture[str]) -> str:
    from nicswitch_agent.ops import cli as main_cli

    with pytest.raises(SystemExit) as exit_:
        main_cli.main(["sim", "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _help_of_the_module(capsys: pytest.CaptureFixture[str]) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "nicswitch_agent.sim", "--help"], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


@pytest.mark.parametrize("read_help", [_help_of_the_subcommand, _help_of_the_module])
def test_help_describes_the_simulator_and_every_option_with_its_default(
    read_help: Callable[[pytest.CaptureFixture[str]], str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11/12: ``nicswitch-agent sim --help`` and ``python -m nicswitch_agent.sim --help``."""
    text = read_help(capsys)
    flat = " ".join(text.split())
    assert "Serve a simulated MindCluster ClusterD" in flat
    assert "--crash-like-clusterd it exits with status 2" in flat
    assert "exit status: 0 stopped by Ctrl-C/SIGTERM; 1 cannot listen; 2 usage error (the port in use" in flat
    for action in _parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.option_strings[-1] in text
        if not action.dest.startswith("tls_"):
            assert action.help and "default:" in action.help, f"{action.option_strings} shows no default"
    for shown in ("(default: 8899", "(default: 900.0)", "(default: 5.0)", "(default: retry,recover,dump)",
                  "(default: pytorch)", "(default: 32)", "(default: 60.0, or the --quick-recovery value)"):
        assert shown in flat, shown


def test_cli_process_exits_2_where_the_real_clusterd_crashes() -> None:
    """--crash-like-clusterd: a report without status takes the process down, as on ClusterD:
    the call fails with UNAVAILABLE and the process exits with status 2, saying why."""
    import subprocess
    import sys

    import grpc

    from nicswitch_agent._pb import recover_pb2 as pb

    proc = subprocess.Popen(
        [sys.executable, "-m", "nicswitch_agent.sim", "--port", "0", "--job", "job-9", "--crash-like-clusterd"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        address = None
        for line in proc.stdout:
            address = re.search(r"listening on (\S+)", line)
            if address:
                break
        assert address
        client = Client(address.group(1), job_id="job-9")
        assert client.init().code == 0 and client.register().code == 0
        with pytest.raises(grpc.RpcError) as failure:
            client.stub.ReportStopComplete(pb.StopCompleteRequest(jobId="job-9"), timeout=WAIT)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(30) == 2
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "crashed as the real ClusterD would (exit status 2)" in stderr
        assert "ReportStopComplete without a status field" in stderr
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_busy_port_is_one_clear_line_and_exit_2() -> None:
    """Issue 18 §7: not gRPC core's raw ``add_port.cc`` error line, but what is wrong and what to do."""
    import socket
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:  # listening, as another server would be
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "nicswitch_agent", "sim", "--port", str(port)],
                              capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"nicswitch-agent sim: error: port {port} on 127.0.0.1 is in use (another ClusterD or simulator?): "
        "stop it, or pick another with --port (0 picks a free one)"
    ], done.stderr
