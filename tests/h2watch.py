"""A TCP relay that reads the HTTP/2 frames passing through it: which pings a client sent, and
whether the server answered with GOAWAY (used by tests/test_keepalive.py).

gRPC exposes neither the keepalive pings a channel sends nor the GOAWAY frames a server answers
with; a relay between the two sees both. It forwards every byte unchanged and as it arrives, and
only counts: per connection, the client's PINGs (not ACKs) since the server last sent a frame other
than a PING (a server's DATA, HEADERS or WINDOW_UPDATE resets its ping strikes), and any GOAWAY
from the server with its error code and debug data.

A ping counts by the server's clock, not the relay's: by where the server's ACK of it (same 8
bytes) falls in what the server wrote. A ping can cross a server's HEADERS in flight: the relay
forwards it before it sees the HEADERS, yet the server received it after it wrote them and so
after it reset its strikes. Counted at the relay it would be lost to the reset; its ACK comes after
the HEADERS, and so does the count. (CI once saw GOAWAY "on the 3rd" ping that way.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PING, GOAWAY = 0x6, 0x7
ACK = 0x1


@dataclass
class Connection:
    """What one relayed connection carried so far (read under :attr:`PingWatch.cond`)."""

    pings: int = 0  # the client's PINGs, in all
    quiet_pings: int = 0  # the client's PINGs the server ACKed since its last frame other than a PING
    goaway: tuple[int, bytes] | None = None  # (error code, debug data) of the server's GOAWAY
    # When the GOAWAY came: quiet_pings and the pings not ACKed yet (the one it answered among them)
    goaway_quiet_pings: int | None = None
    unacked: Counter[bytes] = field(default_factory=Counter)  # the client's pings not ACKed yet, by payload
    early: Counter[bytes] = field(default_factory=Counter)  # ACKs seen before their ping was counted
    open: bool = True
    server_frames: list[int] = field(default_factory=list)  # frame types, for failure messages


class PingWatch:
    """Relay ``127.0.0.1:<port>`` -> ``target``; :attr:`address` is what the client dials."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.cond = threading.Condition()  # guards connections; notified on every count
        self.connections: list[Connection] = []
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        self._start(self._accept, "h2watch-accept")

    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self._target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            conn = Connection()
            with self.cond:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self.connections.append(conn)
                self._sockets += [client, server]
            self._start(self._pump, "h2watch-up", client, server, conn, True)
            self._start(self._pump, "h2watch-down", server, client, conn, False)

    def _pump(self, source: socket.socket, sink: socket.socket, conn: Connection, from_client: bool) -> None:
        buffer = b""
        preface = len(PREFACE) if from_client else 0
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
                buffer += chunk
                if preface:
                    taken = min(preface, len(buffer))
                    buffer, preface = buffer[taken:], preface - taken
                while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                    length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                    payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                    self._count(conn, from_client, kind, flags, payload)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self.cond:
                conn.open = False
                self.cond.notify_all()

    def _count(self, conn: Connection, from_client: bool, kind: int, flags: int, payload: bytes) -> None:
        with self.cond:
            if from_client:
                if kind == PING and not flags & ACK:
                    conn.pings += 1
                    if conn.early[payload]:  # its ACK was counted already (forwarded before counted)
                        conn.early[payload] -= 1
                    else:
                        conn.unacked[payload] += 1
            else:
                conn.server_frames.append(kind)
                if kind == GOAWAY:
                    conn.goaway = (int.from_bytes(payload[4:8], "big"), payload[8:])
                    conn.goaway_quiet_pings = conn.quiet_pings + conn.unacked.total()
                elif kind == PING and flags & ACK:
                    if conn.unacked[payload]:
                        conn.unacked[payload] -= 1
                    else:
                        conn.early[payload] += 1
                    conn.quiet_pings += 1
                elif kind != PING:
                    conn.quiet_pings = 0
            self.cond.notify_all()

    def wait(self, predicate: Callable[[list[Connection]], bool], timeout: float) -> bool:
        """Wait until ``predicate(connections)`` holds, re-checked on every frame counted."""
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self.connections), timeout)

    def close(self) -> None:
        with self.cond:
            self._closed = True
            sockets = list(self._sockets)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        self._threads[0].join(5)  # the acceptor: no thread is started after this
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> PingWatch:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
