"""Each reader's event queue (a member's, or a relay's on the level above): two ways to carry it.

The writer (the leader, or a relay for its slots) publishes event ``n`` to every reader; each
reader takes its events in order, blocking while it has none. Where the Store has queues
(``KV.queues``: the node and group Stores the agent hosts, torch's TCPStore and the in-process
Store), reader ``r``'s events are the Store queue ``q/<r>``: the writer pushes (no reply), the
reader's ``queue_pop`` blocks and takes the event out in one request. Elsewhere (the job's Store,
MindSpore's) they are keys ``q/<r>/<n>``, written in one ``multi_set`` and read with a blocking
``get``; the reader deletes each once it has answered it (a second round trip per event).

Measured (docs/performance.md, 12-05): the member's delete of each event it read was 12-18 % of
the ranks' coordination CPU with node fan-out at 1,024 ranks.

What does not change between the two: ``q/head`` holds the last event's number (a reader that
starts late begins after it); a reader's stop wakes its own wait by giving it a ``wake`` (on keys
only where no event is there: a wake must never be written over one; a queue never loses one); a
reader that finds another event already waiting knows the writer has moved on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.kv import KV

WAKE = p.encode({"t": p.WAKE})


def queue_name(reader: int) -> str:
    return f"q/{reader}"


def publish(kv: KV, readers: int, n: int, text: str) -> None:
    """Event ``n`` to readers ``0..readers-1``, then the head (keys: all in one request)."""
    if kv.queues:
        for reader in range(readers):
            kv.push(queue_name(reader), text)
        kv.set(p.QUEUE_HEAD, str(n))
        return
    kv.set_many([*(p.queue_key(reader, n) for reader in range(readers)), p.QUEUE_HEAD],
                [text] * readers + [str(n)])  # one request, the head last


def start(kv: KV, reader: int) -> int:
    """Where a reader starting now begins: after the events published before it (on keys, after
    the head; a queue drops what it holds, counted first, so an event pushed meanwhile stays).
    Returns the number of the next event."""
    if kv.queues:
        for _ in range(kv.queued(queue_name(reader))):
            kv.pop(queue_name(reader), 1.0)  # there: counted just now, and only this reader pops
    return int(kv.get(p.QUEUE_HEAD)) + 1 if kv.check([p.QUEUE_HEAD]) else 1


def read(kv: KV, reader: int, n: int, timeout_s: float) -> str | None:
    """The reader's next event (number ``n``); None if none came within ``timeout_s``."""
    if kv.queues:
        return kv.pop(queue_name(reader), timeout_s)
    return kv.get_when_set(p.queue_key(reader, n), timeout_s)


def done(kv: KV, reader: int, n: int) -> None:
    """The reader has handled event ``n``: on keys it deletes it (a queue took it out already)."""
    if not kv.queues:
        kv.delete([p.queue_key(reader, n)])


def waiting(kv: KV, reader: int, n: int) -> bool:
    """Is event ``n`` (the one after the reader's current) already there: has the writer moved on?"""
    if kv.queues:
        return kv.queued(queue_name(reader)) > 0
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
    if not kv.queues:
        keys = kv.poll_gone([p.queue_key(reader, n) for reader in readers], deadline, stop)
        return [int(key.split("/")[1]) for key in keys]
    pending, interval = list(readers), 0.001
    while True:
        pending = [reader for reader in pending if kv.queued(queue_name(reader)) > 0]
        remaining = deadline - time.monotonic()
        if not pending or remaining <= 0 or (stop is not None and stop.is_set()):
            return pending
        if stop is not None:
            stop.wait(min(interval, remaining))
        else:
            time.sleep(min(interval, remaining))
        interval = min(0.02, interval * 2)
