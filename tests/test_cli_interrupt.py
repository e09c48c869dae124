"""Ctrl-C while ``nicswitch-agent`` is still importing: exit 130, one quiet line at most, no traceback.

The command is a real process. A ``sitecustomize`` on its PYTHONPATH stalls the import of one
module (it says so in a file, then waits), so SIGINT lands inside that import, every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

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


@pytest.mark.timeout(120)
# nicswitch_agent.config: imported by the package's __init__ before main() ran, until the public names
# became lazy; grpc: imported while main() builds the parser.
@pytest.mark.parametrize("module", ["nicswitch_agent.config", "grpc"])
def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(tmp_path: Path, module: str) -> None:
    (tmp_path / "sitecustomize.py").write_text(STALL)
    stalled = tmp_path / "stalled"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "STALL_IMPORT": module, "STALL_FILE": str(stalled)}
    argv = [sys.executable, "-m", "nicswitch_agent", "switch", "--server", f"127.0.0.1:{free_port()}",
            "--job", "j", "--node", "node-0", "--dev", "0", "--op", "standby"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        assert poll(lambda: stalled.exists() or proc.poll() is not None, 60), f"{module} was never imported"
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.timeout(120)
def test_ctrl_c_while_switch_waits_for_its_result_says_how_to_follow_it(tmp_path: Path) -> None:
    """The switch goes on inside ClusterD: the line says how to follow it, as --no-wait's does
    (found by an outside check: only "interrupted; the switch goes on inside ClusterD")."""
    from nicswitch_agent.sim import SimJob, Simulator

    # The stand-in registers the job and takes the pause, and no agent takes the list: the switch waits
    with Simulator(jobs=[SimJob(job_id="j", nodes={"node-0": ["0"]})], standin=True) as sim:
        argv = [sys.executable, "-m", "nicswitch_agent", "switch", "--server", sim.address, "--job", "j",
                "--node", "node-0", "--dev", "0", "--op", "standby"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_sigint)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        reader.start()
        try:
            assert poll(lambda: any("waiting for the result" in line for line in lines) or proc.poll() is not None,
                        60)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            err = proc.stderr.read() if proc.stderr is not None else ""
            reader.join(10)
            out = "".join(lines)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert f"interrupted; the switch goes on inside ClusterD; follow it with: nicswitch-agent watch --server " \
           f"{sim.address} --job j" in err, err
    assert "Traceback" not in err
