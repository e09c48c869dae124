"""The notify stream is reopened at once after a clean end, but never in a tight loop.

ClusterD ends the SubscribeNotifySwitch stream cleanly after every switch, so the agent reopens
at once (docs/protocol.md). A server that ends *every* stream at once (a proxy in the way, a
ClusterD in a bad state) must not get a reopen per round trip: more than ``eof_burst`` (5) clean
ends within a second with no message make the subscriber wait ``reconnect_initial_s`` (0.2 s,
jittered to 0.1-0.2 s) before each further open (subscriber.py).

The bound is a count during a fixed wait, so load can only make the test pass more easily: with
the throttle at most ~15 opens fit in a second (10 waits of >= 0.1 s, plus the few opens a
stalled box lets through at once); without it the agent reopens hundreds of times a second
(about 880/s measured on the loaded 2-core test box), two orders of magnitude above the bound.
"""

from __future__ import annotations

import threading

import pytest
from scripted import End, Hold, ScriptedClusterD, Send, rank_list

from nicswitch_agent import SwitchAgent

pytestmark = pytest.mark.timeout(60)

WINDOW_S = 1.0
MOST_OPENS_PER_WINDOW = 40  # throttled: <= ~15; unthrottled: hundreds


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
        clusterd.notify_scripts.clear()
        clusterd.script(Send(rank_list(["0"], [True])), Hold())
        replies = clusterd.wait_replies(1, timeout=20)
        assert replies[0].result is True
    finally:
        agent.stop()
