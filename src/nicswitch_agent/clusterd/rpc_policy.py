"""How a ClusterD client reads a failed call and paces the next one: the one place for both.

Reading: :func:`classify` turns any exception from a call into an :class:`RpcFailure` (gRPC code,
details, and a :class:`Kind` that says what the failure means here). ClusterD's handlers return
plain Go errors, so its refusals all arrive as gRPC ``UNKNOWN`` and only the text tells them apart,
misspelt as ClusterD spells them ("not registed", "swtiching": docs/clusterd.md). Those words are
written here once; every other rule reads the status code.

Pacing: one capped, jittered exponential backoff (:func:`backoff_delays`), one rule for a server
that ends every stream at once (:class:`EndsAtOnce`), and the bounded retries built on tenacity
(:func:`bounded`): a reply until it is delivered, Register's three rounds, an operator's follow.

This module depends on grpc and tenacity only (it belongs to the ClusterD client, not the agent).
"""

from __future__ import annotations

import enum
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    stop_never,
    stop_when_event_set,
    wait_none,
)
from tenacity.stop import stop_base
from tenacity.wait import wait_base

# ClusterD's words (sic), as its stream and unary handlers write them (docs/clusterd.md).
NOT_REGISTERED_TEXT = "not registed"  # "jobId=<job> not registed[, please wait agent register]"
NOT_SWITCHING_TEXT = "is not swtiching nic"  # "jobId=<job> is not swtiching nic"
QPS_EXCEEDED_TEXT = "qps exceeded"  # its rate limiter, before any handler runs
# gRPC's words for a call that never left the client: no connection could be made.
CONNECT_FAILED_TEXT = "failed to connect to all addresses"
HANDSHAKE_WORDS = ("handshake failed", "ssl_error", "tsi_")

_TERMINAL = frozenset(
    {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
)


class Kind(str, enum.Enum):
    """What a failed call means to a ClusterD client."""

    NOT_REGISTERED = "not_registered"  # UNKNOWN "not registed": ClusterD does not know the job (restarted?)
    NOT_SWITCHING = "not_switching"  # UNKNOWN "is not swtiching nic": no switch to follow
    QPS_EXCEEDED = "qps_exceeded"  # UNKNOWN "qps exceeded": refused before the handler ran
    CONNECT_FAILED = "connect_failed"  # UNAVAILABLE "failed to connect to all addresses": nothing sent
    HANDSHAKE_FAILED = "handshake_failed"  # UNAVAILABLE naming a failed TLS handshake: nothing sent
    UNAVAILABLE = "unavailable"  # any other UNAVAILABLE: connection lost, server restarting
    DEADLINE = "deadline"  # DEADLINE_EXCEEDED: our own deadline; the request may have arrived
    INTERNAL = "internal"  # a proxy's RST_STREAM, or a message that could not be decoded
    TERMINAL = "terminal"  # UNIMPLEMENTED (not ClusterD), UNAUTHENTICATED, PERMISSION_DENIED
    OTHER = "other"  # anything else, and exceptions that are not gRPC errors


@dataclass(frozen=True)
class RpcFailure:
    """A failed call, read once. ``code`` is None for an exception that is not a gRPC error."""

    code: grpc.StatusCode | None
    details: str
    kind: Kind

    @property
    def code_name(self) -> str:
        """The code's name; ``UNKNOWN`` when there is none (what gRPC reports for it, too)."""
        return self.code.name if self.code is not None else "UNKNOWN"


def _kind(code: grpc.StatusCode | None, details: str) -> Kind:
    if code is grpc.StatusCode.UNKNOWN:
        if NOT_SWITCHING_TEXT in details:
            return Kind.NOT_SWITCHING
        if NOT_REGISTERED_TEXT in details:
            return Kind.NOT_REGISTERED
        if QPS_EXCEEDED_TEXT in details:
            return Kind.QPS_EXCEEDED
        return Kind.OTHER
    if code is grpc.StatusCode.UNAVAILABLE:
        text = details.lower()
        if CONNECT_FAILED_TEXT in text:
            return Kind.CONNECT_FAILED
        if any(word in text for word in HANDSHAKE_WORDS):
            return Kind.HANDSHAKE_FAILED
        return Kind.UNAVAILABLE
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return Kind.DEADLINE
    if code is grpc.StatusCode.INTERNAL:
        return Kind.INTERNAL
    if code in _TERMINAL:
        return Kind.TERMINAL
    return Kind.OTHER


def classify(exc: BaseException) -> RpcFailure:
    """Read ``exc`` (the one place that calls ``code()`` and ``details()``)."""
    if not isinstance(exc, grpc.RpcError):
        return RpcFailure(None, str(exc), Kind.OTHER)
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = str(details_fn() or "") if callable(details_fn) else ""
    return RpcFailure(code, details, _kind(code, details))


def describe(exc: BaseException) -> str:
    """``CODE: details`` for a gRPC error, ``Type: message`` for anything else."""
    code = classify(exc).code
    details_fn = getattr(exc, "details", None)
    text = details_fn() if callable(details_fn) else exc
    return f"{code.name if code is not None else type(exc).__name__}: {text}"


def is_terminal(exc: BaseException) -> bool:
    """No reconnect can fix it: not ClusterD (UNIMPLEMENTED), or refused credentials."""
    return classify(exc).kind is Kind.TERMINAL


def nothing_sent(exc: BaseException) -> bool:
    """The call failed before it reached the server: no connection could be made."""
    return classify(exc).kind is Kind.CONNECT_FAILED


def refused_unhandled(exc: BaseException) -> bool:
    """ClusterD refused the call before its handler ran ("qps exceeded"): safe to resend."""
    return classify(exc).kind is Kind.QPS_EXCEEDED


def job_unknown(exc: BaseException) -> bool:
    """ClusterD does not know the job: it restarted (and lost every switch in flight), or the job
    has not registered yet."""
    return classify(exc).kind is Kind.NOT_REGISTERED


def must_register_again(exc: BaseException) -> bool:
    """After this error on the process-manage stream, Init and Register again before resubscribing:
    ClusterD forgot the job, or may have (it went away: a restart loses every registration)."""
    failure = classify(exc)
    return failure.kind is Kind.NOT_REGISTERED or failure.code is grpc.StatusCode.UNAVAILABLE


# -- pacing ------------------------------------------------------------------------------------


def backoff_delays(
    initial_s: float, maximum_s: float, *, multiplier: float = 2.0, rng: random.Random | None = None
) -> Iterator[float]:
    """Capped exponential delays, each jittered in [d/2, d]: with 0.2 and 5 s, 0.1-0.2, 0.2-0.4,
    0.4-0.8 ... 2.5-5 s. Half of the delay is kept so that a retry never comes at once; the other
    half spreads many clients. Start a new generator to start again from ``initial_s``."""
    rng = rng or random.Random()
    delay = initial_s
    while True:
        yield delay * (0.5 + rng.random() / 2)
        delay = min(maximum_s, delay * multiplier)


class EndsAtOnce:
    """The rule for a server that ends every stream at once (a broken proxy, a fight over the
    job): ``burst`` streams in a row ended cleanly with no message, the first of them opened less
    than ``window_s`` before the last one ended. The caller then backs off instead of spinning.

    A stream that brought a message starts the count again. Not thread-safe: one per stream loop.
    """

    def __init__(self, burst: int, window_s: float) -> None:
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.window_s = window_s
        self._opened: deque[float] = deque(maxlen=burst)

    def ended(self, opened_at: float, ended_at: float, got_message: bool) -> bool:
        """Record a clean end (monotonic times); True when the caller should back off."""
        if got_message:
            self._opened.clear()
            return False
        self._opened.append(opened_at)
        return len(self._opened) == self._opened.maxlen and ended_at - self._opened[0] < self.window_s


# -- bounded retries (tenacity) ----------------------------------------------------------------


class RetryAfter(Exception):
    """Raised by an attempt to be called again after ``delay_s`` (see :func:`wait_as_asked`)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"retry after {delay_s:.3g} s")
        self.delay_s = delay_s


def wait_as_asked(retry_state: RetryCallState) -> float:
    """A tenacity wait: the delay the failed attempt asked for with :class:`RetryAfter`."""
    outcome = retry_state.outcome
    exc = outcome.exception() if outcome is not None else None
    return exc.delay_s if isinstance(exc, RetryAfter) else 0.0


def bounded(
    retry_on: Callable[[BaseException], bool],
    *,
    attempts: int | None = None,
    within_s: float | None = None,
    stop_event: threading.Event | None = None,
    wait: wait_base | Callable[[RetryCallState], float] | None = None,
    sleep: Callable[[float], None] | None = None,
) -> Retrying:
    """A tenacity ``Retrying`` that calls again while the failure satisfies ``retry_on``, at most
    ``attempts`` times, within ``within_s`` of the first call, and not once ``stop_event`` is set;
    the last failure is raised as it is (no ``RetryError``).

    Args:
        wait: seconds between two calls (tenacity's wait strategies); None: none.
        sleep: how to wait them (e.g. an Event's wait, so that a stop cuts it short).
    """
    stops: list[stop_base] = []
    if attempts is not None:
        stops.append(stop_after_attempt(attempts))
    if within_s is not None:
        stops.append(stop_after_delay(within_s))
    if stop_event is not None:
        stops.append(stop_when_event_set(stop_event))
    stop: stop_base = stop_any(*stops) if stops else stop_never
    options: dict[str, Any] = {}
    if sleep is not None:
        options["sleep"] = sleep
    return Retrying(
        retry=retry_if_exception(retry_on),
        stop=stop,
        wait=wait if wait is not None else wait_none(),
        reraise=True,
        **options,
    )


__all__ = [
    "CONNECT_FAILED_TEXT",
    "HANDSHAKE_WORDS",
    "NOT_REGISTERED_TEXT",
    "NOT_SWITCHING_TEXT",
    "QPS_EXCEEDED_TEXT",
    "EndsAtOnce",
    "Kind",
    "RetryAfter",
    "RpcFailure",
    "backoff_delays",
    "bounded",
    "classify",
    "describe",
    "is_terminal",
    "job_unknown",
    "must_register_again",
    "nothing_sent",
    "refused_unhandled",
    "wait_as_asked",
]
