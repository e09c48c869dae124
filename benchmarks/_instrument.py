"""Stamps taken inside a rank (a thread or a torch process) during end-to-end switches.

Nothing here changes what the agent does: it wraps a few of the agent's own callables (the pause
request, the stub's unary calls, the stream callbacks, the Store) with a monotonic stamp and calls
through. It reads private attributes of :class:`~nicswitch_agent.SwitchAgent`; that is acceptable
for a benchmark and is the only place that does it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.observability.events import AgentEvent

UNARY_REPORTS = ("ReportStopComplete", "ReplySwitchNicResult", "ReportRecoverStatus")


class CountingStore:
    """Wraps a Store: counts calls and the time spent in them, per method."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if not callable(target) or name == "clone":
            return target

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return target(*args, **kwargs)
            finally:
                elapsed = time.monotonic() - started
                with self._lock:
                    self.calls[name] += 1
                    self.seconds[name] += elapsed

        return timed

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"calls": dict(self.calls), "seconds": {k: round(v, 6) for k, v in self.seconds.items()}}


class RankRecorder:
    """One rank's stamps: pause requests, parking, hook calls; the leader's RPCs and stream messages."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.call_t = 0.0  # set by the training loop just before each agent.step()
        self.requests: list[float] = []
        self.completed_at_request: list[int | None] = []  # the rank's last step when its flag went up
        self.parked: list[tuple[float, int | None, float]] = []  # (parked, step, step() called)
        self.hooks: list[tuple[int, float, float]] = []  # (seq, start, end)
        self.rpc: list[tuple[str, float, float]] = []  # leader: (method, start, end)
        self.signals: list[tuple[str, float]] = []  # leader: process-manage signals received
        self.lists: list[float] = []  # leader: rank lists received
        self.verifies: list[float] = []  # this rank's verify hook, seconds (member_result of kind verify)
        self.leader_store: CountingStore | None = None
        self.member_store: CountingStore | None = None

    # -- the hook and the listener given to SwitchAgent -------------------------------------------

    def hook(self, order: SwitchOrder) -> bool:
        started = time.monotonic()
        self.hooks.append((order.seq, started, time.monotonic()))
        return True

    def on_event(self, event: AgentEvent) -> None:
        if event.kind == "parked":
            self.parked.append((event.mono, event.detail.get("step"), self.call_t))
        elif event.kind == "member_result" and event.detail.get("kind") == "verify":
            self.verifies.append(float(event.detail.get("duration_s", 0.0)))

    # -- wrapping ------------------------------------------------------------------------------

    def instrument(self, agent: SwitchAgent) -> None:
        """Before start(): stamp every pause request this rank's member makes."""
        lot = agent._parking
        request = lot.request

        def stamped_request(*args: Any, **kwargs: Any) -> int:
            self.requests.append(time.monotonic())
            self.completed_at_request.append(agent.last_step)  # what the member reads as c_r right after
            return request(*args, **kwargs)

        lot.request = stamped_request  # type: ignore[method-assign]

    def instrument_started(self, agent: SwitchAgent, *, count_store: bool = True) -> None:
        """After start(): the leader's unary reports and stream callbacks; the Store calls."""
        if count_store and agent._member is not None:
            self.member_store = CountingStore(agent._member.kv.store)
            agent._member.kv.store = self.member_store
        if agent.rank != 0:
            return
        stub = agent._session.stub
        assert stub is not None
        calls: dict[str, Callable[..., Any]] = stub._calls
        for name in UNARY_REPORTS:
            calls[name] = self._timed_call(name, calls[name])
        pm = agent._session.process_manage
        if pm is not None:
            on_signal = pm._on_signal

            def stamped_signal(signal: Any) -> None:
                kind = "pause" if "pause_train" in signal.actions else (
                    "continue" if signal.changeStrategy == "continue" else signal.signalType)
                self.signals.append((kind, time.monotonic()))
                on_signal(signal)

            pm._on_signal = stamped_signal
        subscriber = agent._session.subscriber
        if subscriber is not None:
            on_list = subscriber._on_list

            def stamped_list(message: Any) -> None:
                self.lists.append(time.monotonic())
                on_list(message)

            subscriber._on_list = stamped_list
        if count_store and agent._coordinator is not None:
            self.leader_store = CountingStore(agent._coordinator.kv.store)
            agent._coordinator.kv.store = self.leader_store

    def _timed_call(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return call(*args, **kwargs)
            finally:
                self.rpc.append((name, started, time.monotonic()))

        return timed

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "requests": list(self.requests),
            "completed_at_request": list(self.completed_at_request),
            "parked": [list(p) for p in self.parked],
            "hooks": [list(h) for h in self.hooks],
            "rpc": [list(r) for r in self.rpc],
            "signals": [list(s) for s in self.signals],
            "lists": list(self.lists),
            "verifies": list(self.verifies),
            "leader_store": self.leader_store.snapshot() if self.leader_store else None,
            "member_store": self.member_store.snapshot() if self.member_store else None,
        }
