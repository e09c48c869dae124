"""Restarts and keepalive (issue 7 §2), with the simulator as a separate process where it matters.

- The simulator SIGKILLed and started again on the same port: the agent (pause mode agent)
  registers again, reopens process-manage then notify, and handles the next switch. The time to
  recovery is printed (``pytest -s``), never asserted.
- ClusterD's ping policy (3 s minimum, GOAWAY ``too_many_pings`` on the third strike): the
  simulator enforces it (a 1 s pinger is cut off), and an idle agent pinging every 3 s is not.
- A half-open connection (the simulator frozen with SIGSTOP): keepalive notices it, and once the
  simulator continues the agent reopens its streams and switches again.

Every wait is bounded and waits on an event or a condition; the one fixed wait is the idle test's
observation window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from soak import JOB, SubprocessBackend, idle_check
from support import Events, Trainer, free_port

from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.observability import events as ev
from nicswitch_agent.sim import SimJob, SimSettings, Simulator
from nicswitch_agent.sim import codes as P

NODES = {"node-0": ["0", "1"]}


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
        request.nicOps["node-0"].dev.extend(["0", "1"])
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
    assert "switchNicRecvContinue" in switch(sim, [True, False])

    killed = time.monotonic()
    sim.kill()  # SIGKILL: every stream ends with UNAVAILABLE, all of ClusterD's state is gone
    restarted = start_sim(port, cleanup)
    serving = time.monotonic()
    assert restarted.wait(lambda s: s.ready, 30), restarted.tail()
    ready = time.monotonic()
    # Init/Register first, then the process-manage stream (its reset), and only then the notify stream.
    events = restarted.events()
    assert events[:4] == ["register", "reset", P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, P.SUBSCRIBE_NOTIFY_SWITCH], events
    assert "switchNicRecvContinue" in switch(restarted, [False, False])
    done = time.monotonic()
    snapshot = restarted.snapshot()
    assert snapshot.violations == ()
    assert (snapshot.lists_sent, snapshot.replies) == (1, 1)
    status = agent.status()
    assert status["state"] == "running" and status["process_manage"]["registered"]
    assert status["counters"]["replies_delivered"] == 2
    print(f"\nrecovery after SIGKILL: new simulator serving {(serving - killed) * 1000:.0f} ms after the kill "
          f"(process start-up); streams reopened {(ready - serving) * 1000:.0f} ms later; next switch done "
          f"{(done - serving) * 1000:.0f} ms after the restart")


@pytest.mark.timeout(30)
def test_simulator_sends_goaway_too_many_pings_to_a_client_pinging_every_second() -> None:
    """The control for the idle test below: the policy is really enforced (docs/clusterd.md#keepalive-policy)."""
    with Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=SimSettings(keepalive_interval_s=3600)) as sim:
        channel = grpc.insecure_channel(sim.address, options=[
            ("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ])
        try:
            stub = RecoverStub(channel)
            info = pb.ClientInfo(jobId=JOB, role="pinger")
            assert stub.Init(info, timeout=5).code == 0 and stub.Register(info, timeout=5).code == 0
            stream = stub.SubscribeNotifySwitch(info, timeout=20)  # open and silent: only pings on the wire
            with pytest.raises(grpc.RpcError) as failure:
                for _ in stream:
                    pass
            assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "too many pings" in (failure.value.details() or "").lower().replace("_", " ")
        finally:
            channel.close()


@pytest.mark.timeout(60)
def test_idle_agent_pinging_every_3s_stays_connected_without_goaway() -> None:
    """ClusterD's minimum: 3 s. Over 20 s the agent pings about 6 times with no data in between
    (the simulator sends no keep-alive signals, which would reset its ping strikes). 20 s, because a
    simulator enforcing gRPC's 5 min default instead of 3 s cut this agent off after 17 s."""
    report = idle_check(20.0, keepalive_time_s=3.0)
    print(f"\n{report.text()}")
    assert report.stream_errors == 0 and report.process_manage_errors == 0, report
    assert report.registrations == 1 and report.notify_opens == 1, report  # never reconnected
    assert report.connected and report.last_error == ""


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
    assert "switchNicRecvContinue" in switch(sim, [True, True])
    assert sim.snapshot().violations == ()
    assert agent.status()["state"] == "running"
    print(f"\nhalf-open: detected {(detected - frozen) * 1000:.0f} ms after SIGSTOP (keepalive_time 3 s, "
          f"keepalive_timeout 1 s); streams reopened {(recovered - detected) * 1000:.0f} ms after detection "
          f"(SIGCONT at once); the error: {status['last_error']}")

