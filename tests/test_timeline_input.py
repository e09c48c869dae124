"""The timeline on bad input: the page renders what is known and says what is missing; no events
at all is a clear error with exit code 2; never a traceback.

The input is the real events files of one thread demo (4 ranks, two switches), damaged the way
files get damaged: a line cut short, a stray line, another job's files in the same directory, a
rank's file missing, a job that died mid-switch, a host whose clock is hours off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from scripted import Block, End, ScriptedClusterD, Send, rank_list

from nicswitch_agent import SwitchAgent
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.timeline import build, read_events, render_html
from nicswitch_agent.observability.timeline.model import Timeline
from nicswitch_agent.observability.timeline.render import COLOURS, CRITICAL, FAILED, PHASE_TEXT, span_text
from nicswitch_agent.ops import cli

WORLD = 4


@pytest.fixture(scope="module")
def demo_events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "MINDX_", "PYTEST_"))}
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo", "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "events"


@pytest.fixture
def events(demo_events: Path, tmp_path: Path) -> Path:
    """A copy of the demo's events files, to damage."""
    return Path(shutil.copytree(demo_events, tmp_path / "events"))


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def save(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def timeline_of(*paths: Path, **kwargs: Any) -> Timeline:
    return build(read_events([str(p) for p in paths], **{k: v for k, v in kwargs.items() if k == "job_id"}))


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["timeline", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_undamaged_files_have_no_problems(events: Path) -> None:
    timeline = timeline_of(events)
    assert timeline.problems == [] and [s.ok for s in timeline.switches] == [True, True]
    assert all(s.missing == [] for s in timeline.switches)


def test_cut_and_stray_lines_are_skipped_and_named(events: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = events / "rank-1.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    lines.insert(3, "Traceback (most recent call last):")  # something else wrote to the file
    lines.insert(4, "[1, 2, 3]")  # JSON, but no event
    lines[-1] = lines[-1][: len(lines[-1]) // 2]  # the last line cut short (the disk filled up)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    timeline = timeline_of(events)
    assert [s.ok for s in timeline.switches] == [True, True]  # the rest is used
    assert any("rank-1.jsonl: 2 line(s) not JSON" in p and "line 4," in p and "cut short" in p
               for p in timeline.problems), timeline.problems
    assert any("rank-1.jsonl: 1 line(s) without a kind and a time" in p for p in timeline.problems)
    code, out, err = run_cli([str(events), "-o", str(tmp_path / "t.html")], capsys)
    assert code == 0 and err == ""
    assert "not JSON" in out and "not JSON" in (tmp_path / "t.html").read_text(encoding="utf-8")


def test_events_stamped_out_of_order_still_pair_up(events: Path) -> None:
    """A process's threads write to its file in turn: ``parked`` (training thread) may carry an
    earlier time than ``pause_requested`` (member thread) after a clock step; the pause still pairs."""
    path = events / "rank-1.jsonl"
    records = load(path)
    asked = next(r for r in records if r["kind"] == "pause_requested")
    parked = next(r for r in records if r["kind"] == "parked")
    asked["mono"], parked["mono"] = parked["mono"], asked["mono"]
    save(path, records)
    lane = timeline_of(events).switches[0].lanes[1]
    assert {"pause", "parked"} <= {b.phase for b in lane.bars}


def test_alignment_uses_when_the_work_started_not_when_it_was_reported(events: Path) -> None:
    """Rank 1 got the pauses and outcomes late (5 ms) and the orders at once: its offset must come
    from when each order's work began (``wall - duration_s``), or its guard would start before the
    leader sent the order."""
    path = events / "rank-1.jsonl"
    records = load(path)
    for r in records:
        if r["kind"] in ("pause_requested", "switch_outcome"):
            r["wall"] += 0.005
    save(path, records)
    timeline = timeline_of(events)
    for switch in timeline.switches:
        order_sent = next(m.at for m in switch.leader if m.label.startswith("order sent"))
        guard = next(b for b in switch.lanes[1].bars if b.phase == "guard")
        assert guard.start >= order_sent - 1e-6, (guard, order_sent)


def test_two_jobs_mixed_shows_one_and_says_which_were_left_out(events: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (0, 1):  # another job's files in the same directory, fewer events
        records = load(events / f"rank-{rank}.jsonl")
        save(events / f"other-{rank}.jsonl", [{**r, "job_id": "other-job"} for r in records])
    timeline = timeline_of(events)
    assert timeline.job_id == "demo-job" and timeline.ranks_seen == WORLD
    assert any("'other-job'" in p and "--job" in p for p in timeline.problems), timeline.problems
    code, out, _ = run_cli([str(events), "--job", "other-job", "-o", str(tmp_path / "o.html")], capsys)
    assert code == 0 and "job other-job: 2 switch(es), 2 of 4 rank(s)" in out
    code, _, err = run_cli([str(events), "--job", "nope", "-o", str(tmp_path / "n.html")], capsys)
    assert code == 2 and "no events of job 'nope'" in err and "demo-job" in err


def test_a_missing_ranks_file_is_named_and_the_others_drawn(events: Path) -> None:
    (events / "rank-3.jsonl").unlink()
    timeline = timeline_of(events)
    assert (timeline.ranks_seen, timeline.ranks_expected, timeline.missing_ranks) == (3, 4, [3])
    assert any("no events at all from rank 3 of 4" in p for p in timeline.problems)
    for switch in timeline.switches:
        assert [lane.label for lane in switch.lanes] == ["rank 0", "rank 1", "rank 2"]
        assert switch.ok is True  # the leader said so: rank 3 switched, its file is what is missing
        assert switch.missing == [f"switch {switch.seq}: no result from rank 3"]
    assert "no result from rank 3" in render_html(timeline)


def test_a_switch_that_never_finished_is_drawn_up_to_where_the_events_end(events: Path) -> None:
    """The job died during switch 2, after every rank ran it: nothing after its result remains."""
    for rank in range(WORLD):
        path = events / f"rank-{rank}.jsonl"
        records = load(path)
        cut = next(i for i, r in enumerate(records) if r["kind"] == "member_result" and r["seq"] == 2)
        save(path, records[:cut + 1])
    timeline = timeline_of(events)
    first, second = timeline.switches
    assert first.ok is True and first.missing == []
    assert second.ok is None and second.reason == "the leader's switch_done is not in these events"
    assert second.missing[0].startswith("switch 2 never finished in these events: no switch_done")
    assert "switch 2: no reply to ClusterD in these events" in second.missing
    assert "switch 2: ranks 0-3 never resumed in these events" in second.missing
    for lane in second.lanes:  # parked until the end of what is known; no resume tick
        parked = next(b for b in lane.bars if b.phase == "parked")
        assert parked.end == pytest.approx(second.duration) and parked.note == "never resumed in these events"
        assert lane.marks == []
    assert "outcome unknown" in render_html(timeline)


def test_a_failed_rank_is_drawn_as_failed_and_decides_the_critical_path(events: Path) -> None:
    path = events / "rank-2.jsonl"
    records = load(path)
    for r in records:
        if r["kind"] == "member_result" and r["seq"] == 1:
            r["detail"].update(ok=False, reason="switch hook returned False")
    save(path, records)
    timeline = timeline_of(events)
    lane = timeline.switches[0].lanes[2]
    assert lane.failed == 1 and "failed first" in lane.critical
    switch_bar = next(b for b in lane.bars if b.phase == "switch")
    assert not switch_bar.ok and switch_bar.note == "switch hook returned False"
    assert any(c.startswith("rank 2 failed first") for c in timeline.switches[0].critical)
    page = render_html(timeline)
    assert re.search(rf'<rect [^>]*fill="{FAILED}"', page), "no bar drawn in the failure colour"
    assert re.search(rf'<text [^>]*fill="{FAILED}"[^>]*>rank 2<', page), "rank 2's label is not in the failure colour"


def test_an_older_agents_hours_off_clock_is_used_raw_and_said_so(events: Path) -> None:
    """Without sent_at nothing can align a rank: its raw clock is used, and the page warns."""
    path = events / "rank-1.jsonl"
    records = load(path)
    for r in records:
        r["wall"] += 5 * 3600
        r["detail"].pop("sent_at", None)
    save(path, records)
    timeline = timeline_of(events)
    assert timeline.alignment.unaligned == [1]
    assert any(p.startswith("rank 1: no leader timestamps") and "5.0 h away from the leader's" in p
               for p in timeline.problems), timeline.problems
    page = render_html(timeline)
    assert "Raw wall clock" in page and "5.0 h away" in page


@pytest.mark.parametrize("documented", [False, True], ids=["verify-unknown", "verify-in-EVENT_KINDS"])
def test_verify_and_phases_of_a_newer_agent_are_drawn_as_bars(events: Path, documented: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify_*`` events are the verify phase, documented kinds or not; a kind this version does
    not know, with a duration, is drawn as a phase of its own name (a newer agent's files render)."""
    if documented:
        monkeypatch.setitem(ev.EVENT_KINDS, "verify_done", ev.EventKind("verify_done", "every rank", "", ()))
    path = events / "rank-1.jsonl"
    records = load(path)
    at = next(i for i, r in enumerate(records) if r["kind"] == "member_result" and r["seq"] == 1
              and r["detail"]["kind"] == "switch")
    result = records[at]
    # A rank with a verify hook writes both: its verify order's result and its verify_done (one bar)
    extra = [{**result, "kind": "member_result", "wall": result["wall"] + 0.002,
              "detail": {**result["detail"], "kind": "verify", "ok": False, "duration_s": 0.0016,
                         "reason": "no traffic on the standby link"}},
             {**result, "kind": "verify_done", "wall": result["wall"] + 0.002,
              "detail": {"rank": 1, "ok": False, "duration_s": 0.0015, "reason": "no traffic on the standby link"}},
             {**result, "kind": "probe_links", "wall": result["wall"] + 0.003, "detail": {"duration_s": 0.001}},
             {**result, "kind": "something_new", "wall": result["wall"] + 0.004, "detail": {"note": "no duration"}}]
    save(path, records[:at + 1] + extra + records[at + 1:])
    timeline = timeline_of(events)
    lane = timeline.switches[0].lanes[1]
    switch_end = next(b.end for b in lane.bars if b.phase == "switch")
    assert [b.phase for b in lane.bars].count("verify") == 1
    verify = next(b for b in lane.bars if b.phase == "verify")
    assert not verify.ok and verify.note == "no traffic on the standby link" and lane.failed == 1
    assert verify.end == pytest.approx(switch_end + 0.002, abs=1e-6)
    assert verify.end - verify.start == pytest.approx(0.0015, abs=1e-6)
    assert [b.phase for b in lane.bars if b.phase not in ("pause", "parked", "guard", "switch", "verify")] == \
        ["probe_links"]
    assert [st.phase for st in timeline.switches[0].stats] == ["pause", "parked", "guard", "switch", "verify",
                                                              "probe_links"]
    assert all(b.phase != "verify" for lane in timeline.switches[1].lanes for b in lane.bars)


def test_node_lanes_show_each_nodes_slowest_rank_and_spread(events: Path) -> None:
    timeline = build(read_events([str(events)]), ranks_per_node=2, aggregate_above=2)
    for switch in timeline.switches:
        assert switch.by_node and [lane.label for lane in switch.lanes] == ["node 0 (ranks 0-1)",
                                                                             "node 1 (ranks 2-3)"]
        per_rank = build(read_events([str(events)]), only_switch=switch.seq).switches[0].lanes
        for node, lane in enumerate(switch.lanes):
            ranks = per_rank[2 * node:2 * node + 2]
            answers = [next(b.end for b in r.bars if b.phase == "switch") for r in ranks]
            assert lane.ranks == 2 and lane.spread == (min(answers), max(answers))
            assert lane.rank == ranks[answers.index(max(answers))].rank  # the slowest one is drawn


@pytest.mark.parametrize(("content", "message"), [
    ("", "no events in"),
    ("not json at all\n{\"kind\": \n", "no events in"),
])
def test_no_events_at_all_is_a_clear_error_with_exit_code_2(tmp_path: Path, content: str, message: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rank-0.jsonl"
    path.write_text(content, encoding="utf-8")
    code, out, err = run_cli([str(path), "-o", str(tmp_path / "t.html")], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"nicswitch-agent timeline: error: {message} {path}")
    assert not (tmp_path / "t.html").exists()


def test_no_file_at_all_exits_2_without_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "timeline", str(tmp_path / "none-{rank}.jsonl"),
                             str(tmp_path / "empty-dir")], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("nicswitch-agent timeline: error: no events file found:"), result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_switch_number_exits_2_and_leaves_the_page_alone(events: Path, capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    page = tmp_path / "t.html"
    page.write_text("the page of an earlier run")
    code, out, err = run_cli([str(events), "--switch", "7", "-o", str(page)], capsys)
    assert code == 2 and out == ""
    assert err == ("nicswitch-agent timeline: error: switch 7 is not in these events (switches found: 1, 2); "
                   "nothing written\n")
    assert page.read_text() == "the page of an earlier run"


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_switch_number_below_1_is_refused_at_parse_time(value: str, events: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["timeline", str(events), "--switch", value, "-o", str(tmp_path / "t.html")])
    assert stopped.value.code == 2
    assert f"argument --switch: {value!r}: the leader numbers its lists from 1" in capsys.readouterr().err


def test_a_rejected_list_takes_its_number_and_the_next_switch_keeps_its_own(clusterd: ScriptedClusterD,
                                                                           tmp_path: Path) -> None:
    """ClusterD's first list is invalid (answered false, never run), its second runs on both ranks
    (threads on one store, pause mode external): the ranks' events name the list they ran (``seq``
    rides on the order), so switch 2 gets the lanes and switch 1 only the leader's rejection."""
    clusterd.script(Send(rank_list(["1", "1"], [True, False])), Send(rank_list(["0", "1"], [True, True])), End())
    store, template = InProcessStore(), str(tmp_path / "events-{rank}.jsonl")
    agents = [SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", rank=rank, world_size=2,
                          store=store, switch_hook=lambda order: True, events_file=template) for rank in (1, 0)]
    try:
        for agent in agents:
            agent.start()
        assert [r.result for r in clusterd.wait_replies(2)] == [False, True]
    finally:
        for agent in agents:
            agent.stop()
    timeline = build(read_events([template]))
    first, second = timeline.switches
    assert (first.seq, first.ok, first.lanes) == (1, False, [])
    assert first.reason.startswith("list rejected: ") and "listed more than once" in first.reason
    assert (second.seq, second.ok) == (2, True)
    assert [lane.label for lane in second.lanes] == ["rank 0", "rank 1"]
    assert all({"guard", "switch"} <= {b.phase for b in lane.bars} for lane in second.lanes)


def test_a_launchers_leader_writes_its_own_events_file_and_is_no_restart_of_rank_0(clusterd: ScriptedClusterD,
                                                                                    tmp_path: Path) -> None:
    """The leader ``nicswitch-agent launch`` hosts is rank 0 to the coordination only: with ``{rank}``
    in the path it writes ``events-leader.jsonl`` with ``"rank": "leader"`` (as its status file).
    Before, its events went into training rank 0's file as rank 0, and the timeline took the two
    agents for a restart of rank 0's ("1 restart(s) of a rank's agent" in every run)."""
    clusterd.script(Send(rank_list(["0", "1"], [True, True])), End())
    store, template = InProcessStore(), str(tmp_path / "events-{rank}.jsonl")
    leader = SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", world_size=2, store=store,
                         leader_only=True, events_file=template)
    ranks = [SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", rank=rank, world_size=2,
                         store=store, leader="launcher", switch_hook=lambda order: True, events_file=template)
             for rank in (0, 1)]
    agents = [*ranks, leader]  # the ranks first, as under the launcher: a rank that joins after a list never sees it
    try:
        for agent in agents:
            agent.start()
        assert [r.result for r in clusterd.wait_replies(1)] == [True]
    finally:
        for agent in agents:
            agent.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events-0.jsonl", "events-1.jsonl", "events-leader.jsonl"]
    leader_lines = load(tmp_path / "events-leader.jsonl")
    assert {r["rank"] for r in leader_lines} == {"leader"}
    assert [r["detail"]["rank"] for r in leader_lines if r["kind"] == ev.AGENT_STARTED] == ["leader"]
    assert {r["rank"] for r in load(tmp_path / "events-0.jsonl")} == {0}
    assert not any(r["kind"] == ev.SWITCH_DONE for r in load(tmp_path / "events-0.jsonl"))
    timeline = build(read_events([template]))
    assert timeline.alignment.leader_found and timeline.problems == [], timeline.problems
    (run,) = timeline.runs
    assert run.leader_pids and sorted(p.source[0] for p in run.processes if p.source[0] is not None) == [0, 1]
    (switch,) = timeline.switches
    assert switch.ok is True and [lane.label for lane in switch.lanes] == ["rank 0", "rank 1"]
    assert any(m.label.startswith("reply sent: true") for m in switch.leader)


def test_a_closed_stdout_still_writes_the_page_without_a_traceback(events: Path, tmp_path: Path) -> None:
    """``nicswitch-agent timeline ... | head -1``: the reader is gone before the summary is printed."""
    page = tmp_path / "t.html"
    process = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", "timeline", str(events), "-o", str(page)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the child has even imported the package
    err = process.stderr.read().decode()
    assert process.wait(30) == 0, err
    assert "Traceback" not in err and page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_a_reused_demo_output_dir_holds_only_the_last_runs_events(demo_events: Path, tmp_path: Path) -> None:
    """Appending a second run to the first's files drew both runs' switches as one (1.9 s long)."""
    out = Path(shutil.copytree(demo_events.parent, tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "MINDX_", "PYTEST_"))}
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo", "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in sorted((out / "events").glob("rank-*.jsonl")):
        started = [e for e in load(path) if e["kind"] == "agent_started"]
        assert len(started) == 1, (path, len(started))


def test_the_svg_alone_carries_its_legend(events: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--format svg`` has no page around it: the picture itself says what each colour means."""
    out = tmp_path / "t.svg"
    code, _, _ = run_cli([str(events), "--format", "svg", "-o", str(out)], capsys)
    assert code == 0
    svg = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(out.read_text(encoding="utf-8"))
    legend = next((g for g in root.iter(f"{svg}g") if g.get("class") == "legend"), None)
    assert legend is not None, "no legend in the SVG"
    keys = {rect.get("fill"): "".join(text.itertext()) for entry in legend.iter(f"{svg}g")
            for rect in entry.iter(f"{svg}rect") for text in entry.iter(f"{svg}text")}
    for phase, colour in COLOURS.items():
        assert keys.get(colour) == PHASE_TEXT[phase], (phase, keys)
    assert keys.get(FAILED) == "failed" and keys.get(CRITICAL) == "everyone waited for this lane"
    rows = [float(m.group(1)) for g in legend.iter(f"{svg}g")
            if (m := re.fullmatch(r"translate\([\d.]+,([\d.]+)\)", g.get("transform", "")))]
    assert rows and max(rows) < float(root.get("height", "0")), "the legend is drawn outside the picture"


def test_the_reply_is_drawn_when_it_was_sent_not_when_the_call_returned(clusterd: ScriptedClusterD,
                                                                         tmp_path: Path) -> None:
    """ClusterD holds the reply call after taking the reply (as a busy ClusterD does): the leader's
    ``reply_sent`` event is stamped after ClusterD's "finish"; the mark must come before it."""
    release, replied = threading.Event(), threading.Event()
    clusterd.script(Send(rank_list(["0"], [True])), End())
    clusterd.reply_script.append(Block(release))
    template = str(tmp_path / "events-{rank}.jsonl")
    agent = SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", rank=0, world_size=1,
                        store=InProcessStore(), switch_hook=lambda order: True, events_file=template,
                        on_event=lambda e: replied.set() if e.kind == ev.REPLY_SENT else None)
    try:
        agent.start()
        clusterd.wait_replies(1)
        finished = time.time()  # ClusterD has the reply: its switch is finished
        release.set()
        assert replied.wait(10)
    finally:
        agent.stop()
    events = read_events([template])
    reply = next(r for r in events.records if r.kind == ev.REPLY_SENT)
    assert reply.wall > finished  # what the event's own time says: after ClusterD's finish
    assert reply.detail["sent_at"] <= finished < reply.wall  # when the call went out
    (switch,) = build(events).switches
    sent = next(m for m in switch.leader if m.label.startswith("reply sent: true"))
    assert switch.start_wall + sent.at <= finished, (sent, finished - switch.start_wall)
    assert "the call returned" in sent.label
    done = next(m for m in switch.leader if m.label.startswith("switch done"))
    assert done.at <= sent.at  # still after the switch it answers


# -- several runs in one set of files ------------------------------------------------------------


@pytest.fixture(scope="module")
def second_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The events files of a second, later run of the same demo (the same job id)."""
    out = tmp_path_factory.mktemp("again")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "MINDX_", "PYTEST_"))}
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo", "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "events"


def append_run(events: Path, later: Path, *, same_pid: bool = False) -> None:
    """``later``'s events appended to ``events``'s files, as ``events_file`` with ``{rank}`` does
    when a job is started again (``same_pid``: a restarted container reusing the pids)."""
    for path in sorted(events.glob("rank-*.jsonl")):
        first, second = load(path), load(later / path.name)
        if same_pid:
            second = [{**r, "pid": first[0]["pid"]} for r in second]
        save(path, first + second)


@pytest.mark.parametrize("same_pid", [False, True], ids=["new-pids", "reused-pids"])
def test_two_runs_appended_to_the_same_files_are_drawn_apart(events: Path, second_run: Path, tmp_path: Path,
                                                              same_pid: bool,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Each run's leader numbers its lists from 1: run 2's switches must not merge into run 1's."""
    append_run(events, second_run, same_pid=same_pid)
    timeline = timeline_of(events)
    assert [(r.number, r.first_switch, r.last_switch, len(r.processes)) for r in timeline.runs] == \
        [(1, 1, 2, WORLD), (2, 3, 4, WORLD)]
    assert [(s.seq, s.run, s.list_seq, s.ok) for s in timeline.switches] == \
        [(1, 1, 1, True), (2, 1, 2, True), (3, 2, 1, True), (4, 2, 2, True)]
    for switch in timeline.switches:
        assert switch.missing == [] and switch.duration < 1.0  # merged, it spanned both runs
        assert [lane.label for lane in switch.lanes] == [f"rank {r}" for r in range(WORLD)]
        for lane in switch.lanes:  # one bar per phase: nothing of the other run's switch
            assert sorted(b.phase for b in lane.bars) == ["guard", "parked", "pause", "switch"], lane.bars
            assert [m.label for m in lane.marks] == ["resumed"]
        assert [m.label.split(":")[0] for m in switch.leader].count("reply sent") == 1
    page = render_html(timeline)
    assert "These files hold 2 runs of job demo-job" in page
    assert "Switch 3 (run 2, list 1)" in page and "switches 3-4" in page
    code, out, _ = run_cli([str(events), "--switch", "3", "-o", str(tmp_path / "t.html")], capsys)
    assert code == 0 and "switch 3 (run 2, list 1): switched" in out
    assert "switch 1 " not in out and "switch 4 " not in out


def test_training_processes_restarted_under_one_leader_are_one_run(events: Path) -> None:
    """A launcher's leader outlives the training processes it restarts: rank 1 restarted between
    the two switches (a new pid, a new agent_started) is still the same run, its lists numbered on."""
    path = events / "rank-1.jsonl"
    records = load(path)
    cut = next(i for i, r in enumerate(records) if r["kind"] == "resumed") + 1
    started = {**next(r for r in records if r["kind"] == "agent_started"), "wall": records[cut]["wall"] - 0.001}
    save(path, records[:cut] + [{**r, "pid": r["pid"] + 1} for r in [started, *records[cut:]]])
    timeline = timeline_of(events)
    assert len(timeline.runs) == 1 and len(timeline.runs[0].processes) == WORLD + 1
    assert [(s.seq, s.ok, len(s.lanes), s.missing) for s in timeline.switches] == [(1, True, WORLD, []),
                                                                                 (2, True, WORLD, [])]
    assert "runs of job" not in render_html(timeline)


def test_a_failed_guard_says_its_status_and_detail(events: Path) -> None:
    """``guard_done`` records a hook's outcome as ``status`` + ``detail``, ``member_result`` as
    ``reason``: the bars read both (hook_outcome)."""
    path = events / "rank-2.jsonl"
    records = load(path)
    for r in records:
        if r["kind"] == "guard_done" and r["seq"] == 1:
            r["detail"].update(ok=False, status="raised", detail="OSError: disk full")
    save(path, records)
    lane = timeline_of(events).switches[0].lanes[2]
    guard = next(b for b in lane.bars if b.phase == "guard")
    assert (guard.ok, guard.note) == (False, "raised: OSError: disk full") and lane.failed == 1
    assert next(b for b in lane.bars if b.phase == "switch").note == "switched"


def test_later_stream_events_do_not_stretch_the_switch_they_follow(events: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Found by outside testers: "31698 ms from first pause to last resume" for a switch of 15 ms,
    ending at a stream_restored after ClusterD restarted. A switch lasts from its first event to
    its last; the leader's later events are listed after it, and one during it is still drawn."""
    before = timeline_of(events).switches[1]
    path = events / "rank-0.jsonl"
    records = load(path)
    done = next(r for r in records if r["kind"] == "switch_done" and r["seq"] == 2)
    end = before.start_wall + before.duration  # on the leader's clock, which is rank 0's

    def leader(kind: str, at: float, why: str) -> dict[str, Any]:
        return {**done, "kind": kind, "seq": None, "wall": at, "mono": done["mono"] + (at - done["wall"]),
                "detail": {"why": why}}

    during = leader("stream_lost", done["wall"], "UNAVAILABLE: during")
    lost = leader("stream_lost", end + 6.424, "UNAVAILABLE: simulator stopped")
    restored = leader("stream_restored", end + 31.683, "stream established")
    at = records.index(done) + 1
    save(path, [*records[:at], during, *records[at:], lost, restored])
    timeline = timeline_of(events)
    switch = timeline.switches[1]
    assert switch.duration == pytest.approx(before.duration, abs=1e-9)
    assert switch.start_wall == pytest.approx(before.start_wall, abs=1e-9)
    assert "stream to ClusterD lost: UNAVAILABLE: during" in [m.label for m in switch.leader]
    assert [(round(m.at - switch.duration, 3), m.label) for m in switch.after] == [
        (6.424, "stream to ClusterD lost: UNAVAILABLE: simulator stopped"),
        (31.683, "stream to ClusterD restored: stream established")]
    page = render_html(timeline)
    assert "after the switch ended: stream to ClusterD restored" in page
    code, out, _ = run_cli([str(events), "-o", str(events.parent / "t.html")], capsys)
    assert code == 0 and span_text(before) in out and span_text(before).endswith("from its first event to its last")
    assert "after it ended: +" in out and "first pause" not in out


def test_clusterds_recovery_is_drawn_on_the_switch_it_follows(events: Path) -> None:
    """``recovery`` events (the strategies offered, the one ClusterD chose) carry the failed switch's
    number: they are marks on its leader lane, part of it; one without a number (no switch of its
    pause failed) is drawn where it falls. Files without them (older agents) read as before."""
    path = events / "rank-0.jsonl"
    records = load(path)
    reply = next(r for r in records if r["kind"] == "reply_sent" and r["seq"] == 1)
    done = next(r for r in records if r["kind"] == "switch_done" and r["seq"] == 2)

    def recovery(after: dict[str, Any], seq: int | None, delay: float, **detail: Any) -> dict[str, Any]:
        return {**after, "kind": "recovery", "seq": seq, "wall": after["wall"] + delay,
                "mono": after["mono"] + delay, "detail": {"signal": "globalFault", "offered": None, "chosen": None,
                                                          **detail}}

    offered = recovery(reply, 1, 0.001, offered=["retry", "recover", "dump", "exit"])
    chosen = recovery(reply, 1, 0.002, signal="changeStrategy", chosen="retry")
    exit_ = recovery(done, None, 0.0, signal="changeStrategy", chosen="exit")
    first, second = records.index(reply) + 1, records.index(done) + 1
    save(path, [*records[:first], offered, chosen, *records[first:second], exit_, *records[second:]])
    timeline = timeline_of(events)
    assert timeline.problems == [] and [s.seq for s in timeline.switches] == [1, 2]
    one, two = timeline.switches
    drawn = [(m.label, m.ok) for m in one.leader if "recovery" in m.label]
    assert drawn == [("recovery strategies offered to ClusterD: retry, recover, dump, exit", True),
                     ("ClusterD chose the recovery strategy retry", True)]
    at = next(m.at for m in one.leader if m.label.startswith("ClusterD chose"))
    assert at == pytest.approx(reply["wall"] + 0.002 - one.start_wall, abs=1e-6) and at <= one.duration
    assert [(m.label, m.ok) for m in two.leader if "recovery" in m.label] == [
        ("ClusterD chose the recovery strategy exit", False)]
    page = render_html(timeline)
    assert "ClusterD chose the recovery strategy retry</title>" in page  # a numbered tick on the leader lane
    assert "recovery strategies offered to ClusterD: retry, recover, dump, exit</td>" in page  # and in its table


def test_a_switch_its_guard_round_decided_names_the_refusal_and_the_last_answer(events: Path) -> None:
    """A guard refused on rank 3: no switch order went out, so no rank has a switch result. Every
    rank's answer to the guard round counts (found by an outside check: "no result from ranks 0-3",
    and the critical path named only the rank that parked last)."""
    for rank in range(WORLD):
        path = events / f"rank-{rank}.jsonl"
        kept = []
        for r in load(path):
            if r["kind"] == "member_result" and r["seq"] == 1 and r["detail"]["kind"] == "switch":
                continue  # no switch order went out
            if r["kind"] == "member_result" and r["seq"] == 1 and r["detail"]["kind"] == "guard":
                if rank == 3:
                    r["detail"].update(ok=False,
                                       reason="checkpoint hook raised OSError: disk full; switch not attempted")
                if rank == 2:  # its save took longer: the leader waited for it
                    r["wall"] += 0.5
                    r["mono"] += 0.5
            kept.append(r)
        save(path, kept)
    switch = timeline_of(events).switches[0]
    assert not [m for m in switch.missing if "no result" in m], switch.missing
    assert switch.critical[-2].startswith("rank 2 answered last (+"), switch.critical
    assert switch.critical[-2].endswith("ms): the guard round is decided once every rank answered"), switch.critical
    assert switch.critical[-1].startswith("rank 3 failed first (+") and "its failure decided" in switch.critical[-1]
    assert [lane.failed for lane in switch.lanes] == [0, 0, 0, 1]
    assert not any(b.phase == "switch" for lane in switch.lanes for b in lane.bars)  # no switch ran


def test_a_failed_pause_is_drawn_after_the_switch_it_follows(events: Path) -> None:
    """A pause that failed before any rank list (``pause_failed``, no list number) is a red mark
    after the switch before it: the page no longer shows only ClusterD's killMaster there."""
    path = events / "rank-0.jsonl"
    records = load(path)
    before = timeline_of(events).switches[1]
    done = next(r for r in records if r["kind"] == "switch_done" and r["seq"] == 2)
    at = before.start_wall + before.duration + 5.0
    failed = {**done, "kind": "pause_failed", "seq": None, "wall": at, "mono": done["mono"] + (at - done["wall"]),
              "detail": {"reason": "rank(s) 3 did not park at step 41", "duration_s": 2.0}}
    save(path, [*records, failed])
    switch = timeline_of(events).switches[1]
    assert [(round(m.at - switch.duration, 3), m.label, m.ok) for m in switch.after] == [
        (5.0, "pause failed before a rank list (499: training went on, ClusterD kills the job): rank(s) 3 did not "
              "park at step 41", False)]
