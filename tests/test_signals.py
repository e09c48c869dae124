"""SIGTERM / SIGINT in a real training process: owed replies sent, ranks unparked, prompt exit.

Each test runs tests/signal_job/train.py as a child process against the simulator (in this
process, on a loopback port), waits for a state from the child's printed events, sends a signal,
and checks what ClusterD saw and how the child ended.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import support

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(120)

JOB = "job-sig"
NODES = {"node-0": ["0"]}
TRAIN = Path(__file__).parent / "signal_job" / "train.py"
EXIT_WAIT_S = 30.0


def fast(**changes: float) -> SimSettings:
    values = dict(report_timeout_s=30.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                  schedule_wait_s=0.01, restart_wait_s=0.01)
    values.update(changes)
    return SimSettings(shuffle_nodes=False, **values)


class Child:
    """The training process; its stdout lines are collected on a thread."""

    def __init__(self, sim: Simulator, scenario: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # stderr apart: a traceback written while the stop thread prints would split an EVENT line.
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the test's process
        self.proc = subprocess.Popen([sys.executable, str(TRAIN), sim.address, JOB, scenario],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, text: str, timeout: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: text in self.lines, timeout)

    def finish(self, timeout: float = EXIT_WAIT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the child did not exit within {timeout:g} s of the signal; output:\n" + self.output())

    def output(self) -> str:
        self._reader.join(5)
        self.stderr.seek(0)
        return "\n".join(self.lines) + "\n--- stderr ---\n" + self.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


streams_ready = functools.partial(support.streams_ready, job=JOB)


def request_switch(sim: Simulator) -> None:
    channel = open_channel(ChannelSettings(target=sim.address))
    try:
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps["node-0"].dev.append("0")
        request.nicOps["node-0"].op.append(True)
        status = RecoverStub(channel).SwitchNicTrack(request, timeout=5)
        assert status.code == 0, status
    finally:
        channel.close()


@pytest.fixture
def run() -> Iterator[object]:
    sims: list[Simulator] = []
    children: list[Child] = []

    def start(scenario: str, ready: bool = True, **settings: float) -> tuple[Simulator, Child]:
        sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=fast(**settings))
        sim.start()
        sims.append(sim)
        child = Child(sim, scenario)
        children.append(child)
        assert child.wait_line("STARTED"), child.output()
        assert not ready or sim.wait_until(streams_ready, 20), child.output()
        return sim, child

    yield start
    for child in children:
        child.kill()
    for sim in sims:
        sim.stop()


def test_sigterm_while_idle_stops_the_agent_then_dies_of_the_signal(run) -> None:  # type: ignore[no-untyped-def]
    sim, child = run("idle")
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM  # the same status as without the agent
    assert "EVENT agent_stopped" in child.lines, child.output()
    assert sim.job_view(JOB).replies == []
    assert sim.job_view(JOB).violations == []


def frames(output: str) -> list[str]:
    """The ``File "...", line N, in name`` lines of the tracebacks in ``output``, outermost first."""
    return [line.strip() for line in output.splitlines() if line.strip().startswith('File "')]


def last_frame(output: str) -> str:
    """The innermost frame of the last traceback in ``output``."""
    found = frames(output)
    assert found, output
    return found[-1]


def test_sigint_while_idle_stops_the_agent_and_raises_keyboard_interrupt(run) -> None:  # type: ignore[no-untyped-def]
    _sim, child = run("idle")
    child.proc.send_signal(signal.SIGINT)
    code = child.finish()
    output = child.output()
    assert code == -signal.SIGINT, output  # an uncaught KeyboardInterrupt, as without the agent
    assert "KeyboardInterrupt" in output
    assert "EVENT agent_stopped" in child.lines, output
    # As without the agent: the traceback ends in the training script (its loop sleeps between
    # steps), not in a frame of ours, which would read as the library having crashed.
    assert not [f for f in frames(output) if "/nicswitch_agent/" in f], output
    assert last_frame(output).startswith(f'File "{TRAIN}"'), output


def test_sigterm_while_parked_unparks_and_exits(run) -> None:  # type: ignore[no-untyped-def]
    # The simulator holds the list back after the pause: training stays parked with no list in flight.
    sim, child = run("idle", list_delay_s=60.0)
    request_switch(sim)
    assert child.wait_line("EVENT parked"), child.output()
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM
    output = child.output()
    assert "EVENT resumed" in child.lines, output  # unparked before the process ended
    assert output.index("EVENT resumed") < output.index("EVENT agent_stopped")
    assert sim.job_view(JOB).replies == []  # no list was received, so none is owed


def test_sigterm_mid_switch_sends_the_owed_false_reply_before_exiting(run) -> None:  # type: ignore[no-untyped-def]
    sim, child = run("switching")
    request_switch(sim)
    assert child.wait_line("HOOK"), child.output()
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM
    output = child.output()
    assert "EVENT reply_sent" in child.lines, output
    view = sim.job_view(JOB)
    assert view.replies == [False]  # exactly one reply, and false: the switch did not finish
    assert view.violations == []


def test_a_previous_python_handler_is_chained(run) -> None:  # type: ignore[no-untyped-def]
    _sim, child = run("user-handler")
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish() == 42  # the user's handler decided how to exit
    output = child.output()
    assert "USER-HANDLER" in child.lines, output
    assert "EVENT agent_stopped" in child.lines, output  # interpreter exit waited for the stop under way


def test_handle_signals_false_leaves_the_default_action(run) -> None:  # type: ignore[no-untyped-def]
    _sim, child = run("no-handlers")
    child.proc.send_signal(signal.SIGTERM)
    assert child.finish() == -signal.SIGTERM
    assert "EVENT agent_stopped" not in child.lines  # killed outright: nothing of ours ran


def test_interpreter_exit_with_a_running_agent_does_not_hang(run) -> None:  # type: ignore[no-untyped-def]
    sim, child = run("return", ready=False)
    assert child.finish() == 0
    assert "RETURNING" in child.lines, child.output()
    assert "EVENT agent_stopped" in child.lines, child.output()
    assert sim.job_view(JOB).violations == []


SIGNAL_DURING_INSTALL = """
import os, signal, sys
from nicswitch_agent import process_hooks

chained, stopped = [], []
signal.signal(signal.SIGINT, lambda signum, frame: chained.append(signum))  # a program's own (demo --server's)
real = signal.signal


def install_then_deliver(signum, handler):
    previous = real(signum, handler)
    if signum == signal.SIGINT and handler == process_hooks._stopper._handle:
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at once: inside install()
    return previous


process_hooks.signal.signal = install_then_deliver
names = process_hooks.install(lambda why: stopped.append(why))
process_hooks.signal.signal = real
process_hooks._stopper._stopping.join(10)
print("DONE", sorted(names), chained == [signal.SIGINT], stopped)
"""


def test_a_signal_that_lands_while_the_handlers_are_installed_is_handled_not_deadlocked() -> None:
    """Ctrl-C as `demo --server` started its agents hung the command: the handler ran on the main
    thread inside install(), which held the stopper's lock, and waited for that lock for ever."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    done = subprocess.run([sys.executable, "-c", SIGNAL_DURING_INSTALL], capture_output=True, text=True, env=env,
                          timeout=20, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DONE ['SIGINT', 'SIGTERM'] True ['SIGINT']", done.stdout + done.stderr
