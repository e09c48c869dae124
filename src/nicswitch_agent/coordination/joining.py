"""A training rank joining its job's leader, and what it owes the leader when it comes or goes.

The leader may be waiting for a rank's answer when that rank's agent stops or its process is
replaced, and without a word it would wait out the whole budget (a pause's ``pause_timeout_s``,
five minutes by default; an order's guard, switch and verify warm-up: minutes) with ClusterD, the
operator and every other rank, parked, waiting behind it. So a rank says so:

- **It leaves** (its agent stops while its process may run on: training ended, evaluation or
  clean-up follow, or a signal stops the agent on this rank alone). :func:`leave` counts it on
  the job's Store (``LEFT_COUNT``) and fails a pause or order in flight at once; the leader's next
  pause or order fails at once while any rank is left (coordination/leader.py), naming the last
  one. This holds in every leader mode: after a failed switch the job waits parked for ClusterD's
  recovery, and its rollback must not wait two minutes for a rank whose agent is gone.
- **It takes the place of an earlier process of its rank** (under ``nicswitch-agent launch`` the
  leader and its Store outlive the training processes, which torchrun restarts; or an agent
  started again in the same process). :func:`join` fails the order the leader names as in flight
  (``inflight``, coordination/messages.py), and the leader decides at once, false, naming the
  rank. A pause in flight fails the same way: the new process starts after the pause's events and
  will never park in it. With the leader on rank 0, a torchrun restart starts a new key prefix
  (messages.key_prefix), so only an agent started again in one process finds a predecessor.

Why this is sound without a race: the member takes its queue position first, then reads
``inflight``; the leader names an order (or a pause) before it publishes it. One published before
the member's position is named by then; an order published after reaches the member, which is not
parked and refuses it. (A pause named before the member's position but published after it reaches
the member and is failed all the same: a window of one Store write, on the side of failing.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.kv import done_key

if TYPE_CHECKING:
    from nicswitch_agent.coordination.kv import KV

logger = logging.getLogger("nicswitch_agent.coordination")


def join(kv: KV, rank: int, pid: int) -> str | None:
    """Say that ``rank`` joined (a launcher's leader registers with ClusterD once every rank has),
    after failing the order in flight if this process took the place of an earlier one (or this
    agent of an earlier agent in the same process). Returns the name of the order it failed, if
    any. Call it once the member has its queue position."""
    key = p.joined_key(rank)
    before = kv.get(key) if kv.check([key]) else None
    kv.set(key, str(pid))
    if before is None:
        return None
    if kv.check([p.left_key(rank)]):  # its predecessor had stopped its agent: this rank is back
        kv.delete([p.left_key(rank)])
        if kv.add(p.LEFT_COUNT, -1) > 0 and kv.get(p.LEFT_LAST).startswith(f"rank {rank} ("):
            kv.set(p.LEFT_LAST, "a rank")  # the leader must not name this one (which left before, it does not know)
    text = kv.get(p.IN_FLIGHT) if kv.check([p.IN_FLIGHT]) else ""
    if not text:
        logger.info("rank %d: %s; no order was in flight", rank, _came_back(before, pid))
        return None
    try:
        in_flight = json.loads(text)
        if in_flight.get("pause"):
            return _fail_pause(kv, rank, pid, before, int(in_flight["e"]))
        epoch, name, expected = int(in_flight["e"]), str(in_flight["key"]), int(in_flight["n"])
    except (ValueError, KeyError, TypeError, AttributeError):
        logger.error("rank %d: ignoring a malformed in-flight order: %r", rank, text[:200])
        return None
    reason = (f"its process was restarted during the order (pid {before} replaced by pid {pid}): "
              "what it did is lost and it cannot answer")
    # attempted: the old process may have called the switch hook before it died.
    p.publish_result(kv, epoch, name, p.MemberResult(rank, False, reason, attempted=True), expected)
    logger.warning("rank %d: this process (pid %d) takes the place of pid %s during order %s: told the "
                   "leader it failed", rank, pid, before, name)
    return name


def _came_back(before: str, pid: int) -> str:
    """For the log: a new process in the rank's place, or a new agent in the same process."""
    if before == str(pid):
        return f"its agent started again (pid {pid})"
    return f"this process (pid {pid}) takes the place of pid {before}"


def _fail_pause(kv: KV, rank: int, pid: int, before: str, epoch: int) -> str:
    """The pause in flight cannot complete: this process starts after its events and will never
    park in it, and its predecessor will never answer."""
    _end_pause(kv, epoch, f"rank {rank}: its process was restarted during the pause (pid {before} replaced by pid "
                          f"{pid})")
    logger.warning("rank %d: this process (pid %d) takes the place of pid %s during pause #%d: told the leader "
                   "it cannot complete", rank, pid, before, epoch)
    return f"pause #{epoch}"


def _end_pause(kv: KV, epoch: int, words: str) -> None:
    """End the leader's wait for either phase of pause ``epoch`` now (the done keys it blocks on,
    kv.wait_count), with ``words`` for its message (``e/<E>/restarted``)."""
    kv.set(p.restarted_key(epoch), words)
    for counter in (p.c_counter_key(epoch), p.parked_counter_key(epoch)):
        kv.set(done_key(counter), "failed")


def leave(kv: KV, rank: int, pid: int, *, interrupted: bool = False) -> None:
    """Say that ``rank``'s agent stops while its process may run on (training ended, evaluation or
    clean-up follow): the leader's next pause or order fails at once instead of waiting out its
    budget for a rank that will never park or answer, and a pause or order in flight fails now.
    ``interrupted``: this rank's parked training leaves to raise TrainingStopped (the leader then
    stops training everywhere at once, as for Ctrl-C on a parked rank: messages.MemberResult).

    Counted first, then what is in flight read: the leader names an order (or pause) first, then
    reads the count (leader.Coordinator._unanswerable), so of the two one sees the other."""
    key = p.left_key(rank)
    if kv.check([key]):
        return
    kv.set(key, str(pid))
    kv.set(p.LEFT_LAST, f"rank {rank} (pid {pid})")  # for the leader's message: it counts, it does not scan
    kv.add(p.LEFT_COUNT, 1)
    text = kv.get(p.IN_FLIGHT) if kv.check([p.IN_FLIGHT]) else ""
    try:
        in_flight = json.loads(text) if text else {}
        if not isinstance(in_flight, dict) or not in_flight:
            return
        if in_flight.get("pause"):
            _end_pause(kv, int(in_flight["e"]), f"rank {rank}: its agent stopped during the pause (pid {pid})")
            return
        epoch, name, expected = int(in_flight["e"]), str(in_flight["key"]), int(in_flight["n"])
    except (ValueError, KeyError, TypeError):
        logger.error("rank %d: ignoring a malformed in-flight order: %r", rank, text[:200])
        return
    # The member may answer it too (an order it runs now): a second failure decides nothing more.
    # attempted: it may have run the switch hook already.
    p.publish_result(kv, epoch, name, p.MemberResult(rank, False, "the agent on this rank stopped during the order",
                                                     attempted=True, interrupted=interrupted), expected)


def member_callbacks(kv: KV, rank: int, pid: int) -> dict[str, Any]:
    """The Member's ``on_started`` and ``on_stopping``: :func:`join` and :func:`leave` on the job's
    Store ``kv`` (with fan-out too: the leader reads them there, whatever the layout)."""
    started: Callable[[], object] = lambda: join(kv, rank, pid)  # noqa: E731
    stopping: Callable[[bool], object] = lambda interrupted: leave(kv, rank, pid, interrupted=interrupted)  # noqa: E731
    return {"on_started": started, "on_stopping": stopping}
