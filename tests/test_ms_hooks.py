"""MindSpore's hooks and callback: MindSporeSwitcher, MindSporeCheckpointGuard, NicSwitchMindSporeCallback.

Real MindSpore 2.10 (CPU): ``mindspore.save_checkpoint``, ``Model.train`` with the callback against
the simulator. Run in CI's MindSpore step; skipped without MindSpore.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from support import operator_switch

from nicswitch_agent import AgentConfig, SwitchAgent, SwitchOrder
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks import (
    MindSporeCheckpointGuard,
    MindSporeSwitcher,
    TorchNpuSwitcher,
    default_switch_hook,
    ms_switch,
)
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed (CI's MindSpore step installs "
                                              "mindspore==2.10.0)")
pytestmark = pytest.mark.timeout(120)

JOB = "job-ms"
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)


def order(ranks: tuple[int, ...] = (1, 0), ops: tuple[bool, ...] = (True, False), seq: int = 1) -> SwitchOrder:
    return SwitchOrder(seq=seq, job_id=JOB, ranks=ranks, ops=ops)


# -- MindSporeSwitcher ---------------------------------------------------------------------------

@pytest.mark.parametrize(("ranks", "ops", "why"), [
    ((0, 0), [True, True], "different"),
    ([0, 4], [True, True], "below the world size"),
    ([0, True], [True, True], "below the world size"),
    ([0, 1], [True, 1], "bools"),
    ([0, 1], [True], "as long"),
    ("01", [True, True], "lists"),
])
def test_the_switcher_refuses_what_mindspore_refuses(ranks: Any, ops: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ms_switch.validate(ranks, ops, 4)


def test_the_switcher_finds_mindsporess_function_and_calls_it_with_the_full_list() -> None:
    switcher = MindSporeSwitcher(world_size=2)
    switcher.check()  # MindSpore 2.10 has _comm_switch_nic
    from mindspore.communication import management

    assert callable(management._comm_switch_nic)
    # On CPU without init() MindSpore's own call raises (no communication group): a failure, not a True.
    with pytest.raises(Exception):  # noqa: B017 - whatever MindSpore raises counts as a failed switch
        switcher(order())


def test_a_missing_function_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from mindspore.communication import management

    monkeypatch.delattr(management, "_comm_switch_nic")
    with pytest.raises(ConfigError, match="_comm_switch_nic is missing"):
        MindSporeSwitcher().check()
    monkeypatch.setattr(ms_switch, "MODULE", "mindspore_is_not_here")
    with pytest.raises(ConfigError, match=r"pip install '\.\[mindspore\]'"):
        MindSporeSwitcher().check()


def test_the_default_switch_hook_follows_the_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"server": "127.0.0.1:8899", "job_id": JOB}
    assert isinstance(default_switch_hook(AgentConfig(**base, framework="mindspore")), MindSporeSwitcher)
    assert isinstance(default_switch_hook(AgentConfig(**base, framework="torch")), TorchNpuSwitcher)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # auto: MindSpore imported, torch not
    assert isinstance(default_switch_hook(AgentConfig(**base)), MindSporeSwitcher)


# -- MindSporeCheckpointGuard --------------------------------------------------------------------

def test_the_guard_saves_atomically_skips_a_saved_step_and_keeps_the_last_two(tmp_path: Path) -> None:
    step = [5]
    weight = ms.Parameter(ms.Tensor([1.5, 2.5], ms.float32), name="w")
    guard = MindSporeCheckpointGuard(lambda: {"w": weight}, tmp_path / "ckpt", step=lambda: step[0],
                                     min_interval_s=0, min_free_bytes=0)
    guard.check()
    guard(order())
    saved = tmp_path / "ckpt" / "step-5" / "state.ckpt"
    assert saved.is_file() and guard.last is not None and guard.last.saved
    assert ms.load_checkpoint(str(saved))["w"].asnumpy().tolist() == [1.5, 2.5]
    guard(order(seq=2))  # a retried switch at the same parked step
    assert guard.last is not None and not guard.last.saved and "already checkpointed" in guard.last.reason
    for s in (6, 7):
        step[0] = s
        guard(order(seq=s))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-6", "step-7"]  # bounded, no temp dirs


def test_the_guard_refuses_below_the_free_space_floor(tmp_path: Path) -> None:
    from nicswitch_agent.hooks import GuardRefused

    guard = MindSporeCheckpointGuard(lambda: {"w": ms.Parameter(ms.Tensor([1.0]), name="w")}, tmp_path,
                                     step=lambda: 1, min_free_bytes=1 << 62)
    with pytest.raises(GuardRefused):
        guard(order())
    assert list(tmp_path.iterdir()) == []


def test_the_guard_checks_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="state="):
        MindSporeCheckpointGuard(None, tmp_path, step=lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep_last"):
        MindSporeCheckpointGuard(lambda: {}, tmp_path, step=lambda: 1, keep_last=0)


# -- NicSwitchMindSporeCallback with Model.train -------------------------------------------------

class StopWhen(ms.train.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, finish: threading.Event, reached: threading.Event) -> None:
        super().__init__()
        self.finish, self.reached, self.extra = finish, reached, 5

    def on_train_step_end(self, run_context: Any) -> None:
        if run_context.original_args().cur_step_num >= 3:
            self.reached.set()
        if self.finish.is_set():
            self.extra -= 1
            if self.extra <= 0:
                run_context.request_stop()


def test_a_switch_mid_model_train_parks_checkpoints_and_training_goes_on(tmp_path: Path) -> None:
    import numpy as np
    from mindspore import dataset, nn

    from nicswitch_agent.integrations.mindspore import NicSwitchMindSporeCallback

    calls: list[dict[str, Any]] = []
    net = nn.Dense(4, 1)
    callback = NicSwitchMindSporeCallback(server="127.0.0.1:1", job_id=JOB, pause="agent",
                                          reconnect_initial_s=0.02, reconnect_max_s=0.1,
                                          switch_hook=lambda o: calls.append(
                                              {"step": callback.last_step(), "thread": threading.current_thread().name,
                                               "ranks": o.ranks, "ops": o.ops}) or True)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=FAST) as sim:
        callback._agent_kwargs["server"] = sim.address
        callback.guard(MindSporeCheckpointGuard(lambda: net, tmp_path / "ckpt", step=callback.last_step,
                                                min_free_bytes=0))
        finish, reached = threading.Event(), threading.Event()
        message: list[str] = []

        def operate() -> None:
            try:
                if reached.wait(60):
                    message.append(operator_switch(sim.address, JOB, ["0"], [True]))
            finally:
                finish.set()

        operator = threading.Thread(target=operate)
        operator.start()
        data = dataset.GeneratorDataset(
            [(np.ones(4, np.float32), np.ones(1, np.float32)) for _ in range(100000)], ["x", "y"]).batch(1)
        model = ms.train.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.01))
        model.train(1, data, callbacks=[callback, StopWhen(finish, reached)], dataset_sink_mode=False)
        operator.join(30)
        assert message == ["switch nic finish"]
        assert sim.job_view(JOB).replies == [True]
    (call,) = calls
    assert call["thread"] == threading.current_thread().name  # parked on the training thread
    assert (call["ranks"], call["ops"]) == ((0,), (True,))
    assert (tmp_path / "ckpt" / f"step-{call['step']}" / "state.ckpt").is_file()
    assert callback.agent is None and callback.stop_reason is None
    assert (callback.last_step() or 0) > call["step"]  # training went on after the switch


def test_settings_are_checked_when_the_callback_is_made() -> None:
    from nicswitch_agent.integrations.mindspore import NicSwitchMindSporeCallback

    with pytest.raises(ConfigError, match="framework"):
        NicSwitchMindSporeCallback(server="127.0.0.1:1", job_id=JOB, framework="tensorflow")
    assert SwitchAgent(server="127.0.0.1:1", job_id=JOB, framework="mindspore").config.framework == "mindspore"
