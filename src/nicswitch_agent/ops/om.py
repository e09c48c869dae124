"""Operator (O&M) side: ask ClusterD for a link switch and read its result.

ClusterD gives an operator two RPCs (docs/clusterd.md#switchnictrack-validation,
docs/clusterd.md#the-operators-result-stream):

* ``SwitchNicTrack(SwitchNics)`` answers a ``Status``: 0 accepted, 411 another switch or a recovery
  is running, 413 invalid request (``info`` says why).
* ``SubscribeSwitchNicSignal(SwitchNicRequest)`` is accepted only while a switch is in progress and
  delivers **at most one** ``SwitchNicResponse`` (``"switch nic finish"`` or a failure message),
  then returns. It can also end cleanly with no message (a controller reset), and it answers gRPC
  UNKNOWN ``"... is not swtiching nic"`` / ``"... not registed"`` (sic) when there is nothing to watch.

:class:`OmClient` turns those into values: :meth:`OmClient.switch` returns :class:`SwitchAccepted`
or raises an :class:`OmError`; :meth:`OmClient.follow` always returns an :class:`Outcome`.
Nothing here prints; ``om_cli`` does.

The client is this module; its parts live beside it and every public name is importable from here:
:mod:`~nicswitch_agent.ops.om_request` parses and validates what is asked (``--node/--dev/--op``,
``SwitchNics``), :mod:`~nicswitch_agent.ops.om_results` holds the errors and outcomes and what each
of ClusterD's messages means, and :mod:`~nicswitch_agent.ops.om_follow` the result stream's retries.

ClusterD hands the one result message to exactly one ``SubscribeSwitchNicSignal`` subscriber, so
two followers of the same job compete: one gets the message, the other sees the stream end empty.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType

import grpc

from nicswitch_agent.clusterd.channel import (
    ChannelSettings,
    RecoverStub,
    TlsSettings,
    close_channel,
    open_channel,
    settings_of,
)
from nicswitch_agent.ops.om_follow import (
    DEFAULT_FOLLOW_TIMEOUT_S,
    DEFAULT_MAX_UNREACHABLE_S,
    DEFAULT_WATCH_POLL_S,
    ResultStream,
    backoff_delays,
)
from nicswitch_agent.ops.om_request import (
    NicOps,
    build_switch_request,
    describe_nic_ops,
    op_name,
    parse_nic_groups,
    parse_nic_ops,
    parse_op,
    validate_nic_ops,
)
from nicswitch_agent.ops.om_results import (
    CODE_BUSY,
    CODE_INVALID,
    CODE_OK,
    FAILURE_MESSAGES,
    SWITCH_FINISH,
    OmError,
    OmRpcError,
    Outcome,
    OutcomeKind,
    StreamError,
    SwitchAccepted,
    SwitchBusy,
    SwitchInvalid,
    SwitchRejected,
    WatchedSwitch,
    WatchEnd,
    classify_message,
    classify_stream_error,
)

# One literal name for the O&M client, whichever of its modules logs: operators filter on it, so it
# does not follow the modules' paths (__name__).
_LOG = logging.getLogger("nicswitch_agent.om")

#: Deadline for each unary call. ClusterD answers in milliseconds on loopback.
DEFAULT_RPC_TIMEOUT_S = 10.0


class OmClient:
    """Operator client for one ClusterD: request a switch, follow its result.

    Thread-safety: one follow at a time; :meth:`close` may be called from any thread and makes a
    running :meth:`follow` return ``CANCELLED`` promptly.
    """

    def __init__(
        self,
        target: str,
        *,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        channel: grpc.Channel | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        """Open the channel to ClusterD (or adopt ``channel``).

        Args:
            target: ClusterD's ``host:port``.
            rpc_timeout_s: Deadline of ``SwitchNicTrack``.
            channel: A channel to use (not closed by :meth:`close`); None: one is opened.
            tls: TLS for the channel opened here; None: plaintext (ClusterD's own way).

        Raises:
            ConfigError: a TLS file cannot be read or is not PEM.
        """
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be > 0, got {rpc_timeout_s}")
        self.target = target
        self.rpc_timeout_s = rpc_timeout_s
        self._own_channel = channel is None
        # Without transparent retries (ChannelSettings): follow and watch retry on their own, and a
        # stream lost in gRPC's retry would hang them for good (and --max-unreachable with them).
        self._channel = channel if channel is not None else open_channel(
            ChannelSettings(target=target, tls=tls, transparent_retries=False))
        self._stub = RecoverStub(self._channel)
        self._closed = threading.Event()
        # SubscribeSwitchNicSignal: the in-flight call, cancelled by close().
        self._stream = ResultStream(self._stub, self._channel, self._closed)

    def __enter__(self) -> OmClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop a running follow and close the channel (if ours). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._stream.cancel()
        if self._own_channel:
            close_channel(self._channel)

    # -- SwitchNicTrack ----------------------------------------------------------------------

    def switch(self, job_id: str, nic_ops: NicOps, *, timeout_s: float | None = None) -> SwitchAccepted:
        """Ask ClusterD to switch ``nic_ops`` of ``job_id``; never retried (not idempotent: a
        second call while the first runs gets 411).

        Raises:
            ValueError: bad input, detected before anything is sent.
            SwitchBusy: 411. SwitchInvalid: 413. SwitchRejected: any other non-zero code.
            OmRpcError: the call failed (``maybe_delivered`` on a deadline).
        """
        request = build_switch_request(job_id, nic_ops)
        deadline = self.rpc_timeout_s if timeout_s is None else timeout_s
        _LOG.info("[%s] SwitchNicTrack %s", job_id, describe_nic_ops(nic_ops))
        started = time.monotonic()
        try:
            status = self._stub.SwitchNicTrack(request, timeout=deadline)
        except grpc.RpcError as exc:
            raise OmRpcError.from_rpc_error("SwitchNicTrack", exc, settings_of(self._channel)) from exc
        rpc_s = time.monotonic() - started
        code, info = int(status.code), str(status.info)
        _LOG.info("[%s] SwitchNicTrack -> %d %r (%.1f ms)", job_id, code, info, rpc_s * 1000)
        if code == CODE_OK:
            frozen = {node: (tuple(devs), tuple(ops)) for node, (devs, ops) in nic_ops.items()}
            return SwitchAccepted(job_id=job_id, info=info, nic_ops=frozen, rpc_s=rpc_s)
        if code == CODE_BUSY:
            raise SwitchBusy(job_id, code, info)
        if code == CODE_INVALID:
            raise SwitchInvalid(job_id, code, info)
        raise SwitchRejected(job_id, code, info)

    # -- SubscribeSwitchNicSignal ------------------------------------------------------------

    def follow(
        self,
        job_id: str,
        timeout_s: float = DEFAULT_FOLLOW_TIMEOUT_S,
        *,
        wait_for_start: bool = False,
        server_seen: bool = False,
        max_unreachable_s: float | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> Outcome:
        """Wait for ClusterD's result for the switch of ``job_id``.

        A clean end of stream without a message is followed by a resubscribe: if the switch is
        still in progress (ClusterD's own 15-min O&M timeout, a proxy cutting an idle stream) we
        keep waiting; if ClusterD now says it is not switching, the result was lost (``NO_RESULT``).

        Args:
            timeout_s: our own deadline for the whole wait.
            wait_for_start: retry "not switching"/"not registered" with backoff until the switch
                starts (the ``watch`` command). Otherwise they end the follow at once.
            server_seen: the server already answered us (set after ``SwitchNicTrack``): lost
                connections are then retried (paced: 0.1 s doubling to 1 s) instead of reported as
                unreachable.
            max_unreachable_s: once ClusterD was reached, give up with ``UNREACHABLE`` when it
                has not answered for this long (None: retry until ``timeout_s``).
            on_note: called once when ClusterD becomes unreachable during the wait, and once
                when it answers again (a line for the operator, not once per retry).
        """
        return self._stream.follow(job_id, timeout_s, wait_for_start=wait_for_start, server_seen=server_seen,
                                   max_unreachable_s=max_unreachable_s, on_note=on_note)

    def watch(
        self,
        job_id: str,
        on_result: Callable[[WatchedSwitch], None] | None = None,
        *,
        count: int | None = None,
        timeout_s: float | None = None,
        poll_s: float = DEFAULT_WATCH_POLL_S,
        max_unreachable_s: float | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> WatchEnd:
        """Follow every switch of ``job_id``: each result goes to ``on_result`` as it arrives.

        ClusterD accepts SubscribeSwitchNicSignal only while a switch runs, and the stream ends
        after its one result (docs/protocol.md). So the watch keeps a stream open whenever one is
        accepted and re-opens it at once when it ends, at most once per ``poll_s`` (a server that
        refuses or ends streams at once is not hammered); connection errors back off (0.1 s to 1 s).
        A switch shorter than ``poll_s`` plus a round trip can still be missed.

        Args:
            on_result: called on this thread with each result (exceptions propagate).
            count: stop after this many results; None: until ``timeout_s`` or :meth:`close`.
            timeout_s: stop after this long; None: no limit.
            poll_s: least time between two stream openings.
            max_unreachable_s: once ClusterD has answered, stop with ``UNREACHABLE`` when it has
                not answered for this long (None: retry until ``timeout_s`` or :meth:`close`).
                Unreachable before it ever answered: ``RPC_ERROR`` at once.
            on_note: called with a line worth telling the operator (job not registered,
                connection lost, regained), never twice in a row with the same line.
        """
        return self._stream.watch(
            job_id, on_result, count=count, timeout_s=timeout_s, poll_s=poll_s,
            max_unreachable_s=max_unreachable_s, on_note=on_note,
        )

    def switch_and_wait(
        self,
        job_id: str,
        nic_ops: NicOps,
        *,
        timeout_s: float = DEFAULT_FOLLOW_TIMEOUT_S,
        rpc_timeout_s: float | None = None,
    ) -> Outcome:
        """:meth:`switch`, then :meth:`follow` at once (the result stream is only open while the
        switch runs). ``elapsed_s`` counts from the request.

        Raises:
            The errors of :meth:`switch`; the follow itself never raises.
        """
        started = time.monotonic()
        accepted = self.switch(job_id, nic_ops, timeout_s=rpc_timeout_s)
        result = self.follow(job_id, timeout_s, server_seen=True)
        return replace(result, accepted=accepted, elapsed_s=time.monotonic() - started)


__all__ = [
    "CODE_BUSY",
    "CODE_INVALID",
    "CODE_OK",
    "DEFAULT_FOLLOW_TIMEOUT_S",
    "DEFAULT_MAX_UNREACHABLE_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_WATCH_POLL_S",
    "FAILURE_MESSAGES",
    "SWITCH_FINISH",
    "NicOps",
    "OmClient",
    "OmError",
    "OmRpcError",
    "Outcome",
    "OutcomeKind",
    "StreamError",
    "SwitchAccepted",
    "SwitchBusy",
    "SwitchInvalid",
    "SwitchRejected",
    "WatchEnd",
    "WatchedSwitch",
    "backoff_delays",
    "build_switch_request",
    "classify_message",
    "classify_stream_error",
    "describe_nic_ops",
    "op_name",
    "parse_nic_groups",
    "parse_nic_ops",
    "parse_op",
    "validate_nic_ops",
]
