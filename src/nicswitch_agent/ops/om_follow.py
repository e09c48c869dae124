"""The operator's result stream: follow ``SubscribeSwitchNicSignal`` to a switch's one result.

ClusterD accepts the stream only while a switch runs, delivers at most one message and then ends
it; it can also end it empty (a controller reset) or refuse it with gRPC UNKNOWN
(docs/clusterd.md#the-operators-result-stream). :class:`ResultStream` holds the retries that turn
this into one :class:`~nicswitch_agent.ops.om_results.Outcome` (``follow``) or a series of
:class:`~nicswitch_agent.ops.om_results.WatchedSwitch` (``watch``). Callers use it through
:class:`nicswitch_agent.ops.om.OmClient`, whose methods document the contract.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ConnectivityWatch, RecoverStub, settings_of
from nicswitch_agent.clusterd.rpc_policy import RetryAfter, bounded, wait_as_asked
from nicswitch_agent.clusterd.rpc_policy import backoff_delays as _backoff_delays
from nicswitch_agent.ops.om_results import (
    FAILURE_MESSAGES,
    OmRpcError,
    Outcome,
    OutcomeKind,
    StreamError,
    WatchedSwitch,
    WatchEnd,
    classify_message,
    classify_stream_error,
    code_and_details,
)

# One literal name for the O&M client, whichever of its modules logs: operators filter on it, so it
# does not follow the modules' paths (__name__).
_LOG = logging.getLogger("nicswitch_agent.om")

#: ClusterD waits 15 min per phase (``reportTimeoutMinutes``); we wait a minute longer so that
#: ClusterD's own verdict, not our impatience, ends a slow switch.
DEFAULT_FOLLOW_TIMEOUT_S = 16 * 60.0
#: How long a follow waits for a ClusterD that answered and then became unreachable (refused
#: connections, a dead server) before it gives up: the switch may still run there, but we cannot
#: tell, and a minute is ample for a restart or a network blip.
DEFAULT_MAX_UNREACHABLE_S = 60.0
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


class _Outage:
    """Since when a ClusterD that answered has not, for one follow or watch: the one place that
    says so to the operator (once when lost, once when back, not once per retry) and decides when
    ``max_unreachable_s`` is up, so that ``switch`` and ``watch`` say and do the same.

    ``doing``: what goes on meanwhile, for the operator's line ("still waiting for the result").
    """

    def __init__(self, max_unreachable_s: float | None, note: Callable[[str], None], doing: str) -> None:
        if max_unreachable_s is not None and max_unreachable_s <= 0:
            raise ValueError(f"max_unreachable_s must be > 0, got {max_unreachable_s}")
        self._limit_s = max_unreachable_s
        self._note = note
        self._doing = doing
        self._since: tuple[float, float] | None = None  # (monotonic, wall) of the first failure

    def lost(self, problem: str) -> str | None:
        """A retryable failure (``problem``: ``CODE: details``): None to retry after :meth:`delay`,
        else why to give up (the limit is up)."""
        now = time.monotonic()
        if self._since is None:
            self._since = (now, time.time())
            clock = time.strftime("%H:%M:%S", time.localtime(self._since[1]))
            self._note(f"ClusterD unreachable since {clock}: {problem}; {self._doing}, Ctrl-C to stop")
        elif self._limit_s is not None and now - self._since[0] >= self._limit_s:
            return f"ClusterD unreachable for {now - self._since[0]:.1f} s (limit {self._limit_s:g} s): {problem}"
        return None

    def delay(self, wanted_s: float) -> float:
        """The wait before the next try: the last one falls on the limit, not up to 1 s past it."""
        if self._limit_s is None or self._since is None:
            return wanted_s
        return min(wanted_s, max(0.0, self._since[0] + self._limit_s - time.monotonic()))

    def answered(self) -> None:
        """ClusterD answered: end an outage, telling the operator once."""
        if self._since is not None:
            self._note(f"ClusterD answers again, after {time.monotonic() - self._since[0]:.1f} s unreachable")
            self._since = None


class _Connected:
    """Whether the channel has been READY since the watch began: the connection to ClusterD was
    made, so a stream that then breaks is ClusterD lost, not ClusterD never reached. A stream that
    ClusterD accepted says nothing before its result (ClusterD, in Go, sends its headers with its
    first message), so the channel's connectivity is the only word that ClusterD was there.

    A :class:`~nicswitch_agent.clusterd.channel.ConnectivityWatch` of its own: it subscribes only
    until READY, and its :meth:`close` waits until gRPC's polling thread has let go of the channel,
    which must come before the channel is closed (that thread dies with "Channel closed!" and a
    traceback otherwise).
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._ready = threading.Event()
        self._watch = ConnectivityWatch(channel)
        self._watch.add_listener(self._on_change)

    def start(self) -> None:
        """Start watching (not on a closed channel: gRPC's poller would die on it)."""
        self._watch.start()
        if self._watch.state is grpc.ChannelConnectivity.READY:  # READY already: no change to hear
            self._ready.set()

    def _on_change(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self._ready.set()

    @property
    def seen(self) -> bool:
        """The channel was READY at some point (a connection to the server was made)."""
        return self._ready.is_set()

    def close(self) -> None:
        """Unsubscribe and wait (bounded) until gRPC's poller has let go; idempotent, any thread."""
        self._watch.close()


class ResultStream:
    """SubscribeSwitchNicSignal calls for one client, one at a time.

    ``closed`` is the client's: once set, a running follow or watch ends promptly (:meth:`cancel`
    ends the call in flight, and every wait between calls wakes on it).
    """

    def __init__(self, stub: RecoverStub, channel: grpc.Channel, closed: threading.Event) -> None:
        self._stub = stub
        self._channel = channel
        self._closed = closed
        # Guards _call: the in-flight SubscribeSwitchNicSignal call, cancelled by cancel().
        self._lock = threading.Lock()
        self._call: Any = None
        # The running watches' connectivity watches: closed by cancel() before the client closes
        # the channel, so that no gRPC poller is left on a closed channel.
        self._connected: set[_Connected] = set()

    def cancel(self) -> None:
        """End the call in flight, if any, and let go of the channel's connectivity (the client's
        close(), from any thread, before it closes the channel)."""
        with self._lock:
            call = self._call
            watches = list(self._connected)
        if call is not None:
            call.cancel()
        for connected in watches:
            connected.close()

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
        """Wait for the result of the switch of ``job_id`` (the contract: :meth:`OmClient.follow`)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")

        def note(text: str) -> None:
            if on_note is not None:
                on_note(text)

        outage = _Outage(max_unreachable_s, note, "still waiting for the result")
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
                kind = _stream_error(exc, code)
                _LOG.debug("[%s] SubscribeSwitchNicSignal #%d: %s %s", job_id, attempts, code, details)
                if kind is StreamError.DEADLINE:  # the deadline we gave the call: ours
                    return outcome(OutcomeKind.TIMED_OUT, detail=_timeout_detail(timeout_s, last_problem))
                if kind in (StreamError.NOT_SWITCHING, StreamError.NOT_REGISTERED):
                    reached = True
                    outage.answered()
                    if ended_empty:
                        return outcome(
                            OutcomeKind.NO_RESULT,
                            rpc_code=code,
                            detail="the result stream ended without a message and ClusterD now says "
                            f"{details!r}: the switch is over (or was dropped before it ran) but its result was "
                            "lost (a reset of the job drops the result ClusterD held: the job's ClusterD client "
                            "went away, as when training is stopped or interrupted right after its reply; or no "
                            "agent took the job's pause, as when the job has ended, and ClusterD reset it after "
                            "1 s; or another follower took it)",
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
                    gave_up = outage.lost(last_problem)
                    if gave_up is not None:
                        return outcome(OutcomeKind.UNREACHABLE, rpc_code=code, detail=gave_up)
                    raise RetryAfter(outage.delay(next(delays))) from exc
                return outcome(OutcomeKind.RPC_ERROR, rpc_code=code, detail=self._failure(exc))
            reached = True
            outage.answered()
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
        max_unreachable_s: float | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> WatchEnd:
        """Follow every switch of ``job_id`` (the contract: :meth:`OmClient.watch`).

        ``max_unreachable_s`` as in :meth:`follow`: once ClusterD was reached, stop with
        ``UNREACHABLE`` when it has not answered for this long (None: retry until ``timeout_s``).
        """
        connected = _Connected(self._channel)
        with self._lock:  # close() sets _closed before cancel() takes the lock: one of them sees the other
            if not self._closed.is_set():
                self._connected.add(connected)
                connected.start()
        try:
            return self._watch(job_id, on_result, count, timeout_s, poll_s, max_unreachable_s, on_note, connected)
        finally:
            with self._lock:
                self._connected.discard(connected)
            connected.close()

    def _watch(
        self,
        job_id: str,
        on_result: Callable[[WatchedSwitch], None] | None,
        count: int | None,
        timeout_s: float | None,
        poll_s: float,
        max_unreachable_s: float | None,
        on_note: Callable[[str], None] | None,
        connected: _Connected,
    ) -> WatchEnd:
        """:meth:`watch`; ``connected`` tells whether the channel reached ClusterD."""
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
            if on_note is not None and text != last_note:  # once per registration wait, not once per poll
                last_note = text
                on_note(text)

        outage = _Outage(max_unreachable_s, note, "still watching")

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
                kind = _stream_error(exc, code)
                if kind in (StreamError.NOT_SWITCHING, StreamError.NOT_REGISTERED):
                    outage.answered()
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
                # A stream ClusterD accepted (a switch ran) and lost says nothing before it breaks:
                # a connection made is ClusterD reached, as for switch, whose request answered.
                if kind is StreamError.TRANSIENT and (reached or connected.seen):
                    reached, trouble = True, f"{code}: {details}"
                    gave_up = outage.lost(trouble)
                    if gave_up is not None:
                        return end(OutcomeKind.UNREACHABLE, gave_up, code)
                    self._pause(outage.delay(next(delays)), deadline)
                    continue
                return end(OutcomeKind.RPC_ERROR, self._failure(exc), code)
            # ClusterD accepted the stream: a switch was running when it was opened.
            outage.answered()
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

    def _failure(self, exc: grpc.RpcError) -> str:
        """``CODE: details`` of a call that failed for good, in the words ``switch`` uses for its
        own call (plain words for a TLS mismatch, say: :meth:`OmRpcError.from_rpc_error`)."""
        error = OmRpcError.from_rpc_error("SubscribeSwitchNicSignal", exc, settings_of(self._channel))
        return f"{error.code}: {error.details}"

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


def _stream_error(exc: grpc.RpcError, code: str) -> StreamError:
    """:func:`classify_stream_error`, but a CANCELLED we did not ask for (callers rule out our own
    close() first) is the server going away, as UNAVAILABLE is: a Python gRPC server that stops
    (the simulator's Ctrl-C) cancels the calls it has not answered, where Go's drops the connection."""
    kind = classify_stream_error(exc)
    return StreamError.TRANSIENT if kind is StreamError.FATAL and code == "CANCELLED" else kind


def _timeout_detail(timeout_s: float, last_problem: str) -> str:
    text = f"no result within {timeout_s:g} s"
    if last_problem:
        text += f" (last: {last_problem})"
    return text


__all__ = [
    "DEFAULT_FOLLOW_TIMEOUT_S",
    "DEFAULT_MAX_UNREACHABLE_S",
    "DEFAULT_WATCH_POLL_S",
    "ResultStream",
    "backoff_delays",
]
