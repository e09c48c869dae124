"""Operators see what the docs promise: the CLI's names and flags, the launcher's log, the doctor
without torch, and a ``watch`` that sees every switch, quick ones included.

Real processes where the user runs one (``python -m nicswitch_agent ...``), the ClusterD simulator
on 127.0.0.1:0, and a real SwitchAgent answering its switches.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest
import support
from support import Lines

from nicswitch_agent import SwitchAgent, SwitchOrder, __version__
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.ops import cli
from nicswitch_agent.ops.om import SWITCH_FINISH, OmClient, OutcomeKind
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

if TYPE_CHECKING:
    from nicswitch_agent.ops.om import WatchedSwitch

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
JOB = "job-ops"
NOT_SWITCHING = f"jobId={JOB} is not swtiching nic"
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
OM = "SubscribeSwitchNicSignal"


def child_env(**extra: str) -> dict[str, str]:
    """This interpreter's environment without the agent's settings (the tests give their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "PYTEST_"))}
    env.update({"PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    env.update(extra)
    return env


def nicswitch(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nicswitch_agent", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env=env or child_env(), cwd=ROOT)


# --------------------------------------------------------------------------------------------
# A job with a real agent answering, against the simulator
# --------------------------------------------------------------------------------------------


streams_ready = functools.partial(support.streams_ready, job=JOB)
idle = functools.partial(support.idle, job=JOB)


def om_stream_open(sim: Simulator) -> bool:
    return sim.job_view(JOB).open_streams.get(OM, 0) >= 1


class QuickJob:
    """One rank (pause mode agent) stepping every 2 ms; a switch takes a few milliseconds.

    ``hold`` makes the switch hook wait (at most 45 s: a watch started as a new process took more
    than 10 on a loaded machine) until an operator's result stream is open, so that a follower is
    sure to be there however loaded the machine is; without it a switch is as quick as the job allows.
    """

    def __init__(self, sim: Simulator, hold: Callable[[Simulator], bool] | None = None) -> None:
        self.sim = sim
        self.hold = hold
        self.switched: list[tuple[int, ...]] = []
        self.agent = SwitchAgent(server=sim.address, job_id=JOB, switch_hook=self._switch, pause="agent").start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, name="quick-job", daemon=True)
        self._thread.start()

    def _switch(self, order: SwitchOrder) -> bool:
        if self.hold is not None:
            self.sim.wait_until(self.hold, 45)
        self.switched.append(tuple(order.ops))
        return True

    def _train(self) -> None:
        step = 0
        while not self._stop.wait(0.002):
            step += 1
            self.agent.step(step)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.agent.stop("test done")


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=FAST)
    simulator.start()
    yield simulator
    simulator.stop()


def request(sim: Simulator, standby: bool) -> None:
    """SwitchNicTrack only: the result goes to whoever follows the job (here: the watch)."""
    assert sim.wait_until(idle, 30), sim.job_view(JOB)
    with OmClient(sim.address) as client:
        client.switch(JOB, {"node-0": (["0"], [standby])})


# --------------------------------------------------------------------------------------------
# watch: every switch, as it happens, timed from the switch
# --------------------------------------------------------------------------------------------


def test_watch_started_first_prints_each_of_five_quick_switches(sim: Simulator) -> None:
    """The issue: a watch started first missed 5 of 5 quick switches (it asked once a second,
    and exited after one result). Now it asks every 5 ms while none runs, holds the stream while
    one does, and prints each result as it arrives, with how long that switch ran.

    Each switch is as quick as the job allows, except that its hook waits (bounded) for the
    watch's stream to be open: on a loaded machine a watch descheduled for 10 ms would otherwise
    miss a 7 ms switch by no fault of its own (see test_watch_asks_often_while_nothing_runs for
    the pace).
    """
    job = QuickJob(sim, hold=om_stream_open)
    watch = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "watch", "--server", sim.address,
                              "--job", JOB, "--count", "5", "--timeout", "90"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    try:
        out = Lines(watch.stdout)  # type: ignore[arg-type]
        assert out.wait_for("watching job", 60), out.lines
        for n in range(5):
            request(sim, standby=n % 2 == 0)
            line = out.wait_for(f"switch {n + 1} ", 30)
            assert line is not None and f"switch {n + 1} finished, ran " in line and SWITCH_FINISH in line, out.lines
        assert watch.wait(30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
        watch.wait(10)
        job.stop()
    lines = out.rest()
    results = [line for line in lines if " finished, ran " in line]
    assert len(results) == 5, lines
    # Every switch after the first started after the previous result: its duration has both bounds.
    assert all(" to " in line or "at least" not in line for line in results[1:]), results
    assert job.switched == [(True,), (False,), (True,), (False,), (True,)]
    assert sim.job_view(JOB).om_messages == [SWITCH_FINISH] * 5
    assert sim.job_view(JOB).violations == []


Serve = Callable[..., str]


# serve: the fixture in conftest.py (a real gRPC server with the given Recover behaviours).


def test_watch_asks_often_while_nothing_runs(serve: Serve) -> None:
    """The pace that lets a watch see a switch of a few milliseconds: ~200 calls a second by default.

    Asserted with 10x slack (at least 20 calls in 1 s, where the old watch made 4 or 5).
    """
    calls: list[float] = []

    def refuse(request: Any, context: Any) -> Iterator[Any]:
        calls.append(time.monotonic())
        context.abort(grpc.StatusCode.UNKNOWN, NOT_SWITCHING)
        yield from ()

    from nicswitch_agent.ops.om_cli import add_watch_arguments, run_watch

    parser = argparse.ArgumentParser()
    add_watch_arguments(parser)
    args = parser.parse_args(["--server", serve(SubscribeSwitchNicSignal=refuse), "--job", JOB, "--timeout", "1"])
    assert run_watch(args, env={}) == 7  # nothing switched
    assert len(calls) >= 20, len(calls)


def test_watch_times_each_switch_from_its_start_and_goes_on(serve: Serve) -> None:
    """Results are given as they arrive, the watch goes on after each, and a switch's duration is
    bounded by the last refusal before it (not by the watch's own start)."""
    script = iter(["no", "msg:" + SWITCH_FINISH, "no", "no", "eof", "no", "msg:pause train timeout", "no"])
    lock = threading.Lock()

    def stream(request: Any, context: Any) -> Iterator[Any]:
        with lock:
            step = next(script, "no")
        if step == "no":
            context.abort(grpc.StatusCode.UNKNOWN, NOT_SWITCHING)
        elif step.startswith("msg:"):
            yield pb.SwitchNicResponse(jobID=JOB, msg=step[4:])

    target = serve(SubscribeSwitchNicSignal=stream)
    seen: list[WatchedSwitch] = []
    with OmClient(target) as client:
        end = client.watch(JOB, seen.append, count=3, timeout_s=30, poll_s=0.001)
    assert end.stopped is None and list(end.results) == seen
    assert [(r.seq, r.outcome.kind, r.outcome.message) for r in seen] == [
        (1, OutcomeKind.FINISHED, SWITCH_FINISH),
        (2, OutcomeKind.NO_RESULT, None),  # the stream ended empty, then "not switching": lost
        (3, OutcomeKind.FAILED, "pause train timeout"),
    ]
    for result in seen:
        assert result.at_most_s is not None and 0 <= result.at_least_s <= result.at_most_s < 5, result
    assert "result was lost" in seen[1].outcome.detail


def test_watch_json_prints_one_object_per_result_as_it_arrives(serve: Serve,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from nicswitch_agent.ops.om_cli import add_watch_arguments, run_watch

    script = iter(["no", "finish", "no", "finish"])
    lock = threading.Lock()

    def stream(request: Any, context: Any) -> Iterator[Any]:
        with lock:
            step = next(script, "no")
        if step == "no":
            context.abort(grpc.StatusCode.UNKNOWN, NOT_SWITCHING)
        else:
            yield pb.SwitchNicResponse(jobID=JOB, msg=SWITCH_FINISH)

    parser = argparse.ArgumentParser()
    add_watch_arguments(parser)
    args = parser.parse_args(["--server", serve(SubscribeSwitchNicSignal=stream), "--job", JOB, "--json",
                              "--count", "2", "--poll", "0.001"])
    assert run_watch(args, env={}) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o.get("event") for o in objects] == ["result", "result", None]
    assert [o.get("seq") for o in objects[:2]] == [1, 2]
    assert all(o["outcome"] == "finished" and o["ran_at_most_s"] >= o["ran_at_least_s"] >= 0 for o in objects[:2])
    assert objects[2]["results"] == 2 and objects[2]["exit_code"] == 0


# --------------------------------------------------------------------------------------------
# switch --no-wait: the suggested follow-up works when pasted
# --------------------------------------------------------------------------------------------


def test_switch_no_wait_suggests_a_watch_that_works_when_pasted(sim: Simulator) -> None:
    # The job's hook waits for a result stream: the switch is still running when the command is pasted.
    job = QuickJob(sim, hold=om_stream_open)
    try:
        assert sim.wait_until(idle, 30)
        switch = nicswitch("switch", "--server", sim.address, "--job", JOB, "--node", "node-0", "--dev", "0",
                           "--op", "standby", "--no-wait")
        assert switch.returncode == 0, switch.stdout + switch.stderr
        (hint,) = [line for line in switch.stdout.splitlines() if "follow it with: " in line]
        argv = shlex.split(hint.split("follow it with: ", 1)[1])
        assert argv[:2] == ["nicswitch-agent", "watch"]
        assert argv[argv.index("--server") + 1] == sim.address and argv[argv.index("--job") + 1] == JOB
        pasted = nicswitch(*argv[1:])  # the console script is `python -m nicswitch_agent`
        assert pasted.returncode == 0, pasted.stdout + pasted.stderr
        assert "switch 1 finished, ran " in pasted.stdout and SWITCH_FINISH in pasted.stdout
    finally:
        job.stop()
    assert job.switched == [(True,)]


def test_switch_says_at_once_when_clusterd_dies_while_it_waits_and_gives_up_with_6() -> None:
    """The tester's case: ``kill -9`` of ClusterD (a simulator process) while ``switch`` waits for the
    result printed nothing for 16 min, then exit 7 (timed out). Now: one line at once, then exit 6
    after ``--max-unreachable``, saying the switch may still run and how to check."""
    sim = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "sim", "--port", "0", "--job", JOB,
                            "--nodes", "node-0:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=child_env(), cwd=ROOT)
    entered, gate = threading.Event(), threading.Event()

    def hook(order: SwitchOrder) -> bool:
        entered.set()
        return gate.wait(60)  # the switch runs inside ClusterD until the test lets it end

    agent: SwitchAgent | None = None
    switch: subprocess.Popen[str] | None = None
    try:
        line = Lines(sim.stdout).wait_for("listening on", 60)  # type: ignore[arg-type]
        assert line is not None, "the simulator did not start"
        address = line.rsplit(" ", 1)[1]
        agent = SwitchAgent(server=address, job_id=JOB, switch_hook=hook, pause="agent").start()
        with support.Trainer(agent):
            assert support.wait_until(lambda: agent is not None and agent.status()["connected"], 60)
            switch = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "switch", "--server", address,
                                       "--job", JOB, "--node", "node-0", "--dev", "0", "--op", "standby",
                                       "--max-unreachable", "2"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                                      cwd=ROOT)
            out, err = Lines(switch.stdout), Lines(switch.stderr)  # type: ignore[arg-type]
            assert out.wait_for("waiting for the result", 60), out.lines + err.rest(1)
            assert entered.wait(60), "the switch did not reach the job"
            sim.kill()  # SIGKILL: no goodbye on any stream
            sim.wait(10)
            lost = err.wait_for("ClusterD unreachable since ", 30)
            assert lost is not None and lost.endswith("still waiting for the result, Ctrl-C to stop"), err.lines
            assert switch.wait(60) == 6, out.rest() + err.rest()
            rest = err.rest()
            assert any(line.startswith("gave up after ") for line in rest), rest
            assert any("the switch may still be running on ClusterD's side" in line for line in rest), rest
            assert sum("ClusterD unreachable since" in line for line in rest) == 1, rest  # once, not per retry
            gate.set()
    finally:
        gate.set()
        for process in (switch, sim):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
        if agent is not None:
            agent.stop("test done")


def test_follow_up_commands_carry_server_job_and_tls_flags() -> None:
    from nicswitch_agent.ops.om_cli import watch_command

    args = argparse.Namespace(tls=None, tls_ca="my ca.pem", tls_cert=None, tls_key=None, tls_server_name="cd")
    assert watch_command("10.0.0.1:8899", "job 1", args) == (
        "nicswitch-agent watch --server 10.0.0.1:8899 --job 'job 1' --tls-ca 'my ca.pem' "
        "--tls-server-name cd --count 1")


# --------------------------------------------------------------------------------------------
# The command line: --version, -v anywhere, --job everywhere
# --------------------------------------------------------------------------------------------


def test_version_flag() -> None:
    result = nicswitch("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"nicswitch-agent {__version__}"
    assert nicswitch("version").stdout.strip() == f"nicswitch-agent {__version__}"


@pytest.mark.parametrize(("argv", "verbose"), [
    (["doctor"], False),
    (["-v", "doctor"], True),
    (["doctor", "-v"], True),
    (["doctor", "--verbose"], True),
    (["-v", "doctor", "-v"], True),
    (["status", "-v"], True),
    (["watch", "-v", "--job", "j"], True),
    (["switch", "--job", "j", "-v"], True),
    (["launch", "-v", "--", "python", "-v"], True),  # after the command's own `--`: the child's
    (["launch", "--", "python", "-v"], False),
    (["sim"], False),
    (["-v", "sim"], True),  # the simulator's own -v must not reset the one given before
    (["sim", "-v"], True),
    (["version", "-v"], True),
    (["demo", "-v"], True),
])
def test_verbose_before_or_after_the_command(argv: list[str], verbose: bool) -> None:
    args = cli._build_parser().parse_args(argv)
    assert args.verbose is verbose


def test_verbose_after_the_command_reaches_logging() -> None:
    """A real run: `switch ... -v` logs the client's INFO line, which the default (WARNING) hides."""
    argv = ["switch", "--server", "127.0.0.1:1", "--job", JOB, "--node", "n", "--dev", "0", "--op", "standby",
            "--rpc-timeout", "1"]
    quiet, verbose = nicswitch(*argv), nicswitch(*argv, "-v")
    assert quiet.returncode == verbose.returncode == 6  # unreachable, as expected
    line = f"INFO nicswitch_agent.om: [{JOB}] SwitchNicTrack n: dev 0 -> standby"
    assert line in verbose.stderr and line not in quiet.stderr, verbose.stderr


def test_every_command_names_the_job_option_job() -> None:
    parser = cli._build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("switch", "watch", "doctor", "launch", "sim"):
        text = sub.choices[name].format_help()
        assert "--job " in text, name
        assert "--job-id" not in text, name
    # The launcher's first name still works (existing scripts), and both fill the same setting.
    assert parser.parse_args(["launch", "--job-id", "old", "--", "x"]).job_id == "old"
    assert parser.parse_args(["launch", "--job", "new", "--", "x"]).job_id == "new"


# --------------------------------------------------------------------------------------------
# doctor: a one-process job does not need torch
# --------------------------------------------------------------------------------------------

HIDE_TORCH = ("import sys; sys.modules['torch'] = None; from nicswitch_agent.ops.cli import main; "
              "sys.exit(main(sys.argv[1:]))")


def doctor_without_torch(sim: Simulator, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE_TORCH, "doctor", "--json"], capture_output=True, text=True,
                          timeout=60, check=False, cwd=ROOT,
                          env=child_env(NICSWITCH_SERVER=sim.address, NICSWITCH_JOB_ID=JOB, NICSWITCH_DRY_RUN="1",
                                        **env))


def test_doctor_does_not_require_torch_for_a_one_process_job(sim: Simulator) -> None:
    single = doctor_without_torch(sim, WORLD_SIZE="1")
    report = json.loads(single.stdout)
    torch_check = next(c for c in report["checks"] if c["name"] == "torch")
    assert single.returncode == 0 and report["ready"], report
    assert torch_check["status"] == "warn" and "not needed by a single-process job" in torch_check["detail"]
    assert "torch" not in report["failed"]

    several = doctor_without_torch(sim, WORLD_SIZE="2", RANK="0")
    report = json.loads(several.stdout)
    torch_check = next(c for c in report["checks"] if c["name"] == "torch")
    assert several.returncode == 1 and report["failed"] == ["torch"], report
    assert "2 ranks coordinate through a torch Store" in torch_check["detail"]

    member = doctor_without_torch(sim, WORLD_SIZE="1", NICSWITCH_LEADER="launcher",
                                  NICSWITCH_STORE_ADDRESS="127.0.0.1:1")
    assert json.loads(member.stdout)["failed"] == ["torch"]  # a launcher's member reaches the Store with torch


# --------------------------------------------------------------------------------------------
# launch: the agent's INFO lines, as docs/operations.md promises
# --------------------------------------------------------------------------------------------

MEMBER = """
import sys, time
from pathlib import Path
from nicswitch_agent import SwitchAgent
out = Path(sys.argv[1])
agent = SwitchAgent(switch_hook=lambda order: True).start()
(out / "ready").touch()
step = 0
while not (out / "stop").exists():
    step += 1
    agent.step(step)
    time.sleep(0.05)  # a step of 50 ms: a switch of a few ms could end before switch_and_wait subscribed
agent.stop("done")
"""


@pytest.mark.timeout(240)
def test_launch_logs_the_lines_operations_md_tells_operators_to_look_for(sim: Simulator, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = child_env(NICSWITCH_SERVER=sim.address, NICSWITCH_JOB_ID=JOB, NICSWITCH_PAUSE="agent",
                    NICSWITCH_RECONNECT_INITIAL_S="0.02", NICSWITCH_RECONNECT_MAX_S="0.1", OMP_NUM_THREADS="1",
                    GRPC_ENABLE_FORK_SUPPORT="false")
    log_path = tmp_path / "launch.log"
    with open(log_path, "wb") as log:
        launch = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "launch", "--world-size", "1", "--",
                                   sys.executable, "-c", MEMBER, str(tmp_path)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and launch.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists(), log_path.read_text()
        assert sim.wait_until(idle, 30), log_path.read_text()
        with OmClient(sim.address) as client:
            outcome = client.switch_and_wait(JOB, {"node-0": (["0"], [True])}, timeout_s=60)
        assert outcome.kind is OutcomeKind.FINISHED, outcome
        (tmp_path / "stop").touch()
        assert launch.wait(60) == 0
    finally:
        if launch.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch.pid, 9)
            launch.wait(10)
    text = log_path.read_text()
    for needle in (f"registered job {JOB} with ClusterD", "switch #1 1 rank(s): 0->standby received",
                   "switch #1: replied true", "INFO nicswitch_agent.launcher: hosting the job's leader"):
        assert needle in text, f"{needle!r} not in the launcher's log:\n{text}"


def test_launch_quiet_and_verbose_set_the_agent_log_level() -> None:
    from nicswitch_agent.ops import launcher

    agent_logger = logging.getLogger("nicswitch_agent")
    saved = agent_logger.level
    try:
        for kwargs, level in (({}, logging.INFO), ({"quiet": True}, logging.WARNING)):
            launcher.configure_logging(**kwargs)
            assert agent_logger.level == level
            assert agent_logger.getChild("subscriber").getEffectiveLevel() == level
        agent_logger.setLevel(logging.NOTSET)
        launcher.configure_logging(verbose=True)
        assert agent_logger.level == logging.NOTSET  # DEBUG from the root logger, for everything
    finally:
        agent_logger.setLevel(saved)
    parser = cli._build_parser()
    assert parser.parse_args(["launch", "-q", "--", "x"]).quiet is True
    assert parser.parse_args(["launch", "--", "x", "-q"]).quiet is False  # the child's
