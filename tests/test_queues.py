"""Event queues (coordination/queues.py): on the node and group Stores the agent hosts, a reader
takes each event out of a Store queue in one request; elsewhere it reads a key and deletes it.

What must hold either way: a reader gets every event in order, a stop wakes its own reader and
never loses an event a relay must still pass on, a reader starting late begins after the events
published before it, and the hosted Stores (and only they) say they have queues.
"""

from __future__ import annotations

import threading

import pytest
import support

from nicswitch_agent.coordination import (
    KIND_SWITCH,
    KV,
    Coordinator,
    InProcessStore,
    Member,
    MemberHooks,
    queues,
    topology,
)
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.coordination.relay import NodeRelay
from nicswitch_agent.orders import SwitchOrder

pytestmark = pytest.mark.timeout(60)

PREFIX = "nicswitch/job-queues/0"
ORDER = SwitchOrder(seq=1, job_id="job-queues", ranks=(0,), ops=(True,))


class RecordingStore(InProcessStore):
    """An in-process Store that records the name of every request and the key it names."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str]] = []

    def get(self, key: str) -> bytes:
        self.requests.append(("get", key))
        return super().get(key)

    def delete_key(self, key: str) -> bool:
        self.requests.append(("delete_key", key))
        return super().delete_key(key)

    def set(self, key: str, value: str | bytes) -> None:
        self.requests.append(("set", key))
        super().set(key, value)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.requests.append(("multi_set", ",".join(keys)))
        super().multi_set(keys, values)

    def queue_pop_within(self, key: str, timeout_s: float) -> bytes | None:
        self.requests.append(("queue_pop", key))
        return super().queue_pop_within(key, timeout_s)

    def queue_push(self, key: str, value: str | bytes) -> None:
        self.requests.append(("queue_push", key))
        super().queue_push(key, value)


def member(kv: KV, rank: int = 0, slot: int | None = None) -> Member:
    """A member in pause mode external (its hooks on its own thread), switch hook True."""
    return Member(kv, rank, ParkingLot(), MemberHooks(switch_hook=lambda order: True, checkpoint_hook=None,
                                                      guard_timeout_s=5, switch_timeout_s=5, dry_run=False),
                  lambda: 1, stop_timeout_s=5.0, slot=slot)


@pytest.mark.parametrize("on_queues", [True, False])
def test_a_member_behind_a_relay_reads_every_event_and_on_a_queue_store_deletes_nothing(on_queues: bool) -> None:
    """The leader on the job's Store (keys), one node relay, two members on the node's Store: with
    queues a member's event is one pop and its answer one push (no reply); nothing is set (no queue
    head: a reader starting late empties its queue) and nothing is deleted."""
    job, node = InProcessStore(), RecordingStore()
    local = KV(node, PREFIX, queues=on_queues)
    relay = NodeRelay(KV(job, PREFIX), KV(job, PREFIX), local.clone(), 0, [0, 1], stop_timeout_s=5.0,
                      local_wake=local)
    ranks = [member(local.clone(), rank, slot=rank) for rank in (0, 1)]
    relay.start()
    for rank in ranks:
        rank.start()
    try:
        leader = Coordinator(KV(job, PREFIX), 1, ranks_per_node=2)
        for seq in (1, 2):
            assert leader.run(SwitchOrder(seq=seq, job_id="job-queues", ranks=(0, 1), ops=(True, False)),
                              kind=KIND_SWITCH, budget_s=5).ok
        assert support.wait_until(lambda: all(rank.events_handled == 4 for rank in ranks), 10)
    finally:
        for rank in ranks:
            rank.stop()
        relay.stop()
    assert not any(rank.running for rank in ranks)
    names = [name for name, _key in node.requests]
    if on_queues:
        assert "delete_key" not in names and "get" not in names, node.requests
        assert "set" not in names and "multi_set" not in names, node.requests  # no head, no counter, no key
        assert names.count("queue_push") >= 2 * 4  # the events to the two members, and their answers
    else:  # a get and, once answered, a delete per event; the relay deletes the epoch's keys
        assert names.count("delete_key") >= 2 * 4, node.requests


@pytest.mark.parametrize("on_queues", [True, False])
def test_a_stop_wakes_a_member_waiting_on_its_queue(on_queues: bool) -> None:
    store = InProcessStore()
    rank = member(KV(store, PREFIX, queues=on_queues))
    rank.start()
    assert support.wait_until(lambda: rank.running, 5)
    rank.stop()  # joins for up to stop_timeout_s (5 s); its idle wait is an hour
    assert not rank.running


@pytest.mark.parametrize("on_queues", [True, False])
def test_a_member_starting_late_begins_after_what_was_published_before_it(on_queues: bool) -> None:
    store = InProcessStore()
    kv = KV(store, PREFIX, queues=on_queues)
    stale = p.encode({"t": p.ORDER, "e": 1, "key": "1.1.switch", "kind": KIND_SWITCH, "budget": 5, "seq": 1,
                      **p.inline_order(p.encode_order(ORDER)), "n": 1})
    queues.publish(kv, 1, 1, stale)  # before the member started: not for it
    rank = member(KV(store, PREFIX, queues=on_queues))
    rank.start()
    try:
        queues.publish(kv, 1, 2, p.encode({"t": p.RELEASE, "e": 1, "stop": None, "cancel": False}))
        assert support.wait_until(lambda: rank.events_handled == 1, 10)
    finally:
        rank.stop()
    assert rank.events_handled == 1
    assert not kv.check([p.result_counter_key(1, "1.1.switch")])  # the stale order never ran


@pytest.mark.parametrize("on_queues", [True, False])
def test_a_relays_stop_never_loses_the_release_it_has_not_passed_on_yet(on_queues: bool) -> None:
    """The relay's queue above is a group Store's (queues) or the job's (keys); its stop wakes it
    through that queue and must not write over a release waiting there: the node's ranks would
    never hear that training goes on (or must stop)."""
    above, below = InProcessStore(), InProcessStore()
    up = KV(above, PREFIX, queues=on_queues)
    local = KV(below, PREFIX, queues=True)
    relay = NodeRelay(KV(above, PREFIX, queues=on_queues), KV(above, PREFIX, queues=on_queues), local, 0, [0, 1],
                      stop_timeout_s=5.0, local_wake=local)
    relay.start()
    release = {"t": p.RELEASE, "e": 1, "stop": None, "cancel": False}
    try:
        queues.publish(up, 1, 1, p.encode(release))
        assert support.wait_until(lambda: relay.events_relayed == 1, 10)
        queues.publish(up, 1, 2, p.encode({**release, "stop": "ClusterD chose exit"}))
    finally:
        relay.stop()  # at once: the second release may still be waiting in the relay's queue
    for slot in (0, 1):
        got = [queues.read(local, slot, n, 5.0) for n in (1, 2)]
        assert [p.decode(text)["stop"] for text in got if text is not None] == [None, "ClusterD chose exit"]


def test_the_node_and_group_stores_the_agent_hosts_have_queues_and_the_job_store_keeps_keys() -> None:
    job = KV(support.tcp_store(), PREFIX)
    hosted, keep = topology.node_kv(job, 0, 0, 10.0, 2)
    joined, _ = topology.node_kv(job, 0, 1, 10.0, 2)
    group, keep_group = topology.group_kv(job, 0, 2, hosts=True, timeout_s=10.0)
    try:
        assert not job.queues and hosted.queues and joined.queues and group.queues
        assert joined.clone().queues
        joined.push("q/5", "over the hosted Store")
        assert hosted.pop("q/5", 5.0) == "over the hosted Store"
        assert joined.pop("q/5", 0.2) is None  # empty: the bounded wait ends
    finally:
        del keep, keep_group


def test_an_in_process_job_has_in_process_node_stores_with_queues() -> None:
    job = KV(InProcessStore(), PREFIX)
    node, _ = topology.node_kv(job, 0, 0, 1.0)
    assert node.queues and not job.queues
    node.push("q/0", "a")
    node.push("q/0", "b")
    assert node.queued("q/0") == 2
    assert [node.pop("q/0", 1.0), node.pop("q/0", 1.0), node.pop("q/0", 0.05)] == ["a", "b", None]


@pytest.mark.parametrize("on_queues", [True, False])
def test_ranks_whose_step_was_never_called_are_named_through_their_relay(on_queues: bool) -> None:
    """A rank answers the pause before its training loop ever called step(): on keys it sets its
    nostep key, on a queue it says so in its answer; either way the leader's message names it."""
    job = InProcessStore()
    local = KV(InProcessStore(), PREFIX, queues=on_queues)
    relay = NodeRelay(KV(job, PREFIX), KV(job, PREFIX), local.clone(), 0, [0, 1], stop_timeout_s=5.0,
                      local_wake=local)
    relay.start()
    try:
        leader = Coordinator(KV(job, PREFIX), 1, ranks_per_node=2)
        pausing = leader.pause  # the target is published, nobody parks: the pause fails naming why
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.append(pausing(1.5)))
        thread.start()
        for slot in (0, 1):
            event = p.decode(queues.read(local, slot, 1, 10.0) or "")
            queues.answer_pause(local, int(event["e"]), slot, None if slot == 1 else 12, 2)
        thread.join(20)
    finally:
        relay.stop()
    assert outcome and not outcome[0].ok  # type: ignore[attr-defined]
    assert outcome[0].reason == ("node 0: rank(s) 0, 1 did not park at step 13; step() was never called on "  # type: ignore[attr-defined]
                                 "rank(s) 1")


def test_answers_a_failure_left_unread_are_dropped_when_the_switch_ends() -> None:
    """A failure decides an order before every rank's result was read; the rest stays in the
    phase's Store queue (a queue cannot be deleted) until the relay empties it at the release."""
    job = InProcessStore()
    node = InProcessStore()
    local = KV(node, PREFIX, queues=True)
    relay = NodeRelay(KV(job, PREFIX), KV(job, PREFIX), local.clone(), 0, [0, 1], stop_timeout_s=5.0,
                      local_wake=local)
    relay.start()
    try:
        leader = Coordinator(KV(job, PREFIX), 1, ranks_per_node=2)
        outcome: list[object] = []
        thread = threading.Thread(target=lambda: outcome.append(
            leader.run(ORDER, kind=KIND_SWITCH, budget_s=10)))
        thread.start()
        event = p.decode(queues.read(local, 0, 1, 10.0) or "")
        queues.answer_result(local, 1, str(event["key"]), p.MemberResult(0, False, "no"), 2)
        queues.answer_result(local, 1, str(event["key"]), p.MemberResult(1, True, "ok"), 2)  # behind it
        thread.join(20)  # decided by rank 0's failure, read first: a session, released at once
        told = [p.decode(queues.read(local, 0, n, 10.0) or "")["t"] for n in (2, 3)]
        assert told == [p.OUTCOME, p.RELEASE]  # a failure's outcome on its own, then the release
        late = queues.answers(1, f"res/{event['key']}")
        assert support.wait_until(lambda: local.queued(late) == 0, 10)
    finally:
        relay.stop()
    assert outcome and not outcome[0].ok  # type: ignore[attr-defined]
