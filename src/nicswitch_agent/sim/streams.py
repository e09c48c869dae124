"""The server-stream side of a simulated job: who gets each signal, rank list and O&M message.

Stream handlers keep the generation they opened in; a reset ends them all at once
(docs/clusterd.md#delivery-of-the-rank-list, docs/clusterd.md#the-operators-result-stream).
"""

from __future__ import annotations

import logging
import time

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.generation import StreamToken, copy_message, discard_waiter
from nicswitch_agent.sim.machine import Machine

logger = logging.getLogger("nicswitch_agent.sim")


class StreamSide(Machine):
    """Opening, feeding and ending the job's process-manage, rank-list and O&M streams."""

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
                    self._changed()  # JobView.list_waiters: a test may wait for it
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
        the machine moved on and waited for a reply nobody would send. Same here. Whether the
        subscriber read it is not known yet: gRPC may drop the generator of a stream the client
        ended right after reading the list. So it is a violation only if the generation ends
        without a reply (:meth:`reply_switch_nic_result` clears it, ``_reset`` records it); the
        job view shows it meanwhile.
        """
        with self._cond:
            if not token.in_flight or self._stopping or token.gen.closed:
                token.in_flight = False
                return
            token.in_flight = False
            token.gen.unconfirmed_send = True
            logger.debug("jobId=%s rank list send unconfirmed: a violation unless a reply comes", self.job_id)
            self._changed()
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
