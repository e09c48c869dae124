"""TorchNpuSwitcher against a fake ``torch_npu``; torch is never imported by the agent's core.

Two fakes: :func:`install_fake` has only ``torch_npu.npu._comm_switch_nic`` (an older or stripped
torch_npu: the process groups are then unknown), and :class:`FakeNpu` mirrors what the real
torch_npu does around a switch (read in its source): ``_comm_switch_nic`` synchronizes, reads
``RANK``, walks ``dist_c10d._pg_map`` and calls each NPU group's ``_set_switch_nic_comm``, which
answers True without switching anything for a group with no communicator on this device, False
for a communicator that never ran a collective (HCCL_E_PARA), and True without moving anything
when HCCL's backup link is off (L2 op retry).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from nicswitch_agent import ConfigError, SwitchAgent, SwitchOrder, TorchNpuSwitcher
from nicswitch_agent.coordination import KIND_SWITCH, KV, Coordinator, InProcessStore, Member, MemberHooks
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.hook_runner import HookRunner, HookStatus, execute_order
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.hooks.base import hook_record
from nicswitch_agent.hooks.torch_npu import hccl_retry_enables_l2

L2_ON = "L0:0, L1:1, L2:1"


@pytest.fixture(autouse=True)
def hccl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of a torchrun job with L2 retry on; P2P and connect timeout at HCCL's defaults."""
    monkeypatch.setenv("HCCL_OP_RETRY_ENABLE", L2_ON)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("P2P_HCCL_BUFFSIZE", raising=False)
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)


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
    monkeypatch.setitem(sys.modules, "torch_npu.distributed", None)  # this one has no process-group registry
    monkeypatch.setitem(sys.modules, "torch_npu.distributed.distributed_c10d", None)
    return npu


def make_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import fail whether or not torch_npu is installed here.
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", None)


def order(ranks: tuple[int, ...], ops: tuple[bool, ...], seq: int = 1) -> SwitchOrder:
    return SwitchOrder(seq=seq, job_id="job-1", ranks=ranks, ops=ops)


# -- a torch_npu that behaves like the real one around a switch -----------------------------------


class Device:
    def __init__(self, kind: str) -> None:
        self.type = kind


class Done:
    def wait(self) -> bool:
        return True


class HcclBackend:
    """ProcessGroupHCCL as far as a switch sees it: a lazily created communicator and its collectives."""

    def __init__(self, npu: FakeNpu, name: str, ranks: tuple[int, ...], communicator: bool, collectives: int) -> None:
        self.npu, self.name, self.ranks = npu, name, ranks
        self.communicator, self.collectives = communicator, collectives

    def get_hccl_comm_name(self, rankid: int, init_comm: bool = True) -> str:
        if not self.communicator:
            if not init_comm:
                return ""
            self.communicator = True  # the real one creates it here
        return f"hccl_world_{self.name}"

    def _get_sequence_number_for_group(self) -> int:
        return self.collectives

    def barrier(self) -> Done:  # an all-reduce of one float: creates the communicator if needed, counts
        self.npu.log.append(("barrier", self.name))
        self.communicator = True
        self.collectives += 1
        return Done()

    def _set_switch_nic_comm(self, rankid: int, nRanks: int, ranks: list[int], useBackup: list[bool]) -> bool:
        self.npu.log.append(("switch", self.name))
        if not self.communicator:
            return True  # nothing under this device's key: "success", nothing switched
        if not set(ranks) & set(self.ranks):
            return True  # no listed rank in the group: HCCL is not called
        if self.collectives == 0:
            return False  # HCCL_E_PARA: a communicator that never ran a collective
        if self.name in self.npu.refuse:
            return False
        if hccl_retry_enables_l2(os.environ.get("HCCL_OP_RETRY_ENABLE")):
            self.npu.moved.append(self.name)  # else HCCL answers SUCCESS with a warning, moving nothing
        return True


class ProcessGroup:
    def __init__(self, backend: HcclBackend, kind: str) -> None:
        self._device_types = [Device(kind)]
        self._backend = backend

    def _get_backend(self, device: Device) -> HcclBackend:
        assert device.type == "npu", "asked a non-NPU group for its NPU backend"
        return self._backend


class FakeNpu:
    """``torch_npu`` with ``npu._comm_switch_nic`` and ``distributed.distributed_c10d``, in sys.modules."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, str]] = []  # ("barrier" | "switch" | "sync", group)
        self.moved: list[str] = []  # groups whose links HCCL really moved
        self.refuse: set[str] = set()
        self.gate: threading.Event | None = None  # set: the switch blocks until it is set
        self.entered = threading.Event()
        registry = types.SimpleNamespace(_pg_map={}, _pg_names={}, get_process_group_ranks=self._ranks)
        self.registry = registry
        package = types.ModuleType("torch_npu")
        npu = types.ModuleType("torch_npu.npu")
        distributed = types.ModuleType("torch_npu.distributed")
        c10d = types.ModuleType("torch_npu.distributed.distributed_c10d")
        c10d.dist_c10d = registry  # type: ignore[attr-defined]
        c10d._comm_switch_nic = self._c10d_switch  # type: ignore[attr-defined]
        npu._comm_switch_nic = self._npu_switch  # type: ignore[attr-defined]
        package.npu, package.distributed, distributed.distributed_c10d = npu, distributed, c10d  # type: ignore[attr-defined]
        for name, module in (("torch_npu", package), ("torch_npu.npu", npu), ("torch_npu.distributed", distributed),
                             ("torch_npu.distributed.distributed_c10d", c10d)):
            monkeypatch.setitem(sys.modules, name, module)

    def group(self, name: str, ranks: tuple[int, ...], *, communicator: bool = True, collectives: int = 10,
              kind: str = "npu") -> HcclBackend:
        backend = HcclBackend(self, name, ranks, communicator, collectives)
        pg = ProcessGroup(backend, kind)
        self.registry._pg_map[pg] = ("hccl", None)
        self.registry._pg_names[pg] = name
        return backend

    def _ranks(self, pg: ProcessGroup) -> list[int]:
        return list(pg._backend.ranks)

    def _npu_switch(self, ranks: list[int], useBackup: list[bool]) -> bool:  # torch_npu.npu._comm_switch_nic
        self.log.append(("sync", ""))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        return bool(self._c10d_switch(ranks, useBackup))

    def _c10d_switch(self, ranks: list[int], useBackup: list[bool]) -> bool:
        rankid = int(os.environ["RANK"])
        result = True
        for pg in self.registry._pg_map:
            npu = any(d.type == "npu" for d in pg._device_types)
            if npu and not pg._get_backend(Device("npu"))._set_switch_nic_comm(rankid, len(ranks), ranks, useBackup):
                result = False
        return result


def statuses(switcher: TorchNpuSwitcher) -> dict[str, str]:
    record = switcher.last_record()
    assert record is not None and record.groups is not None
    return {g.name: g.status for g in record.groups}


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
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "nicswitch_agent.hooks" and "HCCL_OP_RETRY_ENABLE" in r.getMessage()]
    assert len(warnings) == 1
    text = warnings[0]
    assert ("HCCL_OP_RETRY_ENABLE unset" if value is None else f"HCCL_OP_RETRY_ENABLE={value!r}") in text
    assert "does not enable L2" in text
    assert L2_ON in text


def test_check_is_quiet_when_everything_is_switched(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("P2P_HCCL_BUFFSIZE", "0")
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "120")
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1))
    with caplog.at_level(logging.INFO, logger="nicswitch_agent.hooks"):
        TorchNpuSwitcher(switch_timeout_s=300).check()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert npu.log == []  # looking switches nothing, warms nothing


# -- what start() says --------------------------------------------------------------------------------


def start_log(caplog: pytest.LogCaptureFixture, switcher: TorchNpuSwitcher) -> tuple[str, list[str]]:
    """(the one INFO line, the WARNING lines) of ``switcher.check()``."""
    with caplog.at_level(logging.INFO, logger="nicswitch_agent.hooks"):
        switcher.check()
    records = [r for r in caplog.records if r.name == "nicswitch_agent.hooks"]
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(info) == 1, info
    return info[0], [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_start_names_the_groups_and_their_communicators(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1, 2, 3), collectives=12)
    npu.group("tp", (0, 1), communicator=False, collectives=0)
    npu.group("eager", (0, 2), collectives=0)
    npu.group("cpu", (0, 1), kind="cpu")  # a gloo group: torch_npu does not switch it
    info, _ = start_log(caplog, TorchNpuSwitcher())
    assert ("NPU process groups now: 0 (4 ranks, communicator, 12 collective(s) run), tp (2 ranks, no "
            "communicator yet), eager (2 ranks, communicator, 0 collective(s) run)") in info
    assert "cpu" not in info


def test_start_warns_that_p2p_communicators_are_not_switched(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    FakeNpu(monkeypatch).group("0", (0, 1))
    _, warnings = start_log(caplog, TorchNpuSwitcher())
    p2p = [w for w in warnings if "P2P_HCCL_BUFFSIZE" in w]
    assert len(p2p) == 1
    assert "P2P_HCCL_BUFFSIZE unset (20 MB)" in p2p[0] and "does not visit" in p2p[0]
    assert "set P2P_HCCL_BUFFSIZE=0" in p2p[0]


def test_start_warns_when_the_worst_case_outlasts_the_waits(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("P2P_HCCL_BUFFSIZE", "0")
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1))
    npu.group("tp", (0, 1))
    npu.group("pp", (0, 2), communicator=False)  # switches nothing, so it blocks nothing
    info, warnings = start_log(caplog, TorchNpuSwitcher(switch_timeout_s=120))
    assert len(warnings) == 1
    text = warnings[0]
    assert "worst case 2 group(s) x 2.5 x 300 s (HCCL_CONNECT_TIMEOUT unset) = 1500 s" in text
    assert "above switch_timeout_s=120 s" in text and "above ClusterD's 900 s wait" in text
    assert "lower HCCL_CONNECT_TIMEOUT to 180 s" in text
    assert text in info  # the same finding is in the start line


@pytest.mark.parametrize("value", [0, -1.5, "120", True, float("nan")])
def test_a_bad_switch_timeout_is_refused_at_construction(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"TorchNpuSwitcher\(switch_timeout_s=.*\): must be a positive number"):
        TorchNpuSwitcher(switch_timeout_s=value)


def test_start_within_the_waits_says_so(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "120")
    FakeNpu(monkeypatch).group("0", (0, 1))
    info, warnings = start_log(caplog, TorchNpuSwitcher(switch_timeout_s=300))
    assert not [w for w in warnings if "worst case" in w]
    assert ("worst case 1 group(s) x 2.5 x 120 s (HCCL_CONNECT_TIMEOUT=120) = 300 s, within switch_timeout_s=300 s "
            "and ClusterD's 900 s") in info


def test_start_without_rank_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("RANK")
    FakeNpu(monkeypatch).group("0", (0, 1))
    info, warnings = start_log(caplog, TorchNpuSwitcher())
    assert any("RANK=None is not a rank" in w and "torchrun" in w for w in warnings), warnings
    assert "process groups not listed (no RANK)" in info


def test_start_with_a_torch_npu_without_the_registry(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    install_fake(monkeypatch)
    info, _ = start_log(caplog, TorchNpuSwitcher())
    assert "process groups cannot be listed: cannot import torch_npu.distributed.distributed_c10d" in info


def test_the_agent_gives_its_switch_timeout_to_the_default_switcher(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    FakeNpu(monkeypatch).group("0", (0, 1))
    agent = SwitchAgent(server="127.0.0.1:1", job_id="job-1", switch_timeout_s=7)
    try:
        hook = agent._switch_hook
        assert isinstance(hook, TorchNpuSwitcher)
        _, warnings = start_log(caplog, hook)
    finally:
        agent.stop("test done")
    assert any("above switch_timeout_s=7 s" in w for w in warnings), warnings


# -- around a switch: warm up, record, answer ------------------------------------------------------


def test_a_true_from_torch_npu_for_a_group_without_communicator_is_reported_not_switched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1, 2, 3))
    npu.group("tp", (0, 1), communicator=False, collectives=0)
    switcher = TorchNpuSwitcher()
    assert switcher(order((1,), (True,))) is True
    assert npu.moved == ["0"]
    assert ("barrier", "tp") not in npu.log  # not warmed: it carries no traffic
    assert statuses(switcher) == {"0": "switched", "tp": "no_communicator"}
    groups = switcher.last_record().to_dict()["groups"]  # type: ignore[union-attr]
    assert groups[1]["switched"] is False and groups[1]["warmed"] is False
    assert "first collective builds its links on the default NIC" in groups[1]["why"]


def test_a_communicator_that_never_ran_a_collective_is_warmed_then_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1, 2, 3))
    npu.group("eager", (0, 1), collectives=0)
    npu.group("eager2", (0, 2), collectives=0)
    switcher = TorchNpuSwitcher()
    assert switcher(order((0, 1, 2), (True, True, True))) is True
    assert npu.log[:3] == [("barrier", "eager"), ("barrier", "eager2"), ("sync", "")]  # in creation order, before
    assert npu.moved == ["0", "eager", "eager2"]
    record = switcher.last_record()
    assert record is not None and record.groups is not None
    assert [(g.name, g.warmed, g.switched) for g in record.groups] == [
        ("0", False, True), ("eager", True, True), ("eager2", True, True)]


def test_without_warm_up_the_fake_refuses_like_hccl(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fake's refusal is what the warm-up avoids: called bare, it answers False (HCCL_E_PARA).
    npu = FakeNpu(monkeypatch)
    npu.group("eager", (0, 1), collectives=0)
    import torch_npu.npu  # type: ignore[import-not-found]  # the fake

    assert torch_npu.npu._comm_switch_nic([1], [True]) is False
    assert npu.moved == []


def test_l2_off_answers_false_although_torch_npu_says_true(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HCCL_OP_RETRY_ENABLE", "L0:0, L1:1, L2:0")
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1))
    npu.group("tp", (0, 1), communicator=False)
    switcher = TorchNpuSwitcher()
    with caplog.at_level(logging.WARNING, logger="nicswitch_agent.hooks"):
        assert switcher(order((1,), (True,))) is False
    assert npu.moved == []
    record = switcher.last_record()
    assert record is not None and record.torch_npu_result is True and record.ok is False and not record.l2_retry
    assert statuses(switcher) == {"0": "backup_disabled", "tp": "no_communicator"}
    assert any("answering False: HCCL moved nothing" in r.getMessage() for r in caplog.records)


def test_l2_off_with_unknown_groups_answers_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HCCL_OP_RETRY_ENABLE")
    install_fake(monkeypatch, FakeSwitchNic(True))
    switcher = TorchNpuSwitcher()
    assert switcher(order((1,), (True,))) is False
    record = switcher.last_record()
    assert record is not None and record.groups is None and "distributed_c10d" in record.note


def test_l2_off_with_no_communicator_anywhere_moved_nothing_it_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HCCL_OP_RETRY_ENABLE")
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1), communicator=False)
    npu.group("other", (2, 3))  # no listed rank in it: HCCL is not called for it
    switcher = TorchNpuSwitcher()
    assert switcher(order((1,), (True,))) is True
    assert statuses(switcher) == {"0": "no_communicator", "other": "not_listed"}


def test_a_registry_shaped_otherwise_leaves_the_groups_unknown_not_the_switch_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1))
    npu.registry._pg_names = ["0"]  # a list, not a dict: only the agent's reading reads it
    switcher = TorchNpuSwitcher()
    assert switcher(order((1,), (True,))) is True
    record = switcher.last_record()
    assert record is not None and record.groups is None
    assert record.note.startswith("reading the process groups failed (AttributeError")


def test_a_refusal_is_false_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1))
    npu.group("tp", (0, 1))
    npu.refuse.add("tp")
    switcher = TorchNpuSwitcher()
    assert switcher(order((1,), (True,))) is False
    assert statuses(switcher) == {"0": "refused", "tp": "refused"}  # one bool for all: which one is not told


@pytest.mark.parametrize(("value", "mb", "visited"), [(None, 20, False), ("64", 64, False), ("0", 0, True)])
def test_p2p_communicators_are_recorded(monkeypatch: pytest.MonkeyPatch, value: str | None, mb: int,
                                        visited: bool) -> None:
    if value is not None:
        monkeypatch.setenv("P2P_HCCL_BUFFSIZE", value)
    FakeNpu(monkeypatch).group("0", (0, 1))
    switcher = TorchNpuSwitcher()
    assert switcher(order((1,), (True,))) is True
    record = switcher.last_record()
    assert record is not None and record.p2p_buffsize_mb == mb
    p2p = record.to_dict()["groups"][0]["p2p"]
    assert p2p.startswith("switched with the group") if visited else p2p.startswith("not visited")
    assert f"P2P_HCCL_BUFFSIZE={mb}" in p2p


def test_the_record_is_plain_data(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNpu(monkeypatch).group("0", (0, 1))
    switcher = TorchNpuSwitcher()
    assert switcher.last_record() is None and hook_record(switcher) is None
    switcher(order((0, 1), (True, False), seq=9))
    detail = hook_record(switcher)
    assert detail is not None
    assert p.MemberResult.decode(p.MemberResult(0, True, "switched", detail=detail).encode()).detail == detail
    assert detail["seq"] == 9 and detail["ok"] is True and detail["torch_npu_result"] is True
    assert detail["groups"] == [{"name": "0", "ranks": [0, 1], "status": "switched", "switched": True,
                                 "warmed": False, "p2p": detail["groups"][0]["p2p"],
                                 "why": detail["groups"][0]["why"]}]


@pytest.mark.timeout(15)
def test_a_switch_that_takes_long_is_a_false_result_within_the_hook_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0, 1))
    switcher = TorchNpuSwitcher()
    switcher(order((1,), (True,), seq=1))
    npu.gate = threading.Event()
    runner = HookRunner()
    try:
        execution = execute_order(order((1,), (True,), seq=2), runner=runner, switch_hook=switcher,
                                  checkpoint_hook=None, guard_timeout_s=1, switch_timeout_s=0.05, dry_run=False)
        assert execution.ok is False and execution.switch is not None
        assert execution.switch.status is HookStatus.TIMEOUT
        assert npu.entered.is_set()  # it was inside torch_npu when the budget ran out
        assert switcher.last_record() is None  # the first call's record is not this call's
        assert runner.busy() == "switch of order #2"
    finally:
        npu.gate.set()
    straggler = runner._straggler
    assert straggler is not None
    straggler.join(10)
    record = switcher.last_record()
    assert record is not None and record.seq == 2


@pytest.mark.timeout(60)
def test_the_registry_is_read_as_torch_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's real process-group registry (what torch_npu's dist_c10d is), with a gloo group standing
    in for an NPU one: the attribute paths, the collective count and the warm-up barrier are torch's own."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    from nicswitch_agent.hooks import npu_groups

    c10d = types.ModuleType("torch_npu.distributed.distributed_c10d")
    c10d.dist_c10d = dist.distributed_c10d  # type: ignore[attr-defined]  # as torch_npu imports it
    monkeypatch.setitem(sys.modules, "torch_npu.distributed.distributed_c10d", c10d)
    monkeypatch.setattr(npu_groups, "DEVICE_TYPE", "cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.new_group([0])
        first = npu_groups.list_npu_groups(0)
        assert [(g.name, g.ranks, g.collectives) for g in first] == [("0", (0,), 0), ("1", (0,), 0)]
        assert all(g.has_communicator is None for g in first)  # gloo has no HCCL communicator to ask about
        dist.all_reduce(torch.ones(1))
        npu_groups.warm_up(first[1])
        assert [g.collectives for g in npu_groups.list_npu_groups(0)] == [1, 1]
    finally:
        dist.destroy_process_group()


# -- the record reaches the member's result ------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_member_result_carries_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpu(monkeypatch)
    npu.group("0", (0,))
    npu.group("tp", (0,), communicator=False)
    store = InProcessStore()
    lot = ParkingLot()  # never parked: the member runs the hooks on its own thread (pause mode external)
    member = Member(KV(store, "t"), 0, lot, MemberHooks(switch_hook=TorchNpuSwitcher(), checkpoint_hook=None,
                                                       guard_timeout_s=5, switch_timeout_s=5, dry_run=False),
                    lambda: 0, stop_timeout_s=5)
    coordinator = Coordinator(KV(store, "t"), 1)
    member.start()
    try:
        outcome = coordinator.run(order((0,), (True,), seq=3), kind=KIND_SWITCH, budget_s=10)
        assert outcome.ok, outcome.reason
        epoch = coordinator.epoch
        results = list(p.arriving_results(KV(store, "t"), epoch, f"{epoch}.3.{KIND_SWITCH}", 1, float("inf")))
    finally:
        member.stop()
    assert len(results) == 1
    detail = results[0].detail
    assert detail is not None and detail["seq"] == 3
    assert [(g["name"], g["status"]) for g in detail["groups"]] == [("0", "switched"), ("tp", "no_communicator")]


def test_a_result_without_record_keeps_the_old_wire_form() -> None:
    text = p.MemberResult(2, True, "switched", attempted=True).encode()
    assert "detail" not in p.decode(text)
    old = p.encode({"t": "r", "rank": 2, "ok": True, "reason": "switched", "attempted": True, "guard": False})
    assert p.MemberResult.decode(old) == p.MemberResult(2, True, "switched", attempted=True)


def test_a_hook_whose_record_fails_keeps_its_result(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def __call__(self, order: SwitchOrder) -> bool:
            return True

        def last_record(self) -> Any:
            raise RuntimeError("record lost")

    with caplog.at_level(logging.ERROR, logger="nicswitch_agent.hooks"):
        assert hook_record(Broken()) is None
    assert "last_record() failed" in caplog.text
    assert hook_record(lambda order: True) is None


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
