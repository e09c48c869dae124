"""Status tells the truth (issue 11, "Trust at the edges", section 3).

- ``connected`` means a notify stream is established: not while the stream waits for a
  connection that is refused, and not again after ClusterD (a simulator process) is SIGKILLed;
  ``nicswitch-agent status`` then says NOT OK.
- Pause mode ``agent`` with nothing at the server port: the real cause ("Connection refused") at
  once, in ``last_error`` and one WARNING, also after a wait for the connection runs out, and
  ``stop()`` is prompt (no "did not stop within").
- Two process-manage clients for one job (the simulator's stand-in, and an agent in pause mode
  ``agent``): detected, one WARNING naming the cause and the fix, shown in status and by
  ``nicswitch-agent status``; the agent stops fighting; with pause ``auto`` it falls back to
  ``external`` and switches with the stand-in doing the pausing.

Waits are bounded and wait on conditions. Where the claim is "stays false", the test watches for
a bounded window (1.5 s past the moment the old code turned true): that is the observation, not
synchronisation.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from soak import JOB, SubprocessBackend
from support import Trainer, free_port, operator_switch, store_server_process, wait_until

from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.status_file import ExitCode
from nicswitch_agent.ops.status_cli import add_arguments, run
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(60)

NODES = {"node-0": ["0", "1"]}
REFUSED = "Connection refused"
NOT_REGISTERED = "not registed"  # ClusterD's own spelling
NOT_CONNECTED = 5  # nicswitch-agent status: a running leader that takes no part (ExitCode.NOT_CONNECTED)
# The old code called a stream "connected" once it had been open 1 s without error, whether or
# not a connection existed; watching 1.5 s past that shows it no longer does.
OLD_SETTLE_S = 1.0
WINDOW_S = OLD_SETTLE_S + 1.5


def never_within(predicate: Callable[[], bool], window: float) -> bool:
    """True if ``predicate`` stayed false for the whole observation ``window``."""
    return not wait_until(predicate, window)


def status_command(path: Path, *extra: str) -> tuple[int, str]:
    """``nicswitch-agent status --file PATH`` through its real argument parser; (exit code, text)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = run(parser.parse_args(["--file", str(path), *extra]), env={})
    return code, out.getvalue()


@pytest.fixture
def agents() -> Iterator[list[SwitchAgent]]:
    started: list[SwitchAgent] = []
    yield started
    for agent in started:
        agent.stop("test done")


def warnings_with(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and needle in r.getMessage()]


# -- connected only while a stream is established --------------------------------------------------


def test_external_with_nothing_listening_is_never_connected(agents: list[SwitchAgent], tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    agent = SwitchAgent(server=f"127.0.0.1:{free_port()}", job_id=JOB, pause="external",
                        switch_hook=lambda order: True, status_file=str(status_file), status_interval_s=0.2)
    agents.append(agent.start())
    assert wait_until(lambda: REFUSED in agent.status()["last_error"], 10), agent.status()
    assert never_within(lambda: agent.status()["connected"], WINDOW_S), agent.status()
    status = agent.status()
    assert status["stream_open"]  # a stream waits for the connection: open, and not connected
    assert status["disconnected_s"] >= OLD_SETTLE_S

    assert wait_until(lambda: status_command(status_file)[0] == NOT_CONNECTED, 10), status_command(
        status_file)
    _code, text = status_command(status_file)
    assert "verdict     OK" not in text and "NOT OK: not connected to ClusterD" in text, text
    assert REFUSED in text


def test_connected_goes_false_and_stays_false_when_clusterd_is_killed(agents: list[SwitchAgent],
                                                                      tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    sim = SubprocessBackend(free_port(), SimJob(job_id=JOB, nodes=NODES), report_timeout_s=30.0, standin=True)
    try:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=lambda order: True,
                            status_file=str(status_file), status_interval_s=0.2)
        agents.append(agent.start())
        assert wait_until(lambda: agent.status()["connected"], 30), (agent.status(), sim.tail())
        assert wait_until(lambda: status_command(status_file)[0] == ExitCode.OK, 10), status_command(status_file)
        assert "verdict     OK" in status_command(status_file)[1]

        sim.kill()  # SIGKILL: the stream breaks, and nothing listens on the port any more
        assert wait_until(lambda: not agent.status()["connected"], 10), agent.status()
        assert never_within(lambda: agent.status()["connected"], WINDOW_S), agent.status()
        assert wait_until(lambda: status_command(status_file)[0] == NOT_CONNECTED, 10), status_command(
            status_file)
        _code, text = status_command(status_file)
        assert "verdict     OK" not in text and "connected   NO" in text, text
    finally:
        sim.close()


def test_a_switch_leaves_the_verdict_ok(agents: list[SwitchAgent], tmp_path: Path) -> None:
    """The control: ClusterD ends the notify stream after every switch; reopened at once, it is
    established again well within the status command's grace, and the verdict stays OK."""
    status_file = tmp_path / "status.json"
    settings = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01,
                           force_release_s=0.01, schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
    replied = threading.Event()
    with Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=settings, standin=True) as sim:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=lambda order: True,
                            status_file=str(status_file), status_interval_s=0.2,
                            on_event=lambda e: e.kind == ev.REPLY_SENT and replied.set())
        agents.append(agent.start())
        assert wait_until(lambda: agent.status()["connected"], 10), agent.status()
        switch(sim.address, [True, False])
        assert replied.wait(20), agent.status()
        assert wait_until(lambda: agent.status()["stream"]["opens"] >= 2 and agent.status()["connected"], 10)
        code, text = status_command(status_file)
        assert code == ExitCode.OK, text


def test_a_hook_stuck_past_its_timeout_is_not_ok(agents: list[SwitchAgent], tmp_path: Path) -> None:
    """The tester's case: a rank whose switch hook runs on past its timeout answers every order false,
    and its status said "verdict OK" (exit 0). Now: NOT OK, exit 6 (stuck)."""
    status_file = tmp_path / "status.json"
    release = threading.Event()
    settings = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01,
                           force_release_s=0.01, schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=settings, standin=True) as sim:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_timeout_s=0.2,
                            switch_hook=lambda order: release.wait(30), status_file=str(status_file),
                            status_interval_s=0.2)
        agents.append(agent.start())
        try:
            assert wait_until(lambda: agent.status()["connected"], 10), agent.status()
            code, text = status_command(status_file)
            assert code == ExitCode.OK, text  # the control
            assert operator_switch(sim.address, JOB, ["0"], [True]).startswith("switch nic failed")
            assert wait_until(lambda: agent.status()["stuck_hook"] and "stuck_hook\": \"" in status_file.read_text(),
                              20), agent.status()
            code, text = status_command(status_file)
            assert code == ExitCode.STUCK == 6, text
            assert "stuck hook  " in text and "verdict     NOT OK: " in text and "past its timeout" in text, text
        finally:
            release.set()


# -- pause mode agent, nothing at the port ---------------------------------------------------------


def test_agent_mode_wrong_port_shows_connection_refused_at_once_and_stops_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = SwitchAgent(server=f"127.0.0.1:{free_port()}", job_id=JOB, pause="agent", switch_hook=lambda order: True,
                        rpc_timeout_s=0.5)
    agent.start()
    try:
        # Well before rpc_timeout_s runs out: the first Init does not wait for a connection.
        assert wait_until(lambda: REFUSED in agent.status()["last_error"], 5), agent.status()
        assert REFUSED in agent.status()["process_manage"]["last_error"]
        # Two waits for the connection ran out since: the cause is still the refused port, said once.
        assert wait_until(lambda: agent.status()["process_manage"]["errors"] >= 3, 20), agent.status()
        assert REFUSED in agent.status()["last_error"], agent.status()
        assert "DEADLINE_EXCEEDED" not in agent.status()["process_manage"]["last_error"]
        assert len(warnings_with(caplog, REFUSED)) == 1, [r.getMessage() for r in caplog.records]
    finally:
        agent.stop()
    assert not warnings_with(caplog, "did not stop within"), [r.getMessage() for r in caplog.records]
    assert agent.status()["state"] == "stopped"


# -- two process-manage clients for one job ---------------------------------------------------------


CAUSE = "another process-manage client"


def conflict_sim() -> Simulator:
    settings = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01,
                           force_release_s=0.01, schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
    return Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=settings, standin=True)


def switch(address: str, ops: list[bool]) -> None:
    channel = open_channel(ChannelSettings(target=address))
    try:
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps["node-0"].dev.extend(["0", "1"])
        request.nicOps["node-0"].op.extend(ops)
        status = RecoverStub(channel).SwitchNicTrack(request, timeout=10, wait_for_ready=True)
        assert status.code == 0, status
    finally:
        channel.close()


def test_pause_agent_next_to_a_standin_detects_the_fight_warns_and_backs_off(
    agents: list[SwitchAgent], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    status_file = tmp_path / "status.json"
    with conflict_sim() as sim:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True,
                            status_file=str(status_file), status_interval_s=0.2)
        agents.append(agent.start())
        assert wait_until(lambda: agent.status().get("conflict") is not None, 20), agent.status()
        status = agent.status()
        assert status["pause"] == "agent"  # asked for explicitly: no fallback
        assert CAUSE in status["conflict"]["detail"] and "backing off" in status["conflict"]["action"]
        assert CAUSE in status["last_error"]
        warned = warnings_with(caplog, CAUSE)
        assert len(warned) == 1, [r.getMessage() for r in warned]
        for needle in ("MindIO/TaskD", "--standin", 'pause="external"', "stop the other client"):
            assert needle in warned[0].getMessage()

        # The status file is rewritten on its writer's thread once the conflict is known: wait for it.
        assert wait_until(lambda: "fights for the job's stream" in status_command(status_file)[1], 10)
        code, text = status_command(status_file)
        assert code == NOT_CONNECTED and "fights for the job's stream" in text, text

        # Stopped fighting: nobody resets the job any more (each subscribe of either client did),
        # the stand-in keeps its stream, and the agent does not subscribe again.
        opens, resets = status["process_manage"]["opens"], sim.reset_count(JOB)
        assert never_within(lambda: agent.status()["process_manage"]["opens"] > opens
                            or sim.reset_count(JOB) > resets, 2.0), (agent.status(), sim.reset_count(JOB))
        assert sim.wait_idle(JOB, 10)  # the stand-in holds the process-manage stream


def test_pause_auto_next_to_a_standin_falls_back_to_external_and_switches(
    agents: list[SwitchAgent], caplog: pytest.LogCaptureFixture,
) -> None:
    replied = threading.Event()
    with conflict_sim() as sim:
        standin = sim._standins[0]
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="auto", switch_hook=lambda order: True,
                            on_event=lambda e: e.kind == ev.REPLY_SENT and replied.set())
        assert agent.pause_mode == "agent"  # no MindIO/TaskD markers in the environment
        agents.append(agent.start())
        assert wait_until(lambda: agent.status()["pause"] == "external", 20), agent.status()
        status: dict[str, Any] = agent.status()
        assert status["process_manage"] is None
        assert "fell back to pause mode external" in status["conflict"]["action"]
        assert warnings_with(caplog, "falling back to pause mode external")
        assert wait_until(lambda: agent.status()["connected"], 10), agent.status()

        assert sim.wait_idle(JOB, 20)
        signals_before = len(standin.signals)
        switch(sim.address, [True, False])
        assert replied.wait(20), agent.status()
        assert sim.wait_idle(JOB, 20)
        paused_by = [(s.signalType, list(s.actions)) for s in standin.signals[signals_before:]]
        assert ("stopTrain", ["pause_train"]) in paused_by, paused_by  # the stand-in paused training
        assert agent.status()["counters"]["replies_delivered"] == 1


def test_stop_right_after_start_in_agent_mode_with_nothing_at_the_port_is_prompt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Init waits for a connection (rpc_timeout_s, 10 s by default): stop() cancels it."""
    agent = SwitchAgent(server=f"127.0.0.1:{free_port()}", job_id=JOB, pause="agent", switch_hook=lambda order: True)
    agent.start()  # its process-manage thread is in Init at once
    agent.stop()
    assert not warnings_with(caplog, "did not stop within"), [r.getMessage() for r in caplog.records]


# -- the verdict of nicswitch-agent status, from written files -------------------------------------


def write_status(path: Path, **status: Any) -> Path:
    import json

    base = {"state": "running", "role": "leader", "pause": "external", "connected": True, "disconnected_s": None,
            "last_error": "", "conflict": None}
    base.update(status)
    path.write_text(json.dumps({"format": "nicswitch-agent-status/1", "written_at": time.time(), "pid": 1,
                                "host": "h", "interval_s": 10.0, "writes": 1, "status": base}))
    return path


@pytest.mark.parametrize(("status", "code", "needle"), [
    ({}, ExitCode.OK, "verdict     OK"),
    ({"connected": False, "disconnected_s": 0.4}, ExitCode.OK, "connected   NO, for 400 ms"),  # after a switch
    ({"connected": False, "disconnected_s": 12.0, "last_error": "UNAVAILABLE: Connection refused"},
     NOT_CONNECTED, "not connected to ClusterD for 12.0 s (more than 3.0 s): UNAVAILABLE: Connection refused"),
    ({"connected": False, "disconnected_s": 12.0, "role": "member"}, ExitCode.OK, "verdict     OK"),
    ({"connected": False, "disconnected_s": 12.0, "state": "stopped"}, ExitCode.NOT_RUNNING, "the agent is stopped"),
    ({"pause": "agent", "conflict": {"detail": "another process-manage client ...", "action": "backing off"}},
     NOT_CONNECTED, "fights for the job's stream"),
    ({"pause": "external", "conflict": {"detail": "another process-manage client ...",
                                        "action": "fell back to pause mode external (pause=auto)"}},
     ExitCode.OK, "conflict    fell back to pause mode external"),
])
def test_status_verdict(tmp_path: Path, status: dict[str, Any], code: ExitCode, needle: str) -> None:
    got, text = status_command(write_status(tmp_path / "s.json", **status))
    assert got == code and needle in text, text


def test_a_longer_grace_can_be_asked_for(tmp_path: Path) -> None:
    path = write_status(tmp_path / "s.json", connected=False, disconnected_s=12.0)
    assert status_command(path)[0] == NOT_CONNECTED
    assert status_command(path, "--max-disconnected", "60")[0] == ExitCode.OK


def test_conflict_detector_counts_quiet_ends_within_the_window() -> None:
    from nicswitch_agent.clusterd.process_manage import ConflictDetector

    now = [0.0]
    detector = ConflictDetector(3, 30.0, clock=lambda: now[0])
    assert [detector.quiet_end() for _ in range(2)] == [False, False]
    now[0] = 10.0
    assert detector.quiet_end()  # 3 within 30 s
    detector.signal()  # a real signal between them: ClusterD's own reset
    assert not detector.quiet_end() and not detector.quiet_end()
    now[0] = 50.0
    assert not detector.quiet_end()  # the first two were 40 s ago


# -- last_error means "now"; the last error seen is history (issue 18, item 3) ----------------------


@pytest.mark.parametrize("pause", ["external", "agent"])
def test_last_error_is_empty_once_connected_and_the_refusal_is_kept_as_history(
    agents: list[SwitchAgent], tmp_path: Path, pause: str,
) -> None:
    """Started before ClusterD: "Connection refused" while nothing listens; once the simulator
    (started after the agent) is up and the agent connected, and after a switch, ``last_error``
    is empty in status(), in the status file and in ``nicswitch-agent status``; the refusal and
    when it happened stay in ``last_error_seen``."""
    status_file = tmp_path / "status.json"
    port = free_port()
    replied = threading.Event()
    agent = SwitchAgent(server=f"127.0.0.1:{port}", job_id=JOB, pause=pause, switch_hook=lambda order: True,
                        status_file=str(status_file), status_interval_s=0.2, reconnect_max_s=0.5,
                        on_event=lambda e: e.kind == ev.REPLY_SENT and replied.set())
    agents.append(agent.start())
    assert wait_until(lambda: REFUSED in agent.status()["last_error"], 10), agent.status()
    refused_at = agent.status()["last_error_seen"]["at"]
    settings = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01,
                           force_release_s=0.01, schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=settings, port=port,
                   standin=pause == "external") as sim:
        assert wait_until(lambda: agent.status()["connected"], 20), agent.status()
        status = agent.status()
        assert status["last_error"] == "", status
        seen = status["last_error_seen"]
        # Pause mode external: the notify stream may also have met ClusterD before its stand-in
        # registered the job (CI, twice): that refusal, later, is then the history.
        before_connected = (REFUSED, NOT_REGISTERED) if pause == "external" else (REFUSED,)
        assert any(e in seen["error"] for e in before_connected) and seen["at"] >= refused_at and seen["stream"], seen
        if pause == "agent":
            assert status["process_manage"]["last_error"] == "", status["process_manage"]

        with Trainer(agent):  # pause mode agent parks the training thread at a step boundary
            channel = open_channel(ChannelSettings(target=sim.address))
            try:
                request = pb.SwitchNics(jobID=JOB)
                request.nicOps["node-0"].dev.extend(["0"])
                request.nicOps["node-0"].op.extend([True])
                assert RecoverStub(channel).SwitchNicTrack(request, timeout=10, wait_for_ready=True).code == 0
            finally:
                channel.close()
            assert replied.wait(20), agent.status()
        assert wait_until(lambda: agent.status()["connected"] and agent.status()["stream"]["opens"] >= 2, 10)
        assert agent.status()["last_error"] == "", agent.status()
        assert agent.status()["counters"]["switches_ok"] == 1, agent.status()

        assert wait_until(lambda: status_command(status_file)[0] == ExitCode.OK, 10), status_command(status_file)
        import json

        written = json.loads(status_file.read_text())["status"]
        assert written["last_error"] == "" and written["last_error_seen"]["error"] == seen["error"], written
        _code, text = status_command(status_file)
        assert "last error  " not in text, text
        assert "error seen  " in text and seen["error"] in text and "over" in text, text


def test_a_conflict_stays_the_error_now_while_the_agent_keeps_trying(agents: list[SwitchAgent]) -> None:
    """Subscribing again after its back-off opens the stream on a READY channel, which would
    otherwise count as "the stream works": while the other client still fights, it does not."""
    with conflict_sim() as sim:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True,
                            conflict_backoff_s=0.3, conflict_backoff_max_s=0.6)
        agents.append(agent.start())
        assert wait_until(lambda: agent.status().get("conflict") is not None, 20), agent.status()
        opens = agent.status()["process_manage"]["opens"]
        # Two more subscriptions after back-offs, each ended by the stand-in's: still fighting.
        assert wait_until(lambda: agent.status()["process_manage"]["opens"] >= opens + 2, 20), agent.status()
        status = agent.status()
        assert status["conflict"] is not None and CAUSE in status["last_error"], status
        assert CAUSE in status["process_manage"]["last_error"], status


@pytest.mark.timeout(60)
def test_a_member_that_lost_its_store_says_so_in_status_and_the_status_check(tmp_path: Path) -> None:
    """A member whose coordination is lost can never switch again: status() and the status file's
    check say so (before, state stayed "running" with nothing wrong to see)."""
    import datetime

    torch_dist = pytest.importorskip("torch.distributed")
    from nicswitch_agent.observability.metrics import PrometheusMetrics
    from nicswitch_agent.observability.status_file import read_status

    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)

    server, port = store_server_process()
    status_file = tmp_path / "status-1.json"  # without {rank} in the path only the leader writes one
    agent = None
    try:
        agent = SwitchAgent(server="127.0.0.1:1", job_id=JOB, handle_signals=False, dry_run=True, rank=1,
                            world_size=2, leader="launcher", store_address=f"127.0.0.1:{port}",
                            status_file=str(tmp_path / "status-{rank}.json"), status_interval_s=0.2,
                            on_event=metrics)
        agent.start()
        assert agent.status()["coordination_lost"] is None
        assert registry.get_sample_value("nicswitch_coordination_up", {"job": JOB}) == 1
        from nicswitch_agent.coordination import KV
        from nicswitch_agent.coordination import messages as p
        watcher = KV(torch_dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10)),
                     p.key_prefix(JOB, "launcher"))
        assert wait_until(lambda: watcher.check([p.joined_key(1)]), 20)  # the member reads its queue from now on
        server.kill()
        server.wait(10)
        assert wait_until(lambda: agent is not None and agent.status()["coordination_lost"], 20)
        assert agent.status()["coordination_lost"].startswith("DistNetworkError: ")
        assert wait_until(lambda: read_status(status_file).exit_code is ExitCode.STUCK, 20), read_status(status_file)
        assert read_status(status_file).problem.startswith("coordination lost (")
        lost = [e for e in agent.events() if e.kind == ev.COORDINATION_LOST]
        assert len(lost) == 1 and lost[0].detail["rank"] == 1 and lost[0].detail["why"].startswith("DistNetworkError")
        assert registry.get_sample_value("nicswitch_coordination_up", {"job": JOB}) == 0
    finally:
        server.kill()
        if agent is not None:
            agent.stop()


def test_a_rank_whose_local_rank_0_stopped_its_agent_says_so_as_a_stop_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Local rank 0's agent stopping (its process ends: a whole job's Ctrl-C, training over) closes
    the node link it hosts and says why. The node's other ranks can no longer switch: their status
    says so at once, and their log says it at INFO (the job is stopping), not as an ERROR."""
    pytest.importorskip("torch.distributed")
    server, port = store_server_process()
    made: list[SwitchAgent] = []
    try:
        with caplog.at_level(logging.INFO, logger="nicswitch_agent"):
            for rank in (0, 1):  # one node of two ranks; the leader lives elsewhere (a launcher's)
                made.append(SwitchAgent(server="127.0.0.1:1", job_id=JOB, handle_signals=False, dry_run=True,
                                        rank=rank, world_size=4, local_world_size=2, leader="launcher",
                                        store_address=f"127.0.0.1:{port}"))
                made[-1].start()
            assert "local rank 1; over the node link" in caplog.text
            made[0].stop("signal SIGINT")
            assert wait_until(lambda: made[1].status()["coordination_lost"], 20)
        assert made[1].status()["coordination_lost"] == (
            "LinkClosed: the node's relay (local rank 0) stopped: local rank 0's agent stopped (signal SIGINT)")
        lost = [r for r in caplog.records if "coordination store lost" in r.getMessage()]
        assert [r.levelno for r in lost] == [logging.INFO], [(r.levelname, r.getMessage()) for r in lost]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        server.kill()
        for agent in made:
            agent.stop()
