"""A wait on the main thread that SIGINT and SIGTERM end at once, whichever thread the kernel gave them to.

The kernel hands a signal sent to the process to any thread that does not block it, and gRPC's
threads block none. CPython's C handler then only notes it; the Python handler runs on the main
thread, and a main thread asleep in ``Event.wait`` runs it only when that wait ends. Seen: SIGINT
delivered to a gRPC thread while ``demo --server`` waited for ClusterD, and the command sat out its
300 s ``--timeout`` before it noticed. Python's wakeup fd is written whichever thread the signal
lands on, so a main thread that sleeps in ``select`` on it wakes, and then runs the handler.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from types import TracebackType


class SignalWakeup:
    """Python's wakeup fd, plus :meth:`wake` for the other threads' news. Off the main thread (which
    gets no signal handlers to run) it is a plain wait on :meth:`wake` and ``fd``."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()  # wake() from another thread never writes to a closed (reused) fd
        self._closed = False
        self._main = threading.current_thread() is threading.main_thread()
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False) if self._main else -1

    def __enter__(self) -> SignalWakeup:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def wake(self) -> None:
        """Something :meth:`wait` waits for may have happened (call after setting it, from any thread)."""
        with self._lock, contextlib.suppress(BlockingIOError):  # full: a wakeup is pending anyway
            if not self._closed:
                os.write(self._write, b"\0")

    def wait(self, done: Callable[[], bool], timeout: float | None = None, fd: int | None = None) -> bool:
        """Sleep until ``done()`` holds, ``fd`` is readable or ``timeout`` passed (None: no limit); a signal's
        Python handler runs meanwhile, on this thread. False when the time ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fds = [self._read] if fd is None else [self._read, fd]
        while not done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            readable, _, _ = select.select(fds, [], [], remaining)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read, 512):
                    pass
            if fd is not None and fd in readable:
                return True
        return True

    def close(self) -> None:
        """Give the wakeup fd back to whoever had it (none, usually) and close the pipe."""
        if self._main:
            signal.set_wakeup_fd(self._previous)
        with self._lock:
            self._closed = True
            os.close(self._read)
            os.close(self._write)
