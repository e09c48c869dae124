"""Real multi-process jobs: torch (CPU, gloo), 2-4 ranks, one agent per process, the ClusterD simulator.

Each rank is its own Python process running tests/torch_job/worker.py: nn.Linear(8, 1) trained by
full-batch gradient descent with one all_reduce per step, ``agent.step(step)`` at every step
boundary, the job's TCPStore (rank 0 hosts it) as the agents' coordination channel, a recording
switch hook (or the default TorchNpuSwitcher over a fake torch_npu) and TorchCheckpointGuard
(torch.save per rank; its torch.distributed.checkpoint mode in one test, which needs numpy).
This process runs the simulator and plays the operator (SwitchNicTrack + SubscribeSwitchNicSignal);
in pause mode external it also plays MindIO (MindIOStandIn), which acknowledges pauses without
stopping training, so there the hooks run while training goes on.

Two library bugs this file found are regression-tested (KnownBug marks the check that caught each:
STALE_WORK and MEMBER_STOP_BLOCKS describe them; both are fixed in coordination/member.py).

Synchronisation with the workers is by polling files and simulator state with deadlines; every
process runs in its own session and is killed with its group at teardown. Worker logs are printed
at teardown (pytest shows them for failed tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import support
from support import StreamWatch, free_port, poll, read_jsonl

pytest.importorskip("torch")

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.sim import MindIOStandIn, SimJob, SimSettings, Simulator

ROOT = Path(__file__).resolve().parent.parent
FAKE_TORCH_NPU = Path(__file__).resolve().parent / "torch_job" / "fake_torch_npu"
JOB = "job-torch-mp"
FAST = SimSettings(report_timeout_s=60.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
FINISH = "switch nic finish"
FAILED = "switch nic failed, switch nic failed"
EXIT_DONE, EXIT_STOPPED = 0, 3  # worker exit codes (4: an error, 5: could not start)
# Never leak the machine's launcher, MindCluster or agent settings into a worker.
SCRUB_PREFIXES = ("NICSWITCH_", "NSW_", "PYTEST_", "TORCHELASTIC_", "MINDX_", "FAKE_TORCH_NPU_", "HCCL_")
SCRUB_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TTP_PORT", "TASKD_PROCESS_ENABLE", "LOCAL_PROXY_ENABLE")


class Job:
    """A world of worker processes, their files, and the operator's view of them."""

    def __init__(self, sim: Simulator, out: Path, world: int, *, pause: str = "agent",
                 env: dict[str, str] | None = None, per_rank_env: dict[int, dict[str, str]] | None = None,
                 local_world: int | None = None, path: list[Path] | None = None) -> None:
        self.sim, self.out, self.world, self.pause = sim, out, world, pause
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.started = time.monotonic()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._files: list[Any] = []
        for rank in range(world):
            child = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB_PREFIXES) and k not in SCRUB_NAMES}
            python_path = [str(p) for p in [*(path or []), ROOT]] + [child.get("PYTHONPATH", "")]
            child.update({
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % (local_world or world)),
                "LOCAL_WORLD_SIZE": str(local_world or world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "NICSWITCH_SERVER": sim.address, "NICSWITCH_JOB_ID": JOB, "NICSWITCH_PAUSE": pause,
                "NICSWITCH_RECONNECT_INITIAL_S": "0.02", "NICSWITCH_RECONNECT_MAX_S": "0.1",
                "TORCH_CPP_LOG_LEVEL": "ERROR", "GRPC_ENABLE_FORK_SUPPORT": "false", "PYTHONUNBUFFERED": "1",
                "NSW_OUT": str(out), "PYTHONPATH": os.pathsep.join(filter(None, python_path)),
            })
            child.update(env or {})
            child.update({k: v.format(out=out) for k, v in (per_rank_env or {}).get(rank, {}).items()})
            stdout = open(out / f"rank{rank}.stdout", "wb")  # noqa: SIM115 - closed in close()
            stderr = open(out / f"rank{rank}.stderr", "wb")  # noqa: SIM115
            self._files += [stdout, stderr]
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.torch_job.worker"], cwd=ROOT, env=child, stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=stderr, start_new_session=True,
            ))

    # -- files -----------------------------------------------------------------------------------

    def steps(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.out / f"rank{rank}.steps.jsonl")

    def hooks(self, rank: int, kind: str = "switch") -> list[dict[str, Any]]:
        return [h for h in read_jsonl(self.out / f"rank{rank}.hooks.jsonl") if h["kind"] == kind]

    def events(self, rank: int, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.out / f"rank{rank}.events.jsonl") if kind is None or e["kind"] == kind]

    def result(self, rank: int) -> dict[str, Any]:
        return dict(json.loads((self.out / f"rank{rank}.result.json").read_text(encoding="utf-8")))

    def log(self, rank: int) -> str:
        path = self.out / f"rank{rank}.stderr"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def last_step(self, rank: int) -> int:
        steps = self.steps(rank)
        return int(steps[-1]["step"]) if steps else 0

    # -- waiting ---------------------------------------------------------------------------------

    def wait_steps(self, minimum: int, timeout: float = 60.0, ranks: list[int] | None = None) -> None:
        """Every rank (alive) has completed at least ``minimum`` steps."""
        ranks = list(range(self.world)) if ranks is None else ranks

        def ok() -> bool:
            for rank in ranks:
                if self.procs[rank].poll() is not None:
                    raise AssertionError(f"rank {rank} exited with {self.procs[rank].returncode} before step {minimum}")
            return all(self.last_step(r) >= minimum for r in ranks)

        assert poll(ok, timeout), f"ranks {ranks} did not reach step {minimum}: {[self.last_step(r) for r in ranks]}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every rank trains and the leader holds its ClusterD streams."""
        self.wait_steps(3, timeout)
        assert self.sim.wait_until(streams_ready, 20), f"streams not ready: {self.sim.job_view(JOB).open_streams}"
        print(f"{self.world} ranks training {time.monotonic() - self.started:.1f} s after their start")

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """Ask every rank to finish (they agree on the step through the all_reduce) and wait."""
        (self.out / "stop").touch()
        started = time.monotonic()
        codes = self.wait_exit(timeout)
        print(f"stop: exit codes {codes} after {time.monotonic() - started:.1f} s")
        return codes

    def wait_exit(self, timeout: float, ranks: list[int] | None = None) -> list[int | None]:
        ranks = list(range(self.world)) if ranks is None else ranks
        poll(lambda: all(self.procs[r].poll() is not None for r in ranks), timeout)
        return [self.procs[r].poll() for r in ranks]

    def kill(self, rank: int) -> None:
        os.killpg(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].wait(10)

    def close(self) -> None:
        (self.out / "unhang").touch()
        (self.out / "stop").touch()
        self.wait_exit(5)
        alive = [(rank, proc) for rank, proc in enumerate(self.procs) if proc.poll() is None]
        for rank, proc in alive:
            print(f"!!!!! rank {rank} still running at teardown: its stacks are at the end of its stderr")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
        if alive:
            time.sleep(0.5)  # not synchronisation: lets faulthandler finish writing before the kill
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for f in self._files:
            f.close()

    def dump(self) -> None:
        """Print each rank's exit code and the tail of its stderr (shown by pytest on failure)."""
        for rank, proc in enumerate(self.procs):
            print(f"===== rank {rank}: pid {proc.pid}, exit {proc.poll()}, last step {self.last_step(rank)}")
            for name in ("stdout", "stderr"):
                path = self.out / f"rank{rank}.{name}"
                text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
                if text.strip():
                    print(f"----- rank {rank} {name} (last 60 lines)")
                    print("\n".join(text.splitlines()[-60:]))


streams_ready = functools.partial(support.streams_ready, job=JOB)
idle = functools.partial(support.idle, job=JOB)


class Operator:
    """The O&M side: SwitchNicTrack, then the one message on SubscribeSwitchNicSignal."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.channel = open_channel(ChannelSettings(target=sim.address))
        self.stub = RecoverStub(self.channel)

    def request(self, node: str, devs: list[str], ops: list[bool]) -> None:
        message = pb.SwitchNics(jobID=JOB)
        message.nicOps[node].dev.extend(devs)
        message.nicOps[node].op.extend(ops)
        status = self.stub.SwitchNicTrack(message, timeout=5)
        assert status.code == 0, status

    def follow(self, timeout: float = 60) -> str:
        for response in self.stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=timeout):
            return str(response.msg)
        return "(no message)"

    def switch(self, node: str, devs: list[str], ops: list[bool], timeout: float = 60) -> tuple[str, float]:
        """(message, seconds from the request to the message); waits for the job to be idle first."""
        assert self.sim.wait_until(idle, 20), f"job not idle: {self.sim.job_view(JOB).state}"
        produced = len(self.sim.job_view(JOB).om_messages)
        started = time.monotonic()
        self.request(node, devs, ops)
        try:
            return self.follow(timeout), time.monotonic() - started
        except grpc.RpcError as exc:
            # The switch was over before the result stream opened (a loaded machine): ClusterD then
            # answers "not swtiching nic", as it would to a late operator. The simulator still
            # says which message the switch produced.
            if "is not swtiching nic" not in str(exc.details()):
                raise
            messages = self.sim.job_view(JOB).om_messages
            assert len(messages) > produced, exc
            return messages[produced], time.monotonic() - started

    def close(self) -> None:
        self.channel.close()


class Cluster:
    """One test's simulator (its rank table matching the job), operator, MindIO stand-in and job."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._sim: Simulator | None = None
        self._op: Operator | None = None
        self._job: Job | None = None
        self._standin: MindIOStandIn | None = None

    @property
    def sim(self) -> Simulator:
        assert self._sim is not None
        return self._sim

    @property
    def op(self) -> Operator:
        assert self._op is not None
        return self._op

    def job(self, world: int, *, pause: str = "agent", local_world: int | None = None,
            strategies: tuple[str, ...] = ("recover", "dump"), **kwargs: Any) -> Job:
        """Start the simulator (nodes of ``local_world`` devices: global rank = node * local_world +
        device; ``strategies``: the job's recover-strategy annotation) and ``world`` worker processes."""
        lws = local_world or world
        nodes = {f"node-{n}": [str(d) for d in range(lws)] for n in range(world // lws)}
        self._sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=nodes, recover_strategies=strategies)],
                              settings=FAST)
        self._sim.start()
        self._op = Operator(self._sim)
        if pause == "external":  # MindIO owns pause/continue: here a stand-in in this process
            self._standin = MindIOStandIn(self._sim.address, JOB)
            self._standin.start()
            assert self._standin.ready.wait(10)
        self._job = Job(self._sim, self.tmp_path / "job", world, pause=pause, local_world=local_world, **kwargs)
        return self._job

    def close(self) -> None:
        if self._job is not None:
            self._job.close()
            self._job.dump()
        if self._standin is not None:
            self._standin.stop()
        if self._op is not None:
            self._op.close()
        if self._sim is not None:
            self._sim.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


# -- checks shared by the tests ------------------------------------------------------------------


def check_training(job: Job, ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """Steps are 1, 2, 3, ... on every rank; all ranks saw the same loss and weights at every step
    (they stayed in lockstep); the global loss fell at every single step. Returns rank 0's steps."""
    ranks = list(range(job.world)) if ranks is None else ranks
    logs = {r: job.steps(r) for r in ranks}
    for rank, steps in logs.items():
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)), f"rank {rank} skipped or repeated a step"
    common = min(len(s) for s in logs.values())
    reference = logs[ranks[0]][:common]
    for rank, steps in logs.items():
        assert [(s["loss"], s["w"]) for s in steps[:common]] == [(s["loss"], s["w"]) for s in reference], (
            f"rank {rank} diverged from rank {ranks[0]}")
    losses = [s["loss"] for s in reference]
    rises = [i + 1 for i in range(len(losses) - 1) if not losses[i + 1] < losses[i]]
    assert not rises, f"the loss did not fall at steps {rises[:10]}"
    return reference


def switch_calls_by_seq(job: Job, ranks: list[int] | None = None) -> dict[int, dict[int, list[dict[str, Any]]]]:
    """seq -> rank -> that rank's switch-hook calls for the order."""
    ranks = list(range(job.world)) if ranks is None else ranks
    out: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for rank in ranks:
        for call in job.hooks(rank):
            out.setdefault(call["seq"], {}).setdefault(rank, []).append(call)
    return out


# -- the tests -----------------------------------------------------------------------------------


# The agents' nodes are of one rank (ClusterD's view stays one node of four devices).
GROUPS = {"NICSWITCH_FAN_OUT": "group", "NICSWITCH_NODES_PER_GROUP": "2", "NICSWITCH_LOCAL_WORLD_SIZE": "1"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pause", "world", "env"), [
    ("agent", 3, {}),
    # Groups of nodes over real TCPStores: 4 nodes of one rank in 2 groups; ranks 0 and 2 host
    # their group's Store (on all interfaces) and run its relay beside their node's. (Flat in
    # pause mode external: the other tests of this file.)
    ("agent", 4, GROUPS), ("external", 4, GROUPS),
])
def test_a_switch_mid_training_parks_checkpoints_switches_and_training_goes_on(
        cluster: Cluster, pause: str, world: int, env: dict[str, str]) -> None:
    import torch

    job = cluster.job(world, pause=pause, env=env)
    sim, operator = cluster.sim, cluster.op
    ranks = list(range(world))
    job.wait_ready()
    # Failover then switchback of the last rank and rank 0, listed in that (non-sorted) order.
    devs = [str(world - 1), "0"]
    rounds = [("node-0", devs, [True, False]), ("node-0", devs, [False, False])]
    before = []
    for node, devs, ops in rounds:
        before.append(job.last_step(0))
        message, _ = operator.switch(node, devs, ops)
        assert message == FINISH
    resumed_from = max(job.last_step(r) for r in ranks)
    job.wait_steps(resumed_from + 30)  # training goes on after the last switch
    assert job.stop() == [EXIT_DONE] * world, "every rank finishes cleanly"

    view = sim.job_view(JOB)
    assert view.replies == [True, True]  # one reply per list
    assert view.violations == []
    steps = check_training(job)
    by_seq = switch_calls_by_seq(job)
    assert sorted(by_seq) == [1, 2]
    for seq, (_node, _devs, ops) in zip((1, 2), rounds, strict=True):
        calls = by_seq[seq]
        assert sorted(calls) == ranks and all(len(c) == 1 for c in calls.values()), "each rank called once"
        args = {(tuple(c[0]["ranks"]), tuple(c[0]["ops"])) for c in calls.values()}
        assert args == {((world - 1, 0), tuple(ops))}, "identical arguments on every rank, in the received order"
        guards = {rank: [g for g in job.hooks(rank, "guard") if g["seq"] == seq] for rank in ranks}
        assert all(len(g) == 1 and g[0]["saved"] for g in guards.values()), guards
        for rank, (call,) in calls.items():
            ckpt = Path(guards[rank][0]["path"])
            assert ckpt == job.out / "ckpt" / f"rank{rank}" / f"step-{guards[rank][0]['step']}"
            assert (ckpt / "state.pt").is_file() and (ckpt / "nicswitch.json").is_file()
            if pause == "agent":
                # parked on its own training thread, at the step it checkpointed
                assert call["thread"] == f"train-{rank}"
                assert guards[rank][0]["thread"] == f"train-{rank}"
                assert call["step"] == guards[rank][0]["step"]
            else:
                # MindIO pauses training: the agent runs hooks on its own threads, never the training thread
                assert call["thread"].startswith("nicswitch-switch-")
                assert guards[rank][0]["thread"].startswith("nicswitch-checkpoint-")
        if pause == "agent":
            parked = {calls[r][0]["step"] for r in calls}
            assert len(parked) == 1, f"switch #{seq}: ranks parked at different steps {parked}"
            step = parked.pop()
            assert step > before[seq - 1]
            for rank in ranks:
                # the checkpoint holds exactly the weights the rank had when it parked at that step
                state = torch.load(job.out / "ckpt" / f"rank{rank}" / f"step-{step}" / "state.pt")
                saved = float(sum(t.sum() for t in state["model"].values()))
                assert saved == pytest.approx(steps[step - 1]["w"], rel=1e-12, abs=1e-12)
                assert [e["detail"]["step"] for e in job.events(rank, "parked")][seq - 1] == step
    assert all(not job.result(r)["agent"]["parked"] for r in ranks)
    if env is GROUPS:
        for rank, group in ((0, 0), (2, 1)):
            assert f"relays for its node and its group; group {group} of 2; over the node link" in job.log(rank), \
                job.log(rank)[-2000:]
        assert "and its group" not in job.log(1) + job.log(3)


@pytest.mark.timeout(120)
def test_process_group_checkpoint_guard_saves_collectively_on_the_parked_training_threads(
        cluster: Cluster, tmp_path: Path) -> None:
    """TorchCheckpointGuard in its torch.distributed.checkpoint mode: a collective that every rank
    enters from its parked training thread, into one shared directory."""
    if importlib.util.find_spec("numpy") is None:
        pytest.skip("TorchCheckpointGuard over a process group needs numpy (torch's object collectives)")
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    job = cluster.job(2, env={"NSW_CHECKPOINT": "dcp"})
    operator = cluster.op
    job.wait_ready()
    for ops in ([True, False], [False, False]):
        assert operator.switch("node-0", ["1", "0"], ops)[0] == FINISH
    job.wait_steps(max(job.last_step(r) for r in (0, 1)) + 20)
    assert job.stop() == [EXIT_DONE, EXIT_DONE]
    assert cluster.sim.job_view(JOB).replies == [True, True]
    steps = check_training(job)
    for seq in (1, 2):
        guards = [g for r in (0, 1) for g in job.hooks(r, "guard") if g["seq"] == seq]
        assert len(guards) == 2 and all(g["saved"] for g in guards), guards
        assert [g["thread"] for g in guards] == ["train-0", "train-1"]
        step = guards[0]["step"]
        assert {g["step"] for g in guards} == {step} == {c["step"] for r in (0, 1) for c in job.hooks(r)
                                                           if c["seq"] == seq}
        ckpt = job.out / "ckpt" / f"step-{step}"
        assert {g["path"] for g in guards} == {str(ckpt)}
        info = json.loads((ckpt / "nicswitch.json").read_text(encoding="utf-8"))
        assert (info["format"], info["world_size"], info["step"], info["seq"]) == (
            "torch.distributed.checkpoint", 2, step, seq)
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        dcp_to_torch_save(ckpt, tmp_path / f"seq{seq}.pt")
        state = torch.load(tmp_path / f"seq{seq}.pt")
        saved = float(sum(t.sum() for t in state["model"].values()))
        assert saved == pytest.approx(steps[step - 1]["w"], rel=1e-12, abs=1e-12)
    assert sorted(p.name for p in (job.out / "ckpt").iterdir()) == sorted(
        f"step-{g['step']}" for g in job.hooks(0, "guard"))  # no temporary directory left behind


@pytest.mark.timeout(120)
def test_twenty_switches_in_a_row_one_reply_each_and_only_rank0_talks_to_clusterd(cluster: Cluster) -> None:
    job = cluster.job(2)
    sim, operator = cluster.sim, cluster.op
    watch = StreamWatch(sim, JOB)
    job.wait_ready()
    durations = []
    for i in range(20):
        ops = [i % 2 == 0, i % 3 == 0]
        message, took = operator.switch("node-0", ["1", "0"], ops, timeout=30)
        assert message == FINISH, f"switch {i + 1}: {message}"
        durations.append(took)
    last = job.last_step(0)
    job.wait_steps(last + 20)
    assert job.stop() == [EXIT_DONE, EXIT_DONE]
    max_open = watch.stop()

    view = sim.job_view(JOB)
    assert view.replies == [True] * 20
    assert view.violations == []
    assert [list(rl.rankID) for rl in view.lists_sent] == [["1", "0"]] * 20
    by_seq = switch_calls_by_seq(job)
    assert sorted(by_seq) == list(range(1, 21))
    parked_steps = []
    for seq, calls in by_seq.items():
        i = seq - 1
        assert {r: [(c["ranks"], c["ops"]) for c in cs] for r, cs in calls.items()} == {
            r: [([1, 0], [i % 2 == 0, i % 3 == 0])] for r in (0, 1)}
        assert calls[0][0]["step"] == calls[1][0]["step"]
        parked_steps.append(calls[0][0]["step"])
    assert parked_steps == sorted(set(parked_steps)), "each switch parked at a later step"
    check_training(job)
    # One ClusterD client for the whole job: never two notify subscribers or process-manage streams.
    assert max_open.get("SubscribeNotifySwitch") == 1, max_open
    assert max_open.get("SubscribeProcessManageSignal") == 1, max_open
    assert watch.samples > 100
    leader, member = job.result(0)["agent"], job.result(1)["agent"]
    assert leader["stream"]["opens"] >= 21 and leader["counters"]["replies_delivered"] == 20
    assert member["stream"]["opens"] == 0 and member["process_manage"] is None
    assert member["counters"]["lists_received"] == 0
    print(f"20 switches: median {sorted(durations)[10] * 1000:.0f} ms, max {max(durations) * 1000:.0f} ms")


@pytest.mark.timeout(120)
def test_default_switch_hook_calls_torch_npu_with_identical_arguments_on_every_rank(cluster: Cluster) -> None:
    job = cluster.job(4, local_world=2, path=[FAKE_TORCH_NPU], env={
        "NSW_HOOK": "default", "HCCL_OP_RETRY_ENABLE": "L0:0, L1:1, L2:1",
    }, per_rank_env={r: {"FAKE_TORCH_NPU_LOG": f"{{out}}/rank{r}.npu.jsonl"} for r in range(4)})
    sim, operator = cluster.sim, cluster.op
    watch = StreamWatch(sim, JOB)
    job.wait_ready()
    assert operator.switch("node-1", ["1", "0"], [True, False])[0] == FINISH
    assert operator.switch("node-0", ["0"], [True])[0] == FINISH
    job.wait_steps(max(job.last_step(r) for r in range(4)) + 10)
    assert job.stop() == [EXIT_DONE] * 4
    max_open = watch.stop()

    view = sim.job_view(JOB)
    assert view.replies == [True, True]
    assert view.violations == []
    pids = [job.result(r)["pid"] for r in range(4)]
    for rank in range(4):
        calls = read_jsonl(job.out / f"rank{rank}.npu.jsonl")
        assert [(c["ranks_repr"], c["ops_repr"]) for c in calls] == [("[3, 2]", "[True, False]"), ("[0]", "[True]")]
        assert all(c["ranks_type"] == "list" and c["ops_type"] == "list" for c in calls)
        assert all(c["item_types"] == ["bool", "int"] for c in calls)
        assert all(c["pid"] == pids[rank] and c["rank"] == str(rank) for c in calls)
        assert all(c["thread"] == f"train-{rank}" for c in calls)  # on the parked training thread
        assert job.hooks(rank) == []  # no other switch hook was involved
    for seq in (1, 2):  # every rank parked (and checkpointed) at the same step
        assert len({g["step"] for r in range(4) for g in job.hooks(r, "guard") if g["seq"] == seq}) == 1
    assert max_open.get("SubscribeNotifySwitch") == 1 and max_open.get("SubscribeProcessManageSignal") == 1
    assert all(job.result(r)["agent"]["stream"]["opens"] == 0 for r in (1, 2, 3))
    check_training(job)


class KnownBug(AssertionError):
    """A library bug this file documents; tests that hit it are xfail(strict=True, raises=KnownBug),
    so any other failure in them still fails, and a fix turns them into a strict XPASS."""


STALE_WORK = (
    "Member._run_order gives up on work queued for the parked training thread after its budget "
    "(future.result(timeout=budget) -> false) but never cancels the future, so the training thread "
    "runs it later anyway: the rollback the leader already reported as failed (and the checkpoint) "
    "run on the hung rank after its hook returns, long after ClusterD moved on"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause", [
    "agent",
    "external",
])
def test_one_rank_failing_then_hanging_its_hook_gives_reply_false_within_the_timeout(
        cluster: Cluster, pause: str) -> None:
    """Rank 1's switch hook returns False for switch #1 and hangs in switch #2 (until <out>/unhang)."""
    job = cluster.job(2, pause=pause, env={
        "NSW_FAIL_RANK": "1", "NSW_FAIL_CALLS": "1", "NSW_HANG_RANK": "1", "NSW_HANG_SEQ": "2",
        "NICSWITCH_SWITCH_TIMEOUT_S": "1", "NICSWITCH_GUARD_TIMEOUT_S": "1", "NSW_PG_TIMEOUT_S": "5"})
    sim, operator = cluster.sim, cluster.op
    job.wait_ready()

    # 1. A hook that returns False on one rank: reply false at once.
    message, took = operator.switch("node-0", ["1"], [True])
    assert (message, sim.job_view(JOB).replies) == (FAILED, [False])
    assert took < 5, took
    assert sim.wait_until(idle, 20), sim.job_view(JOB).state  # ClusterD's recovery is over
    if pause == "agent":
        # The failed switch was rolled back on every rank (the hook worked the second time), so
        # ClusterD picked recover and training went on.
        picks = [s.changeStrategy for s in sim.job_view(JOB).signals_sent if s.signalType == "changeStrategy"]
        assert picks == ["recover"], picks
        for rank in (0, 1):
            assert [(c["seq"], c["ranks"], c["ops"]) for c in job.hooks(rank)] == [(1, [1], [True]), (1, [1], [False])]
    else:  # MindIO's recovery: the agent rolls nothing back itself
        assert [(c["seq"], c["ops"]) for c in job.hooks(1)] == [(1, [True])]
    job.wait_steps(max(job.last_step(r) for r in (0, 1)) + 10)

    # 2. A hook that hangs on one rank: reply false within guard + switch budget (2 s) + the
    # leader's slack (2 s), plus reply and scheduling time.
    message, took = operator.switch("node-0", ["0"], [True])
    assert (message, sim.job_view(JOB).replies) == (FAILED, [False, False])
    assert took < 7, took
    assert [c["seq"] for c in job.hooks(1)][-1] == 2 and not job.hooks(1, "unhung"), "rank 1 is inside its hook"
    if pause == "external":
        # The hook hangs on an agent thread; training never stopped, and goes on.
        job.wait_steps(max(job.last_step(r) for r in (0, 1)) + 20)
        (job.out / "unhang").touch()
        assert poll(lambda: job.hooks(1, "unhung"), 10)
        # 3. Once the hook has returned, the agent switches again.
        assert operator.switch("node-0", ["0"], [False])[0] == FINISH
        assert sim.job_view(JOB).replies == [False, False, True]
        assert job.stop() == [EXIT_DONE, EXIT_DONE]
        check_training(job)
        return
    # Rank 1's training thread is still inside the hook, so ClusterD's recovery can neither roll
    # back nor checkpoint there: the agent offers dump and exit, ClusterD picks dump, the dump
    # cannot be done on rank 1 either, and every rank is told to stop. The leader stops at once;
    # it does not wait for the hung rank.
    assert job.wait_exit(30, ranks=[0]) == [EXIT_STOPPED]
    assert job.procs[1].poll() is None and not (job.out / "rank1.result.json").exists(), "rank 1 is still hung"
    view = sim.job_view(JOB)
    assert [s.changeStrategy for s in view.signals_sent
            if s.signalType == "changeStrategy" and not s.extraParams] == ["recover", "dump"]
    assert view.violations == []
    calls_when_given_up = len(job.hooks(1))
    (job.out / "unhang").touch()
    # Once its hook returns, rank 1 leaves the parking spot too. Rank 0 hosted the job's store and
    # is gone, so rank 1 got the stop only if it read it before rank 0 exited; otherwise it saw
    # the store vanish, was let go, and its next all_reduce failed. Either way it ends.
    assert poll(lambda: (job.out / "rank1.result.json").exists(), 20), "rank 1 stayed parked after its hook returned"
    assert job.result(1)["status"] in ("stopped", "error"), job.result(1)
    print(f"rank 1 after its hook returned: {job.result(1)['status']}: {job.result(1)['reason']}")
    check_training(job)
    late = [(c["seq"], c["call"], c["ops"]) for c in job.hooks(1)[calls_when_given_up:]]
    if late:
        raise KnownBug(f"rank 1 ran switch-hook calls after the leader gave up on them: {late}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pause", "world", "local_world"), [
    ("agent", 3, None), ("external", 2, None),
    # Node-local fan-out (2 nodes of 2 ranks): rank 1 is a member behind node 0's relay (rank 0).
    # (A silent rank during an order, the external case, is tests/test_relay.py's.)
    ("agent", 4, 2),
])
def test_a_killed_member_gives_false_not_a_hang(cluster: Cluster, pause: str, world: int,
                                                local_world: int | None) -> None:
    # NSW_PG_TIMEOUT_S: a survivor that waits on the dead rank in the ring (rather than reading
    # from its closed socket) only notices when its all_reduce times out.
    job = cluster.job(world, pause=pause, local_world=local_world, env={
        "NSW_ON_PEER_LOSS": "continue", "NSW_PG_TIMEOUT_S": "5", "NICSWITCH_PAUSE_TIMEOUT_S": "1.5",
        "NICSWITCH_SWITCH_TIMEOUT_S": "1", "NICSWITCH_GUARD_TIMEOUT_S": "1"})
    sim, operator = cluster.sim, cluster.op
    survivors = [r for r in range(world) if r != 1]
    job.wait_ready()
    job.kill(1)
    # The survivors notice the dead peer in their next all_reduce and go on stepping alone.
    assert poll(lambda: all(any(s["degraded"] for s in job.steps(r)[-3:]) for r in survivors), 30)
    assert sim.wait_until(idle, 10)
    started = time.monotonic()
    operator.request("node-0", ["1"], [True])
    if pause == "agent":
        # Rank 1 never answers the pause: after pause_timeout_s the leader reports 499, ClusterD
        # kills the job (killMaster) and the survivors are told to stop.
        assert sim.wait_until(lambda s: any(sig.signalType == "killMaster"
                                            for sig in s.job_view(JOB).signals_sent), 30)
        took = time.monotonic() - started
        assert took < 1.5 + 7, f"killMaster {took:.1f} s after the request (pause_timeout_s=1.5)"
        assert sim.job_view(JOB).replies == []
        assert "om failed, pause train failed" in sim.job_view(JOB).om_messages
        if local_world is not None:  # the relay said which of its ranks did not answer
            assert "node 0: no answer to the pause from rank(s) 1" in job.log(0), job.log(0)[-2000:]
        assert job.wait_exit(20, ranks=[0]) == [EXIT_STOPPED]
        # Rank 2 got the stop too (its exit is then delayed: see test_a_member_stops_promptly_...).
        assert poll(lambda: (job.out / "rank2.result.json").exists(), 20)
        assert job.result(2)["status"] == "stopped", job.result(2)
    else:
        message = operator.follow(30)
        took = time.monotonic() - started
        assert message == FAILED
        assert sim.job_view(JOB).replies == [False]
        assert took < 1 + 1 + 2 + 3, took  # guard + switch budget, the leader's slack, margin
        # The leader is still responsive: it keeps training and holds its streams.
        job.wait_steps(job.last_step(0) + 10, ranks=survivors)
        assert sim.wait_until(idle, 20)
        codes = job.stop(30)
        assert [codes[r] for r in survivors] == [EXIT_DONE] * len(survivors)
    assert sim.job_view(JOB).violations == []


MEMBER_STOP_BLOCKS = (
    "Member.stop() wakes its own idle wait through self.kv.clone(); once the store's host (rank 0, "
    "without torchrun) is gone, clone() blocks until the store's connect timeout (the process-group "
    "timeout: 30 min by default), so SwitchAgent.stop() on a member is not bounded by stop_timeout_s"
)


@pytest.mark.timeout(120)
def test_a_member_stops_promptly_after_the_leader_died(cluster: Cluster) -> None:
    job = cluster.job(2, env={"NSW_ON_PEER_LOSS": "continue", "NSW_PG_TIMEOUT_S": "3"})
    job.wait_ready()
    job.kill(0)  # the leader, and with it the job's TCPStore
    # Rank 1's next all_reduce fails; it goes on stepping alone, its agent still up.
    assert poll(lambda: any(s["degraded"] for s in job.steps(1)[-3:]), 20)
    (job.out / "stop").touch()
    assert job.wait_exit(30, ranks=[1]) == [EXIT_DONE]
    stop_s = job.result(1)["stop_s"]
    if stop_s > 2.5:  # stop_timeout_s is 1 s per thread, and the member thread is already gone
        raise KnownBug(f"agent.stop() on the member took {stop_s} s (the process-group timeout is 3 s)")
