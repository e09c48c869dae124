"""A training process with a live agent (streams open) that forks DataLoader workers repeatedly.

Run by tests/test_fork.py as a subprocess; exits 0 when every round finished and the agent
still works afterwards (it answered a switch the test drives through the simulator).
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch
from torch.utils.data import DataLoader, Dataset

from nicswitch_agent import SwitchAgent


class Numbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index))


def in_worker(worker_id: int) -> None:
    # The agent object is inherited by the forked worker but must be inert there.
    agent = AGENT
    agent.step(0)
    agent.stop("called in a forked worker")  # a no-op outside the process that started it
    assert agent._member is not None and agent.status()["state"] in ("running", "switching")


AGENT: SwitchAgent


def main() -> int:
    global AGENT
    rounds = int(sys.argv[1])
    replied = threading.Event()
    AGENT = SwitchAgent(pause="external", dry_run=True,
                        on_event=lambda event: event.kind == "reply_sent" and replied.set()).start()
    total = 0.0
    for _ in range(rounds):
        loader = DataLoader(Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork",
                            worker_init_fn=in_worker)
        for step, batch in enumerate(loader):
            total += float(batch.sum())
            AGENT.step(step)
    print(f"rounds={rounds} total={total:.0f} state={AGENT.status()['state']}", flush=True)
    # Tell the test we are done with forking; it then drives a switch and expects a reply.
    print("READY", flush=True)
    line = sys.stdin.readline().strip()
    # ClusterD tells the operator "finish" as it takes the reply, which can be before our reply call
    # returns and is counted: wait for that (bounded), never for a fixed time.
    replied.wait(10)
    status = AGENT.status()
    AGENT.stop()
    print(f"replies={status['counters']['replies_delivered']} after={line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
