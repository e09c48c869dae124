"""The leader's ClusterD session: one channel and everything that talks over it, built and torn
down in one place.

What it holds: the channel and its one connectivity watch, the replier, the notify stream
(SubscribeNotifySwitch: the rank lists) and, in pause mode ``agent``, the process-manage stream
with the controller that says what each of its signals means for training (signal_flow.py). The
agent (agent.py) decides *when* things happen; this module knows *how* each piece is made,
started, and stopped, and in which order.

Teardown order (docs/architecture.md): the notify stream stops first (no new lists); the agent
then settles the replies it owes; only then may the process-manage stream end, because ClusterD
resets the job when it does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import (
    ChannelSettings,
    ConnectivityWatch,
    RecoverStub,
    close_channel,
    open_channel,
)
from nicswitch_agent.clusterd.notify import NotifySubscriber, SubscriberSettings
from nicswitch_agent.clusterd.process_manage import ProcessManageClient, ProcessManageSettings
from nicswitch_agent.clusterd.reply import Replier, ReplyPolicy, ReplyReport
from nicswitch_agent.clusterd.signal_flow import AgentModeController, HookSettings
from nicswitch_agent.config import AgentConfig
from nicswitch_agent.coordination import Coordinator
from nicswitch_agent.executor import OwedReply
from nicswitch_agent.observability import events as ev

logger = logging.getLogger("nicswitch_agent")


@dataclass(frozen=True)
class SessionCallbacks:
    """What the session tells the agent (each is called on a stream's thread; none may block long)."""

    on_list: Callable[[pb.SwitchRankList], None]
    on_fatal: Callable[[BaseException], None]
    on_health: Callable[[bool, str], None]
    on_connection: Callable[[], None]  # the notify stream's connection changed (no event says so)
    on_conflict: Callable[[str], None]  # another process-manage client fights for the job's stream
    on_training_stop: Callable[[str], None]  # ClusterD's recovery decided that training must stop
    emit: Callable[[str, int | None, dict[str, Any]], None]  # an event: (kind, seq, detail)


class LeaderSession:
    """The ClusterD client of a leader. Construct (opens the channel; starts nothing that talks),
    then :meth:`start`; tear down with :meth:`stop_notify`, :meth:`end_process_manage`,
    :meth:`close` in that order, or :meth:`abort` if the start failed half way."""

    def __init__(self, cfg: AgentConfig, *, pause_mode: str, coordinator: Coordinator, hooks: HookSettings,
                 callbacks: SessionCallbacks) -> None:
        self._cfg = cfg
        self._callbacks = callbacks
        self.controller: AgentModeController | None = None
        self.process_manage: ProcessManageClient | None = None
        self._signals_at_stop = 0  # real signals seen when the stop began (end_process_manage)
        self.subscriber: NotifySubscriber | None = None
        self.channel: grpc.Channel = open_channel(ChannelSettings(
            target=cfg.server,
            keepalive_time_s=cfg.keepalive_time_s,
            keepalive_timeout_s=cfg.keepalive_timeout_s,
            reconnect_initial_s=cfg.reconnect_initial_s,
            reconnect_max_s=cfg.reconnect_max_s,
            connect_timeout_s=cfg.connect_timeout_s,
            max_receive_bytes=cfg.max_message_bytes,
            tls=cfg.tls_settings(),
            single_threaded_streams=True,  # idle streams wait in gRPC core (docs/performance.md, "Idle CPU")
        ))
        try:
            self.stub = RecoverStub(self.channel)
            # One watch for the channel, shared by every stream and the replier (a subscription is a
            # gRPC polling thread, held only while someone waits for READY); status()["connected"]
            # reads it through the notify subscriber.
            self.watch = ConnectivityWatch(self.channel).start()
            self.replier = Replier(self.stub, ReplyPolicy(
                total_timeout_s=cfg.reply_timeout_s, attempt_timeout_s=cfg.reply_attempt_timeout_s,
            ), watch=self.watch)
            if pause_mode == "agent":
                self.controller = AgentModeController(coordinator, hooks, on_stop=callbacks.on_training_stop,
                                                      emit=callbacks.emit)
                self.process_manage = ProcessManageClient(
                    self.stub,
                    ProcessManageSettings(job_id=cfg.job_id, role=cfg.role, rpc_timeout_s=cfg.rpc_timeout_s,
                                          reconnect_initial_s=cfg.reconnect_initial_s,
                                          reconnect_max_s=cfg.reconnect_max_s, stop_timeout_s=cfg.stop_timeout_s,
                                          conflict_resets=cfg.conflict_resets, conflict_window_s=cfg.conflict_window_s,
                                          conflict_backoff_s=cfg.conflict_backoff_s,
                                          conflict_backoff_max_s=cfg.conflict_backoff_max_s),
                    self.controller.on_signal,
                    on_stream_end=self.controller.on_stream_end,
                    on_fatal=callbacks.on_fatal,
                    on_conflict=callbacks.on_conflict,
                    watch=self.watch,
                )
                self.process_manage.on_open = lambda opens: callbacks.emit(
                    ev.SUBSCRIBED, None, {"stream": "process_manage", "opens": opens})
                self.controller.attach(self.process_manage)
            self.subscriber = NotifySubscriber(
                self.stub,
                SubscriberSettings(
                    job_id=cfg.job_id, role=cfg.role, reconnect_initial_s=cfg.reconnect_initial_s,
                    reconnect_max_s=cfg.reconnect_max_s, resubscribe_after_eof_s=cfg.resubscribe_after_eof_s,
                    stop_timeout_s=cfg.stop_timeout_s, reopen_wait_s=cfg.notify_reopen_wait_s,
                ),
                callbacks.on_list,
                on_fatal=callbacks.on_fatal,
                on_health=callbacks.on_health,
                gate=None if self.process_manage is None else self.process_manage.gate,
                watch=self.watch,
                on_connection=lambda connected, why: callbacks.on_connection(),
            )
            self.subscriber.on_open = lambda opens: callbacks.emit(ev.SUBSCRIBED, None, {"stream": "notify",
                                                                                          "opens": opens})
        except BaseException:
            watch = getattr(self, "watch", None)
            if watch is not None:
                watch.close()
            self.channel.close()
            raise

    def start(self) -> None:
        """Start the threads: the signal worker and the process-manage stream first (the notify
        stream waits for the job to be registered), then the notify stream."""
        if self.controller is not None:
            self.controller.start()
        if self.process_manage is not None:
            self.process_manage.start()
        assert self.subscriber is not None
        self.subscriber.start()

    # -- replies ---------------------------------------------------------------------------------

    def owed_reply(self, seq: int, order: Any, rejection: str = "") -> OwedReply:
        """The reply token of a list just received, marked so that :meth:`forgotten` can tell later."""
        pm, sub = self.process_manage, self.subscriber
        if pm is not None:
            return OwedReply(seq, self._cfg.job_id, order, rejection, stream=pm.stream_id)
        job_unknown = None if sub is None else sub.job_unknown
        return OwedReply(seq, self._cfg.job_id, order, rejection, job_unknown=job_unknown)

    def forgotten(self, owed: OwedReply) -> str:
        """Why ClusterD no longer waits for this reply ("" if it still does).

        Pause mode agent: the process-manage stream ended since the list came, so ClusterD reset
        the job or restarted. Pause mode external: ClusterD has since said it does not know the
        job ("not registed"), so it restarted; a network blip, after which it still waits, does
        not say that. (If TaskD registers the job again before our notify stream reopens, the
        restart goes unseen: TaskD waits 10 s after a failed health check, we reconnect within
        reconnect_max_s.)
        """
        pm, sub = self.process_manage, self.subscriber
        if owed.stream is not None and pm is not None and not pm.is_current(owed.stream):
            return "ClusterD reset the job since the list arrived"
        gave_up = "" if self.controller is None else self.controller.abandoned(owed.seq)
        if gave_up:  # its stopTrain came while the switch ran (its reply timeout)
            return gave_up
        if owed.job_unknown is not None and sub is not None and sub.job_unknown != owed.job_unknown:
            return "ClusterD has restarted since the list arrived (it answered that it does not know the job)"
        return ""

    def send_reply(self, job_id: str, result: bool, total_timeout_s: float | None) -> ReplyReport:
        return self.replier.send(job_id, result, total_timeout_s=total_timeout_s)

    def health_check(self) -> pb.Status:
        """ClusterD's HealthCheck (one unary call). Raises grpc.RpcError."""
        status: pb.Status = self.stub.HealthCheck(pb.ClientInfo(jobId=self._cfg.job_id, role=self._cfg.role),
                                                  timeout=self._cfg.rpc_timeout_s)
        return status

    # -- pause mode auto's fallback ----------------------------------------------------------------

    def leave_process_manage(self) -> None:
        """Leave the job's process-manage stream to the other client (MindIO/TaskD or a stand-in)
        and run the notify stream ungated, as in pause mode external. Called on the process-manage
        thread: that stream ends after the callback returns (no join here)."""
        pm, controller, sub = self.process_manage, self.controller, self.subscriber
        self.process_manage = None  # lists from now on are not tied to a process-manage stream
        self.controller = None  # orders run on the members' threads, as in pause mode external
        if pm is not None:
            pm.stop()
        if controller is not None:
            controller.stop(self._cfg.stop_timeout_s)
        if sub is not None:
            sub.ungate()

    # -- teardown ----------------------------------------------------------------------------------

    def stop_notify(self) -> None:
        """No new lists (the first step of every stop)."""
        if self.process_manage is not None:
            self._signals_at_stop = self.process_manage.real_signals
        if self.subscriber is not None:
            self.subscriber.stop()

    def end_process_manage(self, *, after_reply: bool = False) -> None:
        """End the process-manage stream and the signal worker; only once every owed reply is
        settled (ClusterD resets the job when the stream ends). ``after_reply``: the stop sent a
        reply (or saw one go out): ClusterD tells the operator how the switch ended only when its
        state machine takes the reply, and then sends its next signal (``stop_train`` after a
        false one); a reset before that ends the operator's stream with no message
        (docs/clusterd.md#resets-and-stream-ends). So wait for that signal first, bounded. The same
        after an OK recovery status (the ``continue`` after a switch): ClusterD tells the operator
        as it finishes the flow and resets, so wait (bounded) for that reset too."""
        timeout = self._cfg.stop_timeout_s
        manage = self.process_manage
        if manage is not None and after_reply and manage.stream_open:  # (not open: nothing will come)
            manage.wait_signal_after(self._signals_at_stop, timeout)
        if manage is not None:  # a flow our last report ended: ClusterD tells the operator as it resets
            manage.wait_flow_finished(timeout)
        if self.process_manage is not None:
            # No report after this point (ClusterD would keep it for its next question), and
            # one on the wire arrives before the stream ends.
            self.process_manage.close_reports(timeout)
            self.process_manage.stop()
        if self.controller is not None:
            self.controller.stop(timeout)

    def close(self) -> None:
        """Close the replier, then the watch and the channel (after the streams have stopped).

        The channel is closed on a thread of its own (``nicswitch-channel-close``): gRPC's
        connectivity thread, if one runs (the channel was not READY a moment ago), must let go of
        it first, which takes up to its 0.2 s poll (ConnectivityWatch.close), and nothing is sent
        on the channel any more, so ``stop()`` need not wait for that.
        """
        self.replier.close()
        threading.Thread(target=self._close_channel, name="nicswitch-channel-close", daemon=True).start()

    def _close_channel(self) -> None:
        try:
            self.watch.close()
        finally:
            close_channel(self.channel)  # and grpcio's call thread done with the streams' last events

    def abort(self) -> None:
        """Undo a start that failed half way: everything stopped and closed, nothing waits."""
        for client in (self.subscriber, self.process_manage):
            if client is not None:
                client.stop()
        if self.controller is not None:
            self.controller.stop(self._cfg.stop_timeout_s)
        self.close()


__all__ = ["LeaderSession", "SessionCallbacks"]
