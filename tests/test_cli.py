"""The command line as a user runs it: a real subprocess of ``python -m nicswitch_agent``."""

from __future__ import annotations

import subprocess
import sys

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


def test_version() -> None:
    result = run("version")
    assert result.returncode == 0 and result.stdout.strip() == f"nicswitch-agent {__version__}"


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("demo", "sim", "switch", "watch", "version"):
        assert command in result.stdout


def test_no_command_is_a_usage_error() -> None:
    result = run()
    assert result.returncode == 2
    assert "COMMAND" in result.stderr
