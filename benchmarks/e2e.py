"""Benchmarks 4, 5 (coordination) and 6: end-to-end switches in pause mode agent, split into parts.

A :class:`~benchmarks._servers.StampedSimulator` plays ClusterD; an operator in this process calls
SwitchNicTrack and reads "switch nic finish" from SubscribeSwitchNicSignal. The job's ranks are
threads (one agent each, one InProcessStore) or torch processes (gloo, env://, the job's TCPStore),
each with a training loop that steps every ``step_s`` and meets the others at a collective per step.
Hooks do nothing (they only stamp).

Each switch is split along its critical path (all stamps are CLOCK_MONOTONIC, shared by processes):

- ``clusterd``: the simulator's own time: accept -> pause signal sent, stop report -> list sent,
  reply -> continue sent, recover status -> finish received by the operator;
- ``wire``: the three stream messages to the agent (simulator yield -> leader callback) and the request
  leg of the agent's three unary reports (call -> server handler entered);
- ``boundary``: for the last rank to park, pause flag raised -> its training loop called step() at the
  step where it parked (training running its step, which any pause at a step boundary waits for);
- ``hooks``: the longest hook call;
- ``coordination``: everything else, i.e. the agent's own work: Store round trips, thread hand-offs,
  validation, parking and releasing. Split further into pause / order / release.

``agent overhead`` = total - hooks - boundary (the target in the issue).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import (
    ROOT,
    BenchResult,
    Metric,
    Settings,
    dist_metric,
    free_port,
    median,
    ms,
    single_metric,
)
from benchmarks._instrument import RankRecorder
from benchmarks._servers import StampedSimulator
from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

JOB = "bench-e2e"
SIM_SETTINGS = SimSettings(report_timeout_s=30.0, shuffle_nodes=False)  # real keep-alive and waits
SIM_STAMPS = ("accept", "pause_sent", "stop_complete", "list_sent", "reply", "continue_sent", "status")

# Upstream TaskD's fixed intervals (docs/clusterd.md#timings), NOT measured:
UPSTREAM_MANAGER_POLL_S = 0.100  # SwitchNicPlugin polled every TASKD_PROCESS_INTERVAL (default 100 ms)
UPSTREAM_RESUBSCRIBE_S = 1.0  # manager.go listenSwitchNicSignal: sleep 1 s after io.EOF
ALIGN_STEP_S = 0.05  # benchmark 6 steps every 50 ms


def nodes_for(world: int) -> dict[str, list[str]]:
    if world == 1:
        return {"node-0": ["0"]}
    if world % 2:
        return {"node-0": [str(d) for d in range(world)]}
    return {f"node-{n}": [str(d) for d in range(world // 2)] for n in range(2)}


def streams_ready(sim: Simulator) -> bool:
    view = sim.job_view(JOB)
    return view.open_streams.get("SubscribeProcessManageSignal", 0) == 1 and (
        view.open_streams.get("SubscribeNotifySwitch", 0) == 1
    )


@dataclass
class SimSwitch:
    """The simulator side of one switch, and the operator's finish."""

    index: int
    stamps: dict[str, float]
    finish: float
    ready: float  # both streams open again after the reset that ends the switch
    result: str


@dataclass
class Phase:
    name: str
    step_s: float
    switches: int
    records: list[SimSwitch] = field(default_factory=list)


class Operator:
    """Drives switches the way an operator does: SwitchNicTrack, then read the result stream."""

    def __init__(self, sim: StampedSimulator, world: int, rng: random.Random) -> None:
        self.sim = sim
        self.world = world
        self.rng = rng
        self.channel = open_channel(ChannelSettings(target=sim.address))
        self.stub = RecoverStub(self.channel)
        self.count = 0

    def close(self) -> None:
        self.channel.close()

    def switch(self, step_s: float) -> SimSwitch:
        if not self.sim.wait_until(streams_ready, 30):
            raise RuntimeError("the agent's streams did not open within 30 s")
        # Land the request at a random phase of the step, after the agent has settled.
        time.sleep(step_s + self.rng.uniform(0, step_s))
        before = self.sim.counts()
        node = "node-1" if self.world > 1 and self.world % 2 == 0 else "node-0"
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps[node].dev.append("0")
        request.nicOps[node].op.append(self.count % 2 == 0)  # failover, then switchback
        self.count += 1
        status = self.stub.SwitchNicTrack(request, timeout=5)
        if status.code != 0:
            raise RuntimeError(f"SwitchNicTrack refused: {status.code} {status.info}")
        result = "(no message)"
        for response in self.stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=60):
            result = str(response.msg)
            break
        finish = time.monotonic()
        if result != "switch nic finish":
            raise RuntimeError(f"switch {self.count} ended with {result!r}")
        if not self.sim.wait_until(streams_ready, 30):
            raise RuntimeError("the agent's streams did not reopen within 30 s after the switch")
        ready = time.monotonic()
        stamps: dict[str, float] = {}
        for name in SIM_STAMPS:
            values = self.sim.stamps.get(name, [])
            new = values[before.get(name, 0):]
            if len(new) != 1:
                raise RuntimeError(f"switch {self.count}: expected one {name!r} stamp, got {len(new)}")
            stamps[name] = new[0]
        return SimSwitch(self.count - 1, stamps, finish, ready, result)


# -- analysis -------------------------------------------------------------------------------------


def analyse(records: Sequence[SimSwitch], ranks: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Split every switch into its parts (seconds). ``ranks``: RankRecorder.as_dict() of every rank."""
    leader = next(r for r in ranks if r["rank"] == 0)

    def nth(items: list[Any], k: int, what: str) -> Any:
        if k >= len(items):
            raise RuntimeError(f"rank data lacks {what} #{k} (have {len(items)})")
        return items[k]

    rpc = {name: [r for r in leader["rpc"] if r[0] == name] for name in
           ("ReportStopComplete", "ReplySwitchNicResult", "ReportRecoverStatus")}
    signals = {kind: [s[1] for s in leader["signals"] if s[0] == kind] for kind in ("pause", "continue")}
    out = []
    for rec in records:
        k, s = rec.index, rec.stamps
        parked = [nth(r["parked"], k, f"rank {r['rank']} parking") for r in ranks]
        requests = [nth(r["requests"], k, f"rank {r['rank']} pause request") for r in ranks]
        hooks = [next((h for h in r["hooks"] if h[0] == k + 1), None) for r in ranks]
        if any(h is None for h in hooks):
            raise RuntimeError(f"switch {k}: a rank has no hook call for order #{k + 1}")
        completed = [r["completed_at_request"][k] if k < len(r.get("completed_at_request", [])) else None
                     for r in ranks]
        known = [c for c in completed if c is not None]
        top = max(known) if known else None
        behind = [r["rank"] for r, c in zip(ranks, completed, strict=True) if c is not None and top is not None
                  and c < top]
        last = max(range(len(ranks)), key=lambda i: parked[i][0])
        boundary = max(0.0, parked[last][2] - requests[last])
        hook_time = max(h[2] - h[1] for h in hooks if h is not None)
        pause_recv = nth(signals["pause"], k, "pause signal")
        continue_recv = nth(signals["continue"], k, "continue signal")
        list_recv = nth(leader["lists"], k, "rank list")
        stop_rpc = nth(rpc["ReportStopComplete"], k, "ReportStopComplete")
        reply_rpc = nth(rpc["ReplySwitchNicResult"], k, "ReplySwitchNicResult")
        status_rpc = nth(rpc["ReportRecoverStatus"], k, "ReportRecoverStatus")
        total = rec.finish - s["accept"]
        clusterd = (s["pause_sent"] - s["accept"]) + (s["list_sent"] - s["stop_complete"]) + (
            s["continue_sent"] - s["reply"]) + (rec.finish - s["status"])
        wire = (pause_recv - s["pause_sent"]) + (list_recv - s["list_sent"]) + (continue_recv - s["continue_sent"]) \
            + (s["stop_complete"] - stop_rpc[1]) + (s["reply"] - reply_rpc[1]) + (s["status"] - status_rpc[1])
        coordination = total - clusterd - wire - boundary - hook_time
        out.append({
            "total": total,
            "clusterd": clusterd,
            "wire": wire,
            "boundary": boundary,
            "hooks": hook_time,
            "coordination": coordination,
            "agent_overhead": total - hook_time - boundary,
            "pause_coordination": (stop_rpc[1] - pause_recv) - boundary,
            "order_coordination": (reply_rpc[1] - list_recv) - hook_time,
            "release": status_rpc[1] - continue_recv,
            "pause_to_parked": max(p[0] for p in parked) - s["pause_sent"],
            "parked_to_report": stop_rpc[1] - max(p[0] for p in parked),
            "hooks_to_reply": reply_rpc[1] - max(h[2] for h in hooks if h is not None),
            "request_spread": max(requests) - min(requests),
            "pause_to_flags": max(requests) - s["pause_sent"],
            "straddled": float(bool(behind)),
            "rank0_behind": float(0 in behind),
            "pause_to_stop_complete": s["stop_complete"] - s["pause_sent"],
            "notify_to_hook": min(h[1] for h in hooks if h is not None) - s["list_sent"],
            "reopen": rec.ready - rec.finish,
            "rpc_round_trips": (stop_rpc[2] - stop_rpc[1]) + (reply_rpc[2] - reply_rpc[1])
            + (status_rpc[2] - status_rpc[1]),
        })
    return out


def leader_store_per_switch(ranks: Sequence[dict[str, Any]], switches: int) -> dict[str, float]:
    leader = next(r for r in ranks if r["rank"] == 0)
    snap = leader.get("leader_store") or {"calls": {}, "seconds": {}}
    calls = snap["calls"]
    per: dict[str, float] = {f"calls.{k}": v / switches for k, v in calls.items()}
    per["round_trips"] = sum(v for k, v in calls.items() if k != "set") / switches
    per["sets"] = calls.get("set", 0) / switches
    per["seconds"] = sum(snap["seconds"].values()) / switches
    return per


def column(rows: Sequence[dict[str, float]], key: str) -> list[float]:
    return [ms(r[key]) for r in rows]


# -- ranks as threads ----------------------------------------------------------------------------------


class ThreadJob:
    """``world`` ranks as threads, one agent each, coordinating through one InProcessStore."""

    def __init__(self, sim: StampedSimulator, world: int, step_s: float) -> None:
        self.world = world
        self.step_s = step_s
        self.store = InProcessStore()
        self.barrier = threading.Barrier(world, timeout=60)
        self.stop = threading.Event()
        self.recorders = [RankRecorder(r) for r in range(world)]
        self.errors: list[BaseException] = []
        self.agents = []
        for r, rec in enumerate(self.recorders):
            agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=rec.hook, store=self.store,
                                rank=r, world_size=world, on_event=rec.on_event)
            rec.instrument(agent)
            self.agents.append(agent)
        for agent, rec in zip(self.agents, self.recorders, strict=True):
            agent.start()
            rec.instrument_started(agent)
        self.threads = [threading.Thread(target=self._train, args=(r,), name=f"bench-train-{r}", daemon=True)
                        for r in range(world)]
        for thread in self.threads:
            thread.start()

    def _train(self, r: int) -> None:
        agent, rec = self.agents[r], self.recorders[r]
        step = 0
        try:
            while not self.stop.is_set():
                time.sleep(self.step_s)
                self.barrier.wait()  # the step's collective
                step += 1
                rec.call_t = time.monotonic()
                agent.step(step)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            self.errors.append(exc)
            self.barrier.abort()

    def close(self) -> None:
        self.stop.set()
        self.barrier.abort()
        for agent in self.agents:
            agent.stop("benchmark done")
        for thread in self.threads:
            thread.join(10)
        if self.errors:
            raise RuntimeError(f"a training thread failed: {self.errors[0]!r}")


def run_thread_job(world: int, step_s: float, switches: int, seed: int) -> tuple[list[dict[str, float]],
                                                                               list[dict[str, Any]]]:
    with StampedSimulator(jobs=[SimJob(job_id=JOB, nodes=nodes_for(world))], settings=SIM_SETTINGS) as sim:
        job = ThreadJob(sim, world, step_s)
        operator = Operator(sim, world, random.Random(seed))
        try:
            records = [operator.switch(step_s) for _ in range(switches)]
        finally:
            operator.close()
            job.close()
        ranks = [rec.as_dict() for rec in job.recorders]
    return analyse(records, ranks), ranks


# -- ranks as torch processes -----------------------------------------------------------------------------


def run_process_group(world: int, phases: Sequence[Phase], seed: int, log_dir: Path, *,
                      probe: bool = False) -> list[dict[str, Any]]:
    """Start ``world`` torch worker processes, run ``phases`` of switches, collect every rank's stamps
    (``probe``: each rank verifies every switch with a TorchLinkProbe)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with StampedSimulator(jobs=[SimJob(job_id=JOB, nodes=nodes_for(world))], settings=SIM_SETTINGS) as sim, \
            tempfile.TemporaryDirectory(prefix="nicswitch-bench-") as tmp:
        port = free_port()
        procs: list[subprocess.Popen[str]] = []
        logs = []
        try:
            for rank in range(world):
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                           WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCH_CPP_LOG_LEVEL="ERROR",
                           PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                for key in ("NICSWITCH_SERVER", "NICSWITCH_JOB_ID", "MINDX_TASK_ID", "TTP_PORT",
                            "TASKD_PROCESS_ENABLE"):
                    env.pop(key, None)
                log = open(log_dir / f"worker-{world}-{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-u", "-m", "benchmarks._worker", "--server", sim.address, "--job", JOB,
                     "--interval", str(phases[0].step_s), "--out", os.path.join(tmp, f"rank{rank}.json"),
                     *(["--probe"] if probe else [])],
                    cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                ))
            for rank, proc in enumerate(procs):
                assert proc.stdout is not None
                line = _readline(proc, 180)
                if line.strip() != "READY":
                    raise RuntimeError(f"worker {rank} did not start: {line!r} (see {log_dir})")
            operator = Operator(sim, world, random.Random(seed))
            try:
                for phase in phases:
                    _command(procs, f"interval {phase.step_s}")
                    time.sleep(3 * phase.step_s)
                    phase.records = [operator.switch(phase.step_s) for _ in range(phase.switches)]
            finally:
                operator.close()
                _command(procs, "stop")
            for rank, proc in enumerate(procs):
                if proc.wait(60) != 0:
                    raise RuntimeError(f"worker {rank} exited with {proc.returncode} (see {log_dir})")
            return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            for log in logs:
                log.close()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    box: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else "(timeout)"


def _command(procs: Sequence[subprocess.Popen[str]], text: str) -> None:
    for proc in procs:
        try:
            assert proc.stdin is not None
            proc.stdin.write(text + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass


# -- metrics --------------------------------------------------------------------------------------------


def breakdown_metrics(label: str, rows: Sequence[dict[str, float]], *, judge: bool) -> list[Metric]:
    """total, the parts, and agent overhead (judged against 50 ms when ``judge``)."""
    metrics = [
        dist_metric(f"{label}: total", column(rows, "total"), "ms"),
        dist_metric(f"{label}: total p95", column(rows, "total"), "ms", q=95),
        dist_metric(f"{label}: waiting for the step boundary", column(rows, "boundary"), "ms"),
        dist_metric(f"{label}: coordination (agent)", column(rows, "coordination"), "ms"),
        dist_metric(f"{label}: hooks", column(rows, "hooks"), "ms"),
        dist_metric(f"{label}: RPCs and stream messages (wire)", column(rows, "wire"), "ms"),
        dist_metric(f"{label}: ClusterD simulator", column(rows, "clusterd"), "ms"),
        dist_metric(f"{label}: agent overhead (total - hooks - boundary)", column(rows, "agent_overhead"), "ms",
                    target="< 50 ms" if judge else "", ok=(lambda v: v < 50) if judge else None),
    ]
    if judge:
        metrics.append(dist_metric(f"{label}: agent overhead p95", column(rows, "agent_overhead"), "ms", q=95))
    return metrics


def summary(rows: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = rows[0].keys() if rows else []
    return {k: {"p50_ms": round(median(column(rows, k)), 3), "max_ms": round(max(column(rows, k)), 3)} for k in keys}


def upstream_comparison(agent_overhead_ms: float) -> list[Metric]:
    poll_mean, poll_worst = ms(UPSTREAM_MANAGER_POLL_S), ms(2 * UPSTREAM_MANAGER_POLL_S)
    return [
        single_metric("upstream TaskD fixed intervals alone: manager poll, per switch (computed)", poll_mean, "ms",
                      note=f"two 100 ms polls (fan-out, aggregation): mean {poll_mean:.0f} ms, worst {poll_worst:.0f} "
                           "ms; stated, not measured"),
        single_metric("upstream TaskD fixed intervals alone: resubscribe after each switch (computed)",
                      ms(UPSTREAM_RESUBSCRIBE_S), "ms",
                      note="1 s sleep after the clean end that follows every switch; stated, not measured"),
        single_metric("our agent overhead / upstream's poll intervals alone", agent_overhead_ms / poll_mean, "x",
                      note="4 processes, p50; < 1 means the whole agent costs less than upstream's waits"),
    ]


def run(settings: Settings) -> list[BenchResult]:
    """Returns three results: e2e_switch (4), scale_coordination (5, part 2), pause_alignment (6)."""
    e2e = BenchResult("e2e_switch", "4. SwitchNicTrack accepted -> 'switch nic finish', pause mode agent, "
                                    "no-op hooks, 10 ms steps")
    coord = BenchResult("scale_coordination", "5b. coordination time: 16 threads-as-ranks and 8 processes")
    align = BenchResult("pause_alignment", "6. pause request -> all parked, 4 processes stepping every 50 ms")
    log_dir = ROOT / "bench-results" / "logs"
    quick = settings.quick
    seed = settings.seed
    started = time.monotonic()

    runs: dict[str, list[dict[str, float]]] = {}
    stores: dict[str, dict[str, float]] = {}
    n_thread = settings.pick(2, 30)
    for world in (1, 4):
        rows, ranks = run_thread_job(world, 0.01, n_thread, seed + world)
        runs[f"threads-{world}"] = rows
        stores[f"threads-{world}"] = leader_store_per_switch(ranks, n_thread)
    n16 = settings.pick(1, 15)
    rows, ranks = run_thread_job(16, 0.01, n16, seed + 16)
    runs["threads-16"] = rows
    stores["threads-16"] = leader_store_per_switch(ranks, n16)

    procs = settings.pick(2, 4)
    phases = [Phase("e2e", 0.01, settings.pick(2, 30)), Phase("align", ALIGN_STEP_S, settings.pick(2, 25))]
    ranks = run_process_group(procs, phases, seed + 100, log_dir)
    all_rows = analyse([r for p in phases for r in p.records], ranks)
    n_e2e = phases[0].switches
    runs[f"procs-{procs}"] = all_rows[:n_e2e]
    runs[f"procs-{procs}-50ms"] = all_rows[n_e2e:]
    stores[f"procs-{procs}"] = leader_store_per_switch(ranks, len(all_rows))
    big = procs
    if not quick:
        big = 8
        phase8 = [Phase("coord", 0.01, 15)]
        ranks8 = run_process_group(8, phase8, seed + 200, log_dir)
        runs["procs-8"] = analyse(phase8[0].records, ranks8)
        stores["procs-8"] = leader_store_per_switch(ranks8, phase8[0].switches)

    # 4. end to end
    for key, label in (("threads-1", "1 rank"), ("threads-4", "4 threads"), (f"procs-{procs}", f"{procs} processes")):
        e2e.metrics += breakdown_metrics(label, runs[key], judge=key == f"procs-{procs}")
    overhead = median(column(runs[f"procs-{procs}"], "agent_overhead"))
    e2e.metrics += upstream_comparison(overhead)
    e2e.add(dist_metric(f"{procs} processes: both streams open again after the switch's reset",
                        column(runs[f"procs-{procs}"], "reopen"), "ms",
                        note="process-manage first, then notify (the gate)"))
    e2e.details = {"breakdown": {k: summary(v) for k, v in runs.items()},
                   "leader_store_per_switch": stores, "note": "quick mode: 2 processes" if quick else ""}
    e2e.limits = (
        "With no-op hooks most of a switch is ClusterD's own state machine and the wait for the step boundary "
        "(half a step on average). The agent's part is Store round trips (pause: publish, collect c_r, publish "
        "the target, collect parked; order: publish, gather; release) and thread hand-offs; on 2 cores 4 "
        "processes plus the simulator compete for the CPU, so every hand-off can wait for a core."
    )

    # 5b. coordination at 16 threads and 8 processes
    for key, label in (("threads-16", "16 threads"), (f"procs-{big}", f"{big} processes")):
        rows = runs[key]
        coord.add(dist_metric(f"{label}: coordination (agent)", column(rows, "coordination"), "ms"))
        coord.add(dist_metric(f"{label}: pause coordination", column(rows, "pause_coordination"), "ms"))
        coord.add(dist_metric(f"{label}: order coordination", column(rows, "order_coordination"), "ms"))
        coord.add(dist_metric(f"{label}: release", column(rows, "release"), "ms"))
        coord.add(dist_metric(f"{label}: last rank parked -> leader reports the pause",
                              column(rows, "parked_to_report"), "ms",
                              note="the leader polls one counter of parked ranks at 0.5, 1, 2 .. 5 ms intervals"))
        coord.add(dist_metric(f"{label}: last hook returned -> leader sends the reply",
                              column(rows, "hooks_to_reply"), "ms",
                              note="member writes its result; the leader polls result keys"))
        coord.add(dist_metric(f"{label}: agent overhead", column(rows, "agent_overhead"), "ms"))
        coord.add(single_metric(f"{label}: leader Store round trips per switch", stores[key]["round_trips"], "",
                                note=f"+ {stores[key]['sets']:.0f} set() per switch; "
                                     f"{ms(stores[key]['seconds']):.1f} ms in Store calls"))
    coord.details = {"breakdown": {k: summary(runs[k]) for k in ("threads-16", f"procs-{big}")},
                     "leader_store_per_switch": {k: stores[k] for k in ("threads-1", "threads-4", "threads-16",
                                                                       f"procs-{big}")}}
    coord.limits = (
        "The leader publishes each of pause, target, order and release to every rank's queue with one multi_set, "
        "waits for c_r, parked and results by polling one counter each, and reads the values with one multi_get: "
        "its round trips per switch barely grow with the ranks (see leader_store_per_switch); the bytes do. "
        "Each member still makes its own few round trips, in parallel with the others."
    )

    # 6. pause alignment at 50 ms steps
    rows = runs[f"procs-{procs}-50ms"]
    bound = ms(ALIGN_STEP_S) + 20
    align.add(dist_metric("pause signal sent -> all ranks parked, p50", column(rows, "pause_to_parked"), "ms"))
    align.add(dist_metric("pause signal sent -> all ranks parked, max", column(rows, "pause_to_parked"), "ms", q=100,
                          target=f"< {bound:.0f} ms (one step + 20 ms)", ok=lambda v: v < bound))
    align.add(dist_metric("pause signal sent -> flag raised on every rank", column(rows, "pause_to_flags"), "ms",
                          note="signal to the leader, controller, Store publish, each member wakes"))
    align.add(dist_metric("of which waiting for the step boundary", column(rows, "boundary"), "ms"))
    align.add(dist_metric("pause flag raised on the first rank -> on the last", column(rows, "request_spread"),
                          "ms", note="a rank that sees the flag after its next step() call makes S one step later"))
    straddled = [r for r in rows if r["straddled"]]
    leader_behind = sum(r["rank0_behind"] for r in straddled)
    align.add(single_metric("pauses where the ranks' last steps differed (S one step later)",
                            100.0 * len(straddled) / max(1, len(rows)), "%",
                            note=f"rank 0 (the leader's process) was behind in {leader_behind:.0f} of "
                                 f"{len(straddled)}"))
    align.add(single_metric("pauses longer than one step period", 100.0 * sum(
        1 for v in column(rows, "pause_to_parked") if v > ms(ALIGN_STEP_S)) / max(1, len(rows)), "%"))
    align.add(dist_metric("pause signal sent -> ReportStopComplete received", column(rows, "pause_to_stop_complete"),
                          "ms"))
    align.details = {"breakdown": summary(rows), "processes": procs, "step_s": ALIGN_STEP_S}
    align.limits = (
        "Parking waits for every rank to reach the target step S = max(last completed step) + 1: up to one step "
        "(50 ms) of training; the rest is each rank's two Store writes (c_r, then parked), the leader's counter "
        "polls (0.5 ms growing to 5 ms) and the hand-off to the training thread."
    )
    elapsed = time.monotonic() - started
    for result in (e2e, coord, align):
        result.duration_s = elapsed / 3
    return [e2e, coord, align]
