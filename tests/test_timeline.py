"""The timeline of a real 4-process job: its layout data, its page in a real browser, its command line.

One ``nicswitch-agent demo --processes --output-dir DIR`` run (four torch processes, gloo, the job's
TCPStore, a failover and a switchback) writes every rank's events file and the page; the tests
read those files as an operator would. The browser test opens the page in headless Chromium (from
the distribution's packages; .ci/run installs it) and checks the screenshot is a picture, not a
blank page, and that the page logged nothing on the console (a blocked fetch would).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

from nicswitch_agent.observability.timeline import build, read_events, render_html
from nicswitch_agent.observability.timeline.model import Lane, Switch, Timeline
from nicswitch_agent.observability.timeline.render import COLOURS
from nicswitch_agent.ops import cli

pytest.importorskip("torch", reason="the 4-process job needs the torch extra")

WORLD = 4
SCRUB = ("NICSWITCH_", "MINDX_", "TORCHELASTIC_", "PYTEST_")


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of one real 4-process demo: ``events/rank-<r>.jsonl`` and ``timeline.html``."""
    out = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo", "--processes", "--ranks", str(WORLD),
                             "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=150, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"timeline page: {out / 'timeline.html'}" in result.stdout, result.stdout
    assert sorted(p.name for p in (out / "events").iterdir()) == [f"rank-{r}.jsonl" for r in range(WORLD)]
    return out


@pytest.fixture(scope="module")
def timeline(job_dir: Path) -> Timeline:
    return build(read_events([str(job_dir / "events")]))


def bars(lane: Lane) -> dict[str, tuple[float, float]]:
    found = {bar.phase: (bar.start, bar.end) for bar in lane.bars}
    assert len(found) == len(lane.bars), f"{lane.label}: a phase twice: {lane.bars}"
    return found


def mark(switch: Switch, prefix: str) -> float:
    return next(m.at for m in switch.leader if m.label.startswith(prefix))


def test_each_switch_has_a_lane_per_rank_with_its_phases_in_order(timeline: Timeline) -> None:
    assert timeline.problems == []
    assert (timeline.ranks_seen, timeline.ranks_expected, timeline.files) == (WORLD, WORLD, WORLD)
    assert [s.seq for s in timeline.switches] == [1, 2]
    for switch in timeline.switches:
        assert switch.ok is True and switch.missing == []
        assert not switch.by_node
        assert [lane.label for lane in switch.lanes] == [f"rank {r}" for r in range(WORLD)]
        assert switch.step is not None
        for lane in switch.lanes:
            phase = bars(lane)
            assert set(phase) == {"pause", "parked", "guard", "switch"}, lane.bars
            assert phase["pause"][1] == pytest.approx(phase["parked"][0])  # parked when the pause ended
            assert phase["parked"][0] <= phase["guard"][0] <= phase["guard"][1] <= phase["switch"][0] \
                <= phase["switch"][1] <= phase["parked"][1]
            assert [m.label for m in lane.marks] == ["resumed"]
            assert lane.marks[0].at == pytest.approx(phase["parked"][1])
            assert lane.failed == 0 and not lane.unfinished
        assert {st.phase for st in switch.stats} == {"pause", "parked", "guard", "switch"}
        assert all(st.count == WORLD and st.p50 <= st.p99 <= st.max for st in switch.stats)
        # the switch's window is exactly its events: from the pause sent to the last resume
        assert min(b.start for lane in switch.lanes for b in lane.bars) >= 0
        assert max(m.at for lane in switch.lanes for m in lane.marks) <= switch.duration + 1e-9


def test_bars_are_the_durations_and_times_the_ranks_wrote(job_dir: Path, timeline: Timeline) -> None:
    import json

    for rank in range(WORLD):
        records = [json.loads(line) for line in (job_dir / "events" / f"rank-{rank}.jsonl").read_text().splitlines()]
        shift = timeline.alignment.offsets.get(rank, 0.0)
        for switch in timeline.switches:
            phase = bars(switch.lanes[rank])
            guard = next(r for r in records if r["kind"] == "guard_done" and r["seq"] == switch.seq)
            result = next(r for r in records if r["kind"] == "member_result" and r["seq"] == switch.seq
                          and r["detail"]["kind"] == "switch")
            epoch = result["detail"]["epoch"]
            parked = next(r for r in records if r["kind"] == "parked" and r["detail"]["epoch"] == epoch)
            # wall clocks near 1.8e9 s keep about a microsecond through the subtractions
            assert phase["guard"][1] - phase["guard"][0] == pytest.approx(guard["detail"]["duration_s"], abs=1e-6)
            assert switch.start_wall + phase["switch"][1] == pytest.approx(result["wall"] - shift, abs=1e-6)
            assert switch.start_wall + phase["parked"][0] == pytest.approx(parked["wall"] - shift, abs=1e-6)


def test_the_leader_lane_has_the_clusterd_messages_in_protocol_order(timeline: Timeline) -> None:
    for switch in timeline.switches:
        labels = [m.label.split(":")[0] for m in switch.leader]
        assert labels == ["pause sent to the ranks", "list received from ClusterD", "order sent to the ranks",
                          "outcome sent to the ranks", "switch done", "reply sent"] or labels == [
            "pause sent to the ranks", "list received from ClusterD", "order sent to the ranks", "switch done",
            "outcome sent to the ranks", "reply sent"], labels
        assert mark(switch, "pause sent") == 0.0  # the leader's first word starts the switch
        assert all(m.ok for m in switch.leader)


def test_ranks_are_aligned_by_the_leaders_timestamps_they_received(timeline: Timeline) -> None:
    alignment = timeline.alignment
    assert alignment.leader_found and alignment.unaligned == []
    assert sorted(alignment.offsets) == [1, 2, 3]  # rank 0 is the leader's process: the reference
    for rank, offset in alignment.offsets.items():
        assert 0 <= offset < 0.5, (rank, offset)  # one host: a delay, no clock difference
        assert alignment.messages[rank] >= 2 * 4  # pause, guard, result, outcome per switch
    for switch in timeline.switches:
        pause_sent, order_sent = mark(switch, "pause sent"), mark(switch, "order sent")
        for lane in switch.lanes:  # nobody got a message before the leader sent it
            assert bars(lane)["pause"][0] >= pause_sent
            assert bars(lane)["guard"][0] >= order_sent - 1e-9


def test_hours_apart_clocks_are_aligned_back(job_dir: Path, tmp_path: Path, timeline: Timeline) -> None:
    """Rank 2's host three hours ahead: its events carry its clock, the leader's sent_at stays the
    leader's; the layout comes out the same."""
    import json

    shifted = tmp_path / "events"
    shutil.copytree(job_dir / "events", shifted)
    path = shifted / "rank-2.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "wall": r["wall"] + 3 * 3600}) + "\n" for r in records))
    again = build(read_events([str(shifted)]))
    assert again.alignment.offsets[2] == pytest.approx(3 * 3600 + timeline.alignment.offsets[2])
    for before, after in zip(timeline.switches, again.switches, strict=True):
        assert after.duration == pytest.approx(before.duration)
        for old, new in zip(before.lanes, after.lanes, strict=True):
            assert [(b.phase, round(b.start, 6), round(b.end, 6)) for b in new.bars] == \
                   [(b.phase, round(b.start, 6), round(b.end, 6)) for b in old.bars]


def test_the_critical_path_names_the_rank_everyone_waited_for(timeline: Timeline) -> None:
    for switch in timeline.switches:
        last_parked = max(switch.lanes, key=lambda lane: bars(lane)["parked"][0])
        last_answer = max(switch.lanes, key=lambda lane: bars(lane)["switch"][1])
        assert "parked last" in last_parked.critical
        assert "answered last" in last_answer.critical
        assert [lane for lane in switch.lanes if lane.critical] == \
               [lane for lane in switch.lanes if lane in (last_parked, last_answer)]
        assert switch.slowest[0][0] == last_answer.rank


def test_the_page_is_self_contained(job_dir: Path) -> None:
    page = (job_dir / "timeline.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 2
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\(", page, re.IGNORECASE)
    assert re.findall(r"https?://[^\s\"'<]+", page) == []  # inline SVG in HTML needs no namespace URL
    assert "leader's clock" in page and "sent_at" in page  # it says how clocks were aligned


def test_cli_writes_one_switch_as_svg_and_prints_a_summary(job_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "two.svg"
    assert cli.main(["timeline", str(job_dir / "events" / "rank-{rank}.jsonl"), "--switch", "2", "--format", "svg",
                     "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "switch 2: switched" in printed and "switch 1:" not in printed
    assert f"picture: {out}" in printed
    root = ET.fromstring(out.read_text(encoding="utf-8"))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert [f"rank {r}" for r in range(WORLD)] == [t for t in labels if t and t.startswith("rank ")]


# -- the page in a real browser ------------------------------------------------------------------

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


def screenshot(page: Path, png: Path, size: str = "1000,800") -> str:
    """Open ``page`` in headless Chromium, save a screenshot; its log (console messages included)."""
    assert CHROMIUM is not None
    result = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--no-first-run", "--enable-logging=stderr", "--v=0", f"--window-size={size}",
                             f"--screenshot={png}", page.resolve().as_uri()],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and png.exists(), result.stderr[-3000:]
    return result.stdout + result.stderr


def console_messages(log: str) -> list[str]:
    return [line for line in log.splitlines() if ":CONSOLE" in line]


def decode_png(data: bytes) -> tuple[int, int, list[bytes], int]:
    """(width, height, rows of pixels, bytes per pixel) of an 8-bit RGB/RGBA PNG, with zlib alone."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, bpp = 8, [], 0, 0, 3
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
    raw = zlib.decompress(b"".join(idat))
    stride, prev, rows, i = width * bpp, bytearray(width * bpp), [], 0
    for _ in range(height):
        kind_, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride) if kind_ else ():
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if kind_ == 1:
                line[x] = (line[x] + a) & 255
            elif kind_ == 2:
                line[x] = (line[x] + b) & 255
            elif kind_ == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows, bpp


def colours(png: Path) -> set[bytes]:
    _, _, rows, bpp = decode_png(png.read_bytes())
    return {row[x:x + 3] for row in rows for x in range(0, len(row), bpp)}


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium; .ci/run does)")
@pytest.mark.timeout(120)
def test_the_page_renders_in_headless_chromium_without_console_errors(job_dir: Path, tmp_path: Path) -> None:
    png = tmp_path / "page.png"
    log = screenshot(job_dir / "timeline.html", png)
    assert console_messages(log) == []
    seen = colours(png)
    assert len(seen) > 50, f"{len(seen)} colours: a blank page?"
    for phase in ("pause", "guard", "switch"):  # the bars themselves were drawn
        assert bytes.fromhex(COLOURS[phase][1:]) in seen, phase


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium; .ci/run does)")
@pytest.mark.timeout(120)
def test_the_browser_check_sees_console_errors_and_blank_pages(tmp_path: Path, timeline: Timeline) -> None:
    """The checks above would fail on a page that logs an error or draws nothing."""
    page = tmp_path / "broken.html"
    page.write_text(render_html(timeline).replace("</body>", '<img src="missing.png"><script>console.error('
                                                               '"drawn wrong")</script></body>'))
    messages = console_messages(screenshot(page, tmp_path / "broken.png"))
    assert any("drawn wrong" in line for line in messages), messages
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    screenshot(blank, tmp_path / "blank.png")
    assert len(colours(tmp_path / "blank.png")) < 5
