"""NicSwitchCallback with real PyTorch Lightning (CPU, one process) against the ClusterD simulator.

A tiny LightningModule trains on the test's main thread; an operator thread waits until the
agent holds its streams and training is under way, then asks the simulator for a switch, which
arrives mid-run. The switch hook must run once, on the training thread, at one global step (the
step LightningCheckpointGuard checkpointed through ``trainer.save_checkpoint``), and training must
then go on and finish normally. One rank: Lightning's multi-process strategies on CPU add nothing
here that tests/test_torch_multiprocess.py and the DDP example (2 ranks) do not cover.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import pytest
import support

torch = pytest.importorskip("torch")
try:
    import lightning.pytorch as pl
except ImportError:
    pl = pytest.importorskip("pytorch_lightning", reason="needs lightning or pytorch_lightning: the [lightning] extra")

from nicswitch_agent import SwitchOrder, TrainingStopped  # noqa: E402
from nicswitch_agent._pb import recover_pb2 as pb  # noqa: E402
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel  # noqa: E402
from nicswitch_agent.hooks import GuardRefused  # noqa: E402
from nicswitch_agent.integrations.lightning import LightningCheckpointGuard, NicSwitchCallback  # noqa: E402
from nicswitch_agent.orders import build_order  # noqa: E402
from nicswitch_agent.sim import SimJob, SimSettings, Simulator  # noqa: E402

pytestmark = pytest.mark.timeout(60)

JOB = "job-pl"
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
AGENT = {"server": None, "job_id": JOB, "pause": "agent", "reconnect_initial_s": 0.02, "reconnect_max_s": 0.1}


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> Any:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Progress(pl.Callback):
    """Publishes the global step; ends the fit normally ``extra`` steps after ``finish`` is set."""

    def __init__(self, finish: threading.Event, extra: int = 5) -> None:
        self.finish = finish
        self.extra = extra
        self.step = 0
        self.stop_at: int | None = None
        self.cond = threading.Condition()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with self.cond:
            self.step = trainer.global_step
            self.cond.notify_all()
        if self.finish.is_set() and self.stop_at is None:
            self.stop_at = trainer.global_step + self.extra
        if self.stop_at is not None and trainer.global_step >= self.stop_at:
            trainer.should_stop = True

    def wait_step(self, step: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.step >= step, timeout)


class Operator(threading.Thread):
    """Waits for the agent's streams and a few training steps, then SwitchNicTrack and its outcome."""

    def __init__(self, sim: Simulator, progress: Progress, finish: threading.Event, ops: list[bool]) -> None:
        super().__init__(name="operator", daemon=True)
        self.sim, self.progress, self.finish, self.ops = sim, progress, finish, ops
        self.message: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        channel = open_channel(ChannelSettings(target=self.sim.address))
        try:
            assert self.sim.wait_until(streams_ready, 20), "the agent never opened its streams"
            assert self.progress.wait_step(3, 20), "training did not start"
            request = pb.SwitchNics(jobID=JOB)
            request.nicOps["node-0"].dev.append("0")
            request.nicOps["node-0"].op.extend(self.ops)
            stub = RecoverStub(channel)
            assert stub.SwitchNicTrack(request, timeout=5).code == 0
            for response in stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB), timeout=30):
                self.message = str(response.msg)
                break
        except BaseException as exc:
            self.error = exc
        finally:
            channel.close()
            self.finish.set()  # training ends either way


streams_ready = functools.partial(support.streams_ready, job=JOB)


class SwitchRecorder:
    def __init__(self, trainer: list[Any], result: bool = True) -> None:
        self.trainer = trainer
        self.result = result
        self.calls: list[dict[str, Any]] = []

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls.append({"step": self.trainer[0].global_step, "thread": threading.current_thread().name,
                           "ranks": order.ranks, "ops": order.ops})
        return self.result


def make_trainer(tmp_path: Path, callbacks: list[Any], max_steps: int = 20000) -> Any:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), callbacks=callbacks)


@pytest.fixture
def sim() -> Any:
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]}, recover_strategies=("dump",))],
                   settings=FAST) as simulator:
        yield simulator


def test_switch_mid_fit_parks_at_one_step_checkpoints_and_training_finishes(sim: Simulator, tmp_path: Path) -> None:
    trainer_box: list[Any] = []
    hook = SwitchRecorder(trainer_box)
    events: list[Any] = []
    callback = NicSwitchCallback(checkpoint_dir=tmp_path / "nicswitch", min_free_bytes=1 << 20, switch_hook=hook,
                                 on_event=events.append, **{**AGENT, "server": sim.address})
    finish = threading.Event()
    progress = Progress(finish)
    trainer = make_trainer(tmp_path, [callback, progress])
    trainer_box.append(trainer)
    operator = Operator(sim, progress, finish, [True])
    operator.start()
    trainer.fit(Regression(), loader())
    operator.join(10)

    assert operator.error is None, operator.error
    assert operator.message == "switch nic finish"
    assert trainer.state.status == "finished" and trainer.state.stage is None  # a normal end, not an interrupt
    assert len(hook.calls) == 1, hook.calls
    (call,) = hook.calls
    assert call["thread"] == threading.current_thread().name  # parked on the training thread
    assert (call["ranks"], call["ops"]) == ((0,), (True,))
    step = call["step"]
    parked = [e.detail["step"] for e in events if e.kind == "parked"]
    assert parked == [step]
    assert trainer.global_step >= step + 5  # training went on after the switch
    # the guard checkpointed exactly the parked step, through trainer.save_checkpoint
    saved = tmp_path / "nicswitch" / f"nicswitch-step-{step}.ckpt"
    assert saved.is_file() and sorted(p.name for p in saved.parent.iterdir()) == [saved.name]
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["global_step"] == step and "optimizer_states" in checkpoint
    view = sim.job_view(JOB)
    assert view.replies == [True] and view.violations == []
    assert callback.agent is None and events[-1].kind == "agent_stopped"  # stopped in teardown
    assert callback.stop_reason is None


def test_failed_switch_ends_fit_with_training_stopped(sim: Simulator, tmp_path: Path) -> None:
    trainer_box: list[Any] = []
    hook = SwitchRecorder(trainer_box, result=False)  # the switch fails and so does its rollback
    events: list[Any] = []
    callback = NicSwitchCallback(switch_hook=hook, on_event=events.append, **{**AGENT, "server": sim.address})
    finish = threading.Event()
    progress = Progress(finish, extra=1000)  # only ClusterD's decision ends this fit
    trainer = make_trainer(tmp_path, [callback, progress])
    trainer_box.append(trainer)
    operator = Operator(sim, progress, finish, [True])
    operator.start()
    with pytest.raises(TrainingStopped, match="exit"):
        trainer.fit(Regression(), loader())
    operator.join(10)
    assert operator.error is None, operator.error
    assert operator.message == "switch nic failed, switch nic failed"
    assert trainer.state.status == "interrupted"  # Lightning ran its on_exception hooks
    assert callback.stop_reason is not None and "exit" in callback.stop_reason
    assert callback.agent is None and events[-1].kind == "agent_stopped"
    assert sim.job_view(JOB).replies == [False]


class GuardDriver(pl.Callback):
    """Calls the guards directly at chosen global steps, on the training thread, as the agent would."""

    def __init__(self, guard: LightningCheckpointGuard, starved: LightningCheckpointGuard) -> None:
        self.guard, self.starved = guard, starved
        self.outcomes: list[tuple[int, str]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        order = build_order(seq=step, job_id=JOB, rank_ids=["0"], ops=[True], world_size=1,
                            max_ranks=8)
        if step in (2, 4, 6):
            for _ in range(2 if step == 6 else 1):  # a retried switch at step 6
                self.guard(order)
                assert self.guard.last is not None
                self.outcomes.append((step, self.guard.last.reason))
        if step == 6:
            with pytest.raises(GuardRefused, match="free space"):
                self.starved(order)
            self.outcomes.append((step, self.starved.last.reason if self.starved.last else ""))


def test_guard_skips_a_checkpointed_step_keeps_the_newest_and_refuses_without_space(tmp_path: Path) -> None:
    directory = tmp_path / "guard"
    trainer = make_trainer(tmp_path, [], max_steps=6)
    guard = LightningCheckpointGuard(trainer, directory, keep_last=2, min_free_bytes=0)
    starved = LightningCheckpointGuard(trainer, tmp_path / "starved", min_free_bytes=1 << 62)
    (directory / "notes.txt").parent.mkdir(parents=True)
    (directory / "notes.txt").write_text("not a checkpoint: never removed")
    (directory / ".tmp-nicswitch-step-1.ckpt").write_text("left by a killed save")
    driver = GuardDriver(guard, starved)
    trainer.callbacks.append(driver)
    trainer.fit(Regression(), loader())
    assert driver.outcomes == [(2, "saved"), (4, "saved"), (6, "saved"), (6, "step 6 already checkpointed"),
                               (6, driver.outcomes[-1][1])]
    assert driver.outcomes[-1][1].startswith("refused: free space")
    assert sorted(p.name for p in directory.iterdir()) == ["nicswitch-step-4.ckpt", "nicswitch-step-6.ckpt",
                                                           "notes.txt"]
    assert torch.load(directory / "nicswitch-step-6.ckpt", weights_only=False)["global_step"] == 6
    assert not (tmp_path / "starved").exists() or not any((tmp_path / "starved").iterdir())


def test_settings_are_checked_when_the_callback_is_made(tmp_path: Path) -> None:
    from nicswitch_agent import ConfigError

    with pytest.raises(ConfigError):
        NicSwitchCallback(server="127.0.0.1:1", job_id="")
    with pytest.raises(ConfigError, match="not both"):
        NicSwitchCallback(server="127.0.0.1:1", job_id=JOB, checkpoint_dir=tmp_path, checkpoint_hook=lambda o: None)
    with pytest.raises(ConfigError, match="keep_last"):
        LightningCheckpointGuard(make_trainer(tmp_path, []), tmp_path, keep_last=0)


def test_the_package_names_it_lazily() -> None:
    import nicswitch_agent.integrations as integrations

    assert integrations.NicSwitchCallback is NicSwitchCallback
    assert integrations.LightningCheckpointGuard is LightningCheckpointGuard
    assert issubclass(NicSwitchCallback, pl.Callback)


def load_fresh(name: str) -> Any:
    """Execute integrations/lightning.py again under another module name (the real one stays)."""
    import importlib.util

    import nicswitch_agent.integrations.lightning as real

    spec = importlib.util.spec_from_file_location(name, real.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_falls_back_to_pytorch_lightning_when_lightning_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    standalone = pytest.importorskip("pytorch_lightning")
    monkeypatch.setitem(sys.modules, "lightning", None)  # `import lightning.pytorch` now raises ImportError
    module = load_fresh("nicswitch_fallback_probe")
    assert module.pl is standalone and issubclass(module.NicSwitchCallback, standalone.Callback)


def test_without_any_lightning_the_import_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(ImportError, match=r"pip install '\.\[lightning\]' in the nicswitch-agent checkout"):
        load_fresh("nicswitch_missing_probe")
