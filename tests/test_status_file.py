"""The status file: written by a real agent across a real switch, read by ``nicswitch-agent status``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import Trainer

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.observability.metrics import EventStats
from nicswitch_agent.observability.status_file import (
    ExitCode,
    StatusFileWriter,
    expand_path,
    format_summary,
    read_status,
)
from nicswitch_agent.ops.status_cli import add_arguments, run
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(30)

JOB = "job-status"
NODES = {"node-0": ["0", "1"]}
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=FAST)
    simulator.start()
    try:
        yield simulator
    finally:
        simulator.stop()


def status_args(path: Path | None, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(([] if path is None else ["--file", str(path)]) + list(argv))


def counters(doc: dict[str, Any]) -> dict[str, int]:
    return dict(doc["status"]["counters"])


# -- a real agent across a real switch -------------------------------------------------------------


def test_real_agent_keeps_the_file_across_a_switch_and_status_reads_it(
    sim: Simulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "status.json"
    events: list[AgentEvent] = []
    agent: SwitchAgent | None = None
    stats = EventStats()  # what the agent adds to status() as "timings"

    def agent_status() -> dict[str, Any]:
        return {**agent.status(), "timings": stats.snapshot()} if agent else {"state": "created"}

    # A long interval: every write in this test is caused by an event, none by the timer.
    writer = StatusFileWriter(path, agent_status, interval_s=60.0)
    switched: list[SwitchOrder] = []

    def hook(order: SwitchOrder) -> bool:
        switched.append(order)
        return True

    def listen(event: AgentEvent) -> None:
        events.append(event)
        stats(event)
        writer(event)

    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=hook, on_event=listen,
                        verify_hook=lambda order: True, reconnect_initial_s=0.02, reconnect_max_s=0.1)
    writer.start()
    try:
        agent.start()
        with Trainer(agent) as trainer:
            assert sim.wait_until(lambda s: support.streams_ready(s, JOB), 10)
            assert writer.wait_written(lambda d: d["status"]["state"] == "running", 10)
            assert support.operator_switch(sim.address, JOB, ["0"], [True]) == "switch nic finish"
            assert writer.wait_written(lambda d: counters(d)["replies_delivered"] == 1
                                       and "pause_s" in d["status"]["timings"], 10), writer.last_document
            assert len(switched) == 1 and switched[0].ranks == (0,)

            on_disk = json.loads(path.read_text())
            assert on_disk["format"] == "nicswitch-agent-status/1"
            status = on_disk["status"]
            assert status["job_id"] == JOB and status["role"] == "leader" and status["pause"] == "agent"
            assert counters(on_disk) == {"lists_received": 1, "lists_rejected": 0, "lists_ignored": 0,
                                         "switches_ok": 1, "switches_failed": 0, "replies_delivered": 1,
                                         "replies_failed": 0}
            assert status["last_switch"]["seq"] == 1 and status["last_switch"]["result"] is True

            assert run(status_args(path)) == ExitCode.OK
            out = capsys.readouterr().out
            # This writer hears events only: the reply's may be the last, written while the state
            # was still "switching" (the agent's own writer is told when it ends: the test below).
            assert re.search(r"^state       (running|switching) \(leader, rank 0 of 1, pause agent\)$", out, re.M), out
            assert "last switch #1: replied true" in out
            assert re.search(r"^last verify #1: passed on this rank in \d+ ms, [\d.]+ m?s before the write$", out,
                             re.M), out
            assert "switches 1 ok, 0 failed; replies 1 delivered, 0 failed" in out
            assert "timings     switch " in out and "; list to reply " in out and "; parked " in out
            assert "verdict     OK" in out

            assert run(status_args(path, "--json")) == 0
            doc = json.loads(capsys.readouterr().out)
            assert doc["result"] == "ok" and doc["status"]["counters"]["switches_ok"] == 1
            assert doc["age_s"] >= 0 and doc["max_age_s"] == 180.0
            steps = trainer.step
    finally:
        agent.stop()
        writer.stop()

    # Events drive the writes, never steps: at most one write per event, plus start and stop.
    assert steps > 0 and writer.writes <= len(events) + 2
    assert json.loads(path.read_text())["status"]["state"] == "stopped"
    assert run(status_args(path)) == ExitCode.NOT_RUNNING
    assert "NOT OK: the agent is stopped" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary files left behind


def test_the_agents_own_file_follows_switching_and_back_without_an_event(tmp_path: Path) -> None:
    """CI's case: the reply's event was the last of a switch (ClusterD's continue, and the resume,
    came before our reply call returned), and the state went back from "switching" to "running"
    after it, with no event: the file said "switching" until the next timed write (10 s by default).
    The executor's busy flag is driven here as it drives it around an order; the timer is 60 s, and
    pause mode external keeps the idle agent from writing for any other reason."""
    sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=FAST, standin=True)
    sim.start()
    path = tmp_path / "status.json"
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=lambda order: True,
                        status_file=str(path), status_interval_s=60.0, reconnect_initial_s=0.02, reconnect_max_s=0.1)

    def status() -> dict[str, Any]:
        return dict(json.loads(path.read_text())["status"])

    try:
        agent.start()
        assert support.wait_until(lambda: status()["state"] == "running" and status()["stream_open"], 10), status()
        agent._on_busy(True)  # an order starts
        assert support.wait_until(lambda: status()["state"] == "switching", 10), status()
        agent._on_busy(False)  # it is over, its reply sent
        assert support.wait_until(lambda: status()["state"] == "running", 10), status()
    finally:
        agent.stop()
        sim.stop()


# -- the reader --------------------------------------------------------------------------------------


def write_fixed(path: Path, state: str, *, written_at: float = 1000.0, interval_s: float = 10.0) -> None:
    writer = StatusFileWriter(path, lambda: {"state": state, "role": "leader", "last_error": "boom"},
                              interval_s=interval_s, clock=lambda: written_at)
    assert writer.write_now()


@pytest.mark.parametrize(
    ("state", "age", "code", "problem"),
    [
        ("running", 29.0, ExitCode.OK, ""),
        ("switching", 0.0, ExitCode.OK, ""),
        ("running", 31.0, ExitCode.STALE, "stale: written 31.0 s ago, more than 30.0 s"),
        ("stopped", 1.0, ExitCode.NOT_RUNNING, "the agent is stopped"),
        ("failed", 1.0, ExitCode.NOT_RUNNING, "the agent is failed (boom)"),
        ("created", 1.0, ExitCode.NOT_RUNNING, "the agent is created"),
        ("stopped", 3600.0, ExitCode.NOT_RUNNING, "the agent is stopped"),  # its last write is old: not stale
        ("failed", 3600.0, ExitCode.NOT_RUNNING, "the agent is failed (boom)"),
    ],
)
def test_verdict_from_state_and_age(tmp_path: Path, state: str, age: float, code: ExitCode, problem: str) -> None:
    path = tmp_path / "s.json"
    write_fixed(path, state)
    report = read_status(path, now=1000.0 + age)
    assert report.exit_code is code
    assert report.problem.startswith(problem)
    assert report.age_s == pytest.approx(age)


def test_a_writer_whose_process_is_gone_is_stale_at_once_on_its_host(tmp_path: Path) -> None:
    """Found by an outside check: a SIGKILLed leader read "not connected to ClusterD" (exit 5) for
    half a minute, until its file went stale. On its own host (and PID namespace) the reader sees
    that the pid is gone; elsewhere (another host, a sidecar container) it waits for the age."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    gone_pid = int(child.stdout)  # ended: a pid nobody holds now (reused only after the pid space wraps)
    path = tmp_path / "s.json"
    write_fixed(path, "running")
    document = json.loads(path.read_text())
    assert document["pid"] == os.getpid()
    assert read_status(path, now=1001.0).exit_code is ExitCode.OK  # this process: alive
    document["pid"] = gone_pid
    path.write_text(json.dumps(document))
    report = read_status(path, now=1001.0)
    assert report.exit_code is ExitCode.STALE, report.problem
    assert report.problem == (f"its process (pid {gone_pid} on {document['host']}) is gone: it ended without "
                              "stopping its agent (killed?), last state: running")
    for field, other in (("host", document["host"] + "-elsewhere"), ("pid_ns", -1)):
        path.write_text(json.dumps({**document, field: other}))
        assert read_status(path, now=1001.0).exit_code is ExitCode.OK, field  # cannot know: the age decides


def test_a_failed_leader_and_a_stuck_hook_are_shown_with_their_reason(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    status = {"state": "failed", "role": "leader", "last_error": "boom",
              "reason": "Init refused (403): label the PodGroup process-recover-enable=on",
              "stuck_hook": "switch hook of order #3"}
    assert StatusFileWriter(path, lambda: status, interval_s=10.0, clock=lambda: 1000.0).write_now()
    report = read_status(path, now=1001.0)
    assert report.exit_code is ExitCode.NOT_RUNNING
    assert report.problem == "the agent is failed (Init refused (403): label the PodGroup process-recover-enable=on)"
    summary = format_summary(report)
    assert "reason      Init refused (403): label the PodGroup process-recover-enable=on" in summary
    assert "stuck hook  switch hook of order #3 is still running past its timeout" in summary


def test_a_failed_verification_has_its_line_and_none_yet_before_any(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    status: dict[str, Any] = {"state": "running", "role": "member", "last_verify": None}
    writer = StatusFileWriter(path, lambda: status, interval_s=10.0, clock=lambda: 1000.0)
    assert writer.write_now()
    assert "\nlast verify none yet\n" in format_summary(read_status(path, now=1001.0))
    status["last_verify"] = {  # as coordination/member.py records it, with TorchLinkProbe's report
        "order": "7.3.verify", "ok": False, "reason": "group dp: all_reduce timed out after 5 s",
        "duration_s": 5.012, "at": 990.0,
        "report": {"seq": 3, "ok": False, "groups": [{"group": "dp", "ok": False}, {"group": "tp", "ok": True}]}}
    assert writer.write_now()
    assert ("\nlast verify #3: FAILED on this rank (group dp: all_reduce timed out after 5 s) in 5.0 s, "
            "1 of 2 group(s) ok, 10.0 s before the write\n") in format_summary(read_status(path, now=1001.0))


def test_max_age_can_be_given(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_fixed(path, "running")
    assert read_status(path, now=1005.0, max_age_s=4.0).exit_code is ExitCode.STALE
    assert read_status(path, now=1005.0, max_age_s=6.0).exit_code is ExitCode.OK


def test_unreadable_files_and_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.json"
    assert run(status_args(missing), env={}) == ExitCode.NO_FILE
    assert "no status file at" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert read_status(garbage).exit_code is ExitCode.NO_FILE
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"state": "running"}))
    assert "not a nicswitch-agent status file" in read_status(other).problem
    assert run(status_args(None), env={}) == ExitCode.USAGE
    assert "NICSWITCH_STATUS_FILE is not set" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_unreadable_not_a_crash(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"format": "\xff\xfe"}')
    assert run(status_args(binary), env={}) == ExitCode.NO_FILE
    assert "is not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-3", "0", "nan", "soon"])
def test_max_age_must_be_above_zero_and_is_refused_at_parse_time(value: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        status_args(None, "--max-age", value)
    assert exit_info.value.code == ExitCode.USAGE
    assert f"argument --max-age: {value!r}" in capsys.readouterr().err


def test_path_from_env_with_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_fixed(tmp_path / "job-status-3.json", "running", written_at=9e12)  # far future: fresh
    env = {"NICSWITCH_STATUS_FILE": str(tmp_path / "{job}-{rank}.json"), "MINDX_TASK_ID": JOB, "RANK": "3"}
    assert run(status_args(None), env=env) == ExitCode.OK
    assert run(status_args(None, "--rank", "4"), env=env) == ExitCode.NO_FILE
    capsys.readouterr()
    # A path without {rank} is the whole job's one file: --rank picks nothing, and says so
    one = {**env, "NICSWITCH_STATUS_FILE": str(tmp_path / "job-status-3.json")}
    assert run(status_args(None, "--rank", "5"), env=one) == ExitCode.OK
    assert capsys.readouterr().err == (f"nicswitch-agent status: --rank 5 ignored: NICSWITCH_STATUS_FILE="
                                       f"{str(tmp_path / 'job-status-3.json')!r} has no {{rank}}\n")
    assert run(status_args(None), env=one) == ExitCode.OK and capsys.readouterr().err == ""  # RANK alone: quiet


@pytest.mark.parametrize(("env", "argv", "needle"), [
    ({"NICSWITCH_STATUS_FILE": "/r/{x}.json"}, (), "NICSWITCH_STATUS_FILE='/r/{x}.json' is not a usable path"),
    ({}, ("--file", "/r/{x}.json"), "--file='/r/{x}.json' is not a usable path"),
    ({"NICSWITCH_STATUS_FILE": "/run/s-{rank}.json", "RANK": "three"}, (), "RANK='three' is not a rank"),
])
def test_usage_errors_name_the_variable_or_flag(env: dict[str, str], argv: tuple[str, ...], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run(status_args(None, *argv), env=env) == ExitCode.USAGE
    assert needle in capsys.readouterr().err


def test_summary_of_an_unreadable_file_says_why(tmp_path: Path) -> None:
    report = read_status(tmp_path / "x.json")
    assert format_summary(report).startswith("status: no status file at")


# -- the writer -------------------------------------------------------------------------------------


def test_expand_path_writes_one_file_per_job_from_the_leader_only() -> None:
    assert expand_path("/run/s.json", rank=3, job_id="j", role="member") is None
    assert expand_path("/run/s.json", rank=0, job_id="j", role="leader") == "/run/s.json"
    assert expand_path("/run/{job}-{rank}.json", rank=3, job_id="j", role="member") == "/run/j-3.json"
    with pytest.raises(ValueError, match=re.escape("only {rank}, {pid} and {job}")):
        expand_path("/run/{host}.json", rank=0, job_id="j")


def test_writer_survives_failures_and_logs_each_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nicswitch_agent.status")
    blocker = tmp_path / "a-file"  # where the file's directory should be: it cannot be made
    blocker.write_text("")
    writer = StatusFileWriter(blocker / "s.json", lambda: {"state": "running"}, interval_s=60.0)
    assert not writer.write_now()
    assert not writer.write_now()
    assert caplog.text.count("cannot write") == 1
    blocker.unlink()
    assert writer.write_now() and writer.writes == 1  # the directory is made now

    def broken() -> dict[str, Any]:
        raise RuntimeError("status exploded")

    assert not StatusFileWriter(tmp_path / "b.json", broken).write_now()
    assert "status exploded" in caplog.text


def test_a_missing_directory_is_made_at_the_first_write(tmp_path: Path) -> None:
    """A stranger's agent ran with NICSWITCH_STATUS_FILE in a directory that did not exist yet:
    nothing was ever written, and `status` said the agent was not running."""
    path = tmp_path / "run" / "nicswitch" / "status-0.json"
    assert StatusFileWriter(path, lambda: {"state": "running"}, interval_s=60.0).write_now()
    assert "running" in path.read_text()


def test_writer_thread_wakes_on_events_and_stops_once(tmp_path: Path) -> None:
    state = {"state": "running", "n": 0}
    writer = StatusFileWriter(tmp_path / "s.json", lambda: dict(state), interval_s=60.0)
    writer.start()
    with pytest.raises(RuntimeError, match="starts once"):
        writer.start()
    state["n"] = 1
    writer(AgentEvent(kind="stream_lost", job_id=JOB))
    assert writer.wait_written(lambda d: d["status"]["n"] == 1, 5)
    state["state"] = "stopped"
    writer.stop()
    writer.stop()
    assert json.loads((tmp_path / "s.json").read_text())["status"]["state"] == "stopped"
    with pytest.raises(RuntimeError, match="starts once"):
        writer.start()


def test_interval_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        StatusFileWriter(tmp_path / "s.json", dict, interval_s=0)


# -- the agent and the command line ---------------------------------------------------------------------

def test_agent_keeps_its_status_file_when_configured(sim: Simulator, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    template = str(tmp_path / "{job}.json")
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True,
                        status_file=template, status_interval_s=60.0, reconnect_initial_s=0.02,
                        reconnect_max_s=0.1)
    path = tmp_path / f"{JOB}.json"
    agent.start()
    try:
        assert read_status(path).exit_code is ExitCode.OK  # written before start() returns
        with Trainer(agent):
            assert sim.wait_until(lambda s: support.streams_ready(s, JOB), 10)
            assert support.operator_switch(sim.address, JOB, ["0"], [True]) == "switch nic finish"
    finally:
        agent.stop()
    doc = json.loads(path.read_text())
    assert doc["status"]["state"] == "stopped"  # stop() writes the final state
    assert counters(doc)["switches_ok"] == 1
    assert doc["status"]["timings"]["switch_s"]["count"] == 1
    assert run(status_args(path)) == ExitCode.NOT_RUNNING
    assert "switches 1 ok" in capsys.readouterr().out


def test_a_member_writes_only_a_per_rank_file(tmp_path: Path) -> None:
    from nicswitch_agent.coordination import InProcessStore

    store = InProcessStore()
    member = SwitchAgent(server="127.0.0.1:1", job_id=JOB, pause="agent", switch_hook=lambda order: True,
                         store=store, rank=1, world_size=2, status_file=str(tmp_path / "job.json"))
    member.start()
    member.stop()
    assert list(tmp_path.iterdir()) == []  # one file per job: the leader's


def test_a_launchers_leader_and_training_rank_0_write_files_of_their_own(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``{rank}`` is ``leader`` in a leader-only agent's file: the launcher's leader is rank 0 to the
    coordination, and training rank 0 writes its own file next to it (before, the two overwrote
    each other). ``status --rank leader`` reads the leader's."""
    from nicswitch_agent.coordination import InProcessStore

    store, template = InProcessStore(), str(tmp_path / "status-{rank}.json")
    leader = SwitchAgent(server="127.0.0.1:1", job_id=JOB, pause="external", store=store, world_size=1,
                         leader_only=True, status_file=template)
    rank0 = SwitchAgent(server="127.0.0.1:1", job_id=JOB, pause="external", switch_hook=lambda order: True,
                        store=store, rank=0, world_size=1, leader="launcher", status_file=template)
    leader.start()
    rank0.start()
    leader.stop()
    rank0.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status-0.json", "status-leader.json"]
    assert json.loads((tmp_path / "status-leader.json").read_text())["status"]["role"] == "leader"
    assert json.loads((tmp_path / "status-0.json").read_text())["status"]["role"] == "member"
    assert run(status_args(None, "--rank", "leader", "--json"), env={"NICSWITCH_STATUS_FILE": template}) == (
        ExitCode.NOT_RUNNING)
    status = json.loads(capsys.readouterr().out)["status"]
    assert (status["role"], status["rank"]) == ("leader", "leader")  # no training rank: rank 0 is the other file
    assert run(status_args(None, "--rank", "leader"), env={"NICSWITCH_STATUS_FILE": template}) == ExitCode.NOT_RUNNING
    assert "state       stopped (leader of 1 rank(s), hosted by nicswitch-agent launch, pause external)" in (
        capsys.readouterr().out)


@pytest.mark.parametrize("value", ["-1", "lead", "1.5"])
def test_rank_is_a_number_or_leader_and_is_refused_at_parse_time(value: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        status_args(None, "--rank", value)
    assert exit_info.value.code == ExitCode.USAGE
    assert f"argument --rank: {value!r} is not a rank (a non-negative integer) or 'leader'" in capsys.readouterr().err


def test_status_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nicswitch_agent.ops import cli

    write_fixed(tmp_path / "s.json", "running", written_at=9e12)
    assert cli.main(["status", "--file", str(tmp_path / "s.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"]["state"] == "running"


def test_training_parked_far_past_any_switch_budget_is_stuck(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    status: dict[str, Any] = {"state": "running", "role": "member", "parked": True, "parked_step": 41}
    clock = [1000.0]
    writer = StatusFileWriter(path, lambda: status, interval_s=10.0, clock=lambda: clock[0])
    assert writer.write_now()  # parked seen at 1000
    clock[0] = 2801.0  # rewritten every interval: the file is fresh, training still parked
    assert writer.write_now()
    report = read_status(path, now=2802.0)
    assert report.exit_code is ExitCode.STUCK
    assert report.problem.startswith("training parked at step 41 for 30 min 2 s, more than 30 min"), report.problem
    assert "training    PARKED at step 41 for 30 min 1 s\n" in format_summary(report)
    assert read_status(path, now=2802.0, max_parked_s=3600.0).exit_code is ExitCode.OK
    status["parked"] = False  # resumed: the next park is timed from its own start
    assert writer.write_now()
    status["parked"] = True
    clock[0] = 2802.0
    assert writer.write_now()
    assert read_status(path, now=2803.0).exit_code is ExitCode.OK


@pytest.mark.parametrize(("last", "line"), [
    ({"seq": 2, "result": True, "reason": "switched on every rank", "reply": "delivered", "reply_attempts": 1},
     "last switch #2: replied true (switched on every rank), reply delivered after 1 attempt(s)"),
    ({"seq": 3, "result": True, "reason": "switched on every rank", "reply": "dropped", "reply_attempts": 0,
      "error": "ClusterD reset the job since the list arrived; a reply now would answer its next switch"},
     "last switch #3: ok (switched on every rank), reply true NOT delivered (dropped: ClusterD reset the job since "
     "the list arrived; a reply now would answer its next switch)"),
    ({"seq": 4, "result": False, "reason": "rank 1: switch hook returned False", "reply": "uncertain",
      "reply_attempts": 2, "error": "DEADLINE_EXCEEDED"},
     "last switch #4: failed (rank 1: switch hook returned False), reply false NOT delivered (uncertain after 2 "
     "attempt(s): DEADLINE_EXCEEDED)"),
])
def test_last_switch_says_whether_its_reply_reached_clusterd(tmp_path: Path, last: dict[str, Any], line: str) -> None:
    path = tmp_path / "s.json"
    assert StatusFileWriter(path, lambda: {"state": "running", "last_switch": last}, clock=lambda: 1000.0).write_now()
    assert f"\n{line}\n" in format_summary(read_status(path, now=1001.0))
