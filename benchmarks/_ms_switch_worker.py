"""One rank of the 4-process switch of benchmarks/ms_store.py, over torch's or MindSpore's TCPStore.

``python -m benchmarks._ms_switch_worker`` with NSW_KIND (``torch`` or ``mindspore``), NSW_RANK,
NSW_WORLD, NSW_STORE_PORT (rank 0 hosts the job's TCPStore there), NSW_STOP (a file: stop when it
exists) and the agent's NICSWITCH_SERVER / NICSWITCH_JOB_ID / NICSWITCH_FRAMEWORK. The ranks step
in lockstep, as data-parallel ranks do through their collectives: a barrier per step, then
``agent.step()``, then 4 ms of "compute". The barrier is files (each rank replaces
``<NSW_STOP>.step<rank>`` with its step and polls the others' every 0.2 ms), not the Store under
test: MindSpore's TCPStore calls hold the GIL for their round trip (torch's release it), so a
barrier polling MindSpore's Store 5,000 times a second would stall the agent's own threads in every
rank, a cost of the benchmark, not of a MindSpore job (whose collectives run in HCCL). After
its first step a rank creates ``<NSW_STOP>.ready<rank>``. The switch hook does nothing. The same
code for both kinds: only the Store differs.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any


def store_class(kind: str) -> Any:
    if kind == "torch":
        from torch.distributed import TCPStore
    else:
        from mindspore.mint.distributed import TCPStore
    return TCPStore


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kind, rank, world = os.environ["NSW_KIND"], int(os.environ["NSW_RANK"]), int(os.environ["NSW_WORLD"])
    port, stop = int(os.environ["NSW_STORE_PORT"]), Path(os.environ["NSW_STOP"])
    tcp_store = store_class(kind)
    timeout = datetime.timedelta(seconds=60)
    store = tcp_store("127.0.0.1", port, world if rank == 0 else None, rank == 0, timeout, wait_for_workers=False)
    mine, others = Path(f"{stop}.step{rank}"), [Path(f"{stop}.step{r}") for r in range(world)]

    def reached(path: Path, step: int) -> bool:
        try:
            return int(path.read_text() or 0) >= step
        except (FileNotFoundError, ValueError):
            return False

    from nicswitch_agent import SwitchAgent

    agent = SwitchAgent(switch_hook=lambda order: True, store=store, rank=rank, world_size=world).start()
    step = 0
    try:
        while not stop.exists():
            partial = Path(f"{mine}.partial")
            partial.write_text(str(step))
            partial.replace(mine)  # whole, for the others' reads
            deadline = time.monotonic() + 10
            while not all(reached(path, step) for path in others) and time.monotonic() < deadline:
                time.sleep(0.0002)
            step += 1
            agent.step(step)
            if step == 1:  # started and stepping: a pause published from now on reaches this rank
                Path(f"{stop}.ready{rank}").touch()
            time.sleep(0.004)
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
