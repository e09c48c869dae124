"""The few key-value operations leader and members need, over torch.distributed's Store or in-process.

Coordination rides on the job's own torch Store (the TCPStore every torch job already has), not
on a network layer of our own. Facts that shape this wrapper (docs/torch-store.md):

- one Store client is one socket and one lock: a thread blocked in ``wait`` stalls every other
  call on that client, so every thread works on its own ``clone()``;
- a timed-out ``wait`` logs two C++ warnings and may stall 5 s on reverse DNS, so every wait is
  one that normally ends with its key: a waiter for N answers blocks on a ``done`` key that the
  N-th answer sets (:meth:`KV.arrive`, :meth:`KV.wait_count`: no polling, and no round trip
  while it waits), and is woken early (stop) by setting that key itself (:class:`Wake`); the
  long idle wait of a member is woken by a key it sets itself;
- ``add`` on a key holding a non-integer kills the connection, so counters have keys of their own;
- ``multi_set`` / ``multi_get`` (torch >= 2.4) do many keys in one round trip: publishing to every
  rank and reading every rank's answer cost one call each instead of one per rank;
- the Store's server (rank 0 or torchrun's agent) dying makes calls raise ``DistNetworkError``
  (a RuntimeError); callers treat any RuntimeError as "coordination lost".

:class:`InProcessStore` implements the same calls for one process (threads as ranks, or a job
without torch), so the same coordination code serves one rank and many.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class StoreLike(Protocol):
    """The subset of ``torch.distributed.Store`` used here."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...
    def clone(self) -> Any: ...


MAX_WAIT_S = 7 * 86400.0  # the longest single wait (a deadline of inf is a wait this long)


class StoreTimeout(RuntimeError):
    """InProcessStore's wait timed out (torch raises DistStoreError, also a RuntimeError)."""


class InProcessStore:
    """A thread-safe in-memory store with torch's Store calls; ``clone()`` returns itself."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, 300):
                raise StoreTimeout(f"get timeout: {key}")
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        with self._cond:
            for key, value in zip(keys, values, strict=True):
                self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._cond:  # as torch's: waits until every key exists
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), 300):
                raise StoreTimeout(f"multi_get timeout: {keys}")
            return [self._data[k] for k in keys]

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout.total_seconds()):
                raise StoreTimeout(f"wait timeout, keys: {keys}")

    def add(self, key: str, value: int) -> int:
        with self._cond:
            current = int(self._data.get(key, b"0")) + value
            self._data[key] = str(current).encode()
            self._cond.notify_all()
            return current

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._queues.setdefault(key, collections.deque()).append(
                value.encode() if isinstance(value, str) else bytes(value))
            self._cond.notify_all()

    def queue_pop_within(self, key: str, timeout_s: float) -> bytes | None:
        """The oldest value of queue ``key``, taken out; None if none came within ``timeout_s``
        (torch's ``queue_pop`` waits for its connection's timeout: this Store is every thread's)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._queues.get(key)), timeout_s):
                return None
            return self._queues[key].popleft()

    def queue_len(self, key: str) -> int:
        with self._cond:
            return len(self._queues.get(key, ()))

    def clone(self) -> InProcessStore:
        return self

    def keys(self) -> list[str]:
        with self._cond:
            return sorted(self._data)


class KV:
    """Prefixed Store access for one thread. Values are UTF-8 strings.

    What a Store backend must provide (everything here is built on these): ``set``, a ``get``
    that blocks until the key exists (bounded: a ``set_timeout`` of the connection, or a timeout
    of its own), ``add`` (atomic, returns the new value), ``delete_key`` and ``clone`` (a new
    connection). The waits of a switch (:meth:`get_when_set`, :meth:`arrive`,
    :meth:`wait_count`, and reading the answers with :meth:`get_many`, which waits like ``get``)
    need nothing more. ``check`` is used once per order by each member (has the leader moved
    on?), at start, and on the failure paths (which keys are missing); ``wait`` only by
    :meth:`wait` and :meth:`get_when_set` on a Store without ``set_timeout``;
    ``multi_set``/``multi_get`` only where the Store has them (:meth:`set_many`,
    :meth:`get_many` fall back to one call per key).
    """

    def __init__(self, store: StoreLike, prefix: str, *, queues: bool = False) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/") + "/"
        self._multi = hasattr(store, "multi_set") and hasattr(store, "multi_get")
        # The Store has queues (``queue_push``, a blocking ``queue_pop``, ``queue_len``) and every
        # writer and reader of it knows so: the node and group Stores the agent hosts itself
        # (topology.py). Not probed: the job's Store may be one whose clients differ (the legacy
        # TCPStore backend and FileStore raise NotImplementedError), and both sides must agree.
        self.queues = queues
        # The connection's timeout can be read back (torch's Stores): it is then set only when a
        # wait needs another one (:meth:`_bound_waits`).
        self._timeout_readable = isinstance(getattr(type(store), "timeout", None), property)

    def clone(self) -> KV:
        """A KV over a new connection (same prefix): one per thread."""
        return KV(self.store.clone(), self.prefix, queues=self.queues)

    def _k(self, key: str) -> str:
        return self.prefix + key  # (the hot paths below write ``self.prefix + key`` out: no call per key)

    def set(self, key: str, value: str) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str) -> str:
        return self.store.get(self._k(key)).decode()

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.store.check([self._k(k) for k in keys]))

    def set_many(self, keys: Sequence[str], values: Sequence[str]) -> None:
        """Set every key, in one round trip where the Store can (``multi_set``)."""
        full = [self._k(k) for k in keys]
        if self._multi and len(full) > 1:
            try:
                self.store.multi_set(full, list(values))  # type: ignore[attr-defined]
                return
            except (NotImplementedError, AttributeError):
                self._multi = False  # a Store type without it (e.g. a custom one): one by one from now on
        for key, value in zip(full, values, strict=True):
            self.store.set(key, value)

    def set_for_readers(self, keys: Sequence[str], values: Sequence[str], readers: Sequence[str]) -> None:
        """Set key i for the rank that reads queue ``readers[i]`` alone (a go key): on the node
        link only that rank's copy gets it (``NodeHub.multi_set_addressed``); any other Store
        has one copy for all, so this is :meth:`set_many`."""
        addressed = getattr(self.store, "multi_set_addressed", None)
        if addressed is None:
            self.set_many(keys, values)
            return
        addressed([self._k(k) for k in keys], list(values), [self._k(r) for r in readers])

    def get_many(self, keys: Sequence[str]) -> list[str]:
        """The values of ``keys``, in one round trip where the Store can (``multi_get``); like
        ``get``, it waits for a key that does not exist yet (bounded by the connection's timeout)."""
        full = [self._k(k) for k in keys]
        if self._multi and len(full) > 1:
            try:
                return [bytes(v).decode() for v in self.store.multi_get(full)]  # type: ignore[attr-defined]
            except (NotImplementedError, AttributeError):
                self._multi = False
        return [self.store.get(key).decode() for key in full]

    def count(self, key: str) -> int:
        """The current value of a counter key (0 if it does not exist)."""
        return int(self.store.add(self._k(key), 0))

    def add(self, key: str, value: int = 1) -> int:
        return int(self.store.add(self._k(key), value))

    def delete(self, keys: Iterable[str]) -> None:
        if hasattr(type(self.store), "delete_keys"):  # the node link's: one message for them all
            self.store.delete_keys([self._k(key) for key in keys])  # type: ignore[attr-defined]
            return
        for key in keys:
            self.store.delete_key(self._k(key))

    def push(self, key: str, value: str) -> None:
        """Append to queue ``key`` (no reply: like ``set``, it does not wait for the Store)."""
        self.store.queue_push(self.prefix + key, value)  # type: ignore[attr-defined]

    def push_each(self, keys: Sequence[str], value: str) -> None:
        """Append ``value`` to every queue of ``keys``: on the node link in one call
        (``NodeHub.queue_push_each``), elsewhere one push each."""
        if hasattr(type(self.store), "queue_push_each"):
            prefix = self.prefix
            self.store.queue_push_each([prefix + key for key in keys], value)  # type: ignore[attr-defined]
            return
        for key in keys:
            self.store.queue_push(self._k(key), value)  # type: ignore[attr-defined]

    def pop(self, key: str, timeout_s: float) -> str | None:
        """The oldest value of queue ``key``, taken out of it in the same request; None if
        ``timeout_s`` passes first (as :meth:`get_when_set`, the connection's timeout is set for it)."""
        # Stores every thread shares (InProcessStore, the node link) have no connection timeout to
        # set; their waits take it. (The type's, not the object's: fd_budget.StoreClient answers
        # any attribute.)
        if hasattr(type(self.store), "queue_pop_within"):
            value = self.store.queue_pop_within(self.prefix + key, timeout_s)  # type: ignore[attr-defined]
            return None if value is None else value.decode()
        self._bound_waits(timeout_s)
        try:
            return bytes(self.store.queue_pop(self._k(key))).decode()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            return None  # a value pushed right at the boundary stays in the queue for the next pop

    def pop_all(self, key: str, timeout_s: float) -> list[str]:
        """Everything queue ``key`` holds, once it holds something ([] if ``timeout_s`` passes
        first): on the node's hub in one call (``NodeHub.queue_pop_all_within``), elsewhere the
        one value of a :meth:`pop`."""
        pop_all = getattr(type(self.store), "queue_pop_all_within", None)
        if pop_all is None:
            value = self.pop(key, timeout_s)
            return [] if value is None else [value]
        return [value.decode() for value in pop_all(self.store, self.prefix + key, timeout_s)]

    def queued(self, key: str) -> int:
        """How many values queue ``key`` holds."""
        return int(self.store.queue_len(self._k(key)))  # type: ignore[attr-defined]

    def queued_here(self, key: str) -> int:
        """As :meth:`queued`, but on a rank's node link what its copy holds, without reading its
        socket (what is still in the socket counts as arrived a moment later): no system call."""
        if hasattr(type(self.store), "queued_here"):
            return int(self.store.queued_here(self.prefix + key))  # type: ignore[attr-defined]
        return self.queued(key)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Block until every key exists (True) or ``timeout_s`` passes (False). For waits that
        normally succeed; use :meth:`poll_all` where a timeout is a normal outcome."""
        try:
            self.store.wait([self._k(k) for k in keys], datetime.timedelta(seconds=timeout_s))
            return True
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            return self.check(keys)  # a key set right at the boundary can still raise

    def get_when_set(self, key: str, timeout_s: float) -> str | None:
        """The value of ``key`` once it exists; None if ``timeout_s`` passes first.

        On a torch Store this is one request: its ``get`` waits for the key itself, so a ``wait``
        before it would be a round trip too many (on every event, on every relay or rank). The
        client's timeout is set for it (a local setting of this connection: callers own theirs).
        """
        if getattr(self.store, "set_timeout", None) is None:  # InProcessStore (shared by every thread): wait, then get
            return self.get(key) if self.wait([key], timeout_s) else None
        self._bound_waits(timeout_s)
        try:
            return self.get(key)
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            return self.get(key) if self.check([key]) else None  # set right at the boundary

    def _bound_waits(self, timeout_s: float) -> None:
        """The connection's timeout for the blocking call that follows, set only where it differs:
        torch's ``set_timeout`` releases the GIL (in a rank process, a wait to get it back, on every
        event a relay or a flat member reads), reading ``timeout`` does not."""
        wanted = datetime.timedelta(seconds=timeout_s)
        if self._timeout_readable and self.store.timeout == wanted:  # type: ignore[attr-defined]
            return
        self.store.set_timeout(wanted)  # type: ignore[attr-defined]

    def arrive(self, counter: str, expected: int | None) -> int:
        """Count one arrival at ``counter``; the arrival that completes it (``expected``) also sets
        the counter's done key, which a waiter blocks on (:meth:`wait_count`). Returns this
        arrival's number. ``expected`` None (a leader of an earlier version): no done key."""
        index = self.add(counter, 1)
        if expected is not None and index == expected:
            self.set(done_key(counter), str(index))
        return index

    def wait_count(self, counter: str, expected: int, deadline: float, wake: Wake | None = None) -> int:
        """Block until ``counter``'s done key is set (by its ``expected``-th arrival, by a failure
        that decides early, or by ``wake``) or ``deadline`` (monotonic) passes; returns the count
        (at least): the number the done key holds (the arrival that set it), else the counter's.

        One blocking request instead of a poll every few ms: the waiter costs nothing while it
        waits, and sees the last arrival one Store round trip after it (no poll interval).
        """
        done = done_key(counter)
        if wake is not None:
            wake.key = done
        value = None
        try:
            remaining = min(deadline - time.monotonic(), MAX_WAIT_S)
            if remaining > 0 and (wake is None or not wake.stop.is_set()):
                value = self.get_when_set(done, remaining)
        finally:
            if wake is not None:
                wake.key = None
        return int(value) if value is not None and value.isdigit() else self.count(counter)

    def poll_all(self, keys: Sequence[str], deadline: float, stop: threading.Event | None = None,
                 interval_s: float = 0.001, max_interval_s: float = 0.005) -> list[str]:
        """Poll until every key exists or ``deadline`` (monotonic) passes; returns the missing keys.

        Polling ``check`` logs nothing and never stalls on DNS; the interval grows from 1 ms to
        5 ms, so a quick answer is seen fast and a slow one costs little.
        """
        pending = list(keys)
        interval = interval_s
        while True:
            if self.check(pending):
                return []
            if len(pending) > 1:
                pending = [k for k in pending if not self.check([k])]
                if not pending:
                    return []
            if not _pause(deadline, stop, interval):
                return pending
            interval = min(max_interval_s, interval * 2)


    def poll_gone(self, keys: Sequence[str], deadline: float, stop: threading.Event | None = None,
                  interval_s: float = 0.001, max_interval_s: float = 0.02) -> list[str]:
        """Poll until no key exists any more (its reader took it) or ``deadline`` passes; returns
        the keys still there. One ``check`` per key still out on each poll (a round trip each)."""
        pending = list(keys)
        interval = interval_s
        while True:
            pending = [k for k in pending if self.check([k])]
            if not pending or not _pause(deadline, stop, interval):
                return pending
            interval = min(max_interval_s, interval * 2)

    def poll_empty(self, queues: Sequence[str], deadline: float, stop: threading.Event | None = None,
                   interval_s: float = 0.001, max_interval_s: float = 0.02) -> list[str]:
        """:meth:`poll_gone` for Store queues: until every queue is empty (its reader took what it
        held); returns the queues still holding something. One ``queue_len`` per queue per poll."""
        pending = list(queues)
        interval = interval_s
        while True:
            pending = [q for q in pending if self.queued(q) > 0]
            if not pending or not _pause(deadline, stop, interval):
                return pending
            interval = min(max_interval_s, interval * 2)


def done_key(counter: str) -> str:
    """The key set when ``counter`` (``.../n``) is complete: ``.../done``."""
    return counter.rsplit("/", 1)[0] + "/done"


class Wake:
    """Wakes a thread blocked in :meth:`KV.wait_count` (its owner's stop): sets ``stop``, then
    the done key it blocks on, through a connection of its own (opened beforehand: one opened
    at stop time to a Store whose host died blocks for its timeout)."""

    def __init__(self, kv: KV | None, stop: threading.Event | None = None) -> None:
        self.kv = kv
        self.stop = stop if stop is not None else threading.Event()
        self.key: str | None = None  # the done key being waited on (set by the waiting thread)
        self.queue = False  # ``key`` is a Store queue being popped (coordination/queues.py)

    def __call__(self) -> None:
        self.stop.set()  # first: a waiter that has not blocked yet sees it and does not block
        key = self.key
        if key is not None and self.kv is not None:
            with contextlib.suppress(Exception):  # the Store is gone: the wait ends with it
                if self.queue:
                    self.kv.push(key, WOKEN)
                else:
                    self.kv.set(key, WOKEN)


WOKEN = "woken"  # what a Wake writes (a done key's value, or an entry of a queue of answers)
GONE = "gone"  # what a wait for answers on the node link returns when a rank's link closed meanwhile


def timed_out(exc: RuntimeError) -> bool:
    """torch raises DistStoreError (a RuntimeError) for a wait that timed out and for a lost Store alike."""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def _pause(deadline: float, stop: threading.Event | None, interval: float) -> bool:
    """One wait between polls: ``interval``, or less if the deadline is nearer. False (without
    waiting) once the deadline has passed or ``stop`` is set: time to give up."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or (stop is not None and stop.is_set()):
        return False
    if stop is not None:
        stop.wait(min(interval, remaining))
    else:
        time.sleep(min(interval, remaining))
    return True
