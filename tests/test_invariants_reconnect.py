"""Streams are reopened at once after a clean end, but never in a tight loop.

ClusterD ends the SubscribeNotifySwitch stream cleanly after every switch, so the agent reopens
at once (docs/protocol.md). A server that ends *every* stream at once (a proxy in the way, a
ClusterD in a bad state) must not get a reopen per round trip: more than ``eof_burst`` (5) clean
ends within a second with no message make the subscriber wait ``reconnect_initial_s`` (0.2 s,
jittered to 0.1-0.2 s) before each further open (clusterd/notify.py).

The bound is a count during a fixed wait, so load can only make the test pass more easily: with
the throttle at most ~15 opens fit in a second (10 waits of >= 0.1 s, plus the few opens a
stalled box lets through at once); without it the agent reopens hundreds of times a second
(about 880/s measured on the loaded 2-core test box), two orders of magnitude above the bound.

The process-manage stream has a throttle of its own (clusterd/process_manage.py): a stream that ends
within 0.5 s with no signal is reopened after a growing backoff. By default the conflict
detector (3 such ends within 30 s: another client holds the stream) takes over after the third
end, so that test sets ``conflict_resets`` out of reach to see the throttle alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from scripted import End, Hold, ScriptedClusterD, Send, rank_list

from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd import channel as transport
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.clusterd.process_manage import ProcessManageClient, ProcessManageSettings

pytestmark = pytest.mark.timeout(60)

WINDOW_S = 1.0
MOST_OPENS_PER_WINDOW = 40  # throttled: <= ~15; unthrottled: hundreds
PM_WINDOW_S = 2.0
PM_MOST_OPENS = 12  # throttled: <= 4; unthrottled: ~180


def test_a_server_that_ends_every_stream_at_once_is_not_hammered(clusterd: ScriptedClusterD) -> None:
    for _ in range(50_000):  # more clean ends than even an unthrottled client gets through here
        clusterd.script(End())
    agent = SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", dry_run=True)
    agent.start()
    try:
        # The first ends after a quiet while are reopened at once: that is what ClusterD needs.
        assert clusterd.wait_for(lambda s: s.opens >= 6, 10), f"only {clusterd.opens} opens"
        before = clusterd.opens
        threading.Event().wait(WINDOW_S)  # a measuring window, not a synchronisation
        opened = clusterd.opens - before
        assert opened <= MOST_OPENS_PER_WINDOW, (
            f"{opened} opens in {WINDOW_S} s against a server that ends every stream at once: the reopen "
            "is not throttled")
        # Still subscribing: the first stream that stays open gets the next list, which is answered.
        # (One call: a stream opened between a clear and an append once held unscripted; CI saw it.)
        clusterd.script_only(Send(rank_list(["0"], [True])), Hold())
        replies = clusterd.wait_replies(1, timeout=20)
        assert replies[0].result is True
    finally:
        agent.stop()


def test_the_wait_grows_while_the_server_keeps_ending_streams_at_once(clusterd: ScriptedClusterD) -> None:
    """Once throttled, each further stream that ends at once doubles the wait, up to
    reconnect_max_s (here 0.05 s growing to 0.4 s, each drawn from [d/2, d]): in 3 s at most
    about 4 + 3 / 0.2 = 19 opens. A wait that starts again from reconnect_initial_s after every
    end keeps reopening every 25-50 ms: 60 or more in the same window."""
    for _ in range(50_000):
        clusterd.script(End())
    agent = SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", dry_run=True,
                        reconnect_initial_s=0.05, reconnect_max_s=0.4)
    agent.start()
    try:
        assert clusterd.wait_for(lambda s: s.opens >= 6, 10), f"only {clusterd.opens} opens"
        before = clusterd.opens
        threading.Event().wait(3.0)  # a measuring window, not a synchronisation
        opened = clusterd.opens - before
        assert opened <= 30, f"{opened} opens in 3 s: the wait does not grow while streams keep ending at once"
    finally:
        agent.stop()


class EndsEveryProcessManageStream:
    """Init and Register succeed; every SubscribeProcessManageSignal ends at once, cleanly."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.opens = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(8, thread_name_prefix="ends-at-once"))
        self.server.add_generic_rpc_handlers((transport.generic_handler({
            "Init": lambda request, context: pb.Status(code=0, info="init"),
            "Register": lambda request, context: pb.Status(code=0, info="register"),
            "SubscribeProcessManageSignal": self._subscribe,
        }),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _subscribe(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.ProcessManageSignal]:
        with self._cond:
            self.opens += 1
            self._cond.notify_all()
        yield from ()

    def wait_opens(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.opens >= count, timeout)


def test_a_process_manage_stream_that_ends_at_once_is_not_reopened_in_a_loop() -> None:
    server = EndsEveryProcessManageStream()
    channel = open_channel(ChannelSettings(target=server.address))
    client = ProcessManageClient(RecoverStub(channel), ProcessManageSettings(
        job_id="j", role="r", conflict_resets=1_000_000), lambda signal: None)
    try:
        client.start()
        assert server.wait_opens(2, 10), f"only {server.opens} opens"
        before = server.opens
        threading.Event().wait(PM_WINDOW_S)  # a measuring window, not a synchronisation
        opened = server.opens - before
        # Throttled, the waits after the second open are >= 0.2, 0.4, 0.8, 1.6 s: at most 4 opens
        # in the window. Without the throttle only the gate's 10 ms settle paces it: ~90 a second.
        assert opened <= PM_MOST_OPENS, (
            f"{opened} opens in {PM_WINDOW_S} s of a stream that ends at once: the reopen is not throttled")
        assert client.running and not client.conflict
    finally:
        client.stop()
        channel.close()
        server.server.stop(0).wait()
