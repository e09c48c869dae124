"""Benchmark: what a verified switch costs (issue 19's target: < 5 ms p50 more per switch on the
4-process gloo job, and no change to the idle ``step()``).

The same 4-process gloo job as benchmark 4 (benchmarks/e2e.py: pause mode agent, no-op switch hook,
10 ms steps, the simulator as ClusterD), once without and once with a TorchLinkProbe on the default
group as verify hook, alternating so that both see the same machine load. With the probe a switch
has a second round (the leader publishes a ``verify`` order once every rank's switch hook returned,
and gathers the results) and each rank replays one one-element all_reduce; the first switch also
warms the probe op up. ``agent overhead`` is e2e's: total - hooks - waiting for the step boundary
(the probe's time is part of it, as it is part of the switch).

The idle step is timed in this process: ``agent.step(i)`` of an agent with a verify hook and of one
without (neither started: ``step()`` reads the same two attributes either way).
"""

from __future__ import annotations

import time

from benchmarks._common import ROOT, BenchResult, Settings, dist_metric, median, single_metric
from benchmarks.e2e import Phase, analyse, column, run_process_group

STEP_S = 0.01
IDLE_CALLS = 1_000_000


def _idle_step_ns(calls: int) -> tuple[float, float]:
    """ns per ``agent.step(i)``: (without a verify hook, with one), the best of 7 alternating runs."""
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.coordination import InProcessStore

    agents = [SwitchAgent(server="127.0.0.1:1", job_id="bench-idle", store=InProcessStore(), world_size=1,
                          switch_hook=lambda order: True, verify_hook=(lambda order: True) if verify else None)
              for verify in (False, True)]
    best = [float("inf"), float("inf")]
    for _ in range(7):
        for index, agent in enumerate(agents):
            started = time.perf_counter_ns()
            for i in range(calls):
                agent.step(i)
            best[index] = min(best[index], (time.perf_counter_ns() - started) / calls)
    return best[0], best[1]


def run(settings: Settings) -> BenchResult:
    result = BenchResult("e2e_probe", "19. verified switches: 4 gloo processes, with and without TorchLinkProbe, "
                                      "10 ms steps")
    started = time.monotonic()
    log_dir = ROOT / "bench-results" / "logs"
    rounds = settings.pick(1, 2)
    switches = settings.pick(2, 15)
    world = settings.pick(2, 4)
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    verifies: list[float] = []
    allreduces: list[float] = []
    for round_index in range(rounds):
        for probe in (False, True):
            phase = Phase("probe" if probe else "plain", STEP_S, switches)
            ranks = run_process_group(world, [phase], settings.seed + 300 + 2 * round_index + probe, log_dir,
                                      probe=probe)
            rows[probe] += analyse(phase.records, ranks)
            if probe:
                verifies += [v for r in ranks for v in r.get("verifies", [])]
            allreduces += [v for r in ranks for v in r.get("allreduce_s", [])]
    plain, probed = rows[False], rows[True]
    for label, data in (("without a verify hook", plain), ("with TorchLinkProbe", probed)):
        result.add(dist_metric(f"{label}: total", column(data, "total"), "ms"))
        result.add(dist_metric(f"{label}: agent overhead (total - hooks - boundary)", column(data, "agent_overhead"),
                               "ms"))
        result.add(dist_metric(f"{label}: order coordination (order + verify rounds)",
                               column(data, "order_coordination"), "ms"))
    added = median(column(probed, "agent_overhead")) - median(column(plain, "agent_overhead"))
    result.add(single_metric("added switch overhead (p50 with - p50 without)", added, "ms", target="< 5 ms",
                             ok=lambda v: v < 5))
    added_order = median(column(probed, "order_coordination")) - median(column(plain, "order_coordination"))
    result.add(single_metric("added order coordination (p50 with - p50 without)", added_order, "ms",
                             note="the verify round alone: publish, every rank's probe, gather"))
    result.add(dist_metric("one rank's verify hook (the probe's all_reduce, on the parked training thread)",
                           [v * 1000 for v in verifies], "ms"))
    result.add(dist_metric("floor: the training step's own all_reduce (one float, same jobs)",
                           [v * 1000 for v in allreduces], "ms",
                           note="what one small collective costs on this machine now; the probe's is the same op"))
    calls = settings.pick(100_000, IDLE_CALLS)
    without, with_hook = _idle_step_ns(calls)
    result.add(single_metric("idle step(): without a verify hook", without, "ns", note="best of 7, alternating"))
    result.add(single_metric("idle step(): with a verify hook", with_hook, "ns", note="best of 7, alternating; "
                             "step() is the same code either way"))
    result.details = {"switches_per_job": switches, "rounds": rounds, "world": world, "step_s": STEP_S}
    result.limits = (
        "2 shared cores run 4 training processes, the simulator and this operator: the two jobs' medians differ by "
        "noise of a few ms as well as by the probe, so the jobs alternate and the difference of medians is the "
        "headline; 'order coordination' isolates the rounds the probe adds."
    )
    result.duration_s = time.monotonic() - started
    return result
