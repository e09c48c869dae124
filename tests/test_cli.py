"""The command line as a user runs it: a real subprocess of ``python -m nicswitch_agent``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nicswitch_agent import __version__

pytestmark = pytest.mark.timeout(60)


def run(*args: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nicswitch_agent", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_demo_runs_a_failover_and_a_switchback_and_exits_zero() -> None:
    result = run("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("result: 'switch nic finish'") == 2
    assert out.count("training parked at step") == 2 * 4  # every rank, twice
    assert out.count("ReplySwitchNicResult(true) delivered") == 2
    assert "every rank parked at the same steps: yes" in out
    assert "ranks on standby: 2, 3" in out and "ranks on standby: none" in out
    assert "misuse" not in out
    assert out.rstrip().endswith("demo succeeded")


def test_demo_ranks_on_one_node() -> None:
    """An odd number of ranks is one node; the failover moves the upper half of its devices."""
    result = run("demo", "--ranks", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "1 node x 3 devices = 3 ranks (threads" in out
    assert "failover: move node-0's devices 1 and 2 to their standby NICs" in out
    assert out.count("training parked at step") == 2 * 3
    assert out.count("guard ok") == out.count("switch ok") == 2 * 3
    assert "ranks on standby: 1, 2" in out and "ranks on standby: none" in out
    assert "every rank parked at the same steps: yes" in out
    assert out.rstrip().endswith("demo succeeded")


@pytest.mark.parametrize(("args", "message"), [
    (["--ranks", "0"], "--ranks must be between 1 and 64, got 0"),
    (["--ranks", "17", "--processes"], "--ranks must be between 1 and 16 with --processes, got 17"),
])
def test_demo_usage_errors_exit_2(args: list[str], message: str) -> None:
    result = run("demo", *args)
    assert result.returncode == 2
    assert result.stderr.strip() == f"nicswitch-agent demo: error: {message}"
    assert result.stdout == ""


def test_demo_processes_without_torch_is_a_one_line_error_with_exit_2() -> None:
    # torch hidden from this interpreter: sys.modules["torch"] = None makes find_spec and import fail.
    code = ("import sys; sys.modules['torch'] = None; from nicswitch_agent.ops.cli import main; "
            "sys.exit(main(['demo', '--processes']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("nicswitch-agent demo: error: --processes needs torch")
    assert "python3 -m pip install -c ci/constraints.txt '.[torch]'" in lines[0]  # the pin, not the newest CUDA build
    assert result.stdout == ""


def test_a_bad_setting_in_the_environment_is_a_one_line_error_with_exit_2() -> None:
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo"], capture_output=True, text=True,
                            timeout=45, check=False, env={**os.environ, "NICSWITCH_SWITCH_TIMEOUT_S": "-5"})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("nicswitch-agent demo: error: ") and "NICSWITCH_SWITCH_TIMEOUT_S" in lines[0], lines


def test_version() -> None:
    result = run("version")
    assert result.returncode == 0 and result.stdout.strip() == f"nicswitch-agent {__version__}"


def test_the_version_is_written_in_one_place() -> None:
    """The package's version is ``nicswitch_agent.__version__``: pyproject.toml reads it from there
    (``--version`` and ``version`` print the same attribute), so a release changes one line."""
    pyproject = pytest.importorskip("setuptools.config.pyprojecttoml")
    path = Path(__file__).resolve().parents[1] / "pyproject.toml"
    written = pyproject.read_configuration(path, expand=False)["project"]
    assert "version" not in written and "version" in written["dynamic"]
    assert pyproject.read_configuration(path, expand=True)["project"]["version"] == __version__


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("demo", "sim", "switch", "watch", "version"):
        assert command in result.stdout


def test_no_command_is_a_usage_error() -> None:
    result = run()
    assert result.returncode == 2
    assert "COMMAND" in result.stderr


@pytest.mark.parametrize("argv", [("status", "--file", "{file}"), ("status", "--file", "{file}", "--json"),
                                  ("version",)])
def test_a_closed_pipe_ends_the_command_quietly(argv: tuple[str, ...], tmp_path: Path) -> None:
    """``nicswitch-agent status | head -4`` ended in a BrokenPipeError traceback. The reader here is
    gone before the command writes (the pipe's read end is closed first), so every write fails."""
    from nicswitch_agent.observability.status_file import StatusFileWriter

    path = tmp_path / "status.json"
    status = {"state": "running", "role": "member", "rank": 3, "world_size": 4, "last_step": 7}
    assert StatusFileWriter(path, lambda: status, interval_s=10.0, clock=lambda: 9e12).write_now()  # fresh
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "nicswitch_agent",
                                 *(arg.format(file=path) for arg in argv)],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=45, check=False)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr  # 128 + SIGPIPE, as a shell tool that met a closed pipe
    assert result.stderr == ""


def test_a_ctrl_c_after_the_command_decided_its_result_does_not_change_the_exit_code() -> None:
    """The command's code is its answer (doctor's 1, switch's 6). A SIGINT landing during the
    interpreter's teardown (half a second after doctor imported torch) printed a traceback from an
    exit handler, or killed the process by the signal (doctor: 31 of 32 late Ctrl-Cs). Here an exit
    handler gets the late Ctrl-C after `status` of a missing file decided its 4."""
    code = "\n".join([
        "import atexit, os, signal, sys, time",
        "import nicswitch_agent.ops.cli as cli",
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))",
        "sys.argv = ['nicswitch-agent', 'status', '--file', '/nonexistent/nicswitch-status.json']",
        "sys.exit(cli.console())",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45, check=False)
    assert "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.returncode == 4, (result.returncode, result.stdout, result.stderr)


def test_a_ctrl_c_after_the_reader_went_away_keeps_141() -> None:
    """As above, after ``| head`` left: the 141 is decided too (found by an outside check: a late
    Ctrl-C killed the process by the signal instead)."""
    code = "\n".join([
        "import atexit, os, signal, sys, time",
        "import nicswitch_agent.ops.cli as cli",
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))",
        "sys.argv = ['nicswitch-agent', 'version']",
        "sys.exit(cli.console())",
    ])
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=45, check=False)
    finally:
        os.close(write_end)
    assert "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.returncode == 141, (result.returncode, result.stderr)
