"""gRPC is made safe for forks before it is first imported, without overriding the user's choice.

Each case runs in a fresh interpreter, because grpc reads GRPC_ENABLE_FORK_SUPPORT once, when it
is first imported. What the setting does for forked DataLoader workers is tested in test_fork.py
(grpc's own fork log lines are rate-limited and no proof either way).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WARNING_PREFIX = "WARNING nicswitch_agent "


def script(*parts: str) -> str:
    return "\n".join(textwrap.dedent(part) for part in parts)


def run(code: str, **env_changes: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPC_", "NICSWITCH_"))}
    env["PYTHONPATH"] = str(ROOT / "src")
    for name, value in env_changes.items():
        if value is not None:
            env[name] = value
    prelude = ("import logging, os, sys\n"
               "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s %(message)s')\n")
    return subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def agent_warnings(stderr: str) -> list[str]:
    # From the prefix on: grpc writes some complaints (GRPC_ENABLE_FORK_SUPPORT='off') without a newline.
    return [line[line.index(WARNING_PREFIX):] for line in stderr.splitlines() if WARNING_PREFIX in line]


def test_importing_the_package_sets_grpcs_fork_support_off_before_grpc_loads() -> None:
    result = run(script("""
        import nicswitch_agent
        assert "grpc" not in sys.modules  # members never import grpc; the setting costs them nothing
        print(os.environ["GRPC_ENABLE_FORK_SUPPORT"])
        from nicswitch_agent.clusterd import channel as transport
    """))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["false"]
    assert agent_warnings(result.stderr) == []


def test_any_module_of_the_package_is_covered() -> None:
    # Python imports the package's __init__ before any of its modules, so none can load grpc first.
    result = run(script("""
        import nicswitch_agent.sim.server
        print(os.environ["GRPC_ENABLE_FORK_SUPPORT"])
    """))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["false"]


@pytest.mark.parametrize("value", ["false", "0", "False", "no"])
def test_a_false_value_the_user_set_is_kept_without_a_warning(value: str) -> None:
    result = run(script("""
        import nicswitch_agent
        print(os.environ["GRPC_ENABLE_FORK_SUPPORT"])
        from nicswitch_agent.clusterd import channel as transport
    """), GRPC_ENABLE_FORK_SUPPORT=value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [value]
    assert agent_warnings(result.stderr) == []


@pytest.mark.parametrize("value", ["true", "1", "off"])
def test_any_other_value_the_user_set_is_kept_with_one_warning_when_grpc_loads(value: str) -> None:
    result = run(script("""
        import nicswitch_agent
        print(os.environ["GRPC_ENABLE_FORK_SUPPORT"])
        from nicswitch_agent.clusterd import channel as transport
        import nicswitch_agent.clusterd.notify, nicswitch_agent.clusterd.reply  # more grpc modules: still one warning
    """), GRPC_ENABLE_FORK_SUPPORT=value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [value]
    assert agent_warnings(result.stderr) == [
        f"{WARNING_PREFIX}GRPC_ENABLE_FORK_SUPPORT={value!r} was set, which leaves gRPC's fork handlers on: "
        "forked DataLoader workers may die or hang beside the agent's streams. Set GRPC_ENABLE_FORK_SUPPORT=false, "
        "or use multiprocessing_context='spawn' (docs/operations.md, Fork and DataLoader workers)"
    ]


def test_grpc_imported_before_the_package_gets_one_warning_at_leader_start() -> None:
    result = run(script("""
        import grpc  # e.g. another library, imported first
        from nicswitch_agent import SwitchAgent
        assert "GRPC_ENABLE_FORK_SUPPORT" not in os.environ  # too late to matter here: left alone
        for _ in range(2):
            agent = SwitchAgent(server="127.0.0.1:1", job_id="job", dry_run=True, handle_signals=False).start()
            agent.stop()
    """))
    assert result.returncode == 0, result.stderr
    assert agent_warnings(result.stderr) == [
        f"{WARNING_PREFIX}grpc was imported before nicswitch_agent with GRPC_ENABLE_FORK_SUPPORT unset, so gRPC's "
        "fork handlers are on: forked DataLoader workers may die or hang beside the agent's streams. Set "
        "GRPC_ENABLE_FORK_SUPPORT=false in the environment, or import nicswitch_agent before anything that "
        "imports grpc (docs/operations.md, Fork and DataLoader workers)"
    ]


def test_child_processes_inherit_the_safe_setting() -> None:
    result = run(script("""
        import subprocess
        import nicswitch_agent
        code = "import os; print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))"
        print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    """))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["false"]
