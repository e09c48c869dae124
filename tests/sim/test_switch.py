"""The observed switch runs (docs/clusterd.md, behaviour observed on loopback)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import codes as P

from .conftest import JOB, OK, WAIT, Setup, received, wait_state, wait_streams

pytestmark = pytest.mark.timeout(20)

HAPPY_PATH = [
    "INIT(startSwitchNic)",
    "NotifyPauseTrainState(notifySuccess)",
    "WaitReportPauseCompleteState(switchNicRecvPause)",
    "NotifySwitchNicState(notifySuccess)",
    "WaitSwitchNicFinishedState(receiveReport)",
    "NotifyContinueTrainState(notifyContinueSuccessEvent)",
    "WaitContinueTrainState(switchNicRecvContinue)",
    "INIT",
]


def _run_switch(setup: Setup, agent_stream, worker_stream, nic_ops, expect_ranks, expect_ops) -> None:  # type: ignore[no-untyped-def]
    """One successful switch, answering like the observed agent and worker."""
    om_stream = setup.start_switch(nic_ops)
    pause = agent_stream.get()
    assert (pause.signalType, list(pause.actions), pause.jobId) == ("stopTrain", ["pause_train"], JOB)
    uuid = pause.uuid
    assert setup.om.track(nic_ops).info == f"jobId={JOB} nic is swtiching, or job recovering"
    stop = setup.agent.stop_complete(0)
    assert (stop.code, stop.info) == (0, received(JOB, uuid, "ReportStopComplete"))
    rank_list = worker_stream.get()
    assert (list(rank_list.rankID), list(rank_list.op), rank_list.jobId) == (expect_ranks, expect_ops, JOB)
    reply = setup.worker.reply(True)
    assert (reply.code, reply.info) == (0, "reply success")
    cont = agent_stream.get()
    assert (cont.uuid, cont.signalType, list(cont.actions), cont.changeStrategy) == (
        uuid,
        "changeStrategy",
        ["change_strategy"],
        "continue",
    )
    status = setup.agent.recover_status(0, "continue")
    assert (status.code, status.info) == (0, received(JOB, uuid, "ReportRecoverStatus"))
    response = om_stream.get()
    assert (response.jobID, response.msg) == (JOB, "switch nic finish")
    assert om_stream.wait_end() == (OK, "")
    assert agent_stream.wait_end() == (OK, "")
    assert worker_stream.wait_end() == (OK, "")


def test_happy(make_setup: Callable[..., Setup]) -> None:
    setup = make_setup()
    agent, worker = setup.ready()
    _run_switch(setup, agent, worker, {"node-1": (["0", "1"], [True, False])}, ["2", "3"], [True, False])
    view = setup.view()
    assert view.state == "INIT"
    assert view.action_path == HAPPY_PATH
    assert view.replies == [True]
    assert view.om_messages == ["switch nic finish"]
    assert [(s.signalType, s.changeStrategy) for s in view.signals_sent] == [
        ("stopTrain", ""),
        ("changeStrategy", "continue"),
    ]
    assert [list(lst.rankID) for lst in view.lists_sent] == [["2", "3"]]
    assert view.violations == []
    assert view.open_streams == dict.fromkeys(P.STREAM_METHODS, 0)
    assert view.stream_opens == dict.fromkeys(P.STREAM_METHODS, 1)


def test_twice(make_setup: Callable[..., Setup]) -> None:
    """After a finished switch every stream is closed: resubscribe (agent first) and switch again."""
    setup = make_setup()
    agent, worker = setup.ready()
    _run_switch(setup, agent, worker, {"node-1": (["0", "1"], [True, False])}, ["2", "3"], [True, False])
    agent, worker = setup.ready()
    _run_switch(setup, agent, worker, {"node-0": (["1"], [False])}, ["1"], [False])
    view = setup.view()
    assert view.action_path == HAPPY_PATH
    assert len(view.path_history) == 2
    assert view.replies == [True, True]
    assert view.violations == []
    uuids = [s.uuid for s in view.signals_sent]
    assert uuids[0] == uuids[1] != uuids[2] == uuids[3]


def test_order_worker_before_agent(make_setup: Callable[..., Setup]) -> None:
    """docs/clusterd.md#subscribe-order: the agent's subscribe resets the job and ends the worker's stream; the
    list then waits with nobody listening, and NotifySwitchNicState has no timeout."""
    setup = make_setup()
    assert setup.agent.init().code == 0 and setup.agent.register().code == 0
    # Agent mode: one client (one channel) holds both streams, in the wrong order.
    worker = setup.subscribe_worker(setup.agent)
    agent = setup.agent.subscribe_process_manage()
    assert worker.wait_end() == (OK, "")
    wait_streams(setup.sim, P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, 1)
    om_stream = setup.start_switch()
    pause = agent.get()
    assert list(pause.actions) == ["pause_train"]
    assert setup.agent.stop_complete(0).code == 0
    wait_state(setup.sim, "NotifySwitchNicState")
    om_stream.assert_quiet(0.3)
    assert setup.view().state == "NotifySwitchNicState"
    assert setup.view().lists_sent == []
    # The agent leaving resets the job: the O&M stream ends with OK and no message.
    agent.cancel()
    assert om_stream.wait_end() == (OK, "")
    view = setup.view()
    assert view.state == "INIT"
    assert view.action_path == [
        "INIT(startSwitchNic)",
        "NotifyPauseTrainState(notifySuccess)",
        "WaitReportPauseCompleteState(switchNicRecvPause)",
        "NotifySwitchNicState",
    ]
    assert view.resets[-1] == "SubscribeProcessManageSignal stream ended"
    prefix = "SubscribeNotifySwitch opened before SubscribeProcessManageSignal"
    assert any(v.startswith(prefix) for v in view.violations)


def test_noagent(make_setup: Callable[..., Setup]) -> None:
    """docs/clusterd.md#no-process-manage-subscriber: no process-manage stream, no event loop: SwitchNicTrack answers 0
    twice
    and nothing else happens."""
    setup = make_setup()
    assert setup.agent.init().code == 0 and setup.agent.register().code == 0
    worker = setup.subscribe_worker()
    om_stream = setup.start_switch()
    assert setup.om.track().info == "switching operation was successfully distributed"
    worker.assert_quiet(0.3)
    om_stream.assert_quiet(0.01)
    view = setup.view()
    assert (view.state, view.loop_running, view.signals_sent, view.resets) == ("INIT", False, [], [])
    assert view.open_streams[P.SUBSCRIBE_NOTIFY_SWITCH] == 1
    assert view.open_streams[P.SUBSCRIBE_SWITCH_NIC_SIGNAL] == 1


def test_two_workers_compete(make_setup: Callable[..., Setup]) -> None:
    """docs/clusterd.md#competing-subscribers: only one of two subscribers gets the list; both end OK at the reset."""
    setup = make_setup()
    agent = setup.register_agent()
    first = setup.subscribe_worker()
    second = setup.subscribe_worker(setup.om)
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    assert setup.sim.wait_until(lambda s: len(s.job_view(JOB).lists_sent) == 1, WAIT)
    setup.worker.reply(True)
    agent.get()
    setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
    messages = []
    for reader in (first, second):
        items = []
        while True:
            try:
                items.append(reader.get(timeout=WAIT))
            except AssertionError:
                break
        assert reader.end == (OK, "")
        messages.append(items)
    assert sorted(len(m) for m in messages) == [0, 1]
    view = setup.view()
    assert view.action_path == HAPPY_PATH
    assert any("competing SubscribeNotifySwitch" in v for v in view.violations)


def test_keepalive_carries_current_uuid(make_setup: Callable[..., Setup]) -> None:
    """Keep-alives every interval on the process-manage stream, with the current uuid
    (docs/clusterd.md#a-failed-switch)."""
    setup = make_setup(keepalive_interval_s=0.05)
    agent, _worker = setup.ready()
    first = agent.get(skip_keepalive=False)
    assert (first.signalType, first.uuid, first.jobId) == ("keep-alive", "", JOB)
    setup.start_switch()
    pause = agent.get()
    while True:
        signal = agent.get(skip_keepalive=False)
        if signal.signalType == "keep-alive":
            break
    assert signal.uuid == pause.uuid
    # The count moves once the server sees the send complete, which may trail the client's read.
    assert setup.sim.wait_until(lambda s: s.job_view(JOB).keepalives_sent >= 2, WAIT)
    assert all(s.signalType != "keep-alive" for s in setup.view().signals_sent)


def test_shuffled_node_order_keeps_pairs_and_device_order(make_setup: Callable[..., Setup]) -> None:
    """Go map order across nodes, request order within a node, rankID[i] pairs with op[i]
    (docs/clusterd.md#rank-ids-and-their-order)."""
    nodes = {f"node-{i}": [str(d) for d in range(4)] for i in range(6)}
    from nicswitch_agent.sim import SimJob

    setup = make_setup(jobs=[SimJob(JOB, nodes)], shuffle_nodes=True, seed=7)
    agent, worker = setup.ready()
    nic_ops = {node: (["3", "1"], [True, False]) for node in nodes}
    setup.start_switch(nic_ops)
    agent.get()
    setup.agent.stop_complete(0)
    rank_list: pb.SwitchRankList = worker.get()
    ranks, ops = list(rank_list.rankID), list(rank_list.op)
    blocks = [ranks[i : i + 2] for i in range(0, len(ranks), 2)]
    expected = {f"node-{i}": [str(i * 4 + 3), str(i * 4 + 1)] for i in range(6)}
    assert sorted(map(tuple, blocks)) == sorted(tuple(v) for v in expected.values())
    assert ops == [True, False] * 6
