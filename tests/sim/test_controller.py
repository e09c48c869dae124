"""Controller paths that need exact timing or no network: overflow, 504, an unconfirmed send."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import SimJob, SimSettings
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.event_controller import JobController, JobView
from nicswitch_agent.sim.generation import UNCONFIRMED_LIST, StreamToken

from .conftest import FAST, JOB, NIC_OPS, NODES, WAIT, Setup

pytestmark = pytest.mark.timeout(20)


class _Harness:
    """A controller driven by direct calls, with a change counter to wait on.

    Like the simulator's notifier, the counter's lock is never held while reading the
    controller: the controller bumps it while holding its own lock.
    """

    def __init__(self, **overrides: float) -> None:
        self.changed = threading.Condition()
        self.version = 0
        self.ctl = JobController(SimJob(JOB, NODES), SimSettings(**{**FAST, **overrides}), random.Random(0), self._bump)
        assert self.ctl.init().code == 0 and self.ctl.register().code == 0

    def _bump(self) -> None:
        with self.changed:
            self.version += 1
            self.changed.notify_all()

    def wait(self, predicate: Callable[[JobView], bool]) -> JobView:
        deadline = time.monotonic() + WAIT
        while True:
            with self.changed:
                seen = self.version
            view = self.ctl.view()
            if predicate(view):
                return view
            remaining = deadline - time.monotonic()
            assert remaining > 0, view
            with self.changed:
                self.changed.wait_for(lambda seen=seen: self.version != seen, remaining)

    def track(self) -> pb.Status:
        request = pb.SwitchNics(jobID=JOB)
        for node, (devs, ops) in NIC_OPS.items():
            request.nicOps[node].dev.extend(devs)
            request.nicOps[node].op.extend(ops)
        return self.ctl.switch_nic_track(request)


@pytest.fixture
def harness() -> Iterator[Callable[..., _Harness]]:
    made: list[_Harness] = []

    def make(**overrides: float) -> _Harness:
        made.append(_Harness(**overrides))
        return made[-1]

    yield make
    for h in made:
        h.ctl.stop()


def test_event_queue_overflow_resets_and_starts_the_loop(harness: Callable[..., _Harness]) -> None:
    """addEvent's default branch: the 11th queued event resets the machine (docs/clusterd.md#resets-and-stream-ends)."""
    h = harness()
    for _ in range(P.EVENT_QUEUE_LENGTH):
        assert h.track().code == 0  # no event loop yet (docs/clusterd.md#no-process-manage-subscriber): they just queue
    assert h.ctl.view().queued["events"] == P.EVENT_QUEUE_LENGTH
    assert h.track().code == 0
    view = h.ctl.view()
    assert view.resets == ["event queue full at startSwitchNic"]
    assert view.loop_running and view.queued["events"] == 0


def test_signal_queue_busy_resets(harness: Callable[..., _Harness]) -> None:
    """A keep-alive left in the signal slot with no stream to take it: the pause signal cannot be
    enqueued within 1 s, 504 SignalQueueBusy, and the machine resets."""
    h = harness(keepalive_interval_s=0.01, enqueue_timeout_s=0.05)
    token = h.ctl.open_stream(P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, "peer")
    h.ctl.stream_terminated(token)  # the agent left: reset, nobody reads the slot any more
    h.wait(lambda v: v.queued["signal"] == 1)
    assert h.track().code == 0
    view = h.wait(lambda v: len(v.resets) == 3)
    assert view.resets[-1] == (
        "trigger error, code=504, err=add signal time-out for jobId=job-uid-0001, program may running in chaos"
    )
    assert view.path_history[-1] == ["INIT(startSwitchNic)", "NotifyPauseTrainState"]


def _unconfirmed_list_send(h: _Harness) -> StreamToken:
    """Drive a switch to a list handed to a notify stream that then ended, its send unconfirmed.
    Returns the process-manage stream."""
    pm = h.ctl.open_stream(P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, "agent")
    notify = h.ctl.open_stream(P.SUBSCRIBE_NOTIFY_SWITCH, "worker")
    assert h.track().code == 0
    pause = h.ctl.next_signal(pm)
    assert pause is not None and list(pause.actions) == ["pause_train"]
    h.ctl.signal_sent(pm, pause)
    h.wait(lambda v: v.state == "WaitReportPauseCompleteState")
    h.ctl.report_stop_complete(pb.StopCompleteRequest(jobId=JOB))
    rank_list = h.ctl.next_rank_list(notify)
    assert rank_list is not None and list(rank_list.rankID) == ["2", "3"]
    h.ctl.stream_terminated(notify)
    h.ctl.rank_list_unconfirmed(notify)
    return pm


def test_unconfirmed_list_send_moves_on_and_is_a_violation_when_no_reply_comes(
    harness: Callable[..., _Harness],
) -> None:
    """docs/clusterd.md#the-reconnect-race: a list handed to a stream that died before the send completed
    may be lost, and the machine waits for a reply anyway. Without a reply it is a violation, shown at
    once and kept when the generation ends."""
    h = harness()
    pm = _unconfirmed_list_send(h)
    view = h.wait(lambda v: v.state == "WaitSwitchNicFinishedState")
    assert view.lists_sent == []
    assert view.violations == [UNCONFIRMED_LIST]
    h.ctl.stream_terminated(pm)  # the reset throws the generation away
    view = h.wait(lambda v: v.state == P.INIT and v.generation == 2)
    assert view.violations == [UNCONFIRMED_LIST]


def test_unconfirmed_list_send_is_no_violation_when_the_subscriber_answers_it(
    harness: Callable[..., _Harness],
) -> None:
    """A client that read the list and then ended its notify stream (a stop right after the list came)
    can leave gRPC's generator unresumed, so the send looks unconfirmed. Its reply shows it saw the
    list: no violation, then or after the reset (CI once flagged a correct agent's Ctrl-C this way)."""
    h = harness()
    pm = _unconfirmed_list_send(h)
    h.wait(lambda v: v.state == "WaitSwitchNicFinishedState")
    assert h.ctl.reply_switch_nic_result(pb.SwitchResult(jobId=JOB, result=False)).code == 0
    view = h.wait(lambda v: v.replies == [False])
    assert view.violations == []
    h.ctl.stream_terminated(pm)
    view = h.wait(lambda v: v.generation == 2)
    assert view.violations == []


def test_process_manage_subscribe_during_a_switch_is_recorded(make_setup: Callable[..., Setup]) -> None:
    """A second process-manage subscribe mid-switch resets the job: the switch is silently lost."""
    setup = make_setup()
    agent, _worker = setup.ready()
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.subscribe_process_manage()
    assert agent.wait_end()[0].name == "OK"
    assert om_stream.wait_end()[0].name == "OK"
    # The pause was read by the client; the server may not have seen its send complete yet.
    prefix = "SubscribeProcessManageSignal opened during "
    assert any(v.startswith(prefix) for v in setup.view().violations)
