"""What both ends of the node link hold: keys and queues in memory, and waits that read the
sockets while they wait (one thread at a time). :class:`~.node_link.NodeHub` and
:class:`~.node_link.NodeLink` say where the sockets are, what a message does to the copy, and how a
local change wakes the thread reading them (node_link.py has the design)."""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from nicswitch_agent.coordination import node_wire as wire
from nicswitch_agent.coordination.kv import StoreTimeout
from nicswitch_agent.coordination.messages import LevelStopped

T = TypeVar("T")
GET_TIMEOUT_S = 300.0  # a get of a key that never comes (as InProcessStore's)


class Copy:
    """Keys and queues in memory, with waits that read the sockets while they wait (see the module doc)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}
        # Every hold takes the lock itself, the condition is for waits only: ``with`` on a lock runs
        # no Python frame, on a Condition two (a few per event, on every rank and relay).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # waits for what the sockets bring (or for their reader)
        # Waits for local changes only (``read=False``: local rank 0's member waiting for its next
        # event): what a read brings (the ranks' answers) never wakes them, only a local change.
        self._local_cond = threading.Condition(self._lock)
        self._reading = False  # a thread is reading the sockets (only one may be)
        self._waiters = 0  # threads in self._cond.wait(): a change with none notifies nobody (no Python call)
        self._local_waiters = 0  # threads in self._local_cond.wait()
        self.lost = ""  # why this side cannot go on (set once): every wait raises it
        self.closed_on_purpose = False  # the other side said it closes (its agent stopped): nothing failed

    # -- what the subclasses say ---------------------------------------------------------------

    def _readable(self) -> list[wire.Peer]:
        raise NotImplementedError

    def _receive(self, peer: wire.Peer, frames: list[wire.Frame]) -> None:
        """Apply what ``peer`` sent (under the lock)."""
        raise NotImplementedError

    def _closed(self, peer: wire.Peer, why: str) -> None:
        """``peer``'s socket ended (under the lock)."""
        raise NotImplementedError

    def _can_read(self) -> bool:
        """Whether a wait may read the sockets at all (a rank's link woken by its stop may not)."""
        return True

    def _lost_error(self) -> LinkLost:
        return LinkClosed(self.lost) if self.closed_on_purpose else LinkLost(self.lost)

    # -- local state ---------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake the threads waiting for what the sockets bring, if any (under the lock)."""
        if self._waiters:
            self._cond.notify_all()

    def _notify_all(self) -> None:
        """A local change: wake every waiting thread, the local waits' too (under the lock)."""
        self._notify()
        if self._local_waiters:
            self._local_cond.notify_all()

    def _changed(self) -> None:
        """A local change: wake the waiters, and the one reading the sockets (under the lock)."""
        raise NotImplementedError

    def _apply(self, op: int, key: str, value: bytes) -> None:
        if op == wire.SET:
            self._data[key] = value
        elif op == wire.DELETE:
            self._data.pop(key, None)
        elif op == wire.PUSH:
            self._queues.setdefault(key, collections.deque()).append(value)

    # -- waiting -------------------------------------------------------------------------------

    def _wait_for(self, take: Callable[[], T | None], timeout_s: float, *, read: bool = True) -> T | None:
        """What ``take()`` gives (called under the lock) once it gives something, or None after
        ``timeout_s``; reads the sockets meanwhile unless another thread does, or ``read`` is
        False (what it waits for comes from this process only: reading would only hand what
        arrives to another thread). Raises :class:`LinkLost` once this side is lost (after what
        arrived before)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while True:
                got = take()
                if got is not None:
                    return got
                if self.lost:
                    raise self._lost_error()
                remaining = deadline - time.monotonic()
                if not read:
                    if remaining <= 0:
                        return None
                    self._local_waiters += 1
                    try:
                        self._local_cond.wait(remaining)
                    finally:
                        self._local_waiters -= 1
                    continue
                if self._reading or not self._can_read():
                    if remaining <= 0:
                        return None
                    self._waiters += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._waiters -= 1
                    continue
                self._reading = True
                peers = self._readable()
                self._lock.release()
                try:
                    arrived = self._read(peers, max(0.0, remaining))
                finally:
                    self._lock.acquire()
                    self._reading = False
                self._take_in(arrived)
                if remaining <= 0:  # one look at what had arrived, then the answer
                    got = take()
                    if got is None and self.lost:
                        raise self._lost_error()
                    return got

    def _take_in(self, arrived: list[tuple[wire.Peer, list[wire.Frame], str | None]]) -> None:
        """What a read brought (under the lock, in the hold that ends the read): each peer's
        messages applied, the sockets that ended closed, the threads waiting for them told."""
        for peer, frames, why in arrived:
            if frames:
                self._receive(peer, frames)
            if why is not None:
                self._closed(peer, why)
        self._notify()

    def _refresh(self) -> None:
        """Take in what has arrived (no wait), so a look at the copy sees it."""
        self._wait_for(lambda: None, 0.0)

    def _read(self, peers: list[wire.Peer], timeout_s: float) -> list[tuple[wire.Peer, list[wire.Frame], str | None]]:
        """Wait up to ``timeout_s`` for the peers (no lock held): what each sent, and why its
        socket ended (None while it is open)."""
        raise NotImplementedError

    # -- the Store calls the coordination makes (kv.KV) ----------------------------------------

    def _remote(self, key: str) -> bool:
        """Whether a wait for ``key`` needs what the sockets bring."""
        return True

    def _remote_queue(self, key: str) -> bool:
        """Whether a wait on queue ``key`` needs what the sockets bring."""
        return True

    def get(self, key: str) -> bytes:
        value = self._wait_for(lambda: self._data.get(key), GET_TIMEOUT_S, read=self._remote(key))
        if value is None:
            raise StoreTimeout(f"get timeout: {key}")
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        if not self._wait_for(lambda: all(k in self._data for k in keys) or None, timeout.total_seconds(),
                              read=any(map(self._remote, keys))):
            raise StoreTimeout(f"wait timeout, keys: {keys}")

    def check(self, keys: list[str]) -> bool:
        self._refresh()
        with self._lock:
            return all(k in self._data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._wait_for(lambda: [self._data[k] for k in keys] if all(k in self._data for k in keys) else None,
                                GET_TIMEOUT_S, read=any(map(self._remote, keys)))
        if values is None:
            raise StoreTimeout(f"multi_get timeout: {keys}")
        return values

    def add(self, key: str, value: int) -> int:
        raise NotImplementedError("the node link has queues, not counters (coordination/queues.py)")

    def queue_pop_within(self, key: str, timeout_s: float) -> bytes | None:
        """The oldest value of queue ``key``, taken out; None if none came within ``timeout_s``."""
        return self._wait_for(lambda: self._take(key), timeout_s, read=self._remote_queue(key))

    def _take(self, key: str) -> bytes | None:
        queue = self._queues.get(key)
        return queue.popleft() if queue else None

    def queue_len(self, key: str) -> int:
        self._refresh()
        with self._lock:
            return len(self._queues.get(key, ()))

    def clone(self) -> Copy:
        return self  # every thread's: the lock is inside

    def close(self) -> None:
        raise NotImplementedError


class LinkLost(RuntimeError):
    """The other side of the node link is gone (a RuntimeError, as a lost Store's DistNetworkError)."""


class LinkClosed(LinkLost, LevelStopped):
    """The hub closed the link on purpose (local rank 0's agent stopped) and said so first."""
