"""Fault soak: many switches against the simulator, faults injected at random, invariants after each.

A job of ``--ranks`` ranks (one :class:`~nicswitch_agent.SwitchAgent` and one training thread per
rank, all in this process, coordinating through one in-process Store; rank 0 leads) runs switch
after switch against a simulated ClusterD. Each switch gets at most one fault:

- simulator side (in-process simulator, :mod:`nicswitch_agent.sim.faults`): the notify stream
  dropped before or after the send; the reply failing with UNAVAILABLE (lost before ClusterD saw
  it, or after it took it); the reply refused with "qps exceeded";
- ``sim_restart``: the in-process simulator stopped and a new one started on the same port;
- ``sim_kill``: the simulator as a separate process (``python -m nicswitch_agent.sim``), killed
  with SIGKILL and started again on the same port (a few of these per run, see ``--kills``);
- hooks: the switch hook returning False, raising, or exceeding its timeout on rank 0
  (``hook_timeout``) or on another rank (``member_slow``);
- opt-in (``--mid-switch-restarts``), ``sim_restart_mid_switch``: the simulator restarted after it
  sent the list and before the reply (the hooks are held until the agent is connected to the new
  one), so the reply is owed to a ClusterD that no longer exists.

After every switch (``SoakFailure`` names the switch, with the agent threads' stacks, when a
bounded wait runs out):

- ClusterD finished the flow (success or recovery) and is back in INIT with the streams reopened;
- one reply reached ClusterD per list it delivered, none for a list it did not deliver (a restarted
  ClusterD delivered none), and the agent received every delivered list and settled exactly one
  reply for each;
- ``JobView.violations`` gained nothing (the simulator records every protocol misuse), and the
  simulator, which runs with ``crash_like_clusterd``, did not go down: the agent never does what
  crashes the real ClusterD (a report without status, a second reply for one list);
- every agent thread is alive, no rank is parked, and training steps again (or, after ClusterD
  chose exit, every rank was told to stop: the job is then started again, as a launcher would);
- every rank that ran the switch hook got the same full list, and every rank answered the order
  (no hook here hangs past its budget, so "did not answer" means a wedged member).

By hand (prints the counts; exit status 1 if any invariant broke; ``-v``: one line per switch;
``--log``: the agent's and simulator's warnings too)::

    python tests/soak.py --switches 500 --seed 7
    python tests/soak.py --switches 200 --pause agent --ranks 4 --seed 3 -v
    python tests/soak.py --switches 100 --kills 10          # more SIGKILL restarts
    python tests/soak.py --switches 40 --mid-switch-restarts
    python tests/soak.py --idle-minutes 10                  # keepalive, see below

``--idle-minutes N`` runs the keepalive check instead: one idle agent (pause mode agent,
``keepalive_time_s=3``, the smallest ClusterD tolerates) against a simulator that enforces
ClusterD's ping policy and sends no keep-alive data that would reset its ping strikes; after N
minutes it prints the stream errors (0 expected: no GOAWAY ``too_many_pings``) and registrations
(1 expected).

Timings: a switch takes tens of milliseconds; a reply lost by injection costs the simulator's
report timeout (``--report-timeout``, 3 s), a hook past its timeout about a second, a SIGKILL
episode two simulator process start-ups. 500 switches take a few minutes.

``tests/test_soak.py`` runs a short version in CI; ``tests/test_keepalive.py`` covers restarts
and keepalive with their own tests.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

import nicswitch_agent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.agent import SwitchAgent
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.orders import SwitchOrder
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim import faults as F
from nicswitch_agent.sim.server import Simulator
from nicswitch_agent.sim.settings import SimJob, SimSettings

__all__ = [
    "FAULTS",
    "IdleReport",
    "InProcessBackend",
    "SoakFailure",
    "SoakReport",
    "SoakSettings",
    "SubprocessBackend",
    "idle_check",
    "main",
    "run_soak",
]

JOB = "soak-job"

# Fault kinds, as the report names them.
NONE = "none"
HOOK_FALSE = "hook_false"
HOOK_RAISES = "hook_raises"
HOOK_TIMEOUT = "hook_timeout"  # rank 0's switch hook runs past its budget
MEMBER_SLOW = "member_slow"  # another rank's switch hook runs past its budget
SIM_RESTART = "sim_restart"  # the in-process simulator stopped, a new one on the same port
SIM_KILL = "sim_kill"  # the simulator process SIGKILLed, a new one on the same port
# Opt-in (``--mid-switch-restarts``): the simulator restarted after it sent the list and before the
# reply (the hooks are held until the agent is connected to the new one).
SIM_RESTART_MID_SWITCH = "sim_restart_mid_switch"
HOOK_FAULTS = (HOOK_FALSE, HOOK_RAISES, HOOK_TIMEOUT, MEMBER_SLOW)
FAULTS = (NONE, *F.FAULT_KINDS, *HOOK_FAULTS, SIM_RESTART, SIM_KILL, SIM_RESTART_MID_SWITCH)
HOLD = "hold"  # a hook action: wait until HookPlan.unhold is set

OUTCOME_OK = "switched"  # ClusterD: "switch nic finish"
OUTCOME_RECOVERED = "failed, recovered"  # a failed switch, then ClusterD's recovery let training go on
OUTCOME_STOPPED = "failed, training stopped"  # ClusterD chose exit/dump: the job was started again


class SoakFailure(AssertionError):
    """A bounded wait ran out (a deadlock, or a flow that never ended): the run cannot go on."""


@dataclass(frozen=True)
class SoakSettings:
    """One soak run.

    Args:
        switches: switches in total, split evenly over ``pause_modes``.
        seed: seeds every random choice (faults, lists, the simulator's node order).
        pause_modes: ``agent`` and/or ``external`` (a MindIO stand-in pauses training).
        ranks: ranks of the job (threads of this process).
        kills: SIGKILL episodes per pause mode; each starts the simulator as a process, SIGKILLs
            it twice and ends on a new in-process simulator (None: one per 50 switches, at least 1;
            0: none, nothing is spawned).
        report_timeout_s: the simulator's wait for each report and for the reply (a reply lost
            by injection costs this much).
        mid_switch_restarts: also restart the simulator between a list's send and its reply
            (``sim_restart_mid_switch``): the reply is owed to a ClusterD that no longer exists.
        switch_deadline_s: bound on one switch, faults and recovery included; past it the run
            fails with :class:`SoakFailure` naming the switch.
    """

    switches: int = 40
    seed: int = 7
    pause_modes: tuple[str, ...] = ("agent", "external")
    ranks: int = 2
    kills: int | None = None
    report_timeout_s: float = 3.0
    mid_switch_restarts: bool = False
    switch_deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if self.switches < 1 or self.ranks < 1:
            raise ValueError("switches and ranks must be positive")
        unknown = set(self.pause_modes) - {"agent", "external"}
        if unknown or not self.pause_modes:
            raise ValueError(f"pause modes must be agent and/or external, not {sorted(unknown)}")


@dataclass
class Recovery:
    """One simulator restart: how long the agent took to be ready, and to finish the next switch."""

    kind: str  # sim_restart | sim_kill
    mode: str
    outage_s: float  # old simulator gone -> new one serving (process start-up, for a process)
    ready_s: float  # new simulator serving -> the agent's streams open again (registered, in order)
    switch_done_s: float | None = None  # new simulator serving -> the next switch finished


@dataclass
class SoakReport:
    """What a run did; ``problems`` and ``violations`` must both be empty."""

    settings: SoakSettings
    switches: int = 0
    per_mode: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)  # faults that fired
    outcomes: Counter[str] = field(default_factory=Counter)
    lists_delivered: int = 0  # lists the simulator sent to the agent
    replies: int = 0  # replies that reached ClusterD's handler
    replies_lost: int = 0  # of those, lost in flight by injection (the agent sent them once, never again)
    reply_retries: int = 0  # "qps exceeded" refusals the agent retried
    job_restarts: int = 0
    violations: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.violations

    def text(self) -> str:
        s = self.settings
        modes = ", ".join(f"{m}: {n}" for m, n in sorted(self.per_mode.items()))
        lines = [
            f"nicswitch-agent soak: {self.switches} switches ({modes}), seed {s.seed}, {s.ranks} rank(s), "
            f"{self.duration_s:.1f} s",
            "faults injected:",
            *(f"  {kind:<30}{self.faults[kind]:>6}" for kind in FAULTS if self.faults[kind]),
            "outcomes:",
            *(f"  {name:<30}{count:>6}" for name, count in sorted(self.outcomes.items())),
            f"lists delivered: {self.lists_delivered}; replies that reached ClusterD: {self.replies} "
            f"(of which lost in flight by injection: {self.replies_lost}); \"qps exceeded\" retries: "
            f"{self.reply_retries}; job restarts after exit: {self.job_restarts}",
        ]
        for kind in (SIM_RESTART, SIM_KILL, SIM_RESTART_MID_SWITCH):
            times = [r for r in self.recoveries if r.kind == kind]
            if times:
                outage = [r.outage_s for r in times]
                ready = [r.ready_s for r in times]
                done = [r.switch_done_s for r in times if r.switch_done_s is not None]
                done_text = f", next switch done in {_spread(done)}" if done else ""
                lines.append(f"recovery after {kind} ({len(times)}), from the new simulator serving: streams "
                             f"reopened in {_spread(ready)}{done_text} (simulator down for {_spread(outage)})")
        lines.append(f"violations: {len(self.violations)}")
        lines += [f"  {v}" for v in self.violations[:20]]
        lines.append(f"problems: {len(self.problems)}")
        lines += [f"  {p}" for p in self.problems[:20]]
        return "\n".join(lines)


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return (f"min {min(values) * 1000:.0f} / median {statistics.median(values) * 1000:.0f} / "
            f"max {max(values) * 1000:.0f} ms")


# -- the simulator, in this process or as a separate one ------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """What the simulator did so far for the soak's job (counts only grow, per simulator)."""

    lists_sent: int
    replies: int
    violations: tuple[str, ...]
    flows: tuple[str, ...]  # every switch flow that ended, its action path as ClusterD logs it
    ready: bool  # in INIT, with a process-manage and a notify stream open


def _flow_text(path: Sequence[str]) -> str:
    return "-->".join(path)


class InProcessBackend:
    """A :class:`Simulator` in this process; supports injected faults."""

    kind = "in-process"

    def __init__(self, port: int, sim_settings: SimSettings, job: SimJob, standin: bool,
                 standin_register_delay_s: float = 0.0) -> None:
        self.sim = Simulator(jobs=[job], settings=sim_settings, port=port, standin=standin,
                             standin_register_delay_s=standin_register_delay_s)
        self.address = self.sim.start()
        self.port = int(self.address.rsplit(":", 1)[1])
        self.faults: F.SimFaults | None = self.sim.faults

    def snapshot(self) -> Snapshot:
        view = self.sim.job_view(JOB)
        flows = tuple(_flow_text(p) for p in view.path_history if p and p[0].startswith(P.INIT + "("))
        ready = (view.state == P.INIT and view.open_streams[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] >= 1
                 and view.open_streams[P.SUBSCRIBE_NOTIFY_SWITCH] >= 1)
        return Snapshot(len(view.lists_sent), len(view.replies), tuple(view.violations), flows, ready)

    def wait(self, predicate: Callable[[Snapshot], bool], timeout: float) -> bool:
        return self.sim.wait_until(lambda _sim: predicate(self.snapshot()), timeout)

    def close(self) -> None:
        self.sim.stop()

    def tail(self) -> str:
        view = self.sim.job_view(JOB)
        return (f"state {view.state}, path {view.action_path_text}, open streams {view.open_streams}, "
                f"last resets {view.resets[-3:]}, queued {view.queued}")


class SubprocessBackend:
    """``python -m nicswitch_agent.sim -v`` as a separate process, read from its log lines.

    The simulator logs every reset (with the action path), stream open, list sent, reply and
    protocol misuse; that is all the soak needs to check its invariants from outside.
    """

    kind = "process"
    faults: F.SimFaults | None = None

    def __init__(self, port: int, job: SimJob, *, report_timeout_s: float, standin: bool,
                 startup_timeout_s: float = 60.0) -> None:
        nodes = [f"{node}:{','.join(devs)}" for node, devs in job.nodes.items()]
        command = [sys.executable, "-m", "nicswitch_agent.sim", "--port", str(port), "--job", JOB,
                   "--report-timeout", str(report_timeout_s), "--keepalive", "1", "--quick-recovery",
                   "--strategies", ",".join(job.recover_strategies), "--no-shuffle", "--verbose",
                   "--crash-like-clusterd"]
        for node in nodes:
            command += ["--nodes", node]
        if standin:
            command.append("--standin")
        env = dict(os.environ)
        src = str(Path(nicswitch_agent.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        self._cond = threading.Condition()  # guards everything the reader thread updates
        self._lines: list[str] = []
        self._lists = 0
        self._replies = 0
        self._violations: list[str] = []
        self._flows: list[str] = []
        self._opened: set[str] = set()  # streams opened since the last reset
        self._events: list[str] = []  # "register", "reset", and the stream methods opened, in order
        self._listening = False
        self._exited = False
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self._reader = threading.Thread(target=self._read, name="soak-sim-reader", daemon=True)
        self._reader.start()
        with self._cond:
            started = self._cond.wait_for(lambda: self._listening or self._exited, startup_timeout_s)
        if not started or self._exited:
            tail = "\n".join(self._lines[-10:])
            self.close()
            raise SoakFailure(f"simulator process did not start on port {port} within {startup_timeout_s:g} s:\n"
                              f"{tail}")
        self.port = port
        self.address = f"127.0.0.1:{port}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._cond:
                self._lines.append(line)
                del self._lines[:-200]
                self._parse(line)
                self._cond.notify_all()
        with self._cond:
            self._exited = True
            self._cond.notify_all()

    def _parse(self, line: str) -> None:
        if len(self._events) > 10_000:
            del self._events[:5_000]
        if "listening on" in line:
            self._listening = True
        elif line.endswith(" register success"):
            self._events.append("register")
        elif "protocol misuse: " in line:
            self._violations.append(line.split("protocol misuse: ", 1)[1])
        elif " switch nic signal=" in line:
            self._lists += 1
        elif " nic swtich result: " in line:
            self._replies += 1
        elif " reset (" in line and "action path = {" in line:
            self._opened.clear()
            self._events.append("reset")
            path = line.split("action path = {", 1)[1].rstrip("}")
            if path.startswith(P.INIT + "("):
                self._flows.append(path)
        else:
            for method in (P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, P.SUBSCRIBE_NOTIFY_SWITCH):
                if f" {method} opened" in line:
                    self._opened.add(method)
                    self._events.append(method)

    def _snapshot(self) -> Snapshot:
        ready = {P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, P.SUBSCRIBE_NOTIFY_SWITCH} <= self._opened
        return Snapshot(self._lists, self._replies, tuple(self._violations), tuple(self._flows), ready)

    def snapshot(self) -> Snapshot:
        with self._cond:
            return self._snapshot()

    def wait(self, predicate: Callable[[Snapshot], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._exited or predicate(self._snapshot()), timeout) and (
                not self._exited)

    def events(self) -> list[str]:
        """What the agent did to this simulator, in order: ``register`` (Init and Register of a job
        the simulator did not know yet), ``reset``, and the stream methods opened."""
        with self._cond:
            return list(self._events)

    def kill(self) -> None:
        """SIGKILL, as an OOM killer or a node failure would."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(5)

    def stop_process(self) -> None:
        """SIGSTOP: the process freezes with its sockets open (a half-open connection)."""
        self.proc.send_signal(signal.SIGSTOP)

    def continue_process(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.kill()

    def tail(self, lines: int = 20) -> str:
        with self._cond:
            return f"{self._snapshot()}; log tail:\n" + "\n".join(self._lines[-lines:])


Backend = InProcessBackend | SubprocessBackend


# -- the job: ranks as threads ---------------------------------------------------------------------


class HookPlan:
    """Which rank's next switch-hook call misbehaves, and how; and what every call received."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self.release = threading.Event()  # set on shutdown: a slow hook returns at once
        self.unhold = threading.Event()  # lets a held hook return
        self.held = threading.Event()  # a hook is being held
        self._lock = threading.Lock()  # guards everything below
        self._armed: dict[int, str] = {}
        self.switch_index = -1
        self.calls: dict[int, list[tuple[int, tuple[int, ...], tuple[bool, ...]]]] = {}  # switch -> calls
        self.fired: Counter[str] = Counter()

    def arm(self, rank: int, action: str) -> None:
        with self._lock:
            self._armed[rank] = action

    def begin(self, index: int) -> None:
        with self._lock:
            self._armed.clear()
            self.switch_index = index
        self.unhold.clear()
        self.held.clear()

    def fired_count(self, kind: str) -> int:
        with self._lock:
            return self.fired[kind]

    def hook(self, rank: int) -> Callable[[SwitchOrder], bool]:
        def switch_hook(order: SwitchOrder) -> bool:
            with self._lock:
                action = self._armed.pop(rank, None)  # the first call after arming: the switch itself
                calls = self.calls.setdefault(self.switch_index, [])
                if not any(c[0] == rank for c in calls):
                    calls.append((rank, order.ranks, order.ops))
                if action is not None:
                    self.fired[action] += 1
            if action == HOOK_FALSE:
                return False
            if action == HOOK_RAISES:
                raise RuntimeError(f"soak: injected hook failure on rank {rank}")
            if action in (HOOK_TIMEOUT, MEMBER_SLOW):
                self.release.wait(self.slow_s)
            elif action == HOLD:
                self.held.set()
                while not (self.unhold.wait(0.05) or self.release.is_set()):
                    pass
            return True

        return switch_hook


class Rank:
    """One rank: its agent and a training thread (a 2 ms step, a collective, ``agent.step()``)."""

    def __init__(self, rank: int, agent: SwitchAgent, barrier: threading.Barrier, cond: threading.Condition) -> None:
        self.rank = rank
        self.agent = agent
        self._barrier = barrier
        self._cond = cond  # the job's: notified on every step and when the thread ends
        self.step = 0
        self.error: BaseException | None = None
        self.done = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"soak-train-{rank}", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.002):  # the "step"
                self._barrier.wait()  # the step's all-reduce: a rank that ran past a pause deadlocks here
                with self._cond:
                    self.step += 1
                    self._cond.notify_all()
                self.agent.step(self.step)
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:
            self.error = exc
            self._barrier.abort()
        finally:
            with self._cond:
                self.done = True
                self._cond.notify_all()

    def stop(self) -> None:
        self._stop.set()


class Job:
    """``ranks`` agents (rank 0 leads) on one in-process Store, and their training threads."""

    def __init__(self, address: str, pause: str, ranks: int, plan: HookPlan, agent_settings: dict[str, Any]) -> None:
        self.store = InProcessStore()
        self.cond = threading.Condition()
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.stopped: list[str] = []  # on_stop reasons (the leader's)
        self.leader_events = threading.Condition()  # notified on every event of the leader
        self.ranks: list[Rank] = []
        for r in range(ranks):
            agent = SwitchAgent(server=address, job_id=JOB, pause=pause, switch_hook=plan.hook(r), store=self.store,
                                rank=r, world_size=ranks, on_stop=self.stopped.append,
                                on_event=self._on_leader_event if r == 0 else None, **agent_settings)
            self.ranks.append(Rank(r, agent, self.barrier, self.cond))
        try:
            for rank in self.ranks:
                rank.agent.start()
        except BaseException:
            self.close()
            raise
        for rank in self.ranks:
            rank.thread.start()

    @property
    def leader(self) -> SwitchAgent:
        return self.ranks[0].agent

    def _on_leader_event(self, event: Any) -> None:
        with self.leader_events:
            self.leader_events.notify_all()

    def wait_leader(self, predicate: Callable[[SwitchAgent], bool], timeout: float) -> bool:
        """Wait until ``predicate(leader)`` holds, re-checked on every event of the leader."""
        with self.leader_events:
            return self.leader_events.wait_for(lambda: predicate(self.leader), timeout)

    def counters(self) -> dict[str, int]:
        counters: dict[str, int] = self.leader.status()["counters"]
        return counters

    def steps(self) -> list[int]:
        with self.cond:
            return [r.step for r in self.ranks]

    def wait_training(self, since: list[int], timeout: float) -> str | None:
        """Wait until every rank stepped twice past ``since`` ("running") or every training thread
        ended ("stopped"); None on timeout."""
        def state() -> str | None:
            if all(r.done for r in self.ranks):
                return "stopped"
            if all(r.step >= s + 2 for r, s in zip(self.ranks, since, strict=True)):
                return "running"
            return None

        with self.cond:
            self.cond.wait_for(lambda: state() is not None, timeout)
            return state()

    def close(self) -> None:
        for rank in self.ranks:
            rank.stop()
        self.barrier.abort()
        for rank in self.ranks:
            rank.agent.stop("soak: job closed")
        for rank in self.ranks:
            if rank.thread.ident is not None:
                rank.thread.join(10)


def agent_problems(agent: SwitchAgent) -> list[str]:
    """Dead agent threads (names), a parked rank, or a state other than running.

    Reads the agent's own thread handles (private: this is the agent's test harness), not thread
    names, which every rank's agent in this process shares.
    """
    problems = []
    status = agent.status()
    if status["state"] not in ("running", "switching"):
        problems.append(f"rank {agent.rank}: state {status['state']}")
    if status["parked"]:
        problems.append(f"rank {agent.rank}: still parked at step {status['parked_step']}")
    threads: dict[str, Any] = {"nicswitch-member": agent._member}
    if agent._coordinator is not None:  # the leader
        threads.update({"nicswitch-notify": agent._session.subscriber, "nicswitch-executor": agent._executor})
        if agent.pause_mode == "agent":
            controller = agent._session.controller
            threads.update({"nicswitch-process-manage": agent._session.process_manage,
                            "nicswitch-signals": controller._thread if controller else None})
    for name, owner in threads.items():
        alive = owner is not None and (owner.is_alive() if isinstance(owner, threading.Thread) else owner.running)
        if not alive:
            problems.append(f"rank {agent.rank}: thread {name} is not running")
    return problems


def _settled(leader: SwitchAgent, before: dict[str, int]) -> bool:
    """Every list the leader received since ``before`` has had its reply sent or given up."""
    counters = leader.status()["counters"]
    settled = counters["replies_delivered"] + counters["replies_failed"]
    return bool(settled - before["replies_delivered"] - before["replies_failed"]
                >= counters["lists_received"] - before["lists_received"])


def leader_summary(leader: SwitchAgent) -> str:
    """What the leader says about its streams (why it is not subscribed, for failure reports):
    opens, errors, its last error, and the process-manage client's conflict evidence."""
    status = leader.status()
    pm = status.get("process_manage") or {}
    return (f"connected {status.get('connected')}, notify {status.get('stream')}, last error "
            f"{status.get('last_error')!r}, process-manage opens {pm.get('opens')} errors {pm.get('errors')} "
            f"quiet resets {pm.get('quiet_resets')}, conflict {status.get('conflict')}")


def agent_stacks(depth: int = 4) -> str:
    """Where every agent and training thread is, innermost ``depth`` frames (for deadlock reports)."""
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "?")
        if not name.startswith(("nicswitch-", "soak-")):
            continue
        frames = traceback.extract_stack(frame)[-depth:]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
        lines.append(f"  {name}: {where}")
    return "\n".join(sorted(lines))


# -- the run ---------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _nodes(ranks: int) -> dict[str, list[str]]:
    per_node = 2 if ranks % 2 == 0 else 1
    return {f"node-{n}": [str(d) for d in range(per_node)] for n in range(ranks // per_node)}


class _ModeRun:
    """The switches of one pause mode: one job, a sequence of simulators on one port."""

    def __init__(self, settings: SoakSettings, mode: str, switches: int, rng: random.Random, report: SoakReport,
                 out: TextIO | None) -> None:
        self.settings = settings
        self.mode = mode
        self.switches = switches
        self.rng = rng
        self.report = report
        self.out = out
        self.port = _free_port()
        self.standin = mode == "external"
        self.sim_job = SimJob(job_id=JOB, nodes=_nodes(settings.ranks), recover_strategies=("recover",))
        self.sim_settings = SimSettings(report_timeout_s=settings.report_timeout_s, keepalive_interval_s=1.0,
                                        fault_flush_s=0.01, force_release_s=0.05, schedule_wait_s=0.02,
                                        restart_wait_s=0.02, seed=rng.randrange(1 << 30),
                                        crash_like_clusterd=True)
        guard_s, switch_s = 0.2, 0.4
        self.plan = HookPlan(slow_s=guard_s + switch_s + 0.3)
        self.agent_settings: dict[str, Any] = dict(
            reconnect_initial_s=0.02, reconnect_max_s=0.5, guard_timeout_s=guard_s, switch_timeout_s=switch_s,
            pause_timeout_s=10.0, reply_timeout_s=5.0, reply_attempt_timeout_s=2.0, rpc_timeout_s=5.0,
        )
        self.backend: Backend = InProcessBackend(self.port, self.sim_settings, self.sim_job, self.standin)
        self.port = self.backend.port
        self.job = Job(self.backend.address, mode, settings.ranks, self.plan, self.agent_settings)
        self._deck: list[str] = []
        self._pending_recovery: tuple[Recovery, float] | None = None

    # -- helpers -----------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        if self.out is not None:
            self.out.write(text + "\n")
            self.out.flush()

    def _wait(self, what: str, predicate: Callable[[Snapshot], bool], index: int, fault: str,
              timeout: float | None = None) -> None:
        if not self.backend.wait(predicate, timeout or self.settings.switch_deadline_s):
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): {what} within "
                              f"{timeout or self.settings.switch_deadline_s:g} s; simulator: {self.backend.tail()}\n"
                              f"leader: {leader_summary(self.job.leader)}\nagent threads:\n{agent_stacks()}")

    def _problem(self, index: int, fault: str, text: str) -> None:
        self.report.problems.append(f"{self.mode} switch #{index} (fault {fault}): {text}")

    def _draw(self, allowed: set[str]) -> str:
        """The next fault, from shuffled decks holding every kind once and ``none`` five times
        (so 15 switches see every kind); kinds not ``allowed`` now wait for a later draw."""
        for _ in range(2):
            for i, kind in enumerate(self._deck):
                if kind in allowed:
                    return self._deck.pop(i)
            deck = [NONE] * 4 + [k for k in FAULTS if k not in (SIM_KILL, SIM_RESTART_MID_SWITCH)]
            if self.settings.mid_switch_restarts:
                deck += [SIM_RESTART_MID_SWITCH] * 2  # twice: it is what such a run is for
            self.rng.shuffle(deck)
            self._deck += deck
        return NONE

    def _request(self) -> pb.SwitchNics:
        request = pb.SwitchNics(jobID=JOB)
        pairs = [(node, dev) for node, devs in self.sim_job.nodes.items() for dev in devs]
        chosen = self.rng.sample(pairs, self.rng.randint(1, len(pairs)))
        for node, dev in chosen:
            request.nicOps[node].dev.append(dev)
            request.nicOps[node].op.append(self.rng.random() < 0.5)
        return request

    # -- restarts ----------------------------------------------------------------------------

    def _replace_backend(self, new: Callable[[], Backend], kind: str) -> None:
        old = self.backend
        if isinstance(old, SubprocessBackend):
            old.kill()
        else:
            old.close()
        gone = time.monotonic()
        self.backend = new()
        serving = time.monotonic()
        self._wait("the agent did not reopen its streams on the restarted simulator", lambda s: s.ready,
                   self.report.switches, kind)
        recovery = Recovery(kind, self.mode, serving - gone, time.monotonic() - serving)
        self._pending_recovery = (recovery, serving)  # the next switch completes it
        self.report.recoveries.append(recovery)

    def _in_process(self) -> Backend:
        return InProcessBackend(self.port, self.sim_settings, self.sim_job, self.standin)

    def _process(self) -> Backend:
        return SubprocessBackend(self.port, self.sim_job, report_timeout_s=self.settings.report_timeout_s,
                                 standin=self.standin)

    # -- one switch --------------------------------------------------------------------------

    def run(self) -> None:
        kills = self.settings.kills
        if kills is None:
            kills = max(1, self.switches // 50)
        kills = min(kills, max(0, (self.switches - 1) // 3))  # an episode takes 3 switches
        episode_at = {int((k + 0.5) * self.switches / max(kills, 1)) for k in range(kills)}
        self._wait("the agent did not open its streams", lambda s: s.ready, 0, NONE)
        index = 0
        try:
            while index < self.switches:
                if index in episode_at and index + 3 <= self.switches:
                    # The simulator as a process, killed twice: to a process, to a new process, back home.
                    self._replace_backend(self._process, SIM_RESTART)
                    self._switch(index, SIM_RESTART)
                    self._replace_backend(self._process, SIM_KILL)
                    self._switch(index + 1, SIM_KILL)
                    self._replace_backend(self._in_process, SIM_KILL)
                    self._switch(index + 2, SIM_KILL)
                    index += 3
                    continue
                allowed = set(FAULTS) - {SIM_KILL}
                if self.settings.ranks < 2:
                    allowed.discard(MEMBER_SLOW)
                if not self.settings.mid_switch_restarts:
                    allowed.discard(SIM_RESTART_MID_SWITCH)
                fault = self._draw(allowed)
                if fault == SIM_RESTART:
                    self._replace_backend(self._in_process, SIM_RESTART)
                if fault == SIM_RESTART_MID_SWITCH:
                    self._switch_with_restart(index)
                else:
                    self._switch(index, fault)
                index += 1
        finally:
            self.plan.release.set()
            self.job.close()
            self.backend.close()

    def _switch_with_restart(self, index: int) -> None:
        """The list is sent, the hooks are held, the simulator restarts; then the hooks finish.

        The new ClusterD never sent that list: a reply to it would be taken as the result of its
        next switch (docs/clusterd.md#reply-timing-and-the-crash), so it must receive none.
        """
        fault, job, old = SIM_RESTART_MID_SWITCH, self.job, self.backend
        self.plan.begin(index)
        before, counters = old.snapshot(), job.counters()
        for r in range(self.settings.ranks):
            self.plan.arm(r, HOLD)
        started = time.monotonic()
        self._track(old, index, fault)
        self._wait("ClusterD did not send the list", lambda s: s.lists_sent > before.lists_sent, index, fault)
        if not self.plan.held.wait(self.settings.switch_deadline_s):
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): no rank ran the switch hook")
        last = old.snapshot()
        lists, answered = last.lists_sent - before.lists_sent, last.replies - before.replies
        # TaskD registers the job with a restarted ClusterD only after its health check failed and
        # it slept (10 s upstream; 1 s here): the agent's notify stream sees "not registed" first.
        self._replace_backend(lambda: InProcessBackend(self.port, self.sim_settings, self.sim_job, self.standin,
                                                       standin_register_delay_s=1.0 if self.standin else 0.0),
                              fault)
        new = self.backend
        fresh = new.snapshot()
        steps = job.steps()
        self.plan.unhold.set()
        if not job.wait_leader(lambda leader: leader.status()["state"] == "running" and leader.status()["counters"][
                "lists_received"] > counters["lists_received"], self.settings.switch_deadline_s):
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): the agent did not finish the order\n"
                              f"agent threads:\n{agent_stacks()}")
        training = job.wait_training(steps, self.settings.switch_deadline_s)
        if training != "running":
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): training is {training or 'stuck'}")
        # A stray reply is written within the reply's own budget: settle before reading the simulator.
        job.wait_leader(lambda leader: _settled(leader, counters), self.settings.switch_deadline_s)
        after = new.snapshot()
        stray = after.replies - fresh.replies
        report = self.report
        report.faults[fault] += 1
        report.lists_delivered += lists
        report.replies += answered + stray
        report.outcomes["restarted before the reply" if not answered else "answered before the restart"] += 1
        report.switches += 1
        report.per_mode[self.mode] += 1
        report.violations += [f"{self.mode} switch #{index} (fault {fault}): {v}"
                              for v in after.violations[len(fresh.violations):]]
        if stray:
            self._problem(index, fault, f"the restarted ClusterD never sent a list but received {stray} reply(ies)")
        if answered > lists:
            self._problem(index, fault, f"ClusterD delivered {lists} list(s) but received {answered} reply(ies)")
        for rank in job.ranks:
            for problem in agent_problems(rank.agent):
                self._problem(index, fault, problem)
        label = "restarted before the reply" if not answered else "answered before the restart"
        self._say(f"{self.mode} #{index:<4} {fault:<28} {label:<26} lists {lists} "
                  f"replies {answered} + {stray} stray {(time.monotonic() - started) * 1000:7.0f} ms  [{new.kind}]")

    def _track(self, backend: Backend, index: int, fault: str) -> None:
        channel = open_channel(ChannelSettings(target=backend.address))
        try:
            status = RecoverStub(channel).SwitchNicTrack(self._request(), timeout=10, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): SwitchNicTrack failed: {exc}") from exc
        finally:
            channel.close()
        if status.code != 0:
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): SwitchNicTrack answered "
                              f"{status.code} {status.info!r}")

    def _switch(self, index: int, fault: str) -> None:
        report, backend, job = self.report, self.backend, self.job
        self.plan.begin(index)
        before = backend.snapshot()
        counters = job.counters()
        sim_faults = backend.faults
        fired_before = Counter(sim_faults.fired) if sim_faults is not None else Counter[str]()
        hook_fired_before = Counter(self.plan.fired)
        if fault in F.FAULT_KINDS:
            assert sim_faults is not None, f"{fault} needs the in-process simulator"
            sim_faults.arm(fault)
        elif fault in (HOOK_FALSE, HOOK_RAISES):
            self.plan.arm(self.rng.randrange(self.settings.ranks), fault)
        elif fault == HOOK_TIMEOUT:
            self.plan.arm(0, fault)
        elif fault == MEMBER_SLOW:
            self.plan.arm(self.rng.randrange(1, self.settings.ranks), fault)

        started = time.monotonic()
        self._track(backend, index, fault)
        # Every switch ends in a reset, whether it succeeded or ClusterD's recovery ran.
        self._wait("ClusterD did not finish the switch", lambda s: len(s.flows) > len(before.flows), index, fault)
        steps = job.steps()
        flow = backend.snapshot().flows[-1]
        training = job.wait_training(steps, self.settings.switch_deadline_s)
        if training is None:
            raise SoakFailure(f"{self.mode} switch #{index} (fault {fault}): training neither stepped again nor "
                              f"stopped within {self.settings.switch_deadline_s:g} s; steps {job.steps()}, "
                              f"parked {[r.agent.status()['parked'] for r in job.ranks]}\n"
                              f"agent threads:\n{agent_stacks()}")
        if training == "running":
            self._wait("the streams were not reopened after the switch", lambda s: s.ready, index, fault)
        elapsed = time.monotonic() - started
        after = backend.snapshot()

        # -- invariants --------------------------------------------------------------------------
        fired = Counter(sim_faults.fired) - fired_before if sim_faults is not None else Counter[str]()
        fired.update(Counter(self.plan.fired) - hook_fired_before)
        fired.pop(HOLD, None)
        if fault in (NONE, SIM_RESTART, SIM_KILL):
            fired[fault] += 1
        report.faults.update(fired)
        lists = after.lists_sent - before.lists_sent
        lost = fired[F.REPLY_UNAVAILABLE_LOST]
        replies = after.replies - before.replies + lost
        report.lists_delivered += lists
        report.replies += replies
        report.replies_lost += lost
        report.reply_retries += fired[F.REPLY_QPS_EXCEEDED]
        if replies != lists:
            self._problem(index, fault, f"ClusterD delivered {lists} list(s) but received {replies} reply(ies)")
        new_violations = list(after.violations[len(before.violations):])
        report.violations += [f"{self.mode} switch #{index} (fault {fault}): {v}" for v in new_violations]
        # ClusterD has the reply before the agent has the RPC's answer: let its counters catch up.
        job.wait_leader(lambda leader: _settled(leader, counters), self.settings.switch_deadline_s)
        leader_after = job.counters()
        received = leader_after["lists_received"] - counters["lists_received"]
        settled = (leader_after["replies_delivered"] + leader_after["replies_failed"]
                   - counters["replies_delivered"] - counters["replies_failed"])
        if received != lists or settled != received:
            self._problem(index, fault, f"the agent received {received} list(s) and settled {settled} reply(ies); "
                          f"ClusterD delivered {lists}")
        last = job.leader.status()["last_switch"] or {}
        if received and "did not answer" in str(last.get("reason", "")):
            # No soak hook hangs longer than its budget plus the leader's slack: a rank that does
            # not answer at all is wedged, and would fail every later switch too.
            self._problem(index, fault, f"a rank answered nothing: {last.get('reason')}")
        # Each rank's first hook call of the switch. Where a hook fault failed it, a rank that reads
        # the switch order after the leader decided it (the rollback already waiting behind it)
        # skips it and runs the rollback only (coordination/member.py): its first call is the
        # rollback's. The list of ranks is the same in every call.
        calls = self.plan.calls.get(index, [])
        if len({c[1] for c in calls}) > 1 or (len({c[2] for c in calls}) > 1 and fault not in HOOK_FAULTS):
            self._problem(index, fault, f"ranks ran the switch hook with different lists: {calls}")
        if training == "running":
            outcome = OUTCOME_OK if "switchNicRecvContinue" in flow else OUTCOME_RECOVERED
            for rank in job.ranks:
                for problem in agent_problems(rank.agent):
                    self._problem(index, fault, problem)
        else:
            outcome = OUTCOME_STOPPED
            errors = [r.error for r in job.ranks if r.error is not None and not isinstance(r.error, TrainingStopped)]
            if errors or not any(isinstance(r.error, TrainingStopped) for r in job.ranks):
                self._problem(index, fault, f"training ended without TrainingStopped: {errors}")
            if any(r.agent.status()["parked"] for r in job.ranks):
                self._problem(index, fault, "a rank is still parked after training stopped")
        report.outcomes[outcome] += 1
        report.switches += 1
        report.per_mode[self.mode] += 1
        if self._pending_recovery is not None:
            recovery, serving = self._pending_recovery
            recovery.switch_done_s = time.monotonic() - serving
            self._pending_recovery = None
        self._say(f"{self.mode} #{index:<4} {fault:<28} {outcome:<26} lists {lists} replies {replies} "
                  f"{elapsed * 1000:7.0f} ms  [{backend.kind}]")
        if outcome == OUTCOME_STOPPED:  # as a launcher would: start the job again
            job.close()
            report.job_restarts += 1
            self.job = Job(backend.address, self.mode, self.settings.ranks, self.plan, self.agent_settings)
            self._wait("the restarted job did not open its streams", lambda s: s.ready, index, fault)


def run_soak(settings: SoakSettings, *, out: TextIO | None = None) -> SoakReport:
    """Run the soak; returns the report (check ``report.ok``). Raises :class:`SoakFailure` on a
    bounded wait that ran out (the report so far is in ``exc.report``)."""
    report = SoakReport(settings)
    rng = random.Random(settings.seed)
    started = time.monotonic()
    per_mode = [settings.switches // len(settings.pause_modes)] * len(settings.pause_modes)
    per_mode[0] += settings.switches - sum(per_mode)
    try:
        for mode, count in zip(settings.pause_modes, per_mode, strict=True):
            if count:
                _ModeRun(settings, mode, count, rng, report, out).run()
    except SoakFailure as exc:
        report.duration_s = time.monotonic() - started
        exc.report = report  # type: ignore[attr-defined]
        raise
    report.duration_s = time.monotonic() - started
    return report


# -- keepalive: an idle agent --------------------------------------------------------------------


@dataclass
class IdleReport:
    seconds: float
    keepalive_time_s: float
    stream_errors: int
    process_manage_errors: int
    registrations: int  # process-manage subscribes the simulator saw (each one resets the job)
    notify_opens: int
    last_error: str
    connected: bool

    @property
    def ok(self) -> bool:
        return (self.stream_errors == 0 and self.process_manage_errors == 0 and self.registrations == 1
                and self.notify_opens == 1 and self.connected)

    def text(self) -> str:
        return (f"idle {self.seconds:.0f} s with keepalive_time_s={self.keepalive_time_s:g}: stream errors "
                f"{self.stream_errors}, process-manage errors {self.process_manage_errors}, process-manage "
                f"subscribes {self.registrations}, notify subscribes {self.notify_opens}, connected "
                f"{self.connected}" + (f", last error {self.last_error!r}" if self.last_error else "")
                + ("  OK" if self.ok else "  FAILED"))


def idle_check(seconds: float, *, keepalive_time_s: float = 3.0, stop: threading.Event | None = None) -> IdleReport:
    """One idle agent (pause mode agent) against a simulator that enforces ClusterD's ping policy
    and sends no keep-alive data (which would reset its ping strikes) for ``seconds``."""
    settings = SimSettings(keepalive_interval_s=3600.0)
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})], settings=settings) as sim:
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", dry_run=True,
                            keepalive_time_s=keepalive_time_s)
        agent.start()
        try:
            def streams(s: Simulator) -> bool:
                view = s.job_view(JOB)
                return (view.open_streams[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] == 1
                        and view.open_streams[P.SUBSCRIBE_NOTIFY_SWITCH] == 1)

            if not sim.wait_until(streams, 30):
                raise SoakFailure("the idle agent did not open its streams within 30 s")
            (stop or threading.Event()).wait(seconds)  # the observation window, not synchronisation
            status = agent.status()
            view = sim.job_view(JOB)
            pm = status["process_manage"] or {}
            return IdleReport(seconds, keepalive_time_s, status["stream"]["errors"], pm.get("errors", 0),
                              view.stream_opens[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL],
                              view.stream_opens[P.SUBSCRIBE_NOTIFY_SWITCH],
                              status["last_error"] or pm.get("last_error", ""), bool(status["connected"]))
        finally:
            agent.stop("idle check done")


# -- CLI -------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/soak.py",
                                     description="Fault soak of the agent against the simulator.")
    parser.add_argument("--switches", type=int, default=100, help="switches in total (default 100)")
    parser.add_argument("--seed", type=int, default=7, help="seed of every random choice (default 7)")
    parser.add_argument("--pause", default="agent,external", help="pause modes, comma-separated (default both)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the job, as threads (default 2)")
    parser.add_argument("--kills", type=int, default=None,
                        help="SIGKILL episodes per pause mode (default: one per 50 switches; 0: none)")
    parser.add_argument("--report-timeout", type=float, default=3.0, metavar="SECONDS",
                        help="the simulator's wait for each report and reply (default 3)")
    parser.add_argument("--mid-switch-restarts", action="store_true",
                        help="also restart the simulator between a list and its reply (sim_restart_mid_switch)")
    parser.add_argument("--idle-minutes", type=float, default=None, metavar="MINUTES",
                        help="instead of the soak: keep one agent idle this long with keepalive_time_s=3")
    parser.add_argument("--keepalive", type=float, default=3.0, metavar="SECONDS",
                        help="keepalive_time_s for --idle-minutes (default 3, ClusterD's minimum)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per switch")
    parser.add_argument("--log", action="store_true", help="also print the agent's and simulator's warnings")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.log else logging.CRITICAL,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.idle_minutes is not None:
        idle = idle_check(args.idle_minutes * 60, keepalive_time_s=args.keepalive)
        print(idle.text())
        return 0 if idle.ok else 1
    settings = SoakSettings(switches=args.switches, seed=args.seed,
                            pause_modes=tuple(m.strip() for m in args.pause.split(",") if m.strip()),
                            ranks=args.ranks, kills=args.kills, report_timeout_s=args.report_timeout,
                            mid_switch_restarts=args.mid_switch_restarts)
    try:
        report = run_soak(settings, out=sys.stdout if args.verbose else None)
    except SoakFailure as exc:
        partial: SoakReport | None = getattr(exc, "report", None)
        if partial is not None:
            print(partial.text())
        print(f"SOAK FAILED: {exc}")
        return 1
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
