"""After a failed switch whose rollback worked: what the agent offers, what ClusterD picks under
each ``recover-strategy`` annotation, and whether training goes on
(docs/protocol.md#5-after-a-failed-switch-mode-agent).

ClusterD tries ``retry`` first whenever the annotation lists it, and if the agent did not offer
it, skips ``recover`` too (docs/clusterd.md#failed-switch-and-fault-recovery). The parked step
was never lost, so the agent offers ``retry`` exactly when it offers ``recover`` and honours both
the same way: training goes on under every annotation that lists either, and the next switch works.

Real pieces: the agent (pause mode ``agent``) against the simulator, in this process with a
training thread; and once with real torch processes (tests/test_torch_multiprocess.py's job).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import Trainer, operator_switch

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(60)

JOB = "job-strategies"
NODES = {"node-0": ["0", "1"]}
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
FINISH = "switch nic finish"
FAILED = "switch nic failed, switch nic failed"
OFFERED_AFTER_ROLLBACK = "offering recovery strategies ['retry', 'recover', 'dump', 'exit']"

idle = functools.partial(support.idle, job=JOB)

# (annotation, ClusterD's pick from what the agent offers after a rollback that worked, training goes on)
ANNOTATIONS = [
    (("retry", "recover", "dump"), "retry", True),  # the simulator's default, and a common one
    (("recover", "dump"), "recover", True),
    (("dump",), "dump", False),  # neither retry nor recover allowed: ClusterD's dump stops the job
    (("retry",), "retry", True),
]


def picks(sim: Simulator, job: str = JOB) -> list[str]:
    """ClusterD's strategy choices (``changeStrategy`` without the informational dump_exit ones)."""
    return [s.changeStrategy for s in sim.job_view(job).signals_sent
            if s.signalType == "changeStrategy" and not s.extraParams and s.changeStrategy != "continue"]


class FailsOnce:
    """A switch hook that fails its first call (the switch) and works after (the rollback, then
    later switches). A later switch answers only once the operator's result stream is open: one
    that works ends within milliseconds, and ClusterD keeps no result for an operator who
    subscribes after it ended (CI saw "not switching nic" under load)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.calls: list[tuple[bool, ...]] = []

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls.append(order.ops)
        if len(self.calls) > 2:
            self.sim.wait_until(lambda s: s.job_view(JOB).open_streams.get("SubscribeSwitchNicSignal", 0) >= 1, 10)
        return len(self.calls) > 1


@pytest.fixture
def simulator(request: pytest.FixtureRequest) -> Iterator[Simulator]:
    sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES, recover_strategies=request.param)], settings=FAST)
    sim.start()
    yield sim
    sim.stop()


@pytest.mark.parametrize(("simulator", "pick", "goes_on"), ANNOTATIONS, indirect=["simulator"],
                         ids=[",".join(a[0]) for a in ANNOTATIONS])
def test_a_rolled_back_failed_switch_under_each_annotation(simulator: Simulator, pick: str, goes_on: bool,
                                                           caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="nicswitch_agent")
    sim, stops = simulator, []
    hook = FailsOnce(sim)
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=hook,
                        checkpoint_hook=lambda order: None, on_stop=stops.append,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1).start()
    trainer = Trainer(agent).start()
    try:
        assert sim.wait_until(idle, 10)
        assert trainer.wait_step(3)
        assert operator_switch(sim.address, JOB, ["0"], [True]) == FAILED
        assert sim.wait_until(lambda s: picks(s) != [], 10)
        assert picks(sim) == [pick]
        assert OFFERED_AFTER_ROLLBACK in caplog.text  # logged before ReportRecoverStrategy was sent
        if goes_on:
            # ReportRecoverStatus(0, pick) took ClusterD back to INIT at once; every stream ended
            # and the agent opened them again.
            assert sim.wait_until(idle, 10), sim.job_view(JOB).state
            assert trainer.wait_step(trainer.step + 5), f"training did not go on after {pick}"
            assert stops == [] and trainer.error is None
            failed_flow = sim.job_view(JOB).path_history[-1]
            assert failed_flow[-2:] == ["CheckRecoverResultState(recoverSuccess)", "INIT"], failed_flow
            assert operator_switch(sim.address, JOB, ["0"], [True]) == FINISH  # the next switch works
            assert sim.job_view(JOB).replies == [False, True]
            assert hook.calls == [(True,), (False,), (True,)]  # switch, its rollback, the next switch
        else:
            assert trainer.done.wait(20), "training was not stopped"
            assert isinstance(trainer.error, TrainingStopped)
            assert stops == [f"ClusterD chose {pick} after a failed switch"]
            assert sim.wait_until(lambda s: s.job_view(JOB).state == "INIT", 10)  # ClusterD's own recovery ends
            assert sim.job_view(JOB).replies == [False]
            # The stopped agent's status says why (found by an outside check: it said "stop() called")
            agent.stop()
            assert agent.status()["reason"] == (f"training must stop: ClusterD chose {pick} after a failed switch "
                                                "(stop() called)"), agent.status()["reason"]
        assert sim.job_view(JOB).violations == []
        # what was offered and what ClusterD chose, on the failed switch (the timeline draws them)
        assert [(e.seq, e.detail) for e in agent.events() if e.kind == "recovery"] == [
            (1, {"signal": "globalFault", "offered": ["retry", "recover", "dump", "exit"], "chosen": None}),
            (1, {"signal": "changeStrategy", "offered": None, "chosen": pick})]
    finally:
        trainer.stop()
        agent.stop()


# -- the same with real torch processes ----------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("strategies", "pick", "goes_on"), [ANNOTATIONS[0], ANNOTATIONS[2]],
                         ids=[",".join(ANNOTATIONS[0][0]), ",".join(ANNOTATIONS[2][0])])
def test_torch_job_after_a_rolled_back_failed_switch(tmp_path: Path, strategies: tuple[str, ...], pick: str,
                                                     goes_on: bool) -> None:
    """Two torch processes (gloo, the job's TCPStore); rank 1's hook fails the switch once, the
    rollback works on both ranks. ``retry,recover,dump``: ClusterD picks retry, both ranks go on
    in lockstep and the next switch works. ``dump``: ClusterD picks dump, both ranks stop."""
    pytest.importorskip("torch")
    import test_torch_multiprocess as mp

    cluster = mp.Cluster(tmp_path)
    try:
        job = cluster.job(2, strategies=strategies, env={"NSW_FAIL_RANK": "1", "NSW_FAIL_CALLS": "1"})
        sim = cluster.sim
        job.wait_ready()
        assert cluster.op.switch("node-0", ["1"], [True])[0] == mp.FAILED
        assert sim.wait_until(lambda s: picks(s, mp.JOB) != [], 20)
        assert picks(sim, mp.JOB) == [pick]
        assert OFFERED_AFTER_ROLLBACK in job.log(0)
        assert [(c["seq"], c["ops"]) for c in job.hooks(1)] == [(1, [True]), (1, [False])]  # switch, rollback
        # Rank 0 may read the switch order only after rank 1's failure decided it: it skips it, as
        # a decided order is never run late (member.py _order_of); the rollback runs everywhere
        assert [(c["seq"], c["ops"]) for c in job.hooks(0)] in ([(1, [True]), (1, [False])], [(1, [False])])
        if goes_on:
            job.wait_steps(max(job.last_step(r) for r in (0, 1)) + 10)
            assert cluster.op.switch("node-0", ["1"], [True])[0] == mp.FINISH
            assert sim.job_view(mp.JOB).replies == [False, True]
            job.wait_steps(max(job.last_step(r) for r in (0, 1)) + 10)
            assert job.stop() == [mp.EXIT_DONE, mp.EXIT_DONE]
        else:
            assert job.wait_exit(30) == [mp.EXIT_STOPPED, mp.EXIT_STOPPED]
            assert all(f"ClusterD chose {pick}" in job.result(r)["reason"] for r in (0, 1)), [
                job.result(r) for r in (0, 1)]
        assert sim.job_view(mp.JOB).violations == []
        mp.check_training(job)  # no step skipped or repeated; the ranks stayed in lockstep
    finally:
        cluster.close()
