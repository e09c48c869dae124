"""Replier: one reply per list; retried only when provably undelivered (real servers on loopback)."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from scripted import Answer, Block, Fail, ScriptedClusterD

from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.clusterd.reply import NotConnected, Replier, ReplyOutcome, ReplyPolicy, is_undelivered

pytestmark = pytest.mark.timeout(30)


def make_replier(address: str, **policy: float) -> tuple[Replier, grpc.Channel]:
    channel = open_channel(ChannelSettings(target=address, reconnect_initial_s=0.05, reconnect_max_s=0.1))
    return Replier(RecoverStub(channel), ReplyPolicy(**policy)), channel


def test_delivered_on_first_attempt(clusterd: ScriptedClusterD) -> None:
    replier, channel = make_replier(clusterd.address)
    report = replier.send("job-1", True)
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.DELIVERED and report.attempts == 1 and report.code == 0
    assert [(r.jobId, r.result) for r in clusterd.replies] == [("job-1", True)]


def test_qps_exceeded_is_retried_until_delivered(clusterd: ScriptedClusterD) -> None:
    qps = Fail(grpc.StatusCode.UNKNOWN, "qps exceeded, method=/Recover/ReplySwitchNicResult")
    clusterd.reply_script.extend([qps, qps])
    replier, channel = make_replier(clusterd.address, initial_backoff_s=0.001, max_backoff_s=0.01)
    report = replier.send("job-1", False)
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.DELIVERED and report.attempts == 3
    assert [r.result for r in clusterd.replies] == [False, False, False]


@pytest.mark.parametrize(
    "failure",
    [
        Fail(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
        Fail(grpc.StatusCode.INTERNAL, "boom"),
        Fail(grpc.StatusCode.UNKNOWN, "something else"),
    ],
)
def test_failures_that_may_have_been_delivered_are_not_resent(clusterd: ScriptedClusterD, failure: Fail) -> None:
    clusterd.reply_script.append(failure)
    replier, channel = make_replier(clusterd.address)
    report = replier.send("job-1", True)
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.UNCERTAIN and report.attempts == 1
    assert failure.details in report.error
    assert len(clusterd.replies) == 1


def test_blocked_handler_times_out_once_and_is_not_resent(clusterd: ScriptedClusterD) -> None:
    release = threading.Event()
    clusterd.reply_script.append(Block(release))
    replier, channel = make_replier(clusterd.address, total_timeout_s=2.0, attempt_timeout_s=0.3)
    report = replier.send("job-1", True)
    release.set()
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.UNCERTAIN and report.attempts == 1
    assert "DEADLINE_EXCEEDED" in report.error
    assert len(clusterd.replies) == 1


def test_nonzero_status_is_rejected_without_retry(clusterd: ScriptedClusterD) -> None:
    clusterd.reply_script.append(Answer(400, "jobId=job-1 not registed"))
    replier, channel = make_replier(clusterd.address)
    report = replier.send("job-1", True)
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.REJECTED and report.code == 400 and report.attempts == 1
    assert report.info == "jobId=job-1 not registed"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server_is_retried_within_budget_and_reported_not_delivered() -> None:
    replier, channel = make_replier(f"127.0.0.1:{_closed_port()}", total_timeout_s=0.6, attempt_timeout_s=0.15,
                                    initial_backoff_s=0.01, max_backoff_s=0.02)
    report = replier.send("job-1", True)
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.NOT_DELIVERED
    assert report.attempts >= 2
    assert "not reachable" in report.error


def test_reply_is_delivered_once_the_server_comes_up() -> None:
    port = _closed_port()
    replier, channel = make_replier(f"127.0.0.1:{port}", total_timeout_s=20, attempt_timeout_s=0.2,
                                    initial_backoff_s=0.01, max_backoff_s=0.05)
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(replier.send("job-1", True)))
    thread.start()
    server = ScriptedClusterD(port=port)
    server.start()
    try:
        thread.join(20)
        report = result[0]
        assert report.outcome is ReplyOutcome.DELIVERED  # type: ignore[attr-defined]
        assert len(server.replies) == 1
    finally:
        replier.close()
        channel.close()
        server.stop()


def test_abort_event_cuts_retries_short() -> None:
    replier, channel = make_replier(f"127.0.0.1:{_closed_port()}", total_timeout_s=30, attempt_timeout_s=0.05)
    abort = threading.Event()
    abort.set()
    report = replier.send("job-1", True, abort=abort)
    replier.close()
    channel.close()
    assert report.outcome is ReplyOutcome.NOT_DELIVERED and report.attempts == 1


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("exc", "undelivered"),
    [
        (NotConnected("x"), True),
        (_FakeRpcError(grpc.StatusCode.UNKNOWN, "qps exceeded, method=/Recover/ReplySwitchNicResult"), True),
        (_FakeRpcError(grpc.StatusCode.UNKNOWN, "jobId=j not registed"), False),
        (_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed"), False),
        (_FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), False),
        (RuntimeError("x"), False),
    ],
)
def test_is_undelivered_table(exc: BaseException, undelivered: bool) -> None:
    assert is_undelivered(exc) is undelivered
