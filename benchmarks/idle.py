"""Benchmark 1: what an idle agent costs.

- ``agent.step(step)`` with nothing pending, against a bare Python function call of the same
  signature, in the same loop, interleaved round by round (target: at most 1.5x).
- What the fast path does: the Python and C calls it makes (sys.setprofile) and the memory it
  allocates (tracemalloc), against the same bare function.
- The idle agent's CPU over a window (target: under 0.5 % of one core), against the floor measured
  in the same window: bare grpcio holding the same two streams with the same channel options
  (target: at most 1.5x the floor + 0.1 % of a core); per thread, for both. And its resident memory
  over a process without it (target: under 15 MB). These run in child processes (``python -m
  benchmarks.idle --child MODE``) connected to the simulator in this process, so neither the
  simulator nor this process's own allocations count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import (
    ROOT,
    BenchResult,
    Settings,
    quiet_logging,
    rounds_metric,
    single_metric,
)

JOB = "bench-idle"
FLOOR_JOB = "bench-idle-floor"
TICK = os.sysconf("SC_CLK_TCK")


# -- the step loop ------------------------------------------------------------------------------


def bare(step: int | None = None) -> None:
    """The reference: a module-level function with step()'s signature that does nothing."""
    return None


class SlottedGate:
    """Reference only (not the library): the least a step() can do in Python: one store, one compare."""

    __slots__ = ("handled", "last_step", "requested")

    def __init__(self) -> None:
        self.last_step: int | None = None
        self.requested = 0
        self.handled = 0

    def step(self, step: int | None = None) -> None:
        self.last_step = step
        if self.requested != self.handled:
            raise AssertionError("never pending here")


def _time_method(obj: Any, n: int) -> int:
    """ns for ``n`` calls written as in a training loop: ``obj.step(i)``."""
    args = range(n)
    started = time.perf_counter_ns()
    for i in args:
        obj.step(i)
    return time.perf_counter_ns() - started


def _time_function(n: int) -> int:
    """ns for ``n`` calls of the bare module-level function: ``bare(i)``."""
    args = range(n)
    started = time.perf_counter_ns()
    for i in args:
        bare(i)
    return time.perf_counter_ns() - started


def _time_empty(n: int) -> int:
    args = range(n)
    started = time.perf_counter_ns()
    for _i in args:
        pass
    return time.perf_counter_ns() - started


def _profile_one_call(fn: Callable[[int], None], arg: int) -> list[tuple[str, str]]:
    """Every profiler event of one call: Python calls and C calls (locks, clocks, syscalls)."""
    events: list[tuple[str, str]] = []

    def profiler(frame: Any, event: str, arg_: Any) -> None:
        if event.startswith("c_"):
            events.append((event, getattr(arg_, "__qualname__", repr(arg_))))
        else:
            events.append((event, frame.f_code.co_qualname))

    sys.setprofile(profiler)
    try:
        fn(arg)
    finally:
        sys.setprofile(None)
    return [e for e in events if e[1] not in ("setprofile", "_profile_one_call")]


def _transient_bytes(fn: Callable[[int], None], n: int, repeats: int = 15) -> int:
    """Peak bytes allocated above the start over ``n`` calls (tracemalloc), the least of ``repeats``.

    tracemalloc sees every thread; the agent's and gRPC's idle threads allocate now and then, so the
    smallest peak of several short windows is the step's own.
    """
    values = list(range(100_000, 100_000 + n))  # allocated before measuring
    peaks = []
    tracemalloc.start()
    try:
        fn(values[0])  # anything the first traced call replaces was allocated untraced
        for _ in range(repeats):
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            for v in values:
                fn(v)
            _, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - before)
    finally:
        tracemalloc.stop()
    return min(peaks)


def run_step_ratio(settings: Settings, result: BenchResult) -> None:
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.sim import SimJob, SimSettings, Simulator

    # Many short rounds, sides alternating: each ratio compares calls made within a few ms of each
    # other, so load from other processes hits both sides alike; the median of the rounds is reported.
    n = settings.pick(20_000, 100_000)
    rounds = settings.pick(5, 41)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})],
                   settings=SimSettings(shuffle_nodes=False)) as sim:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True)
        with agent:
            sim.wait_until(lambda s: s.job_view(JOB).open_streams.get("SubscribeNotifySwitch", 0) == 1, 10)
            step = agent.step
            gate = SlottedGate()
            _time_method(agent, n // 10)  # warm up (and let the interpreter specialise) all three
            _time_method(gate, n // 10)
            _time_function(n // 10)
            ratios, net_ratios, gate_ratios, agent_ns, bare_ns = [], [], [], [], []
            for r in range(rounds):
                runs: list[tuple[str, Callable[[], int]]] = [
                    ("agent", lambda: _time_method(agent, n)), ("bare", lambda: _time_function(n)),
                    ("gate", lambda: _time_method(gate, n)), ("empty", lambda: _time_empty(n)),
                ]
                if r % 2:
                    runs.reverse()
                times = {name: fn() for name, fn in runs}
                t_agent, t_bare, empty = times["agent"], times["bare"], times["empty"]
                ratios.append(t_agent / t_bare)
                net_ratios.append(max(1, t_agent - empty) / max(1, t_bare - empty))
                gate_ratios.append(times["gate"] / t_bare)
                agent_ns.append(t_agent / n)
                bare_ns.append(t_bare / n)
            assert not agent._parking.pending, "a pause was pending during the idle benchmark"
            events = _profile_one_call(step, 10**6)
            bare_events = _profile_one_call(bare, 10**6)
            alloc_peak = _transient_bytes(step, 5_000)
            bare_peak = _transient_bytes(bare, 5_000)
    c_calls = [name for kind, name in events if kind == "c_call"]
    py_calls = [name for kind, name in events if kind == "call"]
    result.add(rounds_metric("agent.step(i) / bare(i), same loop", ratios, "x", target="<= 1.5x",
                             ok=lambda v: v <= 1.5, note=f"{n:,} calls per round, order alternating"))
    result.add(rounds_metric("step() / bare call, loop subtracted", net_ratios, "x",
                             note="(t_step - t_empty_loop) / (t_bare - t_empty_loop)"))
    result.add(rounds_metric("idle step() per call", agent_ns, "ns"))
    result.add(rounds_metric("bare call per call", bare_ns, "ns"))
    result.add(rounds_metric("reference: slotted object's step() / bare(i)", gate_ratios, "x",
                             note="not the library: one store and one compare on a slotted object"))
    result.add(single_metric("C calls (locks, clocks, syscalls) in step()", len(c_calls), "",
                             target="0", ok=lambda v: v == 0, note=", ".join(c_calls)))
    result.add(single_metric("bytes allocated per idle step (peak)", alloc_peak - bare_peak, "B",
                             target="0", ok=lambda v: v <= 0,
                             note=f"tracemalloc peak over the bare call's ({bare_peak} B), with step(i) given; "
                                  "step() without a number counts its own (one int past 256)"))
    result.details["step_events"] = events
    result.details["bare_events"] = bare_events
    result.details["python_calls_in_step"] = py_calls


# -- idle CPU and memory, in child processes -------------------------------------------------------


def _rss_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    try:  # proportional set size: shared library pages divided among the processes mapping them
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Pss":
                out["Pss"] = int(value.split()[0])
    except OSError:
        pass
    return out


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, named by Python thread name or kernel comm."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        name = names.get(int(task.name), comm)
        out[name] = out.get(name, 0.0) + cpu
    return out


def child_main(mode: str, server: str, seconds: float, settle: float, job: str = JOB) -> dict[str, Any]:
    """Run in a child: import what ``mode`` says, maybe start an agent (or the floor) for ``job``, idle,
    report."""
    if "torch" in mode:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        import warnings

        warnings.filterwarnings("ignore")
        import torch  # noqa: F401
    agent = None
    floor = None
    if mode == "floor":
        from benchmarks._servers import FloorLeader

        floor = FloorLeader(server, job)
    elif mode == "member":  # every rank but the leader: coordination only, no ClusterD client
        quiet_logging()
        from nicswitch_agent import SwitchAgent
        from nicswitch_agent.coordination import InProcessStore

        agent = SwitchAgent(server=server, job_id=job, pause="agent", switch_hook=lambda order: True,
                            rank=1, world_size=2, store=InProcessStore())
        agent.start()
    elif "agent" in mode:
        quiet_logging()
        from nicswitch_agent import SwitchAgent

        agent = SwitchAgent(server=server, job_id=job, pause="agent", switch_hook=lambda order: True)
        agent.start()
    time.sleep(settle)
    if agent is not None and mode != "member":
        # "connected" means a stream established (in flight on a READY channel for 0.5 s, since
        # ClusterD sends nothing on subscribe): wait for it, bounded, before measuring idle.
        deadline = time.monotonic() + 10.0
        while not agent.status().get("connected") and time.monotonic() < deadline:
            time.sleep(0.05)
    status = agent.status() if agent is not None else {}
    report: dict[str, Any] = {"mode": mode, "rss": _rss_kb()}
    if seconds > 0:
        threads_before = _thread_cpu()
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        cpu1, wall1 = time.process_time(), time.monotonic()
        threads_after = _thread_cpu()
        report["cpu_s"] = cpu1 - cpu0
        report["window_s"] = wall1 - wall0
        report["threads"] = {k: round(v - threads_before.get(k, 0.0), 3) for k, v in threads_after.items()
                             if v - threads_before.get(k, 0.0) > 0}
    report["threads_alive"] = sorted(t.name for t in threading.enumerate())
    report["grpc_imported"] = "grpc" in sys.modules
    report["native_threads"] = len(list(Path("/proc/self/task").iterdir()))
    if agent is not None:
        report["connected"] = bool(status.get("connected"))
        report["process_manage_open"] = bool((status.get("process_manage") or {}).get("stream_open"))
        agent.stop()
    if floor is not None:
        report["connected"] = report["process_manage_open"] = floor.streams_open()
        report["opens"] = dict(floor.opens)
        floor.close()
    return report


def _start_child(mode: str, server: str, seconds: float, settle: float, job: str = JOB) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.idle", "--child", mode, "--server", server, "--seconds", str(seconds),
         "--settle", str(settle), "--job", job],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _child_report(mode: str, proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"idle child {mode!r} failed ({proc.returncode}): {stderr[-2000:]}")
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return report


def _run_child(mode: str, server: str, seconds: float, settle: float) -> dict[str, Any]:
    return _child_report(mode, _start_child(mode, server, seconds, settle), seconds + settle + 120)


def _run_side_by_side(modes: tuple[str, ...], server: str, seconds: float, settle: float) -> list[dict[str, Any]]:
    """Run the children at the same time, so that load from other processes hits them alike."""
    procs = [(mode, _start_child(mode, server, seconds, settle, FLOOR_JOB if mode == "floor" else JOB))
             for mode in modes]
    return [_child_report(mode, proc, seconds + settle + 120) for mode, proc in procs]


def _pct(report: dict[str, Any]) -> float:
    return 100.0 * float(report["cpu_s"]) / float(report["window_s"])


def _by_thread(report: dict[str, Any]) -> str:
    """``name 0.09 s, ...``: CPU seconds per thread over the window, largest first."""
    threads = sorted(report["threads"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {cpu:.2f} s" for name, cpu in threads)


def run_idle_process(settings: Settings, result: BenchResult) -> None:
    from nicswitch_agent.sim import SimJob, SimSettings, Simulator

    window = settings.pick(2.0, 60.0)
    settle = settings.pick(0.5, 3.0)
    # Real ClusterD timings: a keep-alive signal on the process-manage stream every 5 s.
    # The floor holds the same two streams for a job of its own (two process-manage clients for one
    # job would fight), against the same simulator, during the same window as the agent.
    jobs = [SimJob(job_id=job, nodes={"node-0": ["0"]}) for job in (JOB, FLOOR_JOB)]
    with Simulator(jobs=jobs, settings=SimSettings(shuffle_nodes=False)) as sim:
        bare_report = _run_child("bare", sim.address, 0, settle)
        agent_report, floor_report = _run_side_by_side(("agent", "floor"), sim.address, window, settle)
        member_report = _run_child("member", sim.address, 0, settle)
        torch_reports: dict[str, dict[str, Any]] = {}
        if not settings.quick:
            torch_reports["torch"] = _run_child("torch", sim.address, 0, settle)
            torch_reports["torch+agent"] = _run_child("torch+agent", sim.address, 0, settle)
    if not agent_report.get("connected") or not agent_report.get("process_manage_open"):
        raise RuntimeError(f"the idle agent was not connected: {agent_report}")
    if not floor_report.get("connected"):
        raise RuntimeError(f"the bare grpcio floor did not hold its two streams: {floor_report}")
    cpu_pct, floor_pct = _pct(agent_report), _pct(floor_report)
    budget = 1.5 * floor_pct + 0.1
    rss_delta_mb = (agent_report["rss"]["VmRSS"] - bare_report["rss"]["VmRSS"]) / 1024
    result.add(single_metric(f"idle agent CPU over {window:g} s", cpu_pct, "% of a core", target="< 0.5 %",
                             ok=lambda v: v < 0.5,
                             note="leader, pause mode agent, streams open; 5 s keep-alives, 10 s pings; "
                                  f"per thread: {_by_thread(agent_report)}"))
    result.add(single_metric(f"floor: bare grpcio holding the same two streams, CPU over {window:g} s", floor_pct,
                             "% of a core", note="same simulator, same channel options, measured at the same time; "
                                                 f"per thread: {_by_thread(floor_report)}"))
    result.add(single_metric("idle agent CPU / floor, same run", cpu_pct / floor_pct if floor_pct else float("nan"),
                             "x", target="<= 1.5x floor + 0.1 % of a core", ok=lambda _v: cpu_pct <= budget,
                             note=f"agent {cpu_pct:.3f} %, floor {floor_pct:.3f} %, budget {budget:.3f} %"))
    result.add(single_metric("RSS: agent process - bare python", rss_delta_mb, "MB", target="< 15 MB",
                             ok=lambda v: v < 15,
                             note=f"bare {bare_report['rss']['VmRSS'] / 1024:.1f} MB, with agent "
                                  f"{agent_report['rss']['VmRSS'] / 1024:.1f} MB"))
    result.add(single_metric("RSS, private part (RssAnon): agent - bare", (agent_report["rss"]["RssAnon"]
                                                          - bare_report["rss"]["RssAnon"]) / 1024, "MB",
                             note="the rest is file-backed: grpcio's and protobuf's shared libraries (only the "
                                  "leader loads them; members do not import grpc)"))
    result.add(single_metric("RSS: member process - bare python", (member_report["rss"]["VmRSS"]
                                                                    - bare_report["rss"]["VmRSS"]) / 1024, "MB",
                             target="< 15 MB", ok=lambda v: v < 15,
                             note="every rank but the leader: no grpcio/protobuf import (grpc imported: "
                                  f"{member_report['grpc_imported']})"))
    if torch_reports:
        t, ta = torch_reports["torch"], torch_reports["torch+agent"]
        result.add(single_metric("RSS: torch+agent - torch process", (ta["rss"]["VmRSS"] - t["rss"]["VmRSS"]) / 1024,
                                 "MB", target="< 15 MB", ok=lambda v: v < 15,
                                 note="the realistic case: a training process already has torch loaded"))
    result.details["children"] = {"bare": bare_report, "agent": agent_report, "floor": floor_report,
                                  "member": member_report,
                                  **torch_reports}


def run(settings: Settings) -> BenchResult:
    result = BenchResult("idle", "1. idle cost: step() against a bare call; idle CPU and memory")
    run_step_ratio(settings, result)
    run_idle_process(settings, result)
    result.limits = (
        "step() is pure Python attribute work (no C calls), so its cost is the interpreter's: one method "
        "call plus a few attribute loads and stores. Idle CPU is gRPC's and the process-manage stream's "
        "(a keep-alive signal every 5 s, HTTP/2 pings every 10 s); memory is mostly grpcio/protobuf's import."
    )
    return result


def _cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--job", default=JOB)
    args = parser.parse_args()
    report = child_main(args.child, args.server, args.seconds, args.settle, args.job)
    print(json.dumps(report))


if __name__ == "__main__":
    _cli()
