"""What both kinds of demo job share: the job's shape, its timeline, links, checkpoints, progress."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.observability.timeline import TimelineError, build, read_events, render_html
from nicswitch_agent.orders import SwitchOrder

JOB_ID = "demo-job"
STEP_INTERVAL_S = 0.02
WARMUP_STEPS = 10
DEFAULT_RANKS = 4
MAX_THREAD_RANKS = 64
MAX_PROCESS_RANKS = 16  # each one imports torch: on a laptop more would take minutes to start
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C (ops/cli.py: every command)
FINISH = "switch nic finish"
EVENTS_ENV = "NICSWITCH_EVENTS_FILE"
PAUSE_ENV = "NICSWITCH_PAUSE"
TIMELINE_PAGE = "timeline.html"


class DemoError(Exception):
    """The demo could not run (a rank did not start); the message says why."""


def job_nodes(ranks: int) -> dict[str, list[str]]:
    """The demo job's rank table: two nodes when the ranks split evenly, else one.

    The simulator numbers global ranks ``node index * devices per node + device index``.
    """
    if ranks >= 2 and ranks % 2 == 0:
        per_node = ranks // 2
        return {f"node-{n}": [str(d) for d in range(per_node)] for n in range(2)}
    return {"node-0": [str(d) for d in range(ranks)]}


def failover_devices(nodes: dict[str, list[str]]) -> tuple[str, list[str], list[int]]:
    """(node, its devices to move, their global ranks): the last node's devices, or the upper half
    of a single node's (at least one)."""
    names = list(nodes)
    node = names[-1]
    devices = nodes[node]
    first = 0 if len(names) > 1 else len(devices) // 2
    base = (len(names) - 1) * len(devices)
    return node, devices[first:], [base + i for i in range(first, len(devices))]


def torch_available() -> bool:
    """Whether torch can be found, without importing it (that alone takes a second or two)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def check_arguments(ranks: int, processes: bool) -> str | None:
    """The usage error of these demo arguments, or None when they are fine."""
    limit = MAX_PROCESS_RANKS if processes else MAX_THREAD_RANKS
    if not 1 <= ranks <= limit:
        return f"--ranks must be between 1 and {limit}{' with --processes' if processes else ''}, got {ranks}"
    if processes and not torch_available():
        return ("--processes needs torch (in the nicswitch-agent checkout: python3 -m pip install -c "
                "ci/constraints.txt '.[torch]' for the torch the tests pin; without the pin pip takes the newest "
                "torch, on Linux a CUDA build of several GB: docs/quickstart.md); without --processes the demo "
                "runs its ranks as threads and needs no torch")
    return None


def pause_problem(env: Mapping[str, str] | None = None) -> str | None:
    """The usage error of ``NICSWITCH_PAUSE`` for the demo, or None when the demo may run.

    The demo's job runs in pause mode agent only: what it shows and checks is every rank parking at
    the same step, and there is no MindIO/TaskD to pause anything in external mode. Running agent
    mode anyway would show a user who asked for external what they did not ask for, silently.
    """
    env = os.environ if env is None else env
    raw = env.get(PAUSE_ENV, "").strip()
    if not raw:
        return None
    from nicswitch_agent.config import AgentConfig
    from nicswitch_agent.errors import ConfigError

    try:  # the agent's own grammar: any case, a near miss named with its closest mode
        mode = AgentConfig.from_env({PAUSE_ENV: raw}, server="127.0.0.1:1", job_id=JOB_ID).pause
    except ConfigError as exc:
        return str(exc)
    if mode != "external":
        return None  # agent, or auto: no MindIO/TaskD runs with the demo's job, so auto means agent
    return (f"{PAUSE_ENV}={raw} asks for pause mode external, but the demo's job runs in pause mode agent only "
            "(its ranks park at a step boundary; no MindIO/TaskD runs here to pause them): unset "
            f"{PAUSE_ENV} (or set it to agent) to run the demo; to rehearse pause mode external, run your own "
            "job against `nicswitch-agent sim --standin` (docs/quickstart.md, Pause mode external)")


@dataclass
class Timeline:
    """Lines stamped by wall clock (comparable across processes), rendered in ms since the start."""

    started: float = field(default_factory=time.time)
    lines: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, who: str, text: str, *, at: float | None = None) -> None:
        """Add a line; ``at`` is its wall-clock time (default: now)."""
        with self.lock:
            self.lines.append((time.time() if at is None else at, who, text))

    def render(self, out: TextIO) -> None:
        with self.lock:
            lines = sorted(self.lines, key=lambda line: line[0])  # stable: same-time lines keep their order
        for at, who, text in lines:
            out.write(f"  {(at - self.started) * 1000:8.1f} ms  {who:<9} {text}\n")


class LinkTable:
    """The demo's stand-in for HCCL: which global ranks currently use their standby NIC."""

    def __init__(self, world_size: int, on_change: Callable[[LinkTable], None] | None = None) -> None:
        self.standby = [False] * world_size
        self.calls = 0
        self._on_change = on_change

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls += 1
        for rank, use_backup in order:
            self.standby[rank] = use_backup
        if self._on_change is not None:
            self._on_change(self)
        return True

    def describe(self) -> str:
        return describe_standby(self.standby)


def describe_standby(standby: list[bool]) -> str:
    on = [str(r) for r, b in enumerate(standby) if b]
    return f"ranks on standby: {', '.join(on) if on else 'none'}"


class FileCheckpoint:
    """Writes a tiny checkpoint (the step) before each switch, atomically."""

    def __init__(self, directory: str, current_step: Callable[[], int | None]) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.current_step = current_step
        self.paths: list[str] = []

    def __call__(self, order: SwitchOrder) -> None:
        step = self.current_step()
        path = os.path.join(self.directory, f"step-{step}-switch-{order.seq}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step, "order": order.as_dict()}, f)
        os.replace(tmp, path)
        self.paths.append(path)


class _SimLogToTimeline(logging.Handler):
    def __init__(self, timeline: Timeline) -> None:
        super().__init__(logging.INFO)
        self.timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "action path" in text or "signal enqueue" in text or "misuse" in text:
            if "action path" in text and "reset (switch nic finish)" in text:
                text = "switch finished: all of the job's streams end (reset)"
            elif "misuse" not in text:
                return
        self.timeline.add("clusterd", re.sub(r"uuid=\S+", "uuid=...", text))


def describe_event(event: AgentEvent) -> str | None:
    """One timeline line for an agent event, or None for events the timeline leaves out."""
    d = event.detail
    if event.kind == "list_received":
        return f"rank list #{event.seq} received: {d['ranks']} rank(s), {d['to_standby']} to standby, " \
               f"{d['to_primary']} to primary"
    if event.kind == "member_result":
        where = "on the parked training thread" if d["parked"] else "on the member thread"
        what = d["kind"]  # a guard round's "guard", then the "switch" itself
        result = "ok" if d["ok"] else "FAILED: " + d["reason"]
        return f"{what} {result} in {d['duration_s'] * 1000:.1f} ms {where}"
    if event.kind == "switch_done":
        verdict = "switched" if d["ok"] else "FAILED: " + d["reason"]
        return f"order #{event.seq} {verdict} on all {d['ranks']} rank(s) in {d['duration_s'] * 1000:.1f} ms"
    if event.kind == "reply_sent":
        return f"ReplySwitchNicResult({str(d['result']).lower()}) delivered in {d['duration_s'] * 1000:.1f} ms"
    if event.kind == "reply_failed":
        return f"reply NOT delivered: {d.get('error')}"
    if event.kind == "parked":
        return f"training parked at step {d['step']} (step boundary)"
    if event.kind == "resumed":
        return f"training resumed after {d['parked_s'] * 1000:.1f} ms parked"
    if event.kind in ("agent_started", "agent_stopped"):
        return event.kind.replace("_", " ")
    return None


_LEADER_EVENTS = {"list_received", "switch_done", "reply_sent", "reply_failed"}


def timeline_event(timeline: Timeline, event: AgentEvent, rank: int) -> None:
    """Put rank ``rank``'s event on the timeline, at the time it happened."""
    if event.kind in _LEADER_EVENTS or event.kind.startswith("agent_"):
        if rank != 0 and event.kind.startswith("agent_"):
            return  # one line for the job's start and stop is enough
        who = "leader"
    else:
        if rank != 0 and event.kind == "resumed":
            return
        who = f"rank {rank}"
    text = describe_event(event)
    if text is not None:
        # A reply is drawn when it was sent: ClusterD may act on it (and the operator hear the
        # outcome) before the call's answer is back, which under load comes noticeably later.
        sent = event.kind in ("reply_sent", "reply_failed") and isinstance(event.detail.get("duration_s"), float)
        timeline.add(who, text, at=event.wall - event.detail["duration_s"] if sent else event.wall)


class Progress:
    """Lets the demo wait for the training loop to reach a step (no polling)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.step = 0

    def current(self) -> int:
        return self.step

    def advance(self, step: int) -> None:
        with self._cond:
            self.step = step
            self._cond.notify_all()

    def wait_for_step(self, step: int, timeout: float = 10.0) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.step >= step, timeout)


@dataclass
class RankSummary:
    """How one rank's part of the demo went."""

    rank: int
    parked_at: list[int]
    standby: list[bool]
    switch_calls: int
    checkpoints: int
    last_step: int
    counters: dict[str, Any] = field(default_factory=dict)  # the leader's status()["counters"]


class DemoJob(Protocol):
    """The training job of the demo: threads in this process, or torch processes."""

    description: str
    progress: Progress  # rank 0's steps

    def start(self, address: str) -> None:
        """Start every rank; return once all of them train (DemoError if one cannot start)."""

    def leader_links(self, switches: int) -> list[bool]:
        """Rank 0's links once its switch hook has run ``switches`` times (or what it has now)."""

    def stop(self) -> list[RankSummary]:
        """Stop training on every rank at the same step, stop the agents; one summary per rank."""


def events_template(output_dir: str) -> str:
    """Where every rank writes its events: NICSWITCH_EVENTS_FILE when set, else ``events/`` of the output."""
    return os.environ.get(EVENTS_ENV) or os.path.join(output_dir, "events", "rank-{rank}.jsonl")


def write_timeline_page(out: TextIO, template: str, output_dir: str, since: float) -> str | None:
    """Draw the demo's switches from its ranks' events files (those written since ``since``) into
    ``output_dir/timeline.html`` and say where it is; None (and why, on ``out``) when it cannot."""
    path = os.path.join(output_dir, TIMELINE_PAGE)
    try:
        timeline = build(read_events([template], since=since))
        with open(path, "w", encoding="utf-8") as f:
            f.write(render_html(timeline))
    except (TimelineError, OSError) as exc:
        out.write(f"no timeline page: {exc}\n")
        return None
    out.write(f"timeline page: {path} (open it in a browser); events files: {template}\n")
    return path
