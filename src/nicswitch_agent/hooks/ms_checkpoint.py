"""MindSporeCheckpointGuard: ``mindspore.save_checkpoint`` of the parked step, atomic and bounded on disk.

The same guard as :class:`~nicswitch_agent.hooks.torch_checkpoint.TorchCheckpointGuard` without a
process group (its skip, refuse, atomic rename and retention rules; see that module), writing
``<directory>/step-<S>/state.ckpt`` with ``mindspore.save_checkpoint``. Each process saves its own
state: give each its own ``directory``. MindSpore is imported lazily.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.torch_checkpoint import TorchCheckpointGuard, _fsync_file

STATE_FILE = "state.ckpt"
FORMAT = "mindspore.save_checkpoint"


class MindSporeCheckpointGuard(TorchCheckpointGuard):
    """Checkpoint the parked step with ``mindspore.save_checkpoint`` before a switch.

    Args:
        state: Returns what ``mindspore.save_checkpoint`` takes: a ``Cell``, or a dict of names to
            Parameters/Tensors, or a list of ``{"name", "data"}`` dicts. Called only when a save happens.
        directory, step, keep_last, min_interval_s, min_free_bytes, rank, clock: as for
            TorchCheckpointGuard (``step`` returns the parked step, e.g. ``lambda: agent.last_step``).

    Raises:
        ConfigError: naming the argument, when one is invalid.
    """

    def __init__(self, state: Callable[[], Any], directory: str | os.PathLike[str], *,
                 step: Callable[[], int | None], keep_last: int = 2, min_interval_s: float = 300.0,
                 min_free_bytes: int = 1 << 30, rank: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not callable(state):
            raise ConfigError(f"state={state!r} must be a callable returning what mindspore.save_checkpoint takes")
        super().__init__(directory, state=state, step=step, keep_last=keep_last, min_interval_s=min_interval_s,
                         min_free_bytes=min_free_bytes, rank=rank, use_dcp=False, clock=clock)

    def check(self) -> None:
        """Fail fast at start: MindSpore importable, ``directory`` created and writable.

        Raises:
            ConfigError: naming what is missing or wrong.
        """
        try:
            importlib.import_module("mindspore")
        except ImportError as exc:
            raise ConfigError(f"MindSporeCheckpointGuard needs MindSpore (python3 -m pip install '.[mindspore]' "
                              f"in the nicswitch-agent checkout); import failed: {exc}") from exc
        self._check_directory()

    def _make_state(self) -> Any:
        assert self._state is not None
        return self._state()

    def _write_state(self, tmp: Path) -> str:
        import mindspore

        target = tmp / STATE_FILE
        mindspore.save_checkpoint(self._make_state(), str(target))
        _fsync_file(target)
        return FORMAT


__all__ = ["FORMAT", "STATE_FILE", "MindSporeCheckpointGuard"]
