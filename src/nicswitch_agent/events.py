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
STREAM_LOST = "stream_lost"
STREAM_RESTORED = "stream_restored"
LIST_RECEIVED = "list_received"
LIST_REJECTED = "list_rejected"
LIST_IGNORED = "list_ignored"
SWITCH_DONE = "switch_done"  # leader: an order ran on every rank: {ok, reason, ranks, duration_s}
REPLY_SENT = "reply_sent"
REPLY_FAILED = "reply_failed"
AGENT_STARTED = "agent_started"
AGENT_STOPPED = "agent_stopped"
AGENT_FAILED = "agent_failed"
PARKED = "parked"  # this rank's training thread parked at a step boundary: {step, epoch}
RESUMED = "resumed"  # it left the parking spot: {step, parked_s, stop}
TRAINING_STOP = "training_stop"
MEMBER_RESULT = "member_result"  # one rank ran an order (kind switch / rollback / checkpoint)


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
