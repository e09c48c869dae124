"""The engine of one job's simulated controller: state, resets, the event loop and keep-alive.

This mirrors upstream ``EventController`` (``recover/controller.go``; docs/clusterd.md#the-state-machine):

* Events go through a 10-slot queue read by one event-loop thread; a transition appends
  ``State(event)`` to the action path and runs the destination state's handler, which may
  block waiting for a report and returns the next event (``selectEventChan``/``trigger``).
* A reset closes the current :class:`~nicswitch_agent.sim.generation.Generation` and opens a new one.
* The event loop and the keep-alive thread start at the first reset, never before
  (``NewEventController`` does not start them; docs/clusterd.md#no-process-manage-subscriber).

Lock: one ``threading.Condition`` (re-entrant) per job guards everything in the controller.
It is never held while calling into gRPC. ``on_change`` (the simulator's notifier) takes its
own lock, always after this one.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.generation import UNCONFIRMED_LIST, Cancelled, Generation, StreamToken
from nicswitch_agent.sim.job_view import FATAL_PREFIX
from nicswitch_agent.sim.ranktable import RankTable
from nicswitch_agent.sim.rules import RULES, TriggerError
from nicswitch_agent.sim.settings import SimJob, SimSettings

logger = logging.getLogger("nicswitch_agent.sim")


class Machine:
    """State and engine shared by the controller's parts; the handlers and RPCs live in subclasses."""

    def __init__(
        self,
        job: SimJob,
        settings: SimSettings,
        rng: random.Random,
        on_change: Callable[[], None] = lambda: None,
        on_fatal: Callable[[str], None] = lambda text: None,
    ) -> None:
        self.job = job
        self.settings = settings
        self.ranktable = RankTable(job.nodes)
        self._rng = rng
        self._on_change = on_change
        self._on_fatal = on_fatal
        self._cond = threading.Condition(threading.RLock())
        self._stopping = False
        self._inited = False
        self._registered = False
        self._gen = self._new_generation(0)
        self._state: str = P.INIT
        self._transitions: list[str] = []
        self._last_path: list[str] = []
        self._history: list[list[str]] = []
        self._resets: list[str] = []
        self._replies: list[bool] = []
        self._om_messages: list[str] = []
        self._signals_sent: list[pb.ProcessManageSignal] = []
        self._lists_sent: list[pb.SwitchRankList] = []
        self._keepalives = 0
        self._violations: list[str] = []
        self._streams: set[StreamToken] = set()
        self._stream_opens: dict[str, int] = dict.fromkeys(P.STREAM_METHODS, 0)
        self._threads: list[threading.Thread] = []

    @property
    def job_id(self) -> str:
        return self.job.job_id

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """End every wait and thread of the job (simulator shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(1.0)
            if thread.is_alive():
                logger.warning("jobId=%s: thread %s did not stop", self.job_id, thread.name)

    # ------------------------------------------------------------------ internals: reset, events

    def _new_generation(self, number: int) -> Generation:
        return Generation(number=number, keepalive_due=time.monotonic() + self.settings.keepalive_interval_s)

    def _changed(self) -> None:
        self._cond.notify_all()
        self._on_change()

    def _violation(self, text: str) -> None:
        logger.warning("jobId=%s protocol misuse: %s", self.job_id, text)
        self._violations.append(text)
        self._changed()

    def _fatal(self, why: str) -> None:
        """Something that crashes the real ClusterD: recorded as a violation, logged as an ERROR,
        then handed to the simulator (``on_fatal``), which goes down too with ``crash_like_clusterd``."""
        text = f"{FATAL_PREFIX}{why}"
        what_now = (
            "the simulator crashes too (crash_like_clusterd)"
            if self.settings.crash_like_clusterd
            else "the simulator keeps serving (crash_like_clusterd, --crash-like-clusterd, makes it exit instead)"
        )
        logger.error("jobId=%s protocol misuse: %s; %s", self.job_id, text, what_now)
        self._violations.append(text)
        self._changed()
        self._on_fatal(f"jobId={self.job_id}: {why}")

    def record_fatal(self, why: str) -> None:
        """:meth:`_fatal` for a crash the RPC layer detects (a report without ``status``)."""
        with self._cond:
            self._fatal(why)

    def _current_path(self) -> list[str]:
        return [*self._transitions, self._state]

    def _reset(self, reason: str) -> None:
        """``reset(false)``: close the generation (ends every stream and wait), back to INIT.

        Also starts the event loop and keep-alive the first time (docs/clusterd.md#resets-and-stream-ends,
        docs/clusterd.md#no-process-manage-subscriber).
        """
        with self._cond:
            path = self._current_path()
            if self._transitions:
                self._last_path = path
                self._history.append(path)
            logger.info("jobId=%s reset (%s); action path = {%s}", self.job_id, reason, "-->".join(path))
            old = self._gen
            old.closed = True
            if old.unconfirmed_send:
                self._violation(UNCONFIRMED_LIST)
            self._gen = self._new_generation(old.number + 1)
            self._state = P.INIT
            self._transitions = []
            self._resets.append(reason)
            self._start_threads()
            self._changed()

    def _start_threads(self) -> None:
        if self._threads or self._stopping:
            return
        for target, name in ((self._event_loop, "loop"), (self._keepalive_loop, "keepalive")):
            thread = threading.Thread(target=target, name=f"nicswitch-sim-{name}-{self.job_id}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _add_event(self, gen: Generation, event: str) -> None:
        """``addEvent``: rule-checked against the current state, 10 slots, overflow resets."""
        with self._cond:
            if gen.closed or self._stopping:
                return
            if (self._state, event) not in RULES:
                logger.warning(
                    "event add fail, order mix, jobId=%s, uuid=%s, state=%s, event=%s",
                    self.job_id,
                    gen.uuid,
                    self._state,
                    event,
                )
                return
            if len(gen.events) >= P.EVENT_QUEUE_LENGTH:
                logger.info("add event=%s timeout, reset state machine", event)
                self._reset(f"event queue full at {event}")
                return
            gen.events.append(event)
            self._changed()

    def _event_loop(self) -> None:
        """``listenEvent``: one event at a time; the destination handler runs outside the lock."""
        while True:
            with self._cond:
                while not self._stopping and not self._gen.events:
                    self._cond.wait()
                if self._stopping:
                    return
                gen = self._gen
                event = gen.events.popleft()
                rule = RULES.get((self._state, event))
                if rule is None:
                    logger.warning("jobId=%s: no rule for %s(%s), dropped", self.job_id, self._state, event)
                    continue
                destination, handler_name = rule
                self._transitions.append(f"{self._state}({event})")
                self._state = destination
                logger.info("jobId=%s's action path = {%s}", self.job_id, "-->".join(self._current_path()))
                self._changed()
            handler: Callable[[Generation], str | None] = getattr(self, handler_name)
            try:
                next_event = handler(gen)
            except Cancelled:
                continue
            except TriggerError as exc:
                logger.error("jobId=%s trigger error, code=%d, err=%s", self.job_id, exc.code, exc)
                with self._cond:
                    if not gen.closed:
                        self._reset(f"trigger error, code={exc.code}, err={exc}")
                continue
            except Exception:
                logger.exception("jobId=%s: simulator handler %s failed", self.job_id, handler_name)
                with self._cond:
                    if not gen.closed:
                        self._reset(f"simulator error in {handler_name}")
                continue
            if next_event:
                self._add_event(gen, next_event)

    def _keepalive_loop(self) -> None:
        """``keepAlive``: a keep-alive into the signal slot every interval, per generation.

        The put blocks while the slot is full, as upstream's does (controller.go selectKeepAlive).
        """
        interval = self.settings.keepalive_interval_s
        with self._cond:
            while not self._stopping:
                gen = self._gen
                now = time.monotonic()
                if now < gen.keepalive_due:
                    self._cond.wait(gen.keepalive_due - now)
                    continue
                if gen.signal is not None:
                    self._cond.wait()
                    continue
                gen.signal = pb.ProcessManageSignal(uuid=gen.uuid, jobId=self.job_id, signalType=P.KEEP_ALIVE)
                gen.keepalive_due = now + interval
                self._changed()
