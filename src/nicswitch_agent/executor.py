"""The leader's executor: runs each received list's order, one at a time, and owes ClusterD
exactly one ReplySwitchNicResult for it.

Each accepted list becomes an :class:`OwedReply` the moment it is received (the notify thread
queues it here). Whoever claims the token first sends the reply, and nobody else can: the
executor thread (``nicswitch-executor``) with the real result, or :meth:`Executor.settle` on stop
with a false. A stop that finds the token claimed waits, bounded, until that reply is on the wire
(:attr:`OwedReply.settled`): the caller ends the process-manage stream only afterwards, because
ClusterD resets the job when that stream ends and would take a late reply as its next switch's
result (docs/protocol.md, "Exactly one reply").

The executor knows nothing of gRPC or of how an order is run: the agent gives it ``run`` (the
pause-mode-agent controller, or the coordinator for pause mode external), ``send`` (the
replier) and ``forgotten`` (whether ClusterD still waits for a reply).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nicswitch_agent.coordination.hook_runner import Execution
from nicswitch_agent.observability import events as ev
from nicswitch_agent.orders import SwitchOrder

if TYPE_CHECKING:
    from nicswitch_agent.clusterd.reply import ReplyReport

logger = logging.getLogger("nicswitch_agent")

Emit = Callable[[str, "int | None", "dict[str, Any]"], None]
Send = Callable[[str, bool, "float | None"], "ReplyReport"]


class OwedReply:
    """The one reply owed for one received list. ``claim()`` succeeds exactly once."""

    def __init__(self, seq: int, job_id: str, order: SwitchOrder | None, rejection: str = "",
                 stream: int | None = None, job_unknown: int | None = None) -> None:
        self.seq = seq
        self.job_id = job_id
        self.order = order  # None: the list was refused (``rejection`` says why); the reply is false
        self.rejection = rejection
        self.stream = stream  # pause mode agent: the process-manage stream open when the list came
        self.job_unknown = job_unknown  # pause mode external: the notify stream's "not registed" count then
        self._claimed = False
        self._lock = threading.Lock()  # guards _claimed
        self.settled = threading.Event()  # set once the claimed reply was sent, failed or dropped

    def claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True


@dataclass
class Counters:
    lists_received: int = 0
    lists_rejected: int = 0
    lists_ignored: int = 0
    switches_ok: int = 0
    switches_failed: int = 0
    replies_delivered: int = 0
    replies_failed: int = 0


class Executor:
    """The executor thread, the queue of owed replies, and the switch/reply counters.

    Args:
        run: runs one order on every rank and says how it went (blocks; executor thread).
        send: ``send(job_id, result, total_timeout_s)`` sends one reply (the replier's ``send``).
        forgotten: why ClusterD no longer waits for this reply ("" if it still does).
        emit: ``emit(kind, seq, detail)`` records an agent event.
        on_busy: called with True before an order runs and False after (the agent's state).
        world_size: the number of ranks an order runs on (for the switch_done event).
        stop_timeout_s: bound for each wait of :meth:`settle` and :meth:`stop`.
    """

    def __init__(self, *, run: Callable[[SwitchOrder], Execution], send: Send,
                 forgotten: Callable[[OwedReply], str], emit: Emit, on_busy: Callable[[bool], None],
                 world_size: Callable[[], int], stop_timeout_s: float) -> None:
        self._run, self._send, self._forgotten, self._emit = run, send, forgotten, emit
        self._on_busy, self._world_size, self._stop_timeout_s = on_busy, world_size, stop_timeout_s
        self.queue: queue.Queue[OwedReply | None] = queue.Queue()  # lists waiting; None ends the thread
        self._lock = threading.Lock()  # guards _counters, _last_switch, _current
        self._counters = Counters()
        self._last_switch: dict[str, Any] | None = None
        self._current: OwedReply | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="nicswitch-executor", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """End the thread once the order it runs (if any) is done; bounded by ``stop_timeout_s``."""
        if self._thread is None:
            return
        self.queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(self._stop_timeout_s)
            if self._thread.is_alive():
                logger.warning("executor thread still busy after %.1f s (a hook is running); "
                               "leaving it as a daemon", self._stop_timeout_s)

    def abandon(self) -> None:
        """Undo a start() that failed half way: end the thread, forget what was queued."""
        if self._thread is not None:
            self.queue.put(None)
        self.queue = queue.Queue()
        self._thread = None

    # -- the notify thread's side ----------------------------------------------------------------

    def submit(self, owed: OwedReply) -> None:
        self.queue.put(owed)

    def waiting(self) -> int:
        return self.queue.qsize()

    def count(self, *names: str) -> None:
        """Add one to each named counter (see :class:`Counters`)."""
        with self._lock:
            for name in names:
                setattr(self._counters, name, getattr(self._counters, name) + 1)

    def snapshot(self) -> tuple[dict[str, int], dict[str, Any] | None]:
        """(counters, last switch) for status()."""
        with self._lock:
            return dict(vars(self._counters)), dict(self._last_switch) if self._last_switch else None

    # -- the executor thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            owed = self.queue.get()
            if owed is None:
                return
            try:
                self._execute(owed)
            except Exception:  # the executor must survive anything
                logger.exception("switch #%d: unexpected error; replying false", owed.seq)
                self.reply(owed, False, "internal error")

    def _execute(self, owed: OwedReply) -> None:
        if owed.order is None:
            self.reply(owed, False, owed.rejection)
            return
        order = owed.order
        with self._lock:
            self._current = owed
        self._on_busy(True)
        try:
            started = time.monotonic()
            execution = self._run(order)
            execution = dataclasses.replace(execution, duration_s=time.monotonic() - started)
            self._record(order, execution)
            self.reply(owed, execution.ok, execution.reason)
        finally:
            with self._lock:
                self._current = None
            self._on_busy(False)

    def _record(self, order: SwitchOrder, execution: Execution) -> None:
        self._emit(ev.SWITCH_DONE, order.seq, {
            "ok": execution.ok, "reason": execution.reason, "ranks": self._world_size(),
            "duration_s": execution.duration_s,
        })
        self.count("switches_ok" if execution.ok else "switches_failed")
        if not execution.ok:
            logger.error("switch #%d failed: %s", order.seq, execution.reason)

    # -- replies ---------------------------------------------------------------------------------

    def reply(self, owed: OwedReply, result: bool, reason: str, *,
              total_timeout_s: float | None = None) -> ReplyReport | None:
        """Send the reply owed for ``owed`` unless someone already claimed it (then None)."""
        if not owed.claim():
            logger.debug("switch #%d: reply already sent; not sending another", owed.seq)
            return None
        try:
            return self._send_claimed(owed, result, reason, total_timeout_s)
        finally:
            owed.settled.set()

    def _send_claimed(self, owed: OwedReply, result: bool, reason: str,
                      total_timeout_s: float | None) -> ReplyReport | None:
        forgotten = self._forgotten(owed)
        if forgotten:
            # ClusterD waits for no reply any more, and would keep this one and take it as the
            # result of its next switch.
            why = f"{forgotten}; a reply now would answer its next switch"
            with self._lock:
                self._counters.replies_failed += 1
                self._remember(owed, result, reason, "dropped", 0, why)
            logger.warning("switch #%d: reply %s not sent: %s", owed.seq, str(result).lower(), why)
            self._emit(ev.REPLY_FAILED, owed.seq, {"result": result, "reason": reason, "outcome": "dropped",
                                                   "attempts": 0, "duration_s": 0.0, "code": None, "sent_at": None,
                                                   "error": why})
            return None
        report = self._send(owed.job_id, result, total_timeout_s)
        from nicswitch_agent.clusterd.reply import ReplyOutcome

        if report.delivered:
            why = ""
        elif report.outcome is ReplyOutcome.REJECTED:
            why = f"ClusterD answered code {report.code}: {report.info}"
        elif report.outcome is ReplyOutcome.UNCERTAIN:
            why = f"{report.error}; it may have arrived, so it is not resent (a duplicate would be "\
                  "taken as the next switch's result)"
        else:
            why = f"{report.error}; ClusterD never received it"
        with self._lock:
            if report.delivered:
                self._counters.replies_delivered += 1
            else:
                self._counters.replies_failed += 1
            self._remember(owed, result, reason, report.outcome.value, report.attempts, why or None)
        detail = {"result": result, "reason": reason, "outcome": report.outcome.value,
                  "attempts": report.attempts, "duration_s": report.duration_s, "code": report.code,
                  "sent_at": report.sent_at}
        if report.delivered:
            logger.info("switch #%d: replied %s (%s) in %.1f ms", owed.seq, str(result).lower(), reason,
                        report.duration_s * 1000)
            self._emit(ev.REPLY_SENT, owed.seq, detail)
        else:
            logger.error("switch #%d: reply %s not delivered: %s", owed.seq, str(result).lower(), why)
            self._emit(ev.REPLY_FAILED, owed.seq, {**detail, "error": why})
        return report

    def _remember(self, owed: OwedReply, result: bool, reason: str, reply: str, attempts: int,
                  error: str | None) -> None:
        """The last switch for status(), its reply delivered or not (``error``: why not); under ``_lock``."""
        elapsed = None if owed.order is None else time.monotonic() - owed.order.received_at
        self._last_switch = {
            "seq": owed.seq, "ranks": len(owed.order) if owed.order else 0, "result": result,
            "reason": reason, "reply": reply, "reply_attempts": attempts, "error": error,
            "total_s": None if elapsed is None else round(elapsed, 6), "at": time.time(),
        }

    def settle(self, reason: str) -> int:
        """On stop: answer false for the list being executed and for every queued one, and wait
        (bounded) for a reply another thread is sending right now. Returns how many lists were
        owed a reply (each now answered, by this call or the thread that was sending)."""
        with self._lock:
            current = self._current
        owed_list = [current] if current is not None else []
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                owed_list.append(item)
        for owed in owed_list:
            self.reply(owed, False, f"agent stopping: {reason}", total_timeout_s=self._stop_timeout_s)
            # Claimed elsewhere (the executor replying at this moment): wait until it is on the wire.
            if not owed.settled.wait(self._stop_timeout_s):
                logger.warning("switch #%d: the reply under way did not finish within %.1f s",
                               owed.seq, self._stop_timeout_s)
        return len(owed_list)


__all__ = ["Counters", "Executor", "OwedReply"]
