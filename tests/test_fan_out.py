"""Groups of nodes (coordination/fan_out.py, topology.Layout): the relay one level up.

The layout every rank computes must be the same, and sensible, from the settings alone. The tree
must keep what one level keeps (tests/test_relay.py): the pause target is the largest completed
step over every rank of every node of every group, a failure is forwarded at once and names its
rank, and a silent rank is named, through both levels, before the leader gives up. The relays are
the real ones (each node's and each group's, as RankFanOut builds them); the ranks are played by
hand on their node's Store, so each test decides what every rank says and when.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import support
from test_relay import Node

from nicswitch_agent import AgentConfig
from nicswitch_agent.coordination import KIND_SWITCH, KV, Coordinator, InProcessStore
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.fan_out import RankFanOut
from nicswitch_agent.coordination.topology import Layout, choose_layout
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.orders import SwitchOrder

pytestmark = pytest.mark.timeout(60)

PREFIX = "nicswitch/job-relay/0"
ORDER = SwitchOrder(seq=1, job_id="job-relay", ranks=(2, 3), ops=(True, True))


def config(**settings: Any) -> AgentConfig:
    return AgentConfig(server="127.0.0.1:1", job_id="j", **settings)


# -- the layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "world", "expected"), [
    ({}, 8, Layout(8)),  # no LOCAL_WORLD_SIZE: flat
    ({"local_world_size": 8}, 16_384, Layout(16_384, 8, 46)),  # 2,048 nodes: groups of ceil(sqrt)
    ({"local_world_size": 16}, 16_384, Layout(16_384, 16, 32)),  # 1,024 nodes
    ({"local_world_size": 16}, 2_048, Layout(2_048, 16)),  # 128 nodes: auto keeps one level
    ({"local_world_size": 16}, 2_064, Layout(2_064, 16, 12)),  # 129 nodes
    ({"local_world_size": 16, "fan_out": "node"}, 16_384, Layout(16_384, 16)),  # node: never groups
    ({"local_world_size": 2, "fan_out": "group"}, 16, Layout(16, 2, 3)),  # 8 nodes: 3 groups of 3, 3, 2
    ({"local_world_size": 2, "fan_out": "group", "nodes_per_group": 4}, 16, Layout(16, 2, 4)),
    ({"local_world_size": 2, "fan_out": "group", "nodes_per_group": 8}, 16, Layout(16, 2)),  # one group
    ({"local_world_size": 4, "fan_out": "flat"}, 16_384, Layout(16_384)),
])
def test_the_layout_follows_the_settings(settings: dict[str, Any], world: int, expected: Layout) -> None:
    assert choose_layout(config(**settings), world) == expected


def test_a_local_world_size_that_does_not_divide_the_job_is_flat_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nicswitch_agent.coordination"):
        assert choose_layout(config(local_world_size=3), 4) == Layout(4)
    assert "local_world_size=3 does not divide world_size=4: every rank coordinates on the job's Store" in caplog.text
    with pytest.raises(ConfigError, match="fan_out='node' needs local_world_size"):
        choose_layout(config(local_world_size=3, fan_out="node"), 4)


def test_a_layout_names_who_answers_and_the_ranks_behind_each() -> None:
    layout = Layout(16, 2, 3)  # 8 nodes of 2 in groups of 3: the last group has 2 nodes
    assert (layout.nodes, layout.groups, layout.answerers, layout.unit) == (8, 3, 3, "group")
    assert [layout.ranks_of(g) for g in range(3)] == [range(0, 6), range(6, 12), range(12, 16)]
    assert [layout.nodes_of(g) for g in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]
    assert (Layout(16, 2).answerers, Layout(16, 2).unit, Layout(16).answerers, Layout(16).unit) == \
        (8, "node", 16, "rank")


def test_groups_need_the_ranks_per_node() -> None:
    with pytest.raises(ConfigError, match=r"fan_out='group' needs local_world_size \(LOCAL_WORLD_SIZE\) dividing "
                                          r"world_size=16; got local_world_size=None"):
        choose_layout(config(fan_out="group"), 16)


# -- the relays, two levels -----------------------------------------------------------------------

# 4 nodes of 2 ranks in 2 groups of 2 nodes: the leader sees groups 0 and 1.
LAYOUT = Layout(8, 2, 2)


class Tree:
    """The job's Store, the leader, each rank's RankFanOut (ranks 0, 2, 4, 6 relay for their node;
    0 and 4 also for their group), and the nodes' Stores, where the test plays the ranks."""

    def __init__(self) -> None:
        self.store = InProcessStore()
        self.fan_outs = [RankFanOut(KV(self.store, PREFIX), LAYOUT, rank, node_store_timeout_s=10,
                                    stop_timeout_s=2) for rank in range(8)]
        # Each node's Store as its ranks see it (the relays are the fan-outs').
        self.nodes = [Node.played_on(self.fan_outs[2 * node].member_kv, [2 * node, 2 * node + 1])
                      for node in range(LAYOUT.nodes)]
        for fan_out in self.fan_outs:
            fan_out.start()
        self.leader = Coordinator(KV(self.store, PREFIX), LAYOUT.answerers, layout=LAYOUT)

    def stop(self) -> None:
        for fan_out in self.fan_outs:
            fan_out.stop()


@pytest.fixture
def tree() -> Iterator[tuple[Tree, ThreadPoolExecutor]]:
    built = Tree()
    pool = ThreadPoolExecutor(2)
    yield built, pool
    pool.shutdown(wait=False, cancel_futures=True)
    built.stop()


def test_the_fan_out_runs_a_group_relay_on_each_groups_first_rank_and_a_node_relay_on_each_nodes(
        tree: tuple[Tree, ThreadPoolExecutor]) -> None:
    fan_outs = tree[0].fan_outs
    assert [f.group_relay is not None for f in fan_outs] == [True, False, False, False, True, False, False, False]
    assert [f.node_relay is not None for f in fan_outs] == [True, False] * 4
    assert [f.node_relay.node for f in fan_outs if f.node_relay] == [0, 1, 0, 1]  # its index in its group
    assert [f.slot for f in fan_outs] == [0, 1] * 4


def test_the_target_is_the_largest_completed_step_over_every_rank_of_every_group(
        tree: tuple[Tree, ThreadPoolExecutor]) -> None:
    job, pool = tree
    pausing: Future[Any] = pool.submit(job.leader.pause, 30.0)
    steps = {0: 40, 1: 41, 2: 39, 3: 40, 4: 40, 5: 39, 6: 47, 7: 40}  # rank 6: last group's last node
    epoch = 0
    for node in job.nodes:
        for slot, rank in enumerate(node.ranks):
            event = node.next_event(slot)
            assert event["t"] == p.PAUSE and event["timeout"] < 30.0  # each level's share is shorter
            epoch = int(event["e"])
            node.completed(slot, epoch, steps[rank])
    for node in job.nodes:
        for slot in range(2):
            target = node.next_event(slot)
            assert target["t"] == p.TARGET and target["S"] == 48
            node.parked(slot, epoch, 48)
    outcome = pausing.result(20)
    assert outcome.ok and outcome.step == 48


def test_a_failure_deep_in_a_group_is_forwarded_at_once_and_names_its_rank(
        tree: tuple[Tree, ThreadPoolExecutor]) -> None:
    job, pool = tree
    running: Future[Any] = pool.submit(job.leader.run, ORDER, kind=KIND_SWITCH, budget_s=300.0)
    events = [[node.next_event(slot) for slot in range(2)] for node in job.nodes]
    assert all(e["t"] == p.ORDER and e["slack"] == 0.25 for pair in events for e in pair)  # 2 s, halved twice
    job.nodes[3].result(0, events[3][0], False, "switch hook returned False")  # rank 6; nobody else answers
    outcome = running.result(20)  # long before the 300 s budget
    assert not outcome.ok and outcome.reason == "rank 6: switch hook returned False"


def test_a_group_succeeds_only_once_every_rank_of_every_node_of_it_succeeded(
        tree: tuple[Tree, ThreadPoolExecutor]) -> None:
    job, pool = tree
    running: Future[Any] = pool.submit(job.leader.run, ORDER, kind=KIND_SWITCH, budget_s=300.0)
    events = [[node.next_event(slot) for slot in range(2)] for node in job.nodes]
    for node, pair in list(zip(job.nodes, events, strict=True))[:3]:
        for slot in range(2):
            node.result(slot, pair[slot], True)
    job.nodes[3].result(0, events[3][0], True)  # rank 6 yes, rank 7 not yet: group 1 says nothing
    epoch, name = int(events[0][0]["e"]), str(events[0][0]["key"])
    job_kv = KV(job.store, PREFIX)
    assert support.wait_until(lambda: job_kv.count(p.result_counter_key(epoch, name)) >= 1, 10)
    assert job_kv.count(p.result_counter_key(epoch, name)) == 1  # group 0, once for its 4 ranks
    assert not running.done()
    job.nodes[3].result(1, events[3][1], True)
    outcome = running.result(20)
    assert outcome.ok and outcome.guard_ok


def test_a_silent_rank_is_named_through_both_levels_before_the_leader_gives_up(
        tree: tuple[Tree, ThreadPoolExecutor]) -> None:
    """Each relay passes on a shorter time than it got, so the node relay says why (rank 5 was
    silent) before its group relay stops waiting, and the group relay before the leader does."""
    job, pool = tree
    pausing: Future[Any] = pool.submit(job.leader.pause, 3.0)
    for node in job.nodes:
        for slot, rank in enumerate(node.ranks):
            event = node.next_event(slot)
            if rank != 5:
                node.completed(slot, int(event["e"]), 10)
    outcome = pausing.result(20)
    assert not outcome.ok
    assert outcome.reason == ("group 1: no answer to the pause from node(s) 2 (ranks 4-5) "
                              "(node 2 (ranks 4-5): no answer to the pause from rank(s) 5)")


def test_a_new_in_process_job_never_finds_a_dead_jobs_node_or_group_store() -> None:
    """The in-process node and group Stores are found by the job's Store object. Keyed by its id(),
    a new job's Store that got a dead one's id found the dead job's queue (seen in CI: a test read
    the previous test's pause where it expected an order)."""
    from nicswitch_agent.coordination import topology

    old = InProcessStore()
    old_id = id(old)
    topology.node_kv(KV(old, PREFIX), 0, 0, 1.0)[0].set("q/0/1", "from the dead job")
    topology.group_kv(KV(old, PREFIX), 0, 2, hosts=True, timeout_s=1.0)[0].set("q/0/1", "from the dead job")
    del old
    new = InProcessStore()
    for _ in range(1000):  # CPython hands a freed object's address to a new one of the same size
        if id(new) == old_id:
            break
        new = InProcessStore()
    # (With the Stores held weakly, the dead job's entry may be gone before its address is reused:
    # either way the new job must not see its keys.)
    assert not topology.node_kv(KV(new, PREFIX), 0, 0, 1.0)[0].check(["q/0/1"])
    assert not topology.group_kv(KV(new, PREFIX), 0, 2, hosts=True, timeout_s=1.0)[0].check(["q/0/1"])
