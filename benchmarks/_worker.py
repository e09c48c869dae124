"""One rank of the multi-process benchmarks: torch gloo over env://, a SwitchAgent in pause mode agent.

Run by :func:`benchmarks.e2e.run_process_group` as ``python -m benchmarks._worker``. The training
loop sleeps ``interval`` seconds, all-reduces a one-element tensor (the "collective" of the step,
which also carries the stop flag so every rank stops at the same step), then calls
``agent.step(step)``. Commands on stdin: ``interval <seconds>``, ``stop`` (or EOF).

Prints ``READY`` once the agent runs, writes its stamps as JSON to ``--out`` at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: no C++ warnings, no DNS stalls

import argparse
import datetime
import json
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--probe", action="store_true", help="TorchLinkProbe on the default group as verify hook")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from benchmarks._common import quiet_logging
    from benchmarks._instrument import RankRecorder
    from nicswitch_agent import SwitchAgent, TorchLinkProbe

    quiet_logging()
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    recorder = RankRecorder(rank)
    agent = SwitchAgent(server=args.server, job_id=args.job, pause="agent", switch_hook=recorder.hook,
                        on_event=recorder.on_event, verify_hook=TorchLinkProbe(timeout_s=5) if args.probe else None)
    recorder.instrument(agent)
    agent.start()
    recorder.instrument_started(agent)

    state = {"interval": args.interval, "stop": False}

    def read_commands() -> None:
        for line in sys.stdin:
            words = line.split()
            if words[:1] == ["interval"]:
                state["interval"] = float(words[1])
            elif words[:1] == ["stop"]:
                break
        state["stop"] = True

    threading.Thread(target=read_commands, name="bench-commands", daemon=True).start()
    print("READY", flush=True)

    flag = torch.zeros(1)
    step = 0
    allreduce_s: list[float] = []  # the step's own collective, a floor for a probe's (the last 1000)
    while True:
        time.sleep(float(state["interval"]))
        flag[0] = 1.0 if state["stop"] else 0.0
        started = time.monotonic()
        dist.all_reduce(flag)
        allreduce_s = [*allreduce_s[-999:], time.monotonic() - started]
        if flag.item() > 0:
            break
        step += 1
        recorder.call_t = time.monotonic()
        agent.step(step)

    agent.stop("benchmark done")
    dist.barrier()  # rank 0 hosts the TCPStore: it leaves last
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({**recorder.as_dict(), "steps": step, "allreduce_s": allreduce_s}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
