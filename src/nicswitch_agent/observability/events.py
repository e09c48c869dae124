"""Structured events: one record per state change of the agent, for timelines, tests and metrics.

Listeners are user code and run on agent threads, so a listener that raises is logged and
dropped from nothing: it simply does not affect the agent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger("nicswitch_agent.events")

# Event kinds, in the order a switch produces them.
SUBSCRIBED = "subscribed"  # leader: a ClusterD stream was opened: {stream, opens}
STREAM_LOST = "stream_lost"
STREAM_RESTORED = "stream_restored"
LIST_RECEIVED = "list_received"
LIST_REJECTED = "list_rejected"
LIST_IGNORED = "list_ignored"
SWITCH_DONE = "switch_done"  # leader: an order ran on every rank: {ok, reason, ranks, duration_s}
SWITCH_OUTCOME = "switch_outcome"  # every rank: the leader's decision on an order reached it
REPLY_SENT = "reply_sent"
REPLY_FAILED = "reply_failed"
RECOVERY = "recovery"  # leader, pause mode agent: ClusterD's recovery after a failed switch: {signal, offered, chosen}
PAUSE_FAILED = "pause_failed"  # leader, pause mode agent: ClusterD's pause did not complete: {reason, duration_s}
AGENT_STARTED = "agent_started"
AGENT_STOPPED = "agent_stopped"
AGENT_FAILED = "agent_failed"
PAUSE_REQUESTED = "pause_requested"  # this rank was asked to park: {epoch, completed_step}
PARKED = "parked"  # this rank's training thread parked at a step boundary: {step, epoch}
GUARD_DONE = "guard_done"  # this rank's checkpoint guard ran (or was skipped) before a switch
RESUMED = "resumed"  # it left the parking spot: {step, parked_s, stop}
TRAINING_STOP = "training_stop"
MEMBER_RESULT = "member_result"  # one rank ran an order (kind guard / switch / verify / rollback / checkpoint)
VERIFY_DONE = "verify_done"  # this rank's verify hook ran after a switch that succeeded on every rank
COORDINATION_LOST = "coordination_lost"  # this rank can no longer take part in switches: {rank, why}


@dataclass(frozen=True)
class EventKind:
    """What the agent knows about one kind of event: who emits it, when, and its ``detail`` fields.

    :data:`EVENT_KINDS` is the reference: docs/operations.md's event table is rendered from it,
    and the tests check it against the events a real job emits.
    """

    kind: str
    emitted_by: str
    when: str
    fields: tuple[tuple[str, str], ...]  # (detail field, what it holds), in the order the docs list them


EVENT_KINDS: dict[str, EventKind] = {e.kind: e for e in (
    EventKind(AGENT_STARTED, "every rank", "the agent started (as `start()` returns: a rank list ClusterD sends at "
                                           "once may be received just before it)", (
        ("rank", "this process's global rank (the leader `nicswitch-agent launch` hosts: `leader`)"),
        ("role", "`leader` or `member`"),
        ("server", "leader: ClusterD's address"),
        ("pause", "leader: the effective pause mode, `agent` or `external`"),
        ("dry_run", "leader: whether hooks are skipped"),
        ("world_size", "leader: the ranks it leads"))),
    EventKind(SUBSCRIBED, "leader", "a stream to ClusterD was opened: at start, after every switch (ClusterD "
              "ends the notify stream), after a reset or a loss. ClusterD sends nothing to confirm it", (
        ("stream", "`notify` (SubscribeNotifySwitch) or `process_manage` (SubscribeProcessManageSignal)"),
        ("opens", "how many times this stream has been opened"))),
    EventKind(STREAM_LOST, "leader", "the notify stream failed (one event per loss, not per retry)", (
        ("why", "the gRPC error"),)),
    EventKind(STREAM_RESTORED, "leader", "the notify stream works again after a loss", (
        ("why", "what showed it works: `stream established` (open on a READY channel with no error), "
                "`message received` or `stream ended cleanly`"),)),
    EventKind(LIST_RECEIVED, "leader", "a valid rank list arrived", (
        ("ranks", "how many ranks it names"),
        ("to_standby", "ranks to move to their standby NIC"),
        ("to_primary", "ranks to move back to their primary NIC"))),
    EventKind(LIST_REJECTED, "leader", "a rank list was invalid: it is answered false and never run", (
        ("reason", "what is wrong with it"),
        ("entries", "how many entries it had"))),
    EventKind(LIST_IGNORED, "leader", "a rank list for another job: no reply is sent", (
        ("job_id", "the job it named (first 128 characters)"),)),
    EventKind(PAUSE_REQUESTED, "every rank, pause mode `agent`", "the leader asked this rank to park", (
        ("epoch", "the pause request's number"),
        ("completed_step", "the last step this rank had completed when it saw the request"),
        ("sent_at", "the leader's wall clock when it sent the message (for aligning hosts' clocks in the timeline)"))),
    EventKind(PARKED, "every rank, pause mode `agent`", "the training thread parked at a step boundary", (
        ("step", "the step it parked at, the same on every rank"),
        ("epoch", "the pause request's number"))),
    EventKind(GUARD_DONE, "every rank", "before a switch: the checkpoint guard ran, or there was none to run; "
              "`seq` is the leader's number of the list", (
        ("rank", "this process's global rank"),
        ("ok", "whether the switch may go ahead (true when skipped)"),
        ("skipped", "true when no checkpoint hook is configured, or in a dry run"),
        ("status", "`ok`, `failed`, `raised`, `timeout` or `bad_result`; null when skipped"),
        ("detail", "what the guard said, or why it failed"),
        ("duration_s", "how long the guard took"),
        ("epoch", "the leader's pause (or session) the order ran in"),
        ("sent_at", "the leader's wall clock when it sent the message (for aligning hosts' clocks in the timeline)"))),
    EventKind(MEMBER_RESULT, "every rank", "this rank ran an order: a guard round, a switch, a verification, a "
                                           "rollback or a checkpoint; `seq` is the leader's number of the list", (
        ("rank", "this process's global rank"),
        ("kind", "`guard` (the checkpoint guard and the verify warm-up, where they run: a round before the "
                 "switch), `switch` (the switch hook; with the guard first where no guard round ran), `verify` "
                 "(the verify hook, once the switch succeeded on every rank), `rollback` or `checkpoint`"),
        ("ok", "whether it succeeded"),
        ("reason", "why it failed, or what it did"),
        ("duration_s", "how long it took on this rank"),
        ("parked", "whether it ran on the parked training thread (else on the member thread)"),
        ("epoch", "the leader's pause (or session) the order ran in"),
        ("sent_at", "the leader's wall clock when it sent the message (for aligning hosts' clocks in the timeline)"))),
    EventKind(VERIFY_DONE, "every rank with a verify hook", "after a switch that succeeded on every rank: this "
              "rank's verification ended (passed, failed, raised or timed out)", (
        ("rank", "this process's global rank"),
        ("ok", "whether the links proved to carry traffic here"),
        ("reason", "`ok`, or why it failed (a probe names the group and what became of its communicator)"),
        ("duration_s", "how long the verification took on this rank"),
        ("report", "the hook's own record, or null: `TorchLinkProbe` gives `seq` and per group `group`, `size`, "
                   "`ok`, `before_s`, `after_s`, `detail`"))),
    EventKind(COORDINATION_LOST, "every rank", "this rank can no longer take part in switches: the Store it "
              "coordinates through is gone (the leader's process, or its node's relay), or its relay lost the "
              "Store above it; training goes on (a parked rank resumes) until the process restarts", (
        ("rank", "this process's global rank"),
        ("why", "the error, e.g. `LinkLost: ...` or `LevelLost: the relay of node 1 lost the Store above it: ...`"))),
    EventKind(SWITCH_DONE, "leader", "an order ran on every rank, or failed on one", (
        ("ok", "true only if every rank succeeded"),
        ("reason", "`switched on every rank`, or the first failure and where"),
        ("ranks", "the job's ranks (its world size): every one runs the order"),
        ("duration_s", "the whole switch on every rank, guard included"))),
    EventKind(SWITCH_OUTCOME, "every rank", "the leader's decision on an order reached this rank (how a rank "
              "that is only a member, e.g. under `nicswitch-agent launch`, learns how a switch ended); `seq` is "
              "the leader's number of the list", (
        ("rank", "this process's global rank"),
        ("kind", "`switch`, or `rollback` / `checkpoint` during ClusterD's recovery"),
        ("ok", "the leader's decision: true only if every rank succeeded"),
        ("reason", "`ok on every rank`, or the first failure and where"),
        ("link", "this rank's link in the order, `standby` or `primary` (its link now if `ok` or `moved`), or null "
                 "when the order did not name this rank, was a dry run, or never ran here"),
        ("moved", "the order failed elsewhere, but this rank's hook returned True and the failure was not the "
                  "verification's, so this rank is on `link`"),
        ("epoch", "the leader's pause (or session) the order ran in"),
        ("sent_at", "the leader's wall clock when it sent the message (for aligning hosts' clocks in the timeline)"))),
    EventKind(REPLY_SENT, "leader", "ReplySwitchNicResult was delivered", (
        ("result", "the answer, true or false"),
        ("reason", "why that answer"),
        ("outcome", "`delivered`"),
        ("attempts", "calls made, retries included"),
        ("duration_s", "the reply call, retries included"),
        ("code", "ClusterD's answer code"),
        ("sent_at", "the leader's wall clock as the call that was delivered went out (the event itself is "
                    "stamped when the call returned, after ClusterD took the reply)"))),
    EventKind(REPLY_FAILED, "leader", "the reply was rejected, not delivered, or may not have arrived (never resent)", (
        ("result", "the answer it tried to send"),
        ("reason", "why that answer"),
        ("outcome", "`rejected`, `not_delivered`, `uncertain`, or `dropped` (ClusterD reset the job or "
                    "restarted since the list came, and would take the reply as its next switch's result)"),
        ("attempts", "calls made"),
        ("duration_s", "time spent trying"),
        ("code", "ClusterD's answer code, if it answered"),
        ("sent_at", "the leader's wall clock as the last call went out, or null when none was sent "
                    "(`dropped`, or ClusterD never reachable)"),
        ("error", "what went wrong"))),
    EventKind(RECOVERY, "leader, pause mode `agent`", "ClusterD's recovery, as its signal arrives: `globalFault` "
              "(after a failed switch) was answered with the strategies the agent can honour, or `changeStrategy` "
              "brought ClusterD's choice among them (not `continue`, which ends every pause, nor the informational "
              "`dump_exit`); `seq` is the failed switch's list number, null when no switch of this pause failed", (
        ("signal", "`globalFault` or `changeStrategy`"),
        ("offered", "`globalFault`: the strategies reported (ReportRecoverStrategy), in order: `retry` and "
                    "`recover` only if the failed order's links were rolled back, `dump` only if a checkpoint of "
                    "the parked step exists or can be taken, always `exit`; else null"),
        ("chosen", "`changeStrategy`: ClusterD's pick, `retry`, `recover`, `dump` or `exit` (any other is logged "
                   "and ignored); else null"))),
    EventKind(PAUSE_FAILED, "leader, pause mode `agent`", "the pause ClusterD asked for (before its rank list) "
              "did not complete: not every rank parked within `pause_timeout_s`, or a rank's process was "
              "restarted during it; the agent reported 499, training went on, and ClusterD kills the job "
              "(`killMaster`). Not emitted when the agent's own stop cut the pause short", (
        ("reason", "why, as the leader's log says it (the ranks that did not park, or what they said)"),
        ("duration_s", "from the pause request to the failure"))),
    EventKind(RESUMED, "every rank, pause mode `agent`", "the training thread left its parking spot", (
        ("step", "the step it was parked at"),
        ("parked_s", "how long it was parked"),
        ("stop", "why training must stop (it then raises `TrainingStopped`), or null"),
        ("interrupted", "`KeyboardInterrupt` or `SystemExit` when one raised on the training thread while parked "
                        "(in a hook or not) ended the parking: it goes on up out of `step()` and training does "
                        "not resume; else null"))),
    EventKind(TRAINING_STOP, "leader, pause mode `agent`", "ClusterD's recovery decided that training must stop", (
        ("reason", "`dump`, `exit` or `killMaster`, in words"),)),
    EventKind(AGENT_FAILED, "leader", "the agent stopped taking part for good", (
        ("error", "a terminal stream error or a refused registration"),)),
    EventKind(AGENT_STOPPED, "every rank", "stop() ran", (
        ("reason", "why it stopped"),)),
)}
"""Every event kind, in the order a switch produces them (start and stop around it)."""


@dataclass(frozen=True)
class AgentEvent:
    """One thing that happened. ``seq`` is the order's sequence number when there is one."""

    kind: str
    job_id: str
    seq: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    wall: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)


EventListener = Callable[[AgentEvent], None]


class EventLog:
    """Keeps the last ``capacity`` events and fans each one out to listeners."""

    def __init__(self, capacity: int = 256) -> None:
        self._events: deque[AgentEvent] = deque(maxlen=capacity)
        self._listeners: list[EventListener] = []
        self._lock = threading.Lock()  # guards _events and _listeners

    def add_listener(self, listener: EventListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def emit(self, event: AgentEvent) -> None:
        with self._lock:
            self._events.append(event)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # user code must never break the agent
                logger.exception("event listener %r raised on %s; ignored", listener, event.kind)

    def snapshot(self) -> list[AgentEvent]:
        with self._lock:
            return list(self._events)
