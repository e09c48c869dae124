"""The timeline in a few lines of text, for the terminal (``nicswitch-agent timeline`` prints it)."""

from __future__ import annotations

from nicswitch_agent.observability.timeline.model import Timeline
from nicswitch_agent.observability.timeline.render import (
    _ms,
    _verdict_word,
    alignment_text,
    runs_text,
    span_text,
    switch_name,
)


def summary_text(timeline: Timeline) -> str:
    """Per switch: its verdict, ranks and step, the phases' p50/p99/max, who everyone waited for;
    then what is missing and how the clocks were aligned."""
    lines = [f"job {timeline.job_id}: {len(timeline.switches)} switch(es), {timeline.ranks_seen} of "
             f"{timeline.ranks_expected} rank(s) with events, {timeline.files} file(s)"]
    lines.extend(runs_text(timeline))
    several = len(timeline.runs) > 1
    for s in timeline.switches:
        step = f", parked at step {s.step}" if s.step is not None else ""
        lines.append(f"{switch_name(s, several).lower()}: {_verdict_word(s.ok)} ({s.reason}); {s.ranks_seen} of "
                     f"{s.ranks_expected} ranks{step}; {span_text(s)}")
        for st in s.stats:
            lines.append(f"  {st.phase:<10} p50 {_ms(st.p50):>10}  p99 {_ms(st.p99):>10}  max {_ms(st.max):>10}"
                         f"  (rank {st.max_rank}, {st.count} ranks)")
        if s.slowest:
            answers = (f"rank {rank} (+{_ms(at)}{'' if what == 'answered' else ', failed'})"
                       for rank, at, what in s.slowest)
            lines.append("  last to answer: " + ", ".join(answers))
        lines.extend(f"  waited for: {c}" for c in s.critical)
        lines.extend(f"  missing: {m}" for m in s.missing)
        lines.extend(f"  after it ended: +{_ms(m.at)} {m.label}" for m in s.after)
    lines.extend(f"note: {p}" for p in timeline.problems)
    lines.append(alignment_text(timeline))
    return "\n".join(lines) + "\n"
