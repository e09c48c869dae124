"""SwitchAgent: the object a training script creates, starts, steps and stops.

It wires the pieces together. The one rule that spans them, every list received for this job gets
exactly one ReplySwitchNicResult, is kept by the executor (executor.py): each list becomes an
:class:`~nicswitch_agent.executor.OwedReply` the moment it is received, and ``stop()`` settles
every one still owed (false) before it ends any stream.

Every rank runs a member (``nicswitch-member``, see coordination/member.py) that parks its
training thread and runs the hooks. Rank 0 is also the leader, the job's only ClusterD client:

- ``nicswitch-notify``: reads SubscribeNotifySwitch, validates, enqueues (see clusterd/notify.py);
- ``nicswitch-executor``: runs orders one at a time on every rank, then replies;
- pause mode ``agent`` only: ``nicswitch-process-manage`` (Init/Register and ClusterD's pause and
  continue signals, see clusterd/process_manage.py) and ``nicswitch-signals`` (what they mean, see
  clusterd/signal_flow.py). docs/architecture.md has the whole picture.

In pause mode ``external`` (MindIO/TaskD pause training around the switch) the training thread
is never involved. In pause mode ``agent`` it parks inside ``step()`` when ClusterD asks for a
pause, and runs the guard and the switch there. Either way, an idle ``step()`` costs one
attribute write and one attribute test.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nicswitch_agent import process_hooks
from nicswitch_agent.config import AgentConfig, resolve_pause_mode
from nicswitch_agent.config.frameworks import msrun_scheduler
from nicswitch_agent.coordination import KV, Coordinator, Member, MemberHooks, topology, verification
from nicswitch_agent.coordination.fan_out import RankFanOut, describe_for_leader
from nicswitch_agent.coordination.hook_runner import Execution
from nicswitch_agent.coordination.joining import member_callbacks
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.coordination.topology import Layout
from nicswitch_agent.errors import AgentStateError, ConfigError, InvalidOrder
from nicswitch_agent.executor import Executor, OwedReply
from nicswitch_agent.hooks import default_switch_hook
from nicswitch_agent.hooks.base import CheckpointHook, SwitchHook, check_hook, require_callable
from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.events import AgentEvent, EventListener, EventLog
from nicswitch_agent.observability.metrics import EventStats, JsonlEventSink, PrometheusMetrics
from nicswitch_agent.observability.status_file import StatusFileWriter, expand_path, own_rank
from nicswitch_agent.orders import RankMap, SwitchOrder, build_order

if TYPE_CHECKING:
    # The ClusterD client side (grpc, protobuf: ~30 MB resident) is imported when an agent
    # starts as the leader, never in a member-only process, which only talks to the Store.
    from nicswitch_agent._pb import recover_pb2 as pb
    from nicswitch_agent.clusterd.reply import ReplyReport
    from nicswitch_agent.clusterd.session import LeaderSession
    from nicswitch_agent.clusterd.signal_flow import HookSettings

logger = logging.getLogger("nicswitch_agent")

CREATED, RUNNING, SWITCHING, STOPPING, STOPPED, FAILED = (
    "created", "running", "switching", "stopping", "stopped", "failed"
)
INACTIVE = "inactive"  # start() in a process that is no rank (msrun's scheduler): nothing runs


class SwitchAgent:
    """Takes part in ClusterD's link failover/switchback for one training process.

    Args:
        server: ClusterD ``host:port``; None reads NICSWITCH_SERVER / MINDX_SERVER_IP /
            LOCAL_PROXY_ENABLE.
        job_id: ClusterD job id; None reads NICSWITCH_JOB_ID / MINDX_TASK_ID.
        switch_hook: ``callable(order) -> bool | None``; default: torch_npu's
            ``_comm_switch_nic`` (checked at ``start()``), or a logging no-op with ``dry_run``.
        checkpoint_hook: ``callable(order) -> None`` run before the switch; raising refuses it.
        verify_hook: ``callable(order) -> bool | None`` run on every rank once the switch hook
            succeeded on every rank (e.g. :class:`~nicswitch_agent.TorchLinkProbe`); False, an
            exception or ``verify_timeout_s`` makes the switch fail (coordination/verification.py).
        pause: ``"agent"`` (the agent pauses training at a step boundary), ``"external"``
            (MindIO/TaskD do), or ``"auto"`` (the default: external when MindIO/TaskD markers
            are present).
        on_stop: pause mode agent: called with a reason when ClusterD's recovery decides that
            training must stop (dump, exit, killMaster); ``step()`` then raises TrainingStopped.
        on_event: optional listener called with every :class:`AgentEvent`.
        store: the key-value Store ranks coordinate through (a ``torch.distributed`` Store);
            default: the job's default store when torch.distributed is initialised with more
            than one rank, an in-process store for a single rank.
        leader_only: run only the leader, for ``world_size`` members elsewhere (the
            ``nicswitch-agent launch`` process, which hosts the Store its children join).
        config: a ready :class:`AgentConfig` (then the other settings must not be given).
        **settings: any :class:`AgentConfig` field, e.g. ``switch_timeout_s=60``.

    Raises:
        ConfigError: a setting is missing or invalid (nothing has been started).
    """

    # Slots: ``step()`` runs every training step, and CPython 3.11 reads the attributes of an
    # instance with more than 30 of them in its __dict__ markedly slower (benchmarks/idle.py).
    # A __dict__ remains for attributes users attach.
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_armed",
        "_checkpoint_hook",
        "_conflict",
        "_coordination_stop",
        "_coordinator",
        "_event_sink",
        "_events",
        "_executor",
        "_failure_thread",
        "_fan_out",
        "_layout",
        "_leader_only",
        "_lock",
        "_member",
        "_metrics",
        "_on_stop",
        "_parking",
        "_pause_reason",
        "_pid",
        "_seq",
        "_session",
        "_started_mono",
        "_state",
        "_state_reason",
        "_stats",
        "_status_writer",
        "_steps",
        "_stopped",
        "_stopping_thread",
        "_store",
        "_switch_hook",
        "_verify_hook",
        "config",
        "last_step",
        "pause_mode",
        "rank",
        "world_size",
    )

    def __init__(
        self,
        server: str | None = None,
        job_id: str | None = None,
        switch_hook: SwitchHook | None = None,
        checkpoint_hook: CheckpointHook | None = None,
        pause: str | None = None,
        *,
        on_stop: Callable[[str], None] | None = None,
        on_event: EventListener | None = None,
        verify_hook: SwitchHook | None = None,
        store: Any | None = None,
        leader_only: bool = False,
        config: AgentConfig | None = None,
        **settings: Any,
    ) -> None:
        # Refused here, not at the first switch, where a broken hook costs the job a recovery.
        require_callable("switch_hook", switch_hook, "one argument (the order)")
        require_callable("checkpoint_hook", checkpoint_hook, "one argument (the order)")
        require_callable("verify_hook", verify_hook, "one argument (the order)")
        require_callable("on_stop", on_stop, "one argument (the reason)")
        require_callable("on_event", on_event, "one argument (the event)")
        if not isinstance(leader_only, bool):
            raise ConfigError(f"leader_only must be a bool, got {type(leader_only).__name__} {leader_only!r}")
        if config is not None and not isinstance(config, AgentConfig):
            raise ConfigError(f"config must be an AgentConfig, got {type(config).__name__} {config!r}")
        if config is None:
            config = AgentConfig.from_env(server=server, job_id=job_id, pause=pause, **settings)
        elif server is not None or job_id is not None or pause is not None or settings:
            raise AgentStateError("pass either config=... or individual settings, not both")
        self.config = config
        self.pause_mode, self._pause_reason = resolve_pause_mode(config.pause)
        self._on_stop = on_stop
        if switch_hook is None:
            switch_hook = default_switch_hook(config)
        self._switch_hook = switch_hook
        self._checkpoint_hook = checkpoint_hook
        self._verify_hook = verify_hook
        self._store = store
        self._leader_only = leader_only
        self._events = EventLog()
        if on_event is not None:
            self._events.add_listener(on_event)
        self._stats = EventStats()  # timings for status()
        self._events.add_listener(self._stats)
        self._event_sink: JsonlEventSink | None = None
        if config.events_file:
            self._event_sink = JsonlEventSink(config.events_file, rank=lambda: own_rank(self.rank, leader_only))
            self._events.add_listener(self._event_sink)
        self._metrics: PrometheusMetrics | None = None  # the leader's, made at start()
        self._status_writer: StatusFileWriter | None = None
        self._lock = threading.Lock()  # guards _state, _state_reason
        self._state = CREATED
        self._state_reason = ""  # why the agent failed, or why it stopped
        self._failure_thread: threading.Thread | None = None  # stops the threads of a failed leader
        self._stopped = threading.Event()  # set when a stop() that did the work has finished
        self._stopping_thread: threading.Thread | None = None
        self._seq = itertools.count(1)
        self._session: LeaderSession | None = None  # the leader's ClusterD client (clusterd/session.py)
        self._conflict = ""  # pause mode auto fell back to external because of this conflict
        self._executor = Executor(run=self._run_order, send=self._send_reply, forgotten=self._forgotten,
                                  emit=self._emit, on_busy=self._on_busy, world_size=lambda: self.world_size,
                                  stop_timeout_s=config.stop_timeout_s)
        self._pid = os.getpid()
        self._started_mono: float | None = None
        self._steps = 0
        self.last_step: int | None = None
        self._armed = False  # a pause request is pending: step() must go to the parking lot
        self._parking = ParkingLot(on_event=lambda kind, detail: self._emit(kind, detail=detail),
                                   on_armed=self._set_armed)
        self._coordinator: Coordinator | None = None
        self._coordination_stop = threading.Event()  # cuts the leader's waits short on stop()
        self._member: Member | None = None
        self._fan_out: RankFanOut | None = None  # this rank's Stores and relays (coordination/fan_out.py)
        self._layout = Layout(1)  # who answers on the job's Store (coordination/topology.py), set by start()
        self.rank = 0
        self.world_size = self.config.world_size or 1  # resolved by start(); lists are checked against it

    # -- public API ----------------------------------------------------------------------------

    def start(self) -> SwitchAgent:
        """Check the hooks, open the channel and start the threads; returns once they run.

        In msrun's scheduler process (MS_ROLE=MS_SCHED), which runs the training script but is
        no rank, it starts nothing: state ``inactive``, the reason in ``status()``, one INFO line.

        Raises:
            AgentStateError: started twice, or after stop().
            ConfigError: a hook reports it cannot work here (e.g. torch_npu missing).
        """
        inactive = msrun_scheduler(os.environ)  # "" in any process that is a rank
        with self._lock:
            if self._state != CREATED:
                raise AgentStateError(f"start() called on an agent that is {self._state}")
            self._state, self._state_reason = (INACTIVE, inactive) if inactive else ("starting", "")
        if inactive:
            logger.info("nicswitch-agent inactive: %s", inactive)
            return self
        try:
            if not self.config.dry_run and not self._leader_only:  # a leader-only process runs no hooks
                hooks = {"switch_hook": self._switch_hook, "checkpoint_hook": self._checkpoint_hook,
                         "verify_hook": self._verify_hook}
                verification.check_hooks_at_start(self.config, self.pause_mode, hooks)
                for hook in filter(None, hooks.values()):
                    check_hook(hook)
        except BaseException:
            with self._lock:
                self._state = CREATED
            raise
        try:
            return self._start()
        except BaseException:
            self._abort_start()
            raise

    def _abort_start(self) -> None:
        """Undo a start() that failed half way, so nothing keeps running and start() may be retried."""
        if self._session is not None:
            self._session.abort()
        for stop in (self._member, self._fan_out):
            if stop is not None:
                stop.stop()
        self._executor.abandon()
        self._session = self._member = self._fan_out = self._coordinator = None
        with self._lock:
            self._state = CREATED
        self._stop_observers()  # the status file's last word: "created"
        self._status_writer = None

    def _start(self) -> SwitchAgent:
        cfg = self.config
        self.rank, self.world_size = topology.rank_and_world(self.config, leader_only=self._leader_only)
        kv = topology.coordination_kv(self.config, self.world_size, store=self._store, leader_only=self._leader_only)
        leads = self._leader_only or (cfg.leader == "rank0" and self.rank == 0)
        self._layout = topology.choose_layout(cfg, self.world_size)
        self._start_observers(leads)
        if self._leader_only:
            return self._start_leader(kv)
        # This rank's keys live on its node's Store with fan-out; local rank 0 relays for the node.
        self._fan_out = RankFanOut(kv, self._layout, self.rank, node_store_timeout_s=cfg.node_store_timeout_s,
                                   stop_timeout_s=cfg.stop_timeout_s, node_transport=cfg.node_transport)
        self._fan_out.start()
        member_kv, slot = self._fan_out.member_kv, self._fan_out.slot
        rank_map = RankMap.from_env(rank=self.rank)
        self._member = Member(
            member_kv.clone(), self.rank, self._parking,
            MemberHooks(switch_hook=self._switch_hook, checkpoint_hook=self._checkpoint_hook,
                        guard_timeout_s=cfg.guard_timeout_s, switch_timeout_s=cfg.switch_timeout_s,
                        dry_run=cfg.dry_run, local_ranks=rank_map.local_ranks, verify_hook=self._verify_hook,
                        verify_timeout_s=cfg.verify_timeout_s),
            lambda: self.last_step, max_parked_s=cfg.max_parked_s, stop_timeout_s=cfg.stop_timeout_s,
            on_event=lambda kind, detail: self._emit(kind, detail.pop("seq", None), detail), slot=slot,
            # The leader hears of ranks that join and of those that leave (joining.py).
            **member_callbacks(kv, self.rank, self._pid))
        self._member.start()
        if not leads:  # a member only: the leader (rank 0, or the launcher) holds ClusterD's streams
            with self._lock:
                self._state = RUNNING
            process_hooks.register(self)
            logger.info("nicswitch-agent started as member: rank %d of %d, job=%s, leader=%s%s", self.rank,
                        self.world_size, cfg.job_id, cfg.leader, self._describe_layout())
            self._emit(ev.AGENT_STARTED, detail={"rank": self.rank, "role": "member"})
            return self
        return self._start_leader(kv)

    def _start_observers(self, leads: bool) -> None:
        """Status file (the leader, or every rank with {rank}/{pid} in the path); metrics endpoint (leader)."""
        cfg = self.config
        if cfg.status_file:
            path = expand_path(cfg.status_file, rank=own_rank(self.rank, self._leader_only),
                               job_id=cfg.job_id, role="leader" if leads else "member")
            if path is not None:
                self._status_writer = StatusFileWriter(path, self.status, cfg.status_interval_s)
                self._events.add_listener(self._status_writer)
                self._status_writer.start()
        if leads and cfg.metrics_port is not None:
            if self._metrics is None:  # members serve nothing, so they never need prometheus_client
                self._metrics = PrometheusMetrics(links=self._stats.links, ranks_per_node=cfg.local_world_size)
                self._events.add_listener(self._metrics)
            try:
                self._metrics.start_http_server(cfg.metrics_port)
            except OSError as exc:  # observability must never stop training
                logger.error("Prometheus metrics not served on port %d: %s", cfg.metrics_port, exc)

    def _stop_observers(self) -> None:
        if self._status_writer is not None:
            self._status_writer.stop(self.config.stop_timeout_s)  # writes the final state
        if self._metrics is not None:
            self._metrics.close()

    def _start_leader(self, kv: KV) -> SwitchAgent:
        from nicswitch_agent.clusterd.session import LeaderSession, SessionCallbacks

        cfg = self.config
        self._coordinator = Coordinator(kv.clone(), self._layout.answerers, stop=self._coordination_stop,
                                        layout=self._layout, drain_s=cfg.stop_timeout_s,
                                        **verification.coordinator_settings(cfg, self._verify_hook,
                                                                            leader_only=self._leader_only))
        self._session = LeaderSession(
            cfg, pause_mode=self.pause_mode, coordinator=self._coordinator, hooks=self._hook_settings(),
            callbacks=SessionCallbacks(
                on_list=self._on_list, on_fatal=self._on_fatal, on_health=self._on_health,
                on_connection=self._refresh_status, on_conflict=self._on_conflict,
                on_training_stop=self._training_must_stop, emit=self._emit,
            ))
        self._coordinator.on_decided = self._stats.links.decided  # every rank's link, for status() and metrics
        self._executor.start()  # before any stream can deliver a list
        self._session.start()
        self._started_mono = time.monotonic()
        with self._lock:
            if self._state == "starting":  # a fatal error may already have marked it failed
                self._state = RUNNING
            failed_during_start = self._state == FAILED
        if failed_during_start:
            self._start_failure_teardown()
        process_hooks.register(self)
        logger.info("nicswitch-agent started as leader of %d rank(s): job=%s server=%s pause=%s (%s)%s%s",
                    self.world_size, cfg.job_id, cfg.server, self.pause_mode, self._pause_reason,
                    " (dry run)" if cfg.dry_run else "", self._describe_layout())
        self._emit(ev.AGENT_STARTED, detail={"server": cfg.server, "pause": self.pause_mode, "dry_run": cfg.dry_run,
                                             "rank": own_rank(self.rank, self._leader_only), "role": "leader",
                                             "world_size": self.world_size})
        return self

    def step(self, step: int | None = None) -> None:
        """Mark a safe point of the training loop (call once per step, from the training thread).

        Idle cost: one attribute write and one comparison (plus a counter when ``step`` is None).
        In pause mode ``agent``, when ClusterD asked for a pause, training parks here until
        ClusterD lets it go on.

        Raises:
            TrainingStopped: training must stop (ClusterD's recovery, or an agent stopped mid-switch).
        """
        if step is None:
            self._steps += 1
            step = self._steps
        self.last_step = step
        if self._armed:
            self._parking.at_step_boundary(step)

    def _set_armed(self, armed: bool) -> None:
        self._armed = armed  # called by the parking lot under its lock

    def stop(self, reason: str = "stop() called") -> None:
        """Stop the agent: no new lists, a false reply for any list still owed one, threads joined
        (bounded by ``stop_timeout_s`` each), channel closed. Idempotent; safe from any thread."""
        with self._lock:
            if os.getpid() != self._pid or self._state == STOPPED:
                return
            if self._state == STOPPING:
                if self._stopping_thread is threading.current_thread():
                    return  # called back from inside the stop (a listener, a hook)
                in_progress = True
            else:
                in_progress = False
                was_started = self._state not in (CREATED, "starting", INACTIVE)
                self._state = STOPPING
                self._stopping_thread = threading.current_thread()
        failure = self._failure_thread
        if failure is not None and failure is not threading.current_thread():
            failure.join(self.config.stop_timeout_s * 4)  # a failed leader's threads are being stopped
        if in_progress:
            # Another thread is stopping it (a signal, interpreter exit): wait for it, bounded, so
            # that the process does not end while the false replies are still being sent.
            if not self._stopped.wait(self.config.exit_timeout_s):
                logger.warning("the agent's stop, under way elsewhere, did not finish within %.1f s",
                               self.config.exit_timeout_s)
            return
        try:
            self._stop(reason, was_started)
        finally:
            self._stopped.set()

    def _stop(self, reason: str, was_started: bool) -> None:
        if was_started:
            logger.info("nicswitch-agent stopping: %s", reason)
            self._stop_threads(reason)
            if self._session is not None:
                self._session.close()
        with self._lock:
            earlier = self._state_reason  # why training had to stop, or why the agent failed
            self._state, self._state_reason = STOPPED, f"{earlier} ({reason})" if earlier else reason
        self._emit(ev.AGENT_STOPPED, detail={"reason": reason})
        self._stop_observers()
        if self._event_sink is not None:
            self._event_sink.close()

    def _stop_threads(self, reason: str) -> None:
        """Everything stop() does but closing the channel; safe to run twice (a failed leader's
        threads are stopped this way at once, and stop() runs it again later)."""
        session = self._session
        if session is not None:
            session.stop_notify()  # no new lists
        replied = self._executor.settle(reason)  # false for every list still owed a reply, before anything else
        self._coordination_stop.set()  # then cut the leader's waits short
        if self._coordinator is not None:
            self._coordinator.wake()  # ... including the one it blocks in now
        if session is not None:
            session.end_process_manage(after_reply=replied > 0)  # only now: ClusterD resets the job then
        # Parked training stops (alone it would step beside paused ranks), but as every rank where the leader is.
        stop_training: str | None = (f"the agent on rank {self.rank} stopped ({reason}) while training was "
                                     "parked for a switch: training cannot resume on this rank alone")
        if self._coordinator is not None:
            try:
                stop_training = self._coordinator.release_at_stop(reason)  # a stop if links may have moved
                self._coordinator.drain()  # a release (or a stop) taken by every rank before our Store may go
            except Exception:
                logger.warning("could not release the members", exc_info=True)
        if self._member is not None:
            self._member.stop(parked_training_stops=stop_training is not None)  # None: it resumes (no link moved)
        if self._fan_out is not None:
            self._fan_out.stop(reason)  # after the member: the release above still reaches the node's ranks
        self._parking.let_go(stop_reason_if_parked=stop_training)
        if not self._parking.wait_unparked(self.config.stop_timeout_s):
            logger.warning("training still parked %.1f s after stop (a hook runs on it)", self.config.stop_timeout_s)
        self._executor.stop()

    def _describe_layout(self) -> str:
        """For the start line: the fan-out, if any ("" when every rank is on the job's Store)."""
        if self._fan_out is None:  # a leader-only process
            return describe_for_leader(self._layout)
        return self._fan_out.describe()

    @property
    def handles_signals(self) -> bool:
        """Whether SIGTERM/SIGINT stop this agent (``handle_signals``; see process_hooks.py)."""
        return self.config.handle_signals

    def status(self) -> dict[str, Any]:
        """A snapshot for humans and health checks: state, connection, counters, last switch.

        ``connected`` is true only while the notify stream is established (see clusterd/notify.py);
        ``disconnected_s`` says for how long it has not been. ``last_error`` is the error that keeps it
        from being so now ("" once connected): the process-manage client's while that stream, which the
        notify stream waits for, is not open. ``last_error_seen`` keeps the last error met and when.
        ``conflict``: another process-manage client fights for the job's stream (clusterd/process_manage.py).
        ``coordination_lost``: why this rank can no longer take part in switches (its Store, or its relay's).
        """
        session = self._session
        sub = session.subscriber if session else None
        pm = session.process_manage if session else None
        controller = session.controller if session else None
        counters, last_switch = self._executor.snapshot()
        with self._lock:
            state, reason = self._state, self._state_reason
        now, last_msg = time.monotonic(), (sub.last_message_mono if sub else None)
        connected = bool(sub and sub.running and sub.connected())
        from nicswitch_agent.clusterd.stream_thread import error_now, error_seen  # no grpc: members call it too
        conflict = None
        if pm is not None and pm.conflict:
            conflict = {"detail": pm.conflict, "action": "backing off: the other client keeps the stream"}
        elif self._conflict:
            conflict = {"detail": self._conflict, "action": "fell back to pause mode external (pause=auto)"}
        return {
            "state": state,
            "reason": reason if state in (FAILED, STOPPED, INACTIVE) else "",
            "role": "leader" if self._coordinator is not None else ("member" if self._member is not None else None),
            "rank": None if state == INACTIVE else own_rank(self.rank, self._leader_only),
            "world_size": self.world_size,
            "job_id": self.config.job_id,
            "server": self.config.server,
            "pause": self.pause_mode,
            "dry_run": self.config.dry_run,
            "connected": connected,
            "disconnected_s": None if connected or sub is None else round(now - sub.connection_changed_mono, 3),
            "stream_open": bool(sub and sub.stream_open),
            "last_error": error_now(sub, pm),
            "last_error_seen": error_seen(notify=sub, process_manage=pm),
            "conflict": conflict,
            "last_message_age_s": None if last_msg is None else round(time.monotonic() - last_msg, 3),
            "uptime_s": None if self._started_mono is None else round(time.monotonic() - self._started_mono, 3),
            "stream": {key: getattr(sub, key) if sub else 0 for key in ("opens", "clean_ends", "errors")},
            "counters": counters,
            "timings": self._stats.snapshot(),
            "links": self._stats.links.status(),
            "last_switch": last_switch,
            "last_step": self.last_step,
            "parked": self._parking.parked, "parked_step": self._parking.parked_step,
            "training_stopped": self._parking.stop_requested(),  # why step() raises TrainingStopped, if it does
            "stuck_hook": None if self._member is None else self._member.stuck_hook(),
            "coordination_lost": (self._member.lost or None) if self._member is not None else None,
            "last_verify": None if self._member is None else self._member.last_verify,
            "process_manage": None if pm is None else {
                **{key: getattr(pm, key) for key in ("registered", "stream_open", "opens", "errors", "last_error",
                                                     "last_error_seen")},
                "last_signal": controller.last_signal if controller else "",
                "quiet_resets": pm.conflict_resets,
            },
        }

    def health_check(self) -> dict[str, Any]:
        """Ask ClusterD's HealthCheck (one unary call; for status pages and the CLI, not per step)."""
        if self._session is None:
            raise AgentStateError("health_check() needs a started agent")
        started = time.monotonic()
        status = self._session.health_check()
        return {"code": int(status.code), "info": status.info,
                "latency_ms": round((time.monotonic() - started) * 1000, 3)}

    def events(self) -> list[AgentEvent]:
        """The most recent events (up to 256), oldest first."""
        return self._events.snapshot()

    def add_listener(self, listener: EventListener) -> None:
        self._events.add_listener(listener)

    def __enter__(self) -> SwitchAgent:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop("context exited")

    # -- notify thread -------------------------------------------------------------------------

    def _on_list(self, message: pb.SwitchRankList) -> None:
        """Validate and enqueue; never blocks (runs on the notify thread)."""
        cfg = self.config
        if message.jobId and message.jobId != cfg.job_id:
            self._executor.count("lists_ignored")
            logger.warning("ignoring a rank list for job %r (this agent serves %r); no reply sent",
                           message.jobId[:128], cfg.job_id)
            self._emit(ev.LIST_IGNORED, detail={"job_id": message.jobId[:128]})
            return
        seq = next(self._seq)
        waiting = self._executor.waiting()
        if waiting >= cfg.max_pending_lists:
            reason = (f"{waiting} lists already wait for execution (max_pending_lists="
                      f"{cfg.max_pending_lists}); ClusterD sends one at a time")
            self._executor.count("lists_received", "lists_rejected")
            logger.error("switch #%d refused, replying false in turn: %s", seq, reason)
            self._emit(ev.LIST_REJECTED, seq, {"reason": reason, "entries": len(message.rankID)})
            self._executor.submit(self._owed(seq, None, reason))
            return
        try:
            order = build_order(seq=seq, job_id=cfg.job_id, rank_ids=message.rankID, ops=message.op,
                                world_size=self.world_size, max_ranks=cfg.max_ranks)
        except InvalidOrder as exc:
            self._executor.count("lists_received", "lists_rejected")
            logger.error("switch #%d refused, replying false: %s", seq, exc)
            self._emit(ev.LIST_REJECTED, seq, {"reason": str(exc), "entries": len(message.rankID)})
            self._executor.submit(self._owed(seq, None, str(exc)))
            return
        self._executor.count("lists_received")
        logger.info("switch %s received", order.summary())
        standby = sum(order.ops)
        self._emit(ev.LIST_RECEIVED, seq, {"ranks": len(order), "to_standby": standby,
                                           "to_primary": len(order) - standby})
        self._executor.submit(self._owed(seq, order))

    def _owed(self, seq: int, order: SwitchOrder | None, rejection: str = "") -> OwedReply:
        if self._session is None:  # not started (benchmarks feed _on_list directly)
            return OwedReply(seq, self.config.job_id, order, rejection)
        return self._session.owed_reply(seq, order, rejection)

    def _forgotten(self, owed: OwedReply) -> str:
        return "" if self._session is None else self._session.forgotten(owed)

    def _on_fatal(self, exc: BaseException) -> None:
        """A stream thread met an error no retry can fix (its ERROR, naming the fix, is logged
        there). The leader cannot go on: it says why in status(), and its threads stop; training
        is not touched (``step()`` stays as cheap as ever, and no rank is left parked)."""
        reason = str(exc)
        with self._lock:
            if self._state in (STOPPING, STOPPED, FAILED):
                return
            starting = self._state == "starting"  # _start_leader stops the threads once all exist
            self._state, self._state_reason = FAILED, reason
        self._emit(ev.AGENT_FAILED, detail={"error": reason})
        if not starting:
            self._start_failure_teardown()

    def _start_failure_teardown(self) -> None:
        with self._lock:
            if self._failure_thread is not None:
                return
            reason = self._state_reason
            thread = threading.Thread(target=self._stop_threads, args=(f"the agent failed: {reason}",),
                                      name="nicswitch-failed", daemon=True)
            thread.start()  # before it is published: stop() joins it
            self._failure_thread = thread

    def _training_must_stop(self, reason: str) -> None:
        with self._lock:  # status()'s reason from now on, and the stopped agent's (stop() adds its own)
            self._state_reason = f"training must stop: {reason}"
        self._emit(ev.TRAINING_STOP, detail={"reason": reason})
        if self._on_stop is not None:
            self._on_stop(reason)

    def _on_health(self, healthy: bool, why: str) -> None:
        self._emit(ev.STREAM_RESTORED if healthy else ev.STREAM_LOST, detail={"why": why})

    def _refresh_status(self) -> None:
        """Rewrite the status file soon: ``connected`` changed without an event."""
        writer = self._status_writer
        if writer is not None:
            writer.refresh()

    def _on_conflict(self, detail: str) -> None:
        """Another process-manage client fights for the job's stream (process-manage thread).

        Pause mode ``agent`` asked for explicitly: the client backs off and status shows it.
        Pause mode ``auto``: the other client is MindIO/TaskD (or a stand-in) pausing training, so
        leave the stream to it: stop ours and run the notify stream ungated, as in ``external``.
        """
        self._refresh_status()
        if self.config.pause != "auto":
            return
        collective = [type(h).__name__ for h in (self._checkpoint_hook, self._verify_hook)
                      if verification.runs_collectives(h) and not self.config.dry_run]
        if collective:  # off the training thread they would deadlock against it (verification.py)
            logger.error("pause mode auto: not falling back to pause mode external: %s run(s) collectives; "
                         "backing off as pause=\"agent\" does", ", ".join(collective))
            return
        logger.warning("pause mode auto: falling back to pause mode external (another process-manage client "
                       "pauses this job); set pause=\"external\" to start that way")
        self._conflict = detail
        self.pause_mode = "external"
        self._pause_reason = "pause=auto fell back: another process-manage client holds the job's stream"
        if self._session is not None:
            self._session.leave_process_manage()
        self._refresh_status()

    # -- the executor's collaborators ---------------------------------------------------------

    def _hook_settings(self) -> HookSettings:
        """The hooks' time budget as the leader counts it."""
        from nicswitch_agent.clusterd.signal_flow import HookSettings

        cfg = self.config
        return HookSettings(has_checkpoint_hook=self._checkpoint_hook is not None,
                            guard_timeout_s=cfg.guard_timeout_s, switch_timeout_s=cfg.switch_timeout_s,
                            pause_timeout_s=cfg.pause_timeout_s, dry_run=cfg.dry_run,
                            guard_unknown=self._leader_only)

    def _run_order(self, order: SwitchOrder) -> Execution:
        """Run one order on every rank (executor thread): through the pause-mode-agent controller,
        or, in pause mode external, on the members' own threads through the coordinator."""
        controller = None if self._session is None else self._session.controller
        if controller is not None:
            return controller.execute(order)
        assert self._coordinator is not None
        return self._hook_settings().execute(self._coordinator, order)

    def _send_reply(self, job_id: str, result: bool, total_timeout_s: float | None) -> ReplyReport:
        assert self._session is not None
        return self._session.send_reply(job_id, result, total_timeout_s)

    def _on_busy(self, busy: bool) -> None:
        with self._lock:
            if self._state in (RUNNING, SWITCHING):
                self._state = SWITCHING if busy else RUNNING
        self._refresh_status()  # no event says the switch is over: the file must not keep saying "switching"

    def _emit(self, kind: str, seq: int | None = None, detail: dict[str, Any] | None = None) -> None:
        self._events.emit(AgentEvent(kind=kind, job_id=self.config.job_id, seq=seq, detail=detail or {}))
