"""An idle, connected leader sleeps (issue 21, item 3), and ``connected`` still follows ClusterD.

- No connectivity subscription while the channel is READY: one keeps gRPC's polling thread waking
  every 200 ms. When the server goes away and comes back, ``connected`` turns false, then true
  again, and the watch holds no subscription once it is (pause mode agent, where the
  process-manage stream reconnects first, and external, where the notify stream waits for the
  connection on its own: there the watch subscribes while it waits, or READY would go unheard).
- The stream threads wait in gRPC core: over an idle window the notify and process-manage threads
  make no Python call at all (grpcio's default stream reads wake every 100 ms in Python), and
  ``stop()`` still ends both at once (its cancel ends a read blocked in gRPC core).

Mechanisms are counted (subscriptions held, Python calls per thread), never timed: CPU numbers
belong to ``python -m benchmarks --only idle``. The idle window is an observation that ends as soon
as a call is seen, as in test_edges_status.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from support import free_port, wait_until

from nicswitch_agent import SwitchAgent
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(60)

JOB = "job-idle"
NODES = {"node-0": ["0", "1"]}
# No keep-alive signal during a test: the process-manage stream would wake for it (and should).
QUIET = SimSettings(shuffle_nodes=False, keepalive_interval_s=3600.0)
IDLE_WINDOW_S = 1.0  # grpcio's default reads wake 10 times in it, on each stream thread


@pytest.fixture
def sims() -> Iterator[list[Simulator]]:
    started: list[Simulator] = []
    yield started
    for sim in started:
        sim.stop()


def serve(sims: list[Simulator], port: int, *, standin: bool) -> Simulator:
    sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=QUIET, port=port, standin=standin)
    sim.start()
    sims.append(sim)
    return sim


def connected(agent: SwitchAgent) -> bool:
    return bool(agent.status()["connected"])


def poller_running(channel: Any) -> bool:
    """gRPC's connectivity polling thread runs (grpcio's own flag; it ends within 0.2 s of the
    last unsubscribe)."""
    return bool(getattr(channel._connectivity_state, "polling", False))


@pytest.mark.parametrize("pause", ["agent", "external"])
def test_a_connected_leader_holds_no_connectivity_subscription_across_a_server_restart(
        sims: list[Simulator], pause: str) -> None:
    port = free_port()
    standin = pause == "external"  # someone else registers the job and holds its process-manage stream
    first = serve(sims, port, standin=standin)
    agent = SwitchAgent(server=first.address, job_id=JOB, pause=pause, switch_hook=lambda order: True,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1).start()
    try:
        session = agent._session
        assert session is not None
        watch, channel = session.watch, session.channel
        assert wait_until(lambda: connected(agent), 20), agent.status()
        assert not watch.subscribed, "connected, yet the watch still holds a connectivity subscription"
        assert wait_until(lambda: not poller_running(channel), 5), "gRPC's connectivity poller still runs"
        held = watch.subscriptions

        first.stop()  # the server goes away: the streams break
        assert wait_until(lambda: not connected(agent), 10), agent.status()
        if pause == "external":
            # The notify stream, reopened, waits for the connection: it must hear READY, so the
            # watch subscribes. (In pause mode agent it opens only once the process-manage stream
            # is back, on a READY channel, and may never need to.)
            assert wait_until(lambda: watch.subscribed, 10), "the stream waits for READY, unheard"
            assert watch.subscriptions > held
        serve(sims, port, standin=standin)  # and comes back on the same address
        assert wait_until(lambda: connected(agent), 20), agent.status()
        assert not watch.subscribed, "connected again, yet the watch still holds a connectivity subscription"
        assert wait_until(lambda: not poller_running(channel), 5), "gRPC's connectivity poller still runs"
    finally:
        agent.stop("test done")


def test_idle_stream_threads_run_no_python_and_stop_at_once(sims: list[Simulator]) -> None:
    sim = serve(sims, 0, standin=False)  # started before profiling: its threads are not counted
    counting = False
    calls: Counter[int] = Counter()  # Python calls, C calls and returns, by thread id

    def profile(frame: Any, event: str, arg: Any) -> None:
        if counting:
            calls[threading.get_ident()] += 1

    threading.setprofile(profile)  # every thread started from now on: the agent's and gRPC's
    try:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True).start()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]  # threads already started keep it
    try:
        session = agent._session
        assert session is not None and session.subscriber is not None and session.process_manage is not None
        streams = {"nicswitch-notify": session.subscriber, "nicswitch-process-manage": session.process_manage}
        assert wait_until(lambda: connected(agent) and session.process_manage.stream_open, 20), agent.status()
        idents = {name: client._thread.ident for name, client in streams.items() if client._thread is not None}
        assert len(idents) == 2
        counting = True
        woke = wait_until(lambda: any(calls[ident] for ident in idents.values()), IDLE_WINDOW_S)
        counting = False
        assert not woke, {name: calls[ident] for name, ident in idents.items()}
        assert connected(agent), agent.status()  # idle, not broken
    finally:
        agent.stop("test done")
    # A read blocked in gRPC core ends when stop() cancels its call: both threads ended within
    # stop_timeout_s (stop() joins them for that long, and warns if one lives on).
    alive = [name for name, client in streams.items() if client.running]
    assert alive == [], f"still reading after stop(): {alive}"
