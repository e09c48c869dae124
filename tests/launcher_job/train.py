"""One rank of a tiny torchrun job under ``nicswitch-agent launch``, for tests/test_launcher.py.

Run by torchrun: ``train.py --out DIR``. The agent is configured by the launcher's env only
(NICSWITCH_LEADER=launcher, NICSWITCH_STORE_ADDRESS, NICSWITCH_SERVER/JOB_ID/PAUSE), so
``SwitchAgent()`` becomes a member of the launcher-hosted leader, like a user's script would.

Files in DIR (JSON lines, one flush per line, appended across torchrun restarts):

    rank<r>.start.jsonl    one line per (re)start: pid, restart count, role, agent env, torchrun's store env
    rank<r>.steps.jsonl    {"step", "restart", "loss"} per step
    rank<r>.hooks.jsonl    {"seq", "step", "ranks", "ops", "restart", "pid", "thread"} per switch hook call
    rank<r>.signals.jsonl  {"signal", "restart", "pid"} when SIGTERM arrives (the rank then exits 0)

With ``--late-rank R``, rank R starts its agent only once DIR/join exists (a rank that joins late).
With ``--die-in-switch R:SEQ``, rank R SIGKILLs itself in its switch hook for order SEQ, once (it
leaves DIR/died: a rank that dies mid-switch; torchrun then restarts the ranks). With
``--die-at-pause R``, rank R does so when it hears of the first pause, before it parks.

The loop runs until DIR/stop exists; the stop flag rides in the step's all_reduce, so every rank
stops after the same step. Exit codes: 0 done (or SIGTERM), 1 error.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: no Store warning spam or DNS stalls
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from nicswitch_agent import AgentEvent, SwitchAgent, SwitchOrder

# How torchrun set up this attempt's store (tests/test_launcher.py checks the launcher's opt-out).
TORCH_ENV = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHELASTIC_USE_AGENT_STORE")


class JsonLines:
    def __init__(self, path: Path) -> None:
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--step-sleep", type=float, default=0.01)
    parser.add_argument("--late-rank", type=int, default=-1,
                        help="this rank starts its agent only once DIR/join exists (a rank that joins late)")
    parser.add_argument("--die-in-switch", default="", help="R:SEQ: rank R SIGKILLs itself in switch SEQ's hook")
    parser.add_argument("--die-at-pause", type=int, default=-1,
                        help="this rank SIGKILLs itself when it hears of the first pause (before it parks)")
    opts = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out: Path = opts.out
    threading.current_thread().name = f"train-{rank}"

    def log(kind: str) -> JsonLines:
        return JsonLines(out / f"rank{rank}.{kind}.jsonl")

    steps, hooks, signals = log("steps"), log("hooks"), log("signals")

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signals.write({"signal": signal.Signals(signum).name, "restart": restart, "pid": os.getpid()})
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("gloo", init_method="env://")
    agent: SwitchAgent | None = None

    def switch(order: SwitchOrder) -> bool:
        hooks.write({"seq": order.seq, "step": None if agent is None else agent.last_step,
                     "ranks": list(order.ranks), "ops": list(order.ops), "restart": restart, "pid": os.getpid(),
                     "thread": threading.current_thread().name})
        if opts.die_in_switch == f"{rank}:{order.seq}" and not (out / "died").exists():
            (out / "died").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return True

    if rank == opts.late_rank:
        while not (out / "join").exists():  # the test says when; the other ranks wait in their first all_reduce
            time.sleep(0.05)
    agent = SwitchAgent(switch_hook=switch)
    if rank == opts.die_at_pause and restart == 0:
        def die_at_pause(event: AgentEvent) -> None:
            if event.kind == "pause_requested":
                (out / "died").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        agent.add_listener(die_at_pause)
    agent.start()
    status = agent.status()
    log("start").write({"pid": os.getpid(), "ppid": os.getppid(), "restart": restart, "role": status["role"],
                        "world": world, "holds_channel": agent._session is not None,
                        "env": {k: v for k, v in os.environ.items() if k.startswith("NICSWITCH_")},
                        "torch_env": {k: os.environ[k] for k in TORCH_ENV if k in os.environ}})
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    step = 0
    try:
        while True:
            optim.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            stop = torch.tensor([1.0 if (out / "stop").exists() else 0.0])
            buf = torch.cat([flat, stop])
            dist.all_reduce(buf)  # the "gradient all-reduce" and the stop vote, in one collective
            offset = 0
            for p in model.parameters():
                n = p.numel()
                p.grad = buf[offset:offset + n].reshape(p.shape) / world
                offset += n
            optim.step()
            step += 1
            steps.write({"step": step, "restart": restart, "loss": float(loss.detach())})
            agent.step(step)
            if buf[-1].item() > 0:
                return 0
            time.sleep(opts.step_sleep)
    finally:
        agent.stop("training done")
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
