"""``nicswitch-agent demo --processes``: the demo's training ranks as real torch processes.

Each rank is ``python -m nicswitch_agent.demo.processes --rank R ...``, a process of its own
that trains a tiny ``nn.Linear`` on CPU: ``torch.distributed`` with the gloo backend over a
``TCPStore`` that rank 0 hosts, one all-reduce per step (the gradients and the stop vote), and a
``SwitchAgent`` per process calling ``agent.step(step)`` at every step boundary. The agents
coordinate through the job's own Store, as in a real torchrun job; rank 0's agent leads.

The demo process (:class:`ProcessJob`) runs the simulator and the operator, as with threads,
and talks to its ranks through pipes, one JSON object per line:

- rank -> demo (stdout): ``store`` (rank 0: the TCPStore's port), ``ready``, ``step`` (rank 0),
  ``event`` (every :class:`~nicswitch_agent.observability.events.AgentEvent`), ``links`` (after every switch
  hook call), ``error``, and ``done`` (the rank's summary, once training has ended);
- demo -> rank (stdin): ``{"port": P}`` (where rank 0's Store listens), then ``stop``; the end of
  stdin (the demo is gone) also means stop.

The ranks stop at the same step: the stop vote rides in the step's all-reduce. Each rank runs in
a session of its own (a Ctrl-C on the terminal reaches the demo, which stops them) and its stderr
goes to a file, shown when it fails (``-v``: straight to the terminal, with INFO logs).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: no Store warning spam, no DNS stalls

import argparse
import contextlib
import datetime
import json
import logging
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from nicswitch_agent.demo.common import (
    JOB_ID,
    STEP_INTERVAL_S,
    DemoError,
    FileCheckpoint,
    LinkTable,
    Progress,
    RankSummary,
    Timeline,
    job_nodes,
    timeline_event,
)
from nicswitch_agent.demo.quiet import quiet_grpc
from nicswitch_agent.observability.events import AgentEvent

STARTUP_TIMEOUT_S = 120.0  # Python + torch import in every rank, on a small and possibly busy machine
STOP_TIMEOUT_S = 30.0
STORE_TIMEOUT = datetime.timedelta(seconds=60)
# Never let the caller's job settings turn a demo rank into something else (a member of a
# launcher, another job's rank, a MindIO client).
_SCRUB_PREFIXES = ("NICSWITCH_", "MINDX_", "TORCHELASTIC_", "PET_")
_SCRUB_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                          "MASTER_ADDR", "MASTER_PORT", "TTP_PORT", "TASKD_PROCESS_ENABLE", "LOCAL_PROXY_ENABLE"})


# -- the demo's side ----------------------------------------------------------------------------


class _Rank:
    """One rank process, as the demo sees it (fields written by its reader thread, under the job's lock)."""

    def __init__(self, rank: int, proc: subprocess.Popen[str], stderr_path: Path | None) -> None:
        self.rank = rank
        self.proc = proc
        self.stderr_path = stderr_path
        self.stdin_lock = threading.Lock()  # one writer at a time on proc.stdin
        self.reader: threading.Thread | None = None
        self.ready = False
        self.ended = False  # its stdout closed
        self.error = ""
        self.torch_version = ""
        self.links: list[bool] = []
        self.link_calls = 0
        self.summary: RankSummary | None = None

    def send(self, text: str) -> None:
        stdin = self.proc.stdin
        if stdin is None:
            return
        with self.stdin_lock, contextlib.suppress(OSError, ValueError):  # it exited, or stdin is closed
            stdin.write(text + "\n")
            stdin.flush()

    def why_failed(self) -> str:
        if self.error:
            return self.error
        if self.stderr_path is not None:
            with contextlib.suppress(OSError):
                lines = [line for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]
                if lines:
                    return lines[-1].strip()
        code = self.proc.poll()
        return "no output" if code is None else f"exit code {code}"


class ProcessJob:
    """The demo's training job as ``world`` torch processes on this machine (see the module docstring)."""

    description = "processes: torch.distributed with gloo on CPU over a TCPStore, an all-reduce every step"

    def __init__(self, world: int, timeline: Timeline, workdir: str, *, verbose: bool = False,
                 events_file: str | None = None) -> None:
        self.world = world
        self.events_file = events_file
        self.timeline = timeline
        self.workdir = Path(workdir)
        self.verbose = verbose
        self.progress = Progress()
        self._ranks: list[_Rank] = []
        self._cond = threading.Condition()  # guards the _Rank fields the readers write, and _store_port
        self._store_port: int | None = None

    # -- starting ----------------------------------------------------------------------------------

    def start(self, address: str) -> None:
        started = time.monotonic()
        package_root = str(Path(__file__).resolve().parent.parent)  # the same nicswitch_agent in every rank
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
        env.update({
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")])),
            "PYTHONUNBUFFERED": "1",
            "TORCH_CPP_LOG_LEVEL": env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),  # a tiny model: threads would only compete
        })
        quiet_grpc(env)  # the ranks' gRPC core lines would land on the terminal with -v (the command sets it too)
        # The job's nodes as the simulator lists them (demo/common.py): with two, each node's first
        # rank relays for its node over the node link, as in a job of several hosts.
        env["LOCAL_WORLD_SIZE"] = str(len(next(iter(job_nodes(self.world).values()))))
        for r in range(self.world):
            command = [sys.executable, "-m", "nicswitch_agent.demo.processes", "--rank", str(r),
                       "--world-size", str(self.world), "--server", address, "--job-id", JOB_ID,
                       "--checkpoint-dir", str(self.workdir / f"rank{r}"), "--step-interval", str(STEP_INTERVAL_S)]
            if self.verbose:
                command.append("--verbose")
            if self.events_file:
                command += ["--events-file", self.events_file]
            stderr_path = None if self.verbose else self.workdir / f"rank{r}.stderr"
            stderr: IO[bytes] | None = None if stderr_path is None else open(stderr_path, "wb")  # noqa: SIM115
            try:
                proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=stderr, text=True, bufsize=1, start_new_session=True)
            finally:
                if stderr is not None:
                    stderr.close()  # the child has its own descriptor
            rank = _Rank(r, proc, stderr_path)
            with self._cond:
                self._ranks.append(rank)
                port = self._store_port
            if port is not None:  # rank 0 was quicker than this loop
                rank.send(json.dumps({"port": port}))
            reader = threading.Thread(target=self._read, args=(rank,), name=f"demo-rank{r}-reader", daemon=True)
            reader.start()
            rank.reader = reader  # once started: a Ctrl-C between the two made the stop join an unstarted thread
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self._cond:
            self._cond.wait_for(lambda: all(r.ready for r in self._ranks) or any(r.ended for r in self._ranks),
                                max(0.0, deadline - time.monotonic()))
            not_ready = [r for r in self._ranks if not r.ready]
            port = self._store_port
        if not_ready:
            first = next((r for r in not_ready if r.ended), not_ready[0])  # the one that exited says why
            verb = "exited" if first.ended else f"was not training after {STARTUP_TIMEOUT_S:.0f} s"
            raise DemoError(f"rank {first.rank} {verb}: {first.why_failed()}")
        pids = ", ".join(str(r.proc.pid) for r in self._ranks)
        self.timeline.add("demo", f"{self.world} rank process{'es' if self.world != 1 else ''} (pids {pids}) "
                                  f"training {time.monotonic() - started:.1f} s after they were started (torch "
                                  f"{self._ranks[0].torch_version}, gloo, the job's TCPStore on 127.0.0.1:{port}, "
                                  "hosted by rank 0)")

    def _read(self, rank: _Rank) -> None:
        """Rank ``rank``'s messages, until its stdout closes."""
        stdout = rank.proc.stdout
        assert stdout is not None
        try:
            for line in stdout:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue  # not ours (a library printing to stdout)
                if isinstance(message, dict):
                    self._handle(rank, message)
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                rank.ended = True
                self._cond.notify_all()

    def _handle(self, rank: _Rank, message: dict[str, Any]) -> None:
        kind = message.get("t")
        if kind == "event":
            event = AgentEvent(**message["event"])
            timeline_event(self.timeline, event, rank.rank)
            return
        if kind == "step":
            self.progress.advance(int(message["step"]))
            return
        if kind == "store":
            with self._cond:
                self._store_port = port = int(message["port"])
                others = [r for r in self._ranks if r is not rank]
            for other in others:  # a rank started later gets it from start()
                other.send(json.dumps({"port": port}))
            return
        with self._cond:
            if kind == "ready":
                rank.ready = True
                rank.torch_version = str(message.get("torch", ""))
            elif kind == "links":
                rank.links = [bool(b) for b in message["standby"]]
                rank.link_calls = int(message["calls"])
            elif kind == "error":
                rank.error = str(message.get("error", ""))
            elif kind == "done":
                rank.summary = RankSummary(
                    rank.rank, [int(s) for s in message["parked_at"]], [bool(b) for b in message["standby"]],
                    int(message["calls"]), int(message["checkpoints"]), int(message["step"]),
                    dict(message.get("counters") or {}))
            self._cond.notify_all()

    # -- during the demo ---------------------------------------------------------------------------

    def leader_links(self, switches: int, timeout: float = 10.0) -> list[bool]:
        leader = self._ranks[0]
        with self._cond:
            self._cond.wait_for(lambda: leader.link_calls >= switches or leader.ended, timeout)
            return list(leader.links)

    # -- stopping ----------------------------------------------------------------------------------

    def stop(self) -> list[RankSummary]:
        with self._cond:
            ranks, starting = list(self._ranks), not all(r.ready for r in self._ranks)
        if starting:
            # Ctrl-C (or a failure) before every rank was training: nothing ran that a clean stop
            # would save, and a rank inside torch.distributed's set-up waiting for one that is gone
            # reads no "stop" (rank 0 held Ctrl-C for the whole STOP_TIMEOUT_S).
            self.timeline.add("demo", "the rank processes were still starting: stopped at once")
            for rank in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank.proc.pid, signal.SIGKILL)
        else:
            for rank in ranks:
                rank.send("stop")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for rank in self._ranks:
            try:
                rank.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.timeline.add("demo", f"rank {rank.rank} did not stop within {STOP_TIMEOUT_S:.0f} s: killed")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rank.proc.pid, signal.SIGKILL)
                rank.proc.wait(10)
        for rank in self._ranks:
            if rank.reader is not None:
                rank.reader.join(5)
            if rank.proc.stdin is not None:
                with rank.stdin_lock, contextlib.suppress(OSError):
                    rank.proc.stdin.close()
        summaries = []
        with self._cond:
            for rank in self._ranks:
                if rank.summary is not None:
                    summaries.append(rank.summary)
                elif rank.ready:  # it trained but never said how it ended
                    self.timeline.add("demo", f"rank {rank.rank} ended without a summary: {rank.why_failed()}")
        return summaries


# -- a rank's side ------------------------------------------------------------------------------


class _Pipe:
    """This rank's messages to the demo: one JSON object per line on stdout, from any thread."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": kind, **fields}, default=str) + "\n"
        with self._lock, contextlib.suppress(OSError, ValueError):  # the demo is gone: nothing to tell
            self._stream.write(line)
            self._stream.flush()


class _Orders:
    """The demo's orders on stdin: the Store's port, then stop (also at the end of stdin)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stop = threading.Event()
        self.port: int | None = None
        self.port_known = threading.Event()
        self._stream = stream
        threading.Thread(target=self._run, name="demo-orders", daemon=True).start()

    def _run(self) -> None:
        try:
            for line in self._stream:
                text = line.strip()
                if text == "stop":
                    break
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    self.port = int(json.loads(text)["port"])
                    self.port_known.set()
        finally:
            self.stop.set()
            self.port_known.set()


def _parse_rank_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nicswitch_agent.demo.processes",
                                     description="one rank of `nicswitch-agent demo --processes` (not for direct use)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--step-interval", type=float, default=STEP_INTERVAL_S)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--events-file", help="this rank's events file (NICSWITCH_EVENTS_FILE; {rank} allowed)")
    return parser.parse_args(argv)


def rank_main(argv: list[str] | None = None) -> int:
    """One rank: join the job's process group, start its agent, train until the demo says stop."""
    args = _parse_rank_args(argv)
    rank, world = args.rank, args.world_size
    threading.current_thread().name = f"train-{rank}"
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(threadName)s %(name)s %(levelname)s %(message)s")
    pipe = _Pipe(sys.stdout)
    orders = _Orders(sys.stdin)
    agent: Any = None
    links = LinkTable(world, on_change=lambda t: pipe.send("links", standby=t.standby, calls=t.calls))
    parked_at: list[int] = []
    step = 0
    guard = FileCheckpoint(args.checkpoint_dir, lambda: None if agent is None else agent.last_step)

    def on_event(event: AgentEvent) -> None:
        if event.kind == "parked":
            parked_at.append(int(event.detail["step"]))
        pipe.send("event", event=json.loads(event.to_json()))

    code = 0
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        from nicswitch_agent.agent import SwitchAgent

        if rank == 0:  # hosts the job's Store, like rank 0 of an env:// job
            store = TCPStore("127.0.0.1", 0, world, True, STORE_TIMEOUT, wait_for_workers=False)
            pipe.send("store", port=store.port)
        else:
            if not orders.port_known.wait(STORE_TIMEOUT.total_seconds()) or orders.port is None:
                raise DemoError("the demo never said where rank 0's Store listens")
            store = TCPStore("127.0.0.1", orders.port, world, False, STORE_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
        agent = SwitchAgent(server=args.server, job_id=args.job_id, pause="agent", rank=rank, world_size=world,
                            switch_hook=links, checkpoint_hook=guard, on_event=on_event,
                            **({"events_file": args.events_file} if args.events_file else {}))
        agent.start()  # the agents find the job's Store through torch.distributed
        pipe.send("ready", torch=torch.__version__, pid=os.getpid())
        step = _train(agent, orders.stop.wait, args.step_interval, rank, pipe)
        counters = dict(agent.status()["counters"]) if rank == 0 else {}
        agent.stop("the demo is over")
        agent = None
        dist.barrier()  # rank 0 hosts the Store: nobody leaves while another rank may still use it
    except Exception as exc:
        traceback.print_exc()
        pipe.send("error", error=f"{type(exc).__name__}: {exc}")
        counters, code = {}, 1
    finally:
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.stop("the demo rank failed")
    pipe.send("done", parked_at=parked_at, standby=links.standby, calls=links.calls,
              checkpoints=len(guard.paths), step=step, counters=counters)
    return code


def _train(agent: Any, wait: Callable[[float], bool], interval: float, rank: int, pipe: _Pipe) -> int:
    """Full-batch gradient descent on ``nn.Linear(8, 1)``: compute, all-reduce, step boundary; until stopped."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    gen = torch.Generator().manual_seed(1000 + rank)  # this rank's shard of the data
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    params = list(model.parameters())
    world = dist.get_world_size()
    step = 0
    while True:
        stopping = wait(interval)  # the rest of a real step's compute; returns at once when told to stop
        loss = nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, params)
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([1.0 if stopping else 0.0])])
        dist.all_reduce(flat)  # the gradient all-reduce, and the stop vote: every rank stops after the same step
        with torch.no_grad():
            offset = 0
            for p, g in zip(params, grads, strict=True):
                p.sub_(0.05 * flat[offset:offset + g.numel()].view_as(g) / world)
                offset += g.numel()
        step += 1
        agent.step(step)  # the step boundary: where a pause parks this rank
        if rank == 0:
            pipe.send("step", step=step)
        if flat[-1].item() > 0:
            return step


if __name__ == "__main__":
    exit_code = rank_main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # never wait at exit on a hook or gloo thread
