"""Behaviours recorded on the real ClusterD that the simulator once got wrong or could not set up.

- Two SubscribeNotifySwitch streams for one job: the one that has waited longest gets the list,
  even a stale one (then the switch stalls until the report timeout).
- ``ReportStopComplete``/``ReportRecoverStatus`` without ``status``, and a second reply blocked on
  the full one-slot channel when the job resets: the real server crashes. By default the simulator
  records it and logs an ERROR; with ``crash_like_clusterd`` it goes down the same way.
- A server that goes down (SIGKILL or SIGTERM): every open stream ends with UNAVAILABLE, never
  cleanly (a clean end is what a reset looks like to a client).
- Init answering 403 (``process-recover-enable`` off), SwitchNicTrack answering 413 ``not exist``
  for a registered job (no job cache), and a MindSpore job's ``dump`` turned into ``exit``.

Timings are shrunk; every wait is on a stream message, a stream end or ``Simulator.wait_until``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import pytest

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import SimJob
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.event_controller import FATAL_PREFIX

from .conftest import JOB, NODES, OK, WAIT, Client, Setup, StreamReader, wait_state
from .test_switch import HAPPY_PATH

pytestmark = pytest.mark.timeout(30)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _fatal(setup: Setup) -> list[str]:
    return [v for v in setup.view().violations if v.startswith(FATAL_PREFIX)]


def _health_unavailable(client: Client) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        client.stub.HealthCheck(client.info(), timeout=WAIT)
    assert failure.value.code() == UNAVAILABLE


# ---------------------------------------------------------------- 1. first come, first served


def _switch_with_subscribers(setup: Setup, count: int) -> list[StreamReader]:
    """Agent first, then ``count`` notify subscribers (each on its own channel), in order: each
    waiting for a list before the next subscribes (a stream waits some time after its open, and
    under load worker1's handler could wait before worker0's: it would then get the list)."""
    setup.register_agent()
    readers = []
    for index in range(count):
        readers.append(setup.subscribe_worker(setup.client(f"worker{index}")))
        assert setup.sim.wait_until(lambda s, n=index + 1: s.job_view(JOB).list_waiters == n, WAIT), \
            f"worker{index} never waited for a list"
    return readers


def test_the_longest_waiting_subscriber_gets_every_list(make_setup: Callable[..., Setup]) -> None:
    """twoworkers: the list goes to the stream that has waited longest, not to the newest.
    Three switches, three subscribers each: the first subscriber wins every time."""
    setup = make_setup()
    for switch in range(3):
        readers = _switch_with_subscribers(setup, 3)
        agent = setup.agent.readers[-1]
        om_stream = setup.start_switch()
        agent.get()
        setup.agent.stop_complete(0)
        rank_list = readers[0].get()
        assert list(rank_list.rankID) == ["2", "3"], f"switch {switch}"
        setup.others[-3].reply(True)
        assert agent.get().changeStrategy == "continue"
        setup.agent.recover_status(0, "continue")
        assert om_stream.get().msg == "switch nic finish"
        for later in readers[1:]:
            assert later.wait_end() == (OK, ""), f"switch {switch}: a newer subscriber got the list"
        assert readers[0].wait_end() == (OK, "")
    view = setup.view()
    assert len(view.lists_sent) == 3 and view.action_path == HAPPY_PATH


def test_a_stale_stream_gets_the_list_and_the_switch_stalls_until_the_timeout(
    make_setup: Callable[..., Setup],
) -> None:
    """The consequence: an agent restarted and subscribed again while its old stream still looks
    alive to ClusterD (a half-open connection). The old stream has waited longest, so the list goes
    there; nobody answers it, and only the report timeout (15 min upstream, 1 s here) ends the wait:
    the switch fails. The restarted agent's fresh stream never sees the list."""
    setup = make_setup(report_timeout_s=1.0)
    stale, fresh = _switch_with_subscribers(setup, 2)
    agent = setup.agent.readers[-1]
    assert setup.om.track().code == 0
    pause = agent.get()
    setup.agent.stop_complete(0)
    assert list(stale.get().rankID) == ["2", "3"]  # delivered into the dead agent's stream
    wait_state(setup.sim, "WaitSwitchNicFinishedState")
    # Nobody replies: the next thing that happens is the report timeout.
    stop = agent.get()
    assert (stop.signalType, list(stop.actions), stop.uuid != pause.uuid) == ("stopTrain", ["stop_train"], True)
    view = setup.view()
    assert "WaitSwitchNicFinishedState(receiveTimeout)" in view.action_path
    assert view.om_messages == ["switch nic failed, report switch nic timeout"]
    assert view.replies == []
    fresh.assert_quiet(0.1)


# ---------------------------------------------------------------- 2. a report without status


def _report_without_status(client: Client, method: str) -> pb.Status:
    if method == P.REPORT_STOP_COMPLETE:
        return client.stub.ReportStopComplete(pb.StopCompleteRequest(jobId=client.job_id), timeout=WAIT)
    return client.stub.ReportRecoverStatus(
        pb.RecoverStatusRequest(jobId=client.job_id, strategy="continue"), timeout=WAIT
    )


def _to_the_report(setup: Setup, method: str) -> tuple[StreamReader, StreamReader, StreamReader]:
    """A switch up to the report ``method`` answers: the pause, or the continue."""
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    assert agent.get().signalType == "stopTrain"
    if method == P.REPORT_RECOVER_STATUS:
        setup.agent.stop_complete(0)
        worker.get()
        setup.worker.reply(True)
        assert agent.get().changeStrategy == "continue"
    return agent, worker, om_stream


@pytest.mark.parametrize("method", [P.REPORT_STOP_COMPLETE, P.REPORT_RECOVER_STATUS])
def test_report_without_status_crashes_like_clusterd(make_setup: Callable[..., Setup], method: str) -> None:
    """nilstatus: the report gets UNAVAILABLE, every stream ends UNAVAILABLE, later calls too."""
    setup = make_setup(crash_like_clusterd=True)
    agent, worker, om_stream = _to_the_report(setup, method)
    with pytest.raises(grpc.RpcError) as failure:
        _report_without_status(setup.agent, method)
    assert failure.value.code() == UNAVAILABLE
    for stream in (agent, worker, om_stream):
        assert stream.wait_end()[0] == UNAVAILABLE, stream.name
    assert setup.sim.wait_crashed(WAIT)
    _health_unavailable(setup.om)
    crashed = setup.sim.crashed
    assert crashed is not None and f"{method} without a status field" in crashed
    assert setup.sim.crash_points() == [crashed]


@pytest.mark.parametrize("method", [P.REPORT_STOP_COMPLETE, P.REPORT_RECOVER_STATUS])
def test_report_without_status_is_recorded_and_logged_and_the_rehearsal_goes_on(
    make_setup: Callable[..., Setup], method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Default mode: the real server would die here; the simulator says so (a violation and an
    ERROR naming the crash), reads the report as code 0 and the switch completes."""
    setup = make_setup()
    agent, worker, om_stream = _to_the_report(setup, method)
    with caplog.at_level(logging.ERROR, logger="nicswitch_agent.sim"):
        status = _report_without_status(setup.agent, method)
    assert status.code == 0
    [fatal] = _fatal(setup)
    assert f"{method} without a status field" in fatal and "panics" in fatal
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("real ClusterD would crash here" in e and "without a status field" in e for e in errors), errors
    if method == P.REPORT_STOP_COMPLETE:
        worker.get()
        setup.worker.reply(True)
        assert agent.get().changeStrategy == "continue"
        setup.agent.recover_status(0, "continue")
    assert om_stream.get().msg == "switch nic finish"
    assert setup.sim.crashed is None and len(setup.sim.crash_points()) == 1
    assert setup.agent.init().code == 0  # still serving


# ---------------------------------------------------------------- 3. a reply blocked at a reset


def test_second_reply_blocked_at_a_reset_crashes_like_clusterd(make_setup: Callable[..., Setup]) -> None:
    """doublereply: #1 buffered (no switch), #2 blocks on the full slot and its client gives up;
    the agent's stream ends, the job resets, the blocked send panics: the server is gone."""
    setup = make_setup(crash_like_clusterd=True)
    agent = setup.register_agent()
    assert setup.worker.reply(True).info == "reply success"
    with pytest.raises(grpc.RpcError) as failure:
        setup.worker.reply(True, timeout=0.5)
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert setup.sim.crashed is None  # a blocked handler alone does not crash it
    assert setup.agent.init().code == 0
    assert agent.cancel()[0] == grpc.StatusCode.CANCELLED  # the reset
    assert setup.sim.wait_crashed(WAIT)
    crashed = setup.sim.crashed
    assert crashed is not None and "send on closed channel" in crashed
    _health_unavailable(setup.om)


def test_third_reply_crashes_like_clusterd(make_setup: Callable[..., Setup]) -> None:
    """triple reply: #1 consumed, #2 buffered, #3 blocks; the finish reset panics the server."""
    setup = make_setup(crash_like_clusterd=True)
    agent, worker = setup.ready()
    om_stream = setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    setup.worker.reply(True)
    assert agent.get().changeStrategy == "continue"
    setup.worker.reply(True)
    third = setup.worker.stub.ReplySwitchNicResult.future(pb.SwitchResult(jobId=JOB, result=True), timeout=WAIT)
    assert setup.sim.wait_until(
        lambda s: any(v.startswith("duplicate reply while a result is pending") for v in s.job_view(JOB).violations),
        WAIT,
    )
    setup.agent.recover_status(0, "continue")
    assert third.exception(WAIT) is not None and third.code() == UNAVAILABLE
    assert setup.sim.wait_crashed(WAIT)
    assert "send on closed channel" in (setup.sim.crashed or "")
    _health_unavailable(setup.om)
    del om_stream  # "switch nic finish" may or may not beat the crash to it, as upstream


def test_blocked_reply_at_a_reset_is_an_error_by_default(
    make_setup: Callable[..., Setup], caplog: pytest.LogCaptureFixture
) -> None:
    """Default mode: the blocked reply ends with UNAVAILABLE, an ERROR says the real server dies
    here and why, and the simulator goes on serving."""
    setup = make_setup()
    agent = setup.register_agent()
    setup.worker.reply(True)
    with pytest.raises(grpc.RpcError):
        setup.worker.reply(True, timeout=0.5)
    with caplog.at_level(logging.ERROR, logger="nicswitch_agent.sim"):
        agent.cancel()
        assert setup.sim.wait_until(lambda s: len(s.crash_points()) == 1, WAIT)
    [fatal] = _fatal(setup)
    assert "send on closed channel" in fatal and "process exits" in fatal
    assert any("real ClusterD would crash here" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert setup.sim.crashed is None
    assert setup.agent.init().code == 0


# ---------------------------------------------------------------- 5-7. settings that did not exist


def test_init_403_when_process_recover_is_off(make_setup: Callable[..., Setup]) -> None:
    setup = make_setup(jobs=[SimJob(JOB, NODES, process_recover_enable=False)])
    status = setup.agent.init()
    assert (status.code, status.info) == (
        403,
        f"job(uid={JOB}) process-recover-enable and subhealthy hotswtich not open:<nil>",
    )
    assert setup.agent.init().code == 403  # nothing was recorded: not idempotent success
    assert (setup.agent.register().code, setup.agent.register().info) == (408, f"jobId={JOB} not inited")
    view = setup.view()
    assert (view.inited, view.registered) == (False, False)


def test_switch_nic_track_413_not_exist_for_a_registered_job_missing_from_the_job_cache(
    make_setup: Callable[..., Setup],
) -> None:
    setup = make_setup(jobs=[SimJob(JOB, NODES, in_job_cache=False)])
    agent, _worker = setup.ready()
    status = setup.om.track()
    assert (status.code, status.info) == (413, f"job:{JOB} not exist")
    assert setup.view().state == "INIT"
    agent.assert_quiet(0.1)


def _fail_to_decision(setup: Setup) -> tuple[StreamReader, str]:
    """A switch the worker fails, then stop_train, globalFault and the agent offering dump/exit."""
    agent, worker = setup.ready()
    setup.start_switch()
    agent.get()
    setup.agent.stop_complete(0)
    worker.get()
    setup.worker.reply(False)
    stop = agent.get()
    assert list(stop.actions) == ["stop_train"]
    setup.agent.stop_complete(0)
    assert agent.get().signalType == "globalFault"
    assert setup.agent.recover_strategy(["dump", "exit"]).code == 0
    decided = agent.get()
    assert decided.signalType == "changeStrategy"
    return agent, decided.changeStrategy


def test_mindspore_job_exits_instead_of_dumping_after_a_failed_switch(make_setup: Callable[..., Setup]) -> None:
    """MindSpore, agent offers dump,exit, the annotation allows dump: ``exit`` while switching,
    then the exit tail (dump_exit, reset), as recorded."""
    setup = make_setup(jobs=[SimJob(JOB, NODES, recover_strategies=("recover", "dump"), framework="mindspore")])
    agent, decided = _fail_to_decision(setup)
    assert decided == "exit"
    dump_exit = agent.get()
    assert (dump_exit.changeStrategy, dump_exit.extraParams) == ("exit", "dump_exit")
    assert agent.wait_end() == (OK, "")
    path = setup.view().path_history[-1]
    assert "NotifyDecidedStrategyState(notifyExitStrategySuccess)" in path
    assert setup.view().violations == []


def test_pytorch_job_dumps(make_setup: Callable[..., Setup]) -> None:
    setup = make_setup(jobs=[SimJob(JOB, NODES, recover_strategies=("recover", "dump"), framework="pytorch")])
    _agent, decided = _fail_to_decision(setup)
    assert decided == "dump"


def test_simjob_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="recover_strategies \\['foo'\\] unknown"):
        SimJob(JOB, NODES, recover_strategies=("foo",))
    with pytest.raises(ValueError, match="framework 'tensorflow' unknown"):
        SimJob(JOB, NODES, framework="tensorflow")



def test_stopping_ends_every_open_stream_with_unavailable(make_setup: Callable[..., Setup]) -> None:
    """restart (SIGTERM, grpc.Server.Stop): the agent's and the worker's streams end UNAVAILABLE
    within milliseconds, not OK. An OK end would tell a client that ClusterD reset the job, and
    three of those with no signal read as another process-manage client (docs/clusterd.md#restarts)."""
    setup = make_setup()
    agent, worker = setup.ready()
    setup.sim.stop()
    assert agent.wait_end()[0] == UNAVAILABLE
    assert worker.wait_end()[0] == UNAVAILABLE
