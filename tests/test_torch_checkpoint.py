"""TorchCheckpointGuard with real torch (CPU): atomic saves, skips, retention, the disk floor, DCP."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

torch = pytest.importorskip("torch")

from nicswitch_agent import ConfigError, SwitchOrder  # noqa: E402
from nicswitch_agent.hooks.torch_checkpoint import (  # noqa: E402
    CheckpointFailed,
    GuardRecord,
    GuardRefused,
    TorchCheckpointGuard,
    _View,
    decide,
)

GiB = 1 << 30
Usage = namedtuple("Usage", "total used free")


def order(seq: int = 1) -> SwitchOrder:
    return SwitchOrder(seq=seq, job_id="job-1", ranks=(0, 1), ops=(True, True))


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Step:
    def __init__(self, value: int | None = 1) -> None:
        self.value = value

    def __call__(self) -> int | None:
        return self.value


def trained() -> tuple[Any, Any]:
    """A tiny model after one SGD step with momentum (so the optimizer has tensor state)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def make_guard(directory: Path, step: Step, clock: Clock | None = None, **kwargs: Any) -> TorchCheckpointGuard:
    model, optimizer = trained()
    kwargs.setdefault("min_interval_s", 0)
    kwargs.setdefault("min_free_bytes", 0)
    return TorchCheckpointGuard(
        directory, model=model, optimizer=optimizer, step=step, clock=clock or Clock(), **kwargs
    )


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- import and construction -----------------------------------------------------------------------


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys; import nicswitch_agent.hooks.torch_checkpoint as m; "
        "m.TorchCheckpointGuard('/nonexistent/x', state=dict, step=lambda: 1); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({}, "nothing to save"),
        ({"state": dict, "model": object()}, "not both"),
        ({"state": 3}, "state=3"),
        ({"state": dict, "step": 5}, "step=5"),
        ({"state": dict, "keep_last": 0}, "keep_last=0"),
        ({"state": dict, "keep_last": True}, "keep_last=True"),
        ({"state": dict, "min_interval_s": -1}, "min_interval_s=-1"),
        ({"state": dict, "min_interval_s": float("nan")}, "min_interval_s=nan"),
        ({"state": dict, "min_free_bytes": -1}, "min_free_bytes=-1"),
        ({"state": dict, "rank": -2}, "rank=-2"),
        ({"state": dict, "use_dcp": "yes"}, "use_dcp='yes'"),
        ({"state": dict, "directory": ""}, "directory=''"),
    ],
)
def test_construction_names_the_bad_argument(tmp_path: Path, kwargs: dict[str, Any], names: str) -> None:
    kwargs = {"directory": tmp_path, "step": Step(), **kwargs}
    with pytest.raises(ConfigError, match=names.replace("(", r"\(")):
        TorchCheckpointGuard(**kwargs)


# -- check() ---------------------------------------------------------------------------------------


def test_check_creates_the_directory(tmp_path: Path) -> None:
    guard = make_guard(tmp_path / "a" / "b", Step())
    guard.check()
    assert (tmp_path / "a" / "b").is_dir()
    assert listing(tmp_path / "a" / "b") == []  # the write probe is removed


@pytest.mark.parametrize("where", ["file-is-the-directory", "file-is-a-parent"])
def test_check_refuses_a_file_in_the_way(tmp_path: Path, where: str) -> None:
    (tmp_path / "blocker").write_text("not a directory")
    target = tmp_path / "blocker" if where == "file-is-the-directory" else tmp_path / "blocker" / "ckpt"
    guard = make_guard(target, Step())
    with pytest.raises(ConfigError, match=r"directory='.*blocker.*'"):
        guard.check()


def test_check_without_torch_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guard = TorchCheckpointGuard(tmp_path, state=dict, step=Step())
    monkeypatch.setitem(sys.modules, "torch", None)
    hint = r"needs torch \(python3 -m pip install '\.\[torch\]' in the nicswitch-agent checkout\)"
    with pytest.raises(ConfigError, match=hint):
        guard.check()


def test_check_warns_when_free_space_is_already_below_the_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10 * GiB, 10 * GiB - 5, 5))
    make_guard(tmp_path, Step(), min_free_bytes=GiB).check()
    assert any("below min_free_bytes" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# -- saving ----------------------------------------------------------------------------------------


def test_save_writes_the_step_directory_and_loads_back(tmp_path: Path) -> None:
    model, optimizer = trained()
    guard = TorchCheckpointGuard(
        tmp_path, model=model, optimizer=optimizer, step=Step(42), min_free_bytes=0, clock=Clock(1234.5)
    )
    guard(order(seq=3))

    assert listing(tmp_path) == ["step-42"]  # no temp dir left behind
    assert listing(tmp_path / "step-42") == ["nicswitch.json", "state.pt"]
    record = guard.last
    assert record is not None and record.saved and record.reason == "saved"
    assert (record.step, record.seq, record.path) == (42, 3, str(tmp_path / "step-42"))
    size = sum(p.stat().st_size for p in (tmp_path / "step-42").iterdir())
    assert 0 < record.bytes <= size and record.duration_s >= 0
    info = json.loads((tmp_path / "step-42" / "nicswitch.json").read_text())
    assert info["step"] == 42 and info["seq"] == 3 and info["job_id"] == "job-1"
    assert info["saved_at"] == 1234.5 and info["format"] == "torch.save" and info["bytes"] > 0

    loaded = torch.load(tmp_path / "step-42" / "state.pt", weights_only=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor)
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(loaded["optimizer"]["state"][0]["momentum_buffer"], momentum)
    fresh = torch.nn.Linear(4, 2)
    fresh.load_state_dict(loaded["model"])
    assert torch.equal(fresh.weight, model.weight)


def test_state_callable_is_what_is_saved(tmp_path: Path) -> None:
    guard = TorchCheckpointGuard(tmp_path, state=lambda: {"w": torch.arange(3)}, step=Step(1), min_free_bytes=0)
    guard(order())
    assert torch.equal(torch.load(tmp_path / "step-1" / "state.pt", weights_only=True)["w"], torch.arange(3))


def test_model_alone_or_optimizer_alone(tmp_path: Path) -> None:
    model, optimizer = trained()
    TorchCheckpointGuard(tmp_path / "m", model=model, step=Step(1), min_free_bytes=0)(order())
    TorchCheckpointGuard(tmp_path / "o", optimizer=optimizer, step=Step(1), min_free_bytes=0)(order())
    assert list(torch.load(tmp_path / "m" / "step-1" / "state.pt", weights_only=True)) == ["model"]
    assert list(torch.load(tmp_path / "o" / "step-1" / "state.pt", weights_only=True)) == ["optimizer"]


def test_failed_save_leaves_nothing_and_propagates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def partial_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", partial_save)
    guard = make_guard(tmp_path, Step(5))
    with pytest.raises(OSError, match="No space left"):
        guard(order())
    assert listing(tmp_path) == []
    assert guard.last is not None and not guard.last.saved
    assert guard.last.reason.startswith("failed: OSError") and guard.last.step == 5


def test_an_interrupt_while_deciding_is_recorded_with_the_parked_step(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands in the decision (a collective, with a process group): the guard's line names the
    step training is parked at, not "step None"."""
    def interrupted(path: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "disk_usage", interrupted)
    guard = make_guard(tmp_path, Step(5))
    with pytest.raises(KeyboardInterrupt):
        guard(order())
    assert guard.last is not None and not guard.last.saved
    assert guard.last.reason.startswith("failed: KeyboardInterrupt") and guard.last.step == 5


def test_failing_state_callable_refuses_and_writes_nothing(tmp_path: Path) -> None:
    guard = TorchCheckpointGuard(tmp_path, state=lambda: ["not", "a", "dict"], step=Step(1), min_free_bytes=0)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="state\\(\\) returned list"):
        guard(order())
    assert listing(tmp_path) == []


# -- skips -----------------------------------------------------------------------------------------


def test_same_step_is_skipped(tmp_path: Path) -> None:
    guard = make_guard(tmp_path, Step(7))
    guard(order(seq=1))
    before = (tmp_path / "step-7" / "state.pt").stat().st_mtime_ns
    guard(order(seq=2))  # a retried switch at the same parked step
    last = guard.last
    assert last == GuardRecord(False, "step 7 already checkpointed", 7, str(tmp_path / "step-7"),
                               last.duration_s if last else 0, 0, 2)
    assert (tmp_path / "step-7" / "state.pt").stat().st_mtime_ns == before
    assert [r.saved for r in guard.history] == [True, False]


def test_recent_checkpoint_is_skipped_until_the_interval_passes(tmp_path: Path) -> None:
    clock, step = Clock(), Step(1)
    guard = make_guard(tmp_path, step, clock, min_interval_s=300)
    guard(order())
    clock.now += 100
    step.value = 2
    guard(order(seq=2))
    assert guard.last is not None and not guard.last.saved
    assert guard.last.reason.startswith("last checkpoint 100.0 s ago (< min_interval_s=300)")
    assert guard.last.path == str(tmp_path / "step-1")
    clock.now += 200
    guard(order(seq=3))
    assert guard.last is not None and guard.last.saved
    assert listing(tmp_path) == ["step-1", "step-2"]


def test_a_later_steps_checkpoint_of_another_run_does_not_stand_in_for_the_parked_step(tmp_path: Path) -> None:
    """Found by an outside check: a new run in the same directory, parked at step 565, skipped its
    save because another run had saved step 1252 a moment ago; a dump would then have meant that
    checkpoint. Only a checkpoint of the parked step or an earlier one counts for the interval."""
    clock = Clock()
    make_guard(tmp_path, Step(1252), clock, min_interval_s=300)(order())
    clock.now += 10
    new_run = make_guard(tmp_path, Step(565), clock, min_interval_s=300)
    new_run(order())
    assert new_run.last is not None and new_run.last.saved, new_run.last
    assert listing(tmp_path) == ["step-1252", "step-565"]


def test_interval_survives_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save time is read from nicswitch.json, so a job that torchrun restarted (the same run
    id) does not save again at once."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    clock = Clock()
    make_guard(tmp_path, Step(1), clock, min_interval_s=300)(order())
    clock.now += 10
    restarted = make_guard(tmp_path, Step(2), clock, min_interval_s=300)
    restarted(order())
    assert restarted.last is not None and restarted.last.reason.startswith("last checkpoint 10.0 s ago")


@pytest.mark.parametrize("runs", [("run-a", "run-b"), ("", "")], ids=["torchrun", "no-run-id"])
def test_an_earlier_run_of_the_same_job_never_stands_in_for_the_parked_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: tuple[str, str]
) -> None:
    """Found by an outside check: the documented job started again with the same directory (and
    job id) parked at step 703 and kept the previous run's step-381, saved a minute before, as its
    checkpoint; nor may the earlier run's directory of the very step parked now count as saved.
    Without torchrun's run id every guard (process) is a run of its own."""
    clock = Clock()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", runs[0])
    first = make_guard(tmp_path, Step(381), clock, min_interval_s=300)
    first(order())
    make_guard(tmp_path, Step(703), clock, min_interval_s=0)(order())  # the step the next run parks at
    clock.now += 60
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", runs[1])
    rerun = make_guard(tmp_path, Step(703), clock, min_interval_s=300)
    rerun(order(seq=1))
    assert rerun.last is not None and rerun.last.saved, rerun.last
    info = json.loads((tmp_path / "step-703" / "nicswitch.json").read_text())
    assert info["run"] == rerun.run != first.run
    assert listing(tmp_path) == ["step-381", "step-703"]  # the replaced directory is gone
    rerun(order(seq=2))  # its own checkpoint of the step does count
    assert rerun.last is not None and rerun.last.reason == "step 703 already checkpointed"


def test_clock_moved_back_saves(tmp_path: Path) -> None:
    clock, step = Clock(), Step(1)
    guard = make_guard(tmp_path, step, clock, min_interval_s=300)
    guard(order())
    clock.now -= 3600
    step.value = 2
    guard(order())
    assert guard.last is not None and guard.last.saved


# -- retention -------------------------------------------------------------------------------------


def test_keep_last_removes_only_old_step_directories(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside"
    (outside / "step-0").mkdir(parents=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    (ckpt / "step-x").mkdir()
    (ckpt / "step-3.bak").mkdir()
    (ckpt / "step-2.pt").write_text("a file")
    (ckpt / "other").mkdir()
    (ckpt / "step-0").symlink_to(outside / "step-0")
    (ckpt / ".tmp-mine").mkdir()
    foreign = {"notes.txt", "step-x", "step-3.bak", "step-2.pt", "other", "step-0", ".tmp-mine"}

    step = Step()
    guard = make_guard(ckpt, step, keep_last=2)
    for value in (1, 2, 3, 4):
        step.value = value
        guard(order(seq=value))
    assert set(listing(ckpt)) == foreign | {"step-3", "step-4"}
    assert (outside / "step-0").is_dir() and (ckpt / "notes.txt").read_text() == "mine"
    assert any(r.getMessage().endswith("removed step-2)") for r in caplog.records)


def test_retention_orders_by_step_number_not_name(tmp_path: Path) -> None:
    step = Step()
    guard = make_guard(tmp_path, step, keep_last=2)
    for value in (9, 10, 100):
        step.value = value
        guard(order())
    assert listing(tmp_path) == ["step-10", "step-100"]


def test_the_checkpoint_just_taken_is_kept_after_a_rewind(tmp_path: Path) -> None:
    step = Step()
    guard = make_guard(tmp_path, step, keep_last=2)
    for value in (20, 30, 5):  # the job was restarted from an older checkpoint
        step.value = value
        guard(order())
    assert listing(tmp_path) == ["step-20", "step-30", "step-5"]


def test_temp_directories_of_killed_saves_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-step-3-4242-deadbeef"
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"x" * 100)
    make_guard(tmp_path, Step(4))(order())
    assert listing(tmp_path) == ["step-4"]


# -- the free-space floor --------------------------------------------------------------------------


def test_low_free_space_refuses_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100 * GiB, 100 * GiB - 512, 512))
    directory = tmp_path / "ckpt"
    guard = make_guard(directory, Step(8), min_free_bytes=GiB)
    with pytest.raises(GuardRefused) as info:
        guard(order())
    message = str(info.value)
    assert "512 bytes" in message and f"min_free_bytes={GiB}" in message and str(directory) in message
    assert "step 8" in message
    assert listing(directory) == []
    assert guard.last is not None and not guard.last.saved and guard.last.reason.startswith("refused:")


def test_floor_counts_the_size_of_the_newest_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step(1)
    guard = make_guard(tmp_path, step, min_free_bytes=1000)
    guard(order())
    size = guard.last.bytes if guard.last else 0
    free = {"bytes": 1000 + size - 1}
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(0, 0, free["bytes"]))
    step.value = 2
    with pytest.raises(GuardRefused, match=f"plus the expected checkpoint size {size}"):
        guard(order())
    free["bytes"] += 1
    guard(order())
    assert guard.last is not None and guard.last.saved


def test_a_skip_needs_no_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guard = make_guard(tmp_path, Step(3), min_free_bytes=GiB, use_dcp=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(0, 0, 10 * GiB))
    guard(order())
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(0, 0, 0))
    guard(order())  # same step: nothing to write, the switch may go ahead
    assert guard.last is not None and guard.last.reason == "step 3 already checkpointed"


def test_without_dcp_and_without_rank_the_guard_names_the_launchers_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Pause mode external takes this path on every rank of a job (no collective guard there): the
    log line and the record name torchrun's RANK, not rank 0 on every rank (a stranger saw
    ``[job-1/0/1]`` from all four ranks)."""
    monkeypatch.setenv("RANK", "3")
    guard = make_guard(tmp_path, Step(7), use_dcp=False)
    with caplog.at_level(logging.INFO, logger="nicswitch_agent"):
        guard(order())
    assert guard.last is not None and guard.last.saved
    assert any(f"[{order().job_id}/3/1] checkpoint step 7: saved" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nicswitch_agent"):
        make_guard(tmp_path / "given", Step(7), use_dcp=False, rank=5)(order())  # rank= still wins
    assert any(f"[{order().job_id}/5/1] checkpoint step 7: saved" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


# -- the parked step -------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "match"), [(None, "parked step is unknown"), (-1, "int >= 0"), (True, "int >= 0")])
def test_unusable_step_refuses(tmp_path: Path, value: Any, match: str) -> None:
    guard = make_guard(tmp_path, Step(value))
    with pytest.raises(GuardRefused, match=match):
        guard(order())
    assert listing(tmp_path) == []


def test_use_dcp_true_without_a_process_group(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use_dcp=True needs an initialised"):
        make_guard(tmp_path, Step(), use_dcp=True)(order())


# -- records and logs ------------------------------------------------------------------------------


def test_history_is_bounded(tmp_path: Path) -> None:
    guard = make_guard(tmp_path, Step(1))
    for seq in range(1, 106):
        guard(order(seq))
    history = guard.history
    assert len(history) == 100 and history[-1].seq == 105 and history[0].seq == 6


def test_one_info_line_per_save_or_skip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    guard = make_guard(tmp_path, Step(1))
    guard(order(seq=1))
    guard(order(seq=2))
    lines = [r.getMessage() for r in caplog.records if r.name == "nicswitch_agent.hooks"]
    assert len(lines) == 2
    assert lines[0].startswith("[job-1/0/1] checkpoint step 1: saved (path ") and "bytes" in lines[0]
    # A skip says it skipped and why, and names the checkpoint it kept: no "0 bytes" of a save.
    kept = tmp_path / "step-1"
    assert lines[1].startswith(f"[job-1/0/2] checkpoint step 1: skipped, step 1 already checkpointed (kept {kept}, "), \
        lines[1]
    assert "bytes" not in lines[1]


# -- the decision every rank takes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("views", "action", "reason"),
    [
        ([_View(0, 5, 10), _View(1, 5, 10)], "save", ""),
        ([_View(0, 5, 10, skip="step 5 already checkpointed"), _View(1, 5, 0)], "skip", "step 5 already"),
        ([_View(0, 5, 10), _View(1, 6, 10)], "refuse", "not parked at the same step (rank 0=5, rank 1=6)"),
        ([_View(0, 5, 10, skip="x"), _View(1, None, error="unknown step")], "refuse", "rank 1: unknown step"),
        ([_View(0, 5, 10), _View(1, 5, 3)], "refuse", "is 3 bytes on rank 1, below min_free_bytes=4"),
        ([_View(0, 5, 10, expected=7), _View(1, 5, 10)], "refuse", "plus the expected checkpoint size 7"),
    ],
)
def test_decide(views: list[_View], action: str, reason: str) -> None:
    decision = decide(views, min_free_bytes=4, directory=Path("/ckpt"))
    assert decision.action == action and reason in decision.reason


# -- two real processes with torch.distributed.checkpoint ------------------------------------------

WORLD = 2


def _init(rank: int, store: str) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=20)
    )
    return dist


def _train_step(model: Any, optimizer: Any, rank: int, dist: Any) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= WORLD
    optimizer.step()


def _worker(rank: int, tmp: str) -> None:
    """One rank: train, drive the guard through save/skip/refuse/save, then load in a fresh group."""
    directory = os.path.join(tmp, "ckpt")
    dist = _init(rank, os.path.join(tmp, "store-1"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train_step(model, optimizer, rank, dist)
        step = Step(7)
        guard = TorchCheckpointGuard(
            directory, model=model, optimizer=optimizer, step=step, keep_last=1, min_interval_s=300, min_free_bytes=0
        )
        guard.check()
        guard(order(seq=1))
        assert guard.last is not None and guard.last.saved, guard.last
        assert guard.last.path == os.path.join(directory, "step-7")

        guard(order(seq=2))  # a retry at the same parked step: skipped on every rank
        assert guard.last is not None and guard.last.reason == "step 7 already checkpointed", guard.last

        step.value = 8  # too soon after step 7: rank 0's reading of nicswitch.json decides for all
        guard(order(seq=3))
        assert guard.last is not None and guard.last.reason.startswith("last checkpoint "), guard.last

        step.value = 9 + rank  # ranks disagree on the step: every rank refuses
        with pytest.raises(GuardRefused, match="not parked at the same step"):
            guard(order(seq=4))

        guard.min_interval_s, guard.min_free_bytes = 0, 1000
        step.value = 11
        low = Usage(0, 0, 1) if rank == 1 else Usage(0, 0, 10 * GiB)
        with mock.patch.object(shutil, "disk_usage", lambda _: low), \
                pytest.raises(GuardRefused, match="1 bytes on rank 1"):
            guard(order(seq=5))  # only rank 1's disk is short: every rank refuses
        guard.min_free_bytes = 0

        def state() -> dict[str, Any]:
            if rank == 1:
                raise ZeroDivisionError("rank 1 cannot build its state")
            return {"x": torch.zeros(1)}

        failing = TorchCheckpointGuard(directory, state=state, step=step, min_interval_s=0, min_free_bytes=0)
        with pytest.raises(RuntimeError, match="state\\(\\) failed, nothing saved: rank 1: ZeroDivisionError"):
            failing(order(seq=5))  # state() raises on rank 1 only: every rank fails, nobody waits in dcp.save

        _train_step(model, optimizer, rank, dist)
        step.value = 12
        if rank == 0:  # a temp dir of a killed save with this very name: it must not leak into the checkpoint
            os.makedirs(os.path.join(directory, ".tmp-step-12-seq6"))
            Path(directory, ".tmp-step-12-seq6", "junk").write_text("stale")
        guard(order(seq=6))  # saves, and keep_last=1 removes step-7
        assert guard.last is not None and guard.last.saved, guard.last
        assert [r.saved for r in guard.history] == [True, False, False, False, False, True]
        expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    finally:
        dist.destroy_process_group()

    from torch.distributed.checkpoint import state_dict_loader

    dist = _init(rank, os.path.join(tmp, "store-2"))  # a fresh process group, a fresh model
    try:
        fresh = torch.nn.Linear(4, 2)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        state = {"model": fresh.state_dict()}
        state_dict_loader.load(state, checkpoint_id=os.path.join(directory, "step-12"))
        fresh.load_state_dict(state["model"])
        for name, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, expected[name]) and tensor.abs().sum() > 0, name
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_two_ranks_save_with_dcp_and_load_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's object collectives (used by DCP and by the guard's votes) unpickle through numpy.
    pytest.importorskip("numpy", reason="torch.distributed.checkpoint needs numpy")
    from torch.multiprocessing.spawn import start_processes

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback only; the children inherit it
    start_processes(_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")  # type: ignore[no-untyped-call]

    directory = tmp_path / "ckpt"
    assert listing(directory) == ["step-12"]  # step-7 gone (keep_last=1), no temp dirs
    files = listing(directory / "step-12")
    assert ".metadata" in files and "nicswitch.json" in files and sum(f.endswith(".distcp") for f in files) == WORLD
    assert "junk" not in files
    info = json.loads((directory / "step-12" / "nicswitch.json").read_text())
    assert info["format"] == "torch.distributed.checkpoint" and info["world_size"] == WORLD and info["seq"] == 6


def test_a_save_that_fails_with_a_base_exception_is_a_failed_guard_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an outside check: torch's CheckpointException (a BaseException, with every failed
    rank's traceback in its text) from a save into a read-only directory stopped training."""
    class CheckpointException(BaseException):  # as torch.distributed.checkpoint.api's
        def __init__(self, msg: str, failures: dict[int, Any]) -> None:
            super().__init__(msg, failures)
            self.failures = failures

    def read_only(tmp: Path) -> str:
        raise CheckpointException("CheckpointException ranks:dict_keys([1])\nTraceback ...",
                                  {1: (OSError(30, "Read-only file system"), "Traceback (most recent call last): ...")})

    guard = make_guard(tmp_path, Step(9))
    monkeypatch.setattr(guard, "_write_state", read_only)
    with pytest.raises(CheckpointFailed) as caught:
        guard(order())
    assert str(caught.value) == ("checkpoint of step 9 failed: CheckpointException: rank 1: OSError: [Errno 30] "
                                 "Read-only file system")
    assert guard.last is not None and not guard.last.saved and "\n" not in guard.last.reason
