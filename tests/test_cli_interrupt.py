"""Ctrl-C at the moments where it used to break ``nicswitch-agent``: while the command is still
importing (exit 130, one quiet line at most, no traceback), and inside grpcio's creation of a call
(exit 130 with the command's own line, not a hang).

The command is a real process. A ``sitecustomize`` on its PYTHONPATH stalls it at the line in
question (it says so in a file, then waits), so SIGINT lands there, every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import free_port, poll

STALL = textwrap.dedent("""
    import os, sys, time

    class Stall:
        def find_spec(self, name, path=None, target=None):
            if name == os.environ["STALL_IMPORT"]:
                open(os.environ["STALL_FILE"], "w").close()
                while True:
                    time.sleep(0.01)
            return None

    sys.meta_path.insert(0, Stall())
""")


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal, even under a runner that ignores it


def run_stalled(tmp_path: Path, stall: str, argv: list[str], env: dict[str, str], at_stall: Callable[[Any], object],
                never: str) -> tuple[int, str, str]:
    """``nicswitch-agent argv`` with ``stall`` as its sitecustomize; once it says it stalled,
    ``at_stall(proc)`` (the test's SIGINT). Its exit code, stdout and stderr; killed if still running."""
    (tmp_path / "sitecustomize.py").write_text(stall)
    stalled = tmp_path / "stalled"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "STALL_FILE": str(stalled), **env}
    proc = subprocess.Popen([sys.executable, "-m", "nicswitch_agent", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        assert poll(lambda: stalled.exists() or proc.poll() is not None, 60), never
        assert proc.poll() is None, proc.communicate()
        at_stall(proc)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, out, err


@pytest.mark.timeout(120)
# nicswitch_agent.config: imported by the package's __init__ before main() ran, until the public names
# became lazy; grpc: imported while main() builds the parser.
@pytest.mark.parametrize("module", ["nicswitch_agent.config", "grpc"])
def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(tmp_path: Path, module: str) -> None:
    argv = ["switch", "--server", f"127.0.0.1:{free_port()}", "--job", "j", "--node", "node-0", "--dev", "0",
            "--op", "standby"]
    code, out, err = run_stalled(tmp_path, STALL, argv, {"STALL_IMPORT": module},
                                 lambda proc: proc.send_signal(signal.SIGINT), f"{module} was never imported")
    assert code == 130, (code, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


# Python 3.11 wraps what a descriptor's __set_name__ raises in a RuntimeError ("Error calling
# __set_name__"), a KeyboardInterrupt too: an outside check saw Ctrl-C during the command's imports
# (a dataclass's fields) end as that traceback, exit 1. Stalled in one, as in an import of grpc.
STALL_SET_NAME = textwrap.dedent("""
    import os, sys, time

    class Stalls:
        def __set_name__(self, owner, name):
            open(os.environ["STALL_FILE"], "w").close()
            while True:
                time.sleep(0.01)

    class Stall:
        def find_spec(self, name, path=None, target=None):
            if name == os.environ["STALL_IMPORT"]:
                type("Fields", (), {"field": Stalls()})
            return None

    sys.meta_path.insert(0, Stall())
""")


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_set_name_while_the_command_imports_exits_130_without_a_traceback(tmp_path: Path) -> None:
    argv = ["switch", "--server", f"127.0.0.1:{free_port()}", "--job", "j", "--node", "node-0", "--dev", "0",
            "--op", "standby"]
    code, out, err = run_stalled(tmp_path, STALL_SET_NAME, argv, {"STALL_IMPORT": "grpc"},
                                 lambda proc: proc.send_signal(signal.SIGINT), "grpc was never imported")
    assert code == 130, (code, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and out == "", (out, err)


# grpcio starts the thread that serves a channel's streaming calls inside the call's creation
# (grpc/_channel.py, _channel_managed_call_management): stalled there until SIGINT has come, so
# that it lands there every time. In the main thread, as before ops/ctrl_c.py, the call is left
# with no thread to complete it and the client's close() waits for it forever: the command hangs.
STALL_CALL = textwrap.dedent("""
    import os, signal, sys, threading, time
    import grpc._channel as channel

    start_serving_calls = channel._run_channel_spin_thread

    def main_thread_waits():  # in the wait of ops/ctrl_c.py, not still starting the worker
        frame, inner = sys._current_frames().get(threading.main_thread().ident), None
        while frame is not None:
            if frame.f_code.co_name == "call_beside_ctrl_c":
                return inner is not None and inner.f_code.co_name == "wait"
            frame, inner = frame.f_back, frame
        return False

    def stalled(state):
        open(os.environ["STALL_FILE"], "w").close()
        if os.environ.get("SIGINT_HERE"):  # to the thread that creates the call, not the process
            while threading.current_thread() is not threading.main_thread() and not main_thread_waits():
                time.sleep(0.01)  # a SIGINT before the main thread waits is seen by it at once anyway
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        while not os.path.exists(os.environ["GO_FILE"]):
            time.sleep(0.01)
        start_serving_calls(state)

    channel._run_channel_spin_thread = stalled
""")


@pytest.mark.timeout(120)
# to_thread: the kernel gives the process's SIGINT to a thread other than the main one (any that
# does not block it; gRPC's block none), which does not wake a main thread asleep in Event.wait
@pytest.mark.parametrize(("command", "to_thread"), [("switch", False), ("watch", False), ("switch", True)])
def test_ctrl_c_inside_grpcs_call_creation_ends_the_command(tmp_path: Path, command: str, to_thread: bool) -> None:
    """Ctrl-C while the CLI opens its result stream: exit 130 with the command's own line (for
    switch: how to follow the switch, found by an outside check), never a hang in close()."""
    import grpc._channel

    from nicswitch_agent.sim import SimJob, Simulator

    assert callable(getattr(grpc._channel, "_run_channel_spin_thread", None)), "grpcio moved the line this test stalls"
    go = tmp_path / "go"

    def interrupt(proc: Any) -> None:
        if not to_thread:
            proc.send_signal(signal.SIGINT)
        go.touch()

    # The stand-in registers the job and takes the pause, and no agent takes the list: the switch waits
    with Simulator(jobs=[SimJob(job_id="j", nodes={"node-0": ["0"]})], standin=True) as sim:
        argv = [command, "--server", sim.address, "--job", "j"]
        if command == "switch":
            argv += ["--node", "node-0", "--dev", "0", "--op", "standby"]
        code, out, err = run_stalled(tmp_path, STALL_CALL, argv,
                                     {"GO_FILE": str(go), "SIGINT_HERE": "1" if to_thread else ""}, interrupt,
                                     "the stream was never opened")
    assert code == 130, (code, out, err)
    if command == "switch":
        assert "waiting for the result" in out, out
        assert f"interrupted; the switch goes on inside ClusterD; follow it with: nicswitch-agent watch " \
               f"--server {sim.address} --job j" in err, err
    else:
        assert "stopped after 0 result(s)" in err, err
    assert "Traceback" not in err
