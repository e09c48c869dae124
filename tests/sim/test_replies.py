"""When ReplySwitchNicResult arrives (docs/clusterd.md#reply-timing-and-the-crash) and the reconnect race
(docs/clusterd.md#the-reconnect-race)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest

from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.event_controller import FATAL_PREFIX

from .conftest import JOB, OK, WAIT, Setup, wait_state, wait_streams
from .test_switch import HAPPY_PATH

pytestmark = pytest.mark.timeout(20)


def _has(setup: Setup, prefix: str) -> bool:
    return setup.sim.wait_until(lambda s: any(v.startswith(prefix) for v in s.job_view(JOB).violations), WAIT)


def test_duplicate_reply_is_buffered_then_dropped(make_setup: Callable[..., Setup]) -> None:
    """a second reply after the first was taken is buffered; the finish reset drops it, and
    the next switch waits for its own reply."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    assert setup.worker.reply(True).info == "reply success"
    assert agent.get().changeStrategy == "continue"  # the first reply was consumed
    assert setup.worker.reply(True).info == "reply success"
    assert _has(setup, "reply while no switch is waiting (buffered; the next switch takes it)")
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
    # Switch #2 must wait for its own reply: the stale one died with the reset.
    agent, worker = setup.ready()
    setup.start_switch({"node-0": (["1"], [False])})
    agent.get()
    setup.agent.stop_complete(0)
    assert list(worker.get().rankID) == ["1"]
    wait_state(setup.sim, "WaitSwitchNicFinishedState")
    agent.assert_quiet(0.2)
    assert setup.view().state == "WaitSwitchNicFinishedState"
    setup.worker.reply(True)
    assert agent.get().changeStrategy == "continue"
    assert setup.view().replies == [True, True, True]


def test_third_reply_blocks_and_would_crash_at_reset(make_setup: Callable[..., Setup]) -> None:
    """#1 consumed, #2 buffered, #3 blocks in the handler; the next reset would panic the
    real server. By default the simulator records it and ends #3 with UNAVAILABLE instead
    (test_recorded.py: with crash_like_clusterd it goes down)."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    setup.worker.reply(True)
    assert agent.get().changeStrategy == "continue"
    setup.worker.reply(True)
    outcome: dict[str, object] = {}

    def third() -> None:
        try:
            outcome["status"] = setup.worker.reply(True, timeout=WAIT)
        except grpc.RpcError as exc:
            outcome["error"] = exc.code()

    thread = threading.Thread(target=third)
    thread.start()
    assert _has(setup, "duplicate reply while a result is pending (real ClusterD blocks this handler")
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
    thread.join(WAIT)
    assert outcome == {"error": grpc.StatusCode.UNAVAILABLE}
    assert _has(setup, FATAL_PREFIX + "a blocked ReplySwitchNicResult met a reset")
    assert setup.sim.crashed is None and len(setup.sim.crash_points()) == 1
    # The simulator itself keeps serving.
    assert setup.agent.init().code == 0


def test_early_reply_is_taken_by_the_next_switch(make_setup: Callable[..., Setup]) -> None:
    """a reply while INIT (agent subscribed) becomes the next switch's result: continue is
    sent as soon as the list is, before the worker acts."""
    setup = make_setup()
    agent, worker = setup.ready()
    assert setup.worker.reply(True).info == "reply success"
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    assert agent.get().changeStrategy == "continue"
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
    view = setup.view()
    assert view.action_path == HAPPY_PATH
    assert view.replies == [True]
    assert view.violations == ["reply while no switch is waiting (buffered; the next switch takes it)"]


def test_early_reply_before_agent_subscribe_is_dropped(make_setup: Callable[..., Setup]) -> None:
    """the agent's subscribe resets the controller and drops the buffered reply."""
    setup = make_setup()
    assert setup.agent.init().code == 0 and setup.agent.register().code == 0
    assert setup.worker.reply(True).code == 0
    agent = setup.agent.subscribe_process_manage()
    wait_streams(setup.sim, P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, 1)
    worker = setup.subscribe_worker()
    setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    wait_state(setup.sim, "WaitSwitchNicFinishedState")
    agent.assert_quiet(0.2)
    assert setup.view().state == "WaitSwitchNicFinishedState"


def test_list_waits_for_the_next_subscriber(make_setup: Callable[..., Setup]) -> None:
    """the worker's stream is gone when the list is enqueued; the list
    waits in its slot (no timeout) and the next subscriber gets it at once."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    agent.get()
    assert worker.cancel()[0] == grpc.StatusCode.CANCELLED
    wait_streams(setup.sim, P.SUBSCRIBE_NOTIFY_SWITCH, 0)
    setup.agent.stop_complete(0)
    wait_state(setup.sim, "NotifySwitchNicState")
    assert setup.view().lists_sent == []
    worker2 = setup.subscribe_worker(setup.om)
    rank_list = worker2.get()
    assert (list(rank_list.rankID), list(rank_list.op)) == (["2", "3"], [True, False])
    setup.om.reply(True)
    assert agent.get().changeStrategy == "continue"
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
    assert worker2.wait_end() == (OK, "")
    view = setup.view()
    assert view.action_path == HAPPY_PATH
    assert view.violations == []


def test_reply_from_anyone_completes_the_switch(make_setup: Callable[..., Setup]) -> None:
    """the server does not check who replies (a reply from a client that never
    saw the list still completes the switch)."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    assert setup.om.reply(True).code == 0
    assert agent.get().changeStrategy == "continue"
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
