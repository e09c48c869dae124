"""The verify round's go key (messages.py ``e/<E>/go/<K>``): one write per level instead of a
queue event per rank.

Where the leader expects verification, its switch order says so (``"v"``); every rank (and relay)
that answered the switch ok blocks on the switch's go key, and the leader writes there what
follows: the verify order, or a wake (no verify round). What must hold: the verify order reaches
every rank that switched, through the go key and never through a queue; a failed switch sends the
ranks that switched back to their queues at once (the rollback is a queue event); a stop wakes a
member or a relay blocked on a go key; a leader gone leaves the wait bounded.

Members here are real Member threads on an in-process Store with the real Coordinator; relays are
real NodeRelays whose ranks the test plays by hand (test_relay's Node).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import support
from test_relay import PREFIX, Node

from nicswitch_agent.coordination import KIND_SWITCH, KV, Coordinator, InProcessStore, Member, MemberHooks, queues
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.orders import SwitchOrder

pytestmark = pytest.mark.timeout(60)

ORDER = SwitchOrder(seq=1, job_id="job-go", ranks=(0, 1), ops=(True, True))


class WrittenStore(InProcessStore):
    """An in-process Store that keeps every value written to a key (queue events are deleted once read)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[tuple[str, str]] = []

    def set(self, key: str, value: str | bytes) -> None:
        self.values.append((key, value if isinstance(value, str) else value.decode()))
        super().set(key, value)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.values.append((key, value if isinstance(value, str) else value.decode()))
        super().multi_set(keys, values)

    def events(self, where: str) -> list[dict[str, Any]]:
        """The decoded values written to keys containing ``where`` (``/q/0/`` for rank 0's queue events)."""
        return [p.decode(value) for key, value in self.values if where in key and "head" not in key]


class Members:
    """``size`` Member threads on one Store, each with a switch hook (True unless its scripted
    results say otherwise, one per call) and a recording verify hook; no training thread (the
    hooks run on the member's own: pause mode external)."""

    def __init__(self, store: InProcessStore, size: int, *, switch: dict[int, list[bool]] | None = None,
                 hold: dict[int, threading.Event] | None = None) -> None:
        self.verified: list[int] = []
        scripted = {rank: list(results) for rank, results in (switch or {}).items()}

        def switch_hook(order: SwitchOrder, rank: int) -> bool:
            held = (hold or {}).get(rank)
            if held is not None:
                assert held.wait(30)
            return scripted[rank].pop(0) if scripted.get(rank) else True

        self.members = [Member(KV(store, PREFIX), rank, ParkingLot(), MemberHooks(
            switch_hook=lambda order, r=rank: switch_hook(order, r), checkpoint_hook=None,
            guard_timeout_s=5, switch_timeout_s=5, dry_run=False,
            verify_hook=lambda order, r=rank: self.verified.append(r) is None, verify_timeout_s=5),
            lambda: 0, stop_timeout_s=5) for rank in range(size)]
        for member in self.members:
            member.start()

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def test_the_verify_order_reaches_every_rank_through_the_go_key_not_the_queue() -> None:
    store = WrittenStore()
    members = Members(store, 2)
    leader = Coordinator(KV(store, PREFIX), 2, verify_expected=True)
    try:
        outcome = leader.run(ORDER, kind=KIND_SWITCH, budget_s=30)
    finally:
        members.stop()
    assert outcome.ok and outcome.verified, outcome
    assert sorted(members.verified) == [0, 1]
    queued = store.events("/q/0/")
    events = [e for e in queued if e["t"] != p.WAKE]
    assert [e["t"] for e in events] == [p.ORDER, p.RELEASE]
    assert events[-1][p.CARRIED_OUTCOME]["t"] == p.OUTCOME  # a success's outcome rides on the release
    assert queued[0]["v"] == 1 and queued[0]["kind"] == KIND_SWITCH
    go = store.events("/go/")
    assert [(e["t"], e["kind"], e["n"]) for e in go] == [(p.ORDER, p.KIND_VERIFY, 2)] * 2  # a key per rank


def test_a_leader_that_expects_no_verification_sends_the_round_through_the_queues() -> None:
    """A leader without a verify hook of its own (ranks with one ask for the round in their results)."""
    store = WrittenStore()
    members = Members(store, 2)
    leader = Coordinator(KV(store, PREFIX), 2)
    try:
        outcome = leader.run(ORDER, kind=KIND_SWITCH, budget_s=30)
    finally:
        members.stop()
    assert outcome.ok and outcome.verified, outcome
    assert sorted(members.verified) == [0, 1]
    assert [e.get("kind") for e in store.events("/q/0/") if e["t"] == p.ORDER] == [KIND_SWITCH, p.KIND_VERIFY]
    assert "v" not in store.events("/q/0/")[0] and not store.events("/go/")


def test_a_failed_switch_sends_the_ranks_that_switched_back_to_their_queues() -> None:
    """Rank 1 fails at once; rank 0 is still in its switch hook when the leader has decided and
    begun the next order (pause mode external: a new epoch, the last one's keys deleted). Rank 0's
    late success must still find its wake, and run the next order, not wait out the switch's bound."""
    store = WrittenStore()
    hold = threading.Event()
    members = Members(store, 2, switch={1: [False]}, hold={0: hold})
    leader = Coordinator(KV(store, PREFIX), 2, verify_expected=True)
    kv = KV(store, PREFIX)
    pool = ThreadPoolExecutor(1)
    try:
        first = leader.run(ORDER, kind=KIND_SWITCH, budget_s=30)
        rollback = SwitchOrder(seq=2, job_id="job-go", ranks=(0,), ops=(False,))
        second: Future[Any] = pool.submit(leader.run, rollback, kind=p.KIND_ROLLBACK, budget_s=10)
        assert support.wait_until(lambda: not kv.check([p.result_counter_key(1, "1.1.switch")]), 10)  # deleted
        hold.set()
        assert second.result(30).ok, "rank 0 did not come back to its queue"
    finally:
        hold.set()
        members.stop()
        pool.shutdown()
    assert not first.ok and "rank 1" in first.reason and not first.verified
    assert members.verified == []
    assert [e["t"] for e in store.events("/go/")] == [p.WAKE] * 2


def test_stop_wakes_a_member_blocked_on_a_go_key() -> None:
    """The switch answered, the leader not heard from (budget: an hour): stop() must not wait for it."""
    store = InProcessStore()
    members = Members(store, 1)
    member = members.members[0]
    kv = KV(store, PREFIX)
    kv.set(p.queue_key(0, 1), p.encode({"t": p.ORDER, "e": 1, "key": "1.1.switch", "kind": KIND_SWITCH,
                                        "budget": 3600.0, "seq": 1, "n": 1, "v": 1,
                                        **p.inline_order(p.encode_order(ORDER))}))
    assert support.wait_until(lambda: member._go is not None, 10)  # answered, now on the go key
    member.stop()
    assert not member.running


def test_a_member_waits_for_a_silent_leader_no_longer_than_the_switch_allows(monkeypatch: Any) -> None:
    """The go wait is bounded (the switch's budget + warm-up + slack); then the queue goes on."""
    monkeypatch.setattr(p, "GO_SLACK_S", 0.05)
    store = InProcessStore()
    members = Members(store, 1)
    kv = KV(store, PREFIX)
    try:
        kv.set(p.queue_key(0, 1), p.encode({"t": p.ORDER, "e": 1, "key": "1.1.switch", "kind": KIND_SWITCH,
                                            "budget": 0.05, "seq": 1, "n": 1, "v": 1,
                                            **p.inline_order(p.encode_order(ORDER))}))
        # The leader never writes the go key; the next order in the queue still runs.
        kv.set(p.queue_key(0, 2), p.encode({"t": p.ORDER, "e": 1, "key": "1.2.rollback", "kind": p.KIND_ROLLBACK,
                                            "budget": 30.0, "seq": 2, "n": 1,
                                            **p.inline_order(p.encode_order(ORDER))}))
        results = list(p.arriving_results(kv, 1, "1.2.rollback", 1, float("inf")))
    finally:
        members.stop()
    assert [r.ok for r in results] == [True]


# -- relays: one go key per level -------------------------------------------------------------


@pytest.fixture
def relayed() -> Iterator[tuple[Coordinator, list[Node], ThreadPoolExecutor]]:
    store = InProcessStore()
    nodes = [Node(store, 0, [0, 1]), Node(store, 1, [2, 3])]
    for node in nodes:
        node.relay.start()
    leader = Coordinator(KV(store, PREFIX), 2, ranks_per_node=2, verify_expected=True)
    pool = ThreadPoolExecutor(2)
    yield leader, nodes, pool
    pool.shutdown(wait=False, cancel_futures=True)
    for node in nodes:
        node.relay.stop()


def answer(node: Node, slot: int, event: dict[str, Any], ok: bool = True, verify_s: float = 0.0) -> None:
    queues.answer_result(node.local, int(event["e"]), str(event["key"]), p.MemberResult(
        node.ranks[slot], ok, "ok" if ok else "no", attempted=True, verify_s=verify_s), int(event["n"]))


def go_below(node: Node, slot: int, event: dict[str, Any]) -> dict[str, Any]:
    """What a rank of ``node`` that answered switch ``event`` reads from its go key."""
    key = p.go_key(int(event["e"]), str(event["key"]), slot)
    text = node.local.get_when_set(key, 10)
    assert text is not None, "the relay wrote nothing to its node's go key"
    return p.decode(text)


def test_a_relay_forwards_the_verify_order_through_its_nodes_go_key(relayed: Any) -> None:
    leader, nodes, pool = relayed
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=30.0)
    orders = [[node.next_event(slot) for slot in range(2)] for node in nodes]
    assert all(o["v"] == 1 for per_node in orders for o in per_node)
    for node, per_node in zip(nodes, orders, strict=True):
        for slot, event in enumerate(per_node):
            answer(node, slot, event, verify_s=5.0)
    for node, per_node in zip(nodes, orders, strict=True):
        for slot, event in enumerate(per_node):
            verify = go_below(node, slot, event)
            assert (verify["t"], verify["kind"], verify["n"]) == (p.ORDER, p.KIND_VERIFY, 2)
            answer(node, slot, verify)
    outcome = running.result(20)
    assert outcome.ok and outcome.verified, outcome
    # The ranks' next queue event is the release carrying the outcome: the verify round never went
    # through a queue.
    following = [node.next_event(slot) for node in nodes for slot in range(2)]
    assert all(e["t"] == p.RELEASE and e[p.CARRIED_OUTCOME]["t"] == p.OUTCOME for e in following), following


def test_a_relay_sends_its_ranks_back_to_their_queues_when_the_switch_failed(relayed: Any) -> None:
    leader, nodes, pool = relayed
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=30.0)
    orders = [[node.next_event(slot) for slot in range(2)] for node in nodes]
    answer(nodes[0], 0, orders[0][0], verify_s=5.0)
    answer(nodes[0], 1, orders[0][1], verify_s=5.0)
    answer(nodes[1], 0, orders[1][0], ok=False)
    outcome = running.result(20)
    assert not outcome.ok and "rank 2" in outcome.reason
    assert go_below(nodes[0], 0, orders[0][0])["t"] == p.WAKE  # node 0's ranks switched: they go on
    answer(nodes[1], 1, orders[1][1], verify_s=5.0)  # rank 3 answers late, ok: it is sent on too
    assert go_below(nodes[1], 1, orders[1][1])["t"] == p.WAKE


def test_stop_wakes_a_relay_blocked_on_a_go_key(relayed: Any) -> None:
    leader, nodes, pool = relayed
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=3600.0)
    orders = [nodes[0].next_event(slot) for slot in range(2)]
    for slot, event in enumerate(orders):
        answer(nodes[0], slot, event, verify_s=5.0)
    relay = nodes[0].relay
    assert support.wait_until(lambda: relay._go is not None, 10)  # node 0 answered; the leader waits for node 1
    relay.stop()
    assert not relay.running
    leader.wake()
    assert not running.result(20).ok


def test_the_leaders_go_keys_are_deleted_one_epoch_after_the_others() -> None:
    """Go keys are garbage, as result keys are, kept one epoch longer (see the failed-switch test)."""
    store = InProcessStore()
    members = Members(store, 1)
    leader = Coordinator(KV(store, PREFIX), 1, verify_expected=True)
    kv = KV(store, PREFIX)
    try:
        for seq in (1, 2, 3):
            order = SwitchOrder(seq=seq, job_id="job-go", ranks=(0,), ops=(seq % 2 == 1,))
            assert leader.run(order, kind=KIND_SWITCH, budget_s=30).verified
            if seq == 1:
                first = p.go_key(leader.epoch, f"{leader.epoch}.1.switch", 0)
            if seq == 2:
                assert support.wait_until(lambda: not kv.check([p.result_counter_key(1, "1.1.switch")]), 10)
                assert kv.check([first])
        assert support.wait_until(lambda: not kv.check([first]), 10)
    finally:
        members.stop()



def test_over_the_node_link_each_rank_gets_its_own_go_key_only() -> None:
    """The relay writes its slots' go keys in one multi-set; over the node link each rank's copy
    gets its own key alone (node_link.py multi_set_addressed), not the node's n of them."""
    store = InProcessStore()
    node = Node(store, 0, [0, 1, 2], way="link")
    node.relay.start()
    leader = Coordinator(KV(store, PREFIX), 1, ranks_per_node=3, verify_expected=True)
    with ThreadPoolExecutor(1) as pool:
        try:
            running: Future[Any] = pool.submit(leader.run, SwitchOrder(seq=1, job_id="job-go", ranks=(0, 1, 2),
                                                                       ops=(True, True, True)),
                                               kind=KIND_SWITCH, budget_s=30.0)
            orders = [node.next_event(slot) for slot in range(3)]
            for slot, event in enumerate(orders):
                queues.answer_result(node.views[slot], int(event["e"]), str(event["key"]), p.MemberResult(
                    node.ranks[slot], True, "ok", attempted=True, verify_s=5.0), int(event["n"]))
            for slot in (1, 2):  # the ranks with a link of their own (slot 0 reads the hub itself)
                epoch, name = int(orders[slot]["e"]), str(orders[slot]["key"])
                view = node.views[slot]
                text = view.get_when_set(p.go_key(epoch, name, slot), 10)
                assert text is not None and p.decode(text)["kind"] == p.KIND_VERIFY
                others = [p.go_key(epoch, name, other) for other in range(3) if other != slot]
                assert not any(view.check([key]) for key in others), "another rank's go key reached this copy"
        finally:
            leader.wake()  # the verify round is not the point: it ends unanswered
            running.result(20)
            node.relay.stop()
