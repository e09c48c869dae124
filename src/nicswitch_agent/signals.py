"""Stop live agents cleanly on SIGTERM/SIGINT, then let the signal do what it would have done.

Without this, SIGTERM's default action kills the process at once: a list being executed never
gets its reply (ClusterD then waits out its 15-minute limit), and members wait for a leader
that is gone. With it:

1. The handler (Python runs it on the main thread) starts ``stop()`` of every live agent on a
   thread of its own, ``nicswitch-signal-stop``. It never stops them in the handler: the
   interrupted main thread may hold a lock that ``stop()`` needs (it may be parked inside
   ``step()``), and a handler waiting for it would deadlock.
2. It then chains to the handler that was there before: a Python handler (SIGINT's
   ``KeyboardInterrupt``, a framework's own) is called at once. The default action (SIGTERM) is
   restored first, so a second signal kills at once as usual, and the stop thread re-raises the
   signal when the agents are stopped: the process dies of the signal, with the same status as
   without the agent, only after every owed reply was sent.

Signals that are ignored (``SIG_IGN``) or handled outside Python are left alone. Handlers can
only be installed from the main thread; an agent started elsewhere logs that it did not.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger("nicswitch_agent")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

StopAll = Callable[[str], None]


class SignalStopper:
    """The process's one set of agent signal handlers (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the fields below
        self._previous: dict[int, Any] = {}
        self._pid = 0
        self._stop_all: StopAll | None = None
        self._stopping: threading.Thread | None = None

    def install(self, stop_all: StopAll) -> tuple[str, ...]:
        """Install the handlers (once per process; later calls only refresh ``stop_all``).

        Returns the names of the signals handled, empty when not on the main thread.
        """
        with self._lock:
            self._stop_all = stop_all
            if self._pid == os.getpid():
                return tuple(signal.Signals(s).name for s in self._previous)
            if threading.current_thread() is not threading.main_thread():
                return ()
            self._previous = {}
            self._stopping = None
            for sig in HANDLED_SIGNALS:
                current = signal.getsignal(sig)
                if current is signal.SIG_IGN or current is None:
                    continue  # ignored on purpose, or owned by C code we cannot chain to
                if current == self._handle:  # inherited across fork: chain to what was before
                    continue
                signal.signal(sig, self._handle)
                self._previous[sig] = current
            self._pid = os.getpid()
            return tuple(signal.Signals(s).name for s in self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            previous = self._previous.get(signum, signal.SIG_DFL)
            stop_all = self._stop_all if self._pid == os.getpid() else None  # a forked child owns no agent
            first = self._stopping is None or not self._stopping.is_alive()
            default = previous is signal.SIG_DFL or previous is None
            if default:
                signal.signal(signum, signal.SIG_DFL)  # a second signal kills at once, as usual
        if stop_all is not None and first:
            logger.info("%s received: stopping the agent (a false reply for any list owed one)", name)
            thread = threading.Thread(target=self._stop_then_resignal, args=(stop_all, name, signum, default),
                                      name="nicswitch-signal-stop", daemon=True)
            with self._lock:
                self._stopping = thread
            thread.start()
        elif default:
            os.kill(os.getpid(), signum)  # nothing of ours to stop: the default action, now
        if not default and callable(previous):
            previous(signum, frame)

    @staticmethod
    def _stop_then_resignal(stop_all: StopAll, name: str, signum: int, resignal: bool) -> None:
        try:
            stop_all(name)
        except Exception:
            logger.exception("stopping the agent after %s failed", name)
        if resignal:
            os.kill(os.getpid(), signum)  # the default action is back in place: the process dies of it


_stopper = SignalStopper()


def install(stop_all: StopAll) -> tuple[str, ...]:
    """Install the process's agent signal handlers; see :class:`SignalStopper`."""
    return _stopper.install(stop_all)


__all__ = ["HANDLED_SIGNALS", "SignalStopper", "install"]
