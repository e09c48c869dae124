"""A training process with a live leader (streams open) that forks DataLoader workers epoch after epoch.

Run by tests/test_fork.py as a subprocess, with ``EPOCHS MIN_REPLIES``: it runs EPOCHS epochs of a
2-worker ``fork`` DataLoader (two forks each), and more (bounded) until its agent has answered
MIN_REPLIES switches, so the forks happen while the leader's gRPC threads are busy. It then prints
READY, reads ``done N`` once the test has stopped driving switches, waits (bounded) for the agent to
have answered N, and exits 0. A worker that dies or hangs fails the job.
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch
from torch.utils.data import DataLoader, Dataset

from nicswitch_agent import SwitchAgent

WORKER_TIMEOUT_S = 20  # a hung worker then fails the job instead of hanging it


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
    epochs, min_replies = int(sys.argv[1]), int(sys.argv[2])
    replies = 0
    answered = threading.Condition()

    def on_event(event: object) -> None:
        nonlocal replies
        if getattr(event, "kind", None) == "reply_sent":
            with answered:
                replies += 1
                answered.notify_all()

    AGENT = SwitchAgent(pause="external", dry_run=True, on_event=on_event).start()
    total = 0.0
    epoch = 0
    while epoch < epochs or (replies < min_replies and epoch < 20 * epochs):
        loader = DataLoader(Numbers(), batch_size=8, num_workers=2, multiprocessing_context="fork",
                            worker_init_fn=in_worker, timeout=WORKER_TIMEOUT_S)
        for step, batch in enumerate(loader):
            total += float(batch.sum())
            AGENT.step(step)
        epoch += 1
    print(f"epochs={epoch} total={total:.0f} replies_while_forking={replies} state={AGENT.status()['state']}",
          flush=True)
    print("READY", flush=True)  # the test stops driving switches and tells how many it drove
    driven = int(sys.stdin.readline().split()[1])
    # ClusterD tells the operator "finish" as it takes the reply, which can be before our reply call
    # returns and is counted: wait for that (bounded), never for a fixed time.
    with answered:
        answered.wait_for(lambda: replies >= driven, timeout=10)
    status = AGENT.status()
    AGENT.stop()
    print(f"replies={status['counters']['replies_delivered']} driven={driven}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
