"""Errors before registration and parameter validation (docs/clusterd.md#errors-before-registration,
docs/clusterd.md#switchnictrack-validation)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import SimJob
from nicswitch_agent.sim import codes as P

from .conftest import JOB, NODES, UNKNOWN, Client, Setup

pytestmark = pytest.mark.timeout(15)


def test_pre_transcript(make_setup: Callable[..., Setup]) -> None:
    """The docs/clusterd.md#errors-before-registration run, call by call."""
    setup = make_setup()
    om, worker, agent = setup.om, setup.worker, setup.agent

    health = om.stub.HealthCheck(om.info(), timeout=5)
    assert (health.code, health.info) == (0, "jobId=job-uid-0001, receive HeathCheck")
    assert worker.subscribe_notify().wait_end() == (
        UNKNOWN,
        "jobId=job-uid-0001 not registed, please wait agent register",
    )
    assert om.subscribe_result().wait_end() == (UNKNOWN, "jobId=job-uid-0001 not registed")
    assert agent.subscribe_process_manage().wait_end() == (UNKNOWN, "jobId=job-uid-0001 not registed")
    status = om.track()
    assert (status.code, status.info) == (413, "job:job-uid-0001 is not registered")
    status = Client(setup.sim.address, job_id="no-such-job").track()
    assert (status.code, status.info) == (413, "job:no-such-job not exist")
    status = worker.reply(True)
    assert (status.code, status.info) == (400, "jobId=job-uid-0001 not registed")
    status = agent.register()
    assert (status.code, status.info) == (408, "jobId=job-uid-0001 not inited")
    for _ in range(2):
        status = agent.init()
        assert (status.code, status.info) == (0, "job(uid=job-uid-0001) init success")
    for _ in range(2):
        status = agent.register()
        assert (status.code, status.info) == (0, "register success")
    cases = [
        ({"node-9": (["0"], [True])}, "node:node-9 not exist in job:job-uid-0001"),
        ({"node-0": (["7"], [True])}, "device:7 not exist in node:node-0"),
        ({"node-0": (["0", "1"], [True])}, "dev and op length is not equal"),
        ({"node-0": ([], [])}, "dev or op is empty"),
    ]
    for nic_ops, info in cases:
        status = om.track(nic_ops)
        assert (status.code, status.info) == (413, info)
    assert om.subscribe_result().wait_end() == (UNKNOWN, "jobId=job-uid-0001 is not swtiching nic")

    view = setup.view()
    assert (view.state, view.loop_running, view.resets, view.violations) == ("INIT", False, [], [])
    assert view.stream_opens == dict.fromkeys(P.STREAM_METHODS, 0)


def test_unknown_job_everywhere(make_setup: Callable[..., Setup]) -> None:
    """A job ClusterD has no PodGroup for: Init 502 (getJobBaseInfo), the rest as unregistered."""
    setup = make_setup()
    ghost = Client(setup.sim.address, job_id="ghost")
    status = ghost.init()
    assert (status.code, status.info) == (502, "job(uid=ghost) one of jobName, pgName, ns is empty")
    assert (ghost.register().code, ghost.register().info) == (408, "jobId=ghost not inited")
    assert ghost.subscribe_process_manage().wait_end() == (UNKNOWN, "jobId=ghost not registed")
    for status in (ghost.stop_complete(0), ghost.recover_status(0), ghost.recover_strategy(["exit"])):
        assert (status.code, status.info) == (400, "jobId=ghost not registed")
    ghost.close()


def test_reports_before_registration_answer_400(make_setup: Callable[..., Setup]) -> None:
    setup = make_setup()
    for status in (
        setup.agent.stop_complete(0),
        setup.agent.recover_status(0),
        setup.agent.recover_strategy(["exit"]),
    ):
        assert (status.code, status.info) == (400, "jobId=job-uid-0001 not registed")


def test_job_not_running_and_superpod(make_setup: Callable[..., Setup]) -> None:
    jobs = [
        SimJob(JOB, NODES, running=False),
        SimJob("job-sp", NODES, superpod_ids={"node-0": 3, "node-1": -1}),
    ]
    setup = make_setup(jobs=jobs)
    assert setup.agent.init().code == 0 and setup.agent.register().code == 0
    status = setup.om.track()
    assert (status.code, status.info) == (413, "job:job-uid-0001 is not running")
    sp = Client(setup.sim.address, job_id="job-sp")
    assert sp.init().code == 0 and sp.register().code == 0
    status = sp.track({"node-1": (["0"], [True])})
    assert (status.code, status.info) == (413, "node:node-1 should operate in superPodID")
    sp.close()


def test_validation_precedes_the_state_check(make_setup: Callable[..., Setup]) -> None:
    """413 before 411 (docs/clusterd.md#switchnictrack-validation): a bad request during a switch is still a parameter
    error."""
    setup = make_setup()
    agent, _worker = setup.ready()
    setup.start_switch()
    agent.get()
    status = setup.om.track({"node-9": (["0"], [True])})
    assert status.code == 413
    status = setup.om.track()
    assert (status.code, status.info) == (411, "jobId=job-uid-0001 nic is swtiching, or job recovering")


def test_empty_nic_ops_stalls_after_pause(make_setup: Callable[..., Setup]) -> None:
    """docs/clusterd.md#switchnictrack-validation "Not validated": an empty map is accepted; the machine stalls in
    WaitReportPauseCompleteState after the pause report, and the O&M stream is refused."""
    setup = make_setup()
    agent, worker = setup.ready()
    status = setup.om.track({})
    assert (status.code, status.info) == (0, "switching operation was successfully distributed")
    assert setup.om.subscribe_result().wait_end() == (UNKNOWN, "jobId=job-uid-0001 is not swtiching nic")
    assert list(agent.get().actions) == ["pause_train"]
    assert setup.agent.stop_complete(0).code == 0
    assert setup.sim.wait_until(
        lambda s: (
            s.job_view(JOB).action_path[-1] == "WaitReportPauseCompleteState"
            and s.job_view(JOB).state == "WaitReportPauseCompleteState"
        ),
        5,
    )
    worker.assert_quiet(0.2)
    assert setup.view().state == "WaitReportPauseCompleteState"
    assert any("empty nicOps" in v for v in setup.view().violations)


def test_oversized_request_is_refused(make_setup: Callable[..., Setup]) -> None:
    """MaxRecvMsgSize 4 MiB (docs/clusterd.md#transport-address-and-server-options): a bigger request never reaches the
    handler."""
    setup = make_setup()
    request = pb.SwitchNics(jobID=JOB)
    request.nicOps["node-0"].dev.extend(["0" * 1024] * 4200)
    request.nicOps["node-0"].op.extend([True] * 4200)
    assert request.ByteSize() > P.MAX_RECEIVE_BYTES
    with pytest.raises(grpc.RpcError) as info:
        setup.om.stub.SwitchNicTrack(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
