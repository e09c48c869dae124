"""The node link's wire (node_link.py): its messages' frames, and the socket calls that carry them.

A message is one frame: a 4-byte length and a 1-byte operation, then the key, a NUL and the
value. Nobody answers a frame. Sends are bounded by the kernel (SO_SNDTIMEO): a rank that does
not read for SEND_TIMEOUT_S is taken for gone. The hub waits with ``poll`` (not ``select``: a
training process may hold more than 1,024 descriptors); a rank's link with one blocking
``recv`` that the kernel bounds (SO_RCVTIMEO).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import struct
import threading

Frame = tuple[int, str, bytes]  # (operation, key, value)
HEADER = struct.Struct("!IB")  # payload length, operation
SET, DELETE, PUSH, HELLO, BYE = b"S"[0], b"D"[0], b"P"[0], b"H"[0], b"B"[0]
RECV_BYTES = 1 << 18
SEND_TIMEOUT_S = 10.0  # a rank that does not read for this long is taken for gone (its socket is full)


def frame(op: int, key: str, value: bytes = b"") -> bytes:
    payload = key.encode() + b"\0" + value
    return HEADER.pack(len(payload), op) + payload


def poller(fds: tuple[int, ...]) -> select.poll:
    """A poll() object for reading ``fds``. poll(), not select(): a training process may hold more
    than select()'s 1,024 descriptors."""
    polled = select.poll()
    for fd in fds:
        if fd < 0:
            raise ValueError("a closed socket")
        polled.register(fd, select.POLLIN)
    return polled


def poll(poller: select.poll, timeout_s: float) -> list[int]:
    """The descriptors that can be read (or have ended) within ``timeout_s``."""
    return [fd for fd, _ in poller.poll(max(0, math.ceil(timeout_s * 1000)))]


def bound_sends(sock: socket.socket) -> None:
    """A blocking socket (no poll of Python's own before each call: the hub reads once poll() said
    there is something, a rank's link within :func:`bound_receive`), its sends bounded by the
    kernel (SO_SNDTIMEO): a send that cannot finish within SEND_TIMEOUT_S raises, and its rank is
    taken for gone."""
    sock.settimeout(None)
    seconds = int(SEND_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", seconds, int((SEND_TIMEOUT_S - seconds) * 1e6)))


def bound_receive(sock: socket.socket, timeout_s: float) -> None:
    """The next blocking ``recv`` on ``sock`` gives up after ``timeout_s`` (at least 1 ms: 0
    would be no bound)."""
    micros = max(1000, math.ceil(timeout_s * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", micros // 1_000_000, micros % 1_000_000))


def close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Peer:
    """One socket and what arrived on it that is not a whole message yet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.send_lock = threading.Lock()
        self.queue: str | None = None  # (the hub's side) the queue this peer reads, from its hello

    def send(self, data: bytes) -> None:
        with self.send_lock:
            self.sock.sendall(data)

    def frames(self, data: bytes) -> list[Frame]:
        """The whole messages in what arrived so far (the rest waits for more)."""
        buffer = self.buffer + data
        out, at = [], 0
        while len(buffer) - at >= HEADER.size:
            size, op = HEADER.unpack_from(buffer, at)
            end = at + HEADER.size + size
            if end > len(buffer):
                break
            key, _, value = buffer[at + HEADER.size:end].partition(b"\0")
            out.append((op, key.decode(), value))
            at = end
        self.buffer = buffer[at:]
        return out
