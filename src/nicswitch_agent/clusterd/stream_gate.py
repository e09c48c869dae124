"""StreamGate: the notify stream opens only while, and after, the process-manage stream is open."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import grpc

_Call = TypeVar("_Call", bound=grpc.RpcContext)


class StreamGate:
    """Lets the notify stream open only while (and after) the process-manage stream is open.

    Each opening of the process-manage stream is a new ``generation``: it resets ClusterD's job
    controller and so ends the notify stream opened before it. After its own stream ended, the
    notify subscriber waits for a newer generation, so it reopens *after* the reset.

    The notify stream is started through :meth:`start`, under the gate's lock, and :meth:`close`
    cancels it. A notify subscribe sent while our process-manage stream looked open can still reach
    ClusterD after a reset it had already made (the end of a switch resets the job): without the
    cancel, that stream would be open in the new job state when we subscribe again, which is the
    wrong order (docs/clusterd.md#subscribe-order). With it, the notify stream's cancel goes out
    on the channel before the next subscribe.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()  # guards _open, generation, _dependent and _cancelled*
        self._open = False
        self.generation = 0
        self._dependent: grpc.RpcContext | None = None  # the notify call started under this gate
        self._cancelled: grpc.RpcContext | None = None  # the call close() cancelled, until finish()
        self._cancel_error: str | None = None  # the error close() was given when it cancelled that call

    def open(self) -> None:
        with self._cond:
            self._open, self.generation = True, self.generation + 1
            self._cond.notify_all()

    def close(self, error: str | None = None) -> None:
        """Close, and cancel the stream started under the gate; both are done when this returns.
        ``error``: why the process-manage stream failed (None: it ended cleanly, a reset, or stop):
        the cancelled stream was lost with it (:meth:`lost_with`)."""
        with self._cond:
            self._open = False
            call, self._dependent = self._dependent, None
            if call is not None:
                self._cancelled, self._cancel_error = call, error
            self._cond.notify_all()
        if call is not None:
            call.cancel()  # outside the lock: no new call can start, the gate is closed

    def start(self, open_call: Callable[[], _Call]) -> tuple[_Call, int] | None:
        """Start a stream that :meth:`close` will cancel, and return it with this generation; None
        (nothing started) when the gate is closed."""
        with self._cond:
            if not self._open:
                return None
            call = open_call()
            self._dependent = call
            return call, self.generation

    def cancelled(self, call: grpc.RpcContext) -> bool:
        """Whether :meth:`close` cancelled ``call`` (its end is the gate's, not its own error)."""
        with self._cond:
            return self._cancelled is call

    def lost_with(self, call: grpc.RpcContext) -> str | None:
        """The process-manage stream's error when :meth:`close` cancelled ``call``: the connection
        went, and ``call`` with it (None: not cancelled, or closed by a clean end)."""
        with self._cond:
            return self._cancel_error if self._cancelled is call else None

    def finish(self, call: grpc.RpcContext) -> None:
        """``call`` has ended: forget it."""
        with self._cond:
            if self._dependent is call:
                self._dependent = None
            if self._cancelled is call:
                self._cancelled = None

    def is_set(self) -> bool:
        return self._open

    def wait(self, newer_than: int, timeout: float) -> bool:
        """True once open with a generation above ``newer_than``; False after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._open and self.generation > newer_than, timeout)

    def wait_open(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._open, timeout)
