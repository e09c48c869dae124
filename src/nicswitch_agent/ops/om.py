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

ClusterD hands the one result message to exactly one ``SubscribeSwitchNicSignal`` subscriber, so
two followers of the same job compete: one gets the message, the other sees the stream end empty.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import (
    ChannelSettings,
    RecoverStub,
    TlsSettings,
    explain_connect_failure,
    open_channel,
    settings_of,
)
from nicswitch_agent.clusterd.rpc_policy import RetryAfter, bounded, wait_as_asked
from nicswitch_agent.clusterd.rpc_policy import backoff_delays as _backoff_delays
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
    code_and_details,
)

# A literal name, not __name__: operators filter on it, and it must not follow the module's path.
_LOG = logging.getLogger("nicswitch_agent.om")

#: ClusterD waits 15 min per phase (``reportTimeoutMinutes``); we wait a minute longer so that
#: ClusterD's own verdict, not our impatience, ends a slow switch.
DEFAULT_FOLLOW_TIMEOUT_S = 16 * 60.0
#: Deadline for each unary call. ClusterD answers in milliseconds on loopback.
DEFAULT_RPC_TIMEOUT_S = 10.0
#: How often :meth:`OmClient.watch` asks again while no switch runs. ClusterD accepts the result
#: stream only while a switch runs, and a switch with a quick job takes a few milliseconds (7-15 ms
#: against the simulator with an agent answering: a 20 ms poll saw 2 of 10, 5 ms saw 10 of 10). A
#: refused call changes nothing in ClusterD and costs both sides a fraction of a millisecond; 200
#: per second cost the watch about 14% of a core and the Python simulator 10%.
DEFAULT_WATCH_POLL_S = 0.005
# Retries of the result stream: 0.1 s doubling to 1 s, jittered (ClusterD answers in milliseconds).
_RETRY_INITIAL_S = 0.1
_RETRY_MAX_S = 1.0


def backoff_delays(
    initial_s: float = _RETRY_INITIAL_S, maximum_s: float = _RETRY_MAX_S, multiplier: float = 2.0
) -> Iterator[float]:
    """Capped, jittered exponential delays (:func:`nicswitch_agent.clusterd.rpc_policy.backoff_delays`);
    the caller bounds them by its deadline."""
    return _backoff_delays(initial_s, maximum_s, multiplier=multiplier)


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------


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
        self._channel = channel if channel is not None else open_channel(ChannelSettings(target=target, tls=tls))
        self._stub = RecoverStub(self._channel)
        self._closed = threading.Event()
        # Guards _call: the in-flight SubscribeSwitchNicSignal call, cancelled by close().
        self._lock = threading.Lock()
        self._call: Any = None

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
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._own_channel:
            self._channel.close()

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
                connections are then retried instead of reported as unreachable.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        started = time.monotonic()
        deadline = started + timeout_s
        delays = backoff_delays()
        reached = server_seen
        ended_empty = 0
        attempts = 0
        last_problem = ""

        def outcome(kind: OutcomeKind, **kw: Any) -> Outcome:
            return Outcome(kind, job_id, elapsed_s=time.monotonic() - started, attempts=attempts, **kw)

        def cancelled() -> Outcome:
            return outcome(OutcomeKind.CANCELLED, detail="stopped waiting (client closed)")

        def attempt() -> Outcome:
            """One stream: the outcome, or RetryAfter (the wait before asking again)."""
            nonlocal reached, ended_empty, attempts, last_problem
            if self._closed.is_set():
                return cancelled()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return outcome(OutcomeKind.TIMED_OUT, detail=_timeout_detail(timeout_s, last_problem))
            attempts += 1
            try:
                message = self._one_stream(job_id, remaining)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    raise RetryAfter(0.0) from exc
                code, details = code_and_details(exc)
                kind = classify_stream_error(exc)
                _LOG.debug("[%s] SubscribeSwitchNicSignal #%d: %s %s", job_id, attempts, code, details)
                if kind is StreamError.DEADLINE:  # the deadline we gave the call: ours
                    return outcome(OutcomeKind.TIMED_OUT, detail=_timeout_detail(timeout_s, last_problem))
                if kind in (StreamError.NOT_SWITCHING, StreamError.NOT_REGISTERED):
                    reached = True
                    if ended_empty:
                        return outcome(
                            OutcomeKind.NO_RESULT,
                            rpc_code=code,
                            detail="the result stream ended without a message and ClusterD now says "
                            f"{details!r}: the switch is over but its result was lost",
                        )
                    if wait_for_start:
                        last_problem = details
                        raise RetryAfter(next(delays)) from exc
                    not_switching = kind is StreamError.NOT_SWITCHING
                    return outcome(
                        OutcomeKind.NOT_SWITCHING if not_switching else OutcomeKind.NOT_REGISTERED,
                        rpc_code=code,
                        detail=details,
                    )
                if kind is StreamError.TRANSIENT and reached:
                    last_problem = f"{code}: {details}"
                    raise RetryAfter(next(delays)) from exc
                plain = explain_connect_failure(exc, settings_of(self._channel))
                return outcome(OutcomeKind.RPC_ERROR, rpc_code=code, detail=f"{code}: {plain or details}")
            reached = True
            if message is None:
                if self._closed.is_set():
                    raise RetryAfter(0.0)
                # Clean EOF: a controller reset, or ClusterD's own O&M timeout. Ask again (paced).
                ended_empty += 1
                last_problem = "the result stream ended without a message"
                _LOG.info("[%s] SubscribeSwitchNicSignal ended without a message; resubscribing", job_id)
                raise RetryAfter(0.05 * min(ended_empty, 20))
            kind_done = classify_message(message)
            if kind_done is OutcomeKind.FAILED and message not in FAILURE_MESSAGES:
                _LOG.warning("[%s] undocumented O&M message %r, treated as a failure", job_id, message)
            return outcome(kind_done, message=message)

        # Each attempt checks the deadline itself (after the wait, which the deadline cuts short),
        # so that a follow runs out with TIMED_OUT, not with a wait cut off early.
        retrying = bounded(lambda exc: isinstance(exc, RetryAfter), stop_event=self._closed,
                           wait=wait_as_asked, sleep=lambda seconds: self._pause(seconds, deadline))
        try:
            result: Outcome = retrying(attempt)
        except RetryAfter:  # close() during the follow
            return cancelled()
        return result

    def watch(
        self,
        job_id: str,
        on_result: Callable[[WatchedSwitch], None] | None = None,
        *,
        count: int | None = None,
        timeout_s: float | None = None,
        poll_s: float = DEFAULT_WATCH_POLL_S,
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
            on_note: called with a line worth telling the operator (job not registered,
                connection lost, regained), never twice in a row with the same line.
        """
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        started = time.monotonic()
        deadline = math.inf if timeout_s is None else started + timeout_s
        delays = backoff_delays()
        results: list[WatchedSwitch] = []
        reached = False
        # What the watch knows of the current switch's start: it began after not_running_at (the
        # opening of a stream ClusterD refused, or a previous result; None: unknown, it may have
        # been running before the watch began) and before running_at (the opening of the first
        # stream ClusterD accepted for it).
        not_running_at: float | None = None
        running_at: float | None = None
        ended_empty_at: float | None = None  # the last stream ended without a message
        last_open = -math.inf
        last_note = ""
        trouble = ""  # the connection problem being retried, if any
        last_answer = ""  # ClusterD's last refusal, for the timeout's detail

        def note(text: str) -> None:
            nonlocal last_note
            if on_note is not None and text != last_note:  # once per outage, not once per retry
                last_note = text
                on_note(text)

        def end(kind: OutcomeKind | None, detail: str = "", rpc_code: str | None = None) -> WatchEnd:
            return WatchEnd(tuple(results), kind, detail, rpc_code)

        def deliver(kind: OutcomeKind, message: str | None, detail: str, ended: float) -> None:
            assert running_at is not None
            at_least = max(0.0, ended - running_at)
            at_most = None if not_running_at is None else max(at_least, ended - not_running_at)
            outcome = Outcome(kind, job_id, message=message, detail=detail, elapsed_s=at_least)
            result = WatchedSwitch(len(results) + 1, outcome, at_least, at_most, time.time())
            results.append(result)
            if on_result is not None:
                on_result(result)

        while True:
            if self._closed.is_set():
                return end(OutcomeKind.CANCELLED, "stopped watching (client closed)")
            if count is not None and len(results) >= count:
                return end(None)
            now = time.monotonic()
            if now >= deadline:
                last = trouble or (f"ClusterD said {last_answer!r}" if last_answer else "")
                text = f"{len(results)} result(s) within {timeout_s:g} s"
                return end(OutcomeKind.TIMED_OUT, text + (f" (last: {last})" if last else ""))
            if now < last_open + poll_s:
                self._pause(last_open + poll_s - now, deadline)
                continue
            opened = last_open = time.monotonic()
            try:
                message = self._one_stream(job_id, None if deadline == math.inf else deadline - opened)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    continue
                code, details = code_and_details(exc)
                kind = classify_stream_error(exc)
                if kind in (StreamError.NOT_SWITCHING, StreamError.NOT_REGISTERED):
                    if trouble:
                        note("ClusterD answers again")
                    reached, trouble, delays, last_answer = True, "", backoff_delays(), details
                    if ended_empty_at is not None:  # that switch is over, and its result went elsewhere
                        deliver(OutcomeKind.NO_RESULT, None, "the result stream ended without a message and "
                                f"ClusterD now says {details!r}: the switch is over but its result was lost "
                                "(another follower took it, or ClusterD reset the job)", ended_empty_at)
                    not_running_at, running_at, ended_empty_at = opened, None, None
                    if kind is StreamError.NOT_REGISTERED:
                        note(f"ClusterD does not know job {job_id} ({details}); waiting for it to register")
                    continue
                if kind is StreamError.DEADLINE:
                    continue  # the deadline we gave the call: the top of the loop ends the watch
                if kind is StreamError.TRANSIENT and reached:
                    trouble = f"{code}: {details}"
                    note(f"lost ClusterD ({trouble}); retrying")
                    self._pause(next(delays), deadline)
                    continue
                plain = explain_connect_failure(exc, settings_of(self._channel))
                return end(OutcomeKind.RPC_ERROR, f"{code}: {plain or details}", code)
            # ClusterD accepted the stream: a switch was running when it was opened.
            if trouble:
                note("ClusterD answers again")
            reached, trouble, delays = True, "", backoff_delays()
            running_at = opened if running_at is None else running_at
            if message is None:
                if not self._closed.is_set():
                    _LOG.debug("[%s] SubscribeSwitchNicSignal ended without a message; resubscribing", job_id)
                    ended_empty_at = time.monotonic()
                continue
            kind_done = classify_message(message)
            if kind_done is OutcomeKind.FAILED and message not in FAILURE_MESSAGES:
                _LOG.warning("[%s] undocumented O&M message %r, treated as a failure", job_id, message)
            deliver(kind_done, message, "", time.monotonic())
            # ClusterD resets the job before it accepts the next switch: that one starts after now.
            not_running_at, running_at, ended_empty_at = time.monotonic(), None, None

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

    def _one_stream(self, job_id: str, timeout_s: float | None) -> str | None:
        """One SubscribeSwitchNicSignal call: its message, or None on a clean end of stream."""
        call = self._stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=job_id), timeout=timeout_s)
        with self._lock:
            self._call = call
        try:
            if self._closed.is_set():  # close() ran before _call was visible
                call.cancel()
            for response in call:
                if response.jobID and response.jobID != job_id:
                    _LOG.warning("[%s] result for job %r on our stream", job_id, response.jobID)
                return str(response.msg)
            return None
        finally:
            # Frees the server handler if we stop early, and on KeyboardInterrupt in the CLI.
            call.cancel()
            with self._lock:
                self._call = None

    def _pause(self, delay_s: float, deadline: float) -> None:
        """Wait before a retry, never past the deadline; close() wakes it."""
        self._closed.wait(max(0.0, min(delay_s, deadline - time.monotonic())))


def _timeout_detail(timeout_s: float, last_problem: str) -> str:
    text = f"no result within {timeout_s:g} s"
    if last_problem:
        text += f" (last: {last_problem})"
    return text


__all__ = [
    "CODE_BUSY",
    "CODE_INVALID",
    "CODE_OK",
    "DEFAULT_FOLLOW_TIMEOUT_S",
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
