"""One rank of a small MindSpore job, for tests/test_ms_multiprocess.py (no torch is imported).

Run as ``python -m tests.ms_job.worker`` with msrun's env (MS_ROLE=MS_WORKER, MS_WORKER_NUM,
RANK_ID), the agent's env (NICSWITCH_SERVER, NICSWITCH_JOB_ID, NICSWITCH_PAUSE, ...) and:

    NSW_OUT          output directory (required); files are named rank<r>.*
    NSW_STORE_PORT   the port of the job's MindSpore TCPStore on 127.0.0.1 (rank 0 hosts it)
    NSW_HOOK         "record" (default): a recording switch hook; "default": the agent's default
                     (MindSporeSwitcher, over a fake ``_comm_switch_nic`` that records its arguments)
    NSW_FAIL_RANK    this rank's switch hook returns False in its first call (the rollback after it works)
    NSW_LOCKSTEP     "1": the ranks step in lockstep, as data-parallel ranks do through their
                     collectives: a barrier per step on the job's TCPStore (an add, then polls of
                     the count; given up after 10 s). For benchmarks: the pause parks every rank at
                     max(step)+1, which ranks drifting apart reach late.

The training: a MindSpore tensor ``w`` decays by 1 % per step (a PyNative op on CPU). The
checkpoint guard is MindSporeCheckpointGuard (mindspore.save_checkpoint into <out>/ckpt/rank<r>).

Output (one JSON object per line): rank<r>.steps.jsonl {"step", "w"}, rank<r>.hooks.jsonl
{"kind": "switch"|"guard", "seq", "step", "ranks", "ops", "thread", ...}, rank<r>.events.jsonl,
rank<r>.result.json. Exit codes: 0 done, 3 TrainingStopped, 4 error, 5 could not start.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mindspore
from mindspore.mint.distributed import TCPStore

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.coordination.parking import TrainingStopped

EXIT_DONE, EXIT_STOPPED, EXIT_ERROR, EXIT_START = 0, 3, 4, 5


def main() -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    out = Path(os.environ["NSW_OUT"])
    rank, world = int(os.environ["RANK_ID"]), int(os.environ["MS_WORKER_NUM"])
    port = int(os.environ["NSW_STORE_PORT"])
    threading.current_thread().name = f"train-{rank}"
    lock = threading.Lock()

    def record(name: str, entry: dict[str, Any]) -> None:
        with lock, open(out / f"rank{rank}.{name}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    state = {"step": 0}
    w = mindspore.Tensor([1.0], mindspore.float32)
    fail = [os.environ.get("NSW_FAIL_RANK", "") == str(rank)]

    def switch(order: SwitchOrder) -> bool:
        record("hooks", {"kind": "switch", "seq": order.seq, "step": state["step"], "ranks": list(order.ranks),
                         "ops": list(order.ops), "thread": threading.current_thread().name})
        failing, fail[0] = fail[0], False
        return not failing

    from nicswitch_agent.hooks.ms_checkpoint import MindSporeCheckpointGuard

    saver = MindSporeCheckpointGuard(lambda: {"w": mindspore.Parameter(w, name="w")}, out / "ckpt" / f"rank{rank}",
                                     step=lambda: state["step"])

    def guard(order: SwitchOrder) -> None:
        saver(order)
        last = saver.last
        record("hooks", {"kind": "guard", "seq": order.seq, "step": state["step"], "path": last.path if last else None,
                         "saved": bool(last and last.saved), "thread": threading.current_thread().name})

    def on_event(event: Any) -> None:
        record("events", {"kind": event.kind, "detail": event.detail})

    try:
        store = TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60), wait_for_workers=False)
        hook = None if os.environ.get("NSW_HOOK") == "default" else switch
        agent = SwitchAgent(switch_hook=hook, checkpoint_hook=guard, store=store, on_event=on_event).start()
    except Exception as exc:
        logging.exception("could not start")
        (out / f"rank{rank}.result.json").write_text(json.dumps({"status": "start", "reason": str(exc)}))
        return EXIT_START
    status, code = "done", EXIT_DONE
    lockstep = os.environ.get("NSW_LOCKSTEP") == "1"
    barrier = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60)) if lockstep else None
    try:
        while not (out / "stop").exists():
            if barrier is not None:
                key, deadline = f"barrier/{state['step']}", time.monotonic() + 10
                barrier.add(key, 1)
                while barrier.add(key, 0) < world and time.monotonic() < deadline:
                    time.sleep(0.0002)
            state["step"] += 1
            w = w * 0.99
            record("steps", {"step": state["step"], "w": float(w.asnumpy()[0])})
            agent.step(state["step"])
            time.sleep(0.004)
    except TrainingStopped as exc:
        status, code = f"stopped: {exc}", EXIT_STOPPED
    finally:
        result = {"status": status, "agent": agent.status(), "reason": status}
        agent.stop()
        (out / f"rank{rank}.result.json").write_text(json.dumps(result, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
