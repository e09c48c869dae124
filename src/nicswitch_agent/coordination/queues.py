"""Each reader's event queue, and the answers to an event: two ways to carry them on a Store.

The writer (the leader, or a relay for its slots) publishes event ``n`` to every reader; each
reader takes its events in order, blocking while it has none. Where the Store has queues
(``KV.queues``: the node and group Stores the agent hosts, torch's TCPStore and the in-process
Store), reader ``r``'s events are the Store queue ``q/<r>``: the writer pushes (no reply), the
reader's ``queue_pop`` blocks and takes the event out in one request. Elsewhere (the job's Store,
MindSpore's) they are keys ``q/<r>/<n>``, written in one ``multi_set`` and read with a blocking
``get``; the reader deletes each once it has answered it (a second round trip per event).

Measured (docs/performance.md, 12-05): the member's delete of each event it read was 12-18 % of
the ranks' coordination CPU with node fan-out at 1,024 ranks.

The answers to a pause, a target or an order go the same two ways. On keys each answerer writes
its value (``e/<E>/c/<r>``...) and counts itself with ``add``; the answer that completes the
count (or a failing result, which decides at once) sets the done key the waiter blocks on; the
waiter then reads every value with one ``multi_get`` and deletes them all when the epoch ends
(messages.py). On a Store with queues each answerer pushes its answer (slot and value, or its
result) to the phase's queue ``a/<E>/<phase>`` (no reply: not on the answerer's critical path),
and the waiter pops them as they arrive, until it has every slot's, a failure, its deadline or
its stop (a ``woken`` pushed behind them): no counter, no done key, no value keys to delete.

What does not change between the two: a reader that starts late begins after the events
published before it (on keys it reads ``q/head``, the last event's number; a queue has no head,
the reader empties it); a reader's stop wakes its own wait by giving it a ``wake`` (on keys
only where no event is there: a wake must never be written over one; a queue never loses one); a
reader that finds another event already waiting knows the writer has moved on.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.kv import GONE, KV, WOKEN, Wake, done_key, timed_out

logger = logging.getLogger("nicswitch_agent.coordination")

WAKE = p.encode({"t": p.WAKE})
ANSWER = "a"  # an answer to a pause or target on a queue: {"t": "a", "s": slot, "v": step [, "nostep": 1]}
# ... or a relay's word that it cannot answer, for good (fail_early): {"t": "a", "s": slot, "fail": 1}


def queue_name(reader: int) -> str:
    return f"q/{reader}"


@functools.lru_cache(maxsize=64)
def _queue_names(readers: int) -> tuple[str, ...]:
    """The queues of readers ``0..readers-1``, made once per size (every event goes to them all)."""
    return tuple(queue_name(reader) for reader in range(readers))


def publish(kv: KV, readers: int, n: int, text: str) -> None:
    """Event ``n`` to readers ``0..readers-1``; on keys then the head, all in one request (a queue
    needs no head: a reader starting late empties its queue instead of counting past the head)."""
    if kv.queues:
        kv.push_each(_queue_names(readers), text)
        return
    kv.set_many([*(p.queue_key(reader, n) for reader in range(readers)), p.QUEUE_HEAD],
                [text] * readers + [str(n)])  # one request, the head last


def start(kv: KV, reader: int) -> int:
    """Where a reader starting now begins: after the events published before it (on keys, after
    the head; a queue drops what it holds, counted first, so an event pushed meanwhile stays).
    Returns the number of the next event (on a queue 1: numbers are only the keys' names)."""
    if kv.queues:
        drop(kv, queue_name(reader))
        return 1
    return int(kv.get(p.QUEUE_HEAD)) + 1 if kv.check([p.QUEUE_HEAD]) else 1


def read(kv: KV, reader: int, n: int, timeout_s: float) -> str | None:
    """The reader's next event (number ``n``); None if none came within ``timeout_s``."""
    if kv.queues:
        return kv.pop(queue_name(reader), timeout_s)
    return kv.get_when_set(p.queue_key(reader, n), timeout_s)


class Reader(NamedTuple):
    """One reader's :func:`read` and :func:`done`, looked up once (a member reads its queue for
    every event: on the node link this is one Python call to its copy, not three)."""

    read: Callable[[int, float], str | None]  # (event n, timeout) -> the event, or None
    done: Callable[[int], None] | None  # on keys: delete event n once handled; None on a queue


def reader_for(kv: KV, reader: int) -> Reader:
    """:func:`read` and :func:`done` for ``reader`` on ``kv``."""
    if not kv.queues:
        return Reader(functools.partial(read, kv, reader), functools.partial(done, kv, reader))
    full = kv.prefix + queue_name(reader)
    pop_within = getattr(type(kv.store), "queue_pop_within", None)
    if pop_within is None:  # a Store's queue: KV.pop sets the connection's timeout
        name = queue_name(reader)
        return Reader(lambda _n, timeout_s: kv.pop(name, timeout_s), None)
    store = kv.store

    def pop_next(_n: int, timeout_s: float) -> str | None:
        value = pop_within(store, full, timeout_s)
        return None if value is None else value.decode()

    return Reader(pop_next, None)


def done(kv: KV, reader: int, n: int) -> None:
    """The reader has handled event ``n``: on keys it deletes it (a queue took it out already)."""
    if not kv.queues:
        kv.delete([p.queue_key(reader, n)])


def waiting(kv: KV, reader: int, n: int) -> bool:
    """Is event ``n`` (the one after the reader's current) already there: has the writer moved on?
    (As far as the reader knows now: an event arriving a moment later is a writer that moves on a
    moment later, which no look can exclude. On the node link the rank's copy says it, without a
    read of its socket for every order.)"""
    if kv.queues:
        return kv.queued_here(queue_name(reader)) > 0
    return kv.check([p.queue_key(reader, n)])


def wake(kv: KV, reader: int, n: int, *, keep_event: bool) -> None:
    """End the reader's wait for event ``n`` (its stop), through a connection of the stopper's. On
    keys, with ``keep_event`` (a relay: the event must still reach its slots) only if no event is
    there, which wakes it anyway; a member's own stop writes over one. A queue keeps both."""
    if kv.queues:
        kv.push(queue_name(reader), WAKE)
    elif not keep_event or not kv.check([p.queue_key(reader, n)]):
        kv.set(p.queue_key(reader, n), WAKE)


def untaken(kv: KV, readers: Sequence[int], n: int, deadline: float,
            stop: threading.Event | None = None) -> list[int]:
    """Wait (polling, until ``deadline`` or ``stop``) until every reader took event ``n``, the last
    one published; returns the readers that had not. Taken: on keys, deleted once handled; on
    queues, popped."""
    if kv.queues:
        left = kv.poll_empty([queue_name(reader) for reader in readers], deadline, stop)
    else:
        left = kv.poll_gone([p.queue_key(reader, n) for reader in readers], deadline, stop)
    return [int(key.split("/")[1]) for key in left]


# -- answers ---------------------------------------------------------------------------------


def answers(epoch: int, phase: str) -> str:
    """The queue of the answers to a phase of epoch ``epoch``: ``c``, ``parked`` or ``res/<K>``."""
    return f"a/{epoch}/{phase}"


def answer_pause(kv: KV, epoch: int, slot: int, completed: int | None, expected: int | None) -> None:
    """Slot ``slot`` saw the pause having completed step ``completed`` (None: step() was never
    called, which the waiter's message names)."""
    step = completed if completed is not None else 0
    if kv.queues:
        kv.push(answers(epoch, "c"), p.encode({"t": ANSWER, "s": slot, "v": step,
                                               **({"nostep": 1} if completed is None else {})}))
        return
    if completed is None:
        kv.set(p.nostep_key(epoch, slot), "1")
    kv.set(p.c_key(epoch, slot), str(step))
    kv.arrive(p.c_counter_key(epoch), expected)  # the key first, then the count


def answer_parked(kv: KV, epoch: int, slot: int, step: int | None, expected: int | None) -> None:
    if kv.queues:
        kv.push(answers(epoch, "parked"), p.encode({"t": ANSWER, "s": slot, "v": step}))
        return
    kv.set(p.parked_key(epoch, slot), str(step))
    kv.arrive(p.parked_counter_key(epoch), expected)


def fail_early(kv: KV, epoch: int, phase: str, slot: int) -> None:
    """Slot ``slot`` (a relay) cannot answer phase ``phase`` (``c`` or ``parked``) of ``epoch``,
    for good (a rank below is gone, or a relay below said so): end its waiter's wait now rather
    than at its deadline. After the relay's why: the waiter reads it once woken. On keys the
    waiter blocks on the counter's done key (kv.wait_count), set here with no count in it."""
    if kv.queues:
        kv.push(answers(epoch, phase), p.encode({"t": ANSWER, "s": slot, "fail": 1}))
        return
    kv.set(done_key(p.c_counter_key(epoch) if phase == "c" else p.parked_counter_key(epoch)), "failed")


def answer_result(kv: KV, epoch: int, name: str, result: p.MemberResult, expected: int | None) -> None:
    if kv.queues:
        kv.push(answers(epoch, f"res/{name}"), result.encode())
        return
    p.publish_result(kv, epoch, name, result, expected)


def gone(kv: KV, slots: int) -> set[int]:
    """The slots whose rank is gone for good: its link to the node's relay closed (the node link
    knows it at once, node_link.py; on a Store nobody knows, and a silent slot is waited for)."""
    if not hasattr(type(kv.store), "gone_queues"):
        return set()
    names = kv.store.gone_queues()  # type: ignore[attr-defined]
    return {slot for slot in range(slots) if kv.prefix + queue_name(slot) in names} if names else set()


def _gone_watch(kv: KV) -> Callable[[], frozenset[str]] | None:
    """What says which ranks' links closed (the node link's ``gone_queues``), asked at every
    answer: mostly none, and then nothing else is looked at. None on a Store (nobody knows)."""
    if not hasattr(type(kv.store), "gone_queues"):
        return None
    return kv.store.gone_queues  # type: ignore[attr-defined,no-any-return]


def _only_gone_left(kv: KV, slots: int, answered: set[int] | dict[int, Any],
                    watch: Callable[[], frozenset[str]] | None) -> bool:
    """Every slot that has not answered is gone: waiting longer cannot complete the phase."""
    if watch is None or not watch():
        return False
    gone_now = gone(kv, slots)
    if not gone_now:
        return False
    left = set(range(slots)).difference(answered)
    return bool(left) and left <= gone_now


def gather(kv: KV, epoch: int, phase: str, slots: int, deadline: float, wake: Wake | None) -> dict[int, dict[str, Any]]:
    """Queues only: the answers to a pause or target phase by slot, once every slot answered, or
    what came before ``deadline`` (monotonic), ``wake``, a slot's word that it cannot answer
    (:func:`fail_early`), or the end of every slot left (gone)."""
    got: dict[int, dict[str, Any]] = {}
    watch = _gone_watch(kv)
    for batch in _arrivals(kv, answers(epoch, phase), deadline, wake):
        for text in batch:
            if text == GONE:  # looked at once the batch is in (below)
                continue
            try:
                answer = p.decode(text)
                slot = int(answer["s"])
            except (ValueError, KeyError, TypeError):
                logger.error("ignoring a malformed answer to %s of epoch %d: %r", phase, epoch, text[:200])
                continue
            if answer.get("fail"):  # the phase cannot complete: no use waiting for the others
                got.pop(slot, None)
                return got
            got[slot] = answer
        if len(got) >= slots or _only_gone_left(kv, slots, got, watch):
            break
    return got


def arriving_results(kv: KV, epoch: int, name: str, expected: int, deadline: float,
                     wake: Wake | None, ranks: Sequence[int] = ()) -> Iterator[p.MemberResult]:
    """The results of order ``name`` in arrival order (messages.arriving_results on keys): on a
    queue each as it arrives, until ``expected`` came, or ``deadline`` or ``wake``, or every slot
    left is gone (``ranks``: the slots' ranks, which the results name); the caller stops at the
    first failure."""
    if not kv.queues:
        yield from p.arriving_results(kv, epoch, name, expected, deadline, wake)
        return
    seen, answered = 0, set[int]()
    slot_of = {rank: slot for slot, rank in enumerate(ranks)}
    watch = _gone_watch(kv) if ranks else None
    for batch in _arrivals(kv, answers(epoch, f"res/{name}"), deadline, wake):
        for text in batch:
            if text == GONE:  # looked at once the batch is in (below)
                continue
            try:
                result = p.MemberResult.decode(text)
            except (ValueError, KeyError, TypeError):
                logger.error("ignoring a malformed result of order %s: %r", name, text[:200])
                continue
            seen += 1
            answered.add(slot_of.get(result.rank, -1))
            yield result
            if seen >= expected:
                return
        if _only_gone_left(kv, expected, answered, watch):
            return


def _arrivals(kv: KV, queue: str, deadline: float, wake: Wake | None) -> Iterator[list[str]]:
    """What arrives on ``queue`` until ``deadline`` or ``wake`` (which pushes ``woken`` behind
    what is queued), a batch at a time: all that one look found (on the node's hub, the answers
    one read of the ranks' sockets brought), so that what a phase does per answer is not also a
    wait per answer."""
    if wake is not None:
        wake.key, wake.queue = queue, True
    try:
        while wake is None or not wake.stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                batch = kv.pop_all(queue, remaining)
            except RuntimeError as exc:
                if not timed_out(exc):
                    raise
                return
            if not batch:
                return
            if WOKEN in batch:  # what came before the wake, then no more
                yield batch[:batch.index(WOKEN)]
                return
            yield batch
    finally:
        if wake is not None:
            wake.key, wake.queue = None, False


def drop(kv: KV, queue: str) -> None:
    """Queues only: empty a queue of what nobody will read (events published before its reader
    started; answers that came after a failure decided the phase). A Store queue cannot be
    deleted; what it holds can only be popped (counted first: what is pushed meanwhile stays)."""
    for _ in range(kv.queued(queue)):
        if kv.pop(queue, 1.0) is None:
            return
