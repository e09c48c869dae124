"""A rank restarted under a launcher-hosted leader fails the order in flight at once (joining.py).

Real torch TCPStore, a real Coordinator and real Members; the dead process is a member whose
switch hook never returns (it never answers, as a killed process never does). Each order has a
budget far longer than the test's timeout: if the restarted rank's word did not decide the order,
the test would time out.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator

import pytest
import support

from nicswitch_agent.coordination import KV, Coordinator, Member, MemberHooks
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.joining import join, leave
from nicswitch_agent.coordination.leader import PauseOutcome, RunOutcome
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.orders import SwitchOrder

torch_dist = pytest.importorskip("torch.distributed", reason="needs the torch extra")

pytestmark = pytest.mark.timeout(30)

BUDGET_S = 600.0  # never reached: see the module docstring


@pytest.fixture
def kv() -> Iterator[KV]:
    store = torch_dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    yield KV(store, p.key_prefix("job", "launcher"))


class Job:
    """A launcher's leader on ``kv`` and its ranks, each joined as the agent joins them."""

    def __init__(self, kv: KV, world_size: int) -> None:
        self.kv = kv
        self.coordinator = Coordinator(kv.clone(), world_size)
        self.members: list[Member] = []
        self.release = threading.Event()  # frees the hooks that stand for dead processes

    def start_rank(self, rank: int, pid: int, hook: Callable[[SwitchOrder], bool], *, says_it_leaves: bool = False
                   ) -> Member:
        """A rank's member, joined as the agent joins it; ``says_it_leaves``: its stop() tells the
        leader, as the agent's does (joining.leave); without it, a stop stands for a process killed."""
        kv, own = self.kv.clone(), self.kv.clone()
        joined = threading.Event()
        member = Member(kv, rank, ParkingLot(),
                        MemberHooks(switch_hook=hook, checkpoint_hook=None, guard_timeout_s=BUDGET_S,
                                    switch_timeout_s=BUDGET_S, dry_run=False),
                        lambda: 0, stop_timeout_s=0.5,
                        on_started=lambda: (join(kv, rank, pid), joined.set()),
                        # (the agent's job connection, not the member's: that one is blocked in its read)
                        on_stopping=(lambda interrupted: leave(own, rank, pid, interrupted=interrupted))
                        if says_it_leaves else None)
        member.start()
        assert joined.wait(10)
        self.members.append(member)
        return member

    def hangs(self, entered: threading.Event) -> Callable[[SwitchOrder], bool]:
        def hook(order: SwitchOrder) -> bool:
            entered.set()
            self.release.wait(25)
            return True
        return hook

    def run(self, seq: int) -> RunOutcome:
        order = SwitchOrder(seq=seq, job_id="job", ranks=(0, 1), ops=(True, True))
        return self.coordinator.run(order, kind="switch", budget_s=BUDGET_S)

    def stop(self) -> None:
        self.release.set()
        for member in self.members:
            member.stop()


def test_a_rank_restarted_mid_order_fails_it_at_once_naming_the_rank(kv: KV) -> None:
    job = Job(kv, 2)
    try:
        job.start_rank(0, 100, lambda order: True)
        entered = threading.Event()
        job.start_rank(1, 101, job.hangs(entered))  # the process that will "die" in its hook
        outcome: list[RunOutcome] = []
        runner = threading.Thread(target=lambda: outcome.append(job.run(1)), daemon=True)
        runner.start()
        assert entered.wait(10)
        job.start_rank(1, 202, lambda order: True)  # torchrun's new process for rank 1
        runner.join(20)
        assert outcome, "the leader waited for the dead process"
        assert not outcome[0].ok and outcome[0].attempted
        assert outcome[0].reason.startswith("rank 1: its process was restarted during the order "
                                            "(pid 101 replaced by pid 202)"), outcome[0].reason
        assert kv.get(p.IN_FLIGHT) == ""  # decided: no order is named any more
        assert kv.get(p.joined_key(1)) == "202"
    finally:
        job.stop()


def test_a_rank_restarted_between_orders_fails_nothing(kv: KV) -> None:
    job = Job(kv, 2)
    try:
        job.start_rank(0, 100, lambda order: True)
        job.start_rank(1, 101, lambda order: True)
        assert job.run(1).ok
        assert join(kv.clone(), 1, 202) is None  # nothing in flight: a restart while idle owes nothing
        assert job.run(2).ok  # ...and leaves no failure behind for the next order
    finally:
        job.stop()


def test_a_first_start_fails_nothing_even_with_an_order_in_flight(kv: KV) -> None:
    kv.set(p.IN_FLIGHT, p.encode({"e": 1, "key": "1.1.switch", "n": 2}))
    assert join(kv, 0, 100) is None
    assert not kv.check([p.result_counter_key(1, "1.1.switch")])


def _pausing(job: Job) -> tuple[threading.Thread, list[PauseOutcome]]:
    outcome: list[PauseOutcome] = []
    pausing = threading.Thread(target=lambda: outcome.append(job.coordinator.pause(BUDGET_S)), daemon=True)
    pausing.start()
    return pausing, outcome


def _failed(pausing: threading.Thread, outcome: list[PauseOutcome], waited_for: str) -> PauseOutcome:
    """The pause's outcome, which must have failed within the test's time (its budget is BUDGET_S)."""
    pausing.join(20)
    assert outcome, f"the leader waited out the pause for {waited_for}"
    assert not outcome[0].ok
    return outcome[0]


def test_a_rank_restarted_before_it_answered_the_pause_fails_it_at_once(kv: KV) -> None:
    """The pause's events went before the new process took its queue position: it will never park
    in that pause, and the old one never answers. Without a word the leader waits out
    pause_timeout_s (five minutes by default) with ClusterD answering "busy"."""
    job = Job(kv, 2)
    try:
        job.start_rank(0, 100, lambda order: True)
        job.start_rank(1, 101, lambda order: True).stop()  # the process that dies, silent from now on
        pausing, outcome = _pausing(job)
        assert support.wait_until(lambda: kv.check([p.c_key(1, 0)]), 10)  # rank 0 answered: the pause went out
        job.start_rank(1, 202, lambda order: True)  # torchrun's new process for rank 1
        failed = _failed(pausing, outcome, "the dead process")
        assert failed.reason == ("no answer to the pause from rank(s) 1; rank 1: its process was restarted "
                                 "during the pause (pid 101 replaced by pid 202)")
        assert kv.get(p.IN_FLIGHT) == ""  # the pause is over: nothing is named any more
    finally:
        job.stop()


def test_a_rank_restarted_before_it_parked_fails_the_pause_at_once(kv: KV) -> None:
    job = Job(kv, 2)
    try:
        job.start_rank(0, 100, lambda order: True)
        job.start_rank(1, 101, lambda order: True)  # both answer the pause; no training thread parks here
        pausing, outcome = _pausing(job)
        assert support.wait_until(lambda: kv.check([p.c_key(1, 0), p.c_key(1, 1)]), 10)
        job.start_rank(1, 202, lambda order: True)
        failed = _failed(pausing, outcome, "a process that will never park")
        assert failed.reason.endswith("; rank 1: its process was restarted during the pause "
                                      "(pid 101 replaced by pid 202)"), failed.reason
    finally:
        job.stop()


def test_a_pause_after_a_ranks_agent_stopped_fails_at_once_until_its_next_process_joins(kv: KV) -> None:
    """Training ended on a rank (its agent stopped) while its process runs on: a pause would wait
    out pause_timeout_s for it. Once a new process of that rank joins, pauses wait for it again."""
    job = Job(kv, 2)
    try:
        job.start_rank(0, 100, lambda order: True)
        job.start_rank(1, 101, lambda order: True, says_it_leaves=True).stop()
        pausing, outcome = _pausing(job)
        failed = _failed(pausing, outcome, "a rank whose agent had stopped")
        assert failed.reason == ("rank 1 (pid 101) stopped its agent (training ended, or its process is ending or "
                                 "restarting) and cannot park")
        job.start_rank(1, 202, lambda order: True)
        assert kv.count(p.LEFT_COUNT) == 0 and not kv.check([p.left_key(1)])
    finally:
        job.stop()


def test_a_ranks_agent_stopping_during_a_pause_fails_it_at_once(kv: KV) -> None:
    job = Job(kv, 2)
    try:
        job.start_rank(0, 100, lambda order: True)
        leaving = job.start_rank(1, 101, lambda order: True, says_it_leaves=True)
        pausing, outcome = _pausing(job)
        assert support.wait_until(lambda: kv.check([p.c_key(1, 0), p.c_key(1, 1)]), 10)  # both answered
        leaving.stop()  # its training thread will never park now
        failed = _failed(pausing, outcome, "a rank whose agent stopped")
        assert failed.reason.endswith("; rank 1: its agent stopped during the pause (pid 101)"), failed.reason
    finally:
        job.stop()


def test_an_order_after_a_ranks_agent_stopped_fails_at_once_without_being_sent(kv: KV) -> None:
    """A rollback after a failed switch (or any order) waits for every rank's answer; a rank whose
    agent stopped will never give one. Once a new process of that rank joins, orders run again."""
    job = Job(kv, 2)
    try:
        called: list[int] = []
        job.start_rank(0, 100, lambda order: called.append(order.seq) is None)
        job.start_rank(1, 101, lambda order: True, says_it_leaves=True).stop()
        # Without the word that rank 1 left, this fails after its budget, saying rank 1 did not answer.
        outcome = job.coordinator.run(SwitchOrder(seq=1, job_id="job", ranks=(0, 1), ops=(True, True)),
                                      kind="switch", budget_s=10.0)
        assert not outcome.ok and not outcome.attempted
        assert outcome.reason == ("rank 1 (pid 101) stopped its agent (training ended, or its process is ending or "
                                  "restarting) and cannot answer")
        assert not kv.check([p.order_key("1.1.switch")])  # nothing was sent to the ranks
        job.start_rank(1, 202, lambda order: True)
        assert job.run(2).ok
        assert called == [2]  # rank 0 never saw order 1
    finally:
        job.stop()


def test_a_ranks_agent_stopping_during_an_order_fails_it_at_once(kv: KV) -> None:
    """Rank 1's member runs the order (its hook hangs); its agent's stop says it left: the order
    is decided at once, false, naming the rank, as if the member had answered it."""
    job = Job(kv, 2)
    try:
        entered = threading.Event()
        job.start_rank(0, 100, lambda order: True)
        job.start_rank(1, 101, job.hangs(entered))
        running: list[RunOutcome] = []
        # A budget of 10 s: without the word that rank 1 left, the order fails after it, silent rank and all.
        order = SwitchOrder(seq=1, job_id="job", ranks=(0, 1), ops=(True, True))
        thread = threading.Thread(target=lambda: running.append(job.coordinator.run(order, kind="switch",
                                                                                     budget_s=10.0)))
        thread.start()
        assert entered.wait(10)
        leave(kv.clone(), 1, 101)  # (what rank 1's agent says as it stops; its member is left running)
        thread.join(20)
        assert running and not running[0].ok
        assert running[0].reason == "rank 1: the agent on this rank stopped during the order", running[0].reason
    finally:
        job.stop()


class LeavesAsTheLeaderLooks(KV):
    """The leader's connection: right after the leader reads how many ranks left, rank 1 leaves
    (the narrowest interleaving: between the leader's look and the order's publication)."""

    def __init__(self, kv: KV) -> None:
        super().__init__(kv.store.clone(), kv.prefix)
        self.leaver = kv.clone()
        self.fired = False

    def clone(self) -> KV:
        return self

    def count(self, key: str) -> int:
        value = super().count(key)
        if key == p.LEFT_COUNT and not self.fired:
            self.fired = True
            leave(self.leaver, 1, 101)
        return value


def _rank_1_leaving_as_the_leader_looks(kv: KV) -> Job:
    """Rank 0 running; rank 1 joined, its member never reads (its agent is stopping) and it leaves
    right after the leader's first look at who left (LeavesAsTheLeaderLooks)."""
    job = Job(kv, 2)
    job.start_rank(0, 100, lambda order: True)
    join(kv.clone(), 1, 101)
    job.coordinator = Coordinator(LeavesAsTheLeaderLooks(kv), 2)
    return job


def test_a_rank_that_leaves_just_as_the_order_starts_still_fails_it_at_once(kv: KV) -> None:
    """The leader names the order in flight, then looks for ranks that left; a rank leaves the
    other way round (counts itself, then reads what is in flight). Rank 1 leaves right after the
    leader looked (it saw nobody): the order is named by then, so rank 1's leave fails it. Looked
    at before naming, the order would go out and wait its budget for a rank that never answers."""
    job = _rank_1_leaving_as_the_leader_looks(kv)
    try:
        order = SwitchOrder(seq=1, job_id="job", ranks=(0, 1), ops=(True, True))
        outcome = job.coordinator.run(order, kind="switch", budget_s=10.0)
        assert not outcome.ok
        assert outcome.reason == "rank 1: the agent on this rank stopped during the order", outcome.reason
    finally:
        job.stop()


def test_a_rank_that_leaves_just_as_the_pause_starts_still_fails_it_at_once(kv: KV) -> None:
    """As for an order: the pause is named in flight before the leader looks for ranks that left."""
    job = _rank_1_leaving_as_the_leader_looks(kv)
    try:
        outcome = job.coordinator.pause(10.0)  # without rank 1's word: no answer from it for 10 s
        assert not outcome.ok
        assert outcome.reason.endswith("; rank 1: its agent stopped during the pause (pid 101)"), outcome.reason
    finally:
        job.stop()


def test_the_leaders_message_never_names_a_rank_that_came_back(kv: KV) -> None:
    """Ranks 1 and 2 left, rank 2 came back: the leader counts one rank left, and must not name
    rank 2 (the last to leave) for it; which one is left it cannot tell without a scan."""
    job = Job(kv, 3)
    try:
        job.start_rank(0, 100, lambda order: True)
        for rank in (1, 2):
            join(kv.clone(), rank, 100 + rank)
        leave(kv.clone(), 1, 101)
        leave(kv.clone(), 2, 102)
        join(kv.clone(), 2, 202)
        outcome = job.coordinator.pause(10.0)
        assert not outcome.ok
        assert outcome.reason == ("a rank stopped its agent (training ended, or its process is ending or restarting) "
                                  "and cannot park"), outcome.reason
    finally:
        job.stop()
