"""NodeRelay (coordination/relay.py): one rank per node answers the leader for its node.

The leader's side is the real Coordinator (counting nodes); the node's ranks are played by hand on
the node's own Store, so each test decides exactly what every rank says and when. What the relay
must keep: the pause target is the largest completed step over every rank of the node (anything
smaller lets a rank pass the target: a deadlock in the next collective), a failure is forwarded at
once and names its rank, a success only once every rank of the node succeeded, and a silent rank
makes the node say which rank it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import support

from nicswitch_agent.coordination import KIND_SWITCH, KV, Coordinator, InProcessStore, queues
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.node_link import NodeHub, NodeLink
from nicswitch_agent.coordination.relay import NodeRelay
from nicswitch_agent.orders import SwitchOrder

pytestmark = pytest.mark.timeout(60)

PREFIX = "nicswitch/job-relay/0"
ORDER = SwitchOrder(seq=1, job_id="job-relay", ranks=(2, 3), ops=(True, True))


class Node:
    """One node: its relay, and its ranks' answers on the node's Store, written by the test: on
    keys, on queues, or through the node link (node_link.py: slot 0 on the relay's hub, as local
    rank 0's member, every other slot through a link of its own over a real Unix socket)."""

    def __init__(self, job_store: InProcessStore, node: int, ranks: list[int], *, way: str = "keys") -> None:
        # Slot 0's queue is the hub's own member's, as the agent hosts it (topology.node_kv): a
        # wait on it never reads the sockets, so a rank's link closing never ends it with GONE.
        hub = NodeHub(local_queue=f"{PREFIX}/{queues.queue_name(0)}") if way == "link" else InProcessStore()
        self.local = KV(hub, PREFIX, queues=way != "keys")
        self.relay = NodeRelay(KV(job_store, PREFIX), KV(job_store, PREFIX), self.local, node, ranks,
                               stop_timeout_s=2.0, local_wake=self.local)
        self.ranks = ranks
        self.read = [0] * len(ranks)  # the local queue index each rank has read
        self.views = [self.local] + [  # where each slot reads and answers
            KV(NodeLink(hub.address, self.local.prefix + queues.queue_name(slot), 5.0), PREFIX, queues=True)
            if isinstance(hub, NodeHub) else self.local for slot in range(1, len(ranks))]

    @classmethod
    def played_on(cls, local: KV, ranks: list[int]) -> Node:
        """The ranks of a node whose Store and relay exist already (tests/test_fan_out.py's)."""
        node = cls.__new__(cls)
        node.local, node.ranks, node.read = local, ranks, [0] * len(ranks)
        node.views = [local] * len(ranks)
        return node

    def next_event(self, slot: int, timeout: float = 10.0) -> dict[str, Any]:
        """What the relay published to local rank ``slot`` next (as a member reads it)."""
        self.read[slot] += 1
        text = queues.read(self.views[slot], slot, self.read[slot], timeout)
        assert text is not None, f"no event {self.read[slot]} for slot {slot}"
        return p.decode(text)

    def completed(self, slot: int, epoch: int, step: int) -> None:
        # As a member: on keys the last one sets the done key; on a Store with queues, a push.
        queues.answer_pause(self.views[slot], epoch, slot, step, len(self.ranks))

    def parked(self, slot: int, epoch: int, step: int) -> None:
        queues.answer_parked(self.views[slot], epoch, slot, step, len(self.ranks))

    def result(self, slot: int, event: dict[str, Any], ok: bool, reason: str = "ok") -> None:
        epoch, name = int(event["e"]), str(event["key"])
        queues.answer_result(self.views[slot], epoch, name, p.MemberResult(self.ranks[slot], ok, reason, attempted=True,
                                                                     guard_ok=ok), int(event["n"]))


@pytest.fixture(params=["keys", "queues", "link"])
def job(request: pytest.FixtureRequest) -> Iterator[tuple[InProcessStore, Coordinator, list[Node], ThreadPoolExecutor]]:
    """The leader on the job's Store and two node relays, each node's Store with keys, with
    queues, or the node link (as the agent hosts them): every test holds for each."""
    store = InProcessStore()
    nodes = [Node(store, 0, [0, 1], way=request.param), Node(store, 1, [2, 3], way=request.param)]
    for node in nodes:
        node.relay.start()
    leader = Coordinator(KV(store, PREFIX), 2, ranks_per_node=2)
    pool = ThreadPoolExecutor(2)
    yield store, leader, nodes, pool
    pool.shutdown(wait=False, cancel_futures=True)
    for node in nodes:
        node.relay.stop()


def pause_every_node(nodes: list[Node], steps: dict[int, int]) -> int:
    """Every rank answers the pause with its completed step; returns the epoch."""
    epoch = 0
    for node in nodes:
        for slot, rank in enumerate(node.ranks):
            event = node.next_event(slot)
            assert event["t"] == p.PAUSE
            epoch = int(event["e"])
            node.completed(slot, epoch, steps[rank])
    return epoch


def every_rank_but_3_succeeds(nodes: list[Node]) -> list[list[dict[str, Any]]]:
    """Every rank reads the order; ranks 0, 1 and 2 answer success. Returns the events read."""
    events = [[node.next_event(slot) for slot in range(2)] for node in nodes]
    for slot in range(2):
        nodes[0].result(slot, events[0][slot], True)
    nodes[1].result(0, events[1][0], True)
    return events


def test_the_target_is_the_largest_completed_step_over_every_rank_of_every_node(job: Any) -> None:
    _store, leader, nodes, pool = job
    pausing: Future[Any] = pool.submit(leader.pause, 30.0)
    steps = {0: 40, 1: 41, 2: 39, 3: 47}  # rank 3, second on its node, is furthest
    epoch = pause_every_node(nodes, steps)
    for node in nodes:
        for slot in range(2):
            target = node.next_event(slot)
            assert target["t"] == p.TARGET and target["S"] == 48  # max over every rank, plus one
            node.parked(slot, epoch, 48)
    outcome = pausing.result(20)
    assert outcome.ok and outcome.step == 48


def test_a_failure_is_forwarded_at_once_and_names_its_rank(job: Any) -> None:
    _store, leader, nodes, pool = job
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=300.0)
    events = [[node.next_event(slot) for slot in range(2)] for node in nodes]
    assert all(e["t"] == p.ORDER for pair in events for e in pair)
    nodes[1].result(1, events[1][1], False, "switch hook returned False")  # rank 3; rank 2 never answers
    outcome = running.result(20)  # long before the 300 s budget
    assert not outcome.ok and outcome.reason == "rank 3: switch hook returned False"


def test_a_node_succeeds_only_once_every_rank_of_it_succeeded(job: Any) -> None:
    store, leader, nodes, pool = job
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=300.0)
    events = every_rank_but_3_succeeds(nodes)  # rank 3 not yet
    epoch, name = int(events[0][0]["e"]), str(events[0][0]["key"])
    job_kv = KV(store, PREFIX)
    # Node 0 answered once for both of its ranks; node 1 says nothing while rank 3 is still out.
    assert support.wait_until(lambda: job_kv.count(p.result_counter_key(epoch, name)) == 1, 10)
    assert not running.done()
    assert job_kv.count(p.result_counter_key(epoch, name)) == 1
    nodes[1].result(1, events[1][1], True)
    outcome = running.result(20)
    assert outcome.ok and outcome.guard_ok  # every rank of every node checkpointed


def test_a_failed_order_names_every_rank_of_the_nodes_that_succeeded_and_none_of_the_failed_one(job: Any) -> None:
    """The link map's knowledge after a failure (observability/links.py): node 0 answered for both
    its ranks before rank 3's failure decided; node 1 answers once, failing, so its rank 2's own
    success never reaches the leader (that rank's own map knows it)."""
    store, leader, nodes, pool = job
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=300.0)
    events = every_rank_but_3_succeeds(nodes)
    epoch, name = int(events[0][0]["e"]), str(events[0][0]["key"])
    assert support.wait_until(lambda: KV(store, PREFIX).count(p.result_counter_key(epoch, name)) == 1, 10)
    nodes[1].result(1, events[1][1], False, "switch hook returned False")
    outcome = running.result(20)
    assert not outcome.ok and outcome.reason == "rank 3: switch hook returned False"
    assert outcome.ok_ranks == frozenset({0, 1})


def test_a_silent_rank_makes_its_node_say_which_rank_and_the_pause_fails_naming_it(job: Any) -> None:
    _store, leader, nodes, pool = job
    pausing: Future[Any] = pool.submit(leader.pause, 1.0)
    for node in nodes:
        for slot, rank in enumerate(node.ranks):
            event = node.next_event(slot)
            if rank != 3:  # rank 3's member is gone
                node.completed(slot, int(event["e"]), 10)
    outcome = pausing.result(20)
    assert not outcome.ok
    assert outcome.reason == "node 1: no answer to the pause from rank(s) 3"
    for node in nodes:  # the pause is withdrawn on every rank
        for slot in range(2):
            assert node.next_event(slot)["t"] == p.RELEASE


def test_a_node_whose_relay_is_gone_is_named_with_its_ranks(job: Any) -> None:
    _store, leader, nodes, _pool = job
    nodes[1].relay.stop()
    pausing = threading.Thread(target=lambda: results.append(leader.pause(0.5)))
    results: list[Any] = []
    pausing.start()
    for slot in range(2):
        nodes[0].completed(slot, int(nodes[0].next_event(slot)["e"]), 5)
    pausing.join(20)
    assert results and not results[0].ok
    assert results[0].reason == "node 1 (ranks 2-3) did not answer"


def test_a_rank_silent_during_an_order_fails_its_node_within_the_budget_naming_the_rank(job: Any) -> None:
    _store, leader, nodes, pool = job
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=0.2)
    every_rank_but_3_succeeds(nodes)  # rank 3 never answers (its member is gone)
    outcome = running.result(20)
    assert not outcome.ok
    assert outcome.reason == "rank 3: did not answer within the budget (1 rank(s) of node 1: 3)"


def test_an_order_the_leader_already_decided_is_skipped_not_waited_for(job: Any) -> None:
    """A relay an epoch behind reads an order event whose key the leader has deleted since: it
    must go on to the next event at once (a get would wait an hour for the key)."""
    store, _leader, nodes, _pool = job
    kv = KV(store, PREFIX)
    node = nodes[1]
    stale = {"t": p.ORDER, "e": 9, "key": "9.7.switch", "kind": KIND_SWITCH, "budget": 300.0}
    after = {"t": p.RELEASE, "e": 9, "stop": None, "cancel": False}
    kv.set(p.queue_key(1, 1), p.encode(stale))  # no o/9.7.switch: deleted with its epoch
    kv.set(p.queue_key(1, 2), p.encode(after))
    assert node.next_event(0, timeout=10)["t"] == p.RELEASE  # the stale order never reached the ranks


def test_the_leaders_drain_returns_only_once_every_rank_behind_every_relay_took_the_stop(job: Any) -> None:
    """Rank 0 may host the Store: its process must not end (draining at stop) before every rank has
    read that training must stop. A relay deletes the leader's key only once its ranks took it."""
    _store, leader, nodes, pool = job
    leader.drain_s = 30.0
    leader.release(stop_reason="ClusterD is killing the job")
    draining: Future[Any] = pool.submit(leader.drain)
    taken = []
    for node in nodes:
        for slot in range(2):
            if (node.relay.node, slot) == (1, 1):
                continue  # rank 3 has not read it yet
            event = node.next_event(slot)
            assert event["t"] == p.RELEASE and event["stop"] == "ClusterD is killing the job"
            queues.done(node.local, slot, node.read[slot])  # as a member does once it read it
            taken.append(node.ranks[slot])
    assert taken == [0, 1, 2]
    node = nodes[1]
    if isinstance(node.local.store, NodeHub):
        # Over the node link an event is the rank's once sent: it is in the rank's socket, which
        # keeps it after the relay's process (the hub) is gone. So the drain need not wait for rank 3.
        draining.result(10)
        node.local.store.close()
        assert node.next_event(1)["stop"] == "ClusterD is killing the job"
        return
    with pytest.raises(TimeoutError):
        draining.result(0.3)  # node 1's relay still waits for rank 3, so the leader's key is still there
    node.next_event(1)
    queues.done(node.local, 1, node.read[1])
    draining.result(10)


def test_stop_wakes_a_relay_blocked_waiting_for_its_ranks(job: Any) -> None:
    """A relay blocks (no polling) until its ranks' last answer sets the phase's done key; stop()
    must end that wait by setting the key itself, not leave the thread blocked for the phase."""
    _store, leader, nodes, pool = job
    pausing: Future[Any] = pool.submit(leader.pause, 3600.0)
    relay = nodes[0].relay
    assert support.wait_until(lambda: relay._wake.key is not None, 10)  # blocked on its ranks' answers
    relay.stop()
    assert not relay.running
    leader.wake()  # and the leader, blocked on the nodes' answers, is woken the same way
    outcome = pausing.result(20)  # long before the hour
    assert not outcome.ok


def test_the_leaders_wake_ends_a_wait_for_results(job: Any) -> None:
    _store, leader, nodes, pool = job
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=3600.0)
    every_rank_but_3_succeeds(nodes)
    assert support.wait_until(lambda: leader._wake.key is not None, 10)
    leader.wake()
    outcome = running.result(20)
    assert not outcome.ok and "did not answer" in outcome.reason


# -- the node link knows a rank is gone (its link closed): its node fails the phase at once ----------


@pytest.fixture
def linked() -> Iterator[tuple[Coordinator, list[Node], ThreadPoolExecutor]]:
    store = InProcessStore()
    nodes = [Node(store, 0, [0, 1], way="link"), Node(store, 1, [2, 3], way="link")]
    for node in nodes:
        node.relay.start()
    pool = ThreadPoolExecutor(2)
    leader = Coordinator(KV(store, PREFIX), 2, ranks_per_node=2)
    yield leader, nodes, pool
    leader.wake()  # a wait a failed test left behind ends now, not in an hour
    pool.shutdown(wait=False, cancel_futures=True)
    for node in nodes:
        node.relay.stop()


def test_a_rank_gone_during_the_pause_fails_the_pause_at_once_naming_the_rank(linked: Any) -> None:
    """The relay stops waiting for a rank whose link closed, writes why, and ends the leader's
    wait (queues.fail_early): the pause fails now, not at its timeout (an hour here)."""
    leader, nodes, pool = linked
    pausing: Future[Any] = pool.submit(leader.pause, 3600.0)
    epoch = 0
    for node in nodes:
        for slot, rank in enumerate(node.ranks):
            event = node.next_event(slot)
            epoch = int(event["e"])
            if rank != 3:
                node.completed(slot, epoch, 10)
    hub = nodes[1].local.store
    # Rank 2's answer taken, node 1's relay reads the sockets for rank 3's: only the link's end can wake it.
    assert support.wait_until(lambda: hub._reading and not hub._queues.get(queues.answers(epoch, "c")), 20)
    nodes[1].views[1].store.close()  # rank 3's process ends: its socket closes
    job = KV(nodes[1].relay.job.store, PREFIX)
    assert support.wait_until(lambda: job.check([p.why_key(epoch, 1)]), 20)  # not the hour
    assert job.get(p.why_key(epoch, 1)) == ("no answer to the pause from rank(s) 3; rank(s) 3 gone: their link to "
                                             "the relay closed (the process ended, or its agent stopped)")
    outcome = pausing.result(20)
    assert not outcome.ok
    # Node 0's answer may still be on its way when node 1 ends the wait: then it is named as such
    said = "node 1: no answer to the pause from rank(s) 3; rank(s) 3 gone: their link to the relay closed (the " \
        "process ended, or its agent stopped)"
    assert outcome.reason in (said, said + "; node 0 (ranks 0-1) had not answered yet"), outcome.reason


def test_a_rank_whose_agent_stopped_while_its_process_lives_is_gone_for_the_next_pause(linked: Any) -> None:
    """A rank's stop wakes its member's blocking recv by shutting its link's reading side
    (node_link.py): the hub's next send to it fails, so the next pause fails at once naming the
    rank instead of waiting its whole timeout (an hour here) for a member that stopped."""
    leader, nodes, pool = linked
    rank3 = nodes[1].views[1].store
    reading = pool.submit(rank3.queue_pop_within, f"{PREFIX}/{queues.queue_name(1)}", 30.0)  # (bounded: a pool thread)
    assert support.wait_until(lambda: rank3._reading, 20)
    rank3.queue_push(f"{PREFIX}/{queues.queue_name(1)}", "wake")  # Member.stop(): its own queue's wake
    assert reading.result(20) == b"wake"
    pausing: Future[Any] = pool.submit(leader.pause, 3600.0)
    for node in nodes:
        for slot, rank in enumerate(node.ranks):
            if rank != 3:  # the others answer; rank 3's event found its link shut
                node.completed(slot, int(node.next_event(slot)["e"]), 10)
    outcome = pausing.result(20)
    assert not outcome.ok
    assert "rank(s) 3 gone: their link to the relay closed (the process ended, or its agent stopped)" in \
        outcome.reason, outcome.reason


def test_a_rank_gone_before_it_parked_fails_the_pause_at_once_naming_the_rank(linked: Any) -> None:
    leader, nodes, pool = linked
    pausing: Future[Any] = pool.submit(leader.pause, 3600.0)
    for node in nodes:
        for slot in range(2):
            node.completed(slot, int(node.next_event(slot)["e"]), 10)
    for node in nodes:
        for slot, rank in enumerate(node.ranks):
            event = node.next_event(slot)
            assert event["t"] == p.TARGET and event["S"] == 11
            if rank != 3:
                node.parked(slot, int(event["e"]), 11)
    nodes[1].views[1].store.close()  # rank 3's process ends before it parked
    outcome = pausing.result(20)
    assert not outcome.ok
    assert outcome.reason.startswith("node 1: rank(s) 3 did not park at step 11"), outcome.reason
    # Node 0 may not have answered when node 1 ended the wait: it was not late, only slower
    assert "node 0 (ranks 0-1) did not answer" not in outcome.reason, outcome.reason


def test_a_rank_gone_before_an_order_fails_it_at_once_naming_the_rank(linked: Any) -> None:
    leader, nodes, pool = linked
    nodes[1].views[1].store.close()  # rank 3 is gone before the order comes
    running: Future[Any] = pool.submit(leader.run, ORDER, kind=KIND_SWITCH, budget_s=3600.0)
    events = [[node.next_event(slot) for slot in range(2)] for node in nodes[:1]] + [[nodes[1].next_event(0)]]
    for slot in range(2):
        nodes[0].result(slot, events[0][slot], True)
    nodes[1].result(0, events[1][0], True)
    outcome = running.result(30)
    assert not outcome.ok
    assert outcome.reason == "rank 3: gone, the link to the relay closed (1 rank(s) of node 1: 3)"


@pytest.mark.parametrize("way", ["queues", "link"])
@pytest.mark.parametrize("stopping", [False, True], ids=["running", "after-a-stop"])
def test_a_relay_that_loses_the_jobs_store_tells_its_ranks_at_once(
        way: str, stopping: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The job's Store is gone (its host died): the node's members, which read only the node's
    Store, hear it from their relay at once and let training go on, as flat members do; parked,
    they would otherwise wait out max_parked_s (30 min). An ERROR each, unless training had been
    told to stop first (killMaster, a dump): the job is ending, its Stores' hosts with it."""
    import datetime
    import logging

    from nicswitch_agent.coordination import Member, MemberHooks
    from nicswitch_agent.coordination.parking import ParkingLot

    dist = pytest.importorskip("torch.distributed")
    server, port = support.store_server_process()
    started: list[int] = []
    relay: NodeRelay | None = None
    members: list[Member] = []
    try:

        def job_kv() -> KV:
            return KV(dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30)), PREFIX)

        hub = NodeHub(local_queue=f"{PREFIX}/{queues.queue_name(0)}") if way == "link" else InProcessStore()
        local = KV(hub, PREFIX, queues=True)
        views = [local, KV(NodeLink(hub.address, local.prefix + queues.queue_name(1), 5.0), PREFIX, queues=True)
                 if isinstance(hub, NodeHub) else local]
        relay = NodeRelay(job_kv(), job_kv(), local, 0, [0, 1], stop_timeout_s=2.0, local_wake=local)
        hooks = MemberHooks(switch_hook=None, checkpoint_hook=None, guard_timeout_s=5, switch_timeout_s=5,
                            dry_run=False)
        members = [Member(views[slot], slot, ParkingLot(), hooks, lambda: 1, slot=slot,
                          on_started=lambda slot=slot: started.append(slot)) for slot in range(2)]
        for member in members:
            member.start()
        relay.start()
        assert support.wait_until(lambda: len(started) == 2, 20)  # both read their queue: they will see the event
        if stopping:  # the leader tells training to stop (as on killMaster); its process then ends
            queues.publish(job_kv(), 1, queues.start(job_kv(), 0),
                           p.encode({"t": p.RELEASE, "e": 0, "stop": "ClusterD is killing the job", "cancel": False}))
            assert support.wait_until(lambda: all(m.events_handled == 1 for m in members) and
                                      relay.events_relayed == 1, 20)
        with caplog.at_level(logging.INFO, logger="nicswitch_agent.coordination"):
            server.kill()
            server.wait(10)
            assert support.wait_until(lambda: all(member.lost for member in members) and not relay.running, 20)
        for member in members:
            assert member.lost.startswith("LevelLost: the relay of node 0 lost the Store above it: "), member.lost
        assert relay.lost and not relay.running
        lost = [r for r in caplog.records if "coordination store lost" in r.getMessage()]
        assert len(lost) == 3, [r.getMessage() for r in lost]  # the relay's line, one per member
        assert {r.levelno for r in lost} == {logging.INFO if stopping else logging.ERROR}, \
            [(r.levelname, r.getMessage()) for r in lost]
    finally:
        server.kill()
        for member in members:
            member.stop()
        if relay is not None:
            relay.stop()


@pytest.mark.parametrize("how", ["on-purpose", "vanished"])
def test_a_member_whose_relay_stopped_on_purpose_says_so_without_an_error(
        how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Local rank 0's agent stopping (its process ending, a whole job's Ctrl-C) closes the node
    link and says why: the node's other ranks lose coordination (status shows it) and log it at
    INFO, as the stop it is. A hub that vanishes without a word is still an ERROR."""
    import logging

    from nicswitch_agent.coordination import Member, MemberHooks
    from nicswitch_agent.coordination.parking import ParkingLot

    hub = NodeHub(local_queue=f"{PREFIX}/{queues.queue_name(0)}")
    view = KV(NodeLink(hub.address, f"{PREFIX}/{queues.queue_name(1)}", 5.0), PREFIX, queues=True)
    hooks = MemberHooks(switch_hook=None, checkpoint_hook=None, guard_timeout_s=5, switch_timeout_s=5, dry_run=False)
    started = threading.Event()
    member = Member(view, 1, ParkingLot(), hooks, lambda: 1, slot=1, on_started=started.set)
    member.start()
    try:
        assert started.wait(20)
        with caplog.at_level(logging.INFO, logger="nicswitch_agent.coordination"):
            hub.close("local rank 0's agent stopped (signal SIGINT)" if how == "on-purpose" else "")
            # (the line, not member.lost: the member sets lost just before it logs)
            assert support.wait_until(lambda: any("coordination store lost" in r.getMessage()
                                                  for r in caplog.records), 20)
        lost = [r for r in caplog.records if "coordination store lost" in r.getMessage()]
        assert len(lost) == 1, [r.getMessage() for r in lost]
        if how == "on-purpose":
            assert member.lost == ("LinkClosed: the node's relay (local rank 0) stopped: local rank 0's agent "
                                   "stopped (signal SIGINT)"), member.lost
            assert lost[0].levelno == logging.INFO
        else:
            assert member.lost.startswith("LinkLost: the node's relay (local rank 0) is gone"), member.lost
            assert lost[0].levelno == logging.ERROR
    finally:
        member.stop()
        hub.close()


def test_a_node_relays_early_failure_reaches_the_leader_through_its_group_relay() -> None:
    """A node relay that knows its pause cannot complete says so on its group's Store
    (queues.fail_early); the group relay passes it on at once, with the node's why."""
    from nicswitch_agent.coordination.topology import Layout

    store = InProcessStore()
    group = KV(InProcessStore(), PREFIX, queues=True)  # the group's Store; its two node relays played here
    relay = NodeRelay(KV(store, PREFIX), KV(store, PREFIX), group, 0, [0, 2], stop_timeout_s=2.0, local_wake=group,
                      names=["0 (ranks 0-1)", "1 (ranks 2-3)"], label="group 0")
    relay.start()
    leader = Coordinator(KV(store, PREFIX), 1, layout=Layout(4, 2, 2))
    pool = ThreadPoolExecutor(1)
    try:
        pausing: Future[Any] = pool.submit(leader.pause, 3600.0)
        events = [p.decode(queues.read(group, slot, 1, 10.0) or "") for slot in range(2)]
        epoch = int(events[0]["e"])
        queues.answer_pause(group, epoch, 0, 10, int(events[0]["n"]))
        group.set(p.why_key(epoch, 1), "no answer to the pause from rank(s) 3; rank(s) 3 gone")
        queues.fail_early(group, epoch, "c", 1)
        outcome = pausing.result(20)
        assert not outcome.ok
        assert outcome.reason == ("group 0: no answer to the pause from node(s) 1 (ranks 2-3) (node 1 (ranks 2-3): "
                                  "no answer to the pause from rank(s) 3; rank(s) 3 gone)")
    finally:
        leader.wake()
        pool.shutdown(wait=False, cancel_futures=True)
        relay.stop()


def test_a_group_relay_that_loses_the_jobs_store_tells_every_rank_of_its_group_through_the_node_relays() -> None:
    """Two levels: the group relay tells its node relays, each of which is then lost too and tells
    its ranks, naming the whole chain."""
    import datetime

    from nicswitch_agent.coordination import Member, MemberHooks
    from nicswitch_agent.coordination.parking import ParkingLot

    dist = pytest.importorskip("torch.distributed")
    server, port = support.store_server_process()
    started: list[int] = []
    relays: list[NodeRelay] = []
    members: list[Member] = []
    try:

        def job_kv() -> KV:
            return KV(dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30)), PREFIX)

        group = KV(InProcessStore(), PREFIX, queues=True)
        nodes = [KV(InProcessStore(), PREFIX, queues=True) for _ in range(2)]
        relays.append(NodeRelay(job_kv(), job_kv(), group, 0, [0, 2], stop_timeout_s=2.0, local_wake=group,
                                names=["0 (ranks 0-1)", "1 (ranks 2-3)"], label="group 0"))
        relays += [NodeRelay(group, group, nodes[n], n, [2 * n, 2 * n + 1], stop_timeout_s=2.0, local_wake=nodes[n],
                             label=f"node {n}") for n in range(2)]
        hooks = MemberHooks(switch_hook=None, checkpoint_hook=None, guard_timeout_s=5, switch_timeout_s=5,
                            dry_run=False)
        members = [Member(nodes[rank // 2], rank, ParkingLot(), hooks, lambda: 1, slot=rank % 2,
                          on_started=lambda rank=rank: started.append(rank)) for rank in range(4)]
        for member in members:
            member.start()
        assert support.wait_until(lambda: len(started) == 4, 20)
        for relay in relays[1:]:
            relay.start()
        for n in range(2):  # a wake taken (or dropped by its start): the node relay reads its queue from now on
            queues.wake(group, n, 1, keep_event=True)
        assert support.wait_until(lambda: all(group.queued(queues.queue_name(n)) == 0 for n in range(2)), 20)
        relays[0].start()
        server.kill()
        server.wait(10)
        assert support.wait_until(lambda: all(member.lost for member in members), 20)
        for member in members:
            assert member.lost.startswith(f"LevelLost: the relay of node {member.rank // 2} lost the Store above it: "
                                          "LevelLost: the relay of group 0 lost the Store above it: "), member.lost
        assert all(relay.lost and not relay.running for relay in relays)
    finally:
        server.kill()
        for member in members:
            member.stop()
        for relay in relays:
            relay.stop()
