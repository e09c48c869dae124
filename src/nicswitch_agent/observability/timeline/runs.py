"""Runs: events files appended to by more than one run of a job, told apart.

An ``events_file`` with ``{rank}`` in it is opened for appending, so a job restarted under the same
job id, training processes restarted by their launcher, or the same script run twice write their
events after the earlier run's. The leader numbers its rank lists from 1 in each run, so without
this the page would draw two runs' list 1 as one switch.

**A process**, in the files: the events of one ``(rank, pid)`` from one ``agent_started`` to the
next (a pid reused by a restarted container, or an agent started twice in one process, starts
again at its ``agent_started``). **A run**: processes whose events overlap in time on the leader's
clock (a launcher's leader outlives the training processes it restarts: one run). Processes whose
clock could not be aligned (no leader timestamps in their events: an older agent) cannot be placed
by time on the leader's clock; each joins the run it overlaps on its own clock, else the nearest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter

from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.timeline.clocks import Source
from nicswitch_agent.observability.timeline.reading import Record

_KIND, _WALL = itemgetter(Record._fields.index("kind")), itemgetter(Record._fields.index("wall"))


@dataclass(slots=True)
class Process:
    """One process's events from one start of its agent (on its own clock; ``shift`` moves them
    onto the leader's)."""

    source: Source
    records: list[Record]
    shift: float
    start: float = 0.0  # the first and last event, on the leader's clock
    end: float = 0.0
    anchored: bool = True  # its place on the leader's clock is known (the leader, or sent_at)
    leader: bool = False


@dataclass
class Run:
    """Processes of the job that ran together. ``number`` counts runs from 1 in time order."""

    number: int
    start: float  # its first and last event, on the leader's clock
    end: float
    processes: list[Process] = field(default_factory=list)
    first_switch: int | None = None  # the page's numbers of its switches (None: it has none)
    last_switch: int | None = None

    @property
    def leader_pids(self) -> list[int]:
        return sorted({p.source[1] for p in self.processes if p.source[1] is not None and p.leader})


def split(by_source: dict[Source, list[Record]], offset: dict[Source, float], leaders: set[Source],
          is_leader: Callable[[Record], bool]) -> list[Process]:
    """Each source's records (in file order) cut at every ``agent_started`` after its first.
    ``leaders``: the sources with any of the leader's events."""
    found = []
    for source, records in by_source.items():
        kinds = list(map(_KIND, records))  # map and itemgetter: C speed, for 16,384 ranks' records
        chunks = [records]
        if kinds.count(ev.AGENT_STARTED) > 1:
            first = kinds.index(ev.AGENT_STARTED)
            cuts = [i for i, kind in enumerate(kinds) if kind == ev.AGENT_STARTED and i > first]
            chunks = [records[a:b] for a, b in zip([0, *cuts], [*cuts, len(records)], strict=True)]
        shift = offset[source]
        for chunk in chunks:
            walls = list(map(_WALL, chunk))
            leader = source in leaders and (len(chunks) == 1 or any(is_leader(r) for r in chunk))
            anchored = leader or any(r.detail.get("sent_at") is not None for r in chunk)
            found.append(Process(source, chunk, shift, min(walls) - shift, max(walls) - shift, anchored, leader))
    return found


def group(found: list[Process]) -> list[Run]:
    """Runs: anchored processes that overlap in time, joined; then each other process into the run
    it overlaps, else the nearest one. Numbered in time order."""
    anchors = sorted((p for p in found if p.anchored), key=lambda p: p.start) or sorted(found, key=lambda p: p.start)
    runs: list[Run] = []
    for process in anchors:
        if runs and process.start <= runs[-1].end:
            runs[-1].end = max(runs[-1].end, process.end)
        else:
            runs.append(Run(len(runs) + 1, process.start, process.end))
        runs[-1].processes.append(process)
    for process in found:
        if process.anchored or not any(p.anchored for p in found):
            continue
        run = min(runs, key=lambda r: max(0.0, r.start - process.end, process.start - r.end))
        run.processes.append(process)
    return runs
