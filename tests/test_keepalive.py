"""Restarts and keepalive (issue 7 §2), with the simulator as a separate process where it matters.

- The simulator SIGKILLed and started again on the same port: the agent (pause mode agent)
  registers again, reopens process-manage then notify, and handles the next switch. The time to
  recovery is printed (``pytest -s``), never asserted.
- ClusterD's ping policy (3 s minimum, GOAWAY ``too_many_pings`` on the third strike): an idle
  agent pinging every 3 s is not cut off (that the simulator enforces the policy at all, a 1 s
  pinger cut off, is tests/sim/test_keepalive_policy.py's).
- A half-open connection (the simulator frozen with SIGSTOP): keepalive notices it, and once the
  simulator continues the agent reopens its streams and switches again.

Every wait is bounded and waits on an event or a condition (the idle test: on the pings a relay
counts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from h2watch import Connection, PingWatch
from soak import JOB, SubprocessBackend
from support import Events, Trainer, free_port, poll, streams_ready

from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.observability import events as ev
from nicswitch_agent.sim import SimJob, SimSettings, Simulator
from nicswitch_agent.sim import codes as P

NODES = {"node-0": ["0"]}  # one process: a job of rank 0 alone


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Things to stop at the end, last first: agents, trainers, simulators."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, SubprocessBackend):
            thing.close()
        elif isinstance(thing, SwitchAgent):
            thing.stop("test done")
        else:
            thing.stop()


def start_sim(port: int, cleanup: list[Any]) -> SubprocessBackend:
    backend = SubprocessBackend(port, SimJob(job_id=JOB, nodes=NODES, recover_strategies=("recover",)),
                                report_timeout_s=30.0, standin=False)
    cleanup.append(backend)
    return backend


def start_agent(address: str, cleanup: list[Any], **settings: Any) -> tuple[SwitchAgent, Events]:
    seen = Events()
    agent = SwitchAgent(server=address, job_id=JOB, pause="agent", switch_hook=lambda order: True,
                        on_event=seen, **settings)
    cleanup.append(agent.start())
    cleanup.append(Trainer(agent).start())
    return agent, seen


def switch(backend: SubprocessBackend, ops: list[bool]) -> str:
    """SwitchNicTrack; returns the action path of the flow once ClusterD is back in INIT."""
    before = len(backend.snapshot().flows)
    channel = open_channel(ChannelSettings(target=backend.address))
    try:
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps["node-0"].dev.extend(["0"])
        request.nicOps["node-0"].op.extend(ops)
        status = RecoverStub(channel).SwitchNicTrack(request, timeout=10, wait_for_ready=True)
        assert status.code == 0, status
    finally:
        channel.close()
    assert backend.wait(lambda s: len(s.flows) > before, 30), backend.tail()
    return backend.snapshot().flows[-1]


@pytest.mark.timeout(90)
def test_agent_registers_again_and_switches_after_the_simulator_is_killed_and_restarted(cleanup: list[Any]) -> None:
    port = free_port()
    sim = start_sim(port, cleanup)
    agent, _seen = start_agent(sim.address, cleanup)
    assert sim.wait(lambda s: s.ready, 30), sim.tail()
    assert "switchNicRecvContinue" in switch(sim, [True])

    killed = time.monotonic()
    sim.kill()  # SIGKILL: every stream ends with UNAVAILABLE, all of ClusterD's state is gone
    restarted = start_sim(port, cleanup)
    serving = time.monotonic()
    assert restarted.wait(lambda s: s.ready, 30), restarted.tail()
    ready = time.monotonic()
    # Init/Register first, then the process-manage stream (its reset), and only then the notify stream.
    events = restarted.events()
    assert events[:4] == ["register", "reset", P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, P.SUBSCRIBE_NOTIFY_SWITCH], events
    assert "switchNicRecvContinue" in switch(restarted, [False])
    done = time.monotonic()
    snapshot = restarted.snapshot()
    assert snapshot.violations == ()
    assert (snapshot.lists_sent, snapshot.replies) == (1, 1)
    # The operator's "continue" can reach the test before the agent's thread has left "switching".
    assert poll(lambda: agent.status()["state"] == "running", 10), agent.status()["state"]
    status = agent.status()
    assert status["process_manage"]["registered"]
    assert status["counters"]["replies_delivered"] == 2
    print(f"\nrecovery after SIGKILL: new simulator serving {(serving - killed) * 1000:.0f} ms after the kill "
          f"(process start-up); streams reopened {(ready - serving) * 1000:.0f} ms later; next switch done "
          f"{(done - serving) * 1000:.0f} ms after the restart")


# A client is cut off on its 3rd ping without data from the server in between (ClusterD's policy
# as the simulator enforces it: tests/sim/test_keepalive_policy.py shows a 1 s pinger cut off).
# Once a connection has sent one more than that with no GOAWAY, the policy did not object.
QUIET_PINGS = 4


@pytest.mark.timeout(90)
def test_idle_agent_pinging_every_3s_stays_connected_without_goaway() -> None:
    """ClusterD's minimum is 3 s, and so is the agent's smallest keepalive_time_s. The agent's
    connection goes through a relay that counts its pings: the test waits until it has sent
    QUIET_PINGS pings with nothing but ping ACKs from the simulator in between (the simulator sends
    no keep-alive signals, which would reset its ping strikes), then checks that no GOAWAY came
    and the agent never lost a stream. A simulator enforcing gRPC's 5 min default instead of 3 s,
    or an agent pinging faster than every 3 s, gets GOAWAY too_many_pings on the 3rd of them."""
    settings = SimSettings(keepalive_interval_s=3600.0)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=settings) as sim, \
            PingWatch(sim.address) as watch:
        # 2 s between attempts: a first connection slowed by a loaded machine (and the relay) is
        # retried calmly (each attempt may take connect_timeout_s).
        agent = SwitchAgent(server=watch.address, job_id=JOB, pause="agent", dry_run=True, keepalive_time_s=3.0,
                            reconnect_initial_s=2.0, reconnect_max_s=2.0)
        agent.start()
        try:
            assert sim.wait_until(lambda s: streams_ready(s, JOB), 30), sim.job_view(JOB).open_streams

            def settled(connections: list[Connection]) -> bool:
                live = [c for c in connections if c.open]
                done = bool(live) and all(c.quiet_pings >= QUIET_PINGS for c in live)
                return done or any(c.goaway for c in connections)

            # 4 pings 3 s apart after the last data: about 12 s from the start; 60 s is the bound.
            assert watch.wait(settled, 60), [(c.pings, c.quiet_pings, c.server_frames) for c in watch.connections]
            with watch.cond:
                goaways = [c.goaway for c in watch.connections if c.goaway]
                pings = [c.pings for c in watch.connections]
            status = agent.status()
            view = sim.job_view(JOB)
        finally:
            agent.stop("test done")
    print(f"\nidle agent, keepalive_time_s=3: pings per connection {pings}, GOAWAYs {goaways}")
    assert goaways == []
    assert status["stream"]["errors"] == 0 and (status["process_manage"] or {}).get("errors", 0) == 0, status
    # Never reconnected: one process-manage subscribe (each resets the job) and one notify subscribe.
    opens = view.stream_opens
    assert opens[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] == 1 and opens[P.SUBSCRIBE_NOTIFY_SWITCH] == 1, opens
    assert status["connected"] and not status["last_error"], status


@pytest.mark.timeout(90)
def test_half_open_connection_is_detected_by_keepalive_and_recovered(cleanup: list[Any]) -> None:
    port = free_port()
    sim = start_sim(port, cleanup)
    agent, seen = start_agent(sim.address, cleanup, keepalive_time_s=3.0, keepalive_timeout_s=1.0)
    assert sim.wait(lambda s: s.ready, 30), sim.tail()
    opens_before = len(sim.events())

    sim.stop_process()  # SIGSTOP: the TCP connection stays up, nothing answers
    frozen = time.monotonic()
    seen.wait(ev.STREAM_LOST, timeout=30)
    detected = time.monotonic()
    status = agent.status()  # STREAM_LOST comes after the notify stream counted its error
    assert status["stream"]["errors"] >= 1, status

    sim.continue_process()
    assert sim.wait(lambda s: s.ready and P.SUBSCRIBE_NOTIFY_SWITCH in sim.events()[opens_before:], 30), sim.tail()
    recovered = time.monotonic()
    assert "switchNicRecvContinue" in switch(sim, [True])
    assert sim.snapshot().violations == ()
    # ClusterD's flow can end before the executor thread, back from the reply's RPC, marks the switch done
    assert poll(lambda: agent.status()["state"] == "running", 10), agent.status()["state"]
    print(f"\nhalf-open: detected {(detected - frozen) * 1000:.0f} ms after SIGSTOP (keepalive_time 3 s, "
          f"keepalive_timeout 1 s); streams reopened {(recovered - detected) * 1000:.0f} ms after detection "
          f"(SIGCONT at once); the error: {status['last_error']}")

