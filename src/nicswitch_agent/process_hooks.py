"""What an agent does to the whole process: fork safety for gRPC, SIGTERM/SIGINT, interpreter exit.

Three process-wide concerns, kept out of the agent's own code because they are installed once per
process and act on every live agent.

**Fork safety.** grpcio's core registers fork handlers by default while its Python layer does not (grpcio 1.85;
grpc/grpc PRs #41455, #41769 and issue #41768 track this mixed state and its reverts). A process
whose gRPC threads are busy (the leader's streams, replies and reconnects) then loses forked
children: a 2-worker ``fork`` DataLoader beside a switching leader had a worker die (SIGSEGV) within
a few epochs in every run (tests/test_fork.py; docs/operations.md has the numbers).
``GRPC_ENABLE_FORK_SUPPORT=false`` turns the handlers off; the children never use gRPC, so nothing
is lost. grpc reads the variable once, when it is
first imported, so this module runs from the package's ``__init__``, before any of our modules
imports grpc, and never overrides a value the user set.

**Signals.** Stop live agents cleanly on SIGTERM (and on a SIGINT someone else handles in Python),
then let the signal do what it would have done.

Without this, SIGTERM's default action kills the process at once: a list being executed never
gets its reply (ClusterD then waits out its 15-minute limit), and members wait for a leader
that is gone. With it:

1. The handler (Python runs it on the main thread) starts ``stop()`` of every live agent on a
   thread of its own, ``nicswitch-signal-stop``. It never stops them in the handler: the
   interrupted main thread may hold a lock that ``stop()`` needs (it may be parked inside
   ``step()``), and a handler waiting for it would deadlock.
2. It then chains to the handler that was there before: a Python handler (a framework's own)
   is called at once. The default action (SIGTERM) is restored first, so a second signal kills
   at once as usual, and the stop thread re-raises the signal when the agents are stopped: the
   process dies of the signal, with the same status as without the agent, only after every owed
   reply was sent.

SIGINT under Python's own handler (Ctrl-C raising ``KeyboardInterrupt``) is left to Python. Its
``KeyboardInterrupt`` is raised by C code in the frame the signal interrupted; a handler of ours
would have to raise it itself, and every Ctrl-C traceback would then end in a frame of this module,
reading as a crash of the library. The interrupt stops the agent on its way out instead: ``with
agent:``, a hook on the parked thread (the list answered false, ``step()`` left at once), and
interpreter exit all stop it.

Signals that are ignored (``SIG_IGN``) or handled outside Python are left alone. Handlers can
only be installed from the main thread; an agent started elsewhere logs that it did not.

**Exit and fork.** Live agents are stopped (bounded) at interpreter exit, and forget their streams
in a forked child: :func:`register` does both.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

logger = logging.getLogger("nicswitch_agent")

# -- fork safety (runs at import: the package's __init__ imports this module first) --------------

GRPC_FORK_ENV = "GRPC_ENABLE_FORK_SUPPORT"
# What grpc core reads as false (absl's SimpleAtob, any case). Anything else, "off" included,
# leaves its default on.
_FALSE_VALUES = frozenset({"false", "f", "no", "n", "0"})

USER_VALUE: str | None = os.environ.get(GRPC_FORK_ENV)
"""The variable as the user left it before nicswitch_agent was imported (None: unset)."""
GRPC_IMPORTED_FIRST: bool = "grpc" in sys.modules
"""grpc was loaded before nicswitch_agent: too late to choose its fork handling for it."""

if USER_VALUE is None and not GRPC_IMPORTED_FIRST:
    os.environ[GRPC_FORK_ENV] = "false"  # inherited by child processes too, which is as safe

_warned = False


def fork_safety_problem() -> str | None:
    """Why forked children of this process are at risk from gRPC's fork handlers; None: safe."""
    if USER_VALUE is not None:
        if USER_VALUE.lower() in _FALSE_VALUES:
            return None
        return (f"{GRPC_FORK_ENV}={USER_VALUE!r} was set, which leaves gRPC's fork handlers on: forked "
                f"DataLoader workers may die or hang beside the agent's streams. Set {GRPC_FORK_ENV}=false, or use "
                "multiprocessing_context='spawn' (docs/operations.md, Fork and DataLoader workers)")
    if GRPC_IMPORTED_FIRST:
        return (f"grpc was imported before nicswitch_agent with {GRPC_FORK_ENV} unset, so gRPC's fork handlers "
                "are on: forked DataLoader workers may die or hang beside the agent's streams. Set "
                f"{GRPC_FORK_ENV}=false in the environment, or import nicswitch_agent before anything that "
                "imports grpc (docs/operations.md, Fork and DataLoader workers)")
    return None


def warn_if_unsafe() -> None:
    """Log the problem, if any, as one WARNING per process (called when the leader loads gRPC)."""
    global _warned
    problem = fork_safety_problem()
    if problem is not None and not _warned:
        _warned = True
        logger.warning("%s", problem)


# -- signals -------------------------------------------------------------------------------------

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)

StopAll = Callable[[str], None]


class SignalStopper:
    """The process's one set of agent signal handlers (see the module docstring)."""

    def __init__(self) -> None:
        # Guards the fields below. Reentrant: a signal that lands while install() holds it runs
        # _handle on the same (main) thread, inside install (a plain Lock deadlocked there: Ctrl-C
        # as `demo --server` started its agents hung it).
        self._lock = threading.RLock()
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
            self._pid = os.getpid()  # before a handler is in place: the signal can come at once
            for sig in HANDLED_SIGNALS:
                current = signal.getsignal(sig)
                if current is signal.SIG_IGN or current is None:
                    continue  # ignored on purpose, or owned by C code we cannot chain to
                if current is signal.default_int_handler:
                    continue  # Ctrl-C's KeyboardInterrupt, raised where it interrupts (module docstring)
                if current == self._handle:  # inherited across fork: chain to what was before
                    continue
                self._previous[sig] = current  # first: _handle may run right after the next line
                signal.signal(sig, self._handle)
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


# -- exit and fork -------------------------------------------------------------------------------


class Stoppable(Protocol):
    """What the process hooks need of an agent."""

    @property
    def handles_signals(self) -> bool: ...

    def stop(self, reason: str = ...) -> None: ...


_live_agents: weakref.WeakSet[Stoppable] = weakref.WeakSet()
_hooks_registered = False
_hooks_lock = threading.Lock()


def register(agent: Stoppable) -> None:
    """Stop live agents at interpreter exit (bounded), on SIGTERM/SIGINT (unless the config says
    not to), and make them inert in forked children."""
    global _hooks_registered
    _live_agents.add(agent)
    if agent.handles_signals:
        handled = install(_stop_on_signal)
        if not handled:
            logger.debug("signal handlers not installed (start() was not called on the main thread)")
    with _hooks_lock:
        if _hooks_registered:
            return
        _hooks_registered = True
        atexit.register(_stop_all_at_exit)
        os.register_at_fork(after_in_child=_forget_in_child)


def _stop_all_at_exit() -> None:
    _stop_all("interpreter exit")


def _stop_on_signal(signal_name: str) -> None:
    for agent in list(_live_agents):
        if agent.handles_signals:
            try:
                agent.stop(f"{signal_name} received")
            except Exception:
                logger.debug("stop on %s failed", signal_name, exc_info=True)


def _stop_all(reason: str) -> None:
    """Stop every live agent of this process (stop() waits, bounded, for one already stopping)."""
    for agent in list(_live_agents):
        try:
            agent.stop(reason)
        except Exception:
            logger.debug("stop (%s) failed", reason, exc_info=True)


def _forget_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) inherits the agent object but none of its threads;
    # stop() checks the pid and does nothing there, and the child never owns the streams.
    _live_agents.clear()


__all__ = ["HANDLED_SIGNALS", "SignalStopper", "Stoppable", "fork_safety_problem", "install", "register",
           "warn_if_unsafe"]
