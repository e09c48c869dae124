"""Run one order: checkpoint guard, then switch hook, each under its own timeout.

User code is isolated here: a hook that raises, returns something odd or hangs becomes a false
result, never a dead or wedged agent thread. A hook that overruns its budget keeps running in its
(daemon) thread, because Python cannot kill a thread; while it does, further orders are refused
rather than run concurrently with it (HCCL requires link switches to be serial on every rank).

A hook that raises is logged here, once, at ERROR with its traceback: the reason that travels to
the leader is one line, and a failure deep inside torch_npu needs the whole stack. On the parked
training thread (:class:`InlineRunner`) a ``KeyboardInterrupt`` or ``SystemExit`` raised there
(Ctrl-C, a SIGTERM handler calling ``sys.exit``) is the user's decision to end training, and goes
on up out of ``agent.step()``; any other exception, a library's own ``BaseException`` subclass
included (torch's ``CheckpointException``), is the hook failing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from nicswitch_agent.errors import HookRefused
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.execute")

STOPS = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""What a hook on the training thread raises to end training, not to fail the order."""


class HookStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"  # returned False
    RAISED = "raised"
    TIMEOUT = "timeout"
    BAD_RESULT = "bad_result"  # returned something other than bool/None


@dataclass(frozen=True)
class HookResult:
    """What one hook call came to."""

    name: str
    status: HookStatus
    detail: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.status is HookStatus.OK


@dataclass(frozen=True)
class Execution:
    """The outcome of one order on this process."""

    ok: bool
    reason: str
    guard: HookResult | None = None
    switch: HookResult | None = None
    duration_s: float = 0.0
    warm_up: HookResult | None = None


class HookRunner:
    """Calls hooks in their own daemon thread with a timeout; remembers any that overran."""

    def __init__(self) -> None:
        self._straggler: threading.Thread | None = None
        self._straggler_name = ""

    def busy(self) -> str | None:
        """Name of a hook still running past its timeout, or None."""
        thread = self._straggler
        if thread is not None and thread.is_alive():
            return self._straggler_name
        self._straggler = None
        return None

    def run(self, name: str, hook: Callable[[SwitchOrder], Any], order: SwitchOrder, timeout: float,
            *, expect_bool: bool) -> HookResult:
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                outcome["value"] = hook(order)
            except BaseException as exc:  # user code: every failure becomes a result
                outcome["error"] = exc
            finally:
                done.set()

        started = time.monotonic()
        thread = threading.Thread(target=target, name=f"nicswitch-{name}-{order.seq}", daemon=True)
        thread.start()
        finished = done.wait(timeout)
        duration = time.monotonic() - started
        if not finished:
            self._straggler, self._straggler_name = thread, f"{name} of order #{order.seq}"
            return HookResult(name, HookStatus.TIMEOUT, f"{name} hook did not finish within {timeout:g} s",
                              duration)
        if "error" in outcome:
            return _raised(name, order, outcome["error"], duration)
        return _classify(name, outcome.get("value"), expect_bool, duration)


class InlineRunner(HookRunner):
    """Calls hooks in the current thread (the parked training thread, in pause mode ``agent``).

    It cannot abandon a hook, so the thread waiting for the result enforces the timeouts: it reads
    :meth:`running` (which hook runs, and until when it may) and answers false once a hook
    overruns, then calls :meth:`abandon` so that no later hook of the same order starts (a guard
    that returns late must not be followed by a switch nobody waits for). The training thread
    stays parked until the hook returns; :meth:`busy` names the hook meanwhile.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()  # guards _running and _abandoned
        self._running: tuple[str, float, float] | None = None  # (what, started, timeout)
        self._abandoned = False

    def busy(self) -> str | None:
        """Name of the hook running on the training thread, or None."""
        with self._cond:
            return None if self._running is None else self._running[0]

    def running(self) -> tuple[str, float, float] | None:
        """(what, deadline, timeout) of the hook running now, or None between and after hooks."""
        with self._cond:
            if self._running is None:
                return None
            what, started, timeout = self._running
            return what, started + timeout, timeout

    def abandon(self) -> None:
        """Nobody waits for this order any more: hooks not started yet will not run."""
        with self._cond:
            self._abandoned = True

    def run(self, name: str, hook: Callable[[SwitchOrder], Any], order: SwitchOrder, timeout: float,
            *, expect_bool: bool) -> HookResult:
        with self._cond:
            if self._abandoned:
                return HookResult(name, HookStatus.TIMEOUT, f"{name} hook not run: the order was given up on", 0.0)
            started = time.monotonic()
            self._running = (f"{name} hook of order #{order.seq}", started, timeout)
        try:
            value = hook(order)
        except Exception as exc:  # user code: every failure becomes a result
            return _raised(name, order, exc, time.monotonic() - started)
        except BaseException as exc:
            if isinstance(exc, STOPS):  # the user ends training: on up, out of step()
                raise
            # torch's CheckpointException (a DCP save that failed) derives from BaseException: an
            # outside check saw a read-only checkpoint directory stop training on every rank, where
            # the guard's failure must refuse the switch and training go on.
            return _raised(name, order, exc, time.monotonic() - started)
        finally:
            with self._cond:
                self._running = None
        return _classify(name, value, expect_bool, time.monotonic() - started)


def _raised(name: str, order: SwitchOrder, exc: BaseException, duration: float) -> HookResult:
    """A hook's exception as a result, logged here once with its traceback; a refusal
    (:class:`~nicswitch_agent.errors.HookRefused`) without one: the hook meant it, and says why in
    the result (the leader logs the switch's failure with it; a guard logs its own decision)."""
    if isinstance(exc, HookRefused):
        logger.debug("%s hook refused order #%d: %s", name, order.seq, exc)
        return HookResult(name, HookStatus.RAISED, f"{name} hook refused: {exc}", duration)
    logger.error("%s hook raised on order #%d", name, order.seq, exc_info=(type(exc), exc, exc.__traceback__))
    return HookResult(name, HookStatus.RAISED, f"{name} hook raised {type(exc).__name__}: {exc}", duration)


def _classify(name: str, value: Any, expect_bool: bool, duration: float) -> HookResult:
    if not expect_bool or value is None or value is True:
        return HookResult(name, HookStatus.OK, "ok", duration)
    if value is False:
        return HookResult(name, HookStatus.FAILED, f"{name} hook returned False", duration)
    return HookResult(name, HookStatus.BAD_RESULT,
                      f"{name} hook returned {value!r}; expected True, False or None", duration)


def execute_guard(
    order: SwitchOrder,
    *,
    runner: HookRunner,
    switch_hook: Callable[[SwitchOrder], Any] | None,
    checkpoint_hook: Callable[[SwitchOrder], Any] | None,
    guard_timeout_s: float,
    dry_run: bool,
    warm_up: Callable[[SwitchOrder], Any] | None = None,
    warm_up_timeout_s: float = 0.0,
) -> Execution:
    """What must succeed on this rank before its switch may start: it can switch at all, then the
    checkpoint guard, then the verify hook's warm-up; the first failure decides (switch not attempted).

    The warm-up runs after a refused guard too: it is a collective (a link probe's all_reduce), so
    a rank that skipped it would leave every other rank's waiting for it until their timeout, with
    an op pending in the communicator that training then resumes into (found by an outside check:
    gloo aborted on a collective mismatch after ClusterD's retry). Not after a guard still running
    past its timeout: that rank is stuck anyway, and the outcome says so."""
    if order.empty:
        return Execution(True, "empty list: nothing to switch")
    if dry_run:
        logger.info("dry run: would switch %s", order.summary())
        return Execution(True, "dry run: nothing switched")
    busy = runner.busy()
    if busy is not None:
        return Execution(False, f"refused: the {busy} is still running past its timeout")
    if switch_hook is None:
        return Execution(False, "no switch hook configured")
    guard = warmed = None
    if checkpoint_hook is not None:
        guard = runner.run("checkpoint", checkpoint_hook, order, guard_timeout_s, expect_bool=False)
    if warm_up is not None and runner.busy() is None:
        warmed = runner.run("verify warm-up", warm_up, order, warm_up_timeout_s, expect_bool=True)
    if guard is not None and not guard.ok:
        return Execution(False, f"{guard.detail}; switch not attempted", guard=guard, warm_up=warmed)
    if warmed is not None and not warmed.ok:
        return Execution(False, f"{warmed.detail}; switch not attempted", guard=guard, warm_up=warmed)
    return Execution(True, "guarded" if guard is not None else "ready", guard=guard, warm_up=warmed)


def execute_order(
    order: SwitchOrder,
    *,
    runner: HookRunner,
    switch_hook: Callable[[SwitchOrder], Any] | None,
    checkpoint_hook: Callable[[SwitchOrder], Any] | None,
    guard_timeout_s: float,
    switch_timeout_s: float,
    dry_run: bool,
    warm_up: Callable[[SwitchOrder], Any] | None = None,
    warm_up_timeout_s: float = 0.0,
) -> Execution:
    """Guard, warm-up, then switch; the first failure decides, and a failed guard or warm-up means
    no switch. ``warm_up`` is the verify hook's ``prepare`` (a link probe runs its collective once
    before the first switch, so that the op it replays afterwards travels on links the switch moved).
    The leader runs the guard and the warm-up as a round of their own first where it knows of them
    (:func:`execute_guard`); the switch order then comes without them."""
    guarded = execute_guard(order, runner=runner, switch_hook=switch_hook, checkpoint_hook=checkpoint_hook,
                            guard_timeout_s=guard_timeout_s, dry_run=dry_run, warm_up=warm_up,
                            warm_up_timeout_s=warm_up_timeout_s)
    if not guarded.ok or order.empty or dry_run:
        return guarded
    assert switch_hook is not None  # execute_guard refuses an order without one
    guard = guarded.guard
    switch = runner.run("switch", switch_hook, order, switch_timeout_s, expect_bool=True)
    if not switch.ok:
        return Execution(False, switch.detail, guard=guard, switch=switch)
    return Execution(True, "switched", guard=guard, switch=switch)
