"""Benchmark: ``nicswitch-agent timeline`` on a 16,384-rank job (targets: under 5 s, a page under 5 MB).

The events are synthetic but shaped like a real job's files: one file per rank, written as
``JsonlEventSink`` writes them, with two switches (pause, park, guard, switch, outcome, resume on
every rank; the leader's list, switch_done and reply on rank 0), every rank's clock off by up to
a second, a straggler rank per switch. Timed: reading every file, aligning, laying out (one lane
per node of 8 ranks) and rendering the HTML page, in this process, best of a few rounds.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import BenchResult, Settings, single_metric

JOB = "bench-timeline"
RANKS = 16_384
TARGET_S = 5.0
TARGET_MB = 5.0


def _record(event: str, who: int, wall: float, seq: int | None = None, /, **detail: Any) -> str:
    return json.dumps({"kind": event, "job_id": JOB, "rank": who, "seq": seq, "wall": wall, "time": "",
                       "mono": wall - 1.7e9, "pid": 1000 + who, "detail": detail}, sort_keys=True)


def write_events(directory: Path, ranks: int, seed: int, switches: int = 2) -> int:
    """One events file per rank under ``directory``; returns the number of events written."""
    rng = random.Random(seed)
    base = 1_800_000_000.0
    skew = [0.0] + [rng.uniform(-1.0, 1.0) for _ in range(ranks - 1)]  # each host's clock error
    lines: list[list[str]] = [[_record("agent_started", r, base + skew[r], rank=r, role="member")]
                              for r in range(ranks)]
    lines[0][0] = _record("agent_started", 0, base, rank=0, role="leader", world_size=ranks)
    for seq in range(1, switches + 1):
        t = base + 10.0 * seq
        slow = rng.randrange(ranks)
        answers = []
        for r in range(ranks):
            delay = rng.uniform(0.0002, 0.002)
            parked = t + delay + rng.uniform(0.001, 0.02) + (0.05 if r == slow else 0.0)
            order = t + 0.08
            guard = order + delay + rng.uniform(0.0005, 0.003)
            answer = guard + rng.uniform(0.0005, 0.004) + (0.02 if r == slow else 0.0)
            answers.append(answer)
            resumed = t + 0.2 + delay
            own = skew[r]
            lines[r] += [
                _record("pause_requested", r, t + delay + own, epoch=seq, completed_step=100 * seq, sent_at=t),
                _record("parked", r, parked + own, epoch=seq, step=100 * seq + 1),
                _record("guard_done", r, guard + own, seq, rank=r, ok=True, skipped=False, status="ok", detail="ok",
                        duration_s=guard - order - delay, epoch=seq, sent_at=order),
                _record("member_result", r, answer + own, seq, rank=r, kind="switch", ok=True, reason="switched",
                        duration_s=answer - order - delay, parked=True, epoch=seq, sent_at=order),
                _record("switch_outcome", r, t + 0.15 + delay + own, seq, rank=r, kind="switch", ok=True,
                        reason="ok on every rank", epoch=seq, sent_at=t + 0.15),
                _record("resumed", r, resumed + own, step=100 * seq + 1, parked_s=resumed - parked, stop=None,
                        interrupted=None),
            ]
        lines[0] += [
            _record("list_received", 0, t + 0.079, seq, ranks=8, to_standby=8, to_primary=0),
            _record("switch_done", 0, max(answers) + 0.001, seq, ok=True, reason="switched on every rank",
                    ranks=ranks, duration_s=max(answers) - t - 0.08),
            _record("reply_sent", 0, t + 0.16, seq, result=True, reason="switched on every rank",
                    outcome="delivered", attempts=1, duration_s=0.001, code=0),
        ]
    directory.mkdir(parents=True, exist_ok=True)
    for r, rank_lines in enumerate(lines):
        (directory / f"events-{r}.jsonl").write_text("\n".join(rank_lines) + "\n", encoding="utf-8")
    return sum(len(rank_lines) for rank_lines in lines)


def run(settings: Settings) -> BenchResult:
    from nicswitch_agent.observability.timeline import build, read_events, render_html

    ranks = settings.pick(512, RANKS)
    rounds = settings.pick(1, 3)
    result = BenchResult("timeline", f"timeline page of a {ranks:,}-rank job, two switches (read, align, lay out, "
                                     "render)")
    with tempfile.TemporaryDirectory(prefix="nicswitch-bench-timeline-") as tmp:
        directory = Path(tmp) / "events"
        events = write_events(directory, ranks, settings.seed)
        times, cpu, size, lanes = [], [], 0, 0
        for _ in range(rounds):
            started, cpu_started = time.perf_counter(), time.process_time()
            timeline = build(read_events([str(directory)]))
            page = render_html(timeline)
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            size = len(page.encode("utf-8"))
            lanes = len(timeline.switches[0].lanes)
        counts = {st.count for s in timeline.switches for st in s.stats}
        if timeline.problems or len(timeline.switches) != 2 or timeline.ranks_seen != ranks or counts != {ranks}:
            raise RuntimeError(f"the synthetic job did not come out whole: {timeline.problems}")
    full = not settings.quick
    result.add(single_metric("render_s", min(times), "s", target=f"< {TARGET_S:g} s at {RANKS:,} ranks" if full else "",
                             ok=(lambda v: v < TARGET_S) if full else None,
                             note=f"best of {rounds}; {events:,} events in {ranks:,} files"))
    result.add(single_metric("render_cpu_s", min(cpu), "s", note="CPU time of this process (what the wall time "
                                                                "is on an idle core)"))
    result.add(single_metric("page_mb", size / 1e6, "MB", target=f"< {TARGET_MB:g} MB" if full else "",
                             ok=(lambda v: v < TARGET_MB) if full else None, note=f"{lanes} lanes per switch"))
    result.details = {"ranks": ranks, "events": events, "rounds_s": [round(t, 3) for t in times],
                      "rounds_cpu_s": [round(t, 3) for t in cpu], "page_bytes": size}
    result.limits = ("synthetic events (the shape of a real job's files), one process, files in the page cache "
                     "(written just before)")
    return result
