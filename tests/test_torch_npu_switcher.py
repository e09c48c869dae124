"""TorchNpuSwitcher against a fake ``torch_npu.npu``; torch is never imported by the agent's core."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from nicswitch_agent import ConfigError, SwitchAgent, SwitchOrder, TorchNpuSwitcher
from nicswitch_agent.hooks.torch_npu import hccl_retry_enables_l2

L2_ON = "L0:0, L1:1, L2:1"


class FakeSwitchNic:
    """Stands in for ``torch_npu.npu._comm_switch_nic``: records calls, answers ``result``."""

    def __init__(self, result: Any = True) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.result = result

    def __call__(self, ranks: Any, useBackup: Any) -> Any:
        self.calls.append((ranks, useBackup))
        return self.result


def install_fake(monkeypatch: pytest.MonkeyPatch, fn: Any = None, *, with_function: bool = True) -> types.ModuleType:
    package = types.ModuleType("torch_npu")
    npu = types.ModuleType("torch_npu.npu")
    if with_function:
        npu._comm_switch_nic = fn if fn is not None else FakeSwitchNic()  # type: ignore[attr-defined]
    package.npu = npu  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", package)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", npu)
    return npu


def make_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import fail whether or not torch_npu is installed here.
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", None)


def order(ranks: tuple[int, ...], ops: tuple[bool, ...]) -> SwitchOrder:
    return SwitchOrder(seq=1, job_id="job-1", ranks=ranks, ops=ops)


# -- the call --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "ops"),
    [((16, 0, 31), (True, False, True)), ((3,), (False,)), ((7, 6, 5, 4), (True, True, False, False)), ((), ())],
)
def test_passes_the_full_lists_in_order(monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...],
                                        ops: tuple[bool, ...]) -> None:
    fake = FakeSwitchNic(True)
    install_fake(monkeypatch, fake)
    assert TorchNpuSwitcher()(order(ranks, ops)) is True
    assert len(fake.calls) == 1
    got_ranks, got_ops = fake.calls[0]
    assert type(got_ranks) is list and type(got_ops) is list
    assert got_ranks == list(ranks)
    assert got_ops == list(ops)
    assert all(type(r) is int for r in got_ranks)
    assert all(type(op) is bool for op in got_ops)


@pytest.mark.parametrize(("answer", "expected"), [(True, True), (False, False), (1, True), (0, False)])
def test_result_mapped_to_bool(monkeypatch: pytest.MonkeyPatch, answer: Any, expected: bool) -> None:
    install_fake(monkeypatch, FakeSwitchNic(answer))
    assert TorchNpuSwitcher()(order((1, 2), (True, True))) is expected


def test_each_call_gets_fresh_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    # A callee that mutates its arguments must not reach back into the (shared, frozen) order.
    def mutating(ranks: list[int], useBackup: list[bool]) -> bool:
        ranks.append(99)
        useBackup.clear()
        return True

    install_fake(monkeypatch, mutating)
    o = order((1, 2), (True, False))
    switcher = TorchNpuSwitcher()
    assert switcher(o) is True
    assert (o.ranks, o.ops) == ((1, 2), (True, False))


def test_exception_from_torch_npu_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    # The executor turns a raising hook into a false reply; the switcher itself must not hide it.
    def boom(ranks: list[int], useBackup: list[bool]) -> bool:
        raise RuntimeError("HCCL error 7")

    install_fake(monkeypatch, boom)
    with pytest.raises(RuntimeError, match="HCCL error 7"):
        TorchNpuSwitcher()(order((0,), (True,)))


# -- readiness -------------------------------------------------------------------------------------


def test_missing_module_is_a_config_error_at_check(monkeypatch: pytest.MonkeyPatch) -> None:
    make_missing(monkeypatch)
    switcher = TorchNpuSwitcher()  # constructing it needs nothing
    with pytest.raises(ConfigError) as info:
        switcher.check()
    message = str(info.value)
    assert "torch_npu.npu" in message
    assert "pip install torch-npu" in message
    assert "switch_hook=" in message
    assert "dry_run=True" in message
    assert isinstance(info.value.__cause__, ImportError)


def test_missing_module_is_a_config_error_at_call_too(monkeypatch: pytest.MonkeyPatch) -> None:
    make_missing(monkeypatch)
    with pytest.raises(ConfigError, match="pip install torch-npu"):
        TorchNpuSwitcher()(order((0,), (True,)))


@pytest.mark.parametrize("value", ["missing", None, 42])
def test_module_without_the_function(monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    npu = install_fake(monkeypatch, with_function=False)
    if value != "missing":
        npu._comm_switch_nic = value  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        TorchNpuSwitcher().check()
    message = str(info.value)
    assert "torch_npu.npu._comm_switch_nic is missing" in message
    assert "upgrade torch_npu" in message
    assert "switch_hook=" in message


def test_check_resolves_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_OP_RETRY_ENABLE", L2_ON)
    fake = FakeSwitchNic(True)
    install_fake(monkeypatch, fake)
    switcher = TorchNpuSwitcher()
    switcher.check()
    make_missing(monkeypatch)  # already resolved: later calls use the function found at check()
    assert switcher(order((5,), (False,))) is True
    assert fake.calls == [([5], [False])]


# -- HCCL_OP_RETRY_ENABLE -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("L0:0, L1:1, L2:1", True),
        ("L0:0,L1:1,L2:1", True),
        ("L2:1", True),
        ("l2:1", True),
        ("  L0:0 ,  l2 : 1  ", True),
        ("L2:1, L1:0", True),
        ("L2:0", False),
        ("L0:0, L1:1, L2:0", False),
        ("L1:1", False),
        ("L0:1, L1:1", False),
        ("", False),
        (None, False),
        ("L2", False),
        ("L2:", False),
        ("L2:true", False),
        ("L2:2", False),
        ("L12:1", False),
    ],
)
def test_hccl_retry_enables_l2(value: str | None, expected: bool) -> None:
    assert hccl_retry_enables_l2(value) is expected


@pytest.mark.parametrize("value", [None, "", "L0:0, L1:1, L2:0", "L1:1"])
def test_check_warns_when_l2_is_off(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                    value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("HCCL_OP_RETRY_ENABLE", raising=False)
    else:
        monkeypatch.setenv("HCCL_OP_RETRY_ENABLE", value)
    install_fake(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nicswitch_agent.hooks"):
        TorchNpuSwitcher().check()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "nicswitch_agent.hooks"]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert f"HCCL_OP_RETRY_ENABLE={value!r}" in text
    assert "L2" in text
    assert L2_ON in text


def test_check_is_quiet_when_l2_is_on(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HCCL_OP_RETRY_ENABLE", L2_ON)
    install_fake(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nicswitch_agent.hooks"):
        TorchNpuSwitcher().check()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- the agent's default hook --------------------------------------------------------------------


@pytest.mark.timeout(15)
def test_agent_without_hook_or_torch_npu_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    make_missing(monkeypatch)
    agent = SwitchAgent(server="127.0.0.1:1", job_id="job-1")  # construction does not need torch_npu
    try:
        with pytest.raises(ConfigError, match="pip install torch-npu"):
            agent.start()
        assert agent.status()["state"] == "created"  # nothing was started
    finally:
        agent.stop("test done")
    assert agent.status()["state"] == "stopped"


@pytest.mark.timeout(30)
def test_importing_the_package_imports_no_torch(tmp_path: Path) -> None:
    # Importable stand-ins for torch and torch_npu: an import of either, even a guarded one, would
    # leave it in sys.modules, whether or not the real packages are installed here.
    for name in ("torch", "torch_npu"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = (
        "import sys, nicswitch_agent, nicswitch_agent.hooks.torch_npu\n"
        "from nicswitch_agent import SwitchAgent, TorchNpuSwitcher\n"
        "TorchNpuSwitcher()\n"
        "SwitchAgent(server='127.0.0.1:1', job_id='j')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_npu'))\n"
        "assert not loaded, loaded\n"
        "import torch, torch_npu\n"  # the stand-ins were there to be found
        "assert torch.__file__.startswith(sys.argv[1]) and torch_npu.__file__.startswith(sys.argv[1])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                            timeout=25, check=False, env=env)
    assert result.returncode == 0, result.stderr
