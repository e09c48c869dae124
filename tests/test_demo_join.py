"""``nicswitch-agent demo --server``: the demo's job joining a running ClusterD, as a shell uses it.

Real processes (``python -m nicswitch_agent demo ...``) against the simulator on a free port: a
signal while the job waits for ClusterD, and ``--background`` under a caller that reads its
stdout and stderr to the end (``out=$(...)``, a pipe).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import free_port, operator_switch, poll

from nicswitch_agent.sim import SimJob, SimSettings, Simulator

JOB = "job-demo-join"


def demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "nicswitch_agent", "demo", *args]


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal, even under a runner that ignores it


class Lines:
    """A child's stderr, read on a thread into lines, so the test can wait for one."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.append(line)

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_job_waits_for_clusterd_ends_it_with_128_plus_the_signal(sig: int) -> None:
    """Nothing listens at --server: the job waits for ClusterD (up to --timeout, 300 s); Ctrl-C or
    SIGTERM ends it at once, with the shell's code for that signal. (Before: ignored until --timeout.)"""
    proc = subprocess.Popen(demo("--server", f"127.0.0.1:{free_port()}", "--job", JOB, "--timeout", "300"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        err = Lines(proc.stderr)
        assert poll(lambda: "waiting for it" in "".join(err.lines) or proc.poll() is not None, 60), err.lines
        assert proc.poll() is None, err.text()
        proc.send_signal(sig)
        code = proc.wait(60)  # well before --timeout: the signal ended the wait
        assert code == 128 + sig, err.text()
        name = signal.Signals(sig).name
        assert f"nicswitch-agent demo: {name} before job {JOB} registered with ClusterD" in err.text()
        assert "Traceback" not in err.text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1"]})],
                          settings=SimSettings(keepalive_interval_s=0.5))
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.mark.timeout(120)
def test_background_returns_to_a_caller_that_reads_stdout_and_stderr_to_the_end(sim: Simulator) -> None:
    """``out=$(nicswitch-agent demo --background ...)`` ends once the job is registered: the job keeps
    neither stream open, and says where it logs. (Before: the caller waited for the whole job.)"""
    proc = subprocess.Popen(demo("--server", sim.address, "--job", JOB, "--switches", "1", "--background"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid, log = None, None
    try:
        out, err = proc.communicate(timeout=90)  # EOF on both: no process holds them any more
        assert proc.returncode == 0, (out, err)
        found = re.search(r"runs in the background as pid (\d+), logging to (\S+);", out)
        assert found, out
        pid, log = int(found.group(1)), Path(found.group(2))
        assert poll(lambda: "registered with ClusterD" in log.read_text(), 30), log.read_text()
        assert operator_switch(sim.address, JOB, ["0", "1"], [True, True]) == "switch nic finish"
        assert poll(lambda: "done after 1 switch(es)" in log.read_text(), 60), log.read_text()  # it went on logging
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if log is not None:
            log.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_switches_0_runs_past_timeout_until_a_signal(sim: Simulator) -> None:
    """--switches 0 says "until SIGINT/SIGTERM": --timeout bounds only the registration (a stranger's
    job stopped at the default 300 s, saying nothing of a timeout)."""
    proc = subprocess.Popen(demo("--server", sim.address, "--job", JOB, "--switches", "0", "--timeout", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        out = Lines(proc.stdout)
        assert poll(lambda: "runs until SIGINT/SIGTERM" in "".join(out.lines) or proc.poll() is not None, 60), \
            out.lines
        with pytest.raises(subprocess.TimeoutExpired):  # still running past its --timeout, no signal yet
            proc.wait(4)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert "done after 0 switch(es)" in out.text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


def test_a_timeout_that_is_not_positive_is_a_usage_error() -> None:
    proc = subprocess.run(demo("--server", "127.0.0.1:1", "--timeout", "-5"), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "argument --timeout: '-5' must be a positive number of seconds" in proc.stderr, \
        proc.stderr


@pytest.mark.timeout(120)
def test_a_job_clusterd_refuses_ends_the_demo_at_once_saying_why(sim: Simulator) -> None:
    """Found by an outside check: Init refused at once (a job ClusterD does not run), and the demo
    still waited out its --timeout before saying it "could not register"."""
    proc = subprocess.run(demo("--server", sim.address, "--job", "no-such-job", "--timeout", "300"),
                          capture_output=True, text=True, timeout=90)  # far below --timeout: it did not wait
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "nicswitch-agent demo: job no-such-job: the leader's agent failed: ClusterD refused" in proc.stderr, \
        proc.stderr
