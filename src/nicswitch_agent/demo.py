"""``nicswitch-agent demo``: a failover and a switchback against the embedded simulator.

Everything runs in this process, on loopback: the ClusterD simulator, a small training loop with a
SwitchAgent in pause mode ``agent`` (the agent is ClusterD's process-manage client and parks the
training thread at a step boundary itself; no MindIO needed), and an operator that calls
SwitchNicTrack and follows SubscribeSwitchNicSignal. It prints a timeline of what happened and
exits 0 only if both switches ended in "switch nic finish" with every link where it should be.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.agent import SwitchAgent
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.events import AgentEvent
from nicswitch_agent.orders import SwitchOrder
from nicswitch_agent.sim import SimJob, SimSettings, Simulator
from nicswitch_agent.transport import ChannelSettings, RecoverStub, open_channel

JOB_ID = "demo-job"
NODES = {"node-0": ["0", "1"], "node-1": ["0", "1"]}
STEP_INTERVAL_S = 0.02
WARMUP_STEPS = 10


@dataclass
class Timeline:
    """Lines stamped in ms since the demo started; thread-safe."""

    started: float = field(default_factory=time.monotonic)
    lines: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, who: str, text: str) -> None:
        with self.lock:
            self.lines.append(((time.monotonic() - self.started) * 1000, who, text))

    def render(self, out: TextIO) -> None:
        with self.lock:
            for ms, who, text in self.lines:
                out.write(f"  {ms:8.1f} ms  {who:<9} {text}\n")


class LinkTable:
    """The demo's stand-in for HCCL: which global ranks currently use their standby NIC."""

    def __init__(self, world_size: int) -> None:
        self.standby = [False] * world_size
        self.calls = 0

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls += 1
        for rank, use_backup in order:
            self.standby[rank] = use_backup
        return True

    def describe(self) -> str:
        on = [str(r) for r, b in enumerate(self.standby) if b]
        return f"ranks on standby: {', '.join(on) if on else 'none'}"


class FileCheckpoint:
    """Writes a tiny checkpoint (the step) before each switch, atomically."""

    def __init__(self, directory: str, current_step: Callable[[], int | None]) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.current_step = current_step
        self.paths: list[str] = []

    def __call__(self, order: SwitchOrder) -> None:
        step = self.current_step()
        path = os.path.join(self.directory, f"step-{step}-switch-{order.seq}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step, "order": order.as_dict()}, f)
        os.replace(tmp, path)
        self.paths.append(path)


class _SimLogToTimeline(logging.Handler):
    def __init__(self, timeline: Timeline) -> None:
        super().__init__(logging.INFO)
        self.timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "action path" in text or "signal enqueue" in text or "misuse" in text:
            if "action path" in text and "reset (switch nic finish)" in text:
                text = "switch finished: all of the job's streams end (reset)"
            elif "misuse" not in text:
                return
        self.timeline.add("clusterd", re.sub(r"uuid=\S+", "uuid=...", text))


def _describe_event(event: AgentEvent) -> str | None:
    d = event.detail
    if event.kind == "list_received":
        return f"rank list #{event.seq} received: {d['ranks']} rank(s), {d['to_standby']} to standby, " \
               f"{d['to_primary']} to primary"
    if event.kind == "member_result":
        where = "on the parked training thread" if d["parked"] else "on the member thread"
        what = "guard + switch" if d["kind"] == "switch" else d["kind"]
        result = "ok" if d["ok"] else "FAILED: " + d["reason"]
        return f"{what} {result} in {d['duration_s'] * 1000:.1f} ms {where}"
    if event.kind == "switch_done":
        verdict = "switched" if d["ok"] else "FAILED: " + d["reason"]
        return f"order #{event.seq} {verdict} on all {d['ranks']} rank(s) in {d['duration_s'] * 1000:.1f} ms"
    if event.kind == "reply_sent":
        return f"ReplySwitchNicResult({str(d['result']).lower()}) delivered in {d['duration_s'] * 1000:.1f} ms"
    if event.kind == "reply_failed":
        return f"reply NOT delivered: {d.get('error')}"
    if event.kind == "parked":
        return f"training parked at step {d['step']} (step boundary)"
    if event.kind == "resumed":
        return f"training resumed after {d['parked_s'] * 1000:.1f} ms parked"
    if event.kind in ("agent_started", "agent_stopped"):
        return event.kind.replace("_", " ")
    return None


def _operator_switch(stub: RecoverStub, nic_ops: dict[str, tuple[list[str], list[bool]]], timeline: Timeline,
                     timeout: float) -> str:
    request = pb.SwitchNics(jobID=JOB_ID)
    for node, (devs, ops) in nic_ops.items():
        request.nicOps[node].dev.extend(devs)
        request.nicOps[node].op.extend(ops)
    wanted = "; ".join(
        f"{node} dev {','.join(d)} -> {','.join('standby' if o else 'primary' for o in ops)}"
        for node, (d, ops) in nic_ops.items()
    )
    status = stub.SwitchNicTrack(request, timeout=5)
    timeline.add("operator", f"SwitchNicTrack({wanted}) -> {status.code} {status.info!r}")
    if status.code != 0:
        return f"refused: {status.code} {status.info}"
    call = stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB_ID), timeout=timeout)
    for response in call:
        timeline.add("operator", f"result: {response.msg!r}")
        return str(response.msg)
    return "stream ended without a result"


@dataclass
class _DemoRank:
    """One training rank of the demo: its agent, its view of the links, its checkpoints."""

    rank: int
    agent: SwitchAgent
    links: LinkTable
    guard: FileCheckpoint
    progress: _Progress
    thread: threading.Thread | None = None
    parked_at: list[int] = field(default_factory=list)


def run_demo(out: TextIO, *, verbose: bool = False) -> int:
    """Run the demo, print its timeline to ``out``; 0 when both switches finished correctly."""
    timeline = Timeline()
    sim_logger = logging.getLogger("nicswitch_agent.sim")
    handler = _SimLogToTimeline(timeline)
    sim_logger.addHandler(handler)
    old_level, old_propagate = sim_logger.level, sim_logger.propagate
    sim_logger.setLevel(logging.INFO)
    sim_logger.propagate = verbose
    world = sum(len(devs) for devs in NODES.values())
    stop_training = threading.Event()
    collective = threading.Barrier(world, timeout=60)
    results: list[str] = []
    ranks: list[_DemoRank] = []
    out.write("nicswitch-agent demo: ClusterD simulator + a training job with the agent, all in this process\n")
    out.write(f"job {JOB_ID}: {len(NODES)} nodes x {len(NODES['node-0'])} devices = {world} ranks (threads, "
              f"meeting every step like an all-reduce); pause mode agent; a step every "
              f"{STEP_INTERVAL_S * 1000:.0f} ms; rank 0 leads\n\n")
    try:
        with tempfile.TemporaryDirectory(prefix="nicswitch-demo-") as ckpt_dir, Simulator(
            jobs=[SimJob(job_id=JOB_ID, nodes=NODES)],
            settings=SimSettings(report_timeout_s=30.0, shuffle_nodes=True),
        ) as sim:
            address = sim.address
            timeline.add("demo", f"simulator serving on {address}")
            store = InProcessStore()  # a torch job would coordinate through its own TCPStore
            for r in range(world):
                progress = _Progress()
                links = LinkTable(world)
                guard = FileCheckpoint(os.path.join(ckpt_dir, f"rank{r}"), progress.current)
                agent = SwitchAgent(server=address, job_id=JOB_ID, pause="agent", rank=r, world_size=world,
                                    store=store, switch_hook=links, checkpoint_hook=guard)
                demo_rank = _DemoRank(r, agent, links, guard, progress)
                agent.add_listener(functools.partial(_on_event, timeline, rank=demo_rank))
                ranks.append(demo_rank)
            for demo_rank in ranks:
                demo_rank.agent.start()
            for demo_rank in ranks:
                demo_rank.thread = threading.Thread(target=_train, args=(demo_rank, stop_training, collective),
                                                    name=f"demo-rank{demo_rank.rank}", daemon=True)
                demo_rank.thread.start()
            leader = ranks[0]
            channel = open_channel(ChannelSettings(target=address))
            stub = RecoverStub(channel)
            try:
                _wait_streams(sim)
                leader.progress.wait_for_step(WARMUP_STEPS)
                timeline.add("demo", f"training at step {leader.progress.step}; failover: move node-1's devices "
                                     "0 and 1 to their standby NICs")
                results.append(_operator_switch(stub, {"node-1": (["0", "1"], [True, True])}, timeline, 60))
                timeline.add("demo", leader.links.describe())
                _wait_streams(sim)
                leader.progress.wait_for_step(leader.progress.step + WARMUP_STEPS)
                timeline.add("demo", f"training at step {leader.progress.step}; switchback: move them back to "
                                     "their primary NICs")
                results.append(_operator_switch(stub, {"node-1": (["0", "1"], [False, False])}, timeline, 60))
                timeline.add("demo", leader.links.describe())
                leader.progress.wait_for_step(leader.progress.step + WARMUP_STEPS)
            finally:
                channel.close()
                stop_training.set()
                collective.abort()
                for demo_rank in ranks:
                    demo_rank.agent.stop()
                    if demo_rank.thread is not None:
                        demo_rank.thread.join(5)
            checkpoints = sum(len(r.guard.paths) for r in ranks)
    finally:
        sim_logger.removeHandler(handler)
        sim_logger.setLevel(old_level)
        sim_logger.propagate = old_propagate
    timeline.render(out)
    same_links = all(r.links.standby == ranks[0].links.standby for r in ranks)
    same_steps = all(r.parked_at == ranks[0].parked_at for r in ranks) and len(ranks[0].parked_at) == 2
    ok = (results == ["switch nic finish", "switch nic finish"] and same_links and same_steps
          and not any(ranks[0].links.standby) and all(r.links.calls == 2 for r in ranks))
    status = ranks[0].agent.status()
    out.write("\n")
    out.write(f"switches: {len(results)}, results: {results}\n")
    out.write(f"every rank parked at the same steps: {'yes' if same_steps else 'NO'} "
              f"({', '.join(str(s) for s in ranks[0].parked_at)}); every rank switched the same links: "
              f"{'yes' if same_links else 'NO'}\n")
    out.write(f"checkpoints written by the guards: {checkpoints} ({world} ranks x 2 switches); "
              f"training reached step {ranks[0].progress.step}\n")
    out.write(f"replies delivered: {status['counters']['replies_delivered']}, "
              f"failed: {status['counters']['replies_failed']}\n")
    out.write("demo " + ("succeeded" if ok else "FAILED") + "\n")
    return 0 if ok else 1


_LEADER_EVENTS = {"list_received", "switch_done", "reply_sent", "reply_failed"}


def _on_event(timeline: Timeline, event: AgentEvent, *, rank: _DemoRank) -> None:
    if event.kind == "parked":
        rank.parked_at.append(int(event.detail["step"]))
    _timeline_event(timeline, event, rank.rank)


def _timeline_event(timeline: Timeline, event: AgentEvent, rank: int) -> None:
    if event.kind in _LEADER_EVENTS or event.kind.startswith("agent_"):
        if rank != 0 and event.kind.startswith("agent_"):
            return  # one line for the job's start and stop is enough
        who = "leader"
    elif event.kind in ("parked", "resumed"):
        if rank != 0 and event.kind == "resumed":
            return
        who = f"rank {rank}"
    else:
        who = f"rank {rank}"
    text = _describe_event(event)
    if text is not None:
        timeline.add(who, text)


class _Progress:
    """Lets the demo wait for the training loop to reach a step (no polling)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.step = 0

    def current(self) -> int:
        return self.step

    def advance(self, step: int) -> None:
        with self._cond:
            self.step = step
            self._cond.notify_all()

    def wait_for_step(self, step: int, timeout: float = 10.0) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.step >= step, timeout)


def _train(rank: _DemoRank, stop: threading.Event, collective: threading.Barrier) -> None:
    """A rank's training loop: compute, meet the others (the all-reduce), mark the step boundary."""
    step = 0
    agent = rank.agent
    try:
        while not stop.wait(STEP_INTERVAL_S):
            collective.wait()
            step += 1
            agent.step(step)
            rank.progress.advance(step)
    except threading.BrokenBarrierError:
        return


def _wait_streams(sim: Simulator, timeout: float = 10.0) -> None:
    """Wait until the agent's process-manage and notify streams are both open.

    ClusterD ends both after every switch and the agent reopens them, process-manage first. A
    switch requested earlier would still work (ClusterD waits), but the timeline reads better.
    """
    def both_open(s: Simulator) -> bool:
        view = s.job_view(JOB_ID)
        return all(view.open_streams.get(m, 0) == 1 for m in ("SubscribeProcessManageSignal", "SubscribeNotifySwitch"))

    if not sim.wait_until(both_open, timeout):
        raise RuntimeError("the simulator never saw both streams open")
