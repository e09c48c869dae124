"""Which link each rank is on now, as this process last learned it: for status() and metrics.

Who knows what:

- the leader decides every order (coordination/leader.py), so it knows every rank of the job: the
  Coordinator calls :meth:`LinkMap.decided` with each order, its kind and its outcome;
- a rank that is only a member hears the decision on its own order (``switch_outcome``, whose
  ``link`` is this rank's target link): it knows its own rank.

The rules, the same from both sources:

- a switch or rollback that succeeded on every rank and ran the hooks (not a dry run) puts each
  listed rank on its op's link (a rollback's ops are the links the ranks were on before, so a
  failed switch rolled back leaves every rank where it was);
- a switch or rollback that failed after hooks ran leaves its ranks *uncertain* where the op
  differs from the link known before: some ranks may have moved. Not the ranks known to have
  succeeded in it (their hook returned True, and the failure was not the verification's): those
  are on their op's link, as after a success; nor a rank that said no hook ran there (not parked,
  say): it is where it was. The leader knows the successes it read before the first failure
  decided the order (``RunOutcome.ok_ranks``) and whether that failure's rank ran a hook
  (``unmoved_ranks``); a member knows its own (``moved``, or ``link`` null when no hook ran). The
  rollback that ClusterD's recovery runs next (pause mode agent) makes the others certain again;
  until then the map keeps the link known before;
- ranks never named by a switch are on their primary link: HCCL communicators start there.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.metrics")

PRIMARY, STANDBY = "primary", "standby"
_LINK_KINDS = ("switch", "rollback")  # order kinds that move links (coordination's KIND_SWITCH, KIND_ROLLBACK)


class Decision(Protocol):
    """What the leader decided on an order (coordination.RunOutcome has these)."""

    @property
    def ok(self) -> bool: ...

    @property
    def attempted(self) -> bool: ...

    @property
    def ok_ranks(self) -> frozenset[int]: ...

    @property
    def unmoved_ranks(self) -> frozenset[int]: ...


def compact_ranks(ranks: Iterable[int], *, most: int | None = None) -> str:
    """``16-23,40`` for ranks 16..23 and 40 (sorted, runs joined); ``""`` for none. With ``most``,
    only the first ``most`` runs, then ``,... (N in all)``. The one place rank sets become text
    (status, the status line, the timeline page)."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    shown = runs if most is None else runs[:most]
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    if len(shown) < len(runs):
        text += f",... ({sum(b - a + 1 for a, b in runs)} in all)"
    return text


class LinkMap:
    """Rank -> standby (True) or primary (False), plus the ranks in doubt. Thread-safe; never raises.

    Its scope (the ranks it speaks for) comes from ``agent_started``: every rank of the job on the
    leader, this rank on a member. It is also an event listener, for ``switch_outcome``.

    Args:
        own_rank_only: speak for this process's rank alone, even on the leader: for a map fed only
            with events (the leader's decisions on the other ranks never reach it).
    """

    def __init__(self, *, own_rank_only: bool = False) -> None:
        self._own_rank_only = own_rank_only
        self._lock = threading.Lock()  # guards every field below
        self._standby: set[int] = set()
        self._uncertain: set[int] = set()
        self._scope: Sequence[int] = ()
        self._last_switch: dict[str, Any] | None = None  # seq, ok, at (wall), mono

    # -- inputs --------------------------------------------------------------------------------

    def decided(self, order: SwitchOrder, kind: str, outcome: Decision) -> None:
        """The leader decided ``order`` (``kind`` switch, rollback, ...); called by its Coordinator."""
        if kind not in _LINK_KINDS:
            return
        try:
            with self._lock:
                if outcome.attempted:
                    self._learn_all(order.ranks, order.ops, outcome.ok, outcome.ok_ranks, outcome.unmoved_ranks)
                if kind == "switch":
                    self._switched(order.seq, outcome.ok, time.time())
        except Exception:  # what people are told must never break what the agent does
            logger.exception("link map: order #%s not recorded", getattr(order, "seq", "?"))

    def __call__(self, event: AgentEvent) -> None:
        try:
            self._observe(event)
        except Exception:
            logger.exception("link map: event %s not recorded", event.kind)

    def _observe(self, event: AgentEvent) -> None:
        detail = event.detail
        if event.kind == ev.AGENT_STARTED:
            rank, world = detail.get("rank"), detail.get("world_size")
            with self._lock:
                if detail.get("role") == "leader" and isinstance(world, int) and not self._own_rank_only:
                    self._scope = range(world)
                elif isinstance(rank, int):
                    self._scope = (rank,)
        elif event.kind == ev.SWITCH_OUTCOME and detail.get("kind") in _LINK_KINDS:
            rank, link, ok = detail.get("rank"), detail.get("link"), bool(detail.get("ok"))
            with self._lock:
                if isinstance(rank, int) and link in (PRIMARY, STANDBY):
                    self._learn(rank, link == STANDBY, ok or bool(detail.get("moved")))
                if detail.get("kind") == "switch":
                    # When the leader decided (its clock): a success's outcome reaches the ranks
                    # with the release that follows it (coordination/leader.py).
                    decided = detail.get("sent_at")
                    self._switched(event.seq, ok, float(decided) if isinstance(decided, (int, float)) else event.wall)

    def _learn_all(self, ranks: tuple[int, ...], ops: tuple[bool, ...], ok: bool,
                   ok_ranks: frozenset[int] = frozenset(), unmoved_ranks: frozenset[int] = frozenset()) -> None:
        """:meth:`_learn` for a whole order, in set operations (the leader's critical path: an order
        of 16,384 ranks costs about a millisecond). A failed order's ``ok_ranks`` are learned as
        a success's; its ``unmoved_ranks`` (no hook ran there) learn nothing."""
        named, to_standby = set(ranks), set(itertools.compress(ranks, ops))
        done = named if ok else named & ok_ranks
        if not ok:
            doubt = named - done - unmoved_ranks
            self._uncertain |= (to_standby & (doubt - self._standby)) | (self._standby & (doubt - to_standby))
        if done:
            self._standby -= done - to_standby
            self._standby |= to_standby & done
            self._uncertain -= done

    def _learn(self, rank: int, standby: bool, ok: bool) -> None:
        if ok:
            if standby:
                self._standby.add(rank)
            else:
                self._standby.discard(rank)
            self._uncertain.discard(rank)
        elif standby != (rank in self._standby):
            self._uncertain.add(rank)

    def _switched(self, seq: int | None, ok: bool, wall: float) -> None:
        last = self._last_switch
        if last is not None and last["seq"] == seq and seq is not None:
            return  # the leader's own rank hears the decision it made: already counted
        self._last_switch = {"seq": seq, "ok": ok, "at": wall, "mono": time.monotonic()}

    # -- outputs -------------------------------------------------------------------------------

    def links(self) -> list[tuple[int, bool]]:
        """(rank, on standby) for every rank in scope, in rank order."""
        with self._lock:
            scope, standby = self._scope, set(self._standby)
        return [(rank, rank in standby) for rank in scope]

    def uncertain(self) -> int:
        """How many ranks in scope may be on either link (a switch failed after hooks ran)."""
        with self._lock:
            return sum(1 for rank in self._uncertain if rank in self._scope)

    def last_switch_wall(self) -> float | None:
        """``time.time()`` when the last switch was decided, or None."""
        with self._lock:
            return None if self._last_switch is None else float(self._last_switch["at"])

    def status(self) -> dict[str, Any]:
        """For ``agent.status()["links"]``: counts, the standby and uncertain ranks (compact),
        and the last switch (``seq``, ``ok``, ``at`` wall time, ``age_s``)."""
        with self._lock:
            scope = self._scope
            standby = [r for r in self._standby if r in scope]
            uncertain = [r for r in self._uncertain if r in scope]
            last = dict(self._last_switch) if self._last_switch else None
        if last is not None:
            last["age_s"] = round(time.monotonic() - last.pop("mono"), 3)
        return {"ranks": len(scope), "primary": len(scope) - len(standby), "standby": len(standby),
                "standby_ranks": compact_ranks(standby), "uncertain": len(uncertain),
                "uncertain_ranks": compact_ranks(uncertain), "last_switch": last}


def format_links(links: Any, written_at: float | None, duration: Callable[[float], str] | None = None) -> str:
    """``1,024 primary, 8 standby (ranks 16-23); last switch #3 ok 2.0 min before the write``.

    ``links`` is ``status()["links"]`` as read back from a status file written at ``written_at``;
    ``duration`` formats the last switch's age (default: seconds, minutes or hours, one decimal).
    """
    if not isinstance(links, dict) or not isinstance(links.get("ranks"), int) or not links["ranks"]:
        return ""
    text = f"{links.get('primary', 0):,} primary, {links.get('standby', 0):,} standby"
    if links.get("standby_ranks"):
        text += f" (ranks {_clip(str(links['standby_ranks']))})"
    if links.get("uncertain"):
        # Counted above by their last known link: "of which", so that the counts do not seem to add up to more
        text += (f"; of which {links['uncertain']:,} UNCERTAIN (ranks {_clip(str(links.get('uncertain_ranks')))}: "
                 "a failed switch's hooks ran on them, and no rollback put them back)")
    last = links.get("last_switch")
    if isinstance(last, dict):
        text += f"; last switch #{last.get('seq')} {'ok' if last.get('ok') else 'failed'}"
        at = last.get("at")
        if isinstance(at, (int, float)) and written_at is not None:
            text += f" {(duration or _age)(max(0.0, written_at - float(at)))} before the write"
    return text


def _clip(ranks: str, limit: int = 60) -> str:
    return ranks if len(ranks) <= limit else ranks[:limit].rsplit(",", 1)[0] + ",..."


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["PRIMARY", "STANDBY", "Decision", "LinkMap", "compact_ranks", "format_links"]
