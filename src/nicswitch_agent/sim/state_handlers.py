"""The state handlers of a simulated job: what each upstream state does, and the channel waits they use.

Each ``_h_*`` method is named in :data:`~nicswitch_agent.sim.rules.RULES` and runs on the event
loop outside the lock; it returns the next event, or None when the flow waits for something else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.generation import Cancelled, Generation, new_event_id
from nicswitch_agent.sim.machine import Machine
from nicswitch_agent.sim.rules import TriggerError

logger = logging.getLogger("nicswitch_agent.sim")


class StateHandlers(Machine):
    """The handlers of upstream's switch, pause/continue and fault-recovery states."""

    # ------------------------------------------------------------------ internals: waiting, queues

    def _wait(self, gen: Generation, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (lock held) until ``ready()``; False on timeout; ``Cancelled`` on reset or stop."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._stopping or gen.closed:
                raise Cancelled()
            if ready():
                return True
            if deadline is None:
                self._cond.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._cond.wait(remaining)

    def _sleep(self, gen: Generation, seconds: float) -> None:
        with self._cond:
            self._wait(gen, lambda: False, seconds)

    def _signal_enqueue(self, gen: Generation, signal: pb.ProcessManageSignal, timeout: float) -> bool:
        """Put a signal in the one-slot signal channel (lock held); False if it stays full."""
        if not self._wait(gen, lambda: gen.signal is None, timeout):
            return False
        gen.signal = signal
        if signal.signalType == P.STOP_TRAIN:
            gen.expecting.add(P.REPORT_STOP_COMPLETE)
        elif signal.signalType == P.GLOBAL_FAULT:
            gen.expecting.add(P.REPORT_RECOVER_STRATEGY)
        elif signal.signalType == P.CHANGE_STRATEGY and not signal.extraParams:
            if signal.changeStrategy in (P.CONTINUE, P.RETRY, P.RECOVER, P.DUMP):
                gen.expecting.add(P.REPORT_RECOVER_STATUS)
            if signal.changeStrategy in (P.RETRY, P.RECOVER, P.DUMP):
                gen.ordered_strategy = signal.changeStrategy
        logger.debug(
            "signal enqueue, jobId=%s, uuid=%s, signalType=%s, strategy=%s",
            self.job_id,
            signal.uuid,
            signal.signalType,
            signal.changeStrategy,
        )
        self._changed()
        return True

    def _enqueue_or_fail(self, gen: Generation, signal: pb.ProcessManageSignal) -> None:
        """``signalEnqueue``: 1 s for the slot, else 504 and (via the loop) a reset."""
        with self._cond:
            if not self._signal_enqueue(gen, signal, self.settings.enqueue_timeout_s):
                raise TriggerError(P.SIGNAL_QUEUE_BUSY, P.SIGNAL_TIMEOUT_MSG.format(job=self.job_id))

    def _reply_om(self, gen: Generation, msg: str) -> None:
        """``replyOMResponse``: only while switching; a blocking send into the 10-slot channel."""
        with self._cond:
            if not gen.switch_ranks:
                return
            self._wait(gen, lambda: len(gen.om) < P.OM_QUEUE_LENGTH, None)
            gen.om.append(pb.SwitchNicResponse(jobID=self.job_id, msg=msg))
            self._om_messages.append(msg)
            self._changed()

    def _take(self, gen: Generation, slot: str, timeout: float) -> object | None:
        """Wait for and empty one report slot (lock held); None on timeout."""
        if not self._wait(gen, lambda: getattr(gen, slot) is not None, timeout):
            return None
        value: object = getattr(gen, slot)
        setattr(gen, slot, None)
        self._changed()
        return value

    def _signal(
        self,
        gen: Generation,
        signal_type: str,
        actions: list[str],
        change_strategy: str = "",
        extra_params: str = "",
    ) -> pb.ProcessManageSignal:
        return pb.ProcessManageSignal(
            uuid=gen.uuid,
            jobId=self.job_id,
            signalType=signal_type,
            actions=actions,
            changeStrategy=change_strategy,
            extraParams=extra_params,
        )

    # -------------------------------------------------------- handlers: the switch (docs/clusterd.md#the-state-machine)

    def _h_notify_pause_train(self, gen: Generation) -> str | None:
        """``handleNotifyPauseTrain``: new uuid, ``stopTrain``/``pause_train``."""
        with self._cond:
            gen.uuid = new_event_id()
            self._enqueue_or_fail(gen, self._signal(gen, P.STOP_TRAIN, [P.PAUSE_TRAIN_ACTION]))
        return None

    def _h_wait_pause_complete(self, gen: Generation) -> str | None:
        """``handleWaitPauseTrainComplete``: 499 fails; any other code counts as paused."""
        with self._cond:
            report = self._take(gen, "stop_report", self.settings.report_timeout_s)
            if report is None:
                self._reply_om(gen, P.OM_PAUSE_TIMEOUT)
                return P.RECEIVE_TIMEOUT
            assert isinstance(report, pb.StopCompleteRequest)
            if report.status.code == P.CLIENT_ERROR:
                self._reply_om(gen, P.OM_PAUSE_FAILED)
                return P.PROCESS_PAUSE_FAIL
            if gen.switch_ranks:
                return P.SWITCH_NIC_RECV_PAUSE
            return None  # empty nicOps: isSwitchingNic() is false, the flow stalls here

    def _h_notify_switch_nic(self, gen: Generation) -> str | None:
        """``notifySwitchNic``: the list into the one-slot channel (1 s, else 504 and a reset).

        No timeout after that: the state waits for a subscriber's successful send
        (docs/clusterd.md#delivery-of-the-rank-list).
        """
        if self.settings.list_delay_s > 0:
            self._sleep(gen, self.settings.list_delay_s)
        with self._cond:
            rank_list = pb.SwitchRankList(rankID=gen.switch_ranks, op=gen.switch_ops, jobId=self.job_id)
            if not self._wait(gen, lambda: gen.rank_list is None, self.settings.enqueue_timeout_s):
                raise TriggerError(P.SIGNAL_QUEUE_BUSY, P.SIGNAL_TIMEOUT_MSG.format(job=self.job_id))
            gen.rank_list = rank_list
            self._changed()
        return None

    def _h_wait_switch_nic_finish(self, gen: Generation) -> str | None:
        """``handleWaitSwitchNicFinish`` (docs/clusterd.md#waiting-for-the-reply): reply, a 406 report, or the report
        timeout."""
        with self._cond:
            try:
                got = self._wait(
                    gen,
                    lambda: gen.result is not None or gen.status_report is not None,
                    self.settings.report_timeout_s,
                )
                if not got:
                    self._reply_om(gen, P.OM_SWITCH_TIMEOUT)
                    return P.RECEIVE_TIMEOUT
                report_first = gen.status_report is not None and gen.status_report_first
                if gen.result is not None and not report_first:
                    result, gen.result = gen.result, None
                    self._changed()
                    if not result:
                        self._reply_om(gen, P.OM_SWITCH_FAILED)
                        return P.SWITCH_NIC_FAIL
                    return P.RECEIVE_REPORT
                report = gen.status_report
                gen.status_report = None
                self._changed()
                assert report is not None
                if report.status.code == P.UN_RECOVERABLE_RETRY_ERROR:
                    self._reply_om(gen, P.OM_REPORT_ERROR)
                    return P.WAIT_SWITCH_NIC_RECV_FAULT
                # Any other code falls through with no event: the job wedges (docs/clusterd.md#waiting-for-the-reply).
                logger.warning(
                    "jobId=%s: ReportRecoverStatus code=%d while waiting for the switch: wedged",
                    self.job_id,
                    report.status.code,
                )
                return None
            finally:
                gen.awaiting_reply = False

    def _h_notify_continue_train(self, gen: Generation) -> str | None:
        """``notifyContinueTrain``: same uuid, ``changeStrategy``/``continue``."""
        with self._cond:
            self._enqueue_or_fail(
                gen,
                self._signal(gen, P.CHANGE_STRATEGY, [P.CHANGE_STRATEGY_ACTION], change_strategy=P.CONTINUE),
            )
        return None

    def _h_wait_continue(self, gen: Generation) -> str | None:
        """``handleDecideContinueTrainComplete``: 499 kills; anything else finishes the switch."""
        with self._cond:
            report = self._take(gen, "status_report", self.settings.report_timeout_s)
            if report is None:
                self._reply_om(gen, P.OM_CONTINUE_TIMEOUT)
                return P.RECEIVE_TIMEOUT
            assert isinstance(report, pb.RecoverStatusRequest)
            if report.status.code == P.CLIENT_ERROR:
                self._reply_om(gen, P.OM_CONTINUE_FAILED)
                return P.CONTINUE_TRAIN_FAIL
            return P.SWITCH_NIC_RECV_CONTINUE if gen.switch_ranks else None

    def _h_switch_nic_finish(self, gen: Generation) -> str | None:
        """``handleSwitchNicFinish``: "switch nic finish", then reset (every stream ends OK)."""
        with self._cond:
            self._reply_om(gen, P.OM_FINISH)
            self._reset("switch nic finish")
        return None

    def _h_kill_job(self, gen: Generation) -> str | None:
        """``handleKillJob``: ``killMaster`` with the current uuid; its send adds ``finish``."""
        with self._cond:
            signal = pb.ProcessManageSignal(uuid=gen.uuid, jobId=self.job_id, signalType=P.KILL_MASTER)
            if self._signal_enqueue(gen, signal, P.KILL_MASTER_ENQUEUE_TIMEOUT_S):
                return None
            return P.FINISH

    def _h_finish(self, gen: Generation) -> str | None:
        """``handleFinish``: reset."""
        with self._cond:
            self._reset(P.FINISH)
        return None

    # ------------------------------------------------------------------ handlers: fault recovery

    def _h_notify_stop_train(self, gen: Generation) -> str | None:
        """``handleNotifyStopTrain``: a NEW uuid, ``stopTrain``/``stop_train`` (docs/clusterd.md#a-failed-switch)."""
        with self._cond:
            gen.uuid = new_event_id()
            self._enqueue_or_fail(gen, self._signal(gen, P.STOP_TRAIN, [P.STOP_TRAIN_ACTION]))
        return None

    def _h_wait_stop_complete(self, gen: Generation) -> str | None:
        """``handleWaitReportStopComplete``: 404 kills the job; no other code is checked."""
        with self._cond:
            report = self._take(gen, "stop_report", self.settings.report_timeout_s)
            if report is None:
                return P.RECEIVE_TIMEOUT
            assert isinstance(report, pb.StopCompleteRequest)
            if report.status.code == P.PROCESS_NOT_READY:
                return P.PROCESS_NOT_READY_EVENT
            return P.RECEIVE_REPORT

    def _h_wait_flush(self, gen: Generation) -> str | None:
        """``handleWaitFlushFinish``: ``faultFlushSeconds``."""
        self._sleep(gen, self.settings.fault_flush_s)
        return P.FLUSH_FINISHED

    def _h_notify_global_fault(self, gen: Generation) -> str | None:
        """``handleNotifyGlobalFault``: ``dealWithForceRelease``'s sleep, then ``globalFault``."""
        self._sleep(gen, self.settings.force_release_s)
        with self._cond:
            self._enqueue_or_fail(
                gen, self._signal(gen, P.GLOBAL_FAULT, [P.ON_GLOBAL_RANK_ACTION, P.FAULT_NODES_EXIT_ACTION])
            )
        return None

    def _h_wait_strategy(self, gen: Generation) -> str | None:
        """``handleWaitReportRecoverStrategy``: remember what the agent offers."""
        with self._cond:
            report = self._take(gen, "strategy_report", self.settings.report_timeout_s)
            if report is None:
                return P.RECEIVE_TIMEOUT
            assert isinstance(report, pb.RecoverStrategyRequest)
            gen.agent_strategies = list(report.strategies)
            return P.RECEIVE_REPORT

    def _choose_strategy(self, gen: Generation) -> str:
        """``chooseStrategy`` for a job with no cached faults (the NIC-switch case).

        Upstream ``firstChooseStrategy`` picks ``retry`` whenever the annotation lists it; if the
        agent did not offer retry, ``chooseStrategy`` falls back to ``chooseForRecoverFail``
        (dump, else exit) and skips recover. Otherwise recover > dump > exit, each only if the
        annotation allows it and the agent offered it (controller.go;
        docs/clusterd.md#failed-switch-and-fault-recovery).
        """
        allowed = self.job.allowed_strategies()
        offered = set(gen.agent_strategies)

        def support(name: str) -> bool:
            return name in allowed and name in offered

        def for_recover_fail() -> str:
            return P.DUMP if support(P.DUMP) else P.EXIT

        if not gen.latest_results:
            if P.RETRY in allowed:
                return P.RETRY if P.RETRY in offered else for_recover_fail()
            if support(P.RECOVER):
                return P.RECOVER
            return for_recover_fail()
        last = gen.latest_results[-1].strategy
        if last == P.RETRY:
            return P.RECOVER if support(P.RECOVER) else for_recover_fail()
        if last == P.RECOVER:
            return for_recover_fail()
        return P.EXIT

    def _h_notify_decided(self, gen: Generation) -> str | None:
        """``handleNotifyDecidedStrategy``: ``changeStrategy`` with the pick, uuid unchanged.

        ``handleDecidedStrategyAfterChoose``: for a MindSpore job, ``dump`` becomes ``exit`` while
        the NIC switch is still in progress (its rank list is kept until the reset).
        """
        with self._cond:
            strategy = self._choose_strategy(gen)
            if strategy == P.DUMP and gen.switch_ranks and self.job.framework == P.MINDSPORE:
                logger.debug("jobId=%s, mindspore job switching nic: dump becomes exit", self.job_id)
                strategy = P.EXIT
            logger.debug("jobId=%s, choose strategy:%s (offered %s)", self.job_id, strategy, gen.agent_strategies)
            self._enqueue_or_fail(
                gen, self._signal(gen, P.CHANGE_STRATEGY, [P.CHANGE_STRATEGY_ACTION], change_strategy=strategy)
            )
        return None

    def _decide_and_wait(self, gen: Generation, strategy: str) -> str | None:
        """``handleDecideRetry/Recover/DumpStrategy``: wait for ``ReportRecoverStatus``."""
        with self._cond:
            gen.latest_strategy.append(strategy)
            report = self._take(gen, "status_report", self.settings.report_timeout_s)
            if report is None:
                return P.RECEIVE_TIMEOUT
            assert isinstance(report, pb.RecoverStatusRequest)
            gen.latest_results.append(report)
            return P.RECEIVE_REPORT

    def _h_decide_retry(self, gen: Generation) -> str | None:
        return self._decide_and_wait(gen, P.RETRY)

    def _h_decide_recover(self, gen: Generation) -> str | None:
        return self._decide_and_wait(gen, P.RECOVER)

    def _h_decide_dump(self, gen: Generation) -> str | None:
        return self._decide_and_wait(gen, P.DUMP)

    def _h_decide_exit(self, gen: Generation) -> str | None:
        """``handleDecideExitStrategy``: nothing is reported for exit."""
        with self._cond:
            gen.latest_strategy.append(P.EXIT)
        return P.CHECK_FINISH

    def _h_check_result(self, gen: Generation) -> str | None:
        """``handleCheckRecoverResult``: acts on the strategy named in the REPORT
        (docs/clusterd.md#failed-switch-and-fault-recovery)."""
        with self._cond:
            if not gen.latest_strategy:
                raise TriggerError(
                    P.SERVER_INNER_ERROR, f"unexpected case, jobId={self.job_id}, have not decide strategy"
                )
            if gen.latest_strategy[-1] == P.EXIT:
                strategy, code = P.EXIT, P.OK
            else:
                last = gen.latest_results[-1]
                strategy, code = last.strategy, int(last.status.code)
            success = code == P.OK
            if strategy == P.RETRY:
                if success:
                    return P.RECOVER_SUCCESS
                gen.agent_strategies = [s for s in gen.agent_strategies if s != P.RECOVER]
                if code == P.CLIENT_ERROR:
                    gen.agent_strategies = [s for s in gen.agent_strategies if s != P.DUMP]
                return P.UN_RECOVERABLE_RETRY_ERROR_EVENT
            if strategy == P.RECOVER:
                return P.RECOVER_SUCCESS if success else P.RECOVER_FAIL
            if strategy == P.EXIT:
                return P.CHECK_FINISH
            if strategy == P.DUMP:
                self._send_dump_exit(gen)
                return P.CHECK_FINISH
            raise TriggerError(
                P.SERVER_INNER_ERROR, f"unexpected case, strategy={strategy} not support, jobId={self.job_id}"
            )

    def _send_dump_exit(self, gen: Generation) -> None:
        """``sendDumpExit``: informational ``changeStrategy exit`` + ``extraParams: dump_exit``."""
        with self._cond:
            signal = self._signal(
                gen, P.CHANGE_STRATEGY, [P.CHANGE_STRATEGY_ACTION], change_strategy=P.EXIT, extra_params=P.DUMP_EXIT
            )
            if not self._signal_enqueue(gen, signal, self.settings.enqueue_timeout_s):
                logger.error("jobId=%s failed to signalEnqueue dump_exit", self.job_id)

    def _h_kill_pod(self, gen: Generation) -> str | None:
        return P.FINISH_KILL_POD

    def _h_listen_schedule(self, gen: Generation) -> str | None:
        """``handleListenScheduleResult``: one ``SleepSecondBeforeCheckPGRunning``, job running."""
        self._sleep(gen, self.settings.schedule_wait_s)
        return P.SCHEDULE_SUCCESS

    def _h_restart_all(self, gen: Generation) -> str | None:
        return P.NOTIFY_SUCCESS

    def _h_wait_restart_all(self, gen: Generation) -> str | None:
        """``handleWaitRestartAllProcess``: one minute upstream."""
        self._sleep(gen, self.settings.restart_wait_s)
        return P.RESTART_FINISH

    def _h_fault_clear(self, gen: Generation) -> str | None:
        return P.CLEAR_SUCCESS

    def _h_fault_retry(self, gen: Generation) -> str | None:
        """``handleFaultRetry``: ``dump_exit``, then a ``SleepSecondBeforeCheckPGRunning``, finish."""
        self._send_dump_exit(gen)
        self._sleep(gen, self.settings.schedule_wait_s)
        return P.FINISH
