"""ParkingLot: park the training thread at a step boundary, run work there, and let it go.

Used in pause mode ``agent``, where the agent itself pauses training for ClusterD. The training
thread calls :meth:`ParkingLot.at_step_boundary` only when ``pending`` is true, so the idle cost
in ``agent.step()`` is one attribute comparison.

Requests are numbered (epochs). Only the agent's thread writes ``request_epoch``; only the
training thread writes ``handled_epoch``. A boolean flag cleared by the training thread would
race with the next request and lose it (docs/torch-store.md#the-step-aligned-pause: it hung 3 of 6 runs).

While parked, the training thread runs the callables handed to :meth:`run_parked` (the
checkpoint guard and switch hook), so a guard can use the framework as usual (it is the thread
that owns the model). It leaves when :meth:`release` is called, or raises
:class:`TrainingStopped` if the release says training must stop. A ``KeyboardInterrupt`` or
``SystemExit`` raised on it while parked (Ctrl-C during a hook) goes on up out of ``step()`` at
once: the work's future gets it first, so whoever waits for the hook learns it was interrupted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from nicswitch_agent.errors import NicSwitchError

logger = logging.getLogger("nicswitch_agent.pause")

# The training thread, when parked, waits in slices of this length. It is usually the main
# thread, and CPython runs a signal handler only when the main thread executes bytecode: when the
# kernel delivers SIGTERM to another thread, one long wait would hold the handler (and so the
# agent's clean stop) back until the wait ends.
WAIT_SLICE_S = 0.1


class TrainingStopped(NicSwitchError):
    """Raised from ``agent.step()`` when training must stop: ClusterD's recovery decided so (dump,
    exit), or an agent stopped while this rank was parked for a switch that had not ended (the links
    may have moved, or the rest of the job is still paused). The message says which."""


class ParkingLot:
    """One training thread's parking spot (single-process coordination)."""

    def __init__(self, on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 on_armed: Callable[[bool], None] | None = None,
                 *, align_timeout_s: float = 60.0) -> None:
        self._on_event = on_event  # ("parked" | "resumed", detail); called on the training thread
        # Told, under the lock, when a request becomes pending (True) and when the training thread
        # has handled the last one (False): the agent keeps this in a flag of its own, so that an
        # idle step() reads one attribute of its own instead of two of this object.
        self._on_armed = on_armed
        self._align_timeout_s = align_timeout_s
        # Whose training thread parks here, for the log ("rank 3: training parked ..."); the Member
        # that drives this lot sets it. None: the lines name no rank.
        self.rank: int | None = None
        # Every hold takes the lock itself (``with`` on a lock runs no Python frame, on a Condition
        # two: several holds per pause on the member's and the training thread); the condition is
        # for the waits, and a change notifies only when a thread waits (``_waiters``).
        self._lock = threading.RLock()  # guards everything below
        self._cond = threading.Condition(self._lock)
        self._waiters = 0  # threads in _wait(): a change with none notifies nobody
        self._aligned = False  # the current request parks at a target step, once it is known
        self._target: int | None = None
        self._label: int | None = None  # what the parked event calls the current request (request())
        self.request_epoch = 0  # written by the agent thread only
        self.handled_epoch = 0  # written by the training thread only
        self._cancelled_epoch = 0
        self._released_epoch = 0
        self._stop_reason: str | None = None
        self._parked = False
        self._parked_epoch = 0  # the request the thread is parked for (a released one until it wakes)
        self._parked_step: int | None = None
        self._parked_at: float | None = None
        self._parked_thread: threading.Thread | None = None
        # Set by the training thread when a KeyboardInterrupt/SystemExit ended its parking (the
        # exception's type name); cleared by the next request.
        self.interrupted: str | None = None
        self._work: deque[tuple[Callable[[], Any], Future[Any]]] = deque()

    # -- agent side ----------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """True while a pause request has not been handled by the training thread."""
        return self.request_epoch != self.handled_epoch

    @property
    def parked(self) -> bool:
        return self._parked

    @property
    def parked_step(self) -> int | None:
        return self._parked_step

    def request(self, *, aligned: bool = False, label: int | None = None) -> int:
        """Ask the training thread to park; returns the epoch.

        Unaligned: at its next step boundary. Aligned (several ranks): at the target step given
        later by :meth:`set_target`; until then a training thread that reaches a boundary waits
        for the target (it arrives within milliseconds: the leader computes it as soon as every
        rank has said which step it completed last). ``label``: the number the ``parked`` event
        gives this request (the leader's pause, which a process restarted since counts apart).
        """
        with self._lock:
            self.request_epoch += 1
            self._arm(True)
            self._aligned, self._target, self._label = aligned, None, label
            self.interrupted = None
            self._notify()
            return self.request_epoch

    def set_target(self, epoch: int, step: int) -> None:
        """The step at which the training thread parks for ``epoch`` (aligned requests)."""
        with self._lock:
            if epoch == self.request_epoch:
                self._target = step
                self._notify()

    def cancel(self, epoch: int) -> None:
        """Withdraw ``epoch``'s request if the training thread has not parked for it yet."""
        with self._lock:
            self._cancelled_epoch = max(self._cancelled_epoch, epoch)
            self._notify()

    def wait_parked(self, epoch: int, timeout: float) -> bool:
        """Wait until the training thread parked for ``epoch``; on timeout cancel the request.

        The cancel happens under the same lock the training thread takes before parking, so
        after a False the thread can no longer park for this epoch: training is never left
        parked by a pause that was reported as failed.
        """
        with self._lock:
            # Parked for this request, not still in the parking of one released a moment ago: a
            # release followed at once by the next pause finds the thread there until it wakes.
            ok = self._wait_for(lambda: self._parked and self._parked_epoch == epoch == self.request_epoch,
                                timeout, slice_s=None)
            if not ok:
                self._cancelled_epoch = max(self._cancelled_epoch, epoch)
                self._notify()
            return ok

    def run_parked(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the parked training thread; the future holds its result or exception."""
        future: Future[Any] = Future()
        with self._lock:
            if not self._parked or self._parked_epoch != self.request_epoch or \
                    self._released_epoch >= self.request_epoch:
                future.set_exception(RuntimeError("training is not parked"))
                return future
            self._work.append((fn, future))
            self._notify()
        return future

    def release(self, *, stop_reason: str | None = None) -> bool:
        """Let the training thread go (``stop_reason``: make ``step()`` raise TrainingStopped).

        Also cancels a request the thread has not reached yet. Returns True if it was parked.
        """
        with self._lock:
            was_parked = self._parked
            if stop_reason is not None and not was_parked:
                # Make the next step() come in here once, so it raises TrainingStopped.
                self.request_epoch += 1
                self._arm(True)
            self._released_epoch = self.request_epoch
            self._cancelled_epoch = self.request_epoch
            if stop_reason is not None:
                self._stop_reason = stop_reason
            self._notify()
            return was_parked

    def let_go(self, *, stop_reason_if_parked: str | None) -> bool:
        """The agent goes away: never leave the training thread parked behind it. A parked thread
        leaves to raise TrainingStopped(``stop_reason_if_parked``) when one is given (the rest of
        the job is still paused, or its links may have moved) instead of resuming; a thread that is
        not parked trains on (a request it has not reached is cancelled). True if it was parked."""
        with self._lock:  # parked or not, decided with the release (an RLock: release() takes it again)
            return self.release(stop_reason=stop_reason_if_parked if self._parked else None)

    def wait_unparked(self, timeout: float) -> bool:
        """Wait (bounded) until the training thread has left its parking spot, its ``resumed``
        event emitted; True if it is not parked. Never waits when called by that thread."""
        with self._lock:
            if self._parked_thread is threading.current_thread():
                return not self._parked
            return self._wait_for(lambda: not self._parked, timeout, slice_s=None)

    def stop_requested(self) -> str | None:
        return self._stop_reason

    # -- training side -------------------------------------------------------------------------

    def at_step_boundary(self, step: int | None) -> None:
        """Called by the training thread when ``pending``; parks if the request still stands.

        Aligned requests: below the target step, training goes on (the request stays pending);
        at the target it parks. Nothing lets a rank pass the target, and every rank reaches it.
        """
        with self._lock:
            epoch = self.request_epoch
            if self._aligned and self._target is None and not self._withdrawn(epoch):
                if not self._wait_for(lambda: self._target is not None or self._withdrawn(epoch)
                                      or self.request_epoch != epoch, self._align_timeout_s):
                    logger.error("%sno target step for pause #%d within %.0f s (the pause failed, or the leader is "
                                 "gone); training goes on", self._who(), epoch, self._align_timeout_s)
                    self._cancelled_epoch = max(self._cancelled_epoch, epoch)
                epoch = self.request_epoch
            if self._withdrawn(epoch):
                self._handled(epoch)
                self._raise_if_stopped()
                return
            target = self._target if self._aligned else None
            if target is not None and step is not None and step < target:
                return  # train on to the target step
            if target is not None and step is not None and step > target:
                logger.error("%sreached step %s past the pause target %s; parking here", self._who(), step, target)
            self._parked, self._parked_epoch, self._parked_step, self._parked_at = True, epoch, step, time.monotonic()
            self._parked_thread = threading.current_thread()
            self._notify()
            logger.info("%straining parked at step %s", self._who(), step)
            self._emit("parked", {"step": step, "epoch": epoch if self._label is None else self._label})
            interrupted: BaseException | None = None
            try:
                while True:
                    while self._work:
                        fn, future = self._work.popleft()
                        self._lock.release()
                        try:
                            if future.set_running_or_notify_cancel():
                                try:
                                    future.set_result(fn())
                                except Exception as exc:  # user code: report, never raise here
                                    future.set_exception(exc)
                                except BaseException as exc:
                                    # Ctrl-C or sys.exit() in a hook: tell the waiter, then leave.
                                    future.set_exception(exc)
                                    raise
                        finally:
                            self._lock.acquire()
                    if self._released_epoch >= epoch:
                        break
                    self._wait(WAIT_SLICE_S)
            except BaseException as exc:
                # KeyboardInterrupt/SystemExit while parked (in a hook or between): the user ends
                # training here, and it must not resume. Recorded for the member, which answers
                # any later order of this pause false instead of switching under a gone thread.
                interrupted = exc
                self.interrupted = type(exc).__name__
                raise
            finally:
                parked_for = time.monotonic() - (self._parked_at or time.monotonic())
                self._parked, self._parked_at, self._parked_thread = False, None, None
                self._handled(epoch)
                self._fail_leftover_work()
                self._notify()
                if interrupted is not None:
                    logger.warning("%straining left its parking spot after %.1f ms: %s raised on the training thread; "
                                   "it does not resume", self._who(), parked_for * 1000, type(interrupted).__name__)
                    self._emit("resumed", {"step": step, "parked_s": parked_for, "stop": self._stop_reason,
                                           "interrupted": type(interrupted).__name__})
            if self._stop_reason is None:
                logger.info("%straining resumed after %.1f ms parked", self._who(), parked_for * 1000)
            else:  # step() raises TrainingStopped next: it does not resume
                logger.info("%straining leaves its parking spot after %.1f ms parked, to stop: %s", self._who(),
                            parked_for * 1000, self._stop_reason)
            self._emit("resumed", {"step": step, "parked_s": parked_for, "stop": self._stop_reason,
                                   "interrupted": None})
            self._raise_if_stopped()

    def _fail_leftover_work(self) -> None:
        """Work handed over but never run (the thread left): its waiter must not wait for ever."""
        while self._work:
            _fn, future = self._work.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("training left its parking spot before this ran"))

    def _who(self) -> str:
        return "" if self.rank is None else f"rank {self.rank}: "

    def _emit(self, kind: str, detail: dict[str, Any]) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, detail)
            except Exception:
                logger.exception("parking event listener failed; ignored")

    def _arm(self, armed: bool) -> None:
        if self._on_armed is not None:
            self._on_armed(armed)

    def _handled(self, epoch: int) -> None:
        """The training thread handled ``epoch`` (the caller holds the lock)."""
        self.handled_epoch = epoch
        if self.request_epoch == epoch:
            self._arm(False)

    def _notify(self) -> None:
        """A change: wake the threads waiting for one, if any (the caller holds the lock)."""
        if self._waiters:
            self._cond.notify_all()

    def _wait(self, timeout: float) -> None:
        """Wait for a change, counted in ``_waiters`` (the caller holds the lock)."""
        self._waiters += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiters -= 1

    def _wait_for(self, predicate: Callable[[], bool], timeout: float, slice_s: float | None = WAIT_SLICE_S) -> bool:
        """``Condition.wait_for``, in slices of ``slice_s`` (the training thread's waits: see
        WAIT_SLICE_S) or in one wait (None: the agent's threads); the caller holds the lock."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._wait(remaining if slice_s is None else min(remaining, slice_s))
        return True

    def _withdrawn(self, epoch: int) -> bool:
        return self._cancelled_epoch >= epoch or self._released_epoch >= epoch

    def _raise_if_stopped(self) -> None:
        if self._stop_reason is not None:
            raise TrainingStopped(self._stop_reason)
