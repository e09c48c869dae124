"""PyTorch Lightning: ``NicSwitchCallback`` and ``LightningCheckpointGuard``.

Install with ``python3 -m pip install '.[lightning]'`` in the checkout. ``lightning`` is imported, and
``pytorch_lightning`` when it is missing; use the one your ``Trainer`` comes from.

::

    from nicswitch_agent.integrations.lightning import NicSwitchCallback

    trainer = Trainer(callbacks=[NicSwitchCallback(checkpoint_dir="ckpt/nicswitch")])
    trainer.fit(model)     # server and job id from MindCluster's env, as for SwitchAgent()

The callback is deliberately thin (as NVRx's PTL callbacks are): ``setup`` (fit) creates and
starts a :class:`~nicswitch_agent.SwitchAgent` (the process group already exists there, so every
rank's agent finds the job's Store), ``on_train_batch_end`` forwards ``trainer.global_step`` to
``agent.step()`` once per optimizer step, ``teardown``/``on_exception`` stop the agent. Every
decision stays in the agent.

In pause mode ``agent`` a pause parks training inside ``on_train_batch_end``, at the same global
step on every rank, and the checkpoint guard and the switch hook run there, on the training thread.
A long validation run delays the pause (``pause_timeout_s``, 300 s by default) since no step
boundary is reached during it.
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
    import lightning.pytorch as pl
except ImportError:  # the standalone package, older projects
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef, unused-ignore]
    except ImportError as exc:
        raise ImportError(
            "nicswitch_agent.integrations.lightning needs PyTorch Lightning: "
            "python3 -m pip install '.[lightning]' in the nicswitch-agent checkout (or pytorch_lightning)"
        ) from exc

from nicswitch_agent.agent import SwitchAgent
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.base import CheckpointGuard, CheckpointHook
from nicswitch_agent.hooks.torch_checkpoint import GuardRecord, GuardRefused
from nicswitch_agent.orders import SwitchOrder

__all__ = ["LightningCheckpointGuard", "NicSwitchCallback"]

logger = logging.getLogger("nicswitch_agent.integrations")

PREFIX = "nicswitch-step-"
SUFFIX = ".ckpt"
_STEP_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+){re.escape(SUFFIX)}$")
_TEMP_NAME = re.compile(rf"^\.tmp-{re.escape(PREFIX)}\d+{re.escape(SUFFIX)}$")


class LightningCheckpointGuard(CheckpointGuard):
    """Checkpoint with ``trainer.save_checkpoint`` before a switch (like ``OnExceptionCheckpoint``).

    Writes ``<dirpath>/nicswitch-step-<global_step>.ckpt``, a full Lightning checkpoint that
    ``trainer.fit(ckpt_path=...)`` resumes from. ``save_checkpoint`` is collective (every rank
    must call it, and it ends with a barrier): the agent calls the guard on every rank for the same
    order at the same parked step (pause mode ``agent``), and rank 0 decides for all of them:

    - **skip** when this step is already checkpointed (a retried switch at the same step);
    - **refuse** (:class:`~nicswitch_agent.hooks.GuardRefused`: the switch does not run, the reply
      is false) when free space minus the size of the newest such checkpoint is below
      ``min_free_bytes``;
    - else **save** into ``.tmp-nicswitch-step-<S>.ckpt``, renamed into place by rank 0 (a
      ``nicswitch-step-*`` entry is always complete), then keep the newest ``keep_last`` of them.

    The decision reaches every rank through ``trainer.strategy.broadcast``, so ranks never
    disagree on whether to enter the collective save. Only entries named by this guard are ever
    removed.

    Args:
        trainer: The Lightning ``Trainer``.
        dirpath: Directory for the checkpoints (a filesystem rank 0 writes; created at start).
        keep_last: How many ``nicswitch-step-*`` checkpoints to keep, >= 1.
        min_free_bytes: Free-space floor, checked before writing anything.

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(self, trainer: pl.Trainer, dirpath: str | os.PathLike[str], *, keep_last: int = 2,
                 min_free_bytes: int = 1 << 30) -> None:
        if not os.fspath(dirpath):
            raise ConfigError("dirpath must be a non-empty path")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last={keep_last!r} must be an int >= 1")
        if isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int) or min_free_bytes < 0:
            raise ConfigError(f"min_free_bytes={min_free_bytes!r} must be an int >= 0")
        self.trainer = trainer
        self.dirpath = Path(dirpath).expanduser().resolve()
        self.keep_last = keep_last
        self.min_free_bytes = min_free_bytes
        self.last: GuardRecord | None = None
        """What the last call did (saved, skipped, refused), on this rank."""

    def path_for(self, step: int) -> Path:
        return self.dirpath / f"{PREFIX}{step}{SUFFIX}"

    def check(self) -> None:
        if self.trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)

    def __call__(self, order: SwitchOrder) -> None:
        trainer = self.trainer
        started = time.monotonic()
        step = int(trainer.global_step)
        final = self.path_for(step)

        def record(saved: bool, reason: str, size: int = 0, level: int = logging.INFO) -> None:
            self.last = GuardRecord(saved, reason, step, str(final), time.monotonic() - started, size, order.seq)
            logger.log(level, "[%s/%s/%s] lightning checkpoint step %d: %s (%s)", order.job_id, trainer.global_rank,
                       order.seq, step, reason, final)

        verdict: tuple[str, str] | None = self._decide(step, final) if trainer.is_global_zero else None
        verdict = trainer.strategy.broadcast(verdict, src=0)  # a collective: every rank is here
        if verdict is None:
            raise RuntimeError("no checkpoint decision from rank 0")
        action, reason = verdict
        if action == "skip":
            record(False, reason)
            return
        if action == "refuse":
            record(False, f"refused: {reason}", level=logging.WARNING)
            raise GuardRefused(reason)
        tmp = self.dirpath / f".tmp-{final.name}"
        try:
            trainer.save_checkpoint(tmp)  # every rank; ends with a barrier, so rank 0 may rename
            size = 0
            if trainer.is_global_zero:
                os.replace(tmp, final)
                size = _size(final)
                self._retain(final)
        except BaseException as exc:
            record(False, f"failed: {type(exc).__name__}: {exc}", level=logging.WARNING)
            if trainer.is_global_zero:
                _remove(tmp)
            raise
        record(True, "saved", size)

    def _decide(self, step: int, final: Path) -> tuple[str, str]:
        """Rank 0: ("save" | "skip" | "refuse", reason); errors refuse (on every rank, after the broadcast)."""
        try:
            if final.exists():
                return "skip", f"step {step} already checkpointed"
            self.dirpath.mkdir(parents=True, exist_ok=True)
            _remove(self.dirpath / f".tmp-{final.name}")  # left by a killed save
            newest = max(self._checkpoints(), default=None)
            expected = _size(newest[1]) if newest is not None else 0
            free = shutil.disk_usage(self.dirpath).free
            if free - expected < self.min_free_bytes:
                return "refuse", (f"free space in {self.dirpath} is {free} bytes, below min_free_bytes="
                                  f"{self.min_free_bytes} plus the expected checkpoint size {expected}")
            return "save", ""
        except Exception as exc:  # a refusal every rank agrees on, never a rank left out of the save
            return "refuse", f"{type(exc).__name__}: {exc}"

    def _checkpoints(self) -> list[tuple[int, Path]]:
        found = []
        for entry in os.scandir(self.dirpath):
            match = _STEP_NAME.match(entry.name)
            if match and not entry.is_symlink():
                found.append((int(match.group(1)), self.dirpath / entry.name))
        return found

    def _retain(self, just_saved: Path) -> None:
        checkpoints = sorted(self._checkpoints(), reverse=True)
        keep = {p for _, p in checkpoints[: self.keep_last]} | {just_saved}
        doomed = [p for _, p in checkpoints if p not in keep]
        doomed += [self.dirpath / e.name for e in os.scandir(self.dirpath)
                   if _TEMP_NAME.match(e.name) and not e.is_symlink()]
        for path in doomed:
            try:
                _remove(path)
            except OSError as exc:  # saved; a leftover is not a failure
                logger.warning("could not remove old checkpoint %s: %s", path, exc)


class NicSwitchCallback(pl.Callback):
    """Runs a :class:`~nicswitch_agent.SwitchAgent` for the duration of ``trainer.fit()``.

    Args:
        checkpoint_dir: When given, a :class:`LightningCheckpointGuard` writing there is the
            agent's checkpoint guard (override :meth:`make_checkpoint_guard` for another one).
        keep_last: ``LightningCheckpointGuard(keep_last=...)``.
        min_free_bytes: ``LightningCheckpointGuard(min_free_bytes=...)``.
        raise_on_stop: What to do when ClusterD's recovery decides that training must stop
            (``agent.step()`` raises :class:`~nicswitch_agent.TrainingStopped`). True (default):
            set ``trainer.should_stop`` and re-raise, so Lightning runs ``on_exception`` hooks
            (e.g. ``OnExceptionCheckpoint``) and ``trainer.fit()`` raises ``TrainingStopped``; the
            process should then exit non-zero for MindCluster to restart it. False: only set
            ``trainer.should_stop``; ``fit()`` returns normally at this step and
            :attr:`stop_reason` says why.
        **agent_kwargs: Passed to :class:`~nicswitch_agent.SwitchAgent` (``server``, ``job_id``,
            ``switch_hook``, ``pause``, ``on_event``, any ``AgentConfig`` field, ...).

    Attributes:
        agent: The running agent between ``setup`` and ``teardown`` (None otherwise).
        stop_reason: Why ClusterD stopped training, if it did.

    Raises:
        ConfigError: a setting is invalid or missing (checked here, not at ``fit()``).
    """

    def __init__(self, *, checkpoint_dir: str | os.PathLike[str] | None = None, keep_last: int = 2,
                 min_free_bytes: int = 1 << 30, raise_on_stop: bool = True, **agent_kwargs: Any) -> None:
        super().__init__()
        if checkpoint_dir is not None and agent_kwargs.get("checkpoint_hook") is not None:
            raise ConfigError("pass either checkpoint_dir=... or checkpoint_hook=..., not both")
        SwitchAgent(**agent_kwargs)  # validates the settings now; starts nothing
        self._checkpoint_dir = checkpoint_dir
        self._keep_last = keep_last
        self._min_free_bytes = min_free_bytes
        self._raise_on_stop = raise_on_stop
        self._agent_kwargs = agent_kwargs
        self.agent: SwitchAgent | None = None
        self.stop_reason: str | None = None
        self._last_step: int | None = None

    def make_checkpoint_guard(self, trainer: pl.Trainer) -> CheckpointHook | None:
        """The checkpoint guard for this fit (called in ``setup``, where the trainer is known)."""
        if self._checkpoint_dir is None:
            return None
        return LightningCheckpointGuard(trainer, self._checkpoint_dir, keep_last=self._keep_last,
                                        min_free_bytes=self._min_free_bytes)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._stop_agent("a new fit started")  # an earlier fit that never reached teardown
        kwargs = dict(self._agent_kwargs)
        guard = self.make_checkpoint_guard(trainer)
        if guard is not None:
            kwargs["checkpoint_hook"] = guard
        self.stop_reason = None
        self._last_step = None
        self.agent = SwitchAgent(**kwargs).start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        agent = self.agent
        step = int(trainer.global_step)
        # One boundary per optimizer step: with gradient accumulation, batches in between are not
        # safe points (a checkpoint there would lose the accumulated gradients).
        if agent is None or step == self._last_step:
            return
        self._last_step = step
        try:
            agent.step(step)
        except TrainingStopped as exc:
            self.stop_reason = str(exc)
            trainer.should_stop = True
            logger.error("ClusterD stopped training at step %d: %s", step, exc)
            if self._raise_on_stop:
                raise

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_agent(f"training raised {type(exception).__name__}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop_agent("training finished")

    def _stop_agent(self, reason: str) -> None:
        agent, self.agent = self.agent, None
        if agent is not None:
            agent.stop(reason)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
