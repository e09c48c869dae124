"""A script msrun runs in every process it starts, for tests/test_ms_multiprocess.py: the agent is
started before ``mindspore.communication.init()`` (which never returns in msrun's scheduler
process), so the scheduler (MS_ROLE=MS_SCHED, RANK_ID=0) reaches ``start()`` too.

Env: NSW_OUT (output directory); NSW_STORE_PORT (optional: the job's MindSpore TCPStore on
127.0.0.1, hosted by RANK_ID 0 and passed as ``store=``; without it the agent finds its Store
itself, as under ``nicswitch-agent launch``); the agent's NICSWITCH_* settings. Each process
writes ``<scheduler|rank<r>>.<pid>.json``, its agent's status after ``start()``; a worker then
steps (``agent.step()`` every 5 ms, a recording switch hook: ``rank<r>.switch.jsonl``) until
``<out>/stop`` exists (at most 60 s) and stops its agent.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from mindspore.mint.distributed import TCPStore

from nicswitch_agent import SwitchAgent, SwitchOrder

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
out = Path(os.environ["NSW_OUT"])
scheduler = os.environ.get("MS_ROLE") == "MS_SCHED"
rank, world = int(os.environ["RANK_ID"]), int(os.environ["MS_WORKER_NUM"])
name = "scheduler" if scheduler else f"rank{rank}"
store: Any = None
if os.environ.get("NSW_STORE_PORT"):
    store = TCPStore("127.0.0.1", int(os.environ["NSW_STORE_PORT"]), world, is_master=(rank == 0),
                     wait_for_workers=False)  # in the scheduler: an object with no connection
steps = 0


def switch(order: SwitchOrder) -> bool:
    with open(out / f"{name}.switch.jsonl", "a", encoding="utf-8") as f:
        entry = {"seq": order.seq, "step": steps, "ranks": list(order.ranks), "ops": list(order.ops)}
        f.write(json.dumps(entry) + "\n")
    return True


agent = SwitchAgent(store=store, switch_hook=switch).start()
partial = out / f"{name}.{os.getpid()}.partial"
partial.write_text(json.dumps(agent.status()), encoding="utf-8")
partial.rename(partial.with_suffix(".json"))  # whole, for a reader polling for it
deadline = time.monotonic() + 60
while not scheduler and not (out / "stop").exists() and time.monotonic() < deadline:
    steps += 1
    agent.step(steps)
    time.sleep(0.005)
agent.stop("done")
