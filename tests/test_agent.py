"""SwitchAgent against a scripted ClusterD on loopback: the switch loop in pause mode external."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from scripted import Answer, End, Fail, Hold, ScriptedClusterD, Send, WaitFor, rank_list
from support import Events

from nicswitch_agent import AgentStateError, ConfigError, SwitchAgent, SwitchOrder
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.status_file import StatusFileWriter, format_summary, read_status

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """A switch hook that records every order and answers ``result``."""

    def __init__(self, result: Any = True) -> None:
        self.orders: list[SwitchOrder] = []
        self.result = result
        self.called = threading.Event()

    def __call__(self, order: SwitchOrder) -> Any:
        self.orders.append(order)
        self.called.set()
        return self.result


@pytest.fixture
def make_agent(clusterd: ScriptedClusterD) -> Iterator[Any]:
    agents: list[SwitchAgent] = []

    def make(**kwargs: Any) -> SwitchAgent:
        kwargs.setdefault("server", clusterd.address)
        kwargs.setdefault("pause", "external")
        kwargs.setdefault("job_id", "job-1")
        kwargs.setdefault("reconnect_initial_s", 0.01)
        kwargs.setdefault("reconnect_max_s", 0.05)
        seen = Events()
        agent = SwitchAgent(**kwargs)
        agent.add_listener(seen)
        agent.seen = seen  # type: ignore[attr-defined]
        agents.append(agent)
        return agent.start()

    yield make
    for agent in agents:
        agent.stop()


def replies_of(clusterd: ScriptedClusterD, agent: SwitchAgent, count: int) -> list[Any]:
    """Wait until the agent has settled ``count`` replies, then return what the server got."""
    seen: Events = agent.seen  # type: ignore[attr-defined]
    assert seen.wait_for(lambda: len(seen.of(ev.REPLY_SENT)) + len(seen.of(ev.REPLY_FAILED)) >= count, 10), seen.kinds
    return clusterd.wait_replies(count)


def kinds(agent: SwitchAgent) -> list[str]:
    return [e.kind for e in agent.events()]


def test_happy_path_switches_full_list_in_received_order_and_replies_true_once(
    clusterd: ScriptedClusterD, make_agent: Any
) -> None:
    clusterd.script(Send(rank_list(["0"], [True])), End())
    hook = Recorder()
    agent = make_agent(switch_hook=hook)
    replies = replies_of(clusterd, agent, 1)
    assert [(r.jobId, r.result) for r in replies] == [("job-1", True)]
    assert hook.orders[0].ranks == (0,)  # one process: a job of one rank (test_multirank.py has longer lists)
    assert hook.orders[0].ops == (True,)
    assert hook.orders[0].job_id == "job-1"
    # ClusterD ends the stream after every switch: the agent must come straight back.
    assert clusterd.wait_for(lambda s: s.opens >= 2 and s.open_now == 1)
    assert clusterd.client_infos[0].jobId == "job-1"
    assert clusterd.client_infos[0].role == "nicswitch-agent"
    status = agent.status()
    assert status["counters"]["replies_delivered"] == 1
    assert status["counters"]["switches_ok"] == 1
    assert status["last_switch"]["result"] is True
    assert ev.SUBSCRIBED in kinds(agent)  # once per open: its place among the others is a race
    # agent_started is emitted as start() returns: a list the server sends at once may come first
    # (seen with two test workers). switch_outcome (the member hearing the decision) races with
    # the leader's own events.
    assert kinds(agent).count(ev.AGENT_STARTED) == 1
    racing = (ev.SUBSCRIBED, ev.SWITCH_OUTCOME, ev.AGENT_STARTED)
    assert [k for k in kinds(agent) if k not in racing][:5] == [
        ev.LIST_RECEIVED, ev.GUARD_DONE, ev.MEMBER_RESULT, ev.SWITCH_DONE, ev.REPLY_SENT]
    assert len(clusterd.replies) == 1


def test_two_switches_in_a_row_each_get_one_reply(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    clusterd.script(Send(rank_list(["0"], [True])), End())
    clusterd.script(Send(rank_list(["0"], [False])), End())
    hook = Recorder()
    agent = make_agent(switch_hook=hook)
    replies = replies_of(clusterd, agent, 2)
    assert [r.result for r in replies] == [True, True]
    assert [o.ops for o in hook.orders] == [(True,), (False,)]
    assert [o.seq for o in hook.orders] == [1, 2]
    assert clusterd.wait_for(lambda s: s.opens >= 3)
    assert len(clusterd.replies) == 2


def test_resubscribes_after_not_registered_unavailable_and_qps_errors(
    clusterd: ScriptedClusterD, make_agent: Any
) -> None:
    clusterd.script(Fail(grpc.StatusCode.UNKNOWN, "jobId=job-1 not registed, please wait agent register"))
    clusterd.script(Fail(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    clusterd.script(Fail(grpc.StatusCode.UNKNOWN, "qps exceeded, method=/Recover/SubscribeNotifySwitch"))
    clusterd.script(Fail(grpc.StatusCode.INTERNAL, "Exception deserializing response!"))
    clusterd.script(Send(rank_list(["0"], [True])), End())
    hook = Recorder()
    agent = make_agent(switch_hook=hook)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]
    assert clusterd.opens >= 5
    status = agent.status()
    assert status["stream"]["errors"] == 4
    assert ev.STREAM_LOST in kinds(agent) and ev.STREAM_RESTORED in kinds(agent)


def test_unimplemented_stops_the_subscriber_and_marks_the_agent_failed(
    clusterd: ScriptedClusterD, make_agent: Any
) -> None:
    clusterd.script(Fail(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"))
    failed = threading.Event()
    agent = make_agent(switch_hook=Recorder(), on_event=lambda e: e.kind == ev.AGENT_FAILED and failed.set())
    assert failed.wait(10)
    assert agent.status()["state"] == "failed"
    assert agent._session.subscriber is not None
    agent._session.subscriber._thread.join(5)  # type: ignore[union-attr]
    assert not agent._session.subscriber.running
    assert clusterd.opens == 1


@pytest.mark.parametrize(
    ("ranks", "ops", "needle"),
    [
        (["1", "2"], [True], "rankID has 2 entries but op has 1"),
        (["-1"], [True], "rankID[0]='-1'"),
        ([" 3"], [True], "rankID[0]=' 3'"),
        (["1e9"], [True], "rankID[0]='1e9'"),
        (["007"], [True], "leading zero"),
        (["\u0663"], [True], "not a plain decimal"),
        (["1", "1"], [True, False], "rankID[1]=1 is listed more than once"),
        (["8"], [True], "outside the job (world_size=8)"),
        ([str(i) for i in range(5)], [True] * 5, "limit max_ranks=4"),
    ],
)
def test_invalid_list_runs_no_hook_and_replies_false(
    clusterd: ScriptedClusterD, make_agent: Any, ranks: list[str], ops: list[bool], needle: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clusterd.script(Send(rank_list(ranks, ops)), End())
    guard, hook = Recorder(), Recorder()
    # world_size=8 with one process: the other 7 ranks never answer, but invalid lists never get that far.
    agent = make_agent(switch_hook=hook, checkpoint_hook=guard, world_size=8, max_ranks=4, store=InProcessStore())
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [False]
    assert hook.orders == [] and guard.orders == []
    assert needle in caplog.text
    rejected = [e for e in agent.events() if e.kind == ev.LIST_REJECTED]
    assert len(rejected) == 1 and needle in rejected[0].detail["reason"]
    assert agent.status()["counters"]["lists_rejected"] == 1


def test_list_for_another_job_is_ignored_without_reply(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    clusterd.script(Send(rank_list(["1"], [True], job_id="someone-else")), Send(rank_list(["0"], [False])), End())
    hook = Recorder()
    agent = make_agent(switch_hook=hook)
    replies = replies_of(clusterd, agent, 1)
    assert [(r.jobId, r.result) for r in replies] == [("job-1", True)]
    assert [o.ranks for o in hook.orders] == [(0,)]
    assert clusterd.wait_for(lambda s: s.opens >= 2)
    assert len(clusterd.replies) == 1
    assert agent.status()["counters"]["lists_ignored"] == 1


def test_empty_list_is_answered_true_without_hooks(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    clusterd.script(Send(rank_list([], [])), End())
    guard, hook = Recorder(), Recorder()
    agent = make_agent(switch_hook=hook, checkpoint_hook=guard)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]
    assert hook.orders == [] and guard.orders == []


def test_guard_runs_before_switch(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    calls: list[str] = []
    clusterd.script(Send(rank_list(["0"], [True])), End())
    agent = make_agent(switch_hook=lambda o: calls.append("switch") or True,
                       checkpoint_hook=lambda o: calls.append("guard"))
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]
    assert calls == ["guard", "switch"]


def _raise(order: SwitchOrder) -> None:
    raise RuntimeError("disk full")


@pytest.mark.parametrize(
    ("switch_result", "guard", "needle"),
    [
        (False, None, "switch hook returned False"),
        ("yes", None, "switch hook returned 'yes'; expected True, False or None"),
        (True, _raise, "checkpoint hook raised RuntimeError: disk full; switch not attempted"),
    ],
)
def test_failing_hooks_reply_false(
    clusterd: ScriptedClusterD, make_agent: Any, switch_result: Any, guard: Any, needle: str,
) -> None:
    clusterd.script(Send(rank_list(["0"], [True])), End())
    hook = Recorder(switch_result)
    agent = make_agent(switch_hook=hook, checkpoint_hook=guard)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [False]
    assert agent.status()["last_switch"]["reason"] == f"rank 0: {needle}"
    if guard is not None:
        assert hook.orders == []


def test_switch_hook_raising_replies_false(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    def boom(order: SwitchOrder) -> bool:
        raise OSError("HCCL said no")

    clusterd.script(Send(rank_list(["0"], [True])), End())
    agent = make_agent(switch_hook=boom)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [False]
    assert "OSError: HCCL said no" in agent.status()["last_switch"]["reason"]
    assert agent.status()["state"] == "running"


def test_hung_switch_hook_times_out_refuses_overlap_and_never_replies_twice(
    clusterd: ScriptedClusterD, make_agent: Any
) -> None:
    release, finished = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow(order: SwitchOrder) -> bool:
        calls.append(order.seq)
        if order.seq == 1:
            release.wait(20)
            finished.set()
        return True

    second, third = threading.Event(), threading.Event()
    clusterd.script(Send(rank_list(["0"], [True])), End())
    clusterd.script(WaitFor(second), Send(rank_list(["0"], [False])), End())
    clusterd.script(WaitFor(third), Send(rank_list(["0"], [True])), End())
    agent = make_agent(switch_hook=slow, switch_timeout_s=0.2)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [False]
    assert "did not finish within 0.2 s" in agent.status()["last_switch"]["reason"]
    second.set()  # the hung hook is still running: the next order must not run beside it
    assert [r.result for r in replies_of(clusterd, agent, 2)] == [False, False]
    assert "still running past its timeout" in agent.status()["last_switch"]["reason"]
    release.set()
    assert finished.wait(10)
    agent._member._runner._straggler.join(5)  # type: ignore[union-attr]
    third.set()
    assert [r.result for r in replies_of(clusterd, agent, 3)] == [False, False, True]
    assert calls == [1, 3]
    assert clusterd.wait_for(lambda s: s.opens >= 4)
    assert len(clusterd.replies) == 3


def test_dry_run_reports_success_without_hooks(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    clusterd.script(Send(rank_list(["0"], [True])), End())
    hook = Recorder()
    agent = make_agent(switch_hook=hook, dry_run=True)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]
    assert hook.orders == []


def test_dry_run_needs_no_switch_hook_and_no_torch_npu(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    clusterd.script(Send(rank_list(["0"], [True])), End())
    agent = make_agent(dry_run=True)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]


def test_reply_rejected_by_clusterd_is_logged_not_retried(
    clusterd: ScriptedClusterD, make_agent: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clusterd.reply_script.append(Answer(400, "jobId=job-1 not registed"))
    clusterd.script(Send(rank_list(["0"], [True])), End())
    agent = make_agent(switch_hook=Recorder())
    replies_of(clusterd, agent, 1)
    assert clusterd.wait_for(lambda s: s.opens >= 2)
    assert len(clusterd.replies) == 1
    assert "ClusterD answered code 400: jobId=job-1 not registed" in caplog.text
    assert agent.status()["counters"]["replies_failed"] == 1


def test_stop_while_idle_is_prompt_and_idempotent(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    agent = make_agent(switch_hook=Recorder())
    assert clusterd.wait_for(lambda s: s.open_now == 1)
    agent.stop()
    agent.stop()
    assert agent.status()["state"] == "stopped"
    assert agent._session.subscriber is not None and not agent._session.subscriber.running
    assert agent._executor is not None and not agent._executor.is_alive()
    assert clusterd.wait_for(lambda s: s.open_now == 0)
    assert clusterd.replies == []
    assert kinds(agent)[-1] == ev.AGENT_STOPPED
    with pytest.raises(AgentStateError):
        agent.start()


def test_stop_mid_switch_replies_false_once(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    release = threading.Event()
    hook_running = threading.Event()

    def blocking(order: SwitchOrder) -> bool:
        hook_running.set()
        release.wait(20)
        return True

    clusterd.script(Send(rank_list(["0"], [True])), Hold())
    agent = make_agent(switch_hook=blocking, switch_timeout_s=30)
    assert hook_running.wait(10)
    agent.stop("test says stop")
    replies = replies_of(clusterd, agent, 1)
    assert [r.result for r in replies] == [False]
    assert "agent stopping: test says stop" in agent.status()["last_switch"]["reason"]
    release.set()
    agent._executor.join(5)  # type: ignore[union-attr]
    assert len(clusterd.replies) == 1


def test_context_manager_starts_and_stops(clusterd: ScriptedClusterD) -> None:
    clusterd.script(Send(rank_list(["0"], [True])), End())
    hook = Recorder()
    with SwitchAgent(server=clusterd.address, job_id="job-1", switch_hook=hook, pause="external") as agent:
        assert [r.result for r in clusterd.wait_replies(1)] == [True]
        agent.step(5)
        assert agent.status()["last_step"] == 5
    assert agent.status()["state"] == "stopped"


def test_step_counts_calls_when_no_step_given(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    agent = make_agent(switch_hook=Recorder())
    for _ in range(3):
        agent.step()
    assert agent.last_step == 3


def test_event_listener_that_raises_does_not_break_the_agent(
    clusterd: ScriptedClusterD, make_agent: Any
) -> None:
    def bad_listener(event: Any) -> None:
        raise ValueError("listener bug")

    clusterd.script(Send(rank_list(["0"], [True])), End())
    agent = make_agent(switch_hook=Recorder(), on_event=bad_listener)
    assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]


def test_agent_survives_server_restart_on_same_port() -> None:
    first = ScriptedClusterD().start()
    port = first.port
    hook = Recorder()
    agent = SwitchAgent(server=first.address, job_id="job-1", switch_hook=hook, reconnect_initial_s=0.01,
                        reconnect_max_s=0.1, pause="external").start()
    try:
        assert first.wait_for(lambda s: s.open_now == 1)
        first.stop()
        second = ScriptedClusterD(port=port)
        second.script(Send(rank_list(["0"], [False])), End())
        second.start()
        try:
            assert [r.result for r in second.wait_replies(1)] == [True]
            assert hook.orders[0].ranks == (0,)
        finally:
            second.stop()
    finally:
        agent.stop()


def test_guard_timeout_replies_false_and_skips_switch(clusterd: ScriptedClusterD, make_agent: Any) -> None:
    release = threading.Event()
    clusterd.script(Send(rank_list(["0"], [True])), End())
    hook = Recorder()
    agent = make_agent(switch_hook=hook, checkpoint_hook=lambda order: release.wait(20), guard_timeout_s=0.2)
    try:
        assert [r.result for r in replies_of(clusterd, agent, 1)] == [False]
        assert "checkpoint hook did not finish within 0.2 s; switch not attempted" in (
            agent.status()["last_switch"]["reason"]
        )
        assert hook.orders == []
    finally:
        release.set()


def test_failed_start_leaves_nothing_running_and_can_be_retried(clusterd: ScriptedClusterD) -> None:
    before = set(threading.enumerate())
    agent = SwitchAgent(server=clusterd.address, job_id="job-1", switch_hook=Recorder(), pause="external",
                        world_size=2, rank=0)  # two ranks, but no torch.distributed and no store
    with pytest.raises(ConfigError, match="world_size=2 needs a Store"):
        agent.start()
    assert agent.status()["state"] == "created"
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("nicswitch-")]
    with pytest.raises(ConfigError):
        agent.start()  # still refused for the same reason, not "already started"
    agent.stop()


def test_member_rank_opens_no_clusterd_stream(clusterd: ScriptedClusterD) -> None:
    store = InProcessStore()
    member = SwitchAgent(server=clusterd.address, job_id="job-1", switch_hook=Recorder(), pause="external",
                         world_size=2, rank=1, store=store).start()
    try:
        assert member.status()["state"] == "running"
        assert member._session is None
        assert clusterd.opens == 0
    finally:
        member.stop()


def test_lists_beyond_max_pending_lists_are_answered_false_in_turn_and_not_kept(
        clusterd: ScriptedClusterD, make_agent: Any) -> None:
    """A server that floods lists (ClusterD never does) costs no memory per list beyond the limit,
    and every list still gets exactly one reply, in order."""
    release = threading.Event()
    started = threading.Event()

    def slow_hook(order: SwitchOrder) -> bool:
        started.set()
        return release.wait(20)

    clusterd.script(Send(rank_list(["0"], [True])), WaitFor(started),
                    *[Send(rank_list(["0"], [i % 2 == 0])) for i in range(5)], End())
    seen = Events()
    agent = make_agent(switch_hook=slow_hook, max_pending_lists=2, on_event=seen)
    seen.wait(ev.LIST_REJECTED, 3)  # lists 4, 5 and 6 found two already waiting
    waiting = {owed.seq: owed.order for owed in list(agent._executor.queue.queue)}
    assert sorted(waiting) == [2, 3, 4, 5, 6]
    assert all(waiting[seq] is not None for seq in (2, 3)) and all(waiting[seq] is None for seq in (4, 5, 6))
    release.set()
    replies = clusterd.wait_replies(6)
    assert [r.result for r in replies] == [True, True, True, False, False, False]
    rejected = [e.detail["reason"] for e in seen.of(ev.LIST_REJECTED)]
    assert all("max_pending_lists=2" in reason for reason in rejected)


@pytest.mark.parametrize(("failure", "replied"), [
    # ClusterD restarted: it no longer knows the job, so it waits for no reply (and would take one as
    # the result of its next switch once TaskD registers the job again).
    (Fail(grpc.StatusCode.UNKNOWN, "jobId=job-1 not registed, please wait agent register"), False),
    # A network blip: the same ClusterD still waits for the reply.
    (Fail(grpc.StatusCode.UNAVAILABLE, "Socket closed"), True),
], ids=["clusterd-restarted", "network-blip"])
def test_pause_mode_external_replies_unless_clusterd_forgot_the_job_meanwhile(
        clusterd: ScriptedClusterD, make_agent: Any, failure: Fail, replied: bool, tmp_path: Path) -> None:
    stream_failed = threading.Event()
    clusterd.script(Send(rank_list(["0"], [True])), End())
    clusterd.script(failure)  # the stream reopened after the list fails while the hook runs

    def hook(order: SwitchOrder) -> bool:
        assert stream_failed.wait(10)
        return True

    agent = make_agent(switch_hook=hook, on_event=lambda e: e.kind == ev.STREAM_LOST and stream_failed.set())
    seen: Events = agent.seen  # type: ignore[attr-defined]
    if replied:
        assert [r.result for r in replies_of(clusterd, agent, 1)] == [True]
    else:
        (event,) = seen.wait(ev.REPLY_FAILED)
        assert event.detail["outcome"] == "dropped" and "does not know the job" in event.detail["error"]
        assert clusterd.replies == []
        # `status` said "last switch none yet" next to "switches 1 ok; replies 1 failed": that switch, and why
        # its reply was not sent.
        last = agent.status()["last_switch"]
        assert last["seq"] == 1 and last["result"] is True and last["reply"] == "dropped", last
        assert StatusFileWriter(tmp_path / "status.json", agent.status).write_now()
        (line,) = [ln for ln in format_summary(read_status(tmp_path / "status.json")).splitlines()
                   if ln.startswith("last switch")]
        assert line.startswith("last switch #1: ok (") and "reply true NOT delivered (dropped: ClusterD has " \
            "restarted since the list arrived (it answered that it does not know the job); a reply now would " \
            "answer its next switch)" in line, line
