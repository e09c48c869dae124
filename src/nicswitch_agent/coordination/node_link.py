"""The node's Store without a server: the relay's process holds it, the node's ranks a copy.

With node-local fan-out the node's traffic is one writer (the relay) and a few readers (the
node's ranks), each reading its own queue and pushing its answers back. Over a TCPStore every one
of those messages is a request that the Store's server thread, in the relay's process, wakes up
for, parses and answers: 220-310 us per rank per switch on this project's benchmark machine, more
than flat coordination's whole Store bill (docs/performance.md, "One rank per process").

Here nothing serves requests. :class:`NodeHub` (local rank 0's process) is the Store: the relay
and its own member use it in process. Every other rank holds a :class:`NodeLink`: one Unix stream
socket to the hub, and a copy of what the hub sent it. Messages go one way each and nobody
answers them:

- the hub's ``set``/``multi_set``/``delete_key`` go to every rank's copy (an order, a go key);
- a push to rank ``r``'s queue goes to rank ``r`` only (the hub learned the queue's name from the
  rank's hello); a push to any other queue (the answers) stays in the hub;
- a rank's push to a queue that is not its own (an answer) goes to the hub; its own ``set`` and a
  push to its own queue stay in its copy (only its stop writes them: to wake its own wait).

Whoever waits reads the sockets itself (one thread at a time), so a wait costs a kernel wake-up
and no thread hand-off: on the hub a ``poll`` on the ranks' sockets and on a pipe that a local
change writes to; on a rank's link one blocking ``recv`` bounded by the kernel (a rank's only
local change is its stop's wake, which shuts the socket's reading side: the rank reads no more). A
message written to a Unix socket is in the reader's queue once ``send`` returns: the hub holds
nothing for a rank that it could lose by exiting. A rank that starts late gets what the hub sends
from then on (its queue starts empty, as :func:`queues.start` expects). The hub's process ending
closes every rank's socket: each rank's next wait raises a RuntimeError (coordination lost) at
once, where a Store client would find out at its next request; a hub closed on purpose (its
agent stopped) says so first, and the ranks raise :class:`LinkClosed` (nothing failed: logged
as the stop it is, not as an error). A rank's socket closing is the
rank gone: the hub drops it, and a wait for the ranks' answers ends (``GONE``) so the relay need
not wait out the phase for it (queues.gone). Only processes of the hub's own user may join
(SO_PEERCRED), and a rank that does not read for SEND_TIMEOUT_S is dropped.

The socket's name is in Linux's abstract namespace (no file to clean up; it lives and dies with
the hub's socket), so ranks reach it from the same network namespace, as they reached the
node's TCPStore on 127.0.0.1.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from nicswitch_agent.coordination import node_wire as wire
from nicswitch_agent.coordination.kv import GONE
from nicswitch_agent.coordination.node_copy import Copy, LinkClosed, LinkLost

logger = logging.getLogger("nicswitch_agent.coordination")
T = TypeVar("T")
SCHEME = "unix:"  # the address a hub publishes: "unix:@<name>" (abstract namespace)
HELLO_TIMEOUT_S = 2.0  # a rank sends its hello right after it dialled
WAKE_PIPE_BYTES = 1 << 16  # a Linux pipe's default capacity: one read empties it


def supported() -> bool:
    """Abstract Unix socket names are Linux's."""
    return sys.platform.startswith("linux")


def is_address(address: str) -> bool:
    return address.startswith(SCHEME)


class NodeHub(Copy):
    """The node's Store in local rank 0's process (see the module doc). ``address`` is what the
    node's other ranks dial (:class:`NodeLink`). ``local_queue``: the queue of local rank 0's own
    member, which only this process pushes to: its wait never reads the sockets (the relay,
    waiting for the answers, does: had the idle member read them, every answer would cost a
    thread hand-off to the relay). Keys are only ever set here: their waits never read either."""

    def __init__(self, backlog: int = 64, *, local_queue: str | None = None) -> None:
        if not supported():
            raise OSError("the node link needs Linux (abstract Unix socket names)")
        super().__init__()
        self._name = f"nicswitch-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self._name)
        self._listener.listen(backlog)
        self._listener.setblocking(False)
        self._peers: dict[str, wire.Peer] = {}  # by the queue each reads
        self._local_queue = local_queue
        self._gone: set[str] = set()  # the queues of ranks whose link closed (and did not come back)
        self._only_for: dict[str, str] = {}  # a key set for one rank (a go key): the queue that rank reads
        self._gone_count = 0
        self._accept_lock = threading.Lock()
        self.address = f"{SCHEME}@{self._name}"
        self._shut = False
        # The reading thread's poll set, kept while the peers and the listener stay the same objects (one
        # reader at a time): (peers and listener, peer by descriptor, the listener's, poll object).
        self._polled: tuple[tuple[object, ...], dict[int, wire.Peer], list[int], Any] = ((), {}, [], None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, wire.close_fds, self._wake_r, self._wake_w)

    def _readable(self) -> list[wire.Peer]:
        return list(self._peers.values())

    def _listening(self) -> socket.socket | None:
        """The listening socket the reading thread accepts on, under no lock (None once shut)."""
        return None if self._shut else self._listener

    def _changed(self) -> None:
        """A local change: wake the waiters, and the one reading the sockets (under the lock)."""
        self._notify_all()
        if self._reading:
            with contextlib.suppress(BlockingIOError):  # the pipe is full of wakes already
                os.write(self._wake_w, b"x")

    def _read(self, peers: list[wire.Peer], timeout_s: float) -> list[tuple[wire.Peer, list[wire.Frame], str | None]]:
        """One ``poll`` over the peers and the wake pipe (no lock held): what each peer sent,
        and why its socket ended (None while it is open)."""
        listener = self._listening()
        sockets = (*peers, listener)
        try:
            if sockets != self._polled[0]:
                by_fd = {peer.sock.fileno(): peer for peer in peers}
                listening = [] if listener is None else [listener.fileno()]
                self._polled = (sockets, by_fd, listening, wire.poller((*by_fd, *listening, self._wake_r)))
            _, by_fd, listening, poller = self._polled
            ready = wire.poll(poller, timeout_s)
        except (OSError, ValueError):  # a socket closed under us (stop): the caller looks again
            self._polled = ((), {}, [], None)
            return []
        out: list[tuple[wire.Peer, list[wire.Frame], str | None]] = []
        for fd in ready:
            if fd in listening:
                self._accept()  # takes the lock: this thread holds none here
                continue
            if fd == self._wake_r:  # one read takes every wake written so far (the pipe holds 64 KiB at most)
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, WAKE_PIPE_BYTES)
                continue
            peer = by_fd[fd]
            try:
                data = peer.sock.recv(wire.RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                out.append((peer, [], f"{type(exc).__name__}: {exc}"))
                continue
            out.append((peer, peer.frames(data), None if data else "closed by the other side"))
        return out

    def _remote(self, key: str) -> bool:
        return False  # keys are set here only

    def _remote_queue(self, key: str) -> bool:
        return key != self._local_queue

    def _receive(self, peer: wire.Peer, frames: list[wire.Frame]) -> None:
        for op, key, value in frames:
            if op == wire.PUSH:  # an answer; anything else from a rank is not the hub's
                self._apply(op, key, value)

    def _closed(self, peer: wire.Peer, why: str) -> None:
        if peer.queue is not None and self._peers.get(peer.queue) is peer:
            del self._peers[peer.queue]
            self._gone.add(peer.queue)
            self._gone_count += 1
            self._notify()
        peer.sock.close()

    def gone_queues(self) -> frozenset[str]:
        """The queues of the ranks whose link closed: their process is gone (a rank that dials
        again is back)."""
        if not self._gone:  # the common case, asked at every answer: no lock for it
            return frozenset()
        with self._lock:
            return frozenset(self._gone)

    def queue_pop_within(self, key: str, timeout_s: float) -> bytes | None:
        """As a Store's; a wait for the ranks' answers also ends, with ``GONE``, when a rank's link
        closes meanwhile, so the relay can stop waiting for a rank that will never answer."""
        if not self._remote_queue(key):
            return super().queue_pop_within(key, timeout_s)
        return self._pop_answers(key, timeout_s, collections.deque.popleft, GONE.encode())

    def queue_pop_all_within(self, key: str, timeout_s: float) -> list[bytes]:
        """Everything queue ``key`` holds, taken out at once, once it holds something ([] if
        nothing came within ``timeout_s``): the ranks' answers that one read brought, in one call
        of the relay's instead of one each. As :meth:`queue_pop_within`, a rank's link closing
        meanwhile ends the wait, with ``[GONE]``."""
        if not self._remote_queue(key):
            value = super().queue_pop_within(key, timeout_s)
            return [] if value is None else [value]
        return self._pop_answers(key, timeout_s, _emptied, [GONE.encode()]) or []

    def _pop_answers(self, key: str, timeout_s: float, take_from: Callable[[collections.deque[bytes]], T],
                     gone: T) -> T | None:
        """``take_from`` queue ``key`` (under the lock) once it holds something, or ``gone`` once a
        rank's link closed meanwhile; None after ``timeout_s``. What came with an earlier read is
        taken without setting up a wait."""
        with self._lock:
            queue = self._queues.get(key)
            if queue:
                return take_from(queue)
        seen = self._gone_count

        def take() -> T | None:
            queue = self._queues.get(key)
            if queue:
                return take_from(queue)
            return None if self._gone_count == seen else gone

        return self._wait_for(take, timeout_s)

    def _accept(self) -> None:
        """Take the ranks that dialled since the last look, each with its hello (sent right after
        its connect: read with a short bound). A rank's earlier connection is replaced."""
        with self._accept_lock:
            while True:
                try:
                    sock, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return  # closed (stop)
                if not self._same_user(sock):
                    sock.close()
                    continue
                peer = wire.Peer(sock)
                wire.bound_sends(sock)
                hello, after = self._hello(peer)
                if hello is None:
                    sock.close()
                    continue
                with self._lock:
                    old = self._peers.get(hello)
                    if old is not None:
                        old.sock.close()
                    self._peers[hello] = peer
                    self._gone.discard(hello)
                    peer.queue = hello
                    self._queues.pop(hello, None)  # a reader starting now starts empty (queues.start)
                    # What is set now is in every copy, another rank's own keys (its go keys) aside.
                    mine = [(key, value) for key, value in self._data.items()
                            if self._only_for.get(key, hello) == hello]
                    if mine:
                        self._send(peer, b"".join(wire.frame(wire.SET, key, value) for key, value in mine))
                    self._receive(peer, after)
                    self._changed()  # the thread reading the sockets reads this one too from now on

    @staticmethod
    def _same_user(sock: socket.socket) -> bool:
        """Whether the process that dialled runs as this one's user (SO_PEERCRED): an abstract
        name can be dialled by any process of the network namespace, a rank is one of the job's."""
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        if uid == os.getuid():
            return True
        logger.warning("node link: refused a connection from uid %d (the job's ranks run as uid %d)", uid, os.getuid())
        return False

    @staticmethod
    def _hello(peer: wire.Peer) -> tuple[str | None, list[wire.Frame]]:
        """The queue a rank that just dialled reads (its hello, the first message it sends), and
        what it sent after it; None if it sent none within HELLO_TIMEOUT_S."""
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                readable = wire.poll(wire.poller((peer.sock.fileno(),)), remaining)
                data = peer.sock.recv(wire.RECV_BYTES) if readable else b""
            except OSError:
                break
            if not data:
                break
            frames = peer.frames(data)
            if frames:
                op, key, _ = frames[0]
                return (key if op == wire.HELLO else None), frames[1:]
        return None, []

    def _to_every_rank(self, data: bytes) -> None:
        """Under the lock: ``data`` to every connected rank; a rank that cannot take it is dropped."""
        for peer in list(self._peers.values()):
            self._send(peer, data)

    def _send(self, peer: wire.Peer, data: bytes) -> None:
        try:
            peer.send(data)
        except OSError as exc:
            self._closed(peer, f"{type(exc).__name__}: {exc}")

    def set(self, key: str, value: str | bytes) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._accept()
        with self._lock:
            data = b""
            for key, value in zip(keys, values, strict=True):
                self._data[key] = wire.as_bytes(value)
                self._only_for.pop(key, None)
                data += wire.frame(wire.SET, key, self._data[key])
            self._to_every_rank(data)
            self._changed()

    def multi_set_addressed(self, keys: list[str], values: list[str | bytes], readers: list[str]) -> None:
        """As :meth:`multi_set`, but key i reaches only the copy of the rank that reads queue
        ``readers[i]`` (and this one: for local rank 0's member, and a rank that dials again). A
        go key is one rank's: sent to every copy, a node of n ranks would parse n x n of them."""
        self._accept()
        with self._lock:
            for key, value, reader in zip(keys, values, readers, strict=True):
                self._data[key] = wire.as_bytes(value)
                self._only_for[key] = reader
                peer = self._peers.get(reader)
                if peer is not None:
                    self._send(peer, wire.frame(wire.SET, key, self._data[key]))
            self._changed()

    def delete_key(self, key: str) -> bool:
        return self.delete_keys([key]) > 0

    def delete_keys(self, keys: Iterable[str]) -> int:
        """Delete every key, in every copy that has it: one message per rank for them all (a key
        set for one rank only, in that rank's copy)."""
        with self._lock:
            gone = [key for key in keys if self._data.pop(key, None) is not None]
            shared = b"".join(wire.frame(wire.DELETE, key) for key in gone if key not in self._only_for)
            own: dict[str, bytes] = {}
            for key in gone:
                reader = self._only_for.pop(key, None)
                if reader is not None:
                    own[reader] = own.get(reader, b"") + wire.frame(wire.DELETE, key)
            for reader, peer in list(self._peers.items()):
                data = shared + own.get(reader, b"")
                if data:
                    self._send(peer, data)
            return len(gone)

    def queue_push(self, key: str, value: str | bytes) -> None:
        self.queue_push_each([key], value)

    def queue_push_each(self, keys: list[str], value: str | bytes) -> None:
        """Push ``value`` to every queue of ``keys`` (an event to the node's ranks), under one
        lock: each rank's to its socket, the others' here."""
        peers = self._peers
        if set(keys).difference(peers, (self._local_queue,)):
            self._accept()  # a rank that dialled since: its queue may be one of these
        data = wire.as_bytes(value)
        kept = False
        with self._lock:
            for key in keys:
                peer = peers.get(key)
                if peer is None:
                    self._apply(wire.PUSH, key, data)
                    kept = True
                    continue
                try:  # Peer.send written out: three Python calls fewer per rank and event
                    with peer.send_lock:
                        peer.sock.sendall(wire.frame(wire.PUSH, key, data))
                except OSError as exc:
                    self._closed(peer, f"{type(exc).__name__}: {exc}")
            if kept:
                self._changed()

    def queue_len(self, key: str) -> int:
        """A rank's queue is in that rank's socket once sent: nothing of it is held here."""
        return 0 if key in self._peers else super().queue_len(key)

    def close(self, reason: str = "") -> None:
        """Close the listener and every rank's socket (each rank's next wait: coordination lost).
        With ``reason`` (the agent stopped) each rank is told so first: its loss is then the
        stop it is, not an error. Told without blocking: a rank that does not read is not waited for."""
        if reason and not self._shut:
            self._accept()  # ranks that dialled but were never taken in (an idle hub accepts lazily) are told too
        with self._lock:
            if self._shut:
                return
            self._shut = True
            self.lost = "the node hub closed"
            self._listener.close()
            for peer in list(self._peers.values()):
                if reason:
                    with contextlib.suppress(OSError):
                        peer.sock.send(wire.frame(wire.BYE, reason), socket.MSG_DONTWAIT)
                peer.sock.close()
            self._peers.clear()
            self._changed()

    @property
    def ranks_connected(self) -> int:
        self._accept()
        return len(self._peers)


class NodeLink(Copy):
    """A rank's end of its node's link (see the module doc): reads queue ``queue`` (its own)."""

    def __init__(self, address: str, queue: str, timeout_s: float) -> None:
        if not is_address(address):
            raise ValueError(f"not a node link address: {address!r}")
        super().__init__()
        self._queue = queue
        self.address = address
        name = address[len(SCHEME):]
        path = "\0" + name[1:] if name.startswith("@") else name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.sendall(wire.frame(wire.HELLO, queue))
        except OSError as exc:
            sock.close()
            raise LinkLost(f"could not reach the node's relay at {address}: {type(exc).__name__}: {exc}") from exc
        wire.bound_sends(sock)
        self._peer = wire.Peer(sock)
        self._bound = -1.0  # the socket's receive bound (SO_RCVTIMEO) now, in seconds
        self._woken = False  # a local change shut the reading side to wake the reader (see _changed)

    def _readable(self) -> list[wire.Peer]:
        return [] if self.lost else [self._peer]

    def _read(self, peers: list[wire.Peer], timeout_s: float) -> list[tuple[wire.Peer, list[wire.Frame], str | None]]:
        """The link's one socket read with one blocking ``recv`` that the kernel bounds
        (SO_RCVTIMEO), where a ``poll`` on the socket and the wake pipe, then a ``recv``, were two
        system calls and two releases of the GIL for every event (docs/performance.md). A local
        change wakes it by shutting the socket's reading side (:meth:`_changed`)."""
        if not peers:
            return []
        peer = peers[0]
        try:
            if timeout_s <= 0.0:
                data = peer.sock.recv(wire.RECV_BYTES, socket.MSG_DONTWAIT)
            else:
                if timeout_s != self._bound:  # the member waits with one of two bounds: set once each time it changes
                    wire.bound_receive(peer.sock, timeout_s)
                    self._bound = timeout_s
                data = peer.sock.recv(wire.RECV_BYTES)
        except (BlockingIOError, InterruptedError):  # nothing within the bound
            return []
        except OSError as exc:
            return [(peer, [], f"{type(exc).__name__}: {exc}")]
        if not data and self._woken:  # our own shutdown: not a loss, the waits now see this copy only
            return []
        return [(peer, peer.frames(data), None if data else "closed by the other side")]

    def _can_read(self) -> bool:
        return not self._woken

    def queue_pop_within(self, key: str, timeout_s: float) -> bytes | None:
        """As a Store's. The rank's own queue, which its member's thread reads for every event,
        takes a short path: one lock, one ``recv``, one lock (the general wait takes the rest: a
        wait that ends with no event, a rank woken by its stop, another thread reading)."""
        if key != self._queue:
            return super().queue_pop_within(key, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            queue = self._queues.get(key)
            if queue:
                return queue.popleft()
            short = not (self._reading or self.lost or self._woken or timeout_s <= 0.0)
            if short:
                self._reading = True
        if short:
            try:
                arrived = self._read([self._peer], timeout_s)
            except BaseException:
                with self._lock:
                    self._reading = False
                raise
            with self._lock:  # the read's end and what it brought in one hold, as in the general wait
                self._reading = False
                self._take_in(arrived)
                queue = self._queues.get(key)
                if queue:
                    return queue.popleft()
        return super().queue_pop_within(key, deadline - time.monotonic())

    def queued_here(self, key: str) -> int:
        """How many values queue ``key`` holds in this copy, without reading the socket."""
        with self._lock:
            return len(self._queues.get(key, ()))

    def _changed(self) -> None:
        """A local change: on a rank's link only its stop makes one (its own queue's wake, its go
        key's), so a reader blocked in ``recv`` is woken by shutting the socket's reading side.
        From then on the link reads nothing more from the hub (the rank stops): its waits see
        what is in its copy and what is set here; it still sends (an answer its stop gives)."""
        self._notify_all()
        if self._reading and not self._woken:
            self._woken = True
            with contextlib.suppress(OSError):
                self._peer.sock.shutdown(socket.SHUT_RD)

    def _receive(self, peer: wire.Peer, frames: list[wire.Frame]) -> None:
        for op, key, value in frames:
            if op == wire.BYE:  # the hub closes on purpose: what came before it is still taken first
                if not self.lost:
                    self.lost, self.closed_on_purpose = f"the node's relay (local rank 0) stopped: {key}", True
                continue
            self._apply(op, key, value)

    def _closed(self, peer: wire.Peer, why: str) -> None:
        if not self.lost:
            self.lost = f"the node's relay (local rank 0) is gone: its link {why}"
        peer.sock.close()

    def set(self, key: str, value: str | bytes) -> None:
        """In this copy only: only a rank's stop sets a key here (to wake its own wait for a go
        key), and that ends the link's reading (:meth:`_changed`)."""
        with self._lock:
            self._data[key] = wire.as_bytes(value)
            self._changed()

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def queue_push(self, key: str, value: str | bytes) -> None:
        """To the hub (an answer); to this copy if ``key`` is this rank's own queue (its stop's wake)."""
        if key == self._queue:
            with self._lock:
                self._apply(wire.PUSH, key, wire.as_bytes(value))
                self._changed()
            return
        if self.lost:
            raise self._lost_error()
        peer = self._peer
        try:  # Peer.send and wire.as_bytes written out: an answer is sent for every event
            with peer.send_lock:
                peer.sock.sendall(wire.frame(wire.PUSH, key, value.encode() if isinstance(value, str) else value))
        except OSError as exc:
            with self._lock:
                self._closed(self._peer, f"{type(exc).__name__}: {exc}")
                self._changed()
            raise self._lost_error() from exc

    def close(self) -> None:
        with self._lock:
            if not self.lost:
                self.lost = "the node link closed"
            with contextlib.suppress(OSError):  # a recv blocked on it returns (a close alone would not end it)
                self._peer.sock.shutdown(socket.SHUT_RDWR)
            self._peer.sock.close()
            self._changed()


def _emptied(queue: collections.deque[bytes]) -> list[bytes]:
    """What ``queue`` held, in order; it holds nothing now."""
    values = list(queue)
    queue.clear()
    return values


__all__ = ["SCHEME", "LinkClosed", "LinkLost", "NodeHub", "NodeLink", "is_address", "supported"]
