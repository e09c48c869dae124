"""``nicswitch-agent demo --processes``: the demo with every rank a real torch process.

Runs the command line as a user does (``python -m nicswitch_agent demo --processes``): four rank
processes (torch.distributed, gloo on CPU, rank 0's TCPStore), the simulator and the operator in
the demo process. The checks read the printed timeline: every rank parked at the same step for
each switch, then the list, the guard and switch on every rank, the leader's verdict, the reply
and the resume, in that order.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from support import poll

pytest.importorskip("torch")

WORLD = 4
LINE = re.compile(r"^\s+(\d+\.\d) ms  (\S+(?: \d+)?)\s+(.*)$")
SCRUB = ("NICSWITCH_", "MINDX_", "TORCHELASTIC_", "PYTEST_")


def timeline(out: str) -> list[tuple[str, str]]:
    """(who, text) of every timeline line, in the printed order."""
    return [(m.group(2), m.group(3)) for m in map(LINE.match, out.splitlines()) if m]


def index_of(lines: list[tuple[str, str]], who: str, pattern: str, start: int = 0) -> int:
    for i in range(start, len(lines)):
        if lines[i][0] == who and re.search(pattern, lines[i][1]):
            return i
    raise AssertionError(f"no {who!r} line matching {pattern!r} after line {start}")


@pytest.mark.timeout(180)
def test_demo_processes_every_rank_parks_at_the_same_step_and_switches() -> None:
    # A launcher's or a job's settings in this shell must not leak into the demo's ranks (it scrubs
    # them too; this keeps the test independent of that).
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo", "--processes", "--ranks", str(WORLD),
                             "-v"], capture_output=True, text=True, timeout=150, env=env, check=False)
    out = result.stdout
    print(out, result.stderr)
    assert result.returncode == 0, out + result.stderr
    assert out.rstrip().endswith("demo succeeded")
    assert "2 nodes x 2 devices = 4 ranks (processes: torch.distributed with gloo" in out
    # The ranks' start lines (-v): two nodes, as in a job of several hosts, each with its relay.
    assert "rank 3 of 4, job=demo-job, leader=rank0; node-local fan-out: node 1 of 2, local rank 1; over the " \
           "node link" in result.stderr, result.stderr
    lines = timeline(out)

    # Real processes: one pid per rank, none of them the demo's.
    started = [t for who, t in lines if who == "demo" and "rank processes" in t]
    assert len(started) == 1, started
    listed = re.search(r"\(pids ([\d, ]+)\)", started[0])
    assert listed, started
    pids = [int(p) for p in listed.group(1).split(", ")]
    assert len(set(pids)) == WORLD and os.getpid() not in pids

    # Every rank parked twice, at the same step as every other rank each time, and never twice at one step.
    parked: dict[int, list[int]] = defaultdict(list)
    for who, text in lines:
        m = re.fullmatch(r"training parked at step (\d+) \(step boundary\)", text)
        if m:
            parked[int(who.split()[1])].append(int(m.group(1)))
    assert sorted(parked) == list(range(WORLD)), parked
    steps = parked[0]
    assert len(steps) == 2 and steps[0] < steps[1], steps
    assert all(parked[r] == steps for r in range(WORLD)), parked
    assert f"every rank parked at the same steps: yes ({steps[0]}, {steps[1]})" in out

    # Each switch, in causal order: all ranks parked -> list received -> the guard on every (parked)
    # rank, then the switch on every rank (the guard round is a barrier) -> the leader's verdict ->
    # the reply (and rank 0 resumes) -> the operator's result.
    position = 0
    for seq, standby in ((1, "ranks on standby: 2, 3"), (2, "ranks on standby: none")):
        request = index_of(lines, "operator", r"^SwitchNicTrack\(node-1 dev 0,1 ", position)
        parks = [index_of(lines, f"rank {r}", rf"^training parked at step {steps[seq - 1]} ", request)
                 for r in range(WORLD)]
        received = index_of(lines, "leader", rf"^rank list #{seq} received: 2 rank\(s\)", request)
        assert max(parks) < received
        guards = [index_of(lines, f"rank {r}", r"^guard ok in .* on the parked training thread$", received)
                  for r in range(WORLD)]
        switched = [index_of(lines, f"rank {r}", r"^switch ok in .* on the parked training thread$", received)
                    for r in range(WORLD)]
        done = index_of(lines, "leader", rf"^order #{seq} switched on all {WORLD} rank\(s\)", received)
        # (each rank's lines keep their order; across ranks, lines from separate pipes may not:
        # the barrier itself is tests/test_guard_round.py's)
        assert all(guard < switch for guard, switch in zip(guards, switched, strict=True)) and max(switched) < done
        reply = index_of(lines, "leader", r"^ReplySwitchNicResult\(true\) delivered", done)
        # ClusterD sends continue as soon as it has the reply, so rank 0 may resume before the leader
        # logs the reply's answer: resuming follows the verdict, not that log line.
        resumed = index_of(lines, "rank 0", r"^training resumed after", done)
        finished = index_of(lines, "operator", r"^result: 'switch nic finish'$", reply)
        index_of(lines, "demo", "^" + re.escape(standby) + "$", finished)
        position = max(resumed, finished)
    assert sum(1 for _, t in lines if t.startswith("switch ok")) == 2 * WORLD
    assert "checkpoints written by the guards: 8 (4 ranks x 2 switches)" in out
    assert "replies delivered: 2, failed: 0" in out
    assert "misuse" not in out and "FAILED" not in out


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_start_fails_the_demo_at_once_and_says_why(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from nicswitch_agent.demo import run_demo

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ImportError: this python has no torch' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))  # what the demo starts its ranks with
    out = io.StringIO()
    assert run_demo(out, ranks=2, processes=True) == 1
    text = out.getvalue()
    assert re.search(r"demo +FAILED: rank [01] exited: ImportError: this python has no torch", text), text
    assert "switches: 0, results: []" in text
    assert text.rstrip().endswith("demo FAILED")


@pytest.mark.timeout(120)
def test_a_stop_while_the_ranks_start_ends_them_at_once(tmp_path: Path) -> None:
    """Ctrl-C during `demo --processes`'s start: a stranger waited 30 s with nothing printed,
    rank 0 held in torch.distributed's set-up by a rank that had already gone. The ranks that
    never reported training are now ended at once, not asked to stop."""
    import threading

    from nicswitch_agent.demo.common import Timeline
    from nicswitch_agent.demo.processes import ProcessJob

    timeline = Timeline()
    job = ProcessJob(2, timeline, str(tmp_path))
    failed: list[BaseException] = []

    def start() -> None:
        try:
            job.start("127.0.0.1:1")  # no ClusterD needed to be still starting
        except BaseException as exc:  # the start fails once its ranks are gone: expected here
            failed.append(exc)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    assert poll(lambda: len(job._ranks) == 2, 60)  # both spawned; torch takes seconds to import
    job.stop()
    starting.join(60)
    said = " | ".join(text for _, _, text in timeline.lines)
    assert "still starting: stopped at once" in said and "did not stop within" not in said, said
    assert all(rank.proc.poll() is not None for rank in job._ranks)
