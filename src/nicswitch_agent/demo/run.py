"""``nicswitch-agent demo``: a failover and a switchback against the embedded simulator.

The ClusterD simulator runs in this process, on loopback, with a small training job of
``--ranks`` ranks (4 by default) whose agents run in pause mode ``agent`` (rank 0's agent is
ClusterD's process-manage client and every rank parks at the same step boundary; no MindIO
needed), and an operator that calls SwitchNicTrack and follows SubscribeSwitchNicSignal. It
prints a timeline of what happened and exits 0 only if both switches ended in "switch nic
finish" with every link where it should be, on every rank, and every rank parked at the same
steps.

The ranks are threads by default (no torch needed; they meet at every step like an all-reduce
and coordinate through an in-process store). With ``--processes`` each rank is a real torch
process (see :mod:`nicswitch_agent.demo.processes`): gloo on CPU, ``torch.distributed`` over a
TCPStore, an all-reduce every step, and the agents coordinating through the job's own Store.

With ``--server`` there is no embedded simulator and no operator: the thread job joins a ClusterD
(or a ``nicswitch-agent sim``) that is already running and waits for an operator's switches
(:func:`run_job`), so that ``switch`` and ``watch`` can be rehearsed from a shell.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.demo.common import (
    _LEADER_EVENTS,
    DEFAULT_RANKS,
    EVENTS_ENV,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    FINISH,
    JOB_ID,
    STEP_INTERVAL_S,
    WARMUP_STEPS,
    DemoError,
    DemoJob,
    FileCheckpoint,
    LinkTable,
    Progress,
    RankSummary,
    Timeline,
    _SimLogToTimeline,
    check_arguments,
    describe_event,
    describe_standby,
    events_template,
    failover_devices,
    job_nodes,
    pause_problem,
    timeline_event,
    write_timeline_page,
)
from nicswitch_agent.demo.wakeup import SignalWakeup
from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

# -- ranks as threads ---------------------------------------------------------------------------


@dataclass
class _ThreadRank:
    rank: int
    agent: Any
    links: LinkTable
    guard: FileCheckpoint
    progress: Progress
    thread: threading.Thread | None = None
    parked_at: list[int] = field(default_factory=list)


class ThreadJob:
    """Every rank a thread of this process, meeting the others at every step (a Barrier stands in
    for the all-reduce); the agents coordinate through an in-process store."""

    def __init__(self, world: int, timeline: Timeline, workdir: str, job_id: str = JOB_ID,
                 leader_listener: Callable[[AgentEvent], None] | None = None, events_file: str | None = None,
                 step_interval_s: float = STEP_INTERVAL_S) -> None:
        self.world = world
        self.step_interval_s = step_interval_s
        self.events_file = events_file
        self.job_id = job_id
        self.leader_listener = leader_listener
        self.timeline = timeline
        self.workdir = workdir
        self.description = "threads, meeting every step like an all-reduce"
        self.progress = Progress()
        self._ranks: list[_ThreadRank] = []
        self._stop = threading.Event()
        self._collective = threading.Barrier(world, timeout=60)

    def start(self, address: str) -> None:
        from nicswitch_agent.agent import SwitchAgent
        from nicswitch_agent.coordination import InProcessStore

        store = InProcessStore()  # a torch job coordinates through its own TCPStore (--processes)
        settings: dict[str, Any] = {"events_file": self.events_file} if self.events_file else {}
        for r in range(self.world):
            progress = self.progress if r == 0 else Progress()
            links = LinkTable(self.world)
            guard = FileCheckpoint(os.path.join(self.workdir, f"rank{r}"), progress.current)
            agent = SwitchAgent(server=address, job_id=self.job_id, pause="agent", rank=r, world_size=self.world,
                                store=store, switch_hook=links, checkpoint_hook=guard, **settings)
            rank = _ThreadRank(r, agent, links, guard, progress)
            agent.add_listener(functools.partial(self._on_event, rank=rank))
            if r == 0 and self.leader_listener is not None:  # before start(): it must not miss the first events
                agent.add_listener(self.leader_listener)
            self._ranks.append(rank)
        for rank in self._ranks:
            rank.agent.start()
        for rank in self._ranks:
            rank.thread = threading.Thread(target=self._train, args=(rank,), name=f"demo-rank{rank.rank}",
                                           daemon=True)
            rank.thread.start()

    def _on_event(self, event: AgentEvent, *, rank: _ThreadRank) -> None:
        if event.kind == "parked":
            rank.parked_at.append(int(event.detail["step"]))
        timeline_event(self.timeline, event, rank.rank)

    def _train(self, rank: _ThreadRank) -> None:
        """A rank's training loop: compute, meet the others (the all-reduce), mark the step boundary."""
        step = 0
        try:
            while not self._stop.wait(self.step_interval_s):
                self._collective.wait()
                step += 1
                rank.agent.step(step)
                rank.progress.advance(step)
        except (threading.BrokenBarrierError, TrainingStopped):  # the job stops (a rank parked then: stopped too)
            return

    def leader_links(self, switches: int) -> list[bool]:
        return list(self._ranks[0].links.standby)

    def stop(self) -> list[RankSummary]:
        self._stop.set()
        self._collective.abort()
        for rank in self._ranks:
            rank.agent.stop()
            if rank.thread is not None:
                rank.thread.join(5)
        leader = self._ranks[0] if self._ranks else None
        counters = dict(leader.agent.status()["counters"]) if leader is not None else {}
        return [RankSummary(r.rank, list(r.parked_at), list(r.links.standby), r.links.calls, len(r.guard.paths),
                            r.progress.step, counters if r.rank == 0 else {}) for r in self._ranks]


# -- the demo -------------------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _devices_text(devices: list[str]) -> str:
    if len(devices) == 1:
        return f"device {devices[0]}"
    return f"devices {', '.join(devices[:-1])} and {devices[-1]}"


def _operator_switch(stub: RecoverStub, nic_ops: dict[str, tuple[list[str], list[bool]]], timeline: Timeline,
                     timeout: float) -> str:
    request = pb.SwitchNics(jobID=JOB_ID)
    for node, (devs, ops) in nic_ops.items():
        request.nicOps[node].dev.extend(devs)
        request.nicOps[node].op.extend(ops)
    wanted = "; ".join(
        f"{node} dev {','.join(d)} -> {','.join('standby' if o else 'primary' for o in ops)}"
        for node, (d, ops) in nic_ops.items()
    )
    # Stamped when it was sent: under load ClusterD can pause the ranks before the answer is back,
    # and the timeline reads in causal order (the request, then the parking).
    sent = time.time()
    status = stub.SwitchNicTrack(request, timeout=5)
    timeline.add("operator", f"SwitchNicTrack({wanted}) -> {status.code} {status.info!r}", at=sent)
    if status.code != 0:
        return f"refused: {status.code} {status.info}"
    call = stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=JOB_ID), timeout=timeout)
    for response in call:
        timeline.add("operator", f"result: {response.msg!r}")
        return str(response.msg)
    return "stream ended without a result"


def run_demo(out: TextIO, *, verbose: bool = False, ranks: int = DEFAULT_RANKS, processes: bool = False,
             err: TextIO | None = None, output_dir: str | None = None) -> int:
    """Run the demo, print its timeline to ``out``, and draw it as a page (``timeline.html``).

    Args:
        out: Where the timeline and the summary go.
        verbose: Also log the simulator (and, with ``processes``, the ranks) at INFO.
        ranks: Training ranks, 1 to 64 (threads) or 1 to 16 (processes).
        processes: Run each rank as a real torch process instead of a thread.
        err: Where a usage error goes (default ``sys.stderr``).
        output_dir: Where the ranks' events files (``events/``, unless NICSWITCH_EVENTS_FILE says
            otherwise) and the page go; default: a new temporary directory, kept.

    Returns:
        0 when both switches finished correctly on every rank, 1 when not, 2 for a usage error
        (``--processes`` without torch, ``ranks`` out of range, ``NICSWITCH_PAUSE=external``), 130
        on Ctrl-C (KeyboardInterrupt), after the timeline so far.
    """
    problem = check_arguments(ranks, processes) or pause_problem()
    if problem is not None:
        print(f"nicswitch-agent demo: error: {problem}", file=err or sys.stderr)
        return EXIT_USAGE
    output_dir = output_dir or tempfile.mkdtemp(prefix="nicswitch-demo-")
    events_file = events_template(output_dir)
    events_dir = os.path.dirname(events_file)
    for directory in (output_dir, events_dir):
        try:
            if directory and "{" not in directory:
                os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            print(f"nicswitch-agent demo: error: cannot create {directory}: {exc.strerror or exc}",
                  file=err or sys.stderr)
            return EXIT_USAGE
    if not os.environ.get(EVENTS_ENV):
        # The demo's own events files: this run's replace the last one's (appended to, a reused
        # --output-dir would draw two runs' switches as one).
        for stale in glob.glob(os.path.join(output_dir, "events", "rank-*.jsonl")):
            with contextlib.suppress(OSError):
                os.remove(stale)
    nodes = job_nodes(ranks)
    node, moved, moved_ranks = failover_devices(nodes)
    timeline = Timeline()
    sim_logger = logging.getLogger("nicswitch_agent.sim")
    handler = _SimLogToTimeline(timeline)
    sim_logger.addHandler(handler)
    old_level, old_propagate = sim_logger.level, sim_logger.propagate
    sim_logger.setLevel(logging.INFO)
    sim_logger.propagate = verbose
    results: list[str] = []
    links_after: list[list[bool]] = []
    summaries: list[RankSummary] = []
    interrupted = False
    try:  # from the banner on, Ctrl-C is reported (with PYTHONUNBUFFERED it shows at once)
        out.write("nicswitch-agent demo: ClusterD simulator + a training job with the agent, on this machine\n")
        with tempfile.TemporaryDirectory(prefix="nicswitch-demo-") as workdir, Simulator(
            jobs=[SimJob(job_id=JOB_ID, nodes=nodes)],
            settings=SimSettings(report_timeout_s=30.0, shuffle_nodes=True),
        ) as sim:
            job: DemoJob
            if processes:
                from nicswitch_agent.demo.processes import ProcessJob

                job = ProcessJob(ranks, timeline, workdir, verbose=verbose, events_file=events_file)
            else:
                job = ThreadJob(ranks, timeline, workdir, events_file=events_file)
            out.write(f"job {JOB_ID}: {_count(len(nodes), 'node')} x {_count(len(nodes[node]), 'device')} = "
                      f"{_count(ranks, 'rank')} ({job.description}); pause mode agent; a step every "
                      f"{STEP_INTERVAL_S * 1000:.0f} ms; rank 0 leads\n")
            if processes:
                out.write("starting the rank processes (each one imports torch: a few seconds); the timeline "
                          "follows at the end\n")
            out.write("\n")
            out.flush()
            address = sim.address
            timeline.add("demo", f"simulator serving on {address}")
            channel = open_channel(ChannelSettings(target=address))
            stub = RecoverStub(channel)
            try:
                job.start(address)
                progress = job.progress
                _wait_streams(sim)
                progress.wait_for_step(WARMUP_STEPS)
                timeline.add("demo", f"training at step {progress.step}; failover: move {node}'s "
                                     f"{_devices_text(moved)} to their standby NICs")
                results.append(_operator_switch(stub, {node: (moved, [True] * len(moved))}, timeline, 60))
                links_after.append(job.leader_links(1))
                timeline.add("demo", describe_standby(links_after[-1]))
                _wait_streams(sim)
                progress.wait_for_step(progress.step + WARMUP_STEPS)
                timeline.add("demo", f"training at step {progress.step}; switchback: move them back to "
                                     "their primary NICs")
                results.append(_operator_switch(stub, {node: (moved, [False] * len(moved))}, timeline, 60))
                links_after.append(job.leader_links(2))
                timeline.add("demo", describe_standby(links_after[-1]))
                progress.wait_for_step(progress.step + WARMUP_STEPS)
            except DemoError as exc:
                timeline.add("demo", f"FAILED: {exc}")
            finally:
                channel.close()
                summaries = job.stop()
    except KeyboardInterrupt:  # Ctrl-C: the job and the simulator were stopped on the way out (finally, with)
        interrupted = True
        timeline.add("demo", "interrupted (Ctrl-C): the job and the simulator stopped")
    finally:
        sim_logger.removeHandler(handler)
        sim_logger.setLevel(old_level)
        sim_logger.propagate = old_propagate
    timeline.render(out)
    if interrupted:  # what it did so far; no summary, no page: there is nothing complete to check or draw
        out.write(f"\ndemo interrupted after {len(results)} of 2 switches"
                  f"{f' (results: {results})' if results else ''}\n")
        return EXIT_INTERRUPTED
    out.write("\n")
    write_timeline_page(out, events_file, output_dir, since=timeline.started)
    return _summarise(out, ranks, results, links_after, moved_ranks, summaries)


def _summarise(out: TextIO, world: int, results: list[str], links_after: list[list[bool]], moved_ranks: list[int],
               summaries: list[RankSummary]) -> int:
    expected_standby = [r in moved_ranks for r in range(world)]
    complete = len(summaries) == world
    leader = summaries[0] if summaries else RankSummary(0, [], [], 0, 0, 0)
    same_links = complete and all(s.standby == leader.standby for s in summaries)
    same_steps = complete and len(leader.parked_at) == 2 and all(s.parked_at == leader.parked_at for s in summaries)
    ok = (results == [FINISH, FINISH] and same_links and same_steps
          and links_after == [expected_standby, [False] * world]
          and not any(leader.standby) and all(s.switch_calls == 2 for s in summaries))
    checkpoints = sum(s.checkpoints for s in summaries)
    out.write("\n")
    out.write(f"switches: {len(results)}, results: {results}\n")
    out.write(f"every rank parked at the same steps: {'yes' if same_steps else 'NO'} "
              f"({', '.join(str(s) for s in leader.parked_at)}); every rank switched the same links: "
              f"{'yes' if same_links else 'NO'}\n")
    out.write(f"checkpoints written by the guards: {checkpoints} ({_count(world, 'rank')} x 2 switches); "
              f"training reached step {leader.last_step}\n")
    out.write(f"replies delivered: {leader.counters.get('replies_delivered', 0)}, "
              f"failed: {leader.counters.get('replies_failed', 0)}\n")
    out.write("demo " + ("succeeded" if ok else "FAILED") + "\n")
    return EXIT_OK if ok else EXIT_FAILED


def _wait_streams(sim: Simulator, timeout: float = 10.0) -> None:
    """Wait until the agent's process-manage and notify streams are both open.

    ClusterD ends both after every switch and the agent reopens them, process-manage first. A
    switch requested earlier would still work (ClusterD waits), but the timeline reads better.
    """
    def both_open(s: Simulator) -> bool:
        view = s.job_view(JOB_ID)
        return all(view.open_streams.get(m, 0) == 1 for m in ("SubscribeProcessManageSignal", "SubscribeNotifySwitch"))

    if not sim.wait_until(both_open, timeout):
        raise DemoError("the simulator never saw both of the leader's streams open")


# -- the job alone, joining an external ClusterD ---------------------------------------------------

# Set by --background for the child it starts; not NICSWITCH_-prefixed, as it is no setting.
READY_FD_ENV = "_NICSWITCH_DEMO_READY_FD"
# A step of the joined job (--server): longer than the embedded demo's, as a small training job's. A
# switch waits for a step boundary, so it lasts about a step; ClusterD accepts an operator's
# result stream only while a switch runs and keeps no result, so a 20 ms switch can end before a
# `switch` command on a busy machine has subscribed, losing the result to it (docs/quickstart.md).
JOINED_STEP_INTERVAL_S = 0.1
FINISH_GRACE_S = 5.0  # after the last switch: how long to wait for ClusterD to end it (see run_job)
RELAY_INTERVAL_S = 0.2  # --background: how often the waiting command looks for its job's first warning
# A line of the job's log (cli.LOG_FORMAT) at WARNING or worse.
_WARNING_LINE = re.compile(r"^\S+ \S+ (?:WARNING|ERROR|CRITICAL) [^\n]*(?=\n)", re.MULTILINE)


def run_job(out: TextIO, *, server: str, job_id: str, ranks: int = DEFAULT_RANKS, switches: int = 2,
            timeout_s: float = 300.0, background: bool = False) -> int:
    """The demo's thread job, joined to the ClusterD at ``server``, until ``switches`` switches ended.

    Prints the leader's events as they happen. With ``background`` the job runs in a child process
    and this returns once the job is registered and subscribed, so that a shell script can go on
    to ``nicswitch-agent switch`` without racing the registration.

    Returns:
        0 after ``switches`` switches were replied to (0: until SIGINT/SIGTERM, ``timeout_s`` then
        bounding only the registration), 1 when the job
        could not join within ``timeout_s`` or the time ran out first, 2 for a usage error, 128 + N
        when signal N (SIGINT, SIGTERM) came before the ``switches`` switches (it says how many).
    """
    problem = check_arguments(ranks, False) or pause_problem()
    if problem is None and switches < 0:
        problem = f"--switches must be 0 or more, got {switches}"
    if problem is None and not timeout_s > 0:
        problem = f"--timeout must be more than 0 seconds, got {timeout_s:g}"
    if problem is None:
        from nicswitch_agent.config import ConfigError, parse_server

        try:  # the agent's one grammar, named as the user typed it
            server = parse_server(server, "--server")
        except ConfigError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"nicswitch-agent demo: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if background:
        return _start_in_background(out, server=server, job_id=job_id, ranks=ranks, switches=switches,
                                    timeout_s=timeout_s)
    done = threading.Event()
    replies: list[bool] = []
    resumes: list[int] = []
    subscribed = threading.Event()

    woken = threading.Event()  # the job subscribed, a signal came, or the leader failed: what the wait ends on
    signals: list[int] = []
    failed: list[str] = []  # the leader's agent failed for good (ClusterD refused the job): no use waiting

    resubscribed = threading.Event()  # the notify stream reopened since the last reply
    grace: list[threading.Timer] = []
    wakeup: list[SignalWakeup] = []  # the main thread's waits (demo/wakeup.py), once it has one

    def wake(*events: threading.Event) -> None:
        for event in events:
            event.set()
        for waker in wakeup:
            waker.wake()

    def on_event(event: AgentEvent) -> None:
        if event.kind == "subscribed" and event.detail.get("stream") == "notify":
            resubscribed.set()
            wake(subscribed, woken)
        elif event.kind == "agent_failed":
            failed.append(str(event.detail.get("error", "")))
            wake(woken, done)
        text = describe_event(event)
        if text is not None and (event.kind in _LEADER_EVENTS or event.kind in ("parked", "resumed")):
            out.write(f"job {job_id}: {text}\n")
            out.flush()
        if event.kind == "reply_sent":
            replies.append(bool(event.detail["result"]))
            resubscribed.clear()
        elif event.kind == "resumed":
            resumes.append(int(event.detail["step"]))
        if switches and len(replies) >= switches and len(resumes) >= switches:
            # The last switch was replied to and training goes on; ClusterD ends it (its last word
            # to the operator, "switch nic finish") and then the notify stream, which the job
            # reopens. Ending the job before that can cut the operator's word off; a ClusterD that
            # does not end the stream is waited for FINISH_GRACE_S at most.
            if resubscribed.is_set():
                wake(done)
            elif not grace:
                grace.append(threading.Timer(FINISH_GRACE_S, wake, args=(done,)))
                grace[0].daemon = True
                grace[0].start()

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        wake(done, woken)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline = time.monotonic() + timeout_s
    starter = int(os.environ[READY_FD_ENV]) if os.environ.get(READY_FD_ENV) else None  # --background's child
    try:
        wakeup.append(SignalWakeup())
        with tempfile.TemporaryDirectory(prefix="nicswitch-demo-") as workdir:
            job = ThreadJob(ranks, Timeline(), workdir, job_id=job_id, leader_listener=on_event,
                            step_interval_s=JOINED_STEP_INTERVAL_S)
            job.start(server)
            try:
                wakeup[0].wait(woken.is_set, max(0.0, deadline - time.monotonic()), fd=starter)
                if signals and not subscribed.is_set():  # Ctrl-C while ClusterD had not heard of the job yet
                    print(f"nicswitch-agent demo: {signal.Signals(signals[0]).name} before job {job_id} registered "
                          f"with ClusterD at {server}; stopped", file=sys.stderr)
                    return 128 + signals[0]
                if _starter_gone(starter):
                    print(f"nicswitch-agent demo: the command that started job {job_id} in the background ended "
                          "before the job was ready; stopped", file=sys.stderr)
                    return EXIT_FAILED
                if failed:
                    print(f"nicswitch-agent demo: job {job_id}: the leader's agent failed: {failed[0]}",
                          file=sys.stderr)
                    return EXIT_FAILED
                if not subscribed.is_set():
                    print(f"nicswitch-agent demo: job {job_id} could not register with ClusterD at {server} "
                          f"within {timeout_s:g} s", file=sys.stderr)
                    return EXIT_FAILED
                until = f"{switches} switch(es)" if switches else "SIGINT/SIGTERM"
                out.write(f"job {job_id}: {_count(ranks, 'rank')} registered with ClusterD at {server} (a step "
                          f"every {JOINED_STEP_INTERVAL_S * 1000:.0f} ms); waiting for switches (runs until {until})\n")
                out.flush()
                _signal_ready()
                # --switches 0 runs until a signal: --timeout bounded only the registration.
                wakeup[0].wait(done.is_set, max(0.0, deadline - time.monotonic()) if switches else None)
            finally:
                for timer in grace:
                    timer.cancel()
                job.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for waker in wakeup:
            waker.close()  # a late wake() from another thread is then a no-op
    if switches and len(replies) < switches and signals:  # Ctrl-C (or SIGTERM) before the switches asked for
        out.write(f"job {job_id}: {signal.Signals(signals[0]).name} after {len(replies)} of {switches} "
                  "switch(es); stopped\n")
        return 128 + signals[0]
    if switches and len(replies) < switches:
        ran_out = time.monotonic() >= deadline
        out.write(f"job {job_id}: stopped after {len(replies)} of {switches} switch(es)"
                  f"{f' (--timeout {timeout_s:g} s ran out)' if ran_out else ''}\n")
        return EXIT_FAILED if ran_out else EXIT_OK
    out.write(f"job {job_id}: done after {len(replies)} switch(es)\n")
    return EXIT_OK


def _starter_gone(fd: int | None) -> bool:
    """Whether the ``--background`` command waiting on the ready pipe ``fd`` is gone (killed, say, by
    SIGKILL): a job it never reported must not run on unseen. Its end closed, Linux's select calls
    ours readable."""
    return fd is not None and bool(select.select([fd], [], [], 0)[0])


def _signal_ready() -> None:
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "w") as ready:
            ready.write("ready\n")


def _start_in_background(out: TextIO, *, server: str, job_id: str, ranks: int, switches: int,
                         timeout_s: float) -> int:
    """Start the job as a child process; return when it reported ready (0) or ended first (its code).

    The child writes to a log file of its own, never to the caller's stdout or stderr: a caller that
    reads them to the end (``out=$(nicswitch-agent demo --background ...)``, a pipe) would otherwise
    wait for the whole job. Its first warning (a wrong ``--server``: "cannot connect to ClusterD") is
    relayed to stderr while this waits, as the job in the foreground prints it. If it ends before it is
    ready, its log is copied to stderr; so it is after SIGINT or SIGTERM here, which stop the child too
    (130, 143).
    """
    signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)  # noted, not raised: a KeyboardInterrupt inside Popen would lose the child

    # From before the child exists until it is ready or stopped. SIGTERM's default (die at once) left it
    # running unseen, registering with a ClusterD that came up later; a signal this process was started
    # ignoring (SIGINT under `cmd &` in a script) stays ignored.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        log_fd, log_path = tempfile.mkstemp(prefix=f"nicswitch-demo-{job_id}-", suffix=".log")
        read_fd, write_fd = os.pipe()
        args = [sys.executable, "-m", "nicswitch_agent", "demo", "--server", server, "--job", job_id,
                "--ranks", str(ranks), "--switches", str(switches), "--timeout", str(timeout_s)]
        try:
            child = subprocess.Popen(args, pass_fds=(write_fd,), env={**os.environ, READY_FD_ENV: str(write_fd)},
                                     stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT)
        finally:
            os.close(write_fd)
            os.close(log_fd)
        # The ready pipe stays open until the child was stopped: its closing tells the child that this
        # command is gone (run_job), which must not race the signal that stops it.
        with os.fdopen(read_fd) as ready, open(log_path, encoding="utf-8", errors="replace") as log, \
                SignalWakeup() as wakeup:  # a signal ends the wait at once, even if another thread got it
            logged, relayed = "", False  # the log so far; its first warning, once relayed to stderr
            while not wakeup.wait(lambda: bool(signals), None if relayed else RELAY_INTERVAL_S, fd=ready.fileno()):
                logged += log.read()
                warning = _WARNING_LINE.search(logged)
                if warning is not None:
                    print(f"{warning.group(0)}\nnicswitch-agent demo: (from the background job {job_id}'s log, "
                          f"{log_path}; still waiting for it to be ready)",
                          file=sys.stderr, flush=True)
                    relayed = True
            if signals:
                return _stop_background(child, log_path, job_id, signals[0])
            started = ready.read() == "ready\n"  # EOF when the child reported ready, or died
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not started:
        code = child.wait()
        with open(log_path, encoding="utf-8", errors="replace") as log:
            sys.stderr.write(log.read())
        print(f"nicswitch-agent demo: the background job ended with {code} before it was ready (log: {log_path})",
              file=sys.stderr)
        return code
    until = f"after {switches} switch(es), or" if switches else "on"
    out.write(f"job {job_id} runs in the background as pid {child.pid}, logging to {log_path}; it stops {until} "
              f"`kill {child.pid}`\n")
    out.flush()
    return EXIT_OK


def _stop_background(child: subprocess.Popen[bytes], log_path: str, job_id: str, signum: int) -> int:
    """A signal while the background job was not ready yet: stop the job with it too, say what it did (its
    log), 128 + the signal (130 for Ctrl-C, 143 for SIGTERM).

    A Ctrl-C on the terminal reached the child as well (one process group); a signal sent to this
    process alone (``kill``, ``kill -INT``) did not, and a job left running unseen is what a user who
    stopped the command least wants.
    """
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signum)
    try:
        code: int | str = child.wait(FINISH_GRACE_S)  # it stops at once: it was only waiting for ClusterD
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        code = "killed"
    with contextlib.suppress(OSError), open(log_path, encoding="utf-8", errors="replace") as log:
        sys.stderr.write(log.read())
    what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"nicswitch-agent demo: {what} before the background job {job_id} was ready; stopped it "
          f"(pid {child.pid}, exit {code}; log: {log_path})", file=sys.stderr)
    return 128 + signum
