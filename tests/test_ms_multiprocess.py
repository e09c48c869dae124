"""Real MindSpore jobs: 4 processes, one agent each, MindSpore's TCPStore, the ClusterD simulator.

Each rank is a process running tests/ms_job/worker.py with msrun's environment (MS_ROLE,
MS_WORKER_NUM, RANK_ID): rank 0 hosts the job's MindSpore TCPStore and every rank passes its
TCPStore to the agent (no torch in the workers: the framework is auto-detected). This process runs
the simulator and plays the operator; in pause mode external it also plays MindIO. Run in CI's
MindSpore step (``mindspore==2.10.0`` pinned); skipped without MindSpore.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import free_port, poll, read_jsonl

if importlib.util.find_spec("mindspore") is None:
    pytest.skip("MindSpore is not installed (CI's MindSpore step installs mindspore==2.10.0)", allow_module_level=True)

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.sim import MindIOStandIn, SimJob, SimSettings, Simulator
from nicswitch_agent.sim import codes as P

ROOT = Path(__file__).resolve().parent.parent
JOB = "job-ms-mp"
FAST = SimSettings(report_timeout_s=60.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
FINISH = "switch nic finish"
WORLD = 4
SCRUB_PREFIXES = ("NICSWITCH_", "NSW_", "PYTEST_", "MINDX_", "MS_", "HCCL_")
SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK_ID", "RANK_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TTP_PORT", "TASKD_PROCESS_ENABLE", "LOCAL_PROXY_ENABLE")

pytestmark = pytest.mark.timeout(180)


class Job:
    def __init__(self, sim: Simulator, out: Path, *, pause: str, env: dict[str, str] | None = None) -> None:
        self.out = out
        out.mkdir(parents=True)
        store_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._files: list[Any] = []
        for rank in range(WORLD):
            child = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_NAMES}
            child.update({
                "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": str(WORLD), "RANK_ID": str(rank), "GLOG_v": "3",
                "NICSWITCH_SERVER": sim.address, "NICSWITCH_JOB_ID": JOB, "NICSWITCH_PAUSE": pause,
                "NICSWITCH_RECONNECT_INITIAL_S": "0.02", "NICSWITCH_RECONNECT_MAX_S": "0.1",
                "NSW_OUT": str(out), "NSW_STORE_PORT": str(store_port), "PYTHONUNBUFFERED": "1",
                "GRPC_ENABLE_FORK_SUPPORT": "false",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), child.get("PYTHONPATH", "")])),
                **(env or {}),
            })
            stdout = open(out / f"rank{rank}.stdout", "wb")  # noqa: SIM115 - closed in close()
            stderr = open(out / f"rank{rank}.stderr", "wb")  # noqa: SIM115
            self._files += [stdout, stderr]
            self.procs.append(subprocess.Popen([sys.executable, "-m", "tests.ms_job.worker"], cwd=ROOT, env=child,
                                               stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                               start_new_session=True))

    def steps(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.out / f"rank{rank}.steps.jsonl")

    def hooks(self, rank: int, kind: str) -> list[dict[str, Any]]:
        return [h for h in read_jsonl(self.out / f"rank{rank}.hooks.jsonl") if h["kind"] == kind]

    def last_step(self, rank: int) -> int:
        steps = self.steps(rank)
        return int(steps[-1]["step"]) if steps else 0

    def wait_steps(self, minimum: int, timeout: float = 90.0) -> None:
        def ok() -> bool:
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise AssertionError(f"rank {rank} exited with {proc.returncode}:\n{self.log(rank)[-3000:]}")
            return all(self.last_step(r) >= minimum for r in range(WORLD))

        assert poll(ok, timeout), [self.last_step(r) for r in range(WORLD)]

    def log(self, rank: int) -> str:
        return (self.out / f"rank{rank}.stderr").read_text(encoding="utf-8", errors="replace")

    def stop(self, timeout: float = 60.0) -> list[int | None]:
        (self.out / "stop").touch()
        poll(lambda: all(p.poll() is not None for p in self.procs), timeout)
        return [p.poll() for p in self.procs]

    def close(self) -> None:
        (self.out / "stop").touch()
        poll(lambda: all(p.poll() is not None for p in self.procs), 10)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                print(f"!!!!! rank {rank} still running at teardown")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for f in self._files:
            f.close()
        for rank in range(WORLD):
            print(f"===== rank {rank}: exit {self.procs[rank].poll()}\n" + "\n".join(self.log(rank).splitlines()[-40:]))


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.sim: Simulator | None = None
        self.job: Job | None = None
        self.standin: MindIOStandIn | None = None
        self.channel: Any = None

    def start(self, pause: str, *, framework: str = P.MINDSPORE, strategies: tuple[str, ...] = ("recover", "dump"),
              env: dict[str, str] | None = None) -> tuple[Simulator, Job]:
        self.sim = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": [str(d) for d in range(WORLD)]},
                                          recover_strategies=strategies, framework=framework)], settings=FAST)
        self.sim.start()
        self.channel = open_channel(ChannelSettings(target=self.sim.address))
        if pause == "external":
            self.standin = MindIOStandIn(self.sim.address, JOB)
            self.standin.start()
            assert self.standin.ready.wait(10)
        self.job = Job(self.sim, self.tmp_path / "job", pause=pause, env=env)
        return self.sim, self.job

    def switch(self, devs: list[str], ops: list[bool], timeout: float = 90.0) -> str:
        assert self.sim is not None
        assert self.sim.wait_until(lambda s: support.idle(s, JOB), 30), self.sim.job_view(JOB).state
        stub = RecoverStub(self.channel)
        message = pb.SwitchNics(jobID=JOB)
        message.nicOps["node-0"].dev.extend(devs)
        message.nicOps["node-0"].op.extend(ops)
        assert stub.SwitchNicTrack(message, timeout=5).code == 0
        for response in stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=timeout):
            return str(response.msg)
        return "(no message)"

    def close(self) -> None:
        if self.job is not None:
            self.job.close()
        if self.standin is not None:
            self.standin.stop()
        if self.channel is not None:
            self.channel.close()
        if self.sim is not None:
            self.sim.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


# Node-local fan-out over MindSpore TCPStores: 2 nodes of 2 ranks, local rank 0 hosts its node's Store.
NODES = {"NICSWITCH_LOCAL_WORLD_SIZE": "2", "NICSWITCH_FAN_OUT": "node"}


@pytest.mark.parametrize(("pause", "env"), [("agent", {}), ("external", {}), ("agent", NODES)],
                         ids=["agent", "external", "agent-node-fan-out"])
def test_four_mindspore_processes_switch_twice_one_reply_each(cluster: Cluster, pause: str,
                                                              env: dict[str, str]) -> None:
    sim, job = cluster.start(pause, env=env)
    job.wait_steps(3)
    assert sim.wait_until(lambda s: support.streams_ready(s, JOB), 30)
    devs, rounds = ["3", "0"], [[True, False], [False, False]]
    for ops in rounds:
        assert cluster.switch(devs, ops) == FINISH
    job.wait_steps(max(job.last_step(r) for r in range(WORLD)) + 10)  # training goes on
    assert job.stop() == [0] * WORLD
    view = sim.job_view(JOB)
    assert view.replies == [True, True]  # one reply per list
    assert view.violations == []
    for seq, ops in enumerate(rounds, start=1):
        calls = {rank: [c for c in job.hooks(rank, "switch") if c["seq"] == seq] for rank in range(WORLD)}
        assert all(len(c) == 1 for c in calls.values()), calls
        assert {(tuple(c[0]["ranks"]), tuple(c[0]["ops"])) for c in calls.values()} == {((3, 0), tuple(ops))}
        guards = {rank: [g for g in job.hooks(rank, "guard") if g["seq"] == seq] for rank in range(WORLD)}
        assert all(len(g) == 1 for g in guards.values()), guards
        if pause == "agent":  # parked on the training thread, every rank at the same step
            assert all(c[0]["thread"] == f"train-{r}" for r, c in calls.items())
            assert len({c[0]["step"] for c in calls.values()}) == 1, calls
        else:
            assert all(c[0]["thread"].startswith("nicswitch-switch-") for c in calls.values())
    for rank in range(WORLD):  # the first switch's checkpoint, by mindspore.save_checkpoint
        first = next(g for g in job.hooks(rank, "guard") if g["seq"] == 1)
        assert first["saved"] and (Path(first["path"]) / "state.ckpt").is_file(), first
        result = json.loads((job.out / f"rank{rank}.result.json").read_text(encoding="utf-8"))
        assert result["agent"]["parked"] is False
    if env is NODES:
        assert "relays for its node" in job.log(0) and "relays for its node" in job.log(2), job.log(2)[-2000:]


def picks(sim: Simulator) -> list[str]:
    """ClusterD's strategy choices (as tests/test_recovery_strategies.py reads them)."""
    return [s.changeStrategy for s in sim.job_view(JOB).signals_sent
            if s.signalType == "changeStrategy" and not s.extraParams and s.changeStrategy != "continue"]


def test_a_failed_switch_of_a_mindspore_job_ends_in_exit_not_dump(cluster: Cluster) -> None:
    """ClusterD's MindSpore path: a job whose PodGroup allows only ``dump`` gets ``exit`` after a
    failed switch (``handleDecidedStrategyAfterChoose``); every rank stops training."""
    sim, job = cluster.start("agent", strategies=("dump",), env={"NSW_FAIL_RANK": "2"})
    job.wait_steps(3)
    assert sim.wait_until(lambda s: support.streams_ready(s, JOB), 30)
    assert cluster.switch(["3", "0"], [True, False]) != FINISH
    assert sim.wait_until(lambda s: picks(s) != [], 30)
    assert picks(sim) == [P.EXIT]
    assert sim.job_view(JOB).replies == [False]
    assert poll(lambda: all(p.poll() is not None for p in job.procs), 60)
    assert [p.poll() for p in job.procs] == [3] * WORLD  # TrainingStopped on every rank
    for rank in range(WORLD):
        result = json.loads((job.out / f"rank{rank}.result.json").read_text(encoding="utf-8"))
        assert "ClusterD chose exit" in result["reason"], result
    assert sim.job_view(JOB).violations == []


def _msrun_logs(log_dir: Path, own: Path) -> str:
    """What msrun (or the launcher around it) and each process it started wrote, the end of each,
    read when a check fails: a process that died at exit says so only at the end of its log."""
    files = [own, *sorted(log_dir.glob("*.log"))]
    return "".join(f"\n== {path.name}\n" + path.read_text(errors="replace")[-4000:]
                   for path in files if path.exists())


def test_under_msrun_the_scheduler_process_is_no_rank(tmp_path: Path) -> None:
    """Real msrun (2 workers on CPU): its scheduler process runs the script too, with MS_ROLE=MS_SCHED
    and RANK_ID=0; there the agent starts nothing, while the two workers are rank 0 (the leader,
    registered once with the simulator) and rank 1."""
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists():
        pytest.skip(f"no msrun beside {sys.executable}")
    out = tmp_path / "out"
    out.mkdir()
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]}, framework=P.MINDSPORE)],
                   settings=FAST) as sim:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_NAMES}
        env.update({"NICSWITCH_SERVER": sim.address, "NICSWITCH_JOB_ID": JOB, "NSW_OUT": str(out),
                    "NSW_STORE_PORT": str(free_port()), "GLOG_v": "3", "PYTHONUNBUFFERED": "1",
                    "PYTHONFAULTHANDLER": "1",  # a crash at exit says where
                    "PATH": os.pathsep.join([str(msrun.parent), env.get("PATH", "")]),  # msrun runs "python"
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))})
        with open(tmp_path / "msrun.log", "wb") as log:
            proc = subprocess.Popen([str(msrun), "--worker_num", "2", "--local_worker_num", "2", "--master_port",
                                     str(free_port()), "--log_dir", str(tmp_path / "logs"), "--join", "True",
                                     str(ROOT / "tests" / "ms_job" / "msrun_start.py")],
                                    cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
        try:
            def statuses() -> dict[str, dict[str, Any]] | None:
                found = {p.name.split(".")[0]: json.loads(p.read_text(encoding="utf-8")) for p in out.glob("*.json")}
                return found if len(found) == 3 else None

            found = poll(lambda: statuses() or proc.poll() is not None, 90) and statuses()
            assert found, f"msrun exit {proc.poll()}" + _msrun_logs(tmp_path / "logs", tmp_path / "msrun.log")
            assert poll(lambda: sim.job_view(JOB).registered, 30)
            (out / "stop").touch()
            code = proc.wait(60)
            logs = _msrun_logs(tmp_path / "logs", tmp_path / "msrun.log")
            assert code == 0, f"msrun exit {code}" + logs  # a str: pytest cuts a tuple's repr
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    sched = found["scheduler"]
    assert (sched["state"], sched["role"], sched["rank"]) == ("inactive", None, None), sched
    assert "MS_ROLE=MS_SCHED" in sched["reason"]
    assert [(found[f"rank{r}"]["role"], found[f"rank{r}"]["rank"]) for r in (0, 1)] == [("leader", 0), ("member", 1)]
    assert sim.job_view(JOB).violations == []
    scheduler_log = (tmp_path / "logs" / "scheduler.log").read_text(errors="replace")
    assert scheduler_log.count("nicswitch-agent inactive: msrun's scheduler process") == 1, scheduler_log[-2000:]


def test_nicswitch_agent_launch_around_msrun_hosts_a_mindspore_store(tmp_path: Path) -> None:
    """``nicswitch-agent launch -- msrun ...``: the launcher reads msrun's options (2 workers), hosts
    MindSpore's TCPStore and the leader; the two workers (no store passed) are members on it, the
    scheduler process starts nothing; a switch runs on both ranks, one reply."""
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists():
        pytest.skip(f"no msrun beside {sys.executable}")
    out = tmp_path / "out"
    out.mkdir()
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]}, framework=P.MINDSPORE)],
                   settings=FAST) as sim:
        env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_NAMES}
        env.update({"NSW_OUT": str(out), "GLOG_v": "3", "PYTHONUNBUFFERED": "1", "NICSWITCH_PAUSE": "agent",
                    "PYTHONFAULTHANDLER": "1",  # a crash at exit says where
                    "NICSWITCH_RECONNECT_INITIAL_S": "0.02", "NICSWITCH_RECONNECT_MAX_S": "0.1",
                    "PATH": os.pathsep.join([str(msrun.parent), env.get("PATH", "")]),  # msrun runs "python"
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))})
        log = open(tmp_path / "launch.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "launch", "--server", sim.address,
                                 "--job-id", JOB, "--", str(msrun), "--worker_num", "2", "--local_worker_num", "2",
                                 "--master_port", str(free_port()), "--log_dir", str(tmp_path / "logs"),
                                 "--join", "True", str(ROOT / "tests" / "ms_job" / "msrun_start.py")],
                                cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)

        def logs() -> str:
            return _msrun_logs(tmp_path / "logs", tmp_path / "launch.log")

        try:
            assert poll(lambda: support.streams_ready(sim, JOB) or proc.poll() is not None, 90), logs()
            assert proc.poll() is None, logs()
            message = support.operator_switch(sim.address, JOB, ["1", "0"], [True, False])
            assert message == FINISH, logs()
            (out / "stop").touch()
            assert proc.wait(60) == 0, logs()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            log.close()
        view = sim.job_view(JOB)
        assert view.replies == [True] and view.violations == [], logs()
    found = {p.name.split(".")[0]: json.loads(p.read_text(encoding="utf-8")) for p in out.glob("*.json")}
    assert sorted(found) == ["rank0", "rank1", "scheduler"], found
    assert [(found[f"rank{r}"]["role"], found[f"rank{r}"]["rank"]) for r in (0, 1)] == [("member", 0), ("member", 1)]
    assert found["scheduler"]["state"] == "inactive"
    for rank in (0, 1):
        calls = read_jsonl(out / f"rank{rank}.switch.jsonl")
        assert [(c["ranks"], c["ops"]) for c in calls] == [([1, 0], [True, False])], calls
    assert "a MindSpore Store on port" in (tmp_path / "launch.log").read_text(errors="replace")
