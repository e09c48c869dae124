"""A rank the job does not have is never switched (issue 18, item 6).

With world size W, a list naming a rank >= W is answered false and its hook never runs, in every
mode: one process with world_size unset (the job has one rank), ranks as threads, and a leader
hosted by the launcher (``leader_only``, the launcher passes its world size). The simulator's
rank table may have more ranks than the job (``2 -> standby`` for a one-rank job): a true reply
would tell ClusterD that a link moved when nothing did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from support import Events, operator_switch

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.observability import events as ev
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(60)

JOB = "job-world"
NODES = {"node-0": ["0", "1", "2", "3"]}  # the rank table: ranks 0-3
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    with Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=FAST, standin=True) as simulator:
        yield simulator


class Hook:
    """A switch hook that records every order it is called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls.append(order.ranks)
        return True


def refused(events: Events, caplog: pytest.LogCaptureFixture, rank: int, world: int) -> None:
    """The list was refused (false reply, a log line naming the rank and the world size)."""
    rejected = events.first(ev.LIST_REJECTED)
    reason = rejected.detail["reason"]
    assert f"rankID[0]={rank} is outside the job (world_size={world})" in reason, reason
    reply = events.first(ev.REPLY_SENT)
    assert reply.detail["result"] is False, reply
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "refused" in r.getMessage()]
    assert any(f"rankID[0]={rank} is outside the job (world_size={world})" in line for line in lines), lines


def test_one_process_with_world_size_unset_refuses_rank_2(sim: Simulator, caplog: pytest.LogCaptureFixture) -> None:
    hook, events = Hook(), Events()
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=hook, on_event=events)
    with agent:
        assert agent.world_size == 1 and agent.config.world_size is None
        outcome = operator_switch(sim.address, JOB, ["2"], [True])
        refused(events, caplog, rank=2, world=1)
    assert hook.calls == []
    assert "finish" not in outcome, outcome


def test_threads_refuse_a_rank_past_the_world(sim: Simulator, caplog: pytest.LogCaptureFixture) -> None:
    store = InProcessStore()
    hooks, events = [Hook(), Hook()], Events()
    agents = [SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=hooks[rank], store=store,
                          rank=rank, world_size=2, on_event=events if rank == 0 else None) for rank in (1, 0)]
    try:
        for agent in agents:
            agent.start()
        operator_switch(sim.address, JOB, ["3"], [True])
        refused(events, caplog, rank=3, world=2)
    finally:
        for agent in agents:
            agent.stop("test done")
    assert [hook.calls for hook in hooks] == [[], []]


def test_a_launcher_hosted_leader_refuses_a_rank_past_the_world(sim: Simulator,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """``nicswitch-agent launch`` runs the leader alone (``leader_only``) for the world size it
    computed; no member exists, so nothing could run a hook, but the reply must still be false."""
    events = Events()
    options: dict[str, Any] = {"leader_only": True, "store": InProcessStore()}
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", world_size=2, rank=0,
                        on_event=events, **options)
    with agent:
        operator_switch(sim.address, JOB, ["2"], [True])
        refused(events, caplog, rank=2, world=2)
