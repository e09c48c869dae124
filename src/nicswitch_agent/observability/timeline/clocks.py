"""Clocks: every rank's times moved onto the leader's clock, by the leader's timestamps it received.

Every rank's events carry its own host's wall clock. The leader stamps every message it publishes
to the ranks with its wall clock, and members copy it into their events as ``sent_at``. A rank
received such a message no earlier than the leader sent it, so ``wall - sent_at`` (less the
event's ``duration_s``, if it has one: the work started when the message arrived) is the rank's
clock offset plus a delay >= 0; the smallest value over a rank's messages is the offset plus the
shortest delay (well under a millisecond on one host, about a network round trip across hosts),
and each rank's times are shifted by it onto the leader's clock. The leader's own process is the
reference (shift 0). A rank whose events have no ``sent_at`` (an older agent) keeps its raw wall
clock, and the page says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nicswitch_agent.observability.timeline.reading import Record

Source = tuple[int | None, int | None]  # (rank, pid): one process, one clock
METHOD = ("each rank's clock shifted onto the leader's by the smallest gap between the leader sending a "
          "message (its time in the rank's events, sent_at) and the rank's event about it (or the start of the "
          "work it reports)")


@dataclass
class Alignment:
    """How each rank's clock was moved onto the leader's (``offsets``), or left alone (``unaligned``)."""

    method: str
    offsets: dict[int, float]  # rank -> seconds subtracted from its wall clock
    messages: dict[int, int]  # rank -> leader messages the offset was taken over
    unaligned: list[int]  # ranks whose raw wall clock is used
    leader_found: bool

    def largest(self) -> tuple[int, float] | None:
        if not self.offsets:
            return None
        rank = max(self.offsets, key=lambda r: abs(self.offsets[r]))
        return rank, self.offsets[rank]


def number(value: Any) -> float | None:
    """A number as a float; None for anything else (a bool, NaN, text, None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def align(by_source: dict[Source, list[Record]], leaders: set[Source]) -> tuple[Alignment, dict[Source, float]]:
    """The alignment, and the seconds to subtract from each process's wall clock. ``leaders``: the
    processes whose events are the leader's (their clock is the reference)."""
    offset: dict[Source, float] = {}
    offsets: dict[int, float] = {}
    messages: dict[int, int] = {}
    unaligned: set[int] = set()
    for source, records in by_source.items():
        if source in leaders:
            offset[source] = 0.0
            continue
        # An event with a duration started when its work did (a member_result: when the order
        # arrived): that start too came after the leader sent the message.
        gaps = [r.wall - (number(r.detail.get("duration_s")) or 0.0) - sent for r in records
                if (sent := number(r.detail.get("sent_at"))) is not None]
        offset[source] = min(gaps) if gaps else 0.0
        rank = source[0]
        if rank is None:
            continue
        if gaps:
            offsets[rank] = offset[source]
            messages[rank] = messages.get(rank, 0) + len(gaps)
        else:
            unaligned.add(rank)
    unaligned -= set(offsets)
    return Alignment(METHOD, offsets, messages, sorted(unaligned), bool(leaders)), offset
