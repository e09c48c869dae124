"""StreamThread: one named daemon thread that owns one cancellable gRPC call at a time.

The notify subscriber and the process-manage client share this lifecycle (python-api-core's
``BackgroundConsumer`` is the model): ``start()`` once; ``stop()`` sets an Event, cancels the call
in flight (the reading thread then gets CANCELLED at once: a blocked ``__next__`` has no timeout
of its own, grpc/grpc#20562), and joins with a bound. Subclasses implement ``_run`` and publish
their call through ``_set_call`` so that ``stop()`` can reach it.

Errors have two faces: ``last_error`` is the error that keeps the stream from working *now* ("" once
it works again: an operator reading "connected yes" beside an old "Connection refused" cannot tell
which one is true), and ``last_error_seen`` keeps the last error and when it happened, for history.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("nicswitch_agent.streams")


class StreamThread(abc.ABC):
    """Lifecycle of a background stream reader; see the module docstring."""

    def __init__(self, name: str, stop_timeout_s: float) -> None:
        self._name = name
        self._stop_timeout_s = stop_timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _call and the subclass's counters
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self.on_open: Callable[[int], None] | None = None  # told the number of opens after each open
        self._error_now = ""  # see last_error
        self._error_seen: tuple[str, float] | None = None  # see last_error_seen

    @property
    def last_error(self) -> str:
        """The error that keeps this stream from working now; "" while it works."""
        return self._error_now

    @property
    def last_error_seen(self) -> dict[str, Any] | None:
        """The last error this stream met, whether or not it still holds: ``{"error": text, "at":
        wall-clock seconds}``; None if it never met one."""
        seen = self._error_seen
        return None if seen is None else {"error": seen[0], "at": seen[1]}

    def _error(self, text: str) -> None:
        """An error now (call with ``self._lock`` held, as the counters are)."""
        self._error_now = text
        self._error_seen = (text, time.time())

    def _error_gone(self) -> None:
        """The stream works again: no error now (the last one stays in ``last_error_seen``)."""
        self._error_now = ""

    def _opened(self, opens: int) -> None:
        """Tell ``on_open`` that a stream was opened (a listener's error never reaches the loop)."""
        if self.on_open is not None:
            try:
                self.on_open(opens)
            except Exception:
                logger.exception("stream open listener failed; ignored")

    def start(self) -> None:
        """Start the thread. A second start() is refused."""
        if self._thread is not None:
            raise RuntimeError(f"{self._name} already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Cancel the call and join the thread (bounded). Idempotent. True if the thread ended."""
        self._stop.set()
        self._on_stop()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(self._stop_timeout_s)
        if thread.is_alive():
            logger.warning("%s did not stop within %.1f s", self._name, self._stop_timeout_s)
            return False
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stream_open(self) -> bool:
        with self._lock:
            return self._call is not None

    def _set_call(self, call: Any) -> None:
        """Publish the call in flight (None when it ended); cancel at once if stop() came first."""
        with self._lock:
            self._call = call
        if call is not None and self._stop.is_set():
            call.cancel()

    def _on_stop(self) -> None:  # noqa: B027 - optional hook
        """Called by stop() before the call is cancelled (e.g. to close a gate)."""

    @abc.abstractmethod
    def _run(self) -> None:
        """The thread's loop; must return soon after ``self._stop`` is set."""


def error_now(notify: StreamThread | None, process_manage: StreamThread | None) -> str:
    """The leader's error now: the notify stream's, or the process-manage stream's while that
    stream, which the notify stream waits for, is not open (or the notify stream has none)."""
    error = notify.last_error if notify is not None else ""
    if process_manage is not None and process_manage.last_error and (not process_manage.stream_open or not error):
        error = process_manage.last_error
    return error


def error_seen(**streams: StreamThread | None) -> dict[str, Any] | None:
    """The most recent error any of ``streams`` met, with when and on which stream (its keyword)."""
    seen = [{**record, "stream": name} for name, stream in streams.items()
            if stream is not None and (record := stream.last_error_seen) is not None]
    return max(seen, key=lambda record: record["at"], default=None)
