"""NicSwitchTrainerCallback with a real transformers Trainer (CPU, one process) against the simulator.

A tiny torch model trains under ``Trainer.train()`` on the test's main thread; an operator thread
waits until the agent holds its streams and training is under way, then asks the simulator for a
switch, which arrives mid-run. The switch hook must run once, on the training thread, at one
global step (the step HFCheckpointGuard checkpointed through the Trainer), and training must then
go on and finish normally. One rank: the Trainer's DDP on CPU adds nothing here that
tests/test_torch_multiprocess.py and the DDP example (2 ranks) do not cover.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import support

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="needs transformers: the [hf] extra")
pytest.importorskip("accelerate", reason="needs accelerate (the Trainer's dependency): the [hf] extra")

from nicswitch_agent import ConfigError, SwitchOrder, TrainingStopped  # noqa: E402
from nicswitch_agent._pb import recover_pb2 as pb  # noqa: E402
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel  # noqa: E402
from nicswitch_agent.hooks import GuardRefused  # noqa: E402
from nicswitch_agent.integrations.huggingface import HFCheckpointGuard, NicSwitchTrainerCallback  # noqa: E402
from nicswitch_agent.orders import build_order  # noqa: E402
from nicswitch_agent.sim import SimJob, SimSettings, Simulator  # noqa: E402

pytestmark = pytest.mark.timeout(60)

JOB = "job-hf"
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
AGENT = {"job_id": JOB, "pause": "agent", "reconnect_initial_s": 0.02, "reconnect_max_s": 0.1}


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
        out = self.layer(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def dataset() -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return [{"x": x[i], "labels": y[i]} for i in range(len(x))]


class Progress(transformers.TrainerCallback):  # type: ignore[misc]
    """Publishes the global step; ends training normally ``extra`` steps after ``finish`` is set."""

    def __init__(self, finish: threading.Event, extra: int = 5) -> None:
        self.finish = finish
        self.extra = extra
        self.step = 0
        self.stop_at: int | None = None
        self.cond = threading.Condition()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with self.cond:
            self.step = state.global_step
            self.cond.notify_all()
        if self.finish.is_set() and self.stop_at is None:
            self.stop_at = state.global_step + self.extra
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True

    def wait_step(self, step: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.step >= step, timeout)


class Operator(threading.Thread):
    """Waits for the agent's streams and a few training steps, then SwitchNicTrack and its outcome."""

    def __init__(self, sim: Simulator, progress: Progress, finish: threading.Event) -> None:
        super().__init__(name="operator", daemon=True)
        self.sim, self.progress, self.finish = sim, progress, finish
        self.message: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        channel = open_channel(ChannelSettings(target=self.sim.address))
        try:
            assert self.sim.wait_until(streams_ready, 20), "the agent never opened its streams"
            assert self.progress.wait_step(3, 20), "training did not start"
            request = pb.SwitchNics(jobID=JOB)
            request.nicOps["node-0"].dev.append("0")
            request.nicOps["node-0"].op.append(True)
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
        self.calls.append({"step": self.trainer[0].state.global_step, "thread": threading.current_thread().name,
                           "ranks": order.ranks, "ops": order.ops})
        return self.result


def make_trainer(tmp_path: Path, callbacks: list[Any]) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=20000, per_device_train_batch_size=8, learning_rate=0.05,
        use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    return transformers.Trainer(model=Regression(), args=args, train_dataset=dataset(), callbacks=callbacks)


@pytest.fixture
def sim() -> Any:
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]}, recover_strategies=("dump",))],
                   settings=FAST) as simulator:
        yield simulator


def test_switch_mid_training_parks_at_one_step_checkpoints_and_training_finishes(
        sim: Simulator, tmp_path: Path) -> None:
    trainer_box: list[Any] = []
    hook = SwitchRecorder(trainer_box)
    events: list[Any] = []
    finish = threading.Event()
    progress = Progress(finish)
    trainer = make_trainer(tmp_path, [progress])
    trainer_box.append(trainer)
    guard = HFCheckpointGuard(trainer, min_free_bytes=1 << 20)
    callback = NicSwitchTrainerCallback(switch_hook=hook, checkpoint_hook=guard, on_event=events.append,
                                        server=sim.address, **AGENT)
    trainer.add_callback(callback)
    operator = Operator(sim, progress, finish)
    operator.start()
    result = trainer.train()
    operator.join(10)

    assert operator.error is None, operator.error
    assert operator.message == "switch nic finish"
    assert len(hook.calls) == 1, hook.calls
    (call,) = hook.calls
    assert call["thread"] == threading.current_thread().name  # parked on the training thread
    assert (call["ranks"], call["ops"]) == ((0,), (True,))
    step = call["step"]
    assert [e.detail["step"] for e in events if e.kind == "parked"] == [step]
    assert result.global_step >= step + 5  # training went on after the switch, and train() returned
    # the guard saved the Trainer's own resumable checkpoint of exactly the parked step
    saved = tmp_path / "out" / f"checkpoint-{step}"
    assert guard.last is not None and guard.last.saved and guard.last.path == str(saved)
    assert json.loads((saved / "trainer_state.json").read_text())["global_step"] == step
    assert (saved / "optimizer.pt").is_file() and any(saved.glob("model.safetensors*"))
    view = sim.job_view(JOB)
    assert view.replies == [True] and view.violations == []
    assert callback.agent is None and events[-1].kind == "agent_stopped"  # stopped in on_train_end
    assert callback.stop_reason is None


@pytest.mark.parametrize("raise_on_stop", [True, False])
def test_failed_switch_stops_training(sim: Simulator, tmp_path: Path, raise_on_stop: bool) -> None:
    trainer_box: list[Any] = []
    hook = SwitchRecorder(trainer_box, result=False)  # the switch fails and so does its rollback
    events: list[Any] = []
    finish = threading.Event()
    progress = Progress(finish, extra=1000)  # only ClusterD's decision ends this run
    trainer = make_trainer(tmp_path, [progress])
    trainer_box.append(trainer)
    callback = NicSwitchTrainerCallback(raise_on_stop=raise_on_stop, switch_hook=hook, on_event=events.append,
                                        server=sim.address, **AGENT)
    trainer.add_callback(callback)
    operator = Operator(sim, progress, finish)
    operator.start()
    if raise_on_stop:
        with pytest.raises(TrainingStopped, match="exit"):
            trainer.train()
    else:
        result = trainer.train()
        assert result.global_step == hook.calls[0]["step"]  # the Trainer ended at the step ClusterD stopped
    operator.join(10)
    assert operator.error is None, operator.error
    assert operator.message == "switch nic failed, switch nic failed"
    assert callback.stop_reason is not None and "exit" in callback.stop_reason
    assert callback.agent is None and events[-1].kind == "agent_stopped"
    assert sim.job_view(JOB).replies == [False]


def test_guard_skips_a_checkpointed_step_and_refuses_without_space(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [])
    order = build_order(seq=1, job_id=JOB, rank_ids=["0"], ops=[True], world_size=1, max_ranks=8)
    trainer.state.global_step = 7
    (tmp_path / "out" / "checkpoint-7").mkdir(parents=True)  # the Trainer saved this step already
    guard = HFCheckpointGuard(trainer, min_free_bytes=0)
    guard.check()
    guard(order)
    assert guard.last is not None and not guard.last.saved and guard.last.reason == "step 7 already checkpointed"
    trainer.state.global_step = 8
    starved = HFCheckpointGuard(trainer, min_free_bytes=1 << 62)
    with pytest.raises(GuardRefused, match="free space"):
        starved(order)
    assert starved.last is not None and starved.last.reason.startswith("refused: free space")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-7"]


def test_settings_are_checked_when_the_callback_is_made() -> None:
    with pytest.raises(ConfigError):
        NicSwitchTrainerCallback(server="127.0.0.1:1", job_id="")
    with pytest.raises(ConfigError, match="min_free_bytes"):
        HFCheckpointGuard(object(), min_free_bytes=-1)  # type: ignore[arg-type]


def test_the_package_names_it_lazily() -> None:
    import nicswitch_agent.integrations as integrations

    assert integrations.NicSwitchTrainerCallback is NicSwitchTrainerCallback
    assert integrations.HFCheckpointGuard is HFCheckpointGuard
    assert issubclass(NicSwitchTrainerCallback, transformers.TrainerCallback)
