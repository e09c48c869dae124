"""Pacing of the notify stream against a real (scripted) server; the rules themselves are
table-tested in test_rpc_policy.py, the loop with an agent in test_agent.py."""

from __future__ import annotations

import threading

import grpc
import pytest
import support
from scripted import End, Fail, ScriptedClusterD, Send, rank_list

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.clusterd.notify import NotifySubscriber, SubscriberSettings
from nicswitch_agent.clusterd.stream_gate import StreamGate
from nicswitch_agent.sim import codes as P

pytestmark = pytest.mark.timeout(30)

# So long that a test sees at most one backoff start, never its end.
LONG_BACKOFF_S = 60.0


def run_subscriber(clusterd: ScriptedClusterD, reconnect_initial_s: float) -> tuple[NotifySubscriber, list[str]]:
    channel = open_channel(ChannelSettings(target=clusterd.address))
    lists: list[str] = []
    settings = SubscriberSettings(job_id="job-1", role="r", reconnect_initial_s=reconnect_initial_s,
                                  reconnect_max_s=max(reconnect_initial_s, 5.0))

    def on_list(message: pb.SwitchRankList) -> None:
        lists.append(",".join(message.rankID))

    subscriber = NotifySubscriber(RecoverStub(channel), settings, on_list)
    subscriber.start()
    return subscriber, lists


def stop(subscriber: NotifySubscriber) -> None:
    assert subscriber.stop()  # prompt even in the middle of a backoff
    subscriber._stub.channel.close()


def test_closing_the_gate_ends_the_notify_stream_opened_under_it(clusterd: ScriptedClusterD) -> None:
    """The process-manage thread closes the gate when its stream ends (ClusterD reset the job). A
    notify subscribe sent just before can reach ClusterD after that reset: it must be gone before
    our next process-manage subscribe, or it is open in the new job state, the wrong order
    (docs/clusterd.md#subscribe-order). So close() cancels it; the subscriber counts no error for
    that and reopens once the gate opens again."""
    channel = open_channel(ChannelSettings(target=clusterd.address))
    gate = StreamGate()
    gate.open()
    subscriber = NotifySubscriber(RecoverStub(channel), SubscriberSettings(job_id="job-1", role="r"),
                                  lambda message: None, gate=gate)
    subscriber.start()
    try:
        assert clusterd.wait_for(lambda s: s.open_now == 1)
        gate.close()
        assert clusterd.wait_for(lambda s: s.open_now == 0), "the notify stream outlived the gate"
        gate.open()
        assert clusterd.wait_for(lambda s: s.opens == 2 and s.open_now == 1)
        assert (subscriber.errors, subscriber.healthy, subscriber.last_error) == (0, True, "")
    finally:
        stop(subscriber)


def test_a_gate_closed_by_a_lost_connection_counts_the_notify_stream_lost_too(clusterd: ScriptedClusterD) -> None:
    """Both streams share one connection: when it goes, whichever end sees it first closes the
    gate, and the notify stream it cancels was lost all the same (the agent's STREAM_LOST, the
    status's error count): the gate's close passes the process-manage stream's error on."""
    channel = open_channel(ChannelSettings(target=clusterd.address))
    gate = StreamGate()
    gate.open()
    health: list[tuple[bool, str]] = []
    subscriber = NotifySubscriber(RecoverStub(channel), SubscriberSettings(job_id="job-1", role="r"),
                                  lambda message: None, gate=gate, on_health=lambda ok, why: health.append((ok, why)))
    subscriber.start()
    try:
        assert clusterd.wait_for(lambda s: s.open_now == 1)
        gate.close("UNAVAILABLE: keepalive watchdog timeout")
        assert clusterd.wait_for(lambda s: s.open_now == 0), "the notify stream outlived the gate"
        assert support.wait_until(lambda: not subscriber.healthy, 10)
        assert subscriber.errors == 1 and "keepalive watchdog timeout" in subscriber.last_error
        assert health == [(False, "UNAVAILABLE: keepalive watchdog timeout")]
        gate.open()
        assert clusterd.wait_for(lambda s: s.opens == 2 and s.open_now == 1)
    finally:
        stop(subscriber)


def test_a_server_that_ends_every_stream_at_once_is_not_hammered(clusterd: ScriptedClusterD) -> None:
    for _ in range(100):
        clusterd.script(End())
    subscriber, _ = run_subscriber(clusterd, LONG_BACKOFF_S)
    try:
        burst = SubscriberSettings("j", "r").eof_burst
        assert clusterd.wait_for(lambda s: s.opens >= burst)
        # Five empty ends within a second: the subscriber now waits 30-60 s. Without the rule it
        # would reopen at once, a hundred times in well under the two seconds watched here.
        assert not clusterd.wait_for(lambda s: s.opens > burst + 2, timeout=2.0), clusterd.opens
    finally:
        stop(subscriber)


def test_streams_that_bring_lists_are_reopened_at_once(clusterd: ScriptedClusterD) -> None:
    # ClusterD ends the stream after every switch: that is no reason to slow down.
    for n in range(12):
        clusterd.script(Send(rank_list([str(n)], [True])), End())
    subscriber, lists = run_subscriber(clusterd, LONG_BACKOFF_S)
    try:
        assert clusterd.wait_for(lambda s: s.opens >= 13), clusterd.opens
        assert lists == [str(n) for n in range(12)]
        assert subscriber.clean_ends == 12 and subscriber.errors == 0
    finally:
        stop(subscriber)


@pytest.mark.parametrize(("failure", "unknown"), [
    (Fail(grpc.StatusCode.UNKNOWN, P.NOT_REGISTED_WAIT_AGENT.format(job="job-1")), 1),
    (Fail(grpc.StatusCode.UNKNOWN, P.NOT_REGISTED.format(job="job-1")), 1),
    (Fail(grpc.StatusCode.UNAVAILABLE, "Socket closed"), 0),
    (Fail(grpc.StatusCode.UNKNOWN, "qps exceeded, method=/Recover/SubscribeNotifySwitch"), 0),
])
def test_not_registed_counts_as_clusterd_not_knowing_the_job(clusterd: ScriptedClusterD, failure: Fail,
                                                           unknown: int) -> None:
    clusterd.script(failure)
    subscriber, _ = run_subscriber(clusterd, 0.01)
    try:
        assert clusterd.wait_for(lambda s: s.opens >= 2)  # failed, then reopened (and held)
        assert subscriber.errors == 1 and subscriber.job_unknown == unknown
        assert subscriber.last_error == f"{failure.code.name}: {failure.details}"
    finally:
        stop(subscriber)


def test_a_server_that_is_not_clusterd_ends_the_subscription(clusterd: ScriptedClusterD) -> None:
    clusterd.script(Fail(grpc.StatusCode.UNIMPLEMENTED, "Method not found"))
    fatal: list[BaseException] = []
    told = threading.Event()
    channel = open_channel(ChannelSettings(target=clusterd.address))
    subscriber = NotifySubscriber(RecoverStub(channel), SubscriberSettings("job-1", "r", reconnect_initial_s=0.01),
                                  lambda m: None, on_fatal=lambda e: (fatal.append(e), told.set()))
    subscriber.start()
    try:
        assert told.wait(10)
        assert subscriber.stop() and clusterd.opens == 1
    finally:
        subscriber.stop()
        channel.close()
