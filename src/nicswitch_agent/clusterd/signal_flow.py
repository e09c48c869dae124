"""Pause mode ``agent``: what each ClusterD process-manage signal means for the training thread.

The controller runs signals one at a time on its own worker thread (``nicswitch-signals``), so the
stream keeps being read while it waits for the training thread to park. Its rules, from the real
server's behaviour (docs/clusterd.md#failed-switch-and-fault-recovery, docs/clusterd.md#when-clusterd-kills-the-job):

- ``stopTrain``/``pause_train``: park training at its next ``step()``; report
  ``ReportStopComplete(0)`` once parked, or ``499`` after ``pause_timeout_s`` (and the request is
  withdrawn, so training is not left parked by a pause reported as failed).
- a rank list (notify stream) while parked: guard and switch hook run **on the parked training
  thread**; the reply is owed by the agent, exactly once.
- ``changeStrategy``/``continue``: unpark, then ``ReportRecoverStatus(0, "continue")``.
- after a failed switch: ``stopTrain``/``stop_train`` -> ``ReportStopComplete(0)`` (404 would make
  ClusterD kill the job); ``globalFault`` -> roll the failed order's ranks back to their previous
  links on the parked thread, then ``ReportRecoverStrategy`` with what can honestly be done:
  ``retry`` and ``recover`` only if the rollback succeeded, ``dump`` only if a checkpoint of the
  parked step exists or can be taken, and always ``exit``; ``changeStrategy`` with ClusterD's
  pick: ``retry`` or ``recover`` -> unpark + ``ReportRecoverStatus(0, <the pick>)``; ``dump`` ->
  make sure the checkpoint exists (the guard's pre-switch one counts),
  ``ReportRecoverStatus(code, "dump")``, then stop; ``exit`` -> stop, report nothing.

  Why ``retry`` too: the parked step was never lost, so letting it go on IS retrying it; and
  ClusterD tries ``retry`` first whenever the job's ``recover-strategy`` annotation lists it: if
  the agent did not offer it, ClusterD skips ``recover`` and picks ``dump`` or ``exit``
  (docs/clusterd.md#failed-switch-and-fault-recovery). The common annotation
  ``retry,recover,dump`` would otherwise stop every job whose failed switch was rolled back.
- ``killMaster``: stop; call nothing.
- the process-manage stream ends (ClusterD reset the job, or restarted): nobody will send
  ``continue`` any more, so a parked training thread is let go.
- anything else: logged at WARNING with the whole signal; nothing changes.

"Stop" means: the user's ``on_stop(reason)`` is called, and the training thread leaves its parking
spot with :class:`~nicswitch_agent.coordination.parking.TrainingStopped`, so training never continues silently
on links in an unknown state. The streams stay open, so ClusterD can finish its own recovery.

The strategies offered and the one ClusterD picks are recorded as ``recovery`` events (the
timeline draws them on the failed switch): the reports themselves leave no trace in the events.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.process_manage import (
    ACTION_PAUSE,
    ACTION_STOP,
    CHANGE_STRATEGY,
    CODE_CLIENT_ERROR,
    CODE_OK,
    EXTRA_DUMP_EXIT,
    GLOBAL_FAULT,
    KILL_MASTER,
    STOP_TRAIN,
    STRATEGY_CONTINUE,
    STRATEGY_DUMP,
    STRATEGY_EXIT,
    STRATEGY_RECOVER,
    STRATEGY_RETRY,
    ProcessManageClient,
    describe_signal,
)
from nicswitch_agent.coordination import KIND_CHECKPOINT, KIND_ROLLBACK, KIND_SWITCH, Coordinator, RunOutcome
from nicswitch_agent.coordination.hook_runner import Execution
from nicswitch_agent.coordination.leader import RESULT_SLACK_S
from nicswitch_agent.observability import events as ev
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.controller")


@dataclass(frozen=True)
class HookSettings:
    """What the controller needs to know about the hooks (members run them)."""

    has_checkpoint_hook: bool
    guard_timeout_s: float
    switch_timeout_s: float
    pause_timeout_s: float
    dry_run: bool
    guard_unknown: bool = False  # a launcher's leader: the members' hooks are not known here

    @property
    def guard_budget_s(self) -> float | None:
        """The guard round's budget where a guard runs (not in a dry run, where no hook runs);
        None: no guard round (Coordinator.run). The leader adds a small slack to it."""
        guarded = (self.has_checkpoint_hook or self.guard_unknown) and not self.dry_run
        return self.guard_timeout_s if guarded else None

    def run_switch(self, coordinator: Coordinator, order: SwitchOrder) -> RunOutcome:
        """A switch on every rank: its guard round first where a guard runs, then the switch."""
        return coordinator.run(order, kind=KIND_SWITCH, budget_s=self.switch_timeout_s,
                               guard_budget_s=self.guard_budget_s)

    def execute(self, coordinator: Coordinator, order: SwitchOrder) -> Execution:
        """Pause mode external: the switch on the members' own threads, as the reply says it."""
        outcome = self.run_switch(coordinator, order)
        return Execution(outcome.ok, success_reason(order, outcome) if outcome.ok else outcome.reason)


class LinkState:
    """Which ranks this job last moved to standby (True) or primary (False); for rollbacks."""

    def __init__(self) -> None:
        self._standby: dict[int, bool] = {}
        self._lock = threading.Lock()

    def apply(self, order: SwitchOrder) -> None:
        with self._lock:
            for rank, op in order:
                self._standby[rank] = op

    def rollback_of(self, order: SwitchOrder) -> SwitchOrder:
        """The order that puts ``order``'s ranks back where they were (unknown = primary)."""
        with self._lock:
            ops = tuple(self._standby.get(rank, False) for rank in order.ranks)
        return SwitchOrder(seq=order.seq, job_id=order.job_id, ranks=order.ranks, ops=ops)


class AgentModeController:
    """Turns process-manage signals into pauses, orders on every rank, and reports."""

    def __init__(self, coordinator: Coordinator, hooks: HookSettings, *, on_stop: Callable[[str], None],
                 emit: Callable[[str, int | None, dict[str, Any]], None] | None = None) -> None:
        self.coordinator = coordinator
        self.hooks = hooks
        self.links = LinkState()
        self._on_stop = on_stop
        self._emit = emit  # (kind, seq, detail): the agent's events
        self._client: ProcessManageClient | None = None
        # (signal, the stream that delivered it) | "stream-end: why" | stop training | None (stop)
        self._signals: queue.Queue[tuple[pb.ProcessManageSignal, int] | str | _Stop | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the fields below
        self._failed_order: SwitchOrder | None = None
        self._failed_switch_attempted = False
        self._failed_unsafe = ""  # why a rank may be unable to go on after it (verification, a guard still running)
        self._checkpoint_ok = False  # every rank has a checkpoint of the currently parked step
        self._guard_failed = ""  # why this pause's guard round failed: no checkpoint is to be had (no dump)
        self._rollback_ok = False
        self._stopped_reason: str | None = None
        self._in_flight: SwitchOrder | None = None  # the switch order running now (execute)
        self._done = threading.Condition(self._lock)  # notified when it ends
        # Why ClusterD gave up on a switch while it ran, by its list's seq: its stopTrain came first
        # (its reply timeout). That switch counts as failed, whatever it returns, and gets no reply.
        self._abandoned: dict[int, str] = {}
        self.last_signal = ""

    def attach(self, client: ProcessManageClient) -> None:
        self._client = client

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nicswitch-signals", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._signals.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- inputs (from the process-manage thread; never block) -----------------------------------

    def on_signal(self, signal: pb.ProcessManageSignal) -> None:
        """Called on the process-manage thread as the signal arrives: its stream is the open one."""
        client = self._client
        self._signals.put((signal, client.stream_id if client is not None else 0))

    def on_stream_end(self, reason: str) -> None:
        self._signals.put(f"stream-end: {reason}")

    # -- orders (from the agent's executor thread) --------------------------------------------

    def execute(self, order: SwitchOrder) -> Execution:
        """Run guard and switch on every parked rank; bounded by the hook budgets."""
        if not self.coordinator.paused:
            return Execution(False, "training is not parked: refusing to switch links under a running step")
        with self._lock:
            self._in_flight = order
        try:
            outcome = self.hooks.run_switch(self.coordinator, order)
        finally:
            with self._lock:
                self._in_flight = None
                self._done.notify_all()
        with self._lock:
            self._checkpoint_ok = self._checkpoint_ok or outcome.guard_ok
            self._guard_failed = outcome.reason if outcome.guard_failed else self._guard_failed
            gave_up = self._abandoned.get(order.seq, "")
            if gave_up:
                # ClusterD's recovery is under way and rolls back what this order did, if anything.
                logger.error("switch #%d %s after ClusterD had given up on it (%s): taken as failed, no reply "
                             "sent", order.seq, "succeeded" if outcome.ok else "failed", gave_up)
                outcome = replace(outcome, ok=False, attempted=outcome.attempted or outcome.ok,
                                  reason=f"ClusterD gave up on it while it ran ({gave_up}); "
                                         f"{'it succeeded' if outcome.ok else outcome.reason}")
            if outcome.ok:
                self.links.apply(order)
                self._failed_order = None
            else:
                self._failed_order, self._failed_switch_attempted = order, outcome.attempted
                self._failed_unsafe = outcome.reason if outcome.unsafe else ""
        if outcome.interrupted is not None:
            # That rank's training thread has left step() for good (Ctrl-C, sys.exit): the job
            # cannot go on without it, and nothing may resume on links in an unknown state.
            # Stopped on the worker thread, so that the false reply does not wait for on_stop.
            self._signals.put(_Stop(f"rank {outcome.interrupted}'s training was interrupted during switch "
                                    f"#{order.seq}; the job cannot go on without it"))
        return Execution(outcome.ok, success_reason(order, outcome) if outcome.ok else outcome.reason)

    # -- the worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._signals.get()
            if item is None:
                return
            try:
                if isinstance(item, str):
                    self._handle_stream_end(item)
                elif isinstance(item, _Stop):
                    self._stop_training(item.reason)
                else:
                    self._handle(*item)
            except Exception:
                logger.exception("handling %s failed", describe_signal(item[0]) if isinstance(item, tuple) else item)

    def _handle(self, signal: pb.ProcessManageSignal, stream: int) -> None:
        assert self._client is not None
        client = _Reports(self._client, stream)  # every report answers this signal's stream
        self.last_signal = describe_signal(signal)
        kind, actions = signal.signalType, list(signal.actions)
        logger.info("ClusterD signal: %s", self.last_signal)
        if kind == STOP_TRAIN and ACTION_PAUSE in actions:
            self._pause(client)
        elif kind == STOP_TRAIN and ACTION_STOP in actions:
            # Training is already parked (or was never paused); say it is stopped. A switch still
            # running now is one ClusterD gave up waiting for (its reply timeout): its recovery follows.
            with self._lock:
                running = self._in_flight
                if running is not None:
                    self._abandoned[running.seq] = "its stopTrain came while the switch ran"
            if running is not None:
                logger.warning("switch #%d still running as ClusterD stops training: ClusterD gave up waiting for "
                               "its reply; it will count as failed and get no reply", running.seq)
            client.report_stop_complete(CODE_OK)
        elif kind == GLOBAL_FAULT:
            strategies = self._strategies_we_can_honour()
            self._recovery_event(offered=strategies)
            client.report_recover_strategy(strategies)
        elif kind == CHANGE_STRATEGY:
            self._change_strategy(client, signal)
        elif kind == KILL_MASTER:
            self._stop_training("ClusterD is killing the job (killMaster)")
        else:
            logger.warning("unknown process-manage signal, ignored: %s", self.last_signal)

    def _pause(self, client: _Reports) -> None:
        if self.coordinator.paused:
            # Asked again before this pause was let go (ClusterD sent it twice): every rank is
            # parked already. A new round would wait pause_timeout_s for a step no parked rank can
            # reach, then fail; a new episode would forget a failed switch that needs its rollback.
            last = self.coordinator.last_pause
            logger.info("pause requested while training is parked (at step %s): answering at once; the pause "
                        "goes on", last.step if last is not None else "?")
            client.report_stop_complete(CODE_OK)
            return
        with self._lock:
            self._failed_order, self._rollback_ok, self._checkpoint_ok, self._guard_failed = None, False, False, ""
            self._abandoned.clear()  # the replies they concern were dropped when their switch ended
            # A new pause is a new episode: a stop decided in an earlier one must not keep a later
            # reset from releasing the ranks this pause parks.
            self._stopped_reason = None
        outcome = self.coordinator.pause(self.hooks.pause_timeout_s)
        if outcome.ok:
            client.report_stop_complete(CODE_OK)
            return
        if self.coordinator.stopping:  # not a timeout: the report below is refused too (the agent is stopping)
            logger.info("pause cut short: %s", outcome.reason)
        else:
            logger.error("pause failed after %.1f s (pause_timeout_s=%g s): %s; reporting 499 and letting training "
                         "go on", outcome.duration_s, self.hooks.pause_timeout_s, outcome.reason)
            self._emit_safely(ev.PAUSE_FAILED, None, {"reason": outcome.reason, "duration_s": outcome.duration_s})
        client.report_stop_complete(CODE_CLIENT_ERROR, outcome.reason[:256])

    def _strategies_we_can_honour(self) -> list[str]:
        strategies: list[str] = []
        if self._rollback():
            # The same promise under both names: the parked step goes on, on the old links.
            strategies += [STRATEGY_RETRY, STRATEGY_RECOVER]
        if self._checkpoint_available():
            strategies.append(STRATEGY_DUMP)
        strategies.append(STRATEGY_EXIT)
        logger.info("offering recovery strategies %s", strategies)
        return strategies

    def abandoned(self, seq: int) -> str:
        """Why ClusterD no longer waits for the reply to list ``seq`` ("" if that is not known here)."""
        with self._lock:
            why = self._abandoned.get(seq, "")
        return f"ClusterD gave up waiting for it ({why})" if why else ""

    def _rollback(self) -> bool:
        """Put the failed order's ranks back on their previous links, on every parked rank (first
        waiting, within the hook budgets, for a switch ClusterD gave up on to end)."""
        # Its budgets and the leader's slack for each round: guard, warm-up, switch, verify.
        budget = self.hooks.guard_timeout_s + self.hooks.switch_timeout_s + 2 * self.coordinator.warm_up_s + \
            4 * RESULT_SLACK_S
        with self._lock:
            if not self._done.wait_for(lambda: self._in_flight is None, budget):
                logger.error("a switch is still running %.0f s after ClusterD gave up on it: no rollback", budget)
                self._rollback_ok = False
                return False
            failed, attempted, unsafe = self._failed_order, self._failed_switch_attempted, self._failed_unsafe
        if not self.coordinator.paused:
            ok = False
        elif failed is not None and unsafe:
            # Rolling the links back would not let training go on: it would resume into a collective
            # that hangs (a probe op still pending, a group gone, a rank still inside its guard).
            logger.error("no rollback of order #%d: a rank may be unable to go on (%s); training must not "
                         "resume beside it", failed.seq, unsafe)
            ok = False
        elif failed is None or not attempted:
            ok = True  # no link was touched
        else:
            back = self.links.rollback_of(failed)
            outcome = self.coordinator.run(back, kind=KIND_ROLLBACK, budget_s=self.hooks.switch_timeout_s)
            ok = outcome.ok
            logger.log(logging.INFO if ok else logging.ERROR, "rollback of order #%d %s%s", failed.seq,
                       "succeeded" if ok else "failed: ", "" if ok else outcome.reason)
        with self._lock:
            self._rollback_ok = ok
        return ok

    def _checkpoint_available(self) -> bool:
        """A checkpoint of the parked step exists, or can be taken now: not after this pause's guard
        failed on a rank (the same save would fail again: offering dump would promise what fails)."""
        with self._lock:
            have, refused = self._checkpoint_ok, self._guard_failed
        return have or (self.hooks.has_checkpoint_hook and self.coordinator.paused and not refused)

    def _ensure_checkpoint(self) -> str:
        """Why no checkpoint of the parked step exists after trying ("" once one does)."""
        with self._lock:
            if self._checkpoint_ok:
                return ""  # the guard's pre-switch checkpoint of this very step counts
            failed, refused = self._failed_order, self._guard_failed
        if refused:
            return f"the guard failed at this pause ({refused})"
        if not self.hooks.has_checkpoint_hook or not self.coordinator.paused:
            return "no checkpoint hook" if not self.hooks.has_checkpoint_hook else "training is not parked"
        order = failed or SwitchOrder(seq=0, job_id="", ranks=(), ops=())
        outcome = self.coordinator.run(order, kind=KIND_CHECKPOINT, budget_s=self.hooks.guard_timeout_s)
        with self._lock:
            self._checkpoint_ok = outcome.ok
        return "" if outcome.ok else outcome.reason

    def _change_strategy(self, client: _Reports, signal: pb.ProcessManageSignal) -> None:
        strategy = signal.changeStrategy
        if strategy != STRATEGY_CONTINUE and not (strategy == STRATEGY_EXIT and signal.extraParams == EXTRA_DUMP_EXIT):
            self._recovery_event(chosen=strategy)  # as it arrives: a dump's checkpoint may take minutes
        if strategy == STRATEGY_CONTINUE:
            self.coordinator.release()
            client.report_recover_status(CODE_OK, STRATEGY_CONTINUE)
        elif strategy in (STRATEGY_RETRY, STRATEGY_RECOVER):
            with self._lock:
                rolled_back = self._rollback_ok
            if rolled_back:
                self.coordinator.release()
                client.report_recover_status(CODE_OK, strategy)
            else:  # never offered; do not claim a recovery that did not happen
                client.report_recover_status(CODE_CLIENT_ERROR, strategy, "rollback did not succeed")
                self._stop_training(f"{strategy} was chosen but the links could not be rolled back")
        elif strategy == STRATEGY_DUMP:
            missing = self._ensure_checkpoint()
            if missing:
                logger.error("ClusterD chose dump, but there is no checkpoint of the parked step: %s", missing)
            client.report_recover_status(CODE_CLIENT_ERROR if missing else CODE_OK, STRATEGY_DUMP,
                                         "no checkpoint of the parked step" if missing else "")
            self._stop_training("ClusterD chose dump after a failed switch"
                                + ("; no checkpoint of the parked step" if missing else ""))
        elif strategy == STRATEGY_EXIT:
            if signal.extraParams == EXTRA_DUMP_EXIT:
                logger.info("ClusterD: dump_exit (informational)")
                return
            self._stop_training("ClusterD chose exit after a failed switch")
        else:
            logger.warning("unknown strategy, ignored: %s", describe_signal(signal))

    def _emit_safely(self, kind: str, seq: int | None, detail: dict[str, Any]) -> None:
        """An event for the timeline; a listener that raises is logged: it must not keep a report
        from ClusterD."""
        if self._emit is None:
            return
        try:
            self._emit(kind, seq, detail)
        except Exception:
            logger.exception("recording the %s event failed; ignored", kind)

    def _recovery_event(self, *, offered: list[str] | None = None, chosen: str | None = None) -> None:
        """ClusterD's recovery for the timeline: what the agent offered, what ClusterD chose."""
        with self._lock:
            failed = self._failed_order
        self._emit_safely(ev.RECOVERY, failed.seq if failed is not None else None,
                          {"signal": GLOBAL_FAULT if chosen is None else CHANGE_STRATEGY,
                           "offered": None if offered is None else list(offered), "chosen": chosen})

    def _handle_stream_end(self, reason: str) -> None:
        """ClusterD reset the job (or went away): nobody will send continue, nor choose a strategy,
        for this pause. Training goes on, on links known to be where they were or were ordered;
        after a failed switch that may have moved links, only once they are rolled back (what
        ClusterD's retry would have led to), else training stops."""
        with self._lock:
            stopping = self._stopped_reason is not None
        if not self.coordinator.paused or stopping:
            return
        if self.coordinator.release_if_settled():
            logger.warning("process-manage stream ended (%s) while training was parked; ClusterD reset the job "
                           "or went away, and will not send continue for this pause: resuming training", reason)
            return
        with self._lock:
            failed = self._failed_order
        if failed is not None and self._rollback():
            logger.warning("process-manage stream ended (%s) while training was parked after switch #%d failed; "
                           "ClusterD reset the job or went away: its links were rolled back, resuming training",
                           reason, failed.seq)
            self.coordinator.release()
            return
        self._stop_training(f"the process-manage stream ended ({reason}) after a switch failed and its links "
                            "could not be rolled back: training must not resume on them")

    def _stop_training(self, reason: str) -> None:
        with self._lock:
            if self._stopped_reason is not None:
                return
            self._stopped_reason = reason
        logger.error("training must stop: %s", reason)
        try:
            self._on_stop(reason)
        except Exception:
            logger.exception("on_stop hook raised; ignored")
        self.coordinator.release(stop_reason=reason)


@dataclass(frozen=True)
class _Stop:
    """A worker item: training must stop on every rank."""

    reason: str


def success_reason(order: SwitchOrder, outcome: RunOutcome) -> str:
    """What a true reply means: links moved, or (no rank called the switch hook) nothing did."""
    if outcome.attempted:
        return "switched on every rank"
    if order.empty:
        return "empty list: nothing to switch"
    return "dry run: nothing switched"


class _Reports:
    """The process-manage client's reports, bound to the stream whose signal they answer."""

    def __init__(self, client: ProcessManageClient, stream: int) -> None:
        self._client, self._stream = client, stream

    def report_stop_complete(self, code: int, info: str = "") -> pb.Status | None:
        return self._client.report_stop_complete(code, info, stream=self._stream)

    def report_recover_strategy(self, strategies: list[str]) -> pb.Status | None:
        return self._client.report_recover_strategy(strategies, stream=self._stream)

    def report_recover_status(self, code: int, strategy: str, info: str = "") -> pb.Status | None:
        return self._client.report_recover_status(code, strategy, info, stream=self._stream)


__all__ = ["AgentModeController", "HookSettings", "LinkState", "success_reason"]
