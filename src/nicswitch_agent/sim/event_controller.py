"""One job's controller in the simulated ClusterD, as the RPC layer sees it.

This mirrors upstream ``EventController`` (``recover/controller.go``, ``om_controller.go``,
``rules.go``; docs/clusterd.md#the-state-machine) closely enough that a client cannot tell the
difference on the wire. It is assembled from parts of the sim package:

* :mod:`~nicswitch_agent.sim.generation`: the one-slot channels a reset throws away.
* :mod:`~nicswitch_agent.sim.machine`: state, resets, the event loop and keep-alive, the lock.
* :mod:`~nicswitch_agent.sim.rules` and :mod:`~nicswitch_agent.sim.state_handlers`: the state machine.
* :mod:`~nicswitch_agent.sim.streams`: the server streams.
* :mod:`~nicswitch_agent.sim.job_view`: the snapshot tests and the CLI read.

This module adds the unary RPCs (registration, SwitchNicTrack, the reply, the reports) and the
snapshot. Nothing here imports gRPC: :mod:`nicswitch_agent.sim.server` adapts RPCs to these methods.
"""

from __future__ import annotations

import logging
import random

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.generation import UNCONFIRMED_LIST, Generation, StreamToken, copy_message, new_event_id
from nicswitch_agent.sim.job_view import FATAL_PREFIX, JobView
from nicswitch_agent.sim.ranktable import go_map_order
from nicswitch_agent.sim.state_handlers import StateHandlers
from nicswitch_agent.sim.streams import StreamSide

logger = logging.getLogger("nicswitch_agent.sim")

__all__ = ["FATAL_PREFIX", "JobController", "JobView", "RpcAbort", "StreamToken", "new_event_id"]


class RpcAbort(Exception):
    """End an RPC with a gRPC status instead of a reply (the server adapts it to ``abort``)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class JobController(StreamSide, StateHandlers):
    """The simulated ``EventController`` of one job. Thread-safe; see :mod:`~nicswitch_agent.sim.machine`."""

    # ------------------------------------------------------------------ introspection

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
                violations=self._violations + ([UNCONFIRMED_LIST] if self._gen.unconfirmed_send else []),
                resets=list(self._resets),
                queued=self._queued(),
                list_waiters=len(self._gen.list_waiters),
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
            gen.unconfirmed_send = False  # the subscriber saw the list: it answered
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
            elif not gen.awaiting_reply or gen.status_report is not None:
                # A status report that came first is what the waiting handler takes (state_handlers).
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
            if slot == "status_report":
                gen.status_report_first = gen.result is None
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


def _param_invalid(info: str) -> pb.Status:
    return pb.Status(code=P.OM_PARAM_INVALID, info=info)
