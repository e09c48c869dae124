"""TorchCheckpointGuard: save model/optimizer state before a link switch, without filling the disk.

Every failed switch costs ClusterD a recovery and usually a checkpoint, and an operator who retries
a failing switch can repeat that many times (ClusterD's API page warns about disk exhaustion). So
this guard is deliberately frugal:

- it **skips** the save when ``<directory>/step-<S>`` already exists (a retried switch at the same
  parked step), or when the newest checkpoint is younger than ``min_interval_s``; a skip is a
  success (the switch runs) and is recorded in :attr:`TorchCheckpointGuard.last`. Only this
  run's checkpoints count (:func:`run_id`): a directory reused by an earlier run (the same
  command started again) holds checkpoints of other training, which must never stand in for the
  parked step; another run's ``step-<S>`` is saved over;
- it **refuses** (raises :class:`GuardRefused`, so the switch does not run and the reply is false)
  when free space minus the size of the newest checkpoint is below ``min_free_bytes``, before
  writing anything;
- it writes into ``<directory>/.tmp-step-<S>-...`` and ``os.replace``s that into ``step-<S>``, so a
  ``step-*`` directory is always complete; on any failure the temporary directory is removed and the
  exception propagates (the switch is refused);
- after a save it keeps the newest ``keep_last`` ``step-<int>`` directories by step number (always
  including the one just written), removes temporary directories left by killed saves, and never
  touches anything else.

Layout::

    <directory>/step-<S>/state.pt            torch.save (no process group)
    <directory>/step-<S>/.metadata, *.distcp  torch.distributed.checkpoint (process group)
    <directory>/step-<S>/nicswitch.json       step, seq, job, run, saved_at (wall clock), bytes, format

With a process group (``torch.distributed`` initialised, ``use_dcp`` not False) the save is
``torch.distributed.checkpoint.save``, a collective: every rank must call the guard for the same
order at the same parked step (the agent does, in pause mode ``agent``), and every decision (save,
skip, refuse) must be the same on all ranks, or some ranks would wait forever in the collective
while others went on to switch. So each rank reports what it sees (its step, its free space, any
error) in one ``all_gather_object``, rank 0 adds the skip decision from the directory contents and
the ``saved_at`` it finds in the newest ``nicswitch.json`` (rank 0's clock only: per-rank clocks
differ), and every rank derives the same outcome from the same gathered list. The directory must be
on a filesystem all ranks share, with one job writing to it.

Without a process group each process saves its own state with ``torch.save``; give each process
its own ``directory``. For sharded models (FSDP) pass ``state=`` built with
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``.

torch is imported lazily: importing this module does not import torch.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from nicswitch_agent.errors import ConfigError, HookRefused, NicSwitchError
from nicswitch_agent.hooks.base import CheckpointGuard
from nicswitch_agent.orders import SwitchOrder

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("nicswitch_agent.hooks")

STEP_DIR = re.compile(r"^step-(\d+)$")
"""The only names retention may delete (besides this guard's own temporary directories)."""

TEMP_DIR = re.compile(r"^\.tmp-step-\d+-")
RUN_ENV = "TORCHELASTIC_RUN_ID"
"""torchrun's run id: the same in every process of one torchrun and across its restarts."""
INFO_FILE = "nicswitch.json"
STATE_FILE = "state.pt"
HISTORY_LIMIT = 100
FORMAT_DCP = "torch.distributed.checkpoint"
FORMAT_TORCH_SAVE = "torch.save"


class GuardRefused(HookRefused):
    """The guard refused the switch (e.g. too little free space): reply false, no traceback logged."""


@dataclass(frozen=True)
class GuardRecord:
    """What one call of the guard did.

    Attributes:
        saved: True if this call wrote a checkpoint.
        reason: ``"saved"``, why it skipped (``"step 7 already checkpointed"``), or why it refused
            or failed (``"refused: ..."``, ``"failed: ..."``).
        step: The parked step, when known.
        path: The checkpoint this call wrote, or the existing one that made it skip.
        duration_s: Time the call took, decision included.
        bytes: Size of the checkpoint written (0 when nothing was written).
        seq: The order's sequence number.
    """

    saved: bool
    reason: str
    step: int | None
    path: str | None
    duration_s: float
    bytes: int
    seq: int = 0


@dataclass(frozen=True)
class _View:
    """What one rank sees before a save; gathered from every rank in DCP mode."""

    rank: int
    step: int | None = None
    free: int = 0
    error: str | None = None
    # Filled by the rank that owns the directory (rank 0) only:
    skip: str | None = None
    skip_path: str | None = None
    expected: int = 0  # size of the newest checkpoint: what the next one will probably need


@dataclass(frozen=True)
class _Decision:
    action: str  # "save" | "skip" | "refuse"
    reason: str = ""
    step: int | None = None
    path: str | None = None


def decide(views: list[_View], *, min_free_bytes: int, directory: Path) -> _Decision:
    """Turn every rank's view into one outcome; a pure function, so every rank computes the same.

    Order: any rank's error refuses; ranks parked at different steps refuse; rank 0's skip wins
    (nothing is written, so free space does not matter); then the free-space floor; then save.
    """
    errors = [f"rank {v.rank}: {v.error}" for v in views if v.error is not None]
    if errors:
        return _Decision("refuse", "; ".join(errors))
    steps = sorted({v.step for v in views if v.step is not None})
    if len(steps) != 1:
        by_rank = ", ".join(f"rank {v.rank}={v.step}" for v in views)
        return _Decision("refuse", f"ranks are not parked at the same step ({by_rank})")
    step = steps[0]
    lead = views[0]
    if lead.skip is not None:
        return _Decision("skip", lead.skip, step, lead.skip_path)
    short = [v for v in views if v.free - lead.expected < min_free_bytes]
    if short:
        worst = min(short, key=lambda v: v.free)
        need = f"min_free_bytes={min_free_bytes}" + (
            f" plus the expected checkpoint size {lead.expected}" if lead.expected else ""
        )
        where = f" on rank {worst.rank}" if len(views) > 1 else ""
        return _Decision(
            "refuse",
            f"free space in {directory} is {worst.free} bytes{where}, below {need}: not checkpointing step {step}",
            step,
        )
    return _Decision("save", "", step)


class CheckpointFailed(RuntimeError):
    """A save failed with an exception that is no ``Exception`` (torch's ``CheckpointException``)."""


class TorchCheckpointGuard(CheckpointGuard):
    """Checkpoint the parked step before a switch: atomic, deduplicated, bounded on disk.

    Args:
        directory: Where ``step-<S>`` directories go (created by :meth:`check`). Shared by all
            ranks in DCP mode; one job (one process without DCP) per directory.
        state: Returns the state to save. Called on every rank, only when a save happens.
        model: Saved as ``state["model"] = model.state_dict()`` when ``state`` is not given.
        optimizer: Saved as ``state["optimizer"] = optimizer.state_dict()`` likewise.
        step: Returns the parked step (e.g. ``lambda: agent.last_step``); identical on all ranks.
        keep_last: How many ``step-*`` directories to keep (newest by step number), >= 1.
        min_interval_s: Skip the save when this run's newest checkpoint is younger than this.
        min_free_bytes: Refuse when free space minus the newest checkpoint's size is below this.
        rank: This process's rank for logs and records without DCP (default: the process group's
            rank, else torchrun's ``RANK``, else 0). With DCP the process group's rank is used (and
            a different ``rank`` is refused).
        use_dcp: True: always ``torch.distributed.checkpoint`` (needs a process group); False:
            always ``torch.save``; None: DCP when ``torch.distributed`` is initialised.
        clock: Wall clock for ``saved_at`` and the interval (seconds since the epoch).

    Raises:
        ConfigError: naming the argument, when one is invalid.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        state: Callable[[], dict[str, Any]] | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        step: Callable[[], int | None],
        keep_last: int = 2,
        min_interval_s: float = 300.0,
        min_free_bytes: int = 1 << 30,
        rank: int | None = None,
        use_dcp: bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ConfigError(f"directory={directory!r} must be a non-empty path")
        if state is not None and (model is not None or optimizer is not None):
            raise ConfigError("pass either state=... or model=/optimizer=..., not both")
        if state is None and model is None and optimizer is None:
            raise ConfigError("nothing to save: pass state=callable, or model= and/or optimizer=")
        if state is not None and not callable(state):
            raise ConfigError(f"state={state!r} must be a callable returning a dict")
        if not callable(step):
            raise ConfigError(f"step={step!r} must be a callable returning the parked step (lambda: agent.last_step)")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last={keep_last!r} must be an int >= 1")
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or not min_interval_s >= 0:
            raise ConfigError(f"min_interval_s={min_interval_s!r} must be a number >= 0")
        if isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int) or min_free_bytes < 0:
            raise ConfigError(f"min_free_bytes={min_free_bytes!r} must be an int >= 0")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"rank={rank!r} must be an int >= 0 or None")
        if use_dcp not in (None, True, False):
            raise ConfigError(f"use_dcp={use_dcp!r} must be True, False or None")
        self.directory = Path(directory).expanduser().resolve()
        self._state = state
        self._model = model
        self._optimizer = optimizer
        self._step = step
        self.keep_last = keep_last
        self.min_interval_s = float(min_interval_s)
        self.min_free_bytes = min_free_bytes
        self._rank = rank
        self.use_dcp = use_dcp
        self._clock = clock
        self.run = run_id()
        self._lock = threading.Lock()  # guards _history (read by status threads, written by calls)
        self._history: collections.deque[GuardRecord] = collections.deque(maxlen=HISTORY_LIMIT)

    # -- public surface ----------------------------------------------------------------------------

    @property
    def last(self) -> GuardRecord | None:
        """The record of the last call, or None before the first."""
        with self._lock:
            return self._history[-1] if self._history else None

    @property
    def history(self) -> list[GuardRecord]:
        """Records of the last calls (at most 100), oldest first."""
        with self._lock:
            return list(self._history)

    @property
    def runs_collectives(self) -> bool:
        """True when it saves over the process group (DCP and its votes are collectives): then it
        may only run on the parked training thread, and pause mode external refuses it at start."""
        return self.use_dcp is True or (self.use_dcp is None and _initialised_dist() is not None)

    def check(self) -> None:
        """Fail fast at start: torch importable, ``directory`` created and writable.

        Raises:
            ConfigError: naming ``directory`` or ``use_dcp`` and what is wrong.
        """
        try:
            importlib.import_module("torch")
        except ImportError as exc:
            raise ConfigError(
                f"TorchCheckpointGuard needs torch (python3 -m pip install '.[torch]' in the nicswitch-agent "
                f"checkout); import failed: {exc}"
            ) from exc
        if self.use_dcp or (self.use_dcp is None and _initialised_dist() is not None):
            try:
                # DCP and this guard's votes are object collectives, and torch unpickles those with numpy.
                for module in ("torch.distributed.checkpoint", "numpy"):
                    importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(
                    f"use_dcp={self.use_dcp}: a checkpoint over the process group needs torch.distributed.checkpoint "
                    f"and numpy (its object collectives use numpy); import failed: {exc}"
                ) from exc
        self._check_directory()

    def _check_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"directory={str(self.directory)!r} cannot be created: {exc}") from exc
        if not self.directory.is_dir():
            raise ConfigError(f"directory={str(self.directory)!r} is not a directory")
        try:  # a real write: os.access() says yes to root on a read-only mount
            fd, probe = _mkstemp(self.directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"directory={str(self.directory)!r} is not writable: {exc}") from exc
        free = shutil.disk_usage(self.directory).free
        if free < self.min_free_bytes:
            logger.warning(
                "checkpoint directory %s has %d bytes free, below min_free_bytes=%d: switches will be refused",
                self.directory, free, self.min_free_bytes,
            )

    def __call__(self, order: SwitchOrder) -> None:
        """Save (or skip) a checkpoint of the parked step; raise to refuse the switch.

        Raises:
            GuardRefused: when a rank cannot tell its step, ranks disagree on it, or free space is
                below the floor; nothing was written.
            Exception: whatever the save raised (the temporary directory is removed first).
        """
        started = time.monotonic()
        dist = None if self.use_dcp is False else _initialised_dist()
        if self.use_dcp and dist is None:
            raise ConfigError("use_dcp=True needs an initialised torch.distributed process group")
        saver = _DcpSave(self, dist) if dist is not None else _LocalSave(self)

        def record(saved: bool, reason: str, step: int | None, path: str | None = None, size: int = 0,
                   level: int = logging.INFO, note: str = "", skipped: bool = False) -> None:
            self._record(order, saver.rank, GuardRecord(
                saved, reason, step, path, time.monotonic() - started, size, order.seq
            ), level=level, note=note, skipped=skipped)

        try:
            decision = saver.decide(order)
        except BaseException as exc:  # (Ctrl-C in the decision's collective, say): the parked step if known
            record(False, f"failed: {_describe(exc)}", self._step_if_known(), level=logging.WARNING)
            raise
        step = decision.step
        if decision.action == "refuse":
            record(False, f"refused: {decision.reason}", step, level=logging.WARNING)
            raise GuardRefused(decision.reason)
        if decision.action == "skip":
            record(False, decision.reason, step, decision.path, skipped=True)
            return
        assert step is not None
        try:
            path, size, removed = saver.save(order, step, started)
        except BaseException as exc:
            record(False, f"failed: {_describe(exc)}", step, level=logging.WARNING)
            if isinstance(exc, (Exception, KeyboardInterrupt, SystemExit)):
                raise
            # torch's CheckpointException is a BaseException, a stop to callers: this is a failed guard
            raise CheckpointFailed(f"checkpoint of step {step} failed: {_describe(exc)}") from exc
        record(True, "saved", step, str(path), size, note=f", removed {', '.join(removed)}" if removed else "")

    # -- helpers used by the savers ----------------------------------------------------------------

    def _view(self, order: SwitchOrder, rank: int, *, owner: bool, tmp_name: Callable[[int], str] | None) -> _View:
        """What this rank sees; errors become part of the view, so all ranks can refuse together."""
        step: int | None = None
        try:
            step = self._read_step()
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
            if not owner:
                return _View(rank, step, free)
            if tmp_name is not None:  # a fixed temp name may be left over by a killed save: start clean
                _remove_tree(self.directory / tmp_name(step))
            skip, skip_path, expected = self._skip_reason(step, order.job_id)
            return _View(rank, step, free, None, skip, skip_path, expected)
        except Exception as exc:
            return _View(rank, step, error=str(exc) if isinstance(exc, NicSwitchError) else _describe(exc))

    def _step_if_known(self) -> int | None:
        try:
            return self._read_step()
        except Exception:
            return None

    def _read_step(self) -> int:
        value = self._step()
        if value is None:
            raise GuardRefused("the parked step is unknown (step() returned None; call agent.step(step) each step)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"step() returned {value!r}; it must return the parked step as an int >= 0")
        return value

    def _skip_reason(self, step: int, job_id: str) -> tuple[str | None, str | None, int]:
        """(skip reason, path that caused it, size of the newest checkpoint) from the directory.

        Only this run's checkpoints (the job's, written under this run id) may stand in for the
        parked step: an outside check found a rerun of the same command keeping the previous
        run's step-381 for its step 703 (an earlier step, saved a minute before)."""
        checkpoints = list(self._checkpoints())
        newest = max(checkpoints, key=lambda c: c[1], default=None)
        expected = newest[2] if newest is not None else 0
        ours = [c for c in checkpoints if c[4] == (job_id, self.run)]
        same = next((c[0] for c in ours if c[3] == step), None)
        if same is not None:
            return f"step {step} already checkpointed", str(same), expected
        # Only a checkpoint of this step or an earlier one may stand in for it: one of a later
        # step is not the parked state's past (a run whose training was reset, say).
        newest = max((c for c in ours if c[3] <= step), key=lambda c: c[1], default=None)
        if newest is not None and self.min_interval_s > 0:
            age = self._clock() - newest[1]
            # A negative age means the clock moved back: trust neither, and save.
            if 0 <= age < self.min_interval_s:
                return (
                    f"last checkpoint {age:.1f} s ago (< min_interval_s={self.min_interval_s:g}): {newest[0].name}",
                    str(newest[0]),
                    expected,
                )
        return None, None, expected

    def _checkpoints(self) -> Iterator[tuple[Path, float, int, int, tuple[str, str] | None]]:
        """(path, saved_at, bytes, step, (job, run) that wrote it) of each ``step-<int>`` directory;
        saved_at from its JSON, else mtime; the writer None when the JSON does not name it."""
        for path, step in _step_dirs(self.directory):
            saved_at, size, writer = path.stat().st_mtime, 0, None
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
                info = json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
                saved_at, size = float(info["saved_at"]), int(info["bytes"])
                writer = (str(info["job_id"]), str(info["run"]))
            yield path, saved_at, size, step, writer

    def _make_state(self) -> dict[str, Any]:
        if self._state is not None:
            state = self._state()
            if not isinstance(state, dict):
                raise ConfigError(f"state() returned {type(state).__name__}; it must return a dict")
            return state
        state = {}
        if self._model is not None:
            state["model"] = self._model.state_dict()
        if self._optimizer is not None:
            state["optimizer"] = self._optimizer.state_dict()
        return state

    def _write_state(self, tmp: Path) -> str:
        """Write this process's state into ``tmp`` (durably); returns the format's name."""
        import torch

        target = tmp / STATE_FILE
        torch.save(self._make_state(), target)
        _fsync_file(target)
        return FORMAT_TORCH_SAVE

    def _finish(self, order: SwitchOrder, step: int, tmp: Path, fmt: str, world: int, started: float
                ) -> tuple[Path, int, list[str]]:
        """Owner only: write the JSON, rename into place, apply retention. Returns (path, bytes, removed)."""
        final = self.directory / f"step-{step}"
        _inside(self.directory, final)
        size = _tree_size(tmp)
        info = {
            "step": step, "seq": order.seq, "job_id": order.job_id, "run": self.run, "format": fmt, "world_size": world,
            "saved_at": self._clock(), "duration_s": round(time.monotonic() - started, 6), "bytes": size,
        }
        _write_synced(tmp / INFO_FILE, json.dumps(info, indent=1).encode())
        if final.is_dir():  # another run's step-<S> (this run's would have been skipped): out of the way first
            aside = tmp.with_name(f"{tmp.name}-replaced")  # a temp name: retention removes it
            _remove_tree(aside)  # one a killed save left (DCP's temp names are fixed)
            os.replace(final, aside)
        os.replace(tmp, final)  # atomic: step-<S> is either absent or complete
        _fsync_dir(self.directory)
        return final, size, self._retain(final)

    def _retain(self, just_saved: Path) -> list[str]:
        """Keep the newest ``keep_last`` step dirs (and the one just saved); drop stale temp dirs."""
        removed: list[str] = []
        dirs = sorted(_step_dirs(self.directory), key=lambda d: d[1], reverse=True)
        keep = {p for p, _ in dirs[: self.keep_last]} | {just_saved}
        doomed = [p for p, _ in dirs if p not in keep]
        # Temp dirs left by saves that were killed (the job was stopped mid-save): each can be as big
        # as a checkpoint, and they are exactly what fills a disk after repeated failed switches.
        doomed += [self.directory / e.name for e in os.scandir(self.directory)
                   if TEMP_DIR.match(e.name) and e.is_dir(follow_symlinks=False)]
        for path in doomed:
            try:
                _inside(self.directory, path)
                shutil.rmtree(path)
                removed.append(path.name)
            except (OSError, ValueError) as exc:  # the checkpoint is saved; a leftover is not a failure
                logger.warning("could not remove old checkpoint %s: %s", path, exc)
        return removed

    def _record(self, order: SwitchOrder, rank: int, record: GuardRecord, *, level: int = logging.INFO,
                note: str = "", skipped: bool = False) -> None:
        with self._lock:
            self._history.append(record)
        where = f"[{order.job_id}/{rank}/{order.seq}] checkpoint step {record.step}"
        if record.saved:
            logger.log(level, "%s: saved (path %s, %d bytes, %.3f s%s)", where, record.path, record.bytes,
                       record.duration_s, note)
        elif skipped:  # nothing written: a size would read as an empty checkpoint
            logger.log(level, "%s: skipped, %s (kept %s, %.3f s)", where, record.reason, record.path,
                       record.duration_s)
        else:
            logger.log(level, "%s: %s (nothing written, %.3f s)", where, record.reason, record.duration_s)


class _LocalSave:
    """No process group (or ``use_dcp=False``): this process decides alone and writes ``state.pt``
    with ``torch.save``. Its rank (for the records and the log) is ``rank=``, else the process
    group's or torchrun's ``RANK`` (pause mode external takes this path in every rank of a job)."""

    def __init__(self, guard: TorchCheckpointGuard) -> None:
        self.guard = guard
        self.rank = guard._rank if guard._rank is not None else _process_rank()

    def decide(self, order: SwitchOrder) -> _Decision:
        view = self.guard._view(order, self.rank, owner=True, tmp_name=None)
        return decide([view], min_free_bytes=self.guard.min_free_bytes, directory=self.guard.directory)

    def save(self, order: SwitchOrder, step: int, started: float) -> tuple[Path, int, list[str]]:
        guard = self.guard
        tmp = guard.directory / f".tmp-step-{step}-{os.getpid()}-{secrets.token_hex(4)}"
        _inside(guard.directory, tmp)
        try:
            tmp.mkdir()
            return guard._finish(order, step, tmp, guard._write_state(tmp), 1, started)
        except BaseException:
            _remove_tree(tmp)
            raise


class _DcpSave:
    """A process group exists: every rank takes part; rank 0 owns the directory.

    Collectives, in order: ``all_gather_object`` of views (the decision), ``all_gather_object`` of
    ``state()`` outcomes (so one rank's failing ``state()`` cannot leave the others waiting inside
    ``dcp.save``), ``dcp.save``, ``barrier``, ``broadcast_object_list`` of rank 0's outcome.
    """

    def __init__(self, guard: TorchCheckpointGuard, dist: ModuleType) -> None:
        self.guard = guard
        self.dist = dist
        self.rank: int = dist.get_rank()
        self.world: int = dist.get_world_size()

    @staticmethod
    def tmp_name(order: SwitchOrder) -> Callable[[int], str]:
        # dcp.save is collective over one checkpoint_id: the name must be the same on every rank,
        # so it comes from values every rank shares (step, seq), not from a pid or a nonce.
        return lambda step: f".tmp-step-{step}-seq{order.seq}"

    def decide(self, order: SwitchOrder) -> _Decision:
        guard = self.guard
        if guard._rank is not None and guard._rank != self.rank:
            view = _View(self.rank, error=f"rank={guard._rank} but torch.distributed.get_rank()={self.rank}")
        else:
            view = guard._view(order, self.rank, owner=self.rank == 0, tmp_name=self.tmp_name(order))
        views = self._gather(view)
        return decide(views, min_free_bytes=guard.min_free_bytes, directory=guard.directory)

    def save(self, order: SwitchOrder, step: int, started: float) -> tuple[Path, int, list[str]]:
        # torch.distributed.checkpoint.save, from the module that defines (and types) it.
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        guard, dist = self.guard, self.dist
        tmp = guard.directory / self.tmp_name(order)(step)
        _inside(guard.directory, tmp)
        try:
            state: dict[str, Any] | None = None
            error: str | None = None
            try:
                state = guard._make_state()
            except Exception as exc:
                error = _describe(exc)
            failed = [f"rank {r}: {e}" for r, e in enumerate(self._gather(error)) if e is not None]
            if failed:
                raise RuntimeError(f"state() failed, nothing saved: {'; '.join(failed)}")
            assert state is not None
            dcp_save(state, checkpoint_id=str(tmp))
            # Rank 0 renames the directory every rank wrote into: no rank may still be writing.
            # dcp.save already ends with a collective in torch 2.x, but the barrier makes the
            # guarantee ours rather than a detail of DCP's implementation or of a storage writer.
            dist.barrier()
            outcome: tuple[str, int, list[str]] | str | None = None
            if self.rank == 0:
                try:
                    final, size, removed = guard._finish(order, step, tmp, FORMAT_DCP, self.world, started)
                    outcome = (str(final), size, removed)
                except Exception as exc:
                    outcome = _describe(exc)
            # Also the second synchronisation: no rank returns (and switches) before the rename,
            # and a failed rename on rank 0 fails the guard on every rank alike.
            box: list[Any] = [outcome]
            dist.broadcast_object_list(box, src=0)
            outcome = box[0]
            if not isinstance(outcome, tuple):
                raise RuntimeError(f"rank 0 could not finish the checkpoint: {outcome}")
            return Path(outcome[0]), outcome[1], outcome[2]
        except BaseException:
            _remove_tree(tmp)
            raise

    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


# -- filesystem helpers ----------------------------------------------------------------------------


def _process_rank() -> int:
    """This process's global rank as torch.distributed or the launcher says (torchrun's ``RANK``,
    msrun's ``RANK_ID``); else 0. Imports nothing: MindSporeCheckpointGuard runs without torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for name in ("RANK", "RANK_ID"):
        raw = os.environ.get(name, "").strip()
        if raw.isascii() and raw.isdigit():
            return int(raw)
    return 0


def _initialised_dist() -> ModuleType | None:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def run_id() -> str:
    """What tells this run's checkpoints from another's in a shared directory: torchrun's run id
    (kept across torchrun's restarts of the job, so a restarted process still finds the
    interval's checkpoint), else one of this process's own."""
    return os.environ.get(RUN_ENV, "").strip() or f"process-{os.getpid()}-{secrets.token_hex(4)}"


def _step_dirs(directory: Path) -> Iterator[tuple[Path, int]]:
    """(path, step) of each real directory named ``step-<int>`` (symlinks are never followed)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            yield directory / entry.name, int(match.group(1))


def _inside(directory: Path, path: Path) -> None:
    """Refuse any path that does not resolve to a direct child of ``directory``."""
    if path.parent.resolve() != directory or path.name in ("", ".", "..") or path.is_symlink():
        raise ValueError(f"refusing to touch {path}: not a directory entry of {directory}")


def _remove_tree(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
    return total


def _mkstemp(directory: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=".nicswitch-probe-", dir=directory)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes the rename durable; some filesystems cannot fsync a directory, which is not an error.
    with contextlib.suppress(OSError):
        _fsync_file(path)


def _describe(exc: BaseException) -> str:
    """One line: torch's CheckpointException holds every failed rank's traceback (40 lines a rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # {rank: (error, its traceback)}: the errors say it
        errors = {rank: f[0] if isinstance(f, tuple) and f else f for rank, f in failures.items()}
        return f"{type(exc).__name__}: " + "; ".join(
            f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(errors.items(), key=lambda i: str(i[0])))
    return f"{type(exc).__name__}: {exc}"
