"""rpc_policy: how a failed call is read (table-tested, code by code and text by text) and how
the next one is paced (backoff, the "server ends every stream at once" rule, bounded retries)."""

from __future__ import annotations

import itertools
import random
import threading

import grpc
import pytest
from tenacity import wait_random_exponential

from nicswitch_agent.clusterd import rpc_policy
from nicswitch_agent.clusterd.rpc_policy import (
    EndsAtOnce,
    Kind,
    RetryAfter,
    backoff_delays,
    bounded,
    classify,
    describe,
    is_terminal,
    job_unknown,
    must_register_again,
    nothing_sent,
    refused_unhandled,
    wait_as_asked,
)
from nicswitch_agent.sim import codes as P

C = grpc.StatusCode
JOB = "job-1"


class FakeRpcError(grpc.RpcError):
    """What grpcio raises, reduced to what a client reads: code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


REFUSED = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused"
TLS_TO_PLAINTEXT = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                    "Ssl handshake failed: SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
                    "WRONG_VERSION_NUMBER")


@pytest.mark.parametrize(
    ("code", "details", "kind"),
    [
        # ClusterD's refusals: all UNKNOWN (plain Go errors), told apart by their words (sic).
        (C.UNKNOWN, P.NOT_REGISTED.format(job=JOB), Kind.NOT_REGISTERED),
        (C.UNKNOWN, P.NOT_REGISTED_WAIT_AGENT.format(job=JOB), Kind.NOT_REGISTERED),
        (C.UNKNOWN, P.NOT_SWITCHING.format(job=JOB), Kind.NOT_SWITCHING),
        (C.UNKNOWN, "qps exceeded, method=/Recover/ReplySwitchNicResult", Kind.QPS_EXCEEDED),
        (C.UNKNOWN, "something else", Kind.OTHER),
        (C.UNKNOWN, "", Kind.OTHER),
        (C.UNKNOWN, "jobId=job-1 not registered", Kind.OTHER),  # only ClusterD's spelling counts
        # The words count only with ClusterD's code.
        (C.UNAVAILABLE, P.NOT_REGISTED.format(job=JOB), Kind.UNAVAILABLE),
        (C.INTERNAL, "qps exceeded", Kind.INTERNAL),
        # No connection could be made: nothing was sent.
        (C.UNAVAILABLE, REFUSED, Kind.CONNECT_FAILED),
        (C.UNAVAILABLE, TLS_TO_PLAINTEXT, Kind.CONNECT_FAILED),
        (C.UNAVAILABLE, "Ssl handshake failed: SSL_ERROR_SSL", Kind.HANDSHAKE_FAILED),
        (C.UNAVAILABLE, "tsi_handshake failed", Kind.HANDSHAKE_FAILED),
        # A connection that was there.
        (C.UNAVAILABLE, "Socket closed", Kind.UNAVAILABLE),
        (C.UNAVAILABLE, "Stream removed", Kind.UNAVAILABLE),
        (C.DEADLINE_EXCEEDED, "Deadline Exceeded", Kind.DEADLINE),
        (C.INTERNAL, "Received RST_STREAM with error code 2", Kind.INTERNAL),
        # Nothing a reconnect can fix.
        (C.UNIMPLEMENTED, "", Kind.TERMINAL),
        (C.UNAUTHENTICATED, "bad token", Kind.TERMINAL),
        (C.PERMISSION_DENIED, "", Kind.TERMINAL),
        # The rest.
        (C.CANCELLED, "Locally cancelled by application!", Kind.OTHER),
        (C.RESOURCE_EXHAUSTED, "Received message larger than max", Kind.OTHER),
        (C.FAILED_PRECONDITION, "", Kind.OTHER),
    ],
)
def test_classify_table(code: grpc.StatusCode, details: str, kind: Kind) -> None:
    failure = classify(FakeRpcError(code, details))
    assert (failure.code, failure.details, failure.kind) == (code, details, kind)


def test_clusterds_words_are_written_once_and_match_the_simulators_copy() -> None:
    # The simulator keeps its own copy of ClusterD's strings; the two must agree.
    assert rpc_policy.NOT_REGISTERED_TEXT == P.NOT_REGISTED_WORDS
    assert all(rpc_policy.NOT_REGISTERED_TEXT in text for text in (P.NOT_REGISTED, P.NOT_REGISTED_WAIT_AGENT))
    assert rpc_policy.NOT_SWITCHING_TEXT in P.NOT_SWITCHING


def test_missing_details_read_as_empty() -> None:
    failure = classify(FakeRpcError(C.UNAVAILABLE, None))
    assert (failure.details, failure.kind) == ("", Kind.UNAVAILABLE)


@pytest.mark.parametrize("exc", [ValueError("x"), grpc.FutureCancelledError(), RuntimeError("not registed")])
def test_other_exceptions_are_other_without_a_code(exc: BaseException) -> None:
    failure = classify(exc)
    assert failure.code is None and failure.kind is Kind.OTHER and failure.code_name == "UNKNOWN"
    assert not is_terminal(exc) and not job_unknown(exc) and not must_register_again(exc)
    assert not nothing_sent(exc) and not refused_unhandled(exc)


def test_rpc_error_without_a_code_is_other() -> None:
    failure = classify(grpc.RpcError("bare"))
    assert failure.code is None and failure.kind is Kind.OTHER


@pytest.mark.parametrize(
    ("code", "details", "terminal", "sent_nothing", "unhandled", "unknown_job", "register_again"),
    [
        (C.UNAVAILABLE, REFUSED, False, True, False, False, True),
        (C.UNAVAILABLE, "Socket closed", False, False, False, False, True),  # a restart forgets us
        (C.UNKNOWN, P.NOT_REGISTED_WAIT_AGENT.format(job=JOB), False, False, False, True, True),
        (C.UNKNOWN, "qps exceeded", False, False, True, False, False),
        (C.INTERNAL, "RST_STREAM", False, False, False, False, False),  # a message we could not decode
        (C.RESOURCE_EXHAUSTED, "too large", False, False, False, False, False),  # an oversized message
        (C.DEADLINE_EXCEEDED, "Deadline Exceeded", False, False, False, False, False),
        (C.CANCELLED, "", False, False, False, False, False),
        (C.UNIMPLEMENTED, "", True, False, False, False, False),  # not ClusterD (or a packaged path)
        (C.UNAUTHENTICATED, "", True, False, False, False, False),
        (C.PERMISSION_DENIED, "", True, False, False, False, False),
    ],
)
def test_predicates_table(code: grpc.StatusCode, details: str, terminal: bool, sent_nothing: bool,
                          unhandled: bool, unknown_job: bool, register_again: bool) -> None:
    exc = FakeRpcError(code, details)
    assert is_terminal(exc) is terminal
    assert nothing_sent(exc) is sent_nothing
    assert refused_unhandled(exc) is unhandled
    assert job_unknown(exc) is unknown_job
    assert must_register_again(exc) is register_again


@pytest.mark.parametrize(
    ("exc", "text"),
    [
        (FakeRpcError(C.UNKNOWN, "jobId=j not registed"), "UNKNOWN: jobId=j not registed"),
        (FakeRpcError(C.UNAVAILABLE, "Socket closed"), "UNAVAILABLE: Socket closed"),
        (ValueError("bad"), "ValueError: bad"),
        (grpc.RpcError("bare"), "RpcError: bare"),
    ],
)
def test_describe(exc: BaseException, text: str) -> None:
    assert describe(exc) == text


# -- backoff -----------------------------------------------------------------------------------


def test_backoff_is_jittered_in_the_upper_half_doubling_and_capped() -> None:
    delays = list(itertools.islice(backoff_delays(0.2, 5.0, rng=random.Random(1)), 12))
    bounds = [min(5.0, 0.2 * 2**n) for n in range(12)]
    assert all(bound / 2 <= d <= bound for d, bound in zip(delays, bounds, strict=True))
    assert len(set(delays)) == len(delays)  # jittered


def test_backoff_is_reproducible_with_a_seed_and_takes_a_multiplier() -> None:
    one = list(itertools.islice(backoff_delays(0.1, 1.0, multiplier=3.0, rng=random.Random(7)), 5))
    two = list(itertools.islice(backoff_delays(0.1, 1.0, multiplier=3.0, rng=random.Random(7)), 5))
    assert one == two
    bounds = [min(1.0, 0.1 * 3**n) for n in range(5)]  # 0.1, 0.3, 0.9, then the cap
    assert all(bound / 2 <= d <= bound for d, bound in zip(one, bounds, strict=True))


# -- "the server ends every stream at once" ----------------------------------------------------


def test_ends_at_once_needs_a_whole_burst_within_the_window() -> None:
    rule = EndsAtOnce(5, 1.0)
    opens = [0.0, 0.1, 0.2, 0.3]
    assert [rule.ended(t, t + 0.01, False) for t in opens] == [False] * 4
    assert rule.ended(0.4, 0.41, False)  # five in 0.41 s
    assert rule.ended(0.5, 0.51, False)  # and every one after, while they keep coming that fast


def test_ends_at_once_slides_past_a_slow_burst() -> None:
    rule = EndsAtOnce(3, 1.0)
    assert not rule.ended(0.0, 0.1, False)
    assert not rule.ended(0.5, 0.6, False)
    assert not rule.ended(1.2, 1.3, False)  # the first opened 1.3 s before this end
    assert rule.ended(1.25, 1.4, False)  # 0.5, 1.2, 1.25: within 0.9 s


def test_a_message_starts_the_count_again() -> None:
    rule = EndsAtOnce(3, 1.0)
    assert not rule.ended(0.0, 0.01, False)
    assert not rule.ended(0.02, 0.03, False)
    assert not rule.ended(0.04, 0.05, True)  # a list came: a switch, not a broken server
    assert not rule.ended(0.06, 0.07, False)
    assert not rule.ended(0.08, 0.09, False)
    assert rule.ended(0.1, 0.11, False)


@pytest.mark.parametrize(("opened", "ended", "got_message", "at_once"), [
    (10.0, 10.49, False, True),
    (10.0, 10.5, False, False),  # lived its half second
    (10.0, 10.1, True, False),  # brought a signal
])
def test_a_burst_of_one_is_a_stream_that_ended_too_soon(opened: float, ended: float, got_message: bool,
                                                         at_once: bool) -> None:
    assert EndsAtOnce(1, 0.5).ended(opened, ended, got_message) is at_once


def test_ends_at_once_refuses_an_empty_burst() -> None:
    with pytest.raises(ValueError, match="burst"):
        EndsAtOnce(0, 1.0)


# -- bounded retries (tenacity) ----------------------------------------------------------------


class Flaky(Exception):
    pass


def test_bounded_stops_after_the_attempts_and_raises_the_last_failure() -> None:
    calls: list[int] = []

    def attempt() -> None:
        calls.append(len(calls) + 1)
        raise Flaky(f"try {len(calls)}")

    with pytest.raises(Flaky, match="try 3"):
        bounded(lambda exc: isinstance(exc, Flaky), attempts=3)(attempt)
    assert calls == [1, 2, 3]


def test_bounded_returns_the_first_success_and_passes_other_failures_through() -> None:
    answers = iter([Flaky(), Flaky(), "ok"])

    def attempt() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert bounded(lambda exc: isinstance(exc, Flaky), attempts=3)(attempt) == "ok"
    with pytest.raises(KeyError):
        bounded(lambda exc: isinstance(exc, Flaky), attempts=3)(lambda: {}["x"])


def test_bounded_stops_once_the_event_is_set_and_sleeps_as_told() -> None:
    stop = threading.Event()
    slept: list[float] = []
    calls = 0

    def attempt() -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            stop.set()
        raise RetryAfter(0.25 * calls)

    with pytest.raises(RetryAfter):
        bounded(lambda exc: isinstance(exc, RetryAfter), stop_event=stop, wait=wait_as_asked,
                sleep=slept.append)(attempt)
    assert calls == 4 and slept == [0.25, 0.5, 0.75]


def test_bounded_stops_after_its_time() -> None:
    calls = 0

    def attempt() -> None:
        nonlocal calls
        calls += 1
        raise Flaky()

    with pytest.raises(Flaky):  # the first failure comes after the limit: no second attempt
        bounded(lambda exc: True, within_s=0.0)(attempt)
    assert calls == 1


def test_bounded_takes_tenacitys_waits() -> None:
    slept: list[float] = []

    def attempt() -> None:
        raise Flaky()

    with pytest.raises(Flaky):
        bounded(lambda exc: True, attempts=6, wait=wait_random_exponential(multiplier=0.05, max=2.0),
                sleep=slept.append)(attempt)
    assert len(slept) == 5 and all(0 <= s <= min(2.0, 0.05 * 2**n) for n, s in enumerate(slept))
