"""Member: every training rank's side of coordination, on a background thread.

The member reads its event queue (see messages.py) and drives the rank's :class:`ParkingLot`:

- ``pause``: first set the local pause flag (``lot.request(aligned=True)``), *then* read the last
  step the training thread completed (``c_r``) and publish it. The training thread records its
  step *before* it checks the flag, so every step that ended without seeing the flag is <= c_r;
  the leader's target ``S = max(c_r) + 1`` is therefore reachable by every rank and passed by
  none (docs/architecture.md has the full argument; reading c_r first deadlocked in 6 trials).
- ``target``: hand S to the training thread, wait until it parks, publish ``parked``.
- ``order``: run the guard/switch (or rollback, or checkpoint) — on the parked training thread
  when parked (pause mode agent), else on this thread with timeouts (pause mode external) — and
  publish the result. Every rank runs the same full list in the received order. A ``verify``
  order (the leader sends one only once the switch succeeded on every rank) runs the verify hook
  the same way, on the same thread as the switch hook when parked. A switch order that says a
  verify round may follow (``"v"``) is followed, on a rank that switched, by a blocking read of
  the switch's go key instead of the queue: the verify order, or a wake (messages.py). So is a
  guard round, on a rank whose guard passed: the switch order, or a wake.
- ``outcome``: the leader's decision on an order; told to listeners as ``switch_outcome``, so a
  rank that is only a member (the launcher leads) learns how a switch ended too.
- ``release``: let the training thread go (or make ``step()`` raise TrainingStopped).

On the parked training thread the member enforces each hook's own timeout (the guard's only if
there is a guard): it watches which hook runs and answers false as soon as that hook overruns.
The thread stays parked until the hook returns; meanwhile every later order is answered false at
once on this rank (``refused: the switch hook of order #N is still running``).

A member never blocks training for ever: parked longer than ``max_parked_s`` without a word from
the leader, or with the Store gone, it lets training go on and says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination import queues
from nicswitch_agent.coordination.hook_runner import (
    Execution,
    HookResult,
    HookRunner,
    HookStatus,
    InlineRunner,
    execute_guard,
    execute_order,
)
from nicswitch_agent.coordination.kv import KV
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.hooks.base import hook_record
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.member")

IDLE_WAIT_S = 3600.0  # one blocking wait per hour when idle; stop() wakes it at once
IDLE_SLICE_S = 0.05  # while no hook runs on the training thread: how often to look again
_LINK_HOOKS = ("switch", "rollback", "verify")  # hooks that run after links may have moved (attempted)


@dataclass(frozen=True)
class MemberHooks:
    switch_hook: Callable[[SwitchOrder], Any] | None
    checkpoint_hook: Callable[[SwitchOrder], Any] | None
    guard_timeout_s: float
    switch_timeout_s: float
    dry_run: bool
    local_ranks: Callable[[SwitchOrder], tuple[int, ...]] | None = None
    verify_hook: Callable[[SwitchOrder], Any] | None = None
    verify_timeout_s: float = 30.0

    @property
    def warm_up(self) -> Callable[[SwitchOrder], Any] | None:
        """The verify hook's ``prepare(order)``, run right before the switch hook; None if it has none."""
        prepare = getattr(self.verify_hook, "prepare", None)
        return prepare if callable(prepare) else None


class Member:
    """One rank's coordination thread (``nicswitch-member``)."""

    def __init__(
        self,
        kv: KV,
        rank: int,
        lot: ParkingLot,
        hooks: MemberHooks,
        last_step: Callable[[], int | None],
        *,
        max_parked_s: float = 1800.0,
        stop_timeout_s: float = 1.0,
        on_lost: Callable[[str], None] | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        slot: int | None = None,
        on_started: Callable[[], object] | None = None,
        on_stopping: Callable[[bool], object] | None = None,
    ) -> None:
        self.kv = kv
        self.rank = rank
        # Where this member's keys live on its Store: its global rank, or with node-local fan-out
        # its local rank on the node's Store (relay.py). Results always name the global rank.
        self.slot = rank if slot is None else slot
        self.lot = lot
        lot.rank = rank  # its log lines name the rank
        self.hooks = hooks
        self._last_step = last_step
        self._max_parked_s = max_parked_s
        self._stop_timeout_s = stop_timeout_s
        self._on_lost = on_lost
        self._on_event = on_event
        # Called on the member's thread once it has its queue position (joining.join); an error
        # there is coordination lost, as any Store error.
        self._on_started = on_started
        # First in stop(), while the Store is still reached (joining.leave), told whether this
        # rank's parked training now leaves to stop (its answer to an order in flight says so).
        self._on_stopping = on_stopping
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 1  # the queue index this member waits for
        self._local_epoch: dict[int, int] = {}  # leader epoch -> ParkingLot epoch
        self._runner = HookRunner()
        self._inline: InlineRunner | None = None  # the last order's runner on the parked training thread
        self._wake_kv: KV | None = None
        # For switch_outcome: (order key, this rank's op in it, a hook ran here, and returned True).
        self._target: tuple[str, bool | None, bool, bool] = ("", None, False, False)
        self._result_lock = threading.Lock()  # guards _in_flight: one result per order, from run or stop
        self._in_flight: tuple[int, str, int | None] | None = None  # (epoch, order key, answerers) being run
        self._go: str | None = None  # the go key being waited on (guarded by _result_lock: stop wakes it)
        self.events_handled = 0
        self.lost = ""
        self._job_stopping = False  # a release told training to stop: the Stores' hosts may end any time now
        self.last_verify: dict[str, Any] | None = None  # this rank's last verification, for status()
        self._last_order: tuple[str, SwitchOrder] | None = None  # (name, order) of the last order run

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("Member already started")
        # The connection stop() uses to wake the idle wait is opened now, while the Store is
        # surely up: opening one in stop() after the Store's host died blocks for its timeout.
        self._wake_kv = self.kv.clone()
        self._thread = threading.Thread(target=self._run, name="nicswitch-member", daemon=True)
        self._thread.start()

    def stop(self, *, parked_training_stops: bool = False) -> None:
        """Stop the thread (bounded). An order still running is answered failed at once, so the
        leader replies false now instead of waiting out the hooks' budget for a rank going away.

        ``parked_training_stops``: the agent's stop makes this rank's training, if parked, leave to
        raise TrainingStopped (it does not resume): that answer then says *interrupted*, so the
        leader stops the job at once instead of waiting out a rollback this rank cannot answer."""
        interrupted = parked_training_stops and self.lot.parked
        if self._on_stopping is not None and not self.lost and not self._stop.is_set():
            try:
                self._on_stopping(interrupted)
            except Exception:
                logger.debug("rank %d: the stop callback failed", self.rank, exc_info=True)
        self._stop.set()
        with self._result_lock:
            in_flight, self._in_flight = self._in_flight, None
            go = self._go
        try:
            if in_flight is not None and self._wake_kv is not None and not self.lost:
                epoch, name, expected = in_flight
                queues.answer_result(self._wake_kv, epoch, name, p.MemberResult(
                    self.rank, False, "the agent on this rank stopped during the order", attempted=True,
                    interrupted=interrupted), expected)
            if go is not None and self._wake_kv is not None and not self.lost:
                self._wake_kv.set(go, p.encode({"t": p.WAKE}))
        except Exception:
            logger.debug("could not answer the order in flight", exc_info=True)
        try:  # wake our own idle wait: nobody else reads this member's queue
            if self._wake_kv is not None and not self.lost:
                queues.wake(self._wake_kv, self.slot, self._next, keep_event=False)
        except Exception:
            logger.debug("could not wake the member thread", exc_info=True)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._stop_timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stuck_hook(self) -> str | None:
        """A hook still running on this rank past its timeout, in words; None if there is none.

        While there is one, every order reaching this rank is answered false without running
        anything (hooks must not run side by side: HCCL switches are serial on every rank).
        """
        inline = self._inline
        running = inline.running() if inline is not None else None
        if running is not None and time.monotonic() >= running[1]:
            return f"{running[0]} (on the training thread, which stays parked until it returns)"
        straggler = self._runner.busy()
        return None if straggler is None else f"{straggler} (on a hook thread of its own)"

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a bug or an error nobody foresaw: never leave training parked, silently
            logger.exception("rank %d: the member thread failed", self.rank)
            self._coordination_lost(f"the member thread failed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        kv = self.kv
        try:
            self._next = queues.start(kv, self.slot)  # joining a leader that already published: after it
            if self._on_started is not None:
                self._on_started()
        except RuntimeError as exc:
            self._coordination_lost(f"{type(exc).__name__}: {exc}")
            return
        read, done = queues.reader_for(kv, self.slot)
        while not self._stop.is_set():
            n = self._next
            try:
                timeout = self._max_parked_s if self.lot.parked else IDLE_WAIT_S
                text = read(n, timeout)
                if text is None:
                    if self.lot.parked:
                        logger.error("parked for %.0f s without a word from the leader; letting training go on",
                                     self._max_parked_s)
                        self.lot.release()
                    continue
            except RuntimeError as exc:  # DistNetworkError and friends: the Store is gone
                self._coordination_lost(f"{type(exc).__name__}: {exc}", stopped=isinstance(exc, p.LevelStopped))
                return
            self._next += 1
            try:
                self._take(text)
                if done is not None:
                    done(n)  # once answered: a key's delete is off the phase's critical path
            except RuntimeError as exc:
                self._coordination_lost(f"{type(exc).__name__}: {exc}", stopped=isinstance(exc, p.LevelStopped))
                return

    def _take(self, text: str) -> None:
        """Handle one event read from the queue (a wake or a malformed one: nothing to do)."""
        try:
            message = p.decode(text)
        except ValueError as exc:
            logger.error("rank %d: ignoring a malformed coordination message: %s", self.rank, exc)
            return
        if message["t"] == p.WAKE:
            return
        try:
            carried = message.get(p.CARRIED_OUTCOME)
            if isinstance(carried, dict):  # a decision that rode on this event: it came first
                self._handle(carried)
            self._handle(message)
        except RuntimeError:
            raise
        except Exception:
            logger.exception("rank %d: handling %s failed", self.rank, message.get("t"))
        self.events_handled += 1

    def _coordination_lost(self, why: str, *, stopped: bool = False) -> None:
        """``stopped``: the level above ended on purpose (its agent stopped). That, or a loss once
        the job was told to stop (its hosts are ending), is the stop it is: INFO, not ERROR."""
        self.lost = why
        if self._stop.is_set():
            return
        logger.log(logging.INFO if stopped or self._job_stopping else logging.ERROR,
                   "rank %d: coordination store lost (%s); switches cannot run here, training goes on",
                   self.rank, why)
        self.lot.release()
        self._emit("coordination_lost", {"rank": self.rank, "why": why})
        if self._on_lost is not None:
            try:
                self._on_lost(why)
            except Exception:
                logger.exception("on_lost callback failed")

    def _handle(self, message: dict[str, Any], *, from_go: bool = False) -> None:
        kind, epoch = message["t"], int(message.get("e", 0))
        if kind == p.PAUSE:
            local = self.lot.request(aligned=True, label=epoch)  # the flag first ...
            self._local_epoch[epoch] = local
            completed = self._last_step()  # ... then the last completed step
            # (None: step() was never called, which a pause that times out says)
            queues.answer_pause(self.kv, epoch, self.slot, completed, _expected(message))
            if self._on_event is not None:  # (the event's dict is made only for a listener)
                self._emit("pause_requested", {"epoch": epoch, "completed_step": completed,
                                               "sent_at": message.get("at")})
        elif kind == p.TARGET:
            target_epoch = self._local_epoch.get(epoch)
            if target_epoch is None:
                return
            self.lot.set_target(target_epoch, int(message["S"]))
            if self.lot.wait_parked(target_epoch, float(message.get("timeout", 60.0))):
                queues.answer_parked(self.kv, epoch, self.slot, self.lot.parked_step, _expected(message))
        elif kind == p.ORDER:
            started = time.monotonic()
            name = str(message["key"])
            order = self._order_of(name, message, decided_check=not from_go)
            if order is None:
                return
            with self._result_lock:
                self._in_flight = (epoch, name, _expected(message))
            result = self._run_order(epoch, message, order)
            if self._target[0] == name:
                self._target = (name, self._target[1], result.attempted, result.ok and result.attempted)
            duration = time.monotonic() - started
            if self._on_event is not None:
                self._emit("member_result", {"rank": self.rank, "kind": message.get("kind"), "ok": result.ok,
                                             "reason": result.reason, "duration_s": duration,
                                             "parked": self.lot.parked, **_origin(message)})
            if message.get("kind") == p.KIND_VERIFY and self.hooks.verify_hook is not None and not self.hooks.dry_run:
                self._record_verify(name, result, duration)
            with self._result_lock:
                answered_by_stop = self._in_flight is None or self._in_flight[:2] != (epoch, name)
                self._in_flight = None
            if not answered_by_stop:
                queues.answer_result(self.kv, epoch, name, result, _expected(message))
                if result.ok and p.followed_by_go(message):
                    self._follow_go(epoch, name, message)
        elif kind == p.OUTCOME:
            if self._on_event is None:
                return
            key, op, ran_here, done_here = self._target
            ours = op is not None and key == message.get("key") and ran_here  # no hook ran: no link moved
            link = ("standby" if op else "primary") if ours else None
            # A failed order whose failure is not its verification's: this rank's own success stands.
            moved = ours and done_here and not message.get("ok") and bool(message.get("stands"))
            self._emit("switch_outcome", {"rank": self.rank, "kind": message.get("kind"),
                                          "ok": bool(message.get("ok")), "reason": str(message.get("reason", "")),
                                          "link": link, "moved": moved, **_origin(message)})
        elif kind == p.RELEASE:
            released = self._local_epoch.pop(epoch, None)
            stop = message.get("stop")
            self._job_stopping = self._job_stopping or bool(stop)
            if released is not None or stop:
                self.lot.release(stop_reason=str(stop) if stop else None)
        elif kind == p.LOST:
            raise p.LevelLost(str(message.get("why", "the relay above lost its Store")))
        else:
            logger.warning("rank %d: unknown coordination message %r", self.rank, kind)

    def _follow_go(self, epoch: int, name: str, message: dict[str, Any]) -> None:
        """After order ``name`` succeeded here (p.followed_by_go): block on its go key and run what
        it holds (the switch order after a guard round, the verify order after a switch) at once,
        without a queue event. Bounded: a leader gone leaves the wait to the queue loop (and its
        ``max_parked_s``)."""
        key = p.go_key(epoch, name, self.slot)
        with self._result_lock:
            if self._stop.is_set():
                return
            self._go = key
        try:
            text = self.kv.get_when_set(key, p.go_wait_s(message))
        finally:
            with self._result_lock:
                self._go = None
        if text is None:
            logger.warning("rank %d: no word from the leader after switch %s within %.0f s", self.rank, name,
                           p.go_wait_s(message))
            return
        try:
            follow = p.decode(text)
        except ValueError as exc:
            logger.error("rank %d: ignoring a malformed go message: %s", self.rank, exc)
            return
        if follow["t"] == p.ORDER and not self._stop.is_set():
            self._handle(follow, from_go=True)
            self.events_handled += 1

    def _order_of(self, name: str, message: dict[str, Any], *, decided_check: bool = True) -> SwitchOrder | None:
        """The order an order event runs; None if the leader is already past it (this rank was
        busy with an earlier one beyond its budget): it must not run late, and its key may be gone
        (a ``get`` would then block for the Store's timeout). The leader publishes its next event
        only once it has decided this order, so a next event in our queue means nobody waits for
        our answer (not asked of an order from a go key: the leader wrote it just now, for us). A
        short order comes in the event itself; a verify round runs the switch's order again (kept
        from it: not read twice)."""
        order_name = p.order_name(message)
        cached = self._last_order
        order = cached[1] if cached is not None and cached[0] == order_name else None
        inline = message.get("o")
        if order is None and inline is not None:
            order = p.decode_order(str(inline))
        if (decided_check and queues.waiting(self.kv, self.slot, self._next)) or (
                order is None and not self.kv.check([p.order_key(order_name)])):
            logger.warning("rank %d: skipping order %s: the leader has decided it without this rank (another "
                           "rank failed first, or this one was still busy with an earlier order)", self.rank, name)
            return None
        if order is None:
            order = p.decode_order(self.kv.get(p.order_key(order_name)))
        self._last_order = (order_name, order)
        return order

    def _record_verify(self, name: str, result: p.MemberResult, duration: float) -> None:
        """Keep this rank's verification for status(), with the hook's own report if it has one
        (TorchLinkProbe: each group's result and latencies)."""
        report = getattr(self.hooks.verify_hook, "last", None)
        as_dict = getattr(report, "as_dict", None)
        record = as_dict() if callable(as_dict) else None
        if isinstance(record, dict) and str(record.get("seq")) != name.split(".")[1]:
            record = None  # the hook's report of an earlier order: this one did not finish
        self.last_verify = {"order": name, "ok": result.ok, "reason": result.reason,
                            "duration_s": round(duration, 6), "at": time.time(), "report": record}
        seq = name.split(".")[1] if name.count(".") == 2 else None  # "<epoch>.<seq>.verify"
        self._emit("verify_done", {"rank": self.rank, "ok": result.ok, "reason": result.reason,
                                   "duration_s": duration, "report": record,
                                   "seq": int(seq) if seq is not None and seq.isdigit() else None})
        if not result.ok:
            logger.error("rank %d: verification of order %s failed: %s", self.rank, name, result.reason)

    def _emit(self, kind: str, detail: dict[str, Any]) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, detail)
            except Exception:
                logger.exception("member event listener failed; ignored")

    def _run_order(self, epoch: int, message: dict[str, Any], order: SwitchOrder) -> p.MemberResult:
        if self.hooks.local_ranks is not None:
            order = replace(order, local_ranks=self.hooks.local_ranks(order))
        kind, budget = str(message["kind"]), float(message["budget"])
        if kind in (p.KIND_SWITCH, p.KIND_ROLLBACK):  # the orders that move links (a dry run moves none)
            listed = self.rank in order.ranks and not self.hooks.dry_run
            self._target = (str(message["key"]), order.ops[order.ranks.index(self.rank)] if listed else None, False,
                            False)
        parked = self.lot.parked
        if not parked and epoch in self._local_epoch:
            # This rank parked for the pause the order belongs to, and its training thread has
            # left since (Ctrl-C, or max_parked_s): links must not move under a running step.
            why = f" ({self.lot.interrupted} on the training thread)" if self.lot.interrupted else ""
            return p.MemberResult(self.rank, False, f"training is no longer parked on this rank{why}",
                                  interrupted=self.lot.interrupted is not None)
        if not parked and message.get("p"):
            # The leader paused every rank for this order, and this one is not parked: it started
            # after the pause (a process a launcher restarted). Its hooks would run next to a step.
            return p.MemberResult(self.rank, False, "training is not parked on this rank: it started after the "
                                  "pause of this switch (restarted?), so the order does not run here")
        runner: HookRunner = self._runner
        if parked:
            busy = self._inline.busy() if self._inline is not None else None
            if busy is not None:
                return p.MemberResult(self.rank, False, f"refused: the {busy} is still running on the training "
                                      "thread, past its timeout")
            runner = self._inline = InlineRunner()
        hooks = self.hooks

        def work() -> p.MemberResult:
            if kind == p.KIND_GUARD:
                execution = execute_guard(
                    order, runner=runner, switch_hook=hooks.switch_hook, checkpoint_hook=hooks.checkpoint_hook,
                    guard_timeout_s=hooks.guard_timeout_s, dry_run=hooks.dry_run, warm_up=hooks.warm_up,
                    warm_up_timeout_s=hooks.verify_timeout_s)
                self._guard_done(execution.guard, message)
                return p.MemberResult(self.rank, execution.ok, execution.reason,
                                      guard_ok=execution.guard is not None and execution.guard.ok,
                                      unsafe=self._warm_up_left_unusable(execution))
            if kind == p.KIND_SWITCH:
                guarded = bool(message.get("g"))  # its guard round ran: the guard and warm-up are done
                execution = execute_order(
                    order, runner=runner, switch_hook=hooks.switch_hook,
                    checkpoint_hook=None if guarded else hooks.checkpoint_hook,
                    guard_timeout_s=hooks.guard_timeout_s, switch_timeout_s=hooks.switch_timeout_s,
                    dry_run=hooks.dry_run, warm_up=None if guarded else hooks.warm_up,
                    warm_up_timeout_s=hooks.verify_timeout_s)
                if not guarded:
                    self._guard_done(execution.guard, message)
                verify = execution.ok and execution.switch is not None and hooks.verify_hook is not None
                return p.MemberResult(self.rank, execution.ok, execution.reason,
                                      attempted=execution.switch is not None,
                                      guard_ok=execution.guard is not None and execution.guard.ok,
                                      unsafe=self._warm_up_left_unusable(execution),
                                      detail=hook_record(hooks.switch_hook) if execution.switch is not None else None,
                                      verify_s=hooks.verify_timeout_s if verify else 0.0)
            if kind == p.KIND_ROLLBACK:
                return self._one_hook(runner, "rollback", hooks.switch_hook, order, hooks.switch_timeout_s, True)
            if kind == p.KIND_VERIFY:
                if hooks.verify_hook is None:  # another rank asked for the round: nothing to check here
                    return p.MemberResult(self.rank, True, "no verify hook on this rank", attempted=True)
                return self._one_hook(runner, "verify", hooks.verify_hook, order, hooks.verify_timeout_s, True)
            if kind == p.KIND_CHECKPOINT:
                result = self._one_hook(runner, "checkpoint", hooks.checkpoint_hook, order, hooks.guard_timeout_s,
                                        False)
                return replace(result, guard_ok=result.ok)
            return p.MemberResult(self.rank, False, f"unknown order kind {kind!r}")

        if not parked:
            return work()
        assert isinstance(runner, InlineRunner)
        return self._await_parked(self.lot.run_parked(work), runner, budget, kind)

    def _guard_done(self, guard: HookResult | None, message: dict[str, Any]) -> None:
        self._emit("guard_done", {
            "rank": self.rank, "ok": guard is None or guard.ok, "skipped": guard is None,
            "status": None if guard is None else guard.status.value,
            "detail": "no checkpoint hook" if guard is None else guard.detail,
            "duration_s": 0.0 if guard is None else guard.duration_s, **_origin(message)})

    def _await_parked(self, future: Future[p.MemberResult], runner: InlineRunner, budget: float,
                      kind: str) -> p.MemberResult:
        """Wait for work on the training thread, each hook within its own timeout.

        ``budget`` (the leader's) bounds only the time no hook runs (before the thread picks the
        work up, between hooks), so a switch without a guard is answered within its own timeout.
        """
        idle_deadline = time.monotonic() + budget
        while True:
            running = runner.running()
            now = time.monotonic()
            if running is not None:
                what, deadline, timeout = running
                idle_deadline = max(idle_deadline, now + budget)  # a gap after this hook counts afresh
                if now >= deadline:
                    runner.abandon()  # a guard returning late must not start the switch
                    # A guard round's hook still running (a collective save waiting for a rank that
                    # refused) keeps this rank parked: the others must not resume beside it.
                    return p.MemberResult(
                        self.rank, False, f"{what} did not finish within {timeout:g} s (it goes on running on "
                        "the training thread, which stays parked until it returns)",
                        attempted=what.split(" hook", 1)[0] in _LINK_HOOKS,
                        unsafe=kind in (p.KIND_GUARD, p.KIND_CHECKPOINT))
                wait = deadline - now
            elif now >= idle_deadline:
                runner.abandon()
                future.cancel()  # if the training thread has not started it, it never will
                return p.MemberResult(self.rank, False, f"the training thread did not run the hooks within "
                                      f"{budget:g} s", attempted=False)
            else:
                wait = min(IDLE_SLICE_S, idle_deadline - now)
            try:
                return future.result(timeout=wait)
            except FutureTimeout:
                continue
            except Exception as exc:
                return p.MemberResult(self.rank, False, f"could not run on the training thread: {exc}")
            except BaseException as exc:  # KeyboardInterrupt/SystemExit, raised on the training thread
                name = type(exc).__name__
                logger.error("rank %d: %s on the training thread during a %s order: training leaves step() and "
                             "does not resume here", self.rank, name, kind)
                return p.MemberResult(self.rank, False, f"interrupted by {name} on the training thread",
                                      attempted=kind != p.KIND_CHECKPOINT, interrupted=True)

    def _warm_up_left_unusable(self, execution: Execution) -> bool:
        """The verify warm-up (a collective) failed in a way that may leave an op pending in this
        rank's communicators: as unsafe as such a verification (training must not resume)."""
        return execution.warm_up is not None and _left_unusable(self.hooks.verify_hook, execution.warm_up)

    def _one_hook(self, runner: HookRunner, name: str, hook: Callable[[SwitchOrder], Any] | None,
                  order: SwitchOrder, timeout: float, expect_bool: bool) -> p.MemberResult:
        if self.hooks.dry_run:
            return p.MemberResult(self.rank, True, "dry run")
        if hook is None:
            return p.MemberResult(self.rank, False, f"no {name} hook")
        busy = runner.busy()
        if busy is not None:
            return p.MemberResult(self.rank, False, f"refused: the {busy} is still running past its timeout")
        result: HookResult = runner.run(name, hook, order, timeout, expect_bool=expect_bool)
        record = hook_record(hook) if name == "rollback" else None
        return p.MemberResult(self.rank, result.ok, result.detail, attempted=name in ("rollback", "verify"),
                              detail=record, unsafe=name == "verify" and _left_unusable(hook, result))


def _expected(message: dict[str, Any]) -> int | None:
    """How many answer the event on this Store (its ``n``: the answer that completes the count
    sets the done key its waiter blocks on); None from a leader of an earlier version."""
    n = message.get("n")
    return int(n) if n is not None else None


def _origin(message: dict[str, Any]) -> dict[str, Any]:
    """Which order an event is about and when the leader sent it, for the timeline: ``seq`` (the
    agent makes it the event's own), the leader's epoch and its wall clock (``sent_at``)."""
    return {"seq": message.get("seq"), "epoch": message.get("e"), "sent_at": message.get("at")}


def _left_unusable(hook: Any, result: HookResult) -> bool:
    """A failed verification after which this rank's communicators may be unusable: the hook is
    still running (timed out on its thread), or it says so itself (``communicators_unusable()``,
    e.g. TorchLinkProbe with an op still pending or a group gone). A clean False is not."""
    if result.ok:
        return False
    if result.status is HookStatus.TIMEOUT:
        return True
    says = getattr(hook, "communicators_unusable", None)
    try:
        return bool(says()) if callable(says) else False
    except Exception:  # a hook's own bookkeeping must not decide this by crashing
        logger.exception("communicators_unusable() of the verify hook failed; taken as unusable")
        return True
