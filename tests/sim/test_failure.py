"""Failure paths (docs/clusterd.md#failed-switch-and-fault-recovery, docs/clusterd.md#when-clusterd-kills-the-job),
with millisecond waits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from nicswitch_agent.sim import SimJob

from .conftest import JOB, NODES, OK, Setup, StreamReader, received, wait_state

pytestmark = pytest.mark.timeout(20)

TO_SWITCH_WAIT = [
    "INIT(startSwitchNic)",
    "NotifyPauseTrainState(notifySuccess)",
    "WaitReportPauseCompleteState(switchNicRecvPause)",
    "NotifySwitchNicState(notifySuccess)",
]
RECOVERY_HEAD = [
    "NotifyStopTrainState(notifySuccess)",
    "WaitReportStopCompleteState(receiveReport)",
    "WaitFaultFlushFinishedState(flushFinished)",
    "NotifyGlobalFaultState(notifySuccess)",
    "WaitReportRecoverStrategyState(receiveReport)",
]
RESTART_TAIL = [
    "CheckRecoverResultState(checkFinish)",
    "ListenScheduleResultState(scheduleSuccess)",
    "NotifyRestartAllProcessState(notifySuccess)",
    "WaitRestartAllProcessState(restartFinish)",
    "FaultClearState(clearSuccess)",
    "FaultRetryState(finish)",
    "INIT",
]
FAILED = [*TO_SWITCH_WAIT, "WaitSwitchNicFinishedState(switchNicFail)", *RECOVERY_HEAD]


def _job(strategies: Sequence[str]) -> list[SimJob]:
    return [SimJob(JOB, NODES, recover_strategies=tuple(strategies))]


def _fail_switch(setup: Setup) -> tuple[StreamReader, StreamReader, str, str]:
    """docs/clusterd.md#a-failed-switch: up to stop_train: the worker replies false."""
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    pause = agent.get()
    assert setup.agent.stop_complete(0).code == 0
    worker.get()
    status = setup.worker.reply(False)
    assert (status.code, status.info) == (0, "reply success")
    assert om_stream.get().msg == "switch nic failed, switch nic failed"
    assert om_stream.wait_end() == (OK, "")
    stop = agent.get()
    assert (stop.signalType, list(stop.actions), list(stop.faultRanks)) == ("stopTrain", ["stop_train"], [])
    assert stop.uuid != pause.uuid
    return agent, worker, pause.uuid, stop.uuid


def _to_global_fault(setup: Setup, agent: StreamReader, uuid: str, offer: Sequence[str]) -> None:
    status = setup.agent.stop_complete(0)
    assert (status.code, status.info) == (0, received(JOB, uuid, "ReportStopComplete"))
    fault = agent.get()
    assert (fault.uuid, fault.signalType, list(fault.actions)) == (
        uuid,
        "globalFault",
        ["on_global_rank", "fault_nodes_exit"],
    )
    assert (list(fault.faultRanks), list(fault.nodeRankIds)) == ([], [])
    status = setup.agent.recover_strategy(offer)
    assert (status.code, status.info) == (0, received(JOB, uuid, "ReportRecoverStrategy"))


def _change_strategy(agent: StreamReader, uuid: str, name: str, extra: str = "") -> None:
    signal = agent.get()
    assert (signal.uuid, signal.signalType, list(signal.actions), signal.changeStrategy, signal.extraParams) == (
        uuid,
        "changeStrategy",
        ["change_strategy"],
        name,
        extra,
    )


def _assert_back_in_init(setup: Setup, agent: StreamReader, worker: StreamReader) -> None:
    assert agent.wait_end() == (OK, "")
    assert worker.wait_end() == (OK, "")
    view = setup.view()
    assert view.state == "INIT"
    # The probe of docs/clusterd.md#failed-switch-and-fault-recovery: a new agent subscribe, then SwitchNicTrack is
    # accepted.
    setup.register_agent()
    assert setup.om.track().code == 0


@pytest.mark.parametrize(
    ("strategies", "offer"),
    [
        (("retry", "recover", "dump"), ["exit"]),  # offered exit only
        (("recover", "dump"), ["retry"]),  # retry not in the annotation -> exit
    ],
)
def test_fail_then_exit(make_setup: Callable[..., Setup], strategies: Sequence[str], offer: list[str]) -> None:
    setup = make_setup(jobs=_job(strategies))
    agent, worker, _, uuid = _fail_switch(setup)
    _to_global_fault(setup, agent, uuid, offer)
    _change_strategy(agent, uuid, "exit")
    # Nothing is reported for exit; after schedule + restart waits: dump_exit, then the reset.
    _change_strategy(agent, uuid, "exit", extra="dump_exit")
    _assert_back_in_init(setup, agent, worker)
    view = setup.view()
    assert view.path_history[-1] == [*FAILED, "NotifyDecidedStrategyState(notifyExitStrategySuccess)", *RESTART_TAIL]
    assert view.om_messages == ["switch nic failed, switch nic failed"]
    assert view.replies == [False]
    assert view.violations == []


def test_fail_then_dump(make_setup: Callable[..., Setup]) -> None:
    """dump chosen; ReportRecoverStatus(0, dump); dump_exit at once and again at the end."""
    setup = make_setup(jobs=_job(("recover", "dump")))
    agent, worker, _, uuid = _fail_switch(setup)
    _to_global_fault(setup, agent, uuid, ["dump", "exit"])
    _change_strategy(agent, uuid, "dump")
    status = setup.agent.recover_status(0, "dump")
    assert (status.code, status.info) == (0, received(JOB, uuid, "ReportRecoverStatus"))
    _change_strategy(agent, uuid, "exit", extra="dump_exit")
    _change_strategy(agent, uuid, "exit", extra="dump_exit")
    _assert_back_in_init(setup, agent, worker)
    view = setup.view()
    assert view.path_history[-1] == [
        *FAILED,
        "NotifyDecidedStrategyState(notifyDumpStrategySuccess)",
        "WaitReportDumpStatusState(receiveReport)",
        *RESTART_TAIL,
    ]
    assert view.violations == []


@pytest.mark.parametrize(
    ("strategies", "offer", "pick", "wait_state_name"),
    [
        (("recover", "dump"), ["recover", "dump", "exit"], "recover", "WaitReportProcessRecoverStatusState"),
        (
            ("retry", "recover", "dump", "exit"),
            ["retry", "recover", "dump", "exit"],
            "retry",
            "WaitReportStepRetryStatusState",
        ),
    ],
)
def test_fail_then_recover_or_retry(
    make_setup: Callable[..., Setup], strategies: Sequence[str], offer: list[str], pick: str, wait_state_name: str
) -> None:
    """ReportRecoverStatus(0, name) brings the job back to INIT within ms, no 60 s tail."""
    setup = make_setup(jobs=_job(strategies), schedule_wait_s=30.0, restart_wait_s=30.0)
    agent, worker, _, uuid = _fail_switch(setup)
    _to_global_fault(setup, agent, uuid, offer)
    _change_strategy(agent, uuid, pick)
    assert setup.agent.recover_status(0, pick).code == 0
    _assert_back_in_init(setup, agent, worker)
    view = setup.view()
    event = {"recover": "notifyRecoverStrategySuccess", "retry": "notifyRetryStrategySuccess"}[pick]
    assert view.path_history[-1] == [
        *FAILED,
        f"NotifyDecidedStrategyState({event})",
        f"{wait_state_name}(receiveReport)",
        "CheckRecoverResultState(recoverSuccess)",
        "INIT",
    ]
    assert view.violations == []


def test_retry_in_annotation_but_not_offered_falls_to_dump(make_setup: Callable[..., Setup]) -> None:
    """Upstream chooseStrategy (read from source, not observed): retry is first whenever the
    annotation lists it; when the agent did not offer it the fallback is chooseForRecoverFail,
    i.e. dump (or exit), never recover."""
    setup = make_setup(jobs=_job(("retry", "recover", "dump")))
    agent, _worker, _, uuid = _fail_switch(setup)
    _to_global_fault(setup, agent, uuid, ["recover", "dump", "exit"])
    _change_strategy(agent, uuid, "dump")


# What nicswitch-agent offers after a failed switch (docs/protocol.md#5-after-a-failed-switch-mode-agent):
# retry and recover only after a successful rollback, dump only with a checkpoint, always exit.
ROLLED_BACK = ["retry", "recover", "dump", "exit"]
ROLLED_BACK_NO_CHECKPOINT = ["retry", "recover", "exit"]
NOT_ROLLED_BACK = ["dump", "exit"]
ANNOTATIONS = [("retry", "recover", "dump"), ("recover", "dump"), ("dump",), ("retry",)]


@pytest.mark.parametrize(
    ("strategies", "offer", "pick"),
    [
        # the offer after a rollback that worked: training goes on under every annotation that
        # lists retry or recover, and dump is the job's own choice otherwise
        (("retry", "recover", "dump"), ROLLED_BACK, "retry"),
        (("recover", "dump"), ROLLED_BACK, "recover"),
        (("dump",), ROLLED_BACK, "dump"),
        (("retry",), ROLLED_BACK, "retry"),
        (("dump",), ROLLED_BACK_NO_CHECKPOINT, "exit"),
        # the offer after a rollback that failed: never retry or recover
        (("retry", "recover", "dump"), NOT_ROLLED_BACK, "dump"),
        (("recover", "dump"), NOT_ROLLED_BACK, "dump"),
        (("dump",), NOT_ROLLED_BACK, "dump"),
        (("retry",), NOT_ROLLED_BACK, "exit"),
        # the agent's old offer (recover without retry) under the common annotation: retry is
        # tried first and, not offered, recover is skipped too (the bug of issue 18 item 1)
        (("retry", "recover", "dump"), ["recover", "exit"], "exit"),
    ],
    ids=lambda value: ",".join(value) if isinstance(value, (list, tuple)) else value,
)
def test_choice_per_annotation_and_offer(
    make_setup: Callable[..., Setup], strategies: Sequence[str], offer: list[str], pick: str
) -> None:
    """upstream chooseStrategy (docs/clusterd.md#failed-switch-and-fault-recovery): retry first
    whenever the annotation lists it, else recover, then dump, then exit; each only if offered.
    After retry or recover reported OK the job is back in INIT and a new switch is accepted."""
    setup = make_setup(jobs=_job(strategies))
    agent, worker, _, uuid = _fail_switch(setup)
    _to_global_fault(setup, agent, uuid, offer)
    _change_strategy(agent, uuid, pick)
    if pick in ("retry", "recover"):
        status = setup.agent.recover_status(0, pick)
        assert (status.code, status.info) == (0, received(JOB, uuid, "ReportRecoverStatus"))
        _assert_back_in_init(setup, agent, worker)
        assert setup.view().path_history[-1][-2:] == ["CheckRecoverResultState(recoverSuccess)", "INIT"]
    elif pick == "dump":
        assert setup.agent.recover_status(0, "dump").code == 0
        _change_strategy(agent, uuid, "exit", extra="dump_exit")
    assert setup.view().violations == []


def test_empty_strategy_in_report_resets(make_setup: Callable[..., Setup]) -> None:
    """ReportRecoverStatus with strategy "" -> trigger error 599 -> reset at once."""
    setup = make_setup(jobs=_job(("recover", "dump")), schedule_wait_s=30.0, restart_wait_s=30.0)
    agent, worker, _, uuid = _fail_switch(setup)
    _to_global_fault(setup, agent, uuid, ["dump", "exit"])
    _change_strategy(agent, uuid, "dump")
    assert setup.agent.recover_status(0, "").code == 0
    assert agent.wait_end() == (OK, "")
    assert worker.wait_end() == (OK, "")
    view = setup.view()
    assert view.path_history[-1] == [
        *FAILED,
        "NotifyDecidedStrategyState(notifyDumpStrategySuccess)",
        "WaitReportDumpStatusState(receiveReport)",
        "CheckRecoverResultState",
    ]
    assert view.resets[-1].startswith("trigger error, code=599, err=unexpected case, strategy= not support")
    assert any("does not echo changeStrategy 'dump'" in v for v in view.violations)


def test_report_406_during_switch(make_setup: Callable[..., Setup]) -> None:
    """MindIO's 406 while the worker is silent fails the switch; the reply still carries the
    pause uuid, stop_train a new one."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    pause = agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    wait_state(setup.sim, "WaitSwitchNicFinishedState")
    status = setup.agent.recover_status(406, "")
    assert (status.code, status.info) == (0, received(JOB, pause.uuid, "ReportRecoverStatus"))
    assert om_stream.get().msg == "switch nic failed, report error when switching nic"
    assert om_stream.wait_end() == (OK, "")
    stop = agent.get()
    assert (stop.signalType, list(stop.actions)) == ("stopTrain", ["stop_train"])
    assert stop.uuid != pause.uuid
    _to_global_fault(setup, agent, stop.uuid, ["exit"])
    _change_strategy(agent, stop.uuid, "exit")
    _change_strategy(agent, stop.uuid, "exit", extra="dump_exit")
    _assert_back_in_init(setup, agent, worker)
    view = setup.view()
    assert view.path_history[-1][4] == "WaitSwitchNicFinishedState(waitSwitchNicRecvFault)"
    assert view.violations == []


def test_other_status_during_switch_wedges(make_setup: Callable[..., Setup]) -> None:
    """any code but 406 while waiting for the switch result wedges the job (411 from then on)."""
    setup = make_setup()
    agent, worker = setup.ready()
    setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    wait_state(setup.sim, "WaitSwitchNicFinishedState")
    assert setup.agent.recover_status(0, "continue").code == 0
    assert setup.sim.wait_until(lambda s: any("wedges the job" in v for v in s.job_view(JOB).violations), 5)
    assert setup.worker.reply(True).code == 0  # late: fills the slot, nobody reads it
    agent.assert_quiet(0.2)
    view = setup.view()
    assert view.state == "WaitSwitchNicFinishedState"
    assert setup.om.track().code == 411
    assert any(v.startswith("reply while no switch is waiting") for v in view.violations)


def test_pause_499_kills(make_setup: Callable[..., Setup]) -> None:
    """ReportStopComplete(499) to pause_train -> "om failed, pause train failed", killMaster, reset."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    pause = agent.get()
    status = setup.agent.stop_complete(499)
    assert (status.code, status.info) == (0, received(JOB, pause.uuid, "ReportStopComplete"))
    assert om_stream.get().msg == "om failed, pause train failed"
    assert om_stream.wait_end() == (OK, "")
    kill = agent.get()
    assert (kill.uuid, kill.signalType, list(kill.actions), kill.changeStrategy) == (pause.uuid, "killMaster", [], "")
    assert agent.wait_end() == (OK, "")
    assert worker.wait_end() == (OK, "")
    view = setup.view()
    assert view.action_path == [
        "INIT(startSwitchNic)",
        "NotifyPauseTrainState(notifySuccess)",
        "WaitReportPauseCompleteState(processPauseFail)",
        "NotifyKillJobState(finish)",
        "INIT",
    ]
    assert view.lists_sent == []
    assert view.violations == []


def test_continue_499_kills(make_setup: Callable[..., Setup]) -> None:
    """ReportRecoverStatus(499) to continue -> killMaster (same uuid), O&M told, reset."""
    setup = make_setup()
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    pause = agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    setup.worker.reply(True)
    assert agent.get().changeStrategy == "continue"
    assert setup.agent.recover_status(499, "continue").code == 0
    kill = agent.get()
    assert (kill.uuid, kill.signalType, list(kill.actions)) == (pause.uuid, "killMaster", [])
    assert om_stream.get().msg == "switch nic failed, continue train failed"
    for stream in (agent, worker, om_stream):
        assert stream.wait_end() == (OK, "")
    assert setup.view().action_path[-3:] == [
        "WaitContinueTrainState(continueTrainFail)",
        "NotifyKillJobState(finish)",
        "INIT",
    ]
    assert setup.view().violations == []


def test_stop_train_404_kills(make_setup: Callable[..., Setup]) -> None:
    """ReportStopComplete(404) to stop_train -> killMaster with the stop uuid, reset."""
    setup = make_setup()
    agent, worker, _, uuid = _fail_switch(setup)
    status = setup.agent.stop_complete(404)
    assert (status.code, status.info) == (0, received(JOB, uuid, "ReportStopComplete"))
    kill = agent.get()
    assert (kill.uuid, kill.signalType, list(kill.actions)) == (uuid, "killMaster", [])
    assert agent.wait_end() == (OK, "")
    assert worker.wait_end() == (OK, "")
    assert setup.view().action_path == [
        *TO_SWITCH_WAIT,
        "WaitSwitchNicFinishedState(switchNicFail)",
        "NotifyStopTrainState(notifySuccess)",
        "WaitReportStopCompleteState(processNotReadyEvent)",
        "NotifyKillJobState(finish)",
        "INIT",
    ]


def test_switch_reply_timeout(make_setup: Callable[..., Setup]) -> None:
    """no reply within reportTimeoutMinutes -> "report switch nic timeout", stop_train."""
    setup = make_setup(report_timeout_s=1.0)
    agent, worker = setup.ready()
    assert setup.om.track().code == 0
    pause = agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    stop = agent.get()
    assert (list(stop.actions), stop.uuid != pause.uuid) == (["stop_train"], True)
    view = setup.view()
    assert "WaitSwitchNicFinishedState(receiveTimeout)" in view.action_path
    assert view.om_messages == ["switch nic failed, report switch nic timeout"]


def test_pause_report_timeout_kills(make_setup: Callable[..., Setup]) -> None:
    setup = make_setup(report_timeout_s=0.3)
    agent, worker = setup.ready()
    assert setup.om.track().code == 0
    pause = agent.get()
    kill = agent.get()
    assert (kill.signalType, kill.uuid) == ("killMaster", pause.uuid)
    assert agent.wait_end() == (OK, "")
    assert worker.wait_end() == (OK, "")
    view = setup.view()
    assert view.action_path[-3:] == [
        "WaitReportPauseCompleteState(receiveTimeout)",
        "NotifyKillJobState(finish)",
        "INIT",
    ]
    assert view.om_messages == ["pause train timeout"]


def test_continue_report_timeout_kills(make_setup: Callable[..., Setup]) -> None:
    setup = make_setup(report_timeout_s=1.0)
    agent, worker = setup.ready()
    assert setup.om.track().code == 0
    pause = agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    setup.worker.reply(True)
    assert agent.get().changeStrategy == "continue"
    kill = agent.get()
    assert (kill.signalType, kill.uuid) == ("killMaster", pause.uuid)
    assert agent.wait_end() == (OK, "")
    view = setup.view()
    assert view.action_path[-3:] == ["WaitContinueTrainState(receiveTimeout)", "NotifyKillJobState(finish)", "INIT"]
    assert view.om_messages == ["switch nic failed, continue train timeout"]


def test_result_stream_timeout_queues_its_message_unsent(make_setup: Callable[..., Setup]) -> None:
    """after reportTimeoutMinutes without a message the O&M stream pushes "report switch nic
    result timeout, please check manually" into the channel and returns WITHOUT sending it; the
    next O&M subscriber of the same switch gets it."""
    setup = make_setup(report_timeout_s=0.3)
    assert setup.agent.init().code == 0 and setup.agent.register().code == 0  # no agent stream
    first = setup.start_switch()
    assert first.wait_end() == (OK, "")
    view = setup.view()
    assert view.om_messages == ["report switch nic result timeout, please check manually"]
    assert view.queued["om"] == 1
    second = setup.om.subscribe_result()
    assert second.get().msg == "report switch nic result timeout, please check manually"
    assert second.wait_end() == (OK, "")
