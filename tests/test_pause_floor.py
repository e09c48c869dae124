"""The floor benchmark's coordination (benchmarks/pause_floor.py) runs the protocol it claims to.

``store_scale --floor`` compares the library against it; a floor that cut a corner of the
step-aligned pause (ranks parked at different steps, a switch answered before every rank parked)
would be a floor of something else. Real ranks here: store_scale's own RankThread (training thread
and ParkingLot), a real TCPStore, the floor's members and relays on their threads.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from tests.support import tcp_store

pytestmark = pytest.mark.timeout(60)


class _Node:
    """What a RankThread asks of its node process: a step period (0: step only when armed), a
    timeout, and a stamp per lot event."""

    step_s = 0.0
    timeout_s = 30.0

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.cond = threading.Condition()

    def stamp(self, kind: str) -> None:
        with self.cond:
            self.counts[kind] += 1
            self.cond.notify_all()

    def wait(self, kind: str, count: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.counts[kind] >= count, 30.0)


@pytest.mark.parametrize("per_node", [None, 4])
def test_every_rank_parks_at_one_target_and_runs_the_switch_parked(per_node: int | None) -> None:
    from benchmarks import pause_floor
    from benchmarks.store_scale import RankThread

    world = 12
    store = tcp_store(30.0)
    node = _Node()
    ranks = [RankThread(rank, node) for rank in range(world)]  # type: ignore[arg-type]
    for r in ranks:
        r.thread.start()
    if per_node is None:
        members: list[Any] = pause_floor.start_flat(ranks, store, world)
        answerers = world
    else:
        members, _relays = pause_floor.start_node(ranks, store, per_node, world)
        answerers = world // per_node
    leader = pause_floor.FloorLeader(store.clone(), answerers)
    switches = 3
    try:
        for switch in range(1, switches + 1):
            before = [r.last_step for r in ranks]
            target = leader.pause()
            # Every rank is parked, at the one target, which is past every step begun before.
            assert [r.lot.parked for r in ranks] == [True] * world
            assert {r.lot.parked_step for r in ranks} == {target}
            assert target > max(s or 0 for s in before)
            leader.run()  # raises unless every rank ran the switch on its parked training thread
            leader.release()
            assert node.wait("resumed", switch * world)
        assert node.counts["parked"] == switches * world
        assert all(m.events_handled == 4 * switches for m in members)
        assert [m.switched_on for m in members] == [[f"train-{m.rank}"] * switches for m in members]
    finally:
        leader.stop()
        for m in members:
            m._thread.join(10)
        for r in ranks:
            r.quit = True
            r.go.set()


def test_a_rank_answers_parked_only_once_its_training_thread_parked() -> None:
    """One rank's training thread is held between two step boundaries while the target goes out:
    its parked answer must wait until it parks (else the leader says "all parked" with a rank
    still stepping, and the floor would be a floor of a pause that is not one)."""
    from benchmarks import pause_floor
    from benchmarks.store_scale import RankThread

    world, held = 6, 4
    store = tcp_store(30.0)
    node = _Node()
    ranks = [RankThread(rank, node) for rank in range(world)]  # type: ignore[arg-type]
    gate = threading.Event()
    lot = ranks[held].lot
    armed = lot._on_armed

    def armed_behind_the_gate(on: bool) -> None:  # the held rank's thread sees a pause only once the gate opens
        if on:
            threading.Thread(target=lambda: (gate.wait(30), armed(True)), daemon=True).start()  # type: ignore[misc]
        else:
            armed(False)  # type: ignore[misc]

    lot._on_armed = armed_behind_the_gate
    for r in ranks:
        r.thread.start()
    answered_parked: dict[int, bool] = {}
    answer_up = pause_floor.answer_up

    def recording(store: Any, n: int, index: int, expected: int, value: str) -> None:
        if n == 2:  # the first switch's target phase: is the rank answering parked?
            answered_parked[index] = ranks[index].lot.parked
        answer_up(store, n, index, expected, value)

    pause_floor.answer_up = recording  # type: ignore[assignment]
    members = pause_floor.start_flat(ranks, store, world)
    leader = pause_floor.FloorLeader(store.clone(), world)
    try:
        opener = threading.Thread(target=lambda: (node.wait("parked", world - 1), gate.set()), daemon=True)
        opener.start()
        target = leader.pause()
        assert {r.lot.parked_step for r in ranks} == {target}
        assert answered_parked == dict.fromkeys(range(world), True)
        leader.run()
        leader.release()
        assert node.wait("resumed", world)
    finally:
        pause_floor.answer_up = answer_up  # type: ignore[assignment]
        gate.set()
        leader.stop()
        for m in members:
            m._thread.join(10)
        for r in ranks:
            r.quit = True
            r.go.set()
