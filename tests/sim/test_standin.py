"""MindIOStandIn and Simulator(standin=True): the switch half driven alone ("pause mode external")."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from nicswitch_agent.sim import MindIOStandIn, SimJob, SimSettings, Simulator
from nicswitch_agent.sim import codes as P

from .conftest import FAST, JOB, NODES, OK, WAIT, Client, wait_streams
from .test_switch import HAPPY_PATH

pytestmark = pytest.mark.timeout(20)


def _switch_with_plain_worker(sim: Simulator, worker: Client, om: Client, result: bool) -> list[str]:
    """Subscribe, SwitchNicTrack, take the list, reply; return the O&M messages."""
    stream = worker.subscribe_notify()
    wait_streams(sim, P.SUBSCRIBE_NOTIFY_SWITCH, 1)
    assert om.track().code == 0
    om_stream = om.subscribe_result()
    rank_list = stream.get()
    assert (list(rank_list.rankID), list(rank_list.op), rank_list.jobId) == (["2", "3"], [True, False], JOB)
    assert worker.reply(result).code == 0
    response = om_stream.get()
    assert om_stream.wait_end() == (OK, "")
    if result:
        assert stream.wait_end() == (OK, "")
    return [response.msg]


def test_simulator_with_standin_runs_a_switch(make_sim: Callable[..., Simulator]) -> None:
    sim = make_sim(standin=True)
    # start() returned only once the stand-in held its process-manage stream.
    assert sim.job_view(JOB).open_streams[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] == 1
    worker, om = Client(sim.address, role="worker"), Client(sim.address, role="om")
    try:
        assert _switch_with_plain_worker(sim, worker, om, True) == ["switch nic finish"]
        view = sim.job_view(JOB)
        assert view.action_path == HAPPY_PATH
        assert view.violations == []
        # The stand-in resubscribes after the finish reset; then a second switch works.
        assert sim.wait_idle(JOB, WAIT)
        assert _switch_with_plain_worker(sim, worker, om, True) == ["switch nic finish"]
        assert sim.job_view(JOB).violations == []
    finally:
        worker.close()
        om.close()


def test_standin_answers_the_failure_path(make_sim: Callable[..., Simulator]) -> None:
    """A false reply: the stand-in answers stop_train and globalFault (["exit"]) like MindIO."""
    sim = make_sim()
    with MindIOStandIn(sim.address, JOB) as standin:
        assert standin.ready.wait(WAIT)
        worker, om = Client(sim.address, role="worker"), Client(sim.address, role="om")
        try:
            assert _switch_with_plain_worker(sim, worker, om, False) == ["switch nic failed, switch nic failed"]
            assert sim.wait_until(lambda s: len(s.job_view(JOB).path_history) == 1, WAIT)
            tail = ["FaultClearState(clearSuccess)", "FaultRetryState(finish)", "INIT"]
            assert sim.job_view(JOB).path_history[0][-3:] == tail
            assert sim.wait_idle(JOB, WAIT)
            seen = [(s.signalType, list(s.actions), s.changeStrategy, s.extraParams) for s in standin.signals]
            assert seen == [
                ("stopTrain", ["pause_train"], "", ""),
                ("stopTrain", ["stop_train"], "", ""),
                ("globalFault", ["on_global_rank", "fault_nodes_exit"], "", ""),
                ("changeStrategy", ["change_strategy"], "exit", ""),
                ("changeStrategy", ["change_strategy"], "exit", "dump_exit"),
            ]
            assert sim.job_view(JOB).stream_opens[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] == 2  # resubscribed once
            assert sim.job_view(JOB).violations == []
        finally:
            worker.close()
            om.close()


def test_standin_fail_pause_kills(make_sim: Callable[..., Simulator]) -> None:
    sim = make_sim()
    standin = MindIOStandIn(sim.address, JOB, fail_pause=True, pause_delay_s=0.01).start()
    try:
        assert standin.ready.wait(WAIT)
        om = Client(sim.address, role="om")
        assert om.track().code == 0
        assert sim.wait_until(lambda s: len(s.job_view(JOB).path_history) == 1, WAIT)
        assert sim.job_view(JOB).path_history[0] == [
            "INIT(startSwitchNic)",
            "NotifyPauseTrainState(notifySuccess)",
            "WaitReportPauseCompleteState(processPauseFail)",
            "NotifyKillJobState(finish)",
            "INIT",
        ]
        om.close()
    finally:
        standin.stop()
        standin.stop()  # idempotent
    with pytest.raises(RuntimeError):
        standin.start()


def test_simulator_lifecycle() -> None:
    sim = Simulator(jobs=[SimJob(JOB, NODES)])
    with pytest.raises(RuntimeError):
        _ = sim.address
    with sim:
        assert sim.address.startswith("127.0.0.1:")
        with pytest.raises(RuntimeError):
            sim.start()
        assert Client(sim.address).init().code == 0
    sim.stop()  # idempotent
    with pytest.raises(ValueError):
        Simulator(jobs=[SimJob(JOB, NODES), SimJob(JOB, NODES)])


def test_standin_registers_again_with_a_restarted_simulator(make_sim: Callable[..., Simulator]) -> None:
    """A restarted ClusterD knows no job: the stand-in's next subscribe is answered "not registed",
    and it must Init/Register again (as MindIO does) instead of subscribing in vain forever."""
    first = make_sim()
    port = int(first.address.rpartition(":")[2])
    with MindIOStandIn(first.address, JOB) as standin:
        assert standin.ready.wait(WAIT)
        first.stop()
        with Simulator(jobs=[SimJob(JOB, NODES)], settings=SimSettings(**FAST), port=port) as second:
            assert second.wait_until(
                lambda sim: sim.job_view(JOB).open_streams[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] == 1, WAIT
            ), second.job_view(JOB)
