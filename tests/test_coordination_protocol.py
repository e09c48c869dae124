"""The leader->member order encoding: exact round trips, the earlier JSON-list form, bad input."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator

import pytest
import support
from hypothesis import given
from hypothesis import strategies as st

from nicswitch_agent.coordination import KV, Coordinator, InProcessStore, Member, MemberHooks
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.kv import done_key
from nicswitch_agent.coordination.parking import ParkingLot, TrainingStopped
from nicswitch_agent.errors import InvalidOrder
from nicswitch_agent.orders import SwitchOrder

RANK = st.integers(min_value=0, max_value=999_999_999)  # orders.py accepts at most 9 digits


@given(st.lists(st.tuples(RANK, st.booleans()), max_size=200), st.integers(min_value=1, max_value=2**31))
def test_an_order_round_trips_exactly(entries: list[tuple[int, bool]], seq: int) -> None:
    order = SwitchOrder(seq=seq, job_id="job-ü/1", ranks=tuple(r for r, _ in entries),
                        ops=tuple(o for _, o in entries))
    decoded = p.decode_order(p.encode_order(order))
    assert (decoded.seq, decoded.job_id, decoded.ranks, decoded.ops) == (seq, "job-ü/1", order.ranks, order.ops)
    assert all(type(op) is bool for op in decoded.ops) and all(type(r) is int for r in decoded.ranks)


def test_a_large_order_round_trips_and_stays_compact() -> None:
    ranks = tuple(range(65_536))
    ops = tuple(r % 3 == 0 for r in ranks)
    text = p.encode_order(SwitchOrder(seq=1, job_id="j", ranks=ranks, ops=ops))
    assert len(text) < 8 * len(ranks)  # ~6.3 bytes per rank (base64 uint32 + one op character)
    decoded = p.decode_order(text)
    assert decoded.ranks == ranks and decoded.ops == ops


def test_the_earlier_json_list_form_is_still_read() -> None:
    text = json.dumps({"t": "o", "seq": 4, "job": "j", "ranks": [3, 2], "ops": [1, 0]})
    decoded = p.decode_order(text)
    assert (decoded.ranks, decoded.ops) == ((3, 2), (True, False))


JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                          max_leaves=12)


@given(st.dictionaries(st.text(), JSON_VALUE, max_size=6))
def test_a_message_encodes_as_json_dumps_does_and_decodes_as_json_loads_does(fields: dict[str, object]) -> None:
    """messages.py calls json's C encoder and scanner directly (no encoder built, no Python frames
    per message): the text and the value must be json's own, else levels of different versions
    disagree."""
    message = {"t": "pause", **fields}
    text = p.encode(message)
    assert text == json.dumps(message, separators=(",", ":"))
    assert json.dumps(p.decode(text)) == json.dumps(json.loads(text))  # NaN != NaN: compared as text


@pytest.mark.parametrize("text", ['{"t":"a"}', ' {"t":"a"}\n', '{"t":"a"}x', '{"t":"a"} {}', "", "[1]", '{"x":1}',
                                  '"t"', "nan", '{"t":1,"t":2}', '{"t":"\\u00e9"}', '{"t":"a"'])
def test_a_message_is_refused_exactly_where_json_loads_refuses_it_or_it_is_not_a_message(text: str) -> None:
    try:
        value = json.loads(text)
        expected = value if isinstance(value, dict) and "t" in value else None
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ValueError):
            p.decode(text)
    else:
        assert p.decode(text) == expected


def test_without_json_s_c_encoder_a_message_still_encodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p, "_C_ENCODE", None)
    assert p.encode({"t": "pause", "e": 1}) == '{"t":"pause","e":1}'


def test_mismatched_lengths_are_refused() -> None:
    good = json.loads(p.encode_order(SwitchOrder(seq=1, job_id="j", ranks=(1, 2), ops=(True, False))))
    good["ops"] = "1"
    with pytest.raises(InvalidOrder, match="differ in length"):
        p.decode_order(json.dumps(good))


def test_corrupt_rank_bytes_are_refused() -> None:
    bad = json.loads(p.encode_order(SwitchOrder(seq=1, job_id="j", ranks=(1, 2), ops=(True, False))))
    bad["ranks"] = "AAA"  # not base64 of whole uint32s
    with pytest.raises(ValueError):
        p.decode_order(json.dumps(bad))


class CountingStore(InProcessStore):
    """An in-process Store that records each request (name, keys) as a client would send it."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, tuple[str, ...]]] = []

    def set(self, key: str, value: str | bytes) -> None:
        self.requests.append(("set", (key,)))
        super().set(key, value)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.requests.append(("multi_set", tuple(keys)))
        super().multi_set(keys, values)

    def add(self, key: str, value: int) -> int:
        self.requests.append(("add", (key,)))
        return super().add(key, value)


@pytest.mark.parametrize(("expected", "ok"), [(2, True), (5, False)])
def test_the_deciding_answer_is_two_requests_its_result_before_its_done_key(expected: int, ok: bool) -> None:
    """The answer that completes the count (or a failure, which decides at once) is on the order's
    critical path: its result and the done key go in one request, the result first."""
    store = CountingStore()
    kv = KV(store, "t")
    p.publish_result(kv, 1, "1.1.switch", p.MemberResult(0, True, "ok"), expected)  # not deciding
    store.requests.clear()
    index = p.publish_result(kv, 1, "1.1.switch", p.MemberResult(1, ok, "ok" if ok else "no"), expected)
    counter = p.result_counter_key(1, "1.1.switch")
    assert index == 2
    assert store.requests == [("add", (f"t/{counter}",)),
                              ("multi_set", (f"t/{p.result_key(1, '1.1.switch', 2)}", f"t/{done_key(counter)}"))]
    results = list(p.arriving_results(kv, 1, "1.1.switch", expected, float("inf")))
    assert [r.rank for r in results] == [0, 1]


def test_an_event_is_one_request_every_queue_key_then_the_head() -> None:
    """Every event the leader (or a relay, the same way) publishes is on its phase's critical path."""
    store = CountingStore()
    leader = Coordinator(KV(store, "t"), 3)
    store.requests.clear()
    leader.release(stop_reason="ClusterD chose exit")
    queue = tuple(f"t/{p.queue_key(rank, 1)}" for rank in range(3))
    assert store.requests == [("multi_set", (*queue, f"t/{p.QUEUE_HEAD}"))]
    assert KV(store, "t").get(p.QUEUE_HEAD) == "1"


def test_a_member_answers_an_event_before_it_deletes_it() -> None:
    """The delete of a read queue key is a round trip: after the answer, off the phase's critical path."""

    class Recording(CountingStore):
        def delete_key(self, key: str) -> bool:
            self.requests.append(("delete_key", (key,)))
            return super().delete_key(key)

    store = Recording()
    kv = KV(store, "t")
    member = Member(kv, 0, ParkingLot(), MemberHooks(switch_hook=None, checkpoint_hook=None, guard_timeout_s=5,
                                                     switch_timeout_s=5, dry_run=False), lambda: 7)
    member.start()
    try:
        kv.set(p.queue_key(0, 1), p.encode({"t": p.PAUSE, "e": 1, "timeout": 30, "n": 1}))
        assert support.wait_until(lambda: ("delete_key", (f"t/{p.queue_key(0, 1)}",)) in store.requests, 10)
    finally:
        member.stop()
    names = [request for request in store.requests if request[0] in ("add", "delete_key")]
    assert names[:2] == [("add", (f"t/{p.c_counter_key(1)}",)), ("delete_key", (f"t/{p.queue_key(0, 1)}",))]


class _Rank:
    """One rank for the outcome tests: a Member on ``store`` and a training thread that steps
    while a pause is armed (pause mode agent), recording the member's events in order."""

    def __init__(self, store: InProcessStore, switch_ok: bool | Callable[[SwitchOrder], bool]) -> None:
        self.events: list[str] = []
        self.last: int | None = None
        self._go = threading.Event()
        self.lot = ParkingLot(on_armed=lambda armed: self._go.set() if armed else self._go.clear(),
                              on_event=lambda kind, _detail: self.events.append(kind))
        hook = switch_ok if callable(switch_ok) else lambda order: switch_ok
        self.member = Member(KV(store, "t"), 0, self.lot, MemberHooks(
            switch_hook=hook, checkpoint_hook=None, guard_timeout_s=5, switch_timeout_s=5,
            dry_run=False), lambda: self.last, on_event=lambda kind, _detail: self.events.append(kind))
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()
        self.member.start()

    def _train(self) -> None:
        step = 0
        with contextlib.suppress(TrainingStopped):  # released to stop: training ends here
            while True:
                step += 1
                self.last = step
                self.lot.at_step_boundary(step)
                self._go.wait()


def _queued(store: InProcessStore) -> list[dict[str, object]]:
    """The events in rank 0's queue that no member took (the leader's queue keys, in order)."""
    keys = [k for k in list(store.keys()) if k.startswith("t/q/0/")]
    return [p.decode(store.get(k).decode()) for k in sorted(keys, key=lambda k: int(k.rsplit("/", 1)[1]))]


def _paused_and_switched(*, switch_ok: bool) -> tuple[_Rank, Coordinator, bool]:
    """One rank parked by its leader (pause mode agent), then a switch order run: (the rank, the
    leader, whether the switch succeeded). The caller releases and stops the rank's member."""
    store = InProcessStore()
    rank = _Rank(store, switch_ok=switch_ok)
    leader = Coordinator(KV(store, "t"), 1)
    assert leader.pause(30).ok
    order = SwitchOrder(seq=3, job_id="j", ranks=(0,), ops=(True,))
    return rank, leader, leader.run(order, kind=p.KIND_SWITCH, budget_s=10).ok


def test_a_successful_outcome_rides_on_the_release_that_follows_it() -> None:
    """One event fewer per switch on every level: the ranks hear a success with the release (pause
    mode agent: after ClusterD's word), before they resume; no outcome event of its own."""
    rank, leader, ok = _paused_and_switched(switch_ok=True)
    try:
        assert ok
        assert support.wait_until(lambda: "member_result" in rank.events, 10)
        assert "switch_outcome" not in rank.events  # not yet: it waits for the release
        leader.release()
        assert support.wait_until(lambda: "resumed" in rank.events, 10)
        assert rank.events.index("switch_outcome") < rank.events.index("resumed")
    finally:
        rank.member.stop()


def test_a_failed_outcome_is_told_at_once_on_its_own() -> None:
    """After a failure the leader may wait for ClusterD's choice of strategy: the ranks hear it now."""
    rank, leader, ok = _paused_and_switched(switch_ok=False)
    try:
        assert not ok
        assert support.wait_until(lambda: "switch_outcome" in rank.events, 10)  # before any release
        assert "resumed" not in rank.events
        leader.release()
        assert support.wait_until(lambda: "resumed" in rank.events, 10)
        assert rank.events.count("switch_outcome") == 1
    finally:
        rank.member.stop()


@pytest.mark.parametrize(("hook_results", "rollback", "stops"), [
    ([True], False, False),  # switched on every rank: the links are where they were ordered
    ([False], False, True),  # failed (ClusterD's strategy not chosen yet): the links may have moved
    ([False, True], True, False),  # failed, then rolled back on every rank: back where they were
    ([False, False], True, True),  # the rollback failed too
])
def test_the_leaders_stop_stops_parked_training_only_when_the_links_may_have_moved(
        hook_results: list[bool], rollback: bool, stops: bool) -> None:
    store = InProcessStore()
    rank = _Rank(store, switch_ok=lambda order: hook_results.pop(0))
    leader = Coordinator(KV(store, "t"), 1)
    try:
        assert leader.pause(30).ok
        order = SwitchOrder(seq=3, job_id="j", ranks=(0,), ops=(True,))
        leader.run(order, kind=p.KIND_SWITCH, budget_s=10)
        if rollback:
            leader.run(SwitchOrder(seq=3, job_id="j", ranks=(0,), ops=(False,)), kind=p.KIND_ROLLBACK, budget_s=10)
        said = leader.release_at_stop("SIGTERM received")
        assert not leader.paused
        assert (said is not None) is stops, said
        if stops:
            assert said is not None and "the job's leader stopped (SIGTERM received) during a switch" in said
        assert support.wait_until(lambda: "resumed" in rank.events, 10)
        assert rank.lot.stop_requested() == said
        assert leader.release_at_stop("again") is None  # not paused any more: nothing to release
    finally:
        rank.member.stop()


def test_in_a_session_the_outcome_goes_with_its_release_and_a_failure_before_it() -> None:
    """Pause mode external: every order is a session of its own, released at once."""
    for ok, expected in ((True, [[p.ORDER], [p.RELEASE, p.OUTCOME]]),
                         (False, [[p.ORDER], [p.OUTCOME], [p.RELEASE]])):
        store = InProcessStore()
        leader = Coordinator(KV(store, "t"), 1)

        kv = KV(store, "t")

        def answer(ok: bool = ok, kv: KV = kv) -> None:
            event = p.decode(kv.get(p.queue_key(0, 1)))
            p.publish_result(kv, int(event["e"]), str(event["key"]), p.MemberResult(0, ok, "scripted"), 1)

        answering = threading.Thread(target=answer)
        answering.start()
        outcome = leader.run(SwitchOrder(seq=1, job_id="j", ranks=(0,), ops=(True,)), kind=p.KIND_SWITCH,
                             budget_s=5)
        answering.join(10)
        assert outcome.ok is ok
        seen = [[e["t"], *([e[p.CARRIED_OUTCOME]["t"]] if p.CARRIED_OUTCOME in e else [])]  # type: ignore[index]
                for e in _queued(store)]
        assert seen == expected


def test_a_rank_started_after_the_pause_refuses_the_order_without_running_a_hook() -> None:
    """A stranger's rank died mid-switch under a launcher, which restarted it; the rollback that
    followed reached the new process, not parked, and its switch hook ran next to its training.
    Orders of a paused epoch now say so ("p"), and a member that is not parked refuses them."""
    rank, leader, ok = _paused_and_switched(switch_ok=False)
    rank.member.stop()  # the process dies; a launcher starts a new one for the same rank
    calls: list[SwitchOrder] = []
    reborn = Member(KV(rank.member.kv.store, "t"), 0, ParkingLot(), MemberHooks(
        switch_hook=lambda order: calls.append(order) or True, checkpoint_hook=None, guard_timeout_s=5,
        switch_timeout_s=5, dry_run=False), lambda: 1)
    reborn.start()
    try:
        # Where it starts reading (after the events published before it) is read on its thread: the
        # order below must come after that, as it would for a process started well before it.
        assert support.wait_until(lambda: reborn._next > 1, 10)
        assert not ok
        outcome = leader.run(SwitchOrder(seq=3, job_id="j", ranks=(0,), ops=(False,)), kind=p.KIND_ROLLBACK,
                             budget_s=10)
        assert not outcome.ok and "started after the pause of this switch" in outcome.reason, outcome
        assert calls == []
        leader.release()
    finally:
        reborn.stop()


def test_in_a_session_an_unparked_member_runs_the_order() -> None:
    """Pause mode external: no pause of the agent's, so no rank is parked and the order runs."""

    class HeadRead(InProcessStore):
        """Tells when a reader has looked for the queue head: where it starts reading is known."""

        def __init__(self) -> None:
            super().__init__()
            self.head_read = threading.Event()

        def check(self, keys: list[str]) -> bool:
            found = super().check(keys)
            if any(key.endswith(p.QUEUE_HEAD) for key in keys):
                self.head_read.set()
            return found

    store = HeadRead()
    calls: list[SwitchOrder] = []
    member = Member(KV(store, "t"), 0, ParkingLot(), MemberHooks(
        switch_hook=lambda order: calls.append(order) or True, checkpoint_hook=None, guard_timeout_s=5,
        switch_timeout_s=5, dry_run=False), lambda: 1)
    member.start()
    try:
        assert store.head_read.wait(10)  # the order below comes after the member took its place
        outcome = Coordinator(KV(store, "t"), 1).run(SwitchOrder(seq=1, job_id="j", ranks=(0,), ops=(True,)),
                                                    kind=p.KIND_SWITCH, budget_s=10)
        assert outcome.ok and len(calls) == 1, outcome
    finally:
        member.stop()


def test_a_stop_that_cuts_an_order_or_a_pause_short_says_so_not_that_the_budget_ran_out() -> None:
    """The leader's stop wakes its wait: the ranks it then lacks did not answer 'before the agent
    stopped', not 'within the budget' (a stranger read a budget timeout into a 2 s old switch)."""
    store = InProcessStore()
    entered, release = threading.Event(), threading.Event()

    def slow_switch(order: SwitchOrder) -> bool:
        entered.set()
        return release.wait(30)

    rank = _Rank(store, switch_ok=slow_switch)
    leader = Coordinator(KV(store, "t"), 1)
    try:
        assert leader.pause(30).ok
        threading.Thread(target=lambda: (entered.wait(10), leader.wake()), daemon=True).start()
        outcome = leader.run(SwitchOrder(seq=3, job_id="j", ranks=(0,), ops=(True,)), kind=p.KIND_SWITCH,
                             budget_s=60)
        assert not outcome.ok and outcome.reason == "1 rank(s) did not answer before the agent stopped"
        assert leader.stopping
    finally:
        release.set()
        rank.member.stop()
    alone = Coordinator(KV(InProcessStore(), "t"), 1)  # nobody to answer its pause
    threading.Timer(0.05, alone.wake).start()
    pause = alone.pause(60)
    assert not pause.ok and pause.reason.startswith("the agent stopped before the pause completed ("), pause.reason


def test_a_member_thread_that_fails_unexpectedly_lets_training_go_on_and_says_why() -> None:
    """Safety net: an error no handler foresaw (a bug, not a lost Store) must not end the member
    thread silently with training parked, waiting for a word nobody will read."""

    class Broken(InProcessStore):
        armed = False

        def delete_key(self, key: str) -> bool:
            if self.armed:
                raise TypeError("a bug in the member's bookkeeping")
            return super().delete_key(key)

    store = Broken()
    rank = _Rank(store, switch_ok=True)
    leader = Coordinator(KV(store, "t"), 1)
    try:
        assert leader.pause(30).ok
        assert support.wait_until(lambda: rank.lot.parked, 10)
        store.armed = True  # the order is answered, then the member's delete of its queue key fails
        assert leader.run(SwitchOrder(seq=3, job_id="j", ranks=(0,), ops=(True,)), kind=p.KIND_SWITCH, budget_s=10).ok
        assert support.wait_until(lambda: bool(rank.member.lost), 10)
        assert "TypeError: a bug in the member's bookkeeping" in rank.member.lost
        assert support.wait_until(lambda: not rank.lot.parked, 10)
        assert support.wait_until(lambda: not rank.member.running, 10)
    finally:
        rank.member.stop()


def test_parked_names_the_leaders_pause_in_a_process_started_after_earlier_ones() -> None:
    """A process a launcher restarted counts its own parking requests from 1 while the leader is at
    pause 7: its parked event must say 7, as its pause_requested does, or the timeline puts its
    parking into another switch (found by an outside check after a torchrun restart)."""
    store = InProcessStore()
    events: list[tuple[str, dict[str, object]]] = []
    lot = ParkingLot(on_event=lambda kind, detail: events.append((kind, detail)))
    member = Member(KV(store, "t"), 0, lot, MemberHooks(switch_hook=None, checkpoint_hook=None, guard_timeout_s=5,
                                                        switch_timeout_s=5, dry_run=False), lambda: 3,
                    on_event=lambda kind, detail: events.append((kind, detail)))
    member.start()
    stepping = threading.Thread(target=lambda: lot.at_step_boundary(4), daemon=True)
    try:
        kv = KV(store, "t")
        kv.set(p.queue_key(0, 1), p.encode({"t": p.PAUSE, "e": 7, "timeout": 30, "n": 1}))
        assert support.wait_until(lambda: any(kind == "pause_requested" for kind, _ in events), 10)
        kv.set(p.queue_key(0, 2), p.encode({"t": p.TARGET, "e": 7, "S": 4, "timeout": 30, "n": 1}))
        stepping.start()
        assert support.wait_until(lambda: any(kind == "parked" for kind, _ in events), 10)
        assert lot.request_epoch == 1  # this process's own count
        assert [detail["epoch"] for kind, detail in events if kind in ("pause_requested", "parked")] == [7, 7]
    finally:
        lot.release()
        member.stop()
        stepping.join(10)


def test_a_failed_order_names_the_ranks_whose_success_the_leader_read_before_it() -> None:
    """What the link map needs after a failure (observability/links.py): ranks 1 and 2 answered
    True before rank 0's False decided the order; rank 3 was not heard. A verification's failure
    names none (tests/test_verify_go.py covers that round)."""
    store = InProcessStore()
    leader = Coordinator(KV(store, "t"), 4)
    kv = KV(store, "t")

    def orders() -> Iterator[dict[str, object]]:
        """The orders in rank 0's queue, as a member reads them (waiting for each event)."""
        index = 0
        while True:
            index += 1
            event = p.decode(kv.get(p.queue_key(0, index)))
            if event["t"] == p.ORDER:
                yield event

    def answer() -> None:
        events = orders()
        event = next(events)
        epoch, name = int(event["e"]), str(event["key"])
        for rank, ok in ((2, True), (1, True), (0, False)):
            p.publish_result(kv, epoch, name, p.MemberResult(rank, ok, "scripted", attempted=True), 4)
        # The next order: rank 3 refuses before any hook (not parked, say)
        event = next(events)
        p.publish_result(kv, int(event["e"]), str(event["key"]), p.MemberResult(3, False, "not parked"), 4)

    answering = threading.Thread(target=answer)
    answering.start()
    outcome = leader.run(SwitchOrder(seq=1, job_id="j", ranks=(0, 1, 2, 3), ops=(True,) * 4),
                         kind=p.KIND_ROLLBACK, budget_s=30)
    assert not outcome.ok and outcome.reason == "rank 0: scripted", outcome
    assert outcome.ok_ranks == frozenset({1, 2}) and not outcome.verify_failed
    assert outcome.unmoved_ranks == frozenset()  # rank 0's hook ran (attempted)
    told = [e for e in _queued(store) if e["t"] == p.OUTCOME]
    assert len(told) == 1 and told[0]["stands"] == 1  # a member's own success stands
    refused = leader.run(SwitchOrder(seq=2, job_id="j", ranks=(3,), ops=(True,)), kind=p.KIND_SWITCH, budget_s=30)
    answering.join(10)
    assert not refused.ok and refused.unmoved_ranks == frozenset({3}) and refused.ok_ranks == frozenset()
