"""A small DistributedDataParallel training script that takes part in ClusterD's link switches.

Runs anywhere torch does (CPU and gloo here; on Ascend use the hccl backend and leave the switch
hook to its default, torch_npu's ``_comm_switch_nic``)::

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py

The agent's settings come from the environment, as in a MindCluster job (``MINDX_SERVER_IP``,
``MINDX_TASK_ID``) or from ``NICSWITCH_*`` variables. To try it against the simulator, in three
terminals::

    nicswitch-agent sim --port 8899 --job demo --nodes node-0:0,1
    NICSWITCH_SERVER=127.0.0.1:8899 NICSWITCH_JOB_ID=demo \\
        torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --wait-for-switch
    nicswitch-agent switch --server 127.0.0.1:8899 --job demo --node node-0 --dev 0,1 --op standby

With the leader outside training (``nicswitch-agent launch --server 127.0.0.1:8899 --job demo --
torchrun ...``) it works the same: every rank learns the switch's outcome from the leader.

The integration is three lines: create the agent (with a switch hook and a checkpoint guard),
``with agent:`` around the loop, and ``enumerate_steps(agent, batches)`` instead of
``enumerate(batches)`` (it calls ``agent.step(step)`` at every step boundary). When ClusterD asks
for a switch, every rank parks at the same step, checkpoints (TorchCheckpointGuard, a collective
torch.distributed.checkpoint save), switches, and training goes on.

Exit codes: 0 done, 3 ClusterD's recovery stopped training (restart the job from the checkpoint).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nicswitch_agent import AgentEvent, SwitchAgent, SwitchOrder, TorchCheckpointGuard, TrainingStopped
from nicswitch_agent.integrations.loop import enumerate_steps

EXIT_DONE, EXIT_STOPPED = 0, 3
logger = logging.getLogger("ddp_train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--wait-for-switch", action="store_true",
                        help="count --steps from the first link switch on (for demos: start it, switch, watch it "
                             "go on)")
    parser.add_argument("--checkpoint-dir", default="checkpoints/ddp_train",
                        help="where the pre-switch checkpoints go, shared by all ranks (default %(default)s)")
    parser.add_argument("--hook", choices=["auto", "npu", "log"], default="auto",
                        help="switch hook: torch_npu's _comm_switch_nic, or one that only logs (auto: npu when "
                             "torch_npu is installed)")
    parser.add_argument("--batch-size", type=int, default=32)
    return parser.parse_args(argv)


class LoggingSwitch:
    """A switch hook for machines without NPUs: logs the order and succeeds."""

    def __init__(self, rank: int, step: Any) -> None:
        self.rank = rank
        self.step = step
        self.switched_at: list[int] = []

    def __call__(self, order: SwitchOrder) -> bool:
        step = self.step()
        self.switched_at.append(step)
        print(f"rank {self.rank}: switch #{order.seq} at step {step}: ranks {list(order.ranks)} "
              f"-> {['standby' if op else 'primary' for op in order.ops]}", flush=True)
        return True


def synthetic_data(samples: int = 4096, features: int = 16) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, 1, generator=gen)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def batches(loader: DataLoader[Any], sampler: DistributedSampler[Any]) -> Iterator[Any]:
    """Epoch after epoch, reshuffled each time."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(name)s %(levelname)s %(message)s")

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = synthetic_data()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    def parked_step() -> int | None:
        return agent.last_step

    use_npu = args.hook == "npu" or (args.hook == "auto" and importlib.util.find_spec("torch_npu") is not None)
    logging_switch = None if use_npu else LoggingSwitch(rank, parked_step)
    # Before any link moves, every rank saves its part of one checkpoint (torch.distributed.checkpoint).
    guard = TorchCheckpointGuard(
        args.checkpoint_dir,
        state=lambda: dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True)),
        step=parked_step,
    )
    switched = threading.Event()  # set when the leader's decision "switched on every rank" reaches this rank

    def on_event(event: AgentEvent) -> None:
        # switch_outcome: every rank hears the leader's decision, whether the leader is rank 0 or the
        # `nicswitch-agent launch` process (switch_done is the leader's own event, so only rank 0 would
        # see it, and under the launcher nobody would).
        if event.kind == "switch_outcome" and event.detail.get("kind") == "switch" and event.detail.get("ok"):
            switched.set()

    # switch_hook=None: torch_npu's _comm_switch_nic
    agent = SwitchAgent(switch_hook=logging_switch, checkpoint_hook=guard, on_event=on_event)

    step, loss_avg = 0, float("nan")
    stop_after: float = float("inf") if args.wait_for_switch else args.steps
    try:
        with agent:
            for step, (x, y) in enumerate_steps(agent, batches(loader, sampler), start=1):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                # One small all_reduce: the mean loss for the log, and whether a switch has been done
                # (ranks hear it at slightly different moments), so that every rank stops at the same step.
                stats = torch.tensor([loss.item(), float(switched.is_set())])
                dist.all_reduce(stats)
                loss_avg = stats[0].item() / world
                if stop_after == float("inf") and stats[1].item() > 0:
                    stop_after = step + args.steps
                if step % 50 == 0 and rank == 0:
                    logger.info("step %d: loss %.4f", step, loss_avg)
                if step >= stop_after:
                    break
    except TrainingStopped as exc:
        print(f"rank {rank}: training stopped at step {step}: {exc}", flush=True)
        return EXIT_STOPPED
    steps = logging_switch.switched_at if logging_switch is not None else "(torch_npu)"
    print(f"rank {rank}: done after {step} steps, loss {loss_avg:.4f}, switches at steps {steps}", flush=True)
    dist.destroy_process_group()
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())
