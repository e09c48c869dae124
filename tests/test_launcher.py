"""``nicswitch-agent launch``: the job's leader in a launcher process, around a real torchrun job.

The pytest process runs the ClusterD simulator and plays the operator (SwitchNicTrack, then
SubscribeSwitchNicSignal). The launcher runs as ``python -m nicswitch_agent.ops.launcher`` in its own
session and wraps ``torchrun --standalone --nproc-per-node 2 tests/launcher_job/train.py``; each
rank's ``SwitchAgent()`` becomes a member from the env the launcher exports. Synchronisation is
by polling files and simulator state with deadlines; teardown kills every process the launcher
started (found through /proc before the launcher goes), then the launcher's group.

The planning rules (node role, world size, Store port and host) are tested in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import StreamWatch, free_port, poll, read_jsonl

pytest.importorskip("torch")

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.observability.timeline import build, read_events
from nicswitch_agent.ops import launcher
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tests" / "launcher_job" / "train.py"
JOB = "job-launch"
PM, NOTIFY = support.PROCESS_MANAGE, support.NOTIFY
FAST = SimSettings(report_timeout_s=30.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
FINISH = "switch nic finish"
STARTUP_S = 120.0  # three Python processes importing torch on a small, possibly busy, CI machine


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (Linux /proc), to kill what an interrupted launcher leaves."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def base_env(sim: Simulator) -> dict[str, str]:
    """The launcher's env: this interpreter's bin first on PATH (torchrun), the agent's settings."""
    drop = ("NICSWITCH_", "PET_", "TORCHELASTIC_", "MASTER_", "PYTEST_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK")}
    env.update({
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        "NICSWITCH_SERVER": sim.address, "NICSWITCH_JOB_ID": JOB, "NICSWITCH_PAUSE": "agent",
        "NICSWITCH_RECONNECT_INITIAL_S": "0.02", "NICSWITCH_RECONNECT_MAX_S": "0.1",
        "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
    })
    return env


class Launch:
    """One ``python -m nicswitch_agent.ops.launcher ...`` process, its log and its process tree."""

    def __init__(self, out: Path, args: list[str], env: dict[str, str]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "launcher.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-m", "nicswitch_agent.ops.launcher", *args], cwd=ROOT, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._seen: set[int] = set()

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def remember_tree(self) -> None:
        """Note the launcher's descendants now: once it is gone they are orphans nobody would find."""
        self._seen.update(descendants(self.proc.pid))

    def wait(self, timeout: float) -> int | None:
        poll(lambda: self.remember_tree() or self.proc.poll() is not None, timeout, 0.05)
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.remember_tree()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)  # forwarded to the child: the polite way first
            self.wait(20)
        self.remember_tree()
        for pid in [self.proc.pid, *self._seen]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()
        print(f"===== launcher: exit {self.proc.poll()}\n{self.log()[-6000:]}")


class TrainJob:
    """The files tests/launcher_job/train.py writes, per rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def lines(self, rank: int, kind: str, restart: int | None = None) -> list[dict[str, Any]]:
        rows = read_jsonl(self.out / f"rank{rank}.{kind}.jsonl")
        return [r for r in rows if restart is None or r.get("restart") == restart]

    def stepping(self, restart: int, minimum: int = 3) -> bool:
        return all(len(self.lines(r, "steps", restart)) >= minimum for r in (0, 1))

    def last_step(self, rank: int) -> int:
        steps = self.lines(rank, "steps")
        return int(steps[-1]["step"]) if steps else 0


class Operator:
    """The O&M side: SwitchNicTrack, then the one message on SubscribeSwitchNicSignal."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.channel = open_channel(ChannelSettings(target=sim.address))
        self.stub = RecoverStub(self.channel)

    def switch(self, devs: list[str], ops: list[bool], timeout: float = 60) -> str:
        assert self.sim.wait_until(idle, 30), f"job not idle: {self.sim.job_view(JOB)}"
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps["node-0"].dev.extend(devs)
        request.nicOps["node-0"].op.extend(ops)
        status = self.stub.SwitchNicTrack(request, timeout=5)
        assert status.code == 0, status
        for response in self.stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=timeout):
            return str(response.msg)
        return "(no message)"

    def track(self, devs: list[str], ops: list[bool]) -> pb.Status:
        """SwitchNicTrack alone: ClusterD's answer to the request (0: accepted, the switch begins)."""
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps["node-0"].dev.extend(devs)
        request.nicOps["node-0"].op.extend(ops)
        return self.stub.SwitchNicTrack(request, timeout=5)

    def close(self) -> None:
        self.channel.close()


streams_ready = functools.partial(support.streams_ready, job=JOB)
idle = functools.partial(support.idle, job=JOB)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]}, recover_strategies=("dump",))],
                          settings=FAST)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for launch in started:
        launch.close()


# -- with a real torchrun child -----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_torchrun_job_switches_survives_a_restart_and_sigterm_ends_it(sim: Simulator, tmp_path: Path,
                                                                     launches: list[Launch]) -> None:
    """One launcher, one ClusterD client, through a failover, a training restart, a switchback and SIGTERM."""
    watch = StreamWatch(sim, JOB)
    # No TORCH_DISABLE_SHARE_RDZV_TCP_STORE here: the launcher sets it (with torchrun's shared store, a
    # restarted gloo group read the dead attempt's addresses and failed in 7 of 9 plain torchrun runs).
    env = base_env(sim) | {"NICSWITCH_EVENTS_FILE": str(tmp_path / "events" / "ev-{rank}.jsonl")}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env
    try:
        out, launch, operator = _two_ranks_training(sim, tmp_path, launches, env=env)
    except BaseException:
        watch.stop()
        raise
    job = TrainJob(out)
    try:
        starts = [job.lines(r, "start", 0)[0] for r in (0, 1)]
        assert all(s["role"] == "member" and not s["holds_channel"] for s in starts), starts
        assert all(s["env"]["NICSWITCH_LEADER"] == "launcher" for s in starts)
        assert {s["env"]["NICSWITCH_STORE_ADDRESS"].rpartition(":")[0] for s in starts} == {"127.0.0.1"}
        assert "hosting the job's leader" in launch.log() and "2 rank(s)" in launch.log()
        # torchrun honoured the launcher's opt-out: rank 0 of each attempt hosts a fresh store.
        assert all(s["torch_env"] == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                                      "TORCHELASTIC_USE_AGENT_STORE": "False"} for s in starts), starts

        # Failover: both ranks run the same full list, at the same step; ClusterD hears "finish".
        assert operator.switch(["1", "0"], [True, True]) == FINISH
        calls = [job.lines(r, "hooks") for r in (0, 1)]
        assert [len(c) for c in calls] == [1, 1], calls
        assert calls[0][0]["ranks"] == calls[1][0]["ranks"] == [1, 0]
        assert calls[0][0]["ops"] == calls[1][0]["ops"] == [True, True]
        assert calls[0][0]["step"] == calls[1][0]["step"] is not None
        assert sim.wait_until(idle, 30)
        before = sim.job_view(JOB).stream_opens
        resets = sim.reset_count(JOB)

        # A training restart: kill one worker; torchrun restarts both; the leader does not notice.
        os.kill(starts[1]["pid"], signal.SIGKILL)
        assert poll(lambda: job.stepping(1), STARTUP_S), "the ranks did not train again after the restart"
        launch.remember_tree()
        restarted = [job.lines(r, "start", 1)[0] for r in (0, 1)]
        assert all(s["torch_env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False" for s in restarted), restarted
        after = sim.job_view(JOB)
        assert after.stream_opens == before, "the training restart reopened ClusterD streams"
        assert sim.reset_count(JOB) == resets
        assert streams_ready(sim)

        # The restarted ranks are members of the same leader: the switchback reaches them.
        assert operator.switch(["1", "0"], [False, False]) == FINISH
        calls = [job.lines(r, "hooks", restart=1) for r in (0, 1)]
        assert [len(c) for c in calls] == [1, 1], calls
        assert calls[0][0]["ops"] == calls[1][0]["ops"] == [False, False]
        assert calls[0][0]["step"] == calls[1][0]["step"] is not None
        assert sim.job_view(JOB).replies == [True, True]

        # SIGTERM to the launcher reaches the training processes; the launcher exits with torchrun's code.
        os.kill(launch.proc.pid, signal.SIGTERM)
        code = launch.wait(60)
        assert code is not None, "the launcher did not exit after SIGTERM"
        got = [job.lines(r, "signals", restart=1) for r in (0, 1)]
        assert all(g and g[0]["signal"] == "SIGTERM" for g in got), got
        assert "forwarding SIGTERM" in launch.log()
        assert f"the training command exited with {code}" in launch.log()
        assert code == 1  # torchrun ends with SignalException (exit 1) when it is terminated
        assert "leader stopped" in launch.log()
        assert sim.wait_until(lambda s: not any(s.job_view(JOB).open_streams.values()), 10), \
            "the leader's streams were left open"
    finally:
        operator.close()
        max_open = watch.stop()
    # Exactly one ClusterD client for the whole job, restart included.
    assert max_open.get(PM) == 1 and max_open.get(NOTIFY) == 1, max_open
    assert sim.job_view(JOB).violations == []
    # The leader's events are its own file's, not training rank 0's: the timeline sees one run, each rank's
    # agent started twice (torchrun restarted both) and the leader once, in the launcher's process.
    events = tmp_path / "events"
    assert sorted(p.name for p in events.iterdir()) == ["ev-0.jsonl", "ev-1.jsonl", "ev-leader.jsonl"]
    timeline = build(read_events([str(events)]))
    (run,) = timeline.runs
    assert run.leader_pids == [launch.proc.pid]
    assert sorted(p.source[0] for p in run.processes if p.source[0] is not None) == [0, 0, 1, 1]
    assert [s.ok for s in timeline.switches] == [True, True]
    assert not [p for p in timeline.problems if "without a rank" in p], timeline.problems


def _two_ranks_training(sim: Simulator, tmp_path: Path, launches: list[Launch], *flags: str,
                        env: dict[str, str] | None = None) -> tuple[Path, Launch, Operator]:
    """Two ranks under the launcher and torchrun (one restart allowed) with train.py's ``flags``,
    training, the leader's streams open: (the job's directory, the launch, an operator to close).
    ``env``: the launcher's (default: base_env)."""
    out = tmp_path / "job"
    launch = Launch(out, ["--", "torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                          "--monitor-interval", "0.1", str(TRAIN), "--out", str(out), *flags],
                    base_env(sim) if env is None else env)
    launches.append(launch)
    job, operator = TrainJob(out), Operator(sim)
    try:
        assert poll(lambda: launch.proc.poll() is None and job.stepping(0), STARTUP_S), "the ranks never trained"
        assert sim.wait_until(streams_ready, 30), sim.job_view(JOB).open_streams
        launch.remember_tree()
    except BaseException:
        operator.close()
        raise
    return out, launch, operator


@pytest.mark.timeout(300)
def test_a_rank_that_dies_mid_switch_is_answered_for_by_its_restarted_process(sim: Simulator, tmp_path: Path,
                                                                            launches: list[Launch]) -> None:
    """Rank 1 SIGKILLs itself in its switch hook; torchrun stops rank 0 and restarts both, and the
    order fails at once (coordination/joining.py), so the leader replies false now: answered by
    rank 0's agent as torchrun stops it (it leaves), or by either new process (it joins), whichever
    the Store hears first (clean-clone CI and a rerun saw all three). Before, it waited out the order's budget (guard +
    switch + verify warm-up: minutes), and here ClusterD's 30 s report timeout would have ended the
    switch first, with another message."""
    out, launch, operator = _two_ranks_training(sim, tmp_path, launches, "--die-in-switch", "1:1")
    try:
        message = operator.switch(["1", "0"], [True, True])
        assert (out / "died").exists()
        assert sim.job_view(JOB).replies == [False], message
        failed = [line for line in launch.log().splitlines() if "switch #1 failed: " in line]
        assert failed, launch.log()[-3000:]
        assert "its process was restarted during the order (pid " in failed[0] \
            or "rank 0: the agent on this rank stopped during the order" in failed[0], failed
        assert sim.job_view(JOB).violations == []
    finally:
        operator.close()


@pytest.mark.timeout(300)
def test_a_switch_before_every_rank_joined_is_refused_then_runs_once_they_have(sim: Simulator, tmp_path: Path,
                                                                                launches: list[Launch]) -> None:
    """The leader makes itself known to ClusterD only once every rank has joined: a switch asked for
    earlier is refused at once (nothing paused, nothing owed), and the same switch asked for afterwards
    runs on every rank. (Before: ClusterD accepted it and paused ranks that could not hear it.)"""
    out = tmp_path / "job"
    launch = Launch(out, ["--", "torchrun", "--standalone", "--nproc-per-node", "2", str(TRAIN), "--out", str(out),
                          "--late-rank", "1"], base_env(sim))
    launches.append(launch)
    job, operator = TrainJob(out), Operator(sim)
    try:
        assert poll(lambda: launch.proc.poll() is None and bool(job.lines(0, "start")), STARTUP_S), \
            f"rank 0 never started: {launch.log()}"
        status = operator.track(["0", "1"], [True, True])
        assert (status.code, status.info) == (413, f"job:{JOB} is not registered"), status
        assert not sim.job_view(JOB).registered and sim.job_view(JOB).state == "INIT"
        assert "joined" not in launch.log()

        (out / "join").touch()
        assert poll(lambda: launch.proc.poll() is None and bool(job.lines(1, "start")), STARTUP_S), \
            f"rank 1 never started: {launch.log()}"
        assert sim.wait_until(idle, 30), sim.job_view(JOB)
        assert "all 2 rank(s) joined" in launch.log()
        assert operator.switch(["0", "1"], [True, True]) == FINISH
        assert [len(job.lines(r, "hooks")) for r in (0, 1)] == [1, 1]
        assert sim.job_view(JOB).replies == [True]
    finally:
        operator.close()
    assert sim.job_view(JOB).violations == []


@pytest.mark.timeout(300)
def test_ranks_that_never_join_do_not_keep_the_leader_from_clusterd(sim: Simulator, tmp_path: Path,
                                                                    launches: list[Launch]) -> None:
    """--join-timeout bounds the wait: the leader then registers, names the missing rank, and a switch
    it cannot pause every rank for is answered (failed) within pause_timeout_s, not left to ClusterD."""
    out = tmp_path / "job"
    env = {**base_env(sim), "NICSWITCH_PAUSE_TIMEOUT_S": "2"}
    launch = Launch(out, ["--join-timeout", "1", "--", "torchrun", "--standalone", "--nproc-per-node", "2",
                          str(TRAIN), "--out", str(out), "--late-rank", "1"], env)
    launches.append(launch)
    job, operator = TrainJob(out), Operator(sim)
    try:
        assert poll(lambda: launch.proc.poll() is None and bool(job.lines(0, "start")), STARTUP_S), \
            f"rank 0 never started: {launch.log()}"
        assert sim.wait_until(idle, 30), sim.job_view(JOB)
        assert re.search(r"rank\(s\) (0-)?1 had not joined after 1 s", launch.log()), launch.log()
        message = operator.switch(["0", "1"], [True, True])
        assert message != FINISH and message != "(no message)", message
        assert sim.job_view(JOB).replies == []  # no list was sent: the pause failed first
    finally:
        operator.close()
        (out / "join").touch()
    assert sim.job_view(JOB).violations == []


def test_join_timeout_is_validated_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan(["--world-size", "2", "--join-timeout", "30", "--", "true"]).join_timeout_s == 30.0
    assert plan(["--world-size", "2", "--", "true"]).join_timeout_s is None  # the agent's setting then
    for value in ("0", "-1", "inf", "nan", "1e20"):  # by the parser: the type of every duration flag
        with pytest.raises(SystemExit) as stopped:
            plan(["--world-size", "2", "--join-timeout", value, "--", "true"])
        assert stopped.value.code == 2
        assert f"argument --join-timeout: {value!r}" in capsys.readouterr().err
    for number in (0.0, math.inf, math.nan, 1e20):  # arguments built by hand: checked again
        args = argparse.Namespace(**{**vars(plan_args(["--world-size", "2", "--", "true"])), "join_timeout": number})
        with pytest.raises(launcher.LaunchError, match=re.escape(f"--join-timeout={number!r} must be a positive")):
            launcher.make_plan(args, {})


@pytest.mark.parametrize("setting", ["NICSWITCH_RECONNECT_MAX_S=2200000", "NICSWITCH_KEEPALIVE_TIME_S=1e20",
                                     "NICSWITCH_CONNECT_TIMEOUT_S=1e20", "NICSWITCH_MAX_MESSAGE_BYTES=3000000000"])
def test_a_setting_too_large_for_grpc_is_a_usage_error_before_the_command_starts(
        setting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It passed the checks, and the leader's start() died of gRPC's OverflowError."""
    variable, value = setting.split("=")
    monkeypatch.setenv(variable, value)
    marker = tmp_path / "ran"
    code = launcher.main(["--server", "127.0.0.1:1", "--job", "j", "--world-size", "2", "--",
                          sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists(), err
    assert f"nicswitch-agent launch: error: {variable}={value!r}: " in err and "must be at most" in err, err


# -- with plain children (the launcher's own behaviour, fast) -------------------------------------

# Every child: dump its NICSWITCH_* env, say it is ready, then idle in short sleeps (a signal landing
# between the last check and one long sleep's syscall would wait out the whole sleep). TRAP handles
# SIGTERM and picks its own exit code; DEFAULT dies of whatever signal comes.
PRELUDE = (
    "import json, os, signal, sys, time; from pathlib import Path; out = Path(sys.argv[1]); "
    "json.dump({k: v for k, v in os.environ.items() if k.startswith('NICSWITCH_')}, open(out / 'env.json', 'w')); "
)
TRAP = (PRELUDE + "signal.signal(signal.SIGTERM, lambda *a: ((out / 'got').write_text('TERM'), os._exit(7))); "
        "(out / 'ready').touch()\nwhile True: time.sleep(0.05)")
DEFAULT = PRELUDE + "(out / 'ready').touch()\nwhile True: time.sleep(0.05)"
EXIT = PRELUDE + "sys.exit(int(sys.argv[2]))"
PASS_THROUGH = ["--node-rank", "1", "--store-host", "127.0.0.1", "--store-port", "1"]  # no torch, no leader
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def wait_ready(launch: Launch, out: Path, timeout: float) -> None:
    assert poll(lambda: (out / "ready").exists() or launch.proc.poll() is not None, timeout), launch.log()
    assert launch.proc.poll() is None, launch.log()


@pytest.mark.timeout(90)
@pytest.mark.skipif(SYS_TGKILL is None or not Path("/proc/self/task").exists(), reason="needs Linux tgkill")
def test_first_node_exports_the_leader_and_forwards_a_signal_any_thread_took(sim: Simulator, tmp_path: Path,
                                                                           launches: list[Launch]) -> None:
    """The child learns where the leader is; a SIGTERM the kernel handed to one of the leader's threads
    (gRPC, Store, agent) still reaches the child, whose exit code the launcher returns after a clean stop.

    Python runs signal handlers on the main thread only, so a launcher parked in one long waitpid
    would not forward it until the child exited by itself (seen: over a minute).
    """
    import ctypes

    # No rank ever joins (the child runs no agent): --join-timeout lets the leader register at once.
    launch = Launch(tmp_path, ["--world-size", "2", "--join-timeout", "0.01", "--", sys.executable, "-c", TRAP,
                               str(tmp_path)], base_env(sim))
    launches.append(launch)
    wait_ready(launch, tmp_path, 60)
    env = json.loads((tmp_path / "env.json").read_text())
    host, _, port = env["NICSWITCH_STORE_ADDRESS"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert env["NICSWITCH_LEADER"] == "launcher"
    assert (env["NICSWITCH_SERVER"], env["NICSWITCH_JOB_ID"], env["NICSWITCH_PAUSE"]) == (sim.address, JOB, "agent")
    assert sim.wait_until(streams_ready, 20), sim.job_view(JOB).open_streams  # the leader is the ClusterD client
    with socket.create_connection(("127.0.0.1", int(port)), timeout=5):
        pass  # and the Store listens

    pid = launch.proc.pid
    others = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if int(t.name) != pid]
    assert others, "a launcher hosting a leader has threads besides the main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pid, others[-1], int(signal.SIGTERM)) == 0, ctypes.get_errno()
    assert launch.wait(20) == 7, "a SIGTERM taken by a non-main thread was not forwarded"
    assert (tmp_path / "got").read_text() == "TERM"
    log = launch.log()
    assert "hosting the job's leader" in log and "exited with 7" in log and "leader stopped" in log
    assert sim.wait_until(lambda s: not any(s.job_view(JOB).open_streams.values()), 10), "streams left open"
    assert sim.job_view(JOB).violations == []


@pytest.mark.timeout(60)
def test_the_children_get_the_world_size_the_leader_leads(sim: Simulator, tmp_path: Path,
                                                          launches: list[Launch]) -> None:
    """--world-size overrides an exported NICSWITCH_WORLD_SIZE for the training ranks too (as the
    server, job id and pause mode the leader resolved), not for the leader alone."""
    env = base_env(sim) | {"NICSWITCH_WORLD_SIZE": "3"}
    launch = Launch(tmp_path, ["--world-size", "2", "--join-timeout", "0.01", "--", sys.executable, "-c", EXIT,
                               str(tmp_path), "0"], env)
    launches.append(launch)
    assert launch.wait(60) == 0, launch.log()
    assert json.loads((tmp_path / "env.json").read_text())["NICSWITCH_WORLD_SIZE"] == "2"
    assert "2 rank(s)" in launch.log()


@pytest.mark.timeout(60)
def test_pass_through_node_starts_no_leader_and_points_at_the_first_node(sim: Simulator, tmp_path: Path,
                                                                        launches: list[Launch]) -> None:
    port = free_port()
    env = base_env(sim) | {"GROUP_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MINDX_TASK_ID": "from-mindx"}
    launch = Launch(tmp_path, ["--store-port", str(port), "--", sys.executable, "-c", EXIT, str(tmp_path), "0"], env)
    launches.append(launch)
    assert launch.wait(30) == 0
    child = json.loads((tmp_path / "env.json").read_text())
    assert child["NICSWITCH_LEADER"] == "launcher"
    assert child["NICSWITCH_STORE_ADDRESS"] == f"10.1.2.3:{port}"
    assert child["NICSWITCH_SERVER"] == sim.address and child["NICSWITCH_JOB_ID"] == JOB  # passed through as is
    assert "passing through (node rank 1 (GROUP_RANK))" in launch.log()
    assert "hosting" not in launch.log()
    assert sum(sim.job_view(JOB).stream_opens.values()) == 0  # no ClusterD client here
    with socket.socket() as s:  # and no Store either
        assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("command", "expected"), [
    ([sys.executable, "-c", EXIT, "{out}", "3"], 3),
    ([sys.executable, "-c", EXIT, "{out}", "0"], 0),
    (["/nonexistent/train"], 127),
])
def test_the_launcher_exits_with_the_child_exit_code(sim: Simulator, tmp_path: Path, launches: list[Launch],
                                                     command: list[str], expected: int) -> None:
    command = [str(tmp_path) if a == "{out}" else a for a in command]
    launch = Launch(tmp_path, [*PASS_THROUGH, "--", *command], base_env(sim))
    launches.append(launch)
    assert launch.wait(30) == expected, launch.log()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "script", "expected"), [
    (signal.SIGTERM, TRAP, 7),  # the child handles it and chooses its code
    (signal.SIGTERM, DEFAULT, 128 + signal.SIGTERM),  # the child dies of it: 128 + N, like a shell
    (signal.SIGHUP, DEFAULT, 128 + signal.SIGHUP),
    (signal.SIGINT, DEFAULT, 128 + signal.SIGINT),  # Python re-raises an unhandled Ctrl-C as the signal
], ids=["term-handled", "term", "hup", "int"])
def test_signals_are_forwarded_and_the_child_code_returned(sim: Simulator, tmp_path: Path, launches: list[Launch],
                                                           sig: int, script: str, expected: int) -> None:
    launch = Launch(tmp_path, [*PASS_THROUGH, "--", sys.executable, "-c", script, str(tmp_path)], base_env(sim))
    launches.append(launch)
    wait_ready(launch, tmp_path, 30)
    os.kill(launch.proc.pid, sig)
    assert launch.wait(30) == expected
    assert f"forwarding {signal.Signals(sig).name}" in launch.log()
    if script is TRAP:
        assert (tmp_path / "got").read_text() == "TERM"


# -- the plan (in-process) ----------------------------------------------------------------------


def plan_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(argv)


def plan(argv: list[str], env: dict[str, str] | None = None) -> launcher.Plan:
    return launcher.make_plan(plan_args(argv), env or {})


@pytest.mark.parametrize(("command", "world"), [
    (["torchrun", "--standalone", "--nproc-per-node", "2", "t.py"], 2),
    (["torchrun", "--nproc_per_node=4", "--nnodes", "2", "--master-port", "29500", "t.py", "--nnodes", "9"], 8),
    (["/usr/bin/torchrun", "--nnodes=3:3", "--nproc-per-node", "2", "--master-port", "29500", "t.py"], 6),
    (["python3", "-m", "torch.distributed.run", "--nproc-per-node", "3", "t.py"], 3),
    (["python", "-u", "-mtorch.distributed.launch", "--use-env", "--nproc_per_node", "2", "t.py"], 2),
])
def test_world_size_is_derived_from_torchrun_as_torchrun_counts(command: list[str], world: int) -> None:
    p = plan(["--", *command])
    assert p.hosts_leader and p.world_size == world and p.command == command


def test_world_size_flag_and_env_win_over_the_command() -> None:
    command = ["--", "torchrun", "--standalone", "--nproc-per-node", "2", "t.py"]
    assert plan(["--world-size", "5", *command]).world_size == 5
    assert plan(command, {"NICSWITCH_WORLD_SIZE": "2"}).world_size == 2  # agrees with torchrun's count
    assert plan(["--store-port", "7", "--", "torchrun", "--nnodes", "1:2", "--nproc-per-node", "2", "t.py"],
                {"NICSWITCH_WORLD_SIZE": "6"}).world_size == 6  # elastic: torchrun's count is not fixed
    # An exported N the command does not start: every rank would refuse it once training began
    # (found by an outside check); before the command starts, a usage error
    with pytest.raises(launcher.LaunchError,
                       match=r"^NICSWITCH_WORLD_SIZE=6 disagrees with the 2 rank\(s\) the command starts; unset it"):
        plan(command, {"NICSWITCH_WORLD_SIZE": "6"})
    assert plan(["--", "torchrun", "t.py"], {"PET_NPROC_PER_NODE": "4"}).world_size == 4  # torchrun's own env


def test_the_ranks_are_told_the_world_size_the_leader_leads() -> None:
    """Whatever N the leader leads reaches the ranks as NICSWITCH_WORLD_SIZE: an exported one that
    --world-size overrode would make every rank refuse torch's world size (after training began)."""
    command = ["--", "torchrun", "--standalone", "--nproc-per-node", "2", "t.py"]
    assert plan(["--world-size", "2", *command], {"NICSWITCH_WORLD_SIZE": "3"}).env["NICSWITCH_WORLD_SIZE"] == "2"
    assert plan(command, {"NICSWITCH_WORLD_SIZE": "2"}).env["NICSWITCH_WORLD_SIZE"] == "2"  # the user's, as led
    assert plan(command).env["NICSWITCH_WORLD_SIZE"] == "2"  # torchrun's count
    # Other nodes lead nothing: the flag only, as --server and --job.
    other = ["--node-rank", "1", "--store-host", "h", "--store-port", "1"]
    assert "NICSWITCH_WORLD_SIZE" not in plan([*other, *command], {"NICSWITCH_WORLD_SIZE": "3"}).env
    assert plan([*other, "--world-size", "2", *command]).env["NICSWITCH_WORLD_SIZE"] == "2"


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--store-host", "bad host"], {}, "NICSWITCH_STORE_ADDRESS='bad host:1234': 'bad host' is not a host name or IP "
                                       "address"),
    ([], {"MASTER_ADDR": "http://x"}, "NICSWITCH_STORE_ADDRESS='http://x:1234': give host:port without a scheme"),
    ([], {"MASTER_ADDR": "10.0.0.300"}, "'10.0.0.300' is not an IPv4 address"),
], ids=["store-host", "master-addr-url", "master-addr-ipv4"])
def test_a_store_host_the_ranks_would_refuse_is_a_usage_error(argv: list[str], env: dict[str, str],
                                                              message: str) -> None:
    """The address a passing-through node exports is read by the agent's own parser, as every rank
    would read it: refused before the command starts, naming where the host came from."""
    source = "--store-host='bad host'" if argv else f"MASTER_ADDR={env['MASTER_ADDR']!r}"
    with pytest.raises(launcher.LaunchError) as refused:
        plan(["--node-rank", "1", "--store-port", "1234", *argv, "--", "python", "t.py"], env)
    assert message in str(refused.value) and f"its host from {source})" in str(refused.value)


@pytest.mark.parametrize("role", [["--node-rank", "1", "--store-port", "1234"],
                                  ["--world-size", "1", "--server", "127.0.0.1:1", "--job-id", "j"]],
                         ids=["other-node", "first-node"])
def test_a_bad_store_host_exits_2_before_the_command_starts(role: list[str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """On the first node --store-host is the address its own ranks dial: checked once the Store's port is known."""
    marker = tmp_path / "ran"
    assert launcher.main([*role, "--store-host", "bad host", "--", "touch", str(marker)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), err
    assert "error: NICSWITCH_STORE_ADDRESS='bad host:" in err and "'bad host' is not a host name" in err, err


@pytest.mark.parametrize(("env", "needle"), [
    ({"NICSWITCH_SWITCH_TIMEOUT_S": "604801"}, "NICSWITCH_SWITCH_TIMEOUT_S='604801': switch_timeout_s=604801.0 must be "
                                               "at most 604800 s (7 days)"),
    ({"NICSWITCH_PAUSE": "sometimes"}, "NICSWITCH_PAUSE='sometimes'"),
])
def test_a_passing_through_node_refuses_a_setting_its_ranks_would(
        env: dict[str, str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the first node does (it builds the leader's config): exit 2 before the command starts,
    not every rank failing once training began (found by an outside check)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    marker = tmp_path / "ran"
    assert launcher.main(["--node-rank", "1", "--store-host", "10.0.0.1", "--store-port", "1234", "--", "touch",
                          str(marker)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), err
    assert "nicswitch-agent launch: error: the training ranks' settings: " in err and needle in err, err


def test_a_passing_through_node_with_good_settings_runs_the_command(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith(("NICSWITCH_", "MINDX_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RANK", "7")  # the pod's own, torchrun replaces it per worker: not checked here
    monkeypatch.setenv("WORLD_SIZE", "2")
    marker = tmp_path / "ran"
    assert launcher.main(["--node-rank", "1", "--store-host", "10.0.0.1", "--store-port", "1234", "--", "touch",
                          str(marker)]) == 0
    assert marker.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--", "python", "train.py"], "not torchrun"),
    (["--", "bash", "-c", "torchrun --nproc-per-node 2 t.py"], "pass --world-size"),
    (["--", "torchrun", "--nnodes", "1:4", "--nproc-per-node", "2", "--master-port", "1", "t.py"], "elastic"),
    (["--", "torchrun", "--nproc-per-node", "many", "t.py"], "--nproc-per-node=many"),
    (["--", "torchrun", "--no-such-option", "t.py"], "cannot read the torchrun options"),
    (["--leader-only", "--", "torchrun", "--nproc-per-node", "2", "t.py"], "--leader-only does not read"),
    (["--", "torchrun", "--nnodes", "2", "--nproc-per-node", "2", "t.py"], "fixed Store port"),
    (["--node-rank", "1", "--", "python", "t.py"], "--store-port"),
    (["--node-rank", "1", "--store-port", "29501", "--", "python", "t.py"], "--store-host"),
    ([], "no training command"),
    (["--world-size", "0", "--", "python", "t.py"], "at least 1"),
])
def test_what_cannot_be_derived_is_a_clear_usage_error(argv: list[str], message: str) -> None:
    with pytest.raises(launcher.LaunchError, match=message.replace("-", r"\-")):
        plan(argv)


def test_usage_errors_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["--", "python", "train.py"]) == 2
    assert "pass --world-size N" in capsys.readouterr().err


def test_node_role_and_store_address() -> None:
    torchrun = ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--master-addr", "10.0.0.1",
                "--master-port", "29500", "t.py"]
    first = plan(["--", *torchrun, "--node-rank", "1"])  # after the script: the script's own argument
    assert first.hosts_leader and first.world_size == 16 and first.store_port == 29501
    other = plan(["--", torchrun[0], "--node-rank", "1", *torchrun[1:]])
    assert not other.hosts_leader and other.world_size is None
    assert other.env == {"NICSWITCH_LEADER": "launcher", "NICSWITCH_STORE_ADDRESS": "10.0.0.1:29501",
                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NICSWITCH_LOCAL_WORLD_SIZE": "8"}
    # The ranks are told the ranks per node the leader is told (node-local fan-out must agree) ...
    assert first.local_world_size == 8 and first.env["NICSWITCH_LOCAL_WORLD_SIZE"] == "8"
    # ... unless the user chose them (fan-out rehearsed on one machine): then the choice is everyone's ...
    chosen = plan(["--", *torchrun, "--node-rank", "1"], {"NICSWITCH_LOCAL_WORLD_SIZE": "2"})
    assert chosen.local_world_size == 2 and chosen.env["NICSWITCH_LOCAL_WORLD_SIZE"] == "2"
    with pytest.raises(launcher.LaunchError, match=r"NICSWITCH_LOCAL_WORLD_SIZE='two' is not a number of ranks"):
        plan(["--", *torchrun], {"NICSWITCH_LOCAL_WORLD_SIZE": "two"})
    # ... and where the launcher cannot tell, every rank coordinates flat, as the leader does.
    assert plan(["--world-size", "2", "--", "python", "t.py"]).env["NICSWITCH_FAN_OUT"] == "flat"
    assert "NICSWITCH_FAN_OUT" not in plan(["--world-size", "2", "--", "python", "t.py"],
                                           {"NICSWITCH_FAN_OUT": "node"}).env
    env = {"NODE_RANK": "2", "MASTER_ADDR": "fd00::1", "MASTER_PORT": "40000"}
    assert plan(["--", "python", "t.py"], env).env["NICSWITCH_STORE_ADDRESS"] == "[fd00::1]:40001"
    assert plan(["--node-rank", "0", "--world-size", "2", "--", "python", "t.py"], env).hosts_leader
    assert plan(["--", "torchrun", "--standalone", "t.py"], {"MASTER_PORT": "40000"}).store_port == 0  # any free
    leader_only = plan(["--leader-only", "--world-size", "4", "--job-id", "j", "--", "python", "t.py"], env)
    assert leader_only.hosts_leader and leader_only.store_port == 40001 and leader_only.env["NICSWITCH_JOB_ID"] == "j"
    assert plan(["--", "torchrun", "--nnodes=4", "--rdzv-endpoint", "h1:29400", "--node-rank", "3", "t.py"]).env[
        "NICSWITCH_STORE_ADDRESS"] == "h1:29401"


@pytest.mark.parametrize("role", [
    ["--world-size", "2"],
    ["--node-rank", "1", "--store-host", "h", "--store-port", "1"],
], ids=["first-node", "other-node"])
def test_torchrun_restarts_get_a_fresh_store_unless_the_user_chose(role: list[str]) -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 goes to the child on every node; a value the user set
    (even "0" or empty) is left alone: the child then inherits it from the launcher's environment."""
    command = ["--", "torchrun", "--standalone", "--nproc-per-node", "2", "t.py"]
    assert plan([*role, *command]).env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    for chosen in ("0", "1", ""):
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": chosen}
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan([*role, *command], env).env


# -- msrun (MindSpore): the leader hosts MindSpore's TCPStore (ops/launch_msrun.py) -----------------


def test_an_msrun_command_is_a_mindspore_job_read_as_msrun_reads_it() -> None:
    one_node = plan(["--", "msrun", "--worker_num", "4", "--local_worker_num=4", "--log_dir", "logs", "t.py",
                     "--worker_num", "9"])  # after the script: the script's own argument
    assert (one_node.framework, one_node.world_size, one_node.local_world_size, one_node.store_port) == (
        "mindspore", 4, 4, 0)
    assert one_node.env == {"NICSWITCH_LEADER": "launcher", "NICSWITCH_FRAMEWORK": "mindspore",
                            "NICSWITCH_WORLD_SIZE": "4", "NICSWITCH_LOCAL_WORLD_SIZE": "4"}  # no torchrun variable
    msrun = ["msrun", "--worker_num", "16", "--local_worker_num", "8", "--master_addr", "10.0.0.1",
             "--master_port", "8200"]
    first = plan(["--", *msrun, "--node_rank", "0", "t.py"])
    assert first.hosts_leader and (first.world_size, first.store_port) == (16, 8201)
    other = plan(["--", *msrun, "--node_rank", "1", "t.py"])
    assert not other.hosts_leader and other.why == "node rank 1 (the msrun --node_rank)"
    assert other.env["NICSWITCH_STORE_ADDRESS"] == "10.0.0.1:8201"
    defaults = plan(["--", "python3", "-m", "mindspore.parallel.cluster.run", "--local_worker_num", "8", "t.py"],
                    {"NODE_RANK": "1"})  # msrun's defaults: 8 workers, scheduler at 127.0.0.1:8118
    assert defaults.framework == "mindspore" and defaults.env["NICSWITCH_STORE_ADDRESS"] == "127.0.0.1:8119"
    assert plan(["--world-size", "3", "--", "python", "t.py"], {"NICSWITCH_FRAMEWORK": "mindspore"}).framework == (
        "mindspore")
    assert plan(["--", "msrun", "--worker_num", "2", "t.py"], {"NICSWITCH_FRAMEWORK": "torch"}).framework == "torch"
    with pytest.raises(launcher.LaunchError, match="cannot read the msrun options"):
        plan(["--", "msrun", "--no_such_option", "1", "t.py"])


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is not None, reason="MindSpore is installed here")
def test_an_msrun_job_without_mindspore_in_the_launcher_is_refused_before_it_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = launcher.main(["--server", "127.0.0.1:1", "--job-id", "j", "--", "msrun", "--worker_num", "2",
                          "--local_worker_num", "2", "touch", str(marker)])
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists(), err
    assert "this is a MindSpore job (msrun, or NICSWITCH_FRAMEWORK=mindspore)" in err
    assert "python3 -m pip install '.[mindspore]'" in err


@pytest.mark.timeout(300)
def test_a_rank_that_dies_during_the_pause_fails_it_at_once_through_its_restarted_process(
        sim: Simulator, tmp_path: Path, launches: list[Launch]) -> None:
    """Rank 1 SIGKILLs itself when it hears of the pause, before it parks; torchrun stops rank 0 and
    restarts both, which start after the pause's events and will never park in it. Rank 0's agent
    stopping, or a new process joining, fails the pause at once (coordination/joining.py). Before,
    the leader waited out pause_timeout_s (five minutes: longer than this test may run) with
    ClusterD answering "busy" to every other request."""
    out, launch, operator = _two_ranks_training(sim, tmp_path, launches, "--die-at-pause", "1")
    try:
        message = operator.switch(["1", "0"], [True, True], timeout=240)
        assert (out / "died").exists()
        log = launch.log()
        # torchrun stops rank 0 (SIGTERM: its agent stops and says so) and restarts both ranks (the first
        # new process to join says so): whichever comes first fails the pause, naming its rank.
        assert re.search(r"pause failed: .*; rank [01]: its (process was restarted during the pause \(pid \d+ "
                         r"replaced by pid \d+\)|agent stopped during the pause \(pid \d+\))", log), log[-3000:]
        assert message != "(no message)", message
        assert sim.job_view(JOB).violations == []
    finally:
        operator.close()
