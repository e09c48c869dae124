"""From a job's events to what the timeline page shows: switches, lanes, bars, the critical path.

Pure data, no drawing: the page (render.py) and the text summary (summary.py) only read a
:class:`Timeline`, and the tests check it without rendering anything.

**Clocks** are aligned on the leader's first (clocks.py).

**Which switch.** ``guard_done``, ``member_result`` and ``switch_outcome`` carry the leader's
list number (``seq``) and the pause they ran in (``epoch``); ``pause_requested`` and ``parked``
carry that epoch, and ``resumed`` is the first one after ``parked`` in the same process. A
``recovery`` carries the failed switch's list number: ClusterD's recovery is part of that switch
(its ranks stay parked through it).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.links import compact_ranks
from nicswitch_agent.observability.timeline import runs
from nicswitch_agent.observability.timeline.clocks import Alignment, Source, align, number
from nicswitch_agent.observability.timeline.reading import EventSet, Record, collecting_later
from nicswitch_agent.observability.timeline.runs import Run

AGGREGATE_ABOVE = 256  # rank lanes per switch; above this, one lane per node
DEFAULT_RANKS_PER_NODE = 8
PHASES = ("pause", "parked", "guard", "switch", "verify")
"""The phases the page knows (a bar of any other name is drawn as a generic phase)."""
VERIFY_PREFIX = "verify"  # events ``verify_*`` with a ``duration_s`` are the verify phase
_LEADER_KINDS = frozenset({ev.LIST_RECEIVED, ev.LIST_REJECTED, ev.SWITCH_DONE, ev.REPLY_SENT, ev.REPLY_FAILED,
                           ev.RECOVERY, ev.TRAINING_STOP, ev.STREAM_LOST, ev.STREAM_RESTORED, ev.AGENT_FAILED,
                           ev.SUBSCRIBED, ev.PAUSE_FAILED})
_LEADER_ONLY = frozenset({ev.LIST_RECEIVED, ev.LIST_REJECTED, ev.SWITCH_DONE, ev.REPLY_SENT, ev.REPLY_FAILED,
                          ev.RECOVERY, ev.SUBSCRIBED})
# Without a list number (a recovery: when no switch of its pause failed): drawn where they fall
_UNSEQUENCED_LEADER = frozenset({ev.RECOVERY, ev.TRAINING_STOP, ev.STREAM_LOST, ev.STREAM_RESTORED, ev.AGENT_FAILED,
                                 ev.PAUSE_FAILED})
_FAR_S = 60.0  # a rank without leader timestamps this far from the leader's times: say its clock may differ


class Bar(NamedTuple):
    """One phase on a lane, in seconds from the switch's start. ``ok`` False: it failed."""

    phase: str
    start: float
    end: float
    ok: bool = True
    note: str = ""


class Mark(NamedTuple):
    """A moment on a lane (the leader's messages, a rank resuming), in seconds from the switch's start."""

    at: float
    label: str
    ok: bool = True


@dataclass(slots=True)
class Lane:
    """One row: a rank, or a node (its slowest rank's bars, with the spread of its ranks' answers)."""

    label: str
    rank: int  # the rank whose bars are shown
    bars: list[Bar] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    ranks: int = 1  # ranks this lane stands for
    spread: tuple[float, float] | None = None  # node lanes: first and last answer of its ranks
    failed: int = 0  # ranks of this lane whose part failed
    critical: str = ""  # why everyone waited for this lane, or ""
    unfinished: bool = False  # no result from (one of) its rank(s)


@dataclass(frozen=True)
class PhaseStats:
    phase: str
    count: int
    p50: float
    p99: float
    max: float
    max_rank: int


@dataclass
class Switch:
    """One rank list of the job, on the leader's clock: from its first event to its last (the pause
    sent, the list, the order, the outcome, the reply, the ranks resuming); nothing later stretches it."""

    seq: int  # the page's number for it, which ``--switch`` takes: runs are numbered on in order
    start_wall: float  # the leader's wall clock at time 0 of this switch
    duration: float
    ok: bool | None  # None: the events do not say how it ended
    reason: str
    ranks_expected: int
    ranks_seen: int
    step: int | None
    leader: list[Mark] = field(default_factory=list)
    after: list[Mark] = field(default_factory=list)  # the leader's later events (a stream lost), not drawn
    lanes: list[Lane] = field(default_factory=list)
    by_node: bool = False
    ranks_per_node: int = 1
    stats: list[PhaseStats] = field(default_factory=list)
    slowest: list[tuple[int, float, str]] = field(default_factory=list)  # (rank, answered at, what)
    critical: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    list_seq: int = 0  # the leader's list number (``seq`` is the page's: the same with one run)
    run: int = 1  # the run it belongs to (runs.py)


@dataclass
class Timeline:
    job_id: str
    switches: list[Switch]
    alignment: Alignment
    problems: list[str]
    files: int
    ranks_seen: int
    ranks_expected: int
    missing_ranks: list[int]
    runs: list[Run] = field(default_factory=list)  # more than one: the files hold several runs of the job


# -- building ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pause:
    requested: float | None = None
    parked: float | None = None
    resumed: float | None = None
    step: int | None = None
    stop: str | None = None
    sent_at: float | None = None


@dataclass(slots=True)
class _RankPart:
    """What one rank did for one switch (times on the leader's clock)."""

    epoch: int | None = None
    guard: tuple[float, float, bool, str] | None = None
    result: tuple[float, float, bool, str] | None = None
    guard_answer: tuple[float, float, bool, str] | None = None  # its answer to a guard round (member_result)
    extras: list[Bar] = field(default_factory=list)
    outcome: float | None = None
    order_sent: float | None = None
    outcome_sent: float | None = None


def build(events: EventSet, *, ranks_per_node: int = DEFAULT_RANKS_PER_NODE,
          aggregate_above: int = AGGREGATE_ABOVE, only_switch: int | None = None) -> Timeline:
    """The timeline of ``events`` (one job's). ``only_switch``: just that list number."""
    with collecting_later():
        return _build(events, ranks_per_node, aggregate_above, only_switch)


def _build(events: EventSet, ranks_per_node: int, aggregate_above: int, only_switch: int | None) -> Timeline:
    problems = list(events.problems)
    by_source: dict[Source, list[Record]] = defaultdict(list)
    for record in events.records:
        by_source[(record.rank, record.pid)].append(record)
    leaders = {s for s, recs in by_source.items() if any(_is_leader(r) for r in recs)}
    alignment, offset = align(by_source, leaders)
    ranks_seen = {source[0] for source in by_source if source[0] is not None}
    # The launcher's leader writes "rank": "leader" (read as None): it is no rank, and found by its events.
    no_rank = sum(len(records) for source, records in by_source.items() if source[0] is None and source not in leaders)
    job_runs = runs.group(runs.split(by_source, offset, leaders, _is_leader))
    walked: list[tuple[dict[int, dict[int, _RankPart]], dict[int, dict[int, _Pause]], list[tuple[float, Record]]]] = []
    for run in job_runs:
        parts: dict[int, dict[int, _RankPart]] = defaultdict(dict)  # seq -> rank -> part
        pauses: dict[int, dict[int, _Pause]] = defaultdict(dict)  # rank -> epoch -> pause
        leader_events: list[tuple[float, Record]] = []
        for process in run.processes:
            process.records.sort(key=lambda r: r.mono if r.mono is not None else r.wall)
            _walk(process.records, process.shift, process.source[0], parts, pauses, leader_events)
        walked.append((parts, pauses, leader_events))
    if no_rank:
        problems.append(f"{no_rank} event(s) without a rank (written before the agent knew it): left out of "
                        "the rank lanes")
    expected = _expected_ranks(events.records, ranks_seen)
    missing_ranks = sorted(set(range(expected)) - ranks_seen)
    if missing_ranks:
        problems.append(f"no events at all from {_ranks_text(missing_ranks)} of {expected}: their events files are "
                        "missing (or they never started)")
    if not alignment.leader_found:
        problems.append("no events of the leader (rank 0's file, or the launcher's, is missing): the leader's "
                        "messages are not shown; clocks were aligned by the leader's timestamps the ranks received")
    far = _far_unaligned(alignment, by_source, [e for _, _, leader_events in walked for e in leader_events])
    if far:
        problems.append(far)
    # The page numbers switches in order across runs: a run's lists follow the last number of the
    # run before it (with one run, a switch's number is the leader's list number).
    numbered: list[tuple[int, int, int]] = []  # (number, the leader's list number, run index)
    base = 0
    for index, (run, (parts, _, leader_events)) in enumerate(zip(job_runs, walked, strict=True)):
        seqs = sorted(set(parts) | {r.seq for _, r in leader_events if r.seq is not None and r.kind in _LEADER_ONLY})
        if seqs:
            run.first_switch, run.last_switch = base + seqs[0], base + seqs[-1]
            numbered += [(base + seq, seq, index) for seq in seqs]
            base += seqs[-1]
    if only_switch is not None:
        if only_switch not in {n for n, _, _ in numbered}:
            problems.append(f"switch {only_switch} is not in these events (switches found: "
                            f"{', '.join(str(n) for n, _, _ in numbered) or 'none'})")
        numbered = [item for item in numbered if item[0] == only_switch]
    switches = []
    for index, (run, (parts, pauses, leader_events)) in enumerate(zip(job_runs, walked, strict=True)):
        mine = [_switch(shown, seq, run.number, parts.get(seq, {}), pauses, leader_events, expected, ranks_per_node,
                        aggregate_above) for shown, seq, at in numbered if at == index]
        _attach_unsequenced(mine, leader_events)
        switches += mine
    return Timeline(job_id=events.job_id, switches=switches, alignment=alignment, problems=problems,
                    files=len(events.files), ranks_seen=len(ranks_seen), ranks_expected=expected,
                    missing_ranks=missing_ranks, runs=job_runs)


def _is_leader(record: Record) -> bool:
    return record.kind in _LEADER_ONLY or (record.kind == ev.AGENT_STARTED and record.detail.get("role") == "leader")


def _walk(records: Sequence[Record], shift: float, rank: int | None, parts: dict[int, dict[int, _RankPart]],
          pauses: dict[int, dict[int, _Pause]], leader_events: list[tuple[float, Record]]) -> None:
    """One process's records, in its own order: pauses by epoch, parts by list number."""
    own_pauses = pauses[rank] if rank is not None else {}
    parked_epoch: int | None = None
    results_seen = 0
    last_seq: int | None = None
    for r in records:
        t = r.wall - shift
        kind, d = r.kind, r.detail
        if kind in _LEADER_KINDS:
            leader_events.append((t, r))
            continue
        if rank is None:
            continue
        if kind == ev.PAUSE_REQUESTED:
            epoch = _int(d.get("epoch"))
            if epoch is not None:  # kept if parked came first (one process's threads race to its file)
                pause = own_pauses.setdefault(epoch, _Pause())
                pause.requested, pause.sent_at = t, number(d.get("sent_at"))
        elif kind == ev.PARKED:
            epoch = _int(d.get("epoch"))
            if epoch is not None:
                pause = own_pauses.setdefault(epoch, _Pause())
                pause.parked, pause.step, parked_epoch = t, _int(d.get("step")), epoch
        elif kind == ev.RESUMED:
            if parked_epoch is not None:
                pause = own_pauses[parked_epoch]
                pause.resumed = t
                why = d.get("stop") or d.get("interrupted")
                pause.stop = str(why) if why else None
                parked_epoch = None
        elif kind in (ev.GUARD_DONE, ev.MEMBER_RESULT, ev.SWITCH_OUTCOME) or _is_phase(kind, d):
            seq = r.seq if r.seq is not None else (last_seq if _is_phase(kind, d) else results_seen + 1)
            if seq is None:
                continue
            last_seq = seq
            part = parts[seq].setdefault(rank, _RankPart())
            epoch = _int(d.get("epoch"))
            if epoch is not None:
                part.epoch = epoch
            _take(part, kind, t, d)
            if kind == ev.MEMBER_RESULT and d.get("kind", "switch") == "switch":
                results_seen += 1


def _is_phase(kind: str, detail: dict[str, Any]) -> bool:
    """A phase bar besides the guard and the switch: ``verify_*``, or a kind this version does not
    know, with a ``duration_s`` (the event's time is the phase's end)."""
    phase = kind.startswith(VERIFY_PREFIX) or kind not in ev.EVENT_KINDS
    return phase and number(detail.get("duration_s")) is not None


def _take(part: _RankPart, kind: str, t: float, d: dict[str, Any]) -> None:
    duration = max(0.0, number(d.get("duration_s")) or 0.0)
    ok, note = hook_outcome(d)
    sent = number(d.get("sent_at"))
    if kind == ev.GUARD_DONE:
        part.guard = (t - duration, t, ok, note)
        part.order_sent = part.order_sent if part.order_sent is not None else sent
    elif kind == ev.MEMBER_RESULT:
        what = str(d.get("kind", "switch"))
        if what == "switch":
            part.result = (t - duration, t, ok, note)
            # The first order sent: the guard round's, where one ran before the switch order
            part.order_sent = min(x for x in (sent, part.order_sent) if x is not None) \
                if sent is not None or part.order_sent is not None else None
        elif what == "guard":  # drawn from guard_done; its answer decides a switch whose guard failed
            part.guard_answer = (t - duration, t, ok, note)
        elif what != "verify":  # drawn from verify_done
            part.extras.append(Bar(what, t - duration, t, ok, note))
    elif kind == ev.SWITCH_OUTCOME:
        if d.get("kind", "switch") == "switch":
            part.outcome, part.outcome_sent = t, sent
    else:
        phase = VERIFY_PREFIX if kind.startswith(VERIFY_PREFIX) else kind
        part.extras.append(Bar(phase, t - duration, t, ok, note))


def hook_outcome(detail: dict[str, Any]) -> tuple[bool, str]:
    """Whether a hook's run succeeded, and what to say about it, from either convention the events
    record it in: ``ok`` + ``reason`` (``member_result``, ``verify_done``) or ``ok`` + ``status`` +
    ``detail`` (``guard_done``: the hook runner's status, and ``skipped`` when no guard ran)."""
    ok = detail.get("ok") is not False
    if "status" not in detail and "skipped" not in detail:
        return ok, str(detail.get("reason") or detail.get("detail") or "")
    status = "skipped" if detail.get("skipped") else str(detail.get("status") or "")
    return ok, status if ok else f"{status}: {detail.get('detail', '')}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _expected_ranks(records: Iterable[Record], seen: set[int]) -> int:
    """The job's world size: the leader's word for it, else the highest rank seen + 1."""
    kinds = {ev.SWITCH_DONE: "ranks", ev.AGENT_STARTED: "world_size"}
    sizes = [n for r in records if r.kind in kinds and (n := _int(r.detail.get(kinds[r.kind]))) is not None]
    return max([*sizes, max(seen) + 1 if seen else 0])


def _far_unaligned(alignment: Alignment, by_source: dict[Any, list[Record]],
                   leader_events: list[tuple[float, Record]]) -> str:
    if not alignment.unaligned:
        return ""
    ranks = _ranks_text(alignment.unaligned)
    text = f"{ranks}: no leader timestamps in their events (an older agent?): their raw wall clock is used"
    if leader_events:
        middle = sorted(t for t, _ in leader_events)[len(leader_events) // 2]
        worst = max((abs(r.wall - middle) for s, recs in by_source.items() if s[0] in alignment.unaligned
                     for r in recs[:1]), default=0.0)
        if worst > _FAR_S:
            text += f", up to {_duration_text(worst)} away from the leader's: their bars may be misplaced"
    return text


def _duration_text(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 2-5,9`` (at most 8 runs of consecutive ranks shown)."""
    return f"rank{'s' if len(ranks) != 1 else ''} {compact_ranks(ranks, most=8)}"


def _switch(shown: int, seq: int, run: int, parts: dict[int, _RankPart], pauses: dict[int, dict[int, _Pause]],
            leader_events: list[tuple[float, Record]], expected: int, ranks_per_node: int,
            aggregate_above: int) -> Switch:
    """The switch of the leader's list ``seq`` in ``run``; ``shown``: the page's number for it."""
    mine = [(t, r) for t, r in leader_events if r.seq == seq and r.kind in _LEADER_ONLY]
    by_kind = {r.kind: (t, r) for t, r in mine}
    rank_pauses = {rank: pauses.get(rank, {}).get(part.epoch) for rank, part in parts.items()
                   if part.epoch is not None}
    t0, t1 = _window(mine, parts, rank_pauses)
    done = by_kind.get(ev.SWITCH_DONE)
    size = _int(done[1].detail.get("ranks")) if done else None
    world = size or expected
    answers, in_guard = _answers(parts)
    ok, reason = _verdict(by_kind, answers)
    switch = Switch(seq=shown, start_wall=t0, duration=t1 - t0, ok=ok, reason=reason, ranks_expected=world,
                    ranks_seen=len(parts), step=None, list_seq=seq, run=run)
    switch.leader = _leader_marks(mine, parts, rank_pauses, t0)
    lanes = {rank: _rank_lane(rank, part, rank_pauses.get(rank), t0, t1, answers.get(rank))
             for rank, part in sorted(parts.items())}
    steps = Counter(p.step for p in rank_pauses.values() if p is not None and p.step is not None)
    switch.step = steps.most_common(1)[0][0] if steps else None
    switch.critical = _critical(lanes, answers, rank_pauses, t0, in_guard=in_guard)
    switch.stats = _stats(lanes)
    switch.slowest = _slowest(answers, t0)
    switch.missing = _missing(shown, by_kind, answers, world, rank_pauses)
    if len(lanes) > aggregate_above:
        switch.lanes, switch.by_node, switch.ranks_per_node = _node_lanes(lanes, ranks_per_node), True, ranks_per_node
    else:
        switch.lanes = list(lanes.values())
    return switch


def _window(mine: list[tuple[float, Record]], parts: dict[int, _RankPart],
            rank_pauses: dict[int, _Pause | None]) -> tuple[float, float]:
    """The first and the last moment of a switch: every time any of its events names."""
    lows, highs = [t for t, _ in mine], [t for t, _ in mine]
    for rank, part in parts.items():
        times = [x for x in (part.order_sent, part.outcome, part.outcome_sent) if x is not None]
        times += [x for span in (part.guard, part.result, part.guard_answer) if span for x in span[:2]]
        times += [x for b in part.extras for x in (b.start, b.end)]
        pause = rank_pauses.get(rank)
        if pause is not None:
            times += [x for x in (pause.requested, pause.parked, pause.resumed, pause.sent_at) if x is not None]
        if times:
            lows.append(min(times))
            highs.append(max(times))
    return (min(lows), max(highs)) if lows else (0.0, 0.0)


Answer = tuple[float, float, bool, str]  # a rank's answer that counts for a switch: (start, end, ok, note)


def _answers(parts: dict[int, _RankPart]) -> tuple[dict[int, Answer], bool]:
    """Each rank's answer to the switch: its switch result; where the guard round decided the switch
    (a guard failed: no switch order went out), its answer to that round (then True)."""
    if any(p.result is not None for p in parts.values()) or not any(
            p.guard_answer is not None and not p.guard_answer[2] for p in parts.values()):
        return {rank: p.result for rank, p in parts.items() if p.result is not None}, False
    return {rank: p.guard_answer for rank, p in parts.items() if p.guard_answer is not None}, True


def _verdict(by_kind: dict[str, tuple[float, Record]], answers: dict[int, Answer]) -> tuple[bool | None, str]:
    done = by_kind.get(ev.SWITCH_DONE)
    if done is not None:
        return done[1].detail.get("ok") is True, str(done[1].detail.get("reason", ""))
    rejected = by_kind.get(ev.LIST_REJECTED)
    if rejected is not None:
        return False, f"list rejected: {rejected[1].detail.get('reason', '')}"
    failed = sorted((rank, answer[3]) for rank, answer in answers.items() if not answer[2])
    if failed:
        return False, f"rank {failed[0][0]}: {failed[0][1]}"
    return None, "the leader's switch_done is not in these events"


def _leader_marks(mine: list[tuple[float, Record]], parts: dict[int, _RankPart],
                  rank_pauses: dict[int, _Pause | None], t0: float) -> list[Mark]:
    marks = []
    sent = [p.sent_at for p in rank_pauses.values() if p is not None and p.sent_at is not None]
    if sent:
        marks.append(Mark(min(sent) - t0, "pause sent to the ranks"))
    orders = [p.order_sent for p in parts.values() if p.order_sent is not None]
    if orders:
        marks.append(Mark(min(orders) - t0, "order sent to the ranks"))
    outcomes = [p.outcome_sent for p in parts.values() if p.outcome_sent is not None]
    for t, r in mine:
        d = r.detail
        if r.kind == ev.LIST_RECEIVED:
            marks.append(Mark(t - t0, f"list received from ClusterD: {d.get('ranks')} rank(s), "
                                      f"{d.get('to_standby')} to standby, {d.get('to_primary')} to primary"))
        elif r.kind == ev.LIST_REJECTED:
            marks.append(Mark(t - t0, f"list rejected: {d.get('reason')}", ok=False))
        elif r.kind == ev.SWITCH_DONE:
            marks.append(Mark(t - t0, f"switch done: {d.get('reason')}", ok=d.get("ok") is True))
        elif r.kind == ev.REPLY_SENT:
            at, returned = _reply_sent_at(t, r)
            marks.append(Mark(at - t0, f"reply sent: {str(d.get('result')).lower()}{returned}",
                              ok=d.get("result") is True))
        elif r.kind == ev.REPLY_FAILED:
            at, returned = _reply_sent_at(t, r)
            marks.append(Mark(at - t0, f"reply {d.get('outcome')}: {d.get('error')}{returned}", ok=False))
        elif r.kind == ev.RECOVERY:
            marks.append(Mark(t - t0, *_recovery(d)))
    if outcomes:
        ok = all(m.ok for m in marks if m.label.startswith("switch done"))
        marks.append(Mark(min(outcomes) - t0, "outcome sent to the ranks", ok=ok))
    return sorted(marks, key=lambda m: m.at)


def _recovery(detail: dict[str, Any]) -> tuple[str, bool]:
    """A ``recovery`` event's mark: red when training cannot go on (no rollback to offer, or
    ClusterD chose to stop)."""
    offered = detail.get("offered")
    if detail.get("chosen") is None and offered is not None:
        names = [str(s) for s in offered] if isinstance(offered, list) else [str(offered)]
        return (f"recovery strategies offered to ClusterD: {', '.join(names)}",
                "retry" in names or "recover" in names)
    chosen = detail.get("chosen")
    return f"ClusterD chose the recovery strategy {chosen}", chosen in ("retry", "recover")


def _reply_sent_at(t: float, record: Record) -> tuple[float, str]:
    """When the reply went out (the event is stamped when the call returned, after ClusterD took
    it): ``sent_at``, else (an older agent) when the call began; and a note of when it returned."""
    sent_at = number(record.detail.get("sent_at"))
    if sent_at is not None:
        sent = min(t, sent_at - (record.wall - t))  # on the same clock as t
    else:
        sent = t - max(0.0, number(record.detail.get("duration_s")) or 0.0)
    return sent, (f" (the call returned {(t - sent) * 1000:.1f} ms later)" if t - sent >= 0.0005 else "")


def _rank_lane(rank: int, part: _RankPart, pause: _Pause | None, t0: float, t1: float,
               answer: Answer | None) -> Lane:
    lane = Lane(label=f"rank {rank}", rank=rank)
    bars = lane.bars
    if pause is not None:
        if pause.requested is not None and pause.parked is not None:
            bars.append(Bar("pause", pause.requested - t0, pause.parked - t0, note=f"parked at step {pause.step}"))
        if pause.parked is not None:
            end = pause.resumed if pause.resumed is not None else t1
            bars.append(Bar("parked", pause.parked - t0, end - t0, ok=pause.stop is None,
                            note="never resumed in these events" if pause.resumed is None else (pause.stop or "")))
        if pause.resumed is not None:
            lane.marks.append(Mark(pause.resumed - t0, "resumed" if pause.stop is None else f"stopped: {pause.stop}",
                                   ok=pause.stop is None))
    if part.guard is not None:
        start, end, ok, status = part.guard
        bars.append(Bar("guard", start - t0, end - t0, ok, status))
    if part.result is not None:
        start, end, ok, reason = part.result
        begin = part.guard[1] if part.guard is not None else start
        bars.append(Bar("switch", begin - t0, end - t0, ok, reason))
    if answer is not None:  # its switch result, or its guard round's answer where that decided
        lane.failed = int(not answer[2])
    else:
        lane.unfinished = True
    bars.extend(Bar(b.phase, b.start - t0, b.end - t0, b.ok, b.note) for b in part.extras)
    lane.failed = max(lane.failed, int(any(not b.ok for b in bars if b.phase != "parked")))
    return lane


def _critical(lanes: dict[int, Lane], answers: dict[int, Answer], rank_pauses: dict[int, _Pause | None],
              t0: float, *, in_guard: bool = False) -> list[str]:
    """Who everyone waited for: the rank that parked last, and the one whose answer decided (in a
    guard round, decided once every rank answered: the first failure, and the last to answer)."""
    found = []
    parked = [(p.parked, rank) for rank, p in rank_pauses.items() if p is not None and p.parked is not None]
    if len(parked) > 1:
        t, rank = max(parked)
        lanes[rank].critical = f"parked last (+{(t - t0) * 1000:.1f} ms)"
        found.append(f"rank {rank} {lanes[rank].critical}: every rank waited for it to reach the step boundary")
    failed = [(answer[1], rank) for rank, answer in answers.items() if not answer[2]]
    answered = [(answer[1], rank) for rank, answer in answers.items()]
    if in_guard and failed and max(answered)[1] != min(failed)[1]:
        t, rank = max(answered)
        why = f"answered last (+{(t - t0) * 1000:.1f} ms)"
        lanes[rank].critical = "; ".join(filter(None, [lanes[rank].critical, why]))
        found.append(f"rank {rank} {why}: the guard round is decided once every rank answered")
    if failed:
        t, rank = min(failed)
        why = f"failed first (+{(t - t0) * 1000:.1f} ms)"
        lanes[rank].critical = "; ".join(filter(None, [lanes[rank].critical, why]))
        found.append(f"rank {rank} {why}: its failure decided the switch")
    elif len(answered) > 1:
        t, rank = max(answered)
        why = f"answered last (+{(t - t0) * 1000:.1f} ms)"
        lanes[rank].critical = "; ".join(filter(None, [lanes[rank].critical, why]))
        found.append(f"rank {rank} {why}: the leader waited for it to decide")
    return found


def percentile(values: Sequence[float], q: float, *, ordered: bool = False) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100], of non-empty ``values`` (``ordered``: sorted already)."""
    ordered_values = values if ordered else sorted(values)
    pos = (len(ordered_values) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered_values) - 1)
    return ordered_values[low] + (ordered_values[high] - ordered_values[low]) * (pos - low)


def _stats(lanes: dict[int, Lane]) -> list[PhaseStats]:
    durations: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for rank, lane in lanes.items():
        for bar in lane.bars:
            durations[bar.phase].append((bar.end - bar.start, rank))
    order = {name: i for i, name in enumerate(PHASES)}
    stats = []
    for phase in sorted(durations, key=lambda p: (order.get(p, len(order)), p)):
        values = durations[phase]
        worst, worst_rank = max(values)
        plain = sorted(v for v, _ in values)
        stats.append(PhaseStats(phase, len(values), percentile(plain, 50, ordered=True),
                                percentile(plain, 99, ordered=True), worst, worst_rank))
    return stats


def _slowest(answers: dict[int, Answer], t0: float, count: int = 5) -> list[tuple[int, float, str]]:
    answered = sorted(((answer[1] - t0, rank, answer[2]) for rank, answer in answers.items()), reverse=True)
    return [(rank, at, "answered" if ok else "failed") for at, rank, ok in answered[:count]]


def _missing(seq: int, by_kind: dict[str, tuple[float, Record]], answers: dict[int, Answer], world: int,
             rank_pauses: dict[int, _Pause | None]) -> list[str]:
    missing: list[str] = []
    if ev.LIST_REJECTED in by_kind:
        return missing
    if ev.SWITCH_DONE not in by_kind:
        missing.append(f"switch {seq} never finished in these events: no switch_done from the leader (it was still "
                       "running, or the leader's events file is missing or cut short)")
    if ev.REPLY_SENT not in by_kind and ev.REPLY_FAILED not in by_kind:
        missing.append(f"switch {seq}: no reply to ClusterD in these events")
    silent = sorted(set(range(world)) - set(answers))
    if silent:
        missing.append(f"switch {seq}: no result from {_ranks_text(silent)}")
    stuck = sorted(rank for rank, p in rank_pauses.items() if p is not None and p.parked is not None
                   and p.resumed is None)
    if stuck:
        missing.append(f"switch {seq}: {_ranks_text(stuck)} never resumed in these events")
    return missing


def _node_lanes(lanes: dict[int, Lane], ranks_per_node: int) -> list[Lane]:
    """One lane per node: its slowest rank's bars (the last to answer, or a failed one) and the
    spread of its ranks' answers."""
    nodes: dict[int, list[Lane]] = defaultdict(list)
    for rank, lane in lanes.items():
        nodes[rank // ranks_per_node].append(lane)
    result = []
    for node, members in sorted(nodes.items()):
        ends = [b.end for lane in members for b in lane.bars if b.phase == "switch"]
        shown = max(members, key=_slowness)
        first, last = members[0].rank, members[-1].rank
        result.append(Lane(
            label=f"node {node} (ranks {first}-{last})" if first != last else f"node {node} (rank {first})",
            rank=shown.rank, bars=shown.bars, marks=shown.marks, ranks=len(members),
            spread=(min(ends), max(ends)) if ends else None, failed=sum(lane.failed for lane in members),
            critical="; ".join(f"rank {lane.rank} {lane.critical}" for lane in members if lane.critical),
            unfinished=any(lane.unfinished for lane in members)))
    return result


def _slowness(lane: Lane) -> tuple[int, float]:
    return (lane.failed, max((b.end for b in lane.bars if b.phase != "parked"), default=0.0))


def _attach_unsequenced(switches: list[Switch], leader_events: list[tuple[float, Record]]) -> None:
    """Stream losses, a stop, a failed agent, a failed pause: on the leader lane of the switch they happened in;
    up to a minute after one ended, in its ``after`` list (the page names them after it). Neither
    stretches the switch: a stream restored long after would read as a slow switch."""
    ordered = sorted(switches, key=lambda s: s.start_wall)
    for t, r in leader_events:
        if r.kind not in _UNSEQUENCED_LEADER or (r.kind in _LEADER_ONLY and r.seq is not None):
            continue  # a recovery with its switch's number is that switch's own (_leader_marks)
        owner = next((s for s in reversed(ordered) if s.start_wall <= t <= s.start_wall + s.duration + 60.0), None)
        if owner is None:
            continue
        d = r.detail
        if r.kind == ev.RECOVERY:
            text, ok = _recovery(d)
        else:
            text = {ev.TRAINING_STOP: f"ClusterD's recovery: training must stop ({d.get('reason')})",
                    ev.STREAM_LOST: f"stream to ClusterD lost: {d.get('why')}",
                    ev.STREAM_RESTORED: f"stream to ClusterD restored: {d.get('why')}",
                    ev.AGENT_FAILED: f"agent failed: {d.get('error')}",
                    ev.PAUSE_FAILED: f"pause failed before a rank list (499: training went on, ClusterD kills "
                                     f"the job): {d.get('reason')}"}[r.kind]
            ok = r.kind == ev.STREAM_RESTORED
        mark = Mark(t - owner.start_wall, text, ok=ok)
        (owner.leader if mark.at <= owner.duration else owner.after).append(mark)
    for switch in switches:
        switch.leader.sort(key=lambda m: m.at)
        switch.after.sort(key=lambda m: m.at)
