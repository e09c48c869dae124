"""One rank of a small real training job, for tests/test_torch_multiprocess.py.

Run as ``python -m tests.torch_job.worker`` (or by path) with the torch.distributed env (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the agent's env (NICSWITCH_SERVER, NICSWITCH_JOB_ID,
NICSWITCH_PAUSE and any other NICSWITCH_* setting) and these knobs:

    NSW_OUT             output directory (required); files are named rank<r>.*
    NSW_MAX_STEPS       stop after this many steps (default 100000)
    NSW_STEP_SLEEP_S    pause between steps, to leave CPU to the others (default 0.004)
    NSW_HOOK            "record" (default): a recording switch hook; "default": no switch_hook,
                        so the agent's default TorchNpuSwitcher runs (put the fake torch_npu on
                        PYTHONPATH; it records its arguments to FAKE_TORCH_NPU_LOG)
    NSW_CHECKPOINT      "guard" (default): TorchCheckpointGuard with torch.save into <out>/ckpt/rank<r>;
                        "dcp": TorchCheckpointGuard over the process group (torch.distributed.checkpoint,
                        a collective; needs numpy) into the shared <out>/ckpt; "none"
    NSW_FAIL_RANK       this rank's switch hook returns False for its first NSW_FAIL_CALLS calls (1)
    NSW_HANG_RANK       this rank's switch hook blocks until <out>/unhang exists, in its first call
                        for order NSW_HANG_SEQ (default 1)
    NSW_ON_PEER_LOSS    "exit" (default): a failed collective ends the process (exit code 4);
                        "continue": go on stepping locally (no collectives) and keep the agent up
    NSW_PG_TIMEOUT_S    process group timeout (default 30)
    NSW_VERIFY          "probe": TorchLinkProbe on the default group as the verify hook; "probe-subgroup":
                        on a group of every rank made for it ("dp"); unset: no verify hook
    NSW_PROBE_TIMEOUT_S the probe's timeout_s (default 5)
    NSW_BREAK_GROUP_RANK this rank's switch hook destroys the probe's subgroup in its first call (its
                        communicator is gone after its switch)

The training: nn.Linear(8, 1) in float64, full-batch gradient descent on a fixed noiseless
regression task sharded over the ranks; gradients, loss and the stop flag are summed in one
all_reduce per step. Every rank therefore sees the same global loss, which falls strictly at every
step (a convex quadratic, lr below 1/L), and all ranks stop after the same step: the stop flag
(``<out>/stop`` exists, or NSW_MAX_STEPS reached) is part of the all_reduce.

Output (one JSON object per line, flushed at once):

    rank<r>.steps.jsonl    {"step", "loss", "w"} per step (w: sum of all parameters after the step)
    rank<r>.hooks.jsonl    {"kind": "switch"|"guard"|"warm-up"|"verify", "seq", "step", "ranks", "ops", "thread", ...}
    rank<r>.events.jsonl   every AgentEvent
    rank<r>.result.json    when training ends: {"status": "done"|"stopped"|"error", "reason", "agent": status()},
                           written again with "stop_s" (how long agent.stop() took) once it returns

Exit codes: 0 done, 3 TrainingStopped, 4 error (e.g. a collective failed), 5 could not start.
"""

from __future__ import annotations

import os
import signal

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: no timed-out-wait spam or DNS stalls
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import datetime
import faulthandler
import json
import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from nicswitch_agent import SwitchAgent, SwitchOrder, TorchLinkProbe
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.hooks.torch_checkpoint import TorchCheckpointGuard

EXIT_DONE, EXIT_STOPPED, EXIT_ERROR, EXIT_START = 0, 3, 4, 5
SAMPLES, FEATURES, LR = 240, 8, 0.2  # 240 rows split evenly over 2, 3 or 4 ranks


def env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


class JsonLines:
    """Append-only JSON lines, one flush per line, safe from several threads."""

    def __init__(self, path: Path) -> None:
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed at exit
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


class RecordingSwitch:
    """The switch hook: records every call; fails or hangs on the rank the knobs name."""

    def __init__(self, rank: int, out: Path, log: JsonLines, step: Any) -> None:
        self.rank = rank
        self.out = out
        self.log = log
        self.step = step
        self.calls = 0
        self.fail = env_int("NSW_FAIL_RANK", None) == rank
        self.fail_calls = env_int("NSW_FAIL_CALLS", 1) or 0
        self.hang = env_int("NSW_HANG_RANK", None) == rank
        self.hang_seq = env_int("NSW_HANG_SEQ", 1)
        self.seqs_seen: set[int] = set()
        self.break_group: Any = None  # destroyed in the first call on NSW_BREAK_GROUP_RANK

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls += 1
        record = {"kind": "switch", "call": self.calls, "seq": order.seq, "step": self.step(),
                  "ranks": list(order.ranks), "ops": list(order.ops),
                  "local_ranks": None if order.local_ranks is None else list(order.local_ranks),
                  "thread": threading.current_thread().name, "pid": os.getpid(), "t": time.time()}
        self.log.write(record)
        if self.break_group is not None and self.calls == 1:
            dist.destroy_process_group(self.break_group)
            self.log.write({"kind": "broke-group", "seq": order.seq, "t": time.time()})
        first_for_seq = order.seq not in self.seqs_seen
        self.seqs_seen.add(order.seq)
        if self.hang and order.seq == self.hang_seq and first_for_seq:
            deadline = time.monotonic() + 120
            while not (self.out / "unhang").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.log.write({"kind": "unhung", "call": self.calls, "seq": order.seq, "t": time.time()})
        return not (self.fail and self.calls <= self.fail_calls)


class LoggedGuard(TorchCheckpointGuard):
    """TorchCheckpointGuard that also writes what each call did to the hooks log."""

    def __init__(self, log: JsonLines, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._log = log

    def __call__(self, order: SwitchOrder) -> None:
        try:
            super().__call__(order)
        finally:
            last = self.last
            self._log.write({"kind": "guard", "seq": order.seq, "step": None if last is None else last.step,
                             "saved": None if last is None else last.saved,
                             "reason": None if last is None else last.reason,
                             "path": None if last is None else last.path,
                             "thread": threading.current_thread().name, "pid": os.getpid(), "t": time.time()})


class LoggedProbe(TorchLinkProbe):
    """TorchLinkProbe that also writes its warm-ups and verifications to the hooks log."""

    def __init__(self, log: JsonLines, step: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._log, self._step = log, step

    def prepare(self, order: SwitchOrder) -> bool:
        warmed = self.warmed
        try:
            return super().prepare(order)
        finally:
            self._log.write({"kind": "warm-up", "seq": order.seq, "step": self._step(), "ran": not warmed,
                             "thread": threading.current_thread().name, "t": time.time()})

    @property
    def warmed(self) -> bool:
        return self.last is not None or bool(self._sizes)

    def __call__(self, order: SwitchOrder) -> bool:
        try:
            return super().__call__(order)
        finally:
            last = self.last
            self._log.write({"kind": "verify", "seq": order.seq, "step": self._step(),
                             "thread": threading.current_thread().name,
                             "report": None if last is None else last.as_dict(), "t": time.time()})


def make_data(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of a fixed, noiseless, ill-conditioned regression task (same on every run)."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=gen, dtype=torch.float64)
    x = x * torch.logspace(0, -1.5, FEATURES, dtype=torch.float64)  # slow directions: the loss keeps falling
    w_true = torch.randn(FEATURES, 1, generator=gen, dtype=torch.float64)
    y = x @ w_true + 0.5
    rows = SAMPLES // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(os.environ["NSW_OUT"])
    threading.current_thread().name = f"train-{rank}"
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks before it kills
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(threadName)s %(name)s %(levelname)s %(message)s")
    max_steps = env_int("NSW_MAX_STEPS", 100000) or 100000
    pace = float(os.environ.get("NSW_STEP_SLEEP_S", "0.004"))
    on_peer_loss = os.environ.get("NSW_ON_PEER_LOSS", "exit")
    steps_log = JsonLines(out / f"rank{rank}.steps.jsonl")
    hooks_log = JsonLines(out / f"rank{rank}.hooks.jsonl")
    events_log = JsonLines(out / f"rank{rank}.events.jsonl")
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "status": "starting"}

    def finish(code: int, **fields: Any) -> int:
        result.update(fields)
        if agent is not None:
            try:
                result["agent"] = agent.status()
            except Exception as exc:  # a status snapshot must not hide the real outcome
                result["agent"] = f"status() failed: {exc!r}"
        write_result()
        return code

    def agents_started(rank: int, world: int) -> None:
        """Every rank's agent is up (or failed to start) before the first collective: a leader
        slow to start on a loaded machine must not make the first all_reduce outlast a short
        NSW_PG_TIMEOUT_S (seen: the leader's start took 5.2 s, rank 1's all_reduce timed out)."""
        store = dist.distributed_c10d._get_default_store()
        store.set(f"nsw/agent-started/{rank}", "1")
        try:
            store.wait([f"nsw/agent-started/{r}" for r in range(world)], datetime.timedelta(seconds=120))
        except RuntimeError:
            log.warning("not every rank's agent started within 120 s; training starts anyway")

    def write_result() -> None:  # atomically: the test polls for the file and reads it at once
        tmp = out / f".rank{rank}.result.json.tmp"
        tmp.write_text(json.dumps(result, default=str))
        os.replace(tmp, out / f"rank{rank}.result.json")

    agent: SwitchAgent | None = None
    log = logging.getLogger("worker")
    log.info("imports done")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(os.environ.get("NSW_PG_TIMEOUT_S", "30"))))
    log.info("process group ready")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    model = nn.Linear(FEATURES, 1)
    x, y = make_data(rank, world)
    params = list(model.parameters())
    step = 0

    def current_step() -> int | None:
        return None if agent is None else agent.last_step

    switch_hook = None if os.environ.get("NSW_HOOK", "record") == "default" else RecordingSwitch(
        rank, out, hooks_log, current_step)
    guard = None
    checkpoint = os.environ.get("NSW_CHECKPOINT", "guard")
    if checkpoint == "guard":
        guard = LoggedGuard(hooks_log, directory=out / "ckpt" / f"rank{rank}", model=model,
                            step=current_step, min_interval_s=0, keep_last=3, min_free_bytes=1 << 20,
                            use_dcp=False, rank=rank)
    elif checkpoint == "dcp":
        guard = LoggedGuard(hooks_log, directory=out / "ckpt", model=model, step=current_step, min_interval_s=0,
                            keep_last=3, min_free_bytes=1 << 20)
    probe = None
    verify = os.environ.get("NSW_VERIFY", "")
    if verify:
        subgroup = dist.new_group(list(range(world))) if verify == "probe-subgroup" else None
        probe = LoggedProbe(hooks_log, current_step, groups=None if subgroup is None else [subgroup],
                            names=None if subgroup is None else ["dp"],
                            timeout_s=float(os.environ.get("NSW_PROBE_TIMEOUT_S", "5")))
        if env_int("NSW_BREAK_GROUP_RANK", None) == rank and isinstance(switch_hook, RecordingSwitch):
            switch_hook.break_group = subgroup
    stops: list[str] = []
    try:
        agent = SwitchAgent(switch_hook=switch_hook, checkpoint_hook=guard, on_stop=stops.append, verify_hook=probe,
                            on_event=lambda e: events_log.write(json.loads(e.to_json())))
        agent.start()
    except Exception as exc:
        traceback.print_exc()
        agents_started(rank, world)
        return finish(EXIT_START, status="start_failed", reason=f"{type(exc).__name__}: {exc}")
    agents_started(rank, world)
    result["status"] = "running"
    degraded = False
    try:
        while True:
            step += 1
            loss = nn.functional.mse_loss(model(x), y)
            grads = list(torch.autograd.grad(loss, params))
            stop_now = (out / "stop").exists() or step >= max_steps
            if not degraded:
                flat = torch.cat([g.reshape(-1) for g in grads]
                                 + [loss.detach().reshape(1), torch.tensor([1.0 if stop_now else 0.0])])
                try:
                    dist.all_reduce(flat)
                except RuntimeError as exc:  # a peer died: gloo raises (or times out)
                    if on_peer_loss != "continue":
                        raise
                    degraded = True
                    result["peer_loss"] = f"step {step}: {type(exc).__name__}: {exc}"[:500]
                    log.error("collective failed, stepping locally: %s", exc)
                else:
                    offset = 0
                    for g in grads:
                        n = g.numel()
                        g.copy_(flat[offset:offset + n].view_as(g) / world)
                        offset += n
                    loss = flat[-2] / world
                    stop_now = bool(flat[-1] > 0)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(LR * g)  # plain SGD (torch.optim costs seconds of imports per process)
                w = float(sum(p.sum() for p in params))
            steps_log.write({"step": step, "loss": float(loss.detach()), "w": w, "degraded": degraded,
                             "t": time.time()})
            agent.step(step)
            if stop_now:
                break
            if pace:
                time.sleep(pace)
    except TrainingStopped as exc:
        code = finish(EXIT_STOPPED, status="stopped", reason=str(exc), last_step=step, on_stop=stops)
    except Exception as exc:
        traceback.print_exc()
        code = finish(EXIT_ERROR, status="error", reason=f"{type(exc).__name__}: {exc}"[:1000], last_step=step,
                      on_stop=stops)
    else:
        code = finish(EXIT_DONE, status="done", last_step=step, on_stop=stops)
    started = time.monotonic()
    agent.stop("worker finished")
    result["stop_s"] = round(time.monotonic() - started, 3)  # how long agent.stop() took
    write_result()
    for jsonl in (steps_log, hooks_log, events_log):
        jsonl.close()
    if code == EXIT_DONE:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    exit_code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # never wait at exit for a hook thread or a broken process group
