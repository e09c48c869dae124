"""Hugging Face transformers: ``NicSwitchTrainerCallback`` and ``HFCheckpointGuard``.

Install with ``python3 -m pip install '.[hf]'`` in the checkout (transformers and accelerate, which the
``Trainer`` needs).

::

    from nicswitch_agent.integrations.huggingface import HFCheckpointGuard, NicSwitchTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(NicSwitchTrainerCallback(checkpoint_hook=HFCheckpointGuard(trainer)))
    trainer.train()        # server and job id from MindCluster's env, as for SwitchAgent()

A ``TrainerCallback`` is not given the ``Trainer``, so the guard is built from it and handed in,
after the Trainer exists (``add_callback``). Without a guard, ``callbacks=[NicSwitchTrainerCallback()]``
works as usual.

The callback is deliberately thin: ``on_train_begin`` creates and starts a
:class:`~nicswitch_agent.SwitchAgent` (the process group exists by then), ``on_step_end``
forwards ``state.global_step`` to ``agent.step()`` (it runs once per optimizer step, never between
gradient-accumulation micro-batches), ``on_train_end`` stops the agent. The Trainer has no
exception hook: if ``train()`` raises something else, the agent is stopped at interpreter exit
(or when the next ``train()`` begins). In pause mode ``agent`` a pause parks training inside
``on_step_end``, at the same global step on every rank, and the guard and the switch run there.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:
    raise ImportError(
        "nicswitch_agent.integrations.huggingface needs transformers: python3 -m pip install '.[hf]' in the "
        "nicswitch-agent checkout"
    ) from exc

from nicswitch_agent.agent import SwitchAgent
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.base import CheckpointGuard
from nicswitch_agent.hooks.torch_checkpoint import GuardRecord, GuardRefused
from nicswitch_agent.orders import SwitchOrder

__all__ = ["HFCheckpointGuard", "NicSwitchTrainerCallback"]

logger = logging.getLogger("nicswitch_agent.integrations")

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_STEP_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


class HFCheckpointGuard(CheckpointGuard):
    """Save the Trainer's own checkpoint before a switch.

    Calls the Trainer's checkpoint routine (``Trainer._save_checkpoint``, what ``save_steps``
    triggers): ``<output_dir>/checkpoint-<global_step>`` with the model, optimizer, scheduler,
    RNG and trainer state, which ``trainer.train(resume_from_checkpoint=...)`` resumes from, and
    the Trainer's own rotation (``save_total_limit``: set it, or checkpoints accumulate until the
    free-space floor refuses the next switch). The public ``save_model`` would save the weights
    only, which is not enough to resume.

    The save may be collective (DeepSpeed, FSDP, the FLOPs all-reduce under DDP), so every rank
    must take the same decision: the world's process zero decides and broadcasts it (the agent
    calls the guard on every rank for the same order at the same parked step, pause mode
    ``agent``):

    - **skip** when ``checkpoint-<step>`` already exists (a retried switch, or the Trainer saved
      this step);
    - **refuse** (:class:`~nicswitch_agent.hooks.GuardRefused`: no switch, reply false) when free
      space minus the size of the newest ``checkpoint-*`` is below ``min_free_bytes``;
    - else **save**.

    Args:
        trainer: The ``transformers.Trainer``.
        min_free_bytes: Free-space floor in the output directory, checked before writing.

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(self, trainer: Trainer, *, min_free_bytes: int = 1 << 30) -> None:
        if isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int) or min_free_bytes < 0:
            raise ConfigError(f"min_free_bytes={min_free_bytes!r} must be an int >= 0")
        self.trainer = trainer
        self.min_free_bytes = min_free_bytes
        self.last: GuardRecord | None = None
        """What the last call did (saved, skipped, refused), on this rank."""

    @property
    def output_dir(self) -> Path:
        return Path(self.trainer.args.output_dir or ".").expanduser().resolve()

    def path_for(self, step: int) -> Path:
        return self.output_dir / f"{CHECKPOINT_PREFIX}-{step}"

    def check(self) -> None:
        if not callable(getattr(self.trainer, "_save_checkpoint", None)):
            raise ConfigError("this transformers version's Trainer has no _save_checkpoint(); "
                              "HFCheckpointGuard cannot save through it")

    def __call__(self, order: SwitchOrder) -> None:
        trainer = self.trainer
        started = time.monotonic()
        step = int(trainer.state.global_step)
        final = self.path_for(step)
        rank = trainer.args.process_index

        def record(saved: bool, reason: str, level: int = logging.INFO) -> None:
            size = _size(final) if saved and trainer.is_world_process_zero() else 0
            self.last = GuardRecord(saved, reason, step, str(final), time.monotonic() - started, size, order.seq)
            logger.log(level, "[%s/%s/%s] transformers checkpoint step %d: %s (%s)", order.job_id, rank, order.seq,
                       step, reason, final)

        verdict = _broadcast(self._decide(step, final) if trainer.is_world_process_zero() else None)
        action, reason = verdict
        if action == "skip":
            record(False, reason)
            return
        if action == "refuse":
            record(False, f"refused: {reason}", logging.WARNING)
            raise GuardRefused(reason)
        try:
            trainer._save_checkpoint(trainer.model_wrapped, None)  # (model, trial), positional in 4.x and 5.x
        except BaseException as exc:
            record(False, f"failed: {type(exc).__name__}: {exc}", logging.WARNING)
            raise
        record(True, "saved")

    def _decide(self, step: int, final: Path) -> tuple[str, str]:
        """Process zero: ("save" | "skip" | "refuse", reason); errors refuse on every rank."""
        try:
            if final.exists():
                return "skip", f"step {step} already checkpointed"
            out = self.output_dir
            out.mkdir(parents=True, exist_ok=True)
            steps = [(int(m.group(1)), out / e.name) for e in os.scandir(out)
                     if (m := _STEP_NAME.match(e.name)) and e.is_dir(follow_symlinks=False)]
            newest = max(steps, default=None)
            expected = _size(newest[1]) if newest is not None else 0
            free = shutil.disk_usage(out).free
            if free - expected < self.min_free_bytes:
                return "refuse", (f"free space in {out} is {free} bytes, below min_free_bytes="
                                  f"{self.min_free_bytes} plus the expected checkpoint size {expected}")
            return "save", ""
        except Exception as exc:
            return "refuse", f"{type(exc).__name__}: {exc}"


class NicSwitchTrainerCallback(TrainerCallback):
    """Runs a :class:`~nicswitch_agent.SwitchAgent` for the duration of ``trainer.train()``.

    Args:
        raise_on_stop: What to do when ClusterD's recovery decides that training must stop
            (``agent.step()`` raises :class:`~nicswitch_agent.TrainingStopped`). True (default):
            set ``control.should_training_stop``, stop the agent and re-raise, so ``train()``
            raises ``TrainingStopped`` and the process can exit non-zero for MindCluster to
            restart it. False: only set ``control.should_training_stop``; the Trainer ends
            training after this step, ``train()`` returns, and :attr:`stop_reason` says why.
        **agent_kwargs: Passed to :class:`~nicswitch_agent.SwitchAgent` (``server``, ``job_id``,
            ``switch_hook``, ``checkpoint_hook`` such as :class:`HFCheckpointGuard`, ``pause``,
            any ``AgentConfig`` field, ...).

    Attributes:
        agent: The running agent during ``train()`` (None otherwise).
        stop_reason: Why ClusterD stopped training, if it did.

    Raises:
        ConfigError: a setting is invalid or missing (checked here, not at ``train()``).
    """

    def __init__(self, *, raise_on_stop: bool = True, **agent_kwargs: Any) -> None:
        SwitchAgent(**agent_kwargs)  # validates the settings now; starts nothing
        self._raise_on_stop = raise_on_stop
        self._agent_kwargs = agent_kwargs
        self.agent: SwitchAgent | None = None
        self.stop_reason: str | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._stop_agent("a new train() began")  # an earlier train() that raised
        self.stop_reason = None
        self.agent = SwitchAgent(**self._agent_kwargs).start()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        agent = self.agent
        if agent is None:
            return
        try:
            agent.step(int(state.global_step))
        except TrainingStopped as exc:
            self.stop_reason = str(exc)
            control.should_training_stop = True
            logger.error("ClusterD stopped training at step %d: %s", state.global_step, exc)
            if self._raise_on_stop:
                self._stop_agent(f"ClusterD stopped training: {exc}")
                raise

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._stop_agent("training finished")

    def _stop_agent(self, reason: str) -> None:
        agent, self.agent = self.agent, None
        if agent is not None:
            agent.stop(reason)


def _broadcast(verdict: tuple[str, str] | None) -> tuple[str, str]:
    """Process zero's verdict on every rank (a collective when torch.distributed runs several)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[Any] = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if verdict is None:
        raise RuntimeError("no checkpoint decision from process zero")
    return verdict


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
