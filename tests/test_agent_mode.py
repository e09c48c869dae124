"""Pause mode agent, end to end in one process against the simulator (no other client).

The agent is ClusterD's process-manage client: it parks the training thread at a step boundary,
runs the guard and the switch there, replies, and lets training go on; after a failed switch it
walks ClusterD's recovery path (stop_train, globalFault, strategy) truthfully.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import Trainer

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(60)

JOB = "job-am"
NODES = {"node-0": ["0", "1"], "node-1": ["0", "1"]}
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)


class Operator:
    """SwitchNicTrack + SubscribeSwitchNicSignal, like `nicswitch-agent switch`."""

    def __init__(self, address: str) -> None:
        self.channel = open_channel(ChannelSettings(target=address))
        self.stub = RecoverStub(self.channel)

    def switch(self, node: str, devs: list[str], ops: list[bool], timeout: float = 30) -> str:
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps[node].dev.extend(devs)
        request.nicOps[node].op.extend(ops)
        status = self.stub.SwitchNicTrack(request, timeout=5)
        assert status.code == 0, status
        for response in self.stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=timeout):
            return str(response.msg)
        return "(no message)"

    def close(self) -> None:
        self.channel.close()


streams_ready = functools.partial(support.streams_ready, job=JOB)


@pytest.fixture
def harness() -> Iterator[Any]:
    sims: list[Simulator] = []
    agents: list[SwitchAgent] = []
    trainers: list[Trainer] = []
    operators: list[Operator] = []

    class H:
        def sim(self, job: SimJob | None = None, port: int = 0) -> Simulator:
            sim = Simulator(jobs=[job or SimJob(job_id=JOB, nodes=NODES)], settings=FAST, port=port)
            sim.start()
            sims.append(sim)
            return sim

        def agent(self, sim: Simulator, **kwargs: Any) -> SwitchAgent:
            kwargs.setdefault("reconnect_initial_s", 0.02)
            kwargs.setdefault("reconnect_max_s", 0.1)
            agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", **kwargs).start()
            agents.append(agent)
            return agent

        def trainer(self, agent: SwitchAgent, **kwargs: Any) -> Trainer:
            trainer = Trainer(agent, **kwargs).start()
            trainers.append(trainer)
            return trainer

        def operator(self, sim: Simulator) -> Operator:
            op = Operator(sim.address)
            operators.append(op)
            return op

    yield H()
    for op in operators:
        op.close()
    for trainer in trainers:
        trainer.stop()
    for agent in agents:
        agent.stop()
    for sim in sims:
        sim.stop()


class SwitchRecorder:
    def __init__(self, results: list[Any] | None = None) -> None:
        self.calls: list[tuple[str, tuple[int, ...], tuple[bool, ...]]] = []
        self.results = list(results or [])

    def __call__(self, order: SwitchOrder) -> Any:
        self.calls.append((threading.current_thread().name, order.ranks, order.ops))
        return self.results.pop(0) if self.results else True


def test_failover_and_switchback_twice_parked_at_a_step_boundary(harness: Any) -> None:
    sim = harness.sim()
    hook = SwitchRecorder()
    guard_steps: list[int | None] = []
    agent = harness.agent(sim, switch_hook=hook, checkpoint_hook=lambda order: guard_steps.append(agent.last_step))
    trainer = harness.trainer(agent)
    op = harness.operator(sim)
    for round_ in range(2):
        assert sim.wait_until(streams_ready, 10)
        assert trainer.wait_step(trainer.step + 5)
        assert op.switch("node-0", ["0"], [True]) == "switch nic finish"
        assert sim.wait_until(streams_ready, 10)
        assert op.switch("node-0", ["0"], [False]) == "switch nic finish"
        assert trainer.wait_step(trainer.step + 5), f"training did not resume after round {round_}"
    view = sim.job_view(JOB)
    assert view.replies == [True, True, True, True]
    assert view.violations == []
    assert [c[0] for c in hook.calls] == ["trainer"] * 4  # guard and switch ran on the parked training thread
    assert [(c[1], c[2]) for c in hook.calls] == [((0,), (True,)), ((0,), (False,))] * 2
    assert len(guard_steps) == 4 and all(s is not None for s in guard_steps)
    assert trainer.error is None
    assert agent.status()["pause"] == "agent"
    assert view.stream_opens["SubscribeProcessManageSignal"] >= 5
    assert view.open_streams.get("SubscribeNotifySwitch", 0) <= 1  # never a second subscriber


def test_failed_switch_walks_recovery_to_dump_and_stops_training(harness: Any, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="nicswitch_agent")
    sim = harness.sim(SimJob(job_id=JOB, nodes=NODES, recover_strategies=("dump",)))
    stops: list[str] = []
    checkpoints: list[int] = []
    hook = SwitchRecorder(results=[False, True])  # the switch fails; the rollback works
    agent = harness.agent(sim, switch_hook=hook, checkpoint_hook=lambda o: checkpoints.append(o.seq),
                          on_stop=stops.append)
    trainer = harness.trainer(agent)
    op = harness.operator(sim)
    assert sim.wait_until(streams_ready, 10)
    assert op.switch("node-0", ["0"], [True]) == "switch nic failed, switch nic failed"
    assert trainer.done.wait(20), "training was not stopped"
    assert isinstance(trainer.error, TrainingStopped)
    assert stops == ["ClusterD chose dump after a failed switch"]
    assert "offering recovery strategies ['retry', 'recover', 'dump', 'exit']" in caplog.text
    assert checkpoints == [1]  # the guard's pre-switch checkpoint counts for dump: no second one
    assert [c[2] for c in hook.calls] == [(True,), (False,)]  # the switch, then its rollback
    view = sim.job_view(JOB)
    picks = [s.changeStrategy for s in view.signals_sent if s.signalType == "changeStrategy"]
    assert picks[0] == "dump"
    assert view.replies == [False]
    assert sim.wait_until(lambda s: s.job_view(JOB).state == "INIT", 10)


def test_failed_switch_with_successful_rollback_recovers_and_training_goes_on(harness: Any) -> None:
    sim = harness.sim(SimJob(job_id=JOB, nodes=NODES, recover_strategies=("recover", "dump")))
    stops: list[str] = []
    hook = SwitchRecorder(results=[False, True, True])  # fails, rolls back, then a later switch works
    agent = harness.agent(sim, switch_hook=hook, on_stop=stops.append)
    trainer = harness.trainer(agent)
    op = harness.operator(sim)
    assert sim.wait_until(streams_ready, 10)
    assert op.switch("node-0", ["0"], [True]) == "switch nic failed, switch nic failed"
    assert sim.wait_until(lambda s: s.job_view(JOB).state == "INIT" and streams_ready(s), 10)
    assert trainer.wait_step(trainer.step + 5), "training did not resume after recover"
    assert stops == [] and trainer.error is None
    picks = [s.changeStrategy for s in sim.job_view(JOB).signals_sent if s.signalType == "changeStrategy"]
    assert picks == ["recover"]
    assert op.switch("node-0", ["0"], [True]) == "switch nic finish"
    assert [c[2] for c in hook.calls] == [(True,), (False,), (True,)]
    assert sim.job_view(JOB).violations == []


def test_failed_switch_and_failed_rollback_offers_only_exit(harness: Any, caplog: Any, tmp_path: Path) -> None:
    from nicswitch_agent.observability.status_file import ExitCode, read_status

    caplog.set_level(logging.INFO, logger="nicswitch_agent")
    sim = harness.sim(SimJob(job_id=JOB, nodes=NODES, recover_strategies=("recover", "dump")))
    stops: list[str] = []
    status_file = tmp_path / "status.json"
    agent = harness.agent(sim, switch_hook=SwitchRecorder(results=[False, False]), on_stop=stops.append,
                          status_file=str(status_file), status_interval_s=0.2)
    trainer = harness.trainer(agent)
    op = harness.operator(sim)
    assert sim.wait_until(streams_ready, 10)
    assert support.wait_until(lambda: read_status(status_file).exit_code is ExitCode.OK, 20), read_status(status_file)
    assert op.switch("node-0", ["0"], [True]) == "switch nic failed, switch nic failed"
    assert trainer.done.wait(20)
    assert isinstance(trainer.error, TrainingStopped)
    assert "offering recovery strategies ['exit']" in caplog.text
    assert stops == ["ClusterD chose exit after a failed switch"]
    # The agent still runs (the script has not stopped it): status must not say all is well (an
    # outside check saw "verdict OK" here).
    assert agent.status()["training_stopped"] == "ClusterD chose exit after a failed switch"
    stuck = support.wait_until(lambda: read_status(status_file).exit_code is ExitCode.STUCK, 20)
    assert stuck, read_status(status_file)
    assert read_status(status_file).problem.startswith("training was told to stop (ClusterD chose exit")


def test_pause_not_reached_in_time_reports_499_and_never_parks_training(harness: Any) -> None:
    sim = harness.sim()
    stall = threading.Event()
    stops: list[str] = []
    hook = SwitchRecorder()
    failed_pauses: list[Any] = []
    agent = harness.agent(sim, switch_hook=hook, pause_timeout_s=0.3, on_stop=stops.append,
                          on_event=lambda e: failed_pauses.append(e) if e.kind == "pause_failed" else None)
    trainer = harness.trainer(agent, stall=stall)
    op = harness.operator(sim)
    assert sim.wait_until(streams_ready, 10)
    assert trainer.wait_step(3)
    stall.set()  # a step that does not end before the pause timeout
    request = pb.SwitchNics(jobID=JOB)
    request.nicOps["node-1"].dev.append("0")
    request.nicOps["node-1"].op.append(True)
    assert op.stub.SwitchNicTrack(request, timeout=5).code == 0
    # ClusterD answers a failed pause (499) by killing the job.
    assert sim.wait_until(lambda s: any(sig.signalType == "killMaster" for sig in s.job_view(JOB).signals_sent), 10)
    assert "om failed, pause train failed" in sim.job_view(JOB).om_messages
    stall.clear()
    assert trainer.done.wait(10)
    assert isinstance(trainer.error, TrainingStopped)  # not parked: told to stop, since the job is killed
    assert not agent.status()["parked"]
    assert hook.calls == []
    assert stops and "killMaster" in stops[0]
    # The timeline's word for it (a failed pause has no rank list, so no switch of its own)
    assert [(e.seq, "did not park" in e.detail["reason"], e.detail["duration_s"] > 0) for e in failed_pauses] \
        == [(None, True, True)], failed_pauses


def test_streams_reopen_in_order_after_a_simulator_restart(harness: Any) -> None:
    sim = harness.sim()
    port = int(sim.address.rsplit(":", 1)[1])
    hook = SwitchRecorder()
    agent = harness.agent(sim, switch_hook=hook)
    trainer = harness.trainer(agent)
    assert sim.wait_until(streams_ready, 10)
    sim.stop()
    restarted = harness.sim(port=port)  # a new ClusterD: it knows nothing about the job
    assert restarted.wait_until(streams_ready, 20)
    view = restarted.job_view(JOB)
    assert view.registered and view.violations == []
    op = harness.operator(restarted)
    assert op.switch("node-0", ["0"], [True]) == "switch nic finish"
    assert [c[1:] for c in hook.calls] == [((0,), (True,))]
    assert trainer.wait_step(trainer.step + 3)
    assert agent.status()["process_manage"]["registered"]


def test_health_check_reaches_clusterd(harness: Any) -> None:
    sim = harness.sim()
    agent = harness.agent(sim, switch_hook=SwitchRecorder())
    result = agent.health_check()
    assert result["code"] == 0 and result["info"] == f"jobId={JOB}, receive HeathCheck"


def test_registration_refused_is_reported_not_retried(harness: Any, caplog: Any) -> None:
    sim = harness.sim()
    failed = threading.Event()
    agent = SwitchAgent(server=sim.address, job_id="no-such-job", pause="agent", switch_hook=SwitchRecorder(),
                        on_event=lambda e: e.kind == "agent_failed" and failed.set()).start()
    try:
        assert failed.wait(10)
        assert agent.status()["state"] == "failed"
        assert "ClusterD refused Init" in caplog.text
    finally:
        agent.stop()


def test_unknown_signal_is_logged_and_changes_nothing() -> None:
    from nicswitch_agent.clusterd.signal_flow import AgentModeController, HookSettings
    from nicswitch_agent.coordination import KV, Coordinator, InProcessStore

    store = InProcessStore()
    coordinator = Coordinator(KV(store, "t"), 1)
    controller = AgentModeController(coordinator, HookSettings(False, 1, 1, 1, False), on_stop=lambda r: None)
    controller._client = object()  # type: ignore[assignment]  # any report call would raise
    controller._handle(pb.ProcessManageSignal(uuid="u", jobId=JOB, signalType="somethingNew", actions=["x"]), 1)
    assert not coordinator.paused and store.keys() == []  # nothing was published
    assert "somethingNew" in controller.last_signal



def test_a_switch_clusterd_gave_up_on_is_rolled_back_and_gets_no_reply(harness: Any) -> None:
    """An outside check (simulator with a short report timeout, a switch hook slower than it):
    ClusterD gave up waiting and started its recovery while the switch still ran; the agent offered
    retry as if no link had moved, then sent its late "true" (taken by ClusterD as the next switch's
    result), and training went on with rank 0 on standby though ClusterD counted the switch failed.
    Now the switch ClusterD gave up on counts as failed: rolled back before the strategies are
    offered, and no reply."""
    sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES, recover_strategies=("retry", "recover", "dump"))],
                    settings=dataclasses.replace(FAST, report_timeout_s=1.0))
    sim.start()
    calls: list[tuple[bool, ...]] = []

    def slow_switch(order: SwitchOrder) -> bool:
        calls.append(order.ops)
        if len(calls) == 1:  # the switch: still running when ClusterD's recovery reaches globalFault
            assert sim.wait_until(lambda s: any(g.signalType == "globalFault" for g in s.job_view(JOB).signals_sent),
                                  30)
        return True

    try:
        agent = harness.agent(sim, switch_hook=slow_switch)
        trainer = harness.trainer(agent)
        op = harness.operator(sim)
        assert sim.wait_until(streams_ready, 10)
        assert op.switch("node-0", ["0"], [True]) != "switch nic finish"
        assert sim.wait_until(lambda s: any(g.signalType == "changeStrategy" for g in s.job_view(JOB).signals_sent), 20)
        picks = [g.changeStrategy for g in sim.job_view(JOB).signals_sent if g.signalType == "changeStrategy"]
        assert picks == ["retry"]
        assert trainer.wait_step(trainer.step + 5), "training did not resume"
        assert calls == [(True,), (False,)]  # switched, then rolled back
        view = sim.job_view(JOB)
        assert view.replies == [] and view.violations == [], (view.replies, view.violations)
        assert agent.status()["links"]["standby"] == 0
        assert "ClusterD gave up waiting for it" in str(agent.status()["last_switch"]), agent.status()["last_switch"]
    finally:
        sim.stop()
