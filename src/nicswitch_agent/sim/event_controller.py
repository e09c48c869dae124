"""One job's controller in the simulated ClusterD: the state machine, its one-slot channels, resets.

This mirrors upstream ``EventController`` (``recover/controller.go``, ``om_controller.go``,
``rules.go``; docs/clusterd.md#the-state-machine) closely enough that a client cannot tell the difference on the wire:

* Events go through a 10-slot queue read by one event-loop thread; a transition appends
  ``State(event)`` to the action path and runs the destination state's handler, which may
  block waiting for a report and returns the next event (``selectEventChan``/``trigger``).
* Every channel of upstream is a slot of a :class:`Generation`. A reset closes the generation
  (``ctx`` cancelled, channels closed) and opens a new one, so every stream, wait and blocked
  call of the old one ends; stream handlers keep the generation they started in, as upstream
  handlers keep the context and channel they grabbed at subscribe time (docs/clusterd.md#delivery-of-the-rank-list).
* The event loop and the keep-alive thread start at the first reset, never before
  (``NewEventController`` does not start them; docs/clusterd.md#no-process-manage-subscriber).

Nothing here imports gRPC: :mod:`nicswitch_agent.sim.server` adapts RPCs to these methods.

Lock: one ``threading.Condition`` (re-entrant) per job guards everything in the controller.
It is never held while calling into gRPC. ``on_change`` (the simulator's notifier) takes its
own lock, always after this one.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.generation import (
    Cancelled,
    Generation,
    StreamToken,
    copy_message,
    discard_waiter,
    new_event_id,
)
from nicswitch_agent.sim.job_view import FATAL_PREFIX, JobView
from nicswitch_agent.sim.ranktable import RankTable, go_map_order
from nicswitch_agent.sim.rules import RULES, TriggerError
from nicswitch_agent.sim.settings import SimJob, SimSettings

logger = logging.getLogger("nicswitch_agent.sim")

__all__ = ["FATAL_PREFIX", "JobController", "JobView", "RpcAbort", "StreamToken", "new_event_id"]


class RpcAbort(Exception):
    """End an RPC with a gRPC status instead of a reply (the server adapts it to ``abort``)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class JobController:
    """The simulated ``EventController`` of one job. Thread-safe; see the module docstring."""

    def __init__(
        self,
        job: SimJob,
        settings: SimSettings,
        rng: random.Random,
        on_change: Callable[[], None] = lambda: None,
        on_fatal: Callable[[str], None] = lambda text: None,
    ) -> None:
        self.job = job
        self.settings = settings
        self.ranktable = RankTable(job.nodes)
        self._rng = rng
        self._on_change = on_change
        self._on_fatal = on_fatal
        self._cond = threading.Condition(threading.RLock())
        self._stopping = False
        self._inited = False
        self._registered = False
        self._gen = self._new_generation(0)
        self._state: str = P.INIT
        self._transitions: list[str] = []
        self._last_path: list[str] = []
        self._history: list[list[str]] = []
        self._resets: list[str] = []
        self._replies: list[bool] = []
        self._om_messages: list[str] = []
        self._signals_sent: list[pb.ProcessManageSignal] = []
        self._lists_sent: list[pb.SwitchRankList] = []
        self._keepalives = 0
        self._violations: list[str] = []
        self._streams: set[StreamToken] = set()
        self._stream_opens: dict[str, int] = dict.fromkeys(P.STREAM_METHODS, 0)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ introspection

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def view(self) -> JobView:
        with self._cond:
            if self._transitions:
                path = self._current_path()
            elif self._last_path:
                path = list(self._last_path)
            else:
                path = [P.INIT]
            open_streams = dict.fromkeys(P.STREAM_METHODS, 0)
            for token in self._streams:
                if token.gen is self._gen and not token.dead:
                    open_streams[token.method] += 1
            return JobView(
                job_id=self.job_id,
                state=self._state,
                action_path=path,
                path_history=[list(p) for p in self._history],
                uuid=self._gen.uuid,
                inited=self._inited,
                registered=self._registered,
                loop_running=bool(self._threads),
                generation=self._gen.number,
                replies=list(self._replies),
                om_messages=list(self._om_messages),
                signals_sent=[copy_message(s) for s in self._signals_sent],
                keepalives_sent=self._keepalives,
                stream_opens=dict(self._stream_opens),
                open_streams=open_streams,
                lists_sent=[copy_message(lst) for lst in self._lists_sent],
                violations=list(self._violations),
                resets=list(self._resets),
                queued=self._queued(),
            )

    def _queued(self) -> dict[str, int]:
        gen = self._gen
        slots = ("signal", "rank_list", "result", "stop_report", "strategy_report", "status_report")
        queued = {"events": len(gen.events), "om": len(gen.om)}
        queued.update({slot: int(getattr(gen, slot) is not None) for slot in slots})
        return queued

    def reset_count(self) -> int:
        with self._cond:
            return len(self._resets)

    def is_registered(self) -> bool:
        with self._cond:
            return self._registered

    # --------------------------------------------------- registration (docs/clusterd.md#registration-init-and-register)

    def init(self) -> pb.Status:
        """``Init``: idempotent (fault_recover_service.go ``Init``; docs/clusterd.md#errors-before-registration).

        403 when the PodGroup has ``process-recover-enable`` off: ``getJobBaseInfo`` refuses and
        nothing is recorded, so a later ``Register`` answers 408.
        """
        with self._cond:
            if not self.job.process_recover_enable:
                logger.debug("jobId=%s Init refused: process-recover-enable off", self.job_id)
                return pb.Status(code=P.PROCESS_RECOVER_ENABLE_OFF, info=P.INIT_RECOVER_OFF.format(job=self.job_id))
            self._inited = True
            self._changed()
        return pb.Status(code=P.OK, info=P.INIT_SUCCESS.format(job=self.job_id))

    def register(self) -> pb.Status:
        """``Register``: 408 before Init, idempotent after; creates the controller
        (docs/clusterd.md#errors-before-registration)."""
        with self._cond:
            if self._registered:
                return pb.Status(code=P.OK, info=P.REGISTER_SUCCESS)
            if not self._inited:
                return pb.Status(code=P.UN_INIT, info=P.NOT_INITED.format(job=self.job_id))
            self._registered = True
            self._changed()
        logger.debug("jobId=%s register success", self.job_id)
        return pb.Status(code=P.OK, info=P.REGISTER_SUCCESS)

    # ------------------------------------------------- O&M: SwitchNicTrack (docs/clusterd.md#switchnictrack-validation)

    def switch_nic_track(self, request: pb.SwitchNics) -> pb.Status:
        """Validate in upstream order, map devices to global ranks, queue ``startSwitchNic``."""
        job = self.job_id
        with self._cond:
            if not self.job.in_job_cache:
                # Check 2, before the registration check: a registered job can still be missing
                # from ClusterD's job cache.
                return _param_invalid(P.JOB_NOT_EXIST_MSG.format(job=job))
            if not self._registered:
                return _param_invalid(P.JOB_NOT_REGISTERED_MSG.format(job=job))
            if not self.job.running:
                return _param_invalid(P.JOB_NOT_RUNNING_MSG.format(job=job))
            # checkNicsParam ranges over the Go map: the first failing node is random.
            for node in go_map_order(request.nicOps.keys(), self._shuffle_rng()):
                devs = request.nicOps[node]
                if not self.ranktable.has_node(node):
                    return _param_invalid(P.NODE_NOT_EXIST_MSG.format(node=node, job=job))
                if len(devs.dev) != len(devs.op):
                    return _param_invalid(P.DEV_OP_LENGTH_MSG)
                if len(devs.dev) == 0 or len(devs.op) == 0:
                    return _param_invalid(P.DEV_OP_EMPTY_MSG)
                known = self.ranktable.device_ids(node)
                for dev in devs.dev:
                    if dev not in known:
                        return _param_invalid(P.DEVICE_NOT_EXIST_MSG.format(dev=dev, node=node))
                if self.job.superpod_id(node) < 0:
                    return _param_invalid(P.SUPER_POD_MSG.format(node=node))
            if not self._can_do_switching_nic():
                return pb.Status(code=P.OM_IS_RUNNING, info=P.OM_RUNNING.format(job=job))
            # getGlobalRankIDAndOp ranges over the map again: a second, independent order.
            order = go_map_order(request.nicOps.keys(), self._shuffle_rng())
            ranks, ops = self.ranktable.global_ranks(
                (node, list(request.nicOps[node].dev), list(request.nicOps[node].op)) for node in order
            )
            gen = self._gen
            gen.switch_ranks, gen.switch_ops = ranks, ops
            if not ranks:
                # docs/clusterd.md#switchnictrack-validation "Not validated": accepted, nothing is stored,
                # and the flow stalls in WaitReportPauseCompleteState with training paused.
                self._violation(
                    "SwitchNicTrack with an empty nicOps map: accepted with 0, but real ClusterD stores "
                    "no ranks and stalls in WaitReportPauseCompleteState after the pause (training stays "
                    "paused)"
                )
            logger.debug("jobId=%s nic swtich: %s, %s", job, ranks, ops)
            self._add_event(gen, P.START_SWITCH_NIC)
            return pb.Status(code=P.OK, info=P.DISTRIBUTED)

    def _can_do_switching_nic(self) -> bool:
        """``canDoSwitchingNic``: state INIT.

        Also refuses while a ``startSwitchNic`` is queued for a running event loop: upstream has a
        microsecond window there in which a second call is accepted and the machine then resets on
        the duplicate event; the observed second call (50 ms later) always got 411.
        """
        if self._state != P.INIT:
            return False
        return not (self._threads and P.START_SWITCH_NIC in self._gen.events)

    def _shuffle_rng(self) -> random.Random | None:
        return self._rng if self.settings.shuffle_nodes else None

    # -------------- worker: reply (docs/clusterd.md#waiting-for-the-reply, docs/clusterd.md#reply-timing-and-the-crash)

    def reply_switch_nic_result(self, request: pb.SwitchResult) -> pb.Status:
        """``ReplySwitchNicResult``: into the one-slot result channel, with no state check.

        Upstream's send blocks when the slot is full and panics the whole server when a reset
        closes the channel under it (docs/clusterd.md#reply-timing-and-the-crash); the simulator
        blocks the same way, then reports the crash (:meth:`_fatal`: recorded, logged as an ERROR,
        and with ``crash_like_clusterd`` the whole simulator goes down) and ends that call with
        UNAVAILABLE.
        """
        with self._cond:
            if not self._registered:
                return pb.Status(code=P.UN_REGISTRY, info=P.NOT_REGISTED.format(job=self.job_id))
            gen = self._gen
            self._replies.append(bool(request.result))
            if gen.result is not None:
                self._violation(
                    "duplicate reply while a result is pending (real ClusterD blocks this handler and "
                    "crashes at the next reset)"
                )
                while gen.result is not None and not gen.closed and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    raise RpcAbort("UNAVAILABLE", "simulator stopped")
                if gen.closed:
                    self._fatal(
                        "a blocked ReplySwitchNicResult met a reset: the one-slot result channel was "
                        "full (a second reply for one list), the reset closed it, and the blocked send "
                        "panics with 'send on closed channel'; the whole server process exits (status 2) "
                        "and every job on it is lost"
                    )
                    raise RpcAbort("UNAVAILABLE", "Stream removed (simulated ClusterD crash: send on closed channel)")
            elif not gen.awaiting_reply:
                self._violation("reply while no switch is waiting (buffered; the next switch takes it)")
            gen.result = bool(request.result)
            self._changed()
        logger.debug("jobId=%s nic swtich result: %s", self.job_id, request.result)
        return pb.Status(code=P.OK, info=P.REPLY_SUCCESS)

    # ------------------------------------------------------------------ agent: reports

    def report_stop_complete(self, request: pb.StopCompleteRequest) -> pb.Status:
        return self._report(P.REPORT_STOP_COMPLETE, request, "stop_report", int(request.status.code))

    def report_recover_strategy(self, request: pb.RecoverStrategyRequest) -> pb.Status:
        return self._report(P.REPORT_RECOVER_STRATEGY, request, "strategy_report", P.OK)

    def report_recover_status(self, request: pb.RecoverStatusRequest) -> pb.Status:
        return self._report(P.REPORT_RECOVER_STATUS, request, "status_report", int(request.status.code))

    def _report(
        self,
        method: str,
        request: pb.StopCompleteRequest | pb.RecoverStrategyRequest | pb.RecoverStatusRequest,
        slot: str,
        code: int,
    ) -> pb.Status:
        """Report* handlers (fault_recover_service.go): reply built first, then a blocking send.

        The reply embeds the uuid current *before* the machine moves on (docs/clusterd.md#waiting-for-the-reply). A send
        into a full slot blocks until a wait takes the earlier report; a reset under it is caught
        upstream (``catchAndSetExceptionInfo``) and answers 599 ``..., chan closed``.
        """
        job = self.job_id
        with self._cond:
            if not self._registered:
                return pb.Status(code=P.UN_REGISTRY, info=P.NOT_REGISTED.format(job=job))
            gen = self._gen
            info = P.RECEIVED.format(job=job, uuid=gen.uuid, method=method)
            self._check_report(gen, method, request, code)
            if getattr(gen, slot) is not None:
                self._violation(
                    f"{method} while an earlier {method} is still pending (real ClusterD blocks this call "
                    "until a wait takes the earlier one, or answers 599 at the next reset)"
                )
                while getattr(gen, slot) is not None and not gen.closed and not self._stopping:
                    self._cond.wait()
                if gen.closed or self._stopping:
                    return pb.Status(code=P.SERVER_INNER_ERROR, info=P.CHAN_CLOSED.format(job=job, uuid=self._gen.uuid))
            setattr(gen, slot, request)
            self._changed()
        logger.debug("receive %s, jobId=%s, code=%d", method, job, code)
        return pb.Status(code=P.OK, info=info)

    def _check_report(
        self,
        gen: Generation,
        method: str,
        request: pb.StopCompleteRequest | pb.RecoverStrategyRequest | pb.RecoverStatusRequest,
        code: int,
    ) -> None:
        """Record reports that a correct MindIO/agent would not send (they still go in, as upstream)."""
        if method in gen.expecting:
            gen.expecting.discard(method)
            if isinstance(request, pb.RecoverStatusRequest) and gen.ordered_strategy:
                if request.strategy != gen.ordered_strategy:
                    self._violation(
                        f"ReportRecoverStatus strategy={request.strategy!r} does not echo changeStrategy "
                        f"{gen.ordered_strategy!r}: real ClusterD processes the report's name (empty or "
                        "unknown is a 599 trigger error and a reset; docs/clusterd.md#failed-switch-and-fault-recovery)"
                    )
                gen.ordered_strategy = ""
            return
        switching = self._state in (P.NOTIFY_SWITCH_NIC, P.WAIT_SWITCH_NIC_FINISHED)
        if method == P.REPORT_RECOVER_STATUS and switching:
            if code == P.UN_RECOVERABLE_RETRY_ERROR:
                return  # MindIO's pause-wait timeout: the switch fails (docs/clusterd.md#waiting-for-the-reply).
            self._violation(
                f"ReportRecoverStatus(code={code}) during {self._state}: real ClusterD acts only on 406 "
                "here; any other code wedges the job in WaitSwitchNicFinishedState with no timeout "
                "(docs/clusterd.md#waiting-for-the-reply)"
            )
            return
        self._violation(f"{method} while nothing waits for it (buffered; the next wait takes it)")

    # --------------- streams (docs/clusterd.md#delivery-of-the-rank-list, docs/clusterd.md#the-operators-result-stream)

    def open_stream(self, method: str, peer: str) -> StreamToken:
        """Register a server stream. A process-manage subscribe resets the job first
        (docs/clusterd.md#registration-init-and-register)."""
        with self._cond:
            if method == P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL:
                if self._state != P.INIT:
                    self._violation(
                        f"SubscribeProcessManageSignal opened during {self._state}: real ClusterD resets "
                        "the job on every subscribe (listenSendChannel) and the running flow is aborted"
                    )
                if any(
                    t.method == P.SUBSCRIBE_NOTIFY_SWITCH and t.peer == peer and t.gen is self._gen and not t.dead
                    for t in self._streams
                ):
                    self._violation(
                        "SubscribeNotifySwitch opened before SubscribeProcessManageSignal was reset: the "
                        "process-manage subscribe from the same client ended it (open the process-manage "
                        "stream first; docs/clusterd.md#subscribe-order)"
                    )
                self._reset("SubscribeProcessManageSignal opened")
            token = StreamToken(method, self._gen, peer)
            self._streams.add(token)
            self._stream_opens[method] += 1
            self._changed()
        logger.debug("jobId=%s %s opened (peer=%s)", self.job_id, method, peer)
        return token

    def open_om_stream(self, peer: str) -> StreamToken | None:
        """``SubscribeSwitchNicSignal``: only while the job is switching (``isSwitchingNic``)."""
        with self._cond:
            if not self._gen.switch_ranks:
                return None
            return self.open_stream(P.SUBSCRIBE_SWITCH_NIC_SIGNAL, peer)

    def stream_terminated(self, token: StreamToken) -> None:
        """The RPC of ``token`` ended, for any reason (gRPC termination callback).

        When the client ends the process-manage stream of the current generation, upstream's
        ``selectSendChannel`` resets the job (docs/clusterd.md#subscribe-order).
        """
        with self._cond:
            if token.dead:
                return
            token.dead = True
            self._streams.discard(token)
            for waiters in (token.gen.list_waiters, token.gen.om_waiters):
                if token in waiters:
                    waiters.remove(token)
            if token.method == P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL and token.gen is self._gen and not self._stopping:
                self._reset("SubscribeProcessManageSignal stream ended")
            self._changed()

    def next_signal(self, token: StreamToken) -> pb.ProcessManageSignal | None:
        """The next signal for a process-manage stream, or None when the stream must end."""
        with self._cond:
            gen = token.gen
            while True:
                if self._stopping or gen.closed or token.dead:
                    return None
                if gen.signal is not None:
                    signal, gen.signal = gen.signal, None
                    self._changed()
                    return signal
                self._cond.wait()

    def signal_sent(self, token: StreamToken, signal: pb.ProcessManageSignal) -> None:
        """``handleSendResult``: the event a sent signal produces (controller.go)."""
        event: str | None
        with self._cond:
            if signal.signalType == P.KEEP_ALIVE:
                self._keepalives += 1
                self._changed()
                return
            self._signals_sent.append(copy_message(signal))
            self._changed()
            if signal.signalType == P.KILL_MASTER:
                event = P.FINISH
            elif signal.extraParams == P.DUMP_EXIT:
                event = None
            elif signal.signalType == P.CHANGE_STRATEGY:
                event = P.STRATEGY_SUCCESS_EVENT.get(signal.changeStrategy)
            else:
                event = P.NOTIFY_SUCCESS
        logger.debug(
            "jobId=%s sent %s %s uuid=%s %s",
            self.job_id,
            signal.signalType,
            list(signal.actions),
            signal.uuid,
            signal.changeStrategy,
        )
        if event is not None:
            self._add_event(token.gen, event)

    def next_rank_list(self, token: StreamToken) -> pb.SwitchRankList | None:
        """The queued rank list for one of the job's competing subscribers, or None to end.

        A list waits in its slot until a live subscriber takes it; a subscriber that went away
        leaves it for the next one. Subscribers are served first come, first served, as a Go
        channel serves its receivers: the one that has waited longest gets the list, even when
        it is a stale stream whose client is gone but whose connection still looks alive
        (docs/clusterd.md#the-reconnect-race).
        """
        with self._cond:
            gen = token.gen
            while True:
                if self._stopping or gen.closed or token.dead:
                    discard_waiter(gen.list_waiters, token)
                    return None
                if token not in gen.list_waiters:
                    gen.list_waiters.append(token)
                if gen.rank_list is not None and gen.list_waiters[0] is token:
                    gen.list_waiters.popleft()
                    rank_list, gen.rank_list = gen.rank_list, None
                    gen.awaiting_reply = True
                    token.in_flight = True
                    competing = sum(
                        1
                        for t in self._streams
                        if t.method == P.SUBSCRIBE_NOTIFY_SWITCH and t.gen is gen and not t.dead
                    )
                    if competing > 1:
                        self._violation(
                            f"rank list taken by one of {competing} competing SubscribeNotifySwitch streams: "
                            "ClusterD gives each list to only one subscriber (docs/clusterd.md#competing-subscribers)"
                        )
                    self._changed()
                    return rank_list
                self._cond.wait()

    def rank_list_sent(self, token: StreamToken, rank_list: pb.SwitchRankList) -> None:
        """The send succeeded: ``NotifySuccessEvent`` (``selectNotifySwitchNic``)."""
        with self._cond:
            token.in_flight = False
            self._lists_sent.append(copy_message(rank_list))
            self._changed()
        logger.debug("jobId=%s switch nic signal=%s %s", self.job_id, list(rank_list.rankID), list(rank_list.op))
        self._add_event(token.gen, P.NOTIFY_SUCCESS)

    def rank_list_not_sent(self, token: StreamToken, rank_list: pb.SwitchRankList) -> None:
        """Put a list taken by ``next_rank_list`` back, unsent (fault injection: the stream goes
        away first). It waits in its slot for the next subscriber (docs/clusterd.md#the-reconnect-race)."""
        with self._cond:
            token.in_flight = False
            gen = token.gen
            if gen.closed or self._stopping or gen.rank_list is not None:
                return
            gen.rank_list = rank_list
            gen.awaiting_reply = False
            self._changed()

    def rank_list_unconfirmed(self, token: StreamToken) -> None:
        """The stream ended with a list handed to it and its send not confirmed.

        The real server's Send into a dying stream "succeeded" (docs/clusterd.md#the-reconnect-race):
        the machine moved on and waited for a reply nobody would send. Same here.
        """
        with self._cond:
            if not token.in_flight or self._stopping or token.gen.closed:
                token.in_flight = False
                return
            token.in_flight = False
            self._violation(
                "rank list handed to a SubscribeNotifySwitch stream that ended before the send completed: "
                "the subscriber may never see it, and ClusterD waits for a reply until its report timeout "
                "(docs/clusterd.md#the-reconnect-race)"
            )
        self._add_event(token.gen, P.NOTIFY_SUCCESS)

    def next_om_response(self, token: StreamToken) -> pb.SwitchNicResponse | None:
        """At most one O&M message, then the stream ends (``selectSendSwitchNicResponseChan``).

        Upstream's select may pick "context done" over a message queued just before a reset, so
        a listener can miss "switch nic finish" (docs/clusterd.md#the-operators-result-stream). The simulator prefers
        the
        message, so tests see a deterministic outcome.
        """
        with self._cond:
            gen = token.gen
            deadline = time.monotonic() + self.settings.report_timeout_s
            while True:
                if not token.dead and not self._stopping and token not in gen.om_waiters:
                    gen.om_waiters.append(token)  # first come, first served, as for rank lists
                if gen.om and not token.dead and not self._stopping and gen.om_waiters[0] is token:
                    gen.om_waiters.popleft()
                    response = gen.om.popleft()
                    self._changed()
                    return response
                if self._stopping or gen.closed or token.dead:
                    discard_waiter(gen.om_waiters, token)
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    discard_waiter(gen.om_waiters, token)
                    # The timeout message goes into the channel, not to this stream.
                    if len(gen.om) < P.OM_QUEUE_LENGTH:
                        self._om_messages.append(P.OM_RESULT_TIMEOUT)
                        gen.om.append(pb.SwitchNicResponse(jobID=self.job_id, msg=P.OM_RESULT_TIMEOUT))
                        self._changed()
                    return None
                self._cond.wait(remaining)

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """End every wait and thread of the job (simulator shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(1.0)
            if thread.is_alive():
                logger.warning("jobId=%s: thread %s did not stop", self.job_id, thread.name)

    # ------------------------------------------------------------------ internals: reset, events

    def _new_generation(self, number: int) -> Generation:
        return Generation(number=number, keepalive_due=time.monotonic() + self.settings.keepalive_interval_s)

    def _changed(self) -> None:
        self._cond.notify_all()
        self._on_change()

    def _violation(self, text: str) -> None:
        logger.warning("jobId=%s protocol misuse: %s", self.job_id, text)
        self._violations.append(text)
        self._changed()

    def _fatal(self, why: str) -> None:
        """Something that crashes the real ClusterD: recorded as a violation, logged as an ERROR,
        then handed to the simulator (``on_fatal``), which goes down too with ``crash_like_clusterd``."""
        text = f"{FATAL_PREFIX}{why}"
        what_now = (
            "the simulator crashes too (crash_like_clusterd)"
            if self.settings.crash_like_clusterd
            else "the simulator keeps serving (crash_like_clusterd, --crash-like-clusterd, makes it exit instead)"
        )
        logger.error("jobId=%s protocol misuse: %s; %s", self.job_id, text, what_now)
        self._violations.append(text)
        self._changed()
        self._on_fatal(f"jobId={self.job_id}: {why}")

    def record_fatal(self, why: str) -> None:
        """:meth:`_fatal` for a crash the RPC layer detects (a report without ``status``)."""
        with self._cond:
            self._fatal(why)

    def _current_path(self) -> list[str]:
        return [*self._transitions, self._state]

    def _reset(self, reason: str) -> None:
        """``reset(false)``: close the generation (ends every stream and wait), back to INIT.

        Also starts the event loop and keep-alive the first time (docs/clusterd.md#resets-and-stream-ends,
        docs/clusterd.md#no-process-manage-subscriber).
        """
        with self._cond:
            path = self._current_path()
            if self._transitions:
                self._last_path = path
                self._history.append(path)
            logger.info("jobId=%s reset (%s); action path = {%s}", self.job_id, reason, "-->".join(path))
            old = self._gen
            old.closed = True
            self._gen = self._new_generation(old.number + 1)
            self._state = P.INIT
            self._transitions = []
            self._resets.append(reason)
            self._start_threads()
            self._changed()

    def _start_threads(self) -> None:
        if self._threads or self._stopping:
            return
        for target, name in ((self._event_loop, "loop"), (self._keepalive_loop, "keepalive")):
            thread = threading.Thread(target=target, name=f"nicswitch-sim-{name}-{self.job_id}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _add_event(self, gen: Generation, event: str) -> None:
        """``addEvent``: rule-checked against the current state, 10 slots, overflow resets."""
        with self._cond:
            if gen.closed or self._stopping:
                return
            if (self._state, event) not in RULES:
                logger.warning(
                    "event add fail, order mix, jobId=%s, uuid=%s, state=%s, event=%s",
                    self.job_id,
                    gen.uuid,
                    self._state,
                    event,
                )
                return
            if len(gen.events) >= P.EVENT_QUEUE_LENGTH:
                logger.info("add event=%s timeout, reset state machine", event)
                self._reset(f"event queue full at {event}")
                return
            gen.events.append(event)
            self._changed()

    def _event_loop(self) -> None:
        """``listenEvent``: one event at a time; the destination handler runs outside the lock."""
        while True:
            with self._cond:
                while not self._stopping and not self._gen.events:
                    self._cond.wait()
                if self._stopping:
                    return
                gen = self._gen
                event = gen.events.popleft()
                rule = RULES.get((self._state, event))
                if rule is None:
                    logger.warning("jobId=%s: no rule for %s(%s), dropped", self.job_id, self._state, event)
                    continue
                destination, handler_name = rule
                self._transitions.append(f"{self._state}({event})")
                self._state = destination
                logger.info("jobId=%s's action path = {%s}", self.job_id, "-->".join(self._current_path()))
                self._changed()
            handler: Callable[[Generation], str | None] = getattr(self, handler_name)
            try:
                next_event = handler(gen)
            except Cancelled:
                continue
            except TriggerError as exc:
                logger.error("jobId=%s trigger error, code=%d, err=%s", self.job_id, exc.code, exc)
                with self._cond:
                    if not gen.closed:
                        self._reset(f"trigger error, code={exc.code}, err={exc}")
                continue
            except Exception:
                logger.exception("jobId=%s: simulator handler %s failed", self.job_id, handler_name)
                with self._cond:
                    if not gen.closed:
                        self._reset(f"simulator error in {handler_name}")
                continue
            if next_event:
                self._add_event(gen, next_event)

    def _keepalive_loop(self) -> None:
        """``keepAlive``: a keep-alive into the signal slot every interval, per generation.

        The put blocks while the slot is full, as upstream's does (controller.go selectKeepAlive).
        """
        interval = self.settings.keepalive_interval_s
        with self._cond:
            while not self._stopping:
                gen = self._gen
                now = time.monotonic()
                if now < gen.keepalive_due:
                    self._cond.wait(gen.keepalive_due - now)
                    continue
                if gen.signal is not None:
                    self._cond.wait()
                    continue
                gen.signal = pb.ProcessManageSignal(uuid=gen.uuid, jobId=self.job_id, signalType=P.KEEP_ALIVE)
                gen.keepalive_due = now + interval
                self._changed()

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
                if gen.result is not None:
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


def _param_invalid(info: str) -> pb.Status:
    return pb.Status(code=P.OM_PARAM_INVALID, info=info)
