"""A guarded switch runs every rank's checkpoint guard first, and its switch only once every guard
succeeded (leader.py ``_guard_round``).

Found by an outside check (12-07): with guard and switch in one order per rank, rank 3's guard
refused at once while ranks 0 and 1 had already switched and rank 2's slow guard was still saving;
the leader decided at rank 3's answer ("switch not attempted"), skipped the rollback, resumed
training, and rank 2 then switched on its own. On HCCL a rank left out of a switch blocks its
peers' switch for minutes. Real members here, each with a training thread parked at its step
boundary, the leader's real Coordinator; flat, and with node and group fan-out (the relays must
wait for every rank of a guard round too).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import support

from nicswitch_agent.coordination import KV, Coordinator, InProcessStore, Member, MemberHooks
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.fan_out import RankFanOut
from nicswitch_agent.coordination.parking import ParkingLot, TrainingStopped
from nicswitch_agent.coordination.topology import Layout
from nicswitch_agent.orders import SwitchOrder

pytestmark = pytest.mark.timeout(60)

PREFIX = "nicswitch/job-guard/0"
WORLD = 4
ORDER = SwitchOrder(seq=1, job_id="job-guard", ranks=(2, 3), ops=(True, True))
LAYOUTS = {"flat": Layout(WORLD), "node": Layout(WORLD, 2), "group": Layout(WORLD, 1, 2)}


class Rank:
    """One rank: a member with the test's hooks, and a training thread stepping until parked."""

    def __init__(self, kv: KV, rank: int, slot: int | None, guard: Callable[[SwitchOrder], Any] | None,
                 switched: list[int], switch: Callable[[SwitchOrder], Any] | None = None,
                 guard_timeout_s: float = 20, verify: Any = None) -> None:
        self.last = 0
        self.answered: list[dict[str, Any]] = []  # the member_result events: the orders it answered
        self._go = threading.Event()
        self.lot = ParkingLot(on_armed=lambda armed: self._go.set() if armed else self._go.clear())

        def switch_and_record(order: SwitchOrder) -> Any:
            switched.append(rank)
            return switch(order) if switch is not None else True

        self.member = Member(kv, rank, self.lot, MemberHooks(
            switch_hook=switch_and_record, checkpoint_hook=guard, guard_timeout_s=guard_timeout_s, switch_timeout_s=20,
            dry_run=False, verify_hook=verify, verify_timeout_s=2), lambda: self.last, slot=slot,
            on_event=lambda kind, detail: self.answered.append(detail) if kind == "member_result" else None)
        threading.Thread(target=self._train, daemon=True).start()
        self.member.start()

    def _train(self) -> None:
        with contextlib.suppress(TrainingStopped):
            while True:
                self.last += 1
                self.lot.at_step_boundary(self.last)
                self._go.wait()


class Job:
    def __init__(self, layout: Layout, guards: dict[int, Callable[[SwitchOrder], Any]], *,
                 switches: dict[int, Callable[[SwitchOrder], Any]] | None = None, guard_timeout_s: float = 20,
                 verifies: dict[int, Any] | None = None) -> None:
        self.store = InProcessStore()
        self.switched: list[int] = []
        self.fan_outs = [RankFanOut(KV(self.store, PREFIX), layout, rank, node_store_timeout_s=10, stop_timeout_s=2)
                         for rank in range(WORLD)]
        for fan_out in self.fan_outs:
            fan_out.start()
        self.ranks = [Rank(f.member_kv, rank, f.slot, guards.get(rank), self.switched, (switches or {}).get(rank),
                           guard_timeout_s, (verifies or {}).get(rank)) for rank, f in enumerate(self.fan_outs)]
        self.leader = Coordinator(KV(self.store, PREFIX), layout.answerers, layout=layout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.leader.release()
        for rank in self.ranks:
            rank.member.stop()
        for fan_out in self.fan_outs:
            fan_out.stop()


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> Layout:
    return LAYOUTS[request.param]


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for job in made:
        job.stop()


def refuse(order: SwitchOrder) -> None:
    raise OSError("No space left on device")


@pytest.mark.parametrize("kind", [p.KIND_SWITCH, p.KIND_CHECKPOINT])
def test_one_guard_refusing_while_another_still_saves_moves_no_link_and_waits_for_it(
        layout: Layout, jobs: list[Job], kind: str) -> None:
    """A guarded switch's guard round, and a checkpoint (ClusterD's dump) alike: decided once every
    rank answered (the dump's order was decided at the first refusal, 3 s before the slow rank's
    save returned: found by an outside check)."""
    saving, saved = threading.Event(), threading.Event()
    release = threading.Event()

    def slow(order: SwitchOrder) -> None:  # rank 2's guard: still saving when rank 3 refuses
        saving.set()
        assert release.wait(30)
        saved.set()

    job = Job(layout, {0: lambda order: None, 1: lambda order: None, 2: slow, 3: refuse})
    jobs.append(job)
    assert job.leader.pause(30).ok
    decided: list[Any] = []
    runner = threading.Thread(target=lambda: decided.append(
        job.leader.run(ORDER, kind=kind, budget_s=20, **({"guard_budget_s": 20} if kind == p.KIND_SWITCH else {}))),
        daemon=True)
    runner.start()
    assert saving.wait(20)
    assert support.wait_until(lambda: any(not d["ok"] for d in job.ranks[3].answered), 20)  # rank 3 refused
    runner.join(1.0)  # a leader deciding at that refusal would have by now (a hop or two)
    assert not decided, "decided while rank 2's guard was still running"
    release.set()
    runner.join(30)
    assert decided and saved.is_set()
    outcome = decided[0]
    assert not outcome.ok and not outcome.attempted and not outcome.unsafe, outcome
    assert outcome.reason.startswith("rank 3: checkpoint hook raised OSError: No space left on device"), outcome.reason
    assert outcome.guard_failed is (kind == p.KIND_SWITCH)
    assert job.switched == []  # no rank's switch started: nothing to roll back


def test_every_guard_succeeding_switches_every_rank_once_and_says_the_guard_ran(
        layout: Layout, jobs: list[Job]) -> None:
    guarded: list[int] = []
    job = Job(layout, {rank: (lambda order, rank=rank: guarded.append(rank)) for rank in range(WORLD)})
    jobs.append(job)
    assert job.leader.pause(30).ok
    outcome = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=20, guard_budget_s=20)
    assert outcome.ok and outcome.attempted and outcome.guard_ok, outcome
    assert sorted(guarded) == sorted(job.switched) == list(range(WORLD))  # each hook once: no guard in the switch


@pytest.mark.parametrize("who", ["its rank", "the leader"])
def test_a_guard_still_running_past_its_timeout_keeps_training_from_resuming(
        layout: Layout, jobs: list[Job], who: str) -> None:
    """A guard stuck (a collective save waiting for a rank that refused) leaves its rank parked
    inside the hook: the outcome says so (unsafe), so no strategy resumes the others beside it;
    whether its rank's own timeout said so, or the leader's budget ran out first."""
    stuck = threading.Event()
    # Rank 2 beside rank 3: with node fan-out their relay hears the refusal and not the stuck one
    job = Job(layout, {2: lambda order: stuck.wait(60), 3: refuse}, guard_timeout_s=1 if who == "its rank" else 20)
    jobs.append(job)
    try:
        assert job.leader.pause(30).ok
        outcome = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=2, guard_budget_s=10 if who == "its rank" else 1)
        if who == "its rank":
            assert "rank 2: checkpoint hook did not finish within 1 s" in outcome.reason or \
                outcome.reason.startswith("rank 3: checkpoint hook raised"), outcome.reason
        assert not outcome.ok and not outcome.attempted and outcome.unsafe, outcome
        assert job.switched == []
    finally:
        stuck.set()


def test_a_switch_failing_on_one_rank_first_counts_as_attempted_while_others_have_not_answered(
        layout: Layout, jobs: list[Job]) -> None:
    """No guard, so no guard round: the first failure decides the switch at once, and it says
    "not attempted" (rank 3 cannot switch at all). Rank 1 is still in its switch, and others
    may have switched: the leader must take the links as moved, so that a rollback runs."""
    switching, done = threading.Event(), threading.Event()

    def slow(order: SwitchOrder) -> bool:
        switching.set()
        done.wait(30)
        return True

    job = Job(layout, {}, switches={1: slow})
    jobs.append(job)
    job.ranks[3].member.hooks = replace(job.ranks[3].member.hooks, switch_hook=None)
    try:
        assert job.leader.pause(30).ok
        outcome = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=20)
        assert not outcome.ok and outcome.attempted, outcome
        assert outcome.reason == "rank 3: no switch hook configured", outcome.reason
    finally:
        done.set()


def test_the_switch_order_follows_a_passed_guard_round_on_go_keys_not_the_queues(
        layout: Layout, jobs: list[Job]) -> None:
    """Every rank whose guard passed blocks on its go key, and the leader (each relay for its
    node) writes the switch order there in one multi-set: no queue event to read and delete per
    rank (docs/performance.md, "The switch order on go keys after the guard round")."""
    job = Job(layout, {rank: (lambda order: None) for rank in range(WORLD)})
    jobs.append(job)
    assert job.leader.pause(30).ok
    read = [rank.member._next for rank in job.ranks]  # the queue event each reads next
    outcome = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=20, guard_budget_s=20)
    assert outcome.ok and outcome.guard_ok, outcome
    assert sorted(job.switched) == list(range(WORLD))
    assert [rank.member._next - before for rank, before in zip(job.ranks, read, strict=True)] == [1] * WORLD, \
        "a rank read more than the guard round's event from its queue"


def test_a_refused_guard_sends_the_ranks_whose_guard_passed_back_to_their_queues_at_once(
        layout: Layout, jobs: list[Job]) -> None:
    """Ranks 0-2 passed their guard and wait on their go keys, which may wait as long as the guard
    round may last (here 35 s): the refusal must wake them (a wake on every go key), or the next
    order finds them deaf to their queues."""
    job = Job(layout, {0: lambda order: None, 1: lambda order: None, 2: lambda order: None, 3: refuse})
    jobs.append(job)
    assert job.leader.pause(30).ok
    refused = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=20, guard_budget_s=30)
    assert not refused.ok and refused.guard_failed, refused
    rollback = SwitchOrder(seq=2, job_id="job-guard", ranks=(2, 3), ops=(False, False))
    outcome = job.leader.run(rollback, kind=p.KIND_ROLLBACK, budget_s=3)
    assert outcome.ok, outcome


class CollectiveProbe:
    """A verify hook whose warm-up is a collective of every rank (a barrier, as a link probe's
    all_reduce): a rank that skips it leaves the others waiting in it."""

    def __init__(self, barrier: threading.Barrier, warmed: list[int], rank: int, wait_s: float = 30) -> None:
        self.barrier, self.warmed, self.rank, self.wait_s = barrier, warmed, rank, wait_s
        self.pending = False

    def prepare(self, order: SwitchOrder) -> bool:
        try:
            self.barrier.wait(self.wait_s)
        except threading.BrokenBarrierError:  # as TorchLinkProbe past its own timeout: the op stays pending
            self.pending = True
            return False
        self.warmed.append(self.rank)
        return True

    def communicators_unusable(self) -> bool:
        return self.pending

    def __call__(self, order: SwitchOrder) -> bool:
        return True


def test_a_refused_guard_still_joins_the_warm_up_collective_so_training_can_go_on(
        layout: Layout, jobs: list[Job]) -> None:
    """Found by an outside check (TorchLinkProbe, 4 gloo ranks): rank 2's guard raised, so it
    skipped the probe's warm-up all_reduce; the others waited in it until their timeout, ClusterD's
    retry resumed training next to the pending op, and gloo aborted the job. Every rank runs the
    warm-up, its guard refused or not: the refusal moves no link and leaves nothing pending."""
    barrier, warmed = threading.Barrier(WORLD), []
    job = Job(layout, {0: lambda order: None, 1: lambda order: None, 2: refuse, 3: lambda order: None},
              verifies={rank: CollectiveProbe(barrier, warmed, rank) for rank in range(WORLD)})
    jobs.append(job)
    assert job.leader.pause(30).ok
    outcome = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=20, guard_budget_s=20)
    assert not outcome.ok and outcome.guard_failed and not outcome.unsafe, outcome
    assert outcome.reason.startswith("rank 2: checkpoint hook raised OSError"), outcome.reason
    assert sorted(warmed) == list(range(WORLD)) and job.switched == []


@pytest.mark.parametrize("probe", ["says so", "overruns"])
def test_a_warm_up_left_pending_makes_the_guard_round_unsafe(layout: Layout, jobs: list[Job], probe: str) -> None:
    """Rank 3 has no probe (so no warm-up): the others' warm-up collective fails with its op still
    pending, the probe saying so after its own timeout (``communicators_unusable()``), or still
    waiting at the member's. Training must not resume into that communicator: the outcome is
    unsafe, so no strategy lets it (as a verification that left one)."""
    barrier = threading.Barrier(WORLD)
    wait_s = 0.5 if probe == "says so" else 30  # the member's verify timeout: 2 s
    job = Job(layout, {rank: (lambda order: None) for rank in range(WORLD)},
              verifies={rank: CollectiveProbe(barrier, [], rank, wait_s) for rank in range(WORLD - 1)})
    jobs.append(job)
    try:
        assert job.leader.pause(30).ok
        outcome = job.leader.run(ORDER, kind=p.KIND_SWITCH, budget_s=20, guard_budget_s=20)
        assert not outcome.ok and outcome.unsafe and not outcome.attempted, outcome
        assert "verify warm-up" in outcome.reason, outcome.reason
        assert job.switched == []
    finally:
        barrier.abort()  # the stuck warm-ups' training threads go on (the fixture's stop releases them)
