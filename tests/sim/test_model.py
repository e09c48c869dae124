"""Rank table, job and settings validation, and the large request (docs/clusterd.md#large-requests)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from nicswitch_agent.sim import SimJob, SimSettings
from nicswitch_agent.sim.event_controller import new_event_id
from nicswitch_agent.sim.ranktable import RankTable, go_map_order

from .conftest import JOB, Setup

pytestmark = pytest.mark.timeout(20)


def test_rank_ids_are_pod_rank_times_width_plus_index() -> None:
    table = RankTable({"node-a": ["4", "5", "6", "7"], "node-b": ["0", "1", "2", "3"]})
    assert [s.rank_ids for s in table.servers] == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
    assert table.rank_of("node-a", "6") == "2"
    assert table.rank_of("node-b", "0") == "4"
    assert table.world_size() == 8
    ranks, ops = table.global_ranks([("node-b", ["3", "0"], [True, False]), ("node-a", ["4"], [True])])
    assert (ranks, ops) == (["7", "4", "0"], [True, False, True])
    with pytest.raises(KeyError):
        table.rank_of("node-a", "0")


def test_go_map_order() -> None:
    keys = [f"k{i}" for i in range(20)]
    assert go_map_order(keys, None) == keys
    shuffled = go_map_order(keys, random.Random(1))
    assert sorted(shuffled) == sorted(keys) and shuffled != keys


@pytest.mark.parametrize(
    "nodes",
    [
        {},
        {"node-0": []},
        {"node-0": ["0", "0"]},
        {"node-0": ["0", "1"], "node-1": ["0"]},
        {"node-0": "01"},
    ],
)
def test_sim_job_rejects_bad_nodes(nodes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimJob("job", nodes)  # type: ignore[arg-type]


def test_sim_job_defaults() -> None:
    job = SimJob("job", {"n": [0, 1]})  # type: ignore[list-item]
    assert job.nodes == {"n": ("0", "1")}
    assert job.superpod_id("n") == 0
    assert job.allowed_strategies() == {"retry", "recover", "dump", "exit"}
    with pytest.raises(ValueError):
        SimJob("job", {"n": ["0"]}, superpod_ids={"other": 1})


def test_settings_validation() -> None:
    assert SimSettings().report_timeout_s == 900.0
    with pytest.raises(ValueError):
        SimSettings(report_timeout_s=0)
    with pytest.raises(ValueError):
        SimSettings(restart_wait_s=-1)
    with pytest.raises(ValueError):
        SimSettings(max_workers=2)


def test_event_id_format() -> None:
    head, _, tail = new_event_id().partition("-")
    assert len(head) == 16 and head == head.upper() and int(head, 16) > 0
    assert len(tail) == 32 and tail == tail.lower() and int(tail, 16) >= 0


def test_large_request_64_nodes_x_16(make_setup: Callable[..., Setup]) -> None:
    """1024 distinct ranks, 16 consecutive per node in request device order, random node order."""
    nodes = {f"node-{i}": [str(d) for d in range(16)] for i in range(64)}
    setup = make_setup(jobs=[SimJob(JOB, nodes)], shuffle_nodes=True, seed=3)
    agent, worker = setup.ready()
    nic_ops = {node: (list(devs), [True] * 16) for node, devs in nodes.items()}
    om_stream = setup.start_switch(nic_ops)
    agent.get()
    setup.agent.stop_complete(0)
    rank_list = worker.get()
    ranks = [int(r) for r in rank_list.rankID]
    assert len(ranks) == len(set(ranks)) == 1024 and all(rank_list.op)
    blocks = [ranks[i : i + 16] for i in range(0, 1024, 16)]
    assert all(block == list(range(block[0], block[0] + 16)) for block in blocks)
    node_order = [block[0] // 16 for block in blocks]
    assert sorted(node_order) == list(range(64)) and node_order != sorted(node_order)
    setup.worker.reply(True)
    agent.get()
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
