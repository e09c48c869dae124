"""The leader's process-manage client (pause mode ``agent``): Init, Register, and the signal stream.

Upstream this half belongs to MindIO/TaskD. ClusterD sends nothing on the switch stream until
training is paused through this one: ``pause_train`` here, ``ReportStopComplete`` back; after the
switch, ``change_strategy``/``continue`` here, ``ReportRecoverStatus`` back.

Ordering matters: every new ``SubscribeProcessManageSignal`` resets ClusterD's job controller,
which ends every other stream of the job (docs/clusterd.md#subscribe-order). So this stream is opened
first, and the notify stream is allowed to open (``gate``) only once this one is open; after any
end of this stream the gate closes until it is reopened.

A job has room for one process-manage client. A second one (MindIO/TaskD, or the simulator's
``--standin``, next to an agent in pause mode ``agent``) makes the two reset each other: every
subscribe of one ends the other's stream, which subscribes again and ends the first one's, every
second or so, forever, and neither ever gets a pause. This client notices it (its stream ends
cleanly again and again with no signal in between: :class:`ConflictDetector`), says so once at
WARNING with the likely cause and the fix, tells ``on_conflict``, and stops fighting: it
resubscribes only after a long, growing pause (``conflict_backoff_s`` up to
``conflict_backoff_max_s``), so the other client keeps its stream in between.

A connection that cannot be made shows at once: the first Init is sent without waiting for a
connection, so a refused port or a plaintext/TLS mismatch is in ``last_error`` (until ClusterD
answers) and the log right away; the next waits for the connection, cancellably (``stop()``
cancels it).

This module only talks to ClusterD and hands signals to ``on_signal`` (which must not block: the
agent queues them to its own worker). Deciding what a signal means is the agent's job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import (
    ConnectivityWatch,
    RecoverStub,
    connect_problem,
    explain_connect_failure,
    settings_of,
)
from nicswitch_agent.clusterd.rpc_policy import (
    EndsAtOnce,
    Kind,
    backoff_delays,
    bounded,
    classify,
    describe,
    is_terminal,
    must_register_again,
    nothing_sent,
)
from nicswitch_agent.clusterd.stream_gate import StreamGate
from nicswitch_agent.clusterd.stream_thread import StreamThread

logger = logging.getLogger("nicswitch_agent.process_manage")


# Signal types and actions, as ClusterD spells them (docs/clusterd.md#process-manage-signals).
KEEP_ALIVE = "keep-alive"
STOP_TRAIN = "stopTrain"
CHANGE_STRATEGY = "changeStrategy"
GLOBAL_FAULT = "globalFault"
KILL_MASTER = "killMaster"
ACTION_PAUSE = "pause_train"
ACTION_STOP = "stop_train"
ACTION_CHANGE_STRATEGY = "change_strategy"
ACTION_ON_GLOBAL_RANK = "on_global_rank"
ACTION_FAULT_NODES_EXIT = "fault_nodes_exit"
STRATEGY_CONTINUE = "continue"
STRATEGY_RECOVER = "recover"
STRATEGY_RETRY = "retry"
STRATEGY_DUMP = "dump"
STRATEGY_EXIT = "exit"
EXTRA_DUMP_EXIT = "dump_exit"

# Status codes the agent sends or meets (docs/clusterd.md#status-codes-and-strings).
CODE_OK = 0
CODE_PROCESS_NOT_READY = 404
CODE_NOT_INITED = 408
CODE_CLIENT_ERROR = 499

# Pause between the barrier's answer and letting the notify stream open: the server may start the
# subscribe's handler after it answered the barrier (a thread pool). 10 ms was overtaken once on a
# loaded 2-core machine (tests/test_soak.py, after a ClusterD restart); the agent recovers either way.
GATE_SETTLE_S = 0.05
# Longest wait for the HealthCheck round trip that follows the subscribe (see _after_subscribe).
GATE_BARRIER_S = 1.0
# During a conflict backoff, how often the channel's state is read to notice ClusterD going away.
CONFLICT_CONNECTION_READ_S = 0.5
# Init/Register rounds while Register answers 408 (not inited).
REGISTER_ROUNDS = 3
# A stream that ends cleanly with no signal within this long: a server that ends every stream at
# once; the next subscribe backs off (rpc_policy.EndsAtOnce with a burst of one).
QUICK_END_S = 0.5


class RegistrationRefused(Exception):
    """ClusterD refused Init/Register with a code that retrying cannot change."""

    def __init__(self, method: str, code: int, info: str) -> None:
        hints = {
            403: "process recovery / hot switch is not enabled for this job's PodGroup: enable process "
                 "recovery for the job (label process-recover-enable=on) or hot switch, then restart it",
            402: "ClusterD does not know this job (check MINDX_TASK_ID)",
            500: "ClusterD serves its maximum number of jobs",
            502: "ClusterD could not read or patch the job's PodGroup",
        }
        hint = hints.get(code, "see ClusterD's log")
        super().__init__(f"ClusterD refused {method}: code {code} {info!r} ({hint})")
        self.method, self.code, self.info = method, code, info


def describe_signal(signal: pb.ProcessManageSignal) -> str:
    parts = [f"type={signal.signalType!r}", f"uuid={signal.uuid!r}"]
    if signal.actions:
        parts.append(f"actions={list(signal.actions)}")
    if signal.changeStrategy:
        parts.append(f"strategy={signal.changeStrategy!r}")
    if signal.extraParams:
        parts.append(f"extra={signal.extraParams!r}")
    if signal.timeout:
        parts.append(f"timeout={signal.timeout}")
    if signal.faultRanks:
        parts.append(f"faultRanks={[(f.rankId, f.faultType) for f in signal.faultRanks][:16]}")
    if signal.nodeRankIds:
        parts.append(f"nodeRankIds={list(signal.nodeRankIds)[:16]}")
    return " ".join(parts)


@dataclass(frozen=True)
class ProcessManageSettings:
    """Timings of the process-manage client.

    Attributes:
        conflict_resets: Clean ends with no signal in between (keep-alives aside) that mean
            another process-manage client is fighting for the job's stream ...
        conflict_window_s: ... when they all fall within this many seconds. ClusterD ends the
            stream cleanly on its own only after a switch or a recovery, which send signals first.
        conflict_backoff_s: Once a conflict is seen, wait this long before subscribing again
            (each subscribe resets the other client), doubling while the conflict lasts ...
        conflict_backoff_max_s: ... up to this.
    """

    job_id: str
    role: str
    rpc_timeout_s: float = 10.0
    reconnect_initial_s: float = 0.2
    reconnect_max_s: float = 1.0
    stop_timeout_s: float = 1.0
    conflict_resets: int = 3
    conflict_window_s: float = 30.0
    conflict_backoff_s: float = 30.0
    conflict_backoff_max_s: float = 300.0


CONFLICT_CAUSE = (
    "another process-manage client is subscribed for job {job}: every subscribe of one resets "
    "ClusterD's controller and ends the other's stream ({resets} clean ends with no signal within "
    "{window:g} s). Likely MindIO/TaskD (or the simulator's --standin) pauses this job as well. "
    "Fix: set pause=\"external\" (NICSWITCH_PAUSE=external) so the agent leaves the process-manage "
    "stream to it, or stop the other client"
)


class ConflictDetector:
    """Counts clean ends of the process-manage stream with no signal in between.

    Not thread-safe: fed by the process-manage thread only.
    """

    def __init__(self, resets: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._resets = max(1, resets)
        self._window_s = window_s
        self._clock = clock
        self._ends: deque[float] = deque(maxlen=self._resets)

    def quiet_end(self) -> bool:
        """Record a clean end with no signal since the stream opened; True when it makes a
        conflict (``resets`` of them within the window)."""
        now = self._clock()
        self._ends.append(now)
        return len(self._ends) == self._resets and now - self._ends[0] <= self._window_s

    def signal(self) -> None:
        """A real signal arrived: the stream is ClusterD's to end, not the other client's."""
        self._ends.clear()


class ProcessManageClient(StreamThread):
    """Registers the job and keeps SubscribeProcessManageSignal open; one named daemon thread."""

    def __init__(
        self,
        stub: RecoverStub,
        settings: ProcessManageSettings,
        on_signal: Callable[[pb.ProcessManageSignal], None],
        *,
        on_stream_end: Callable[[str], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_conflict: Callable[[str], None] | None = None,
        watch: ConnectivityWatch | None = None,
    ) -> None:
        super().__init__("nicswitch-process-manage", settings.stop_timeout_s)
        self._stub = stub
        self._settings = settings
        self._on_signal = on_signal
        self._on_stream_end = on_stream_end
        self._on_fatal = on_fatal
        self._on_conflict = on_conflict  # told once per conflict, on this client's thread
        self._owns_watch = watch is None
        self._watch = watch or ConnectivityWatch(stub.channel)
        # The channel left READY (ClusterD went away, if only for a moment) since the conflict
        # backoff began; _wake is also set by stop(). See _back_off_from_conflict.
        self._dropped = False
        self._wake = threading.Event()
        self._watch.add_listener(self._on_channel)
        self._conflicts = ConflictDetector(settings.conflict_resets, settings.conflict_window_s)
        # Another process-manage client fights for the job's stream (why, in words); "" when not.
        self.conflict = ""
        self.conflict_resets = 0  # quiet clean ends seen, in all
        self._real_signals = 0  # signals other than keep-alives; only this thread writes it
        self._signalled = threading.Condition()  # notified at each of them (wait_signal_after)
        self.gate = StreamGate()  # open while our stream is open: the notify stream may open
        self.registered = False
        self.opens = 0
        self.errors = 0
        self.signals = 0
        self.last_keepalive_mono: float | None = None
        # Reports answer a signal of one stream. Once that stream has ended, ClusterD has reset
        # the job, and a late report would sit in its one-slot channel until the *next* wait
        # took it as that wait's answer (a pause "complete" before anything paused). So a
        # report is sent only while the stream it answers is the open one, and never once stop
        # has begun; ``close_reports`` waits for one already on the wire.
        self.stream_id = 0  # which stream is (or was last) open; read with the signal it delivered
        self._stream_live = False
        # The stream on which an OK ReportRecoverStatus went out: ClusterD finishes that flow next
        # (tells the operator how the switch ended, then resets the job, ending this stream).
        self._finishing_stream: int | None = None
        self._reports_closed = False
        self._report_lock = threading.Lock()  # held while a report is on the wire

    def _on_stop(self) -> None:
        self.gate.close()
        self._wake.set()

    def _on_channel(self, state: grpc.ChannelConnectivity) -> None:
        """The shared watch's listener (gRPC's delivery thread): the connection went away."""
        if state is not grpc.ChannelConnectivity.READY:
            self._dropped = True
            self._wake.set()

    def stop(self) -> bool:
        """Cancel the call in flight (the stream, or an Init/Register waiting for a connection)
        and join the thread (bounded). Idempotent."""
        ended = super().stop()
        if self._owns_watch:
            self._watch.close()
        return ended

    @property
    def stream_open(self) -> bool:
        """The signal stream is open (an Init or Register in flight is not)."""
        return self._stream_live

    # -- reports (called from the agent's worker thread) ----------------------------------------

    def report_stop_complete(self, code: int, info: str = "", *, stream: int | None = None) -> pb.Status | None:
        request = pb.StopCompleteRequest(jobId=self._settings.job_id, status=pb.Status(code=code, info=info))
        return self._unary("ReportStopComplete", request, stream)

    def report_recover_strategy(self, strategies: list[str], *, stream: int | None = None) -> pb.Status | None:
        request = pb.RecoverStrategyRequest(jobId=self._settings.job_id, strategies=strategies)
        return self._unary("ReportRecoverStrategy", request, stream)

    def report_recover_status(self, code: int, strategy: str, info: str = "", *,
                              stream: int | None = None) -> pb.Status | None:
        request = pb.RecoverStatusRequest(jobId=self._settings.job_id, status=pb.Status(code=code, info=info),
                                          strategy=strategy)
        status = self._unary("ReportRecoverStatus", request, stream)
        if status is not None and code == 0:
            self._finishing_stream = self.stream_id if stream is None else stream
        return status

    def is_current(self, stream: int) -> bool:
        """True while ``stream`` is the open process-manage stream (ClusterD has not reset since)."""
        return stream == self.stream_id and self._stream_live

    @property
    def real_signals(self) -> int:
        """How many signals other than keep-alives came so far, on every stream."""
        return self._real_signals

    def wait_signal_after(self, seen: int, timeout: float) -> bool:
        """Whether a signal other than a keep-alive came after the first ``seen``, waiting up to
        ``timeout`` for one (``seen``: :attr:`real_signals` read earlier)."""
        with self._signalled:
            return self._signalled.wait_for(lambda: self._real_signals > seen, timeout)

    def wait_flow_finished(self, timeout: float) -> bool:
        """After an OK ReportRecoverStatus on the open stream, wait (up to ``timeout``) until
        ClusterD has finished that flow: the stream ended (its reset) or a next signal came. Its
        operator hears how the switch ended only as it finishes; a stream we end first resets the
        job before that, and the operator's stream ends with no message
        (docs/clusterd.md#resets-and-stream-ends). True if nothing is (any longer) being finished."""
        with self._signalled:
            seen = self._real_signals
            return self._signalled.wait_for(
                lambda: self._finishing_stream != self.stream_id or not self._stream_live or self._real_signals > seen,
                timeout)

    def close_reports(self, timeout: float) -> None:
        """Send no more reports; wait (bounded) for one on the wire, before the stream is closed."""
        self._reports_closed = True
        if self._report_lock.acquire(timeout=timeout):
            self._report_lock.release()

    def health_check(self) -> pb.Status:
        """HealthCheck (for status and the CLI; never on a hot path). Raises grpc.RpcError."""
        result: pb.Status = self._stub.HealthCheck(
            pb.ClientInfo(jobId=self._settings.job_id, role=self._settings.role),
            timeout=self._settings.rpc_timeout_s,
        )
        return result

    def _unary(self, method: str, request: Any, stream: int | None) -> pb.Status | None:
        """One report, with a deadline. Reports are not retried: ClusterD reads each from a
        one-slot channel, and a duplicate would be taken as the answer to the next question.
        ``stream``: the stream whose signal this answers (None: whatever stream is open)."""
        with self._report_lock:
            if self._reports_closed:
                logger.warning("%s not sent: the agent is stopping", method)
                return None
            if stream is not None and not self.is_current(stream):
                logger.warning("%s not sent: the process-manage stream it answers has ended (ClusterD "
                               "reset the job); a late report would answer ClusterD's next question", method)
                return None
            started = time.monotonic()
            try:
                status: pb.Status = getattr(self._stub, method)(
                    request, timeout=self._settings.rpc_timeout_s, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                logger.error("%s failed: %s", method, describe(exc))
                return None
        level = logging.INFO if status.code == CODE_OK else logging.ERROR
        logger.log(level, "%s -> %d %r (%.1f ms)", method, status.code, status.info,
                   (time.monotonic() - started) * 1000)
        return status

    # -- the loop ----------------------------------------------------------------------------

    def _cancellable(self, method: str, request: Any, *, wait_for_ready: bool) -> pb.Status:
        """One unary call that stop() can cancel (a blocking call cannot be: a stop during a 10 s
        wait for a connection would outlast its bound). Raises grpc.RpcError, or
        grpc.FutureCancelledError once cancelled."""
        future = getattr(self._stub, method).future(
            request, timeout=self._settings.rpc_timeout_s, wait_for_ready=wait_for_ready
        )
        self._set_call(future)
        try:
            result: pb.Status = future.result()
            return result
        finally:
            self._set_call(None)

    def _after_subscribe(self, request: pb.ClientInfo) -> bool:
        """Hold the notify stream back until ClusterD has taken our subscribe; False on stop().

        The server handles the subscribe (and the reset of the job's controller that comes with
        it) concurrently with whatever follows on the connection, and says nothing until the
        first signal. A notify stream that overtakes it is ended by that reset (seen under load
        with a fixed 10 ms pause). So one HealthCheck, sent after the subscribe on the same
        connection, is a barrier: once it is answered the server has read the subscribe and
        started its handler. Any answer or error will do (a server without HealthCheck answers
        UNIMPLEMENTED), and the wait is bounded by GATE_BARRIER_S, so this never blocks the gate.
        """
        future = self._stub.HealthCheck.future(request, timeout=GATE_BARRIER_S, wait_for_ready=False)
        try:
            while not self._stop.is_set():
                try:
                    future.result(timeout=0.05)
                    break
                except grpc.FutureTimeoutError:
                    continue
                except (grpc.RpcError, grpc.FutureCancelledError):
                    break
        finally:
            future.cancel()
        return not self._stop.wait(GATE_SETTLE_S)

    def _register(self, *, wait_for_ready: bool = True) -> None:
        """Init then Register. 408 (not inited) is answered by Init again, up to REGISTER_ROUNDS
        rounds; other codes are fatal.

        ``wait_for_ready=False``: fail at once if no connection can be made (and say why)."""
        info = pb.ClientInfo(jobId=self._settings.job_id, role=self._settings.role)
        rounds = bounded(_not_inited, attempts=REGISTER_ROUNDS)
        rounds(self._init_and_register, info, wait_for_ready)

    def _init_and_register(self, info: pb.ClientInfo, wait_for_ready: bool) -> None:
        status = self._cancellable("Init", info, wait_for_ready=wait_for_ready)
        if status.code != CODE_OK:
            raise RegistrationRefused("Init", status.code, status.info)
        status = self._cancellable("Register", info, wait_for_ready=True)
        if status.code == CODE_NOT_INITED:
            raise RegistrationRefused("Register", CODE_NOT_INITED, "still not inited after Init")
        if status.code != CODE_OK:
            raise RegistrationRefused("Register", status.code, status.info)
        if not self.registered:
            logger.info("registered job %s with ClusterD", self._settings.job_id)
        self.registered = True
        self._works()  # ClusterD answered: a connection error before is over

    def _run(self) -> None:
        settings = self._settings
        request = pb.ClientInfo(jobId=settings.job_id, role=settings.role)
        delays = backoff_delays(settings.reconnect_initial_s, settings.reconnect_max_s)
        conflict_delays = backoff_delays(settings.conflict_backoff_s, settings.conflict_backoff_max_s)
        ends_at_once = EndsAtOnce(1, QUICK_END_S)
        failing: str | None = None
        self._watch.start()
        fail_fast = True  # the next Init fails at once if no connection can be made (and says why)
        while not self._stop.is_set():
            delay = 0.0
            fighting = False  # the delay is a conflict backoff
            opened = False
            lost: str | None = None  # why the stream failed (the gate's close says so); None: a clean end
            try:
                if not self.registered:
                    self._register(wait_for_ready=not fail_fast)
                call = self._stub.SubscribeProcessManageSignal(request, wait_for_ready=True)
                self._set_call(call)
                self.stream_id += 1  # only this thread writes it
                self._stream_live = True
                with self._lock:
                    self.opens += 1
                    opens = self.opens
                self._opened(opens)
                opened, opened_at, signals_before = True, time.monotonic(), self.signals
                real_before = self._real_signals
                if self._after_subscribe(request):
                    self.gate.open()
                    if self._watch.ready:
                        self._works()
                for signal in call:
                    self._dispatch(signal)
                    if failing is not None:
                        logger.info("process-manage stream restored after: %s", failing)
                        failing = None
                    delays = backoff_delays(settings.reconnect_initial_s, settings.reconnect_max_s)
                    if self.conflict and (self._real_signals > real_before
                                          or time.monotonic() - opened_at >= settings.conflict_window_s):
                        self._conflict_over()
                        conflict_delays = backoff_delays(settings.conflict_backoff_s, settings.conflict_backoff_max_s)
                logger.debug("process-manage stream ended cleanly (ClusterD reset the job); reopening")
                fail_fast = True
                if failing is not None:
                    logger.info("process-manage stream restored after: %s", failing)
                    failing = None
                reason = "clean end"
                if self._real_signals > real_before:
                    self._conflicts.signal()
                elif not self._stop.is_set() and self._quiet_end() and not self._stop.is_set():
                    delay = next(conflict_delays)  # stop fighting: leave the stream to the other client
                    fighting = True
                quick = ends_at_once.ended(opened_at, time.monotonic(), self.signals != signals_before)
                if not delay and quick:
                    delay = next(delays)  # a server that ends every stream at once: do not spin
            except RegistrationRefused as exc:
                logger.error("%s; the agent takes no part in switches (training goes on undisturbed)", exc)
                if self._on_fatal is not None:
                    self._on_fatal(exc)
                break
            except grpc.FutureCancelledError:
                if self._stop.is_set():
                    break
                delay = next(delays)
                reason = "cancelled"
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                waited = not fail_fast
                if not opened and fail_fast and nothing_sent(exc):
                    # Nothing reached ClusterD: say why at once, then wait for the connection (gRPC
                    # keeps dialing with its own backoff) in a call that stop() can cancel.
                    explained = explain_connect_failure(exc, settings_of(self._stub.channel))
                    text = lost = explained or describe(exc)
                    self._record_error(text)
                    if failing != text:  # a misconfiguration it can name is an ERROR, as on the notify stream
                        (logger.error if explained else logger.warning)("cannot connect to ClusterD, waiting for "
                                                                        "it: %s", text)
                        failing = text
                    fail_fast = False
                    continue
                fail_fast = True
                if waited and not opened and classify(exc).kind is Kind.DEADLINE and not self._watch.ready:
                    continue  # the wait for a connection ran out: fail fast again, which says why
                text = lost = self._describe(exc)
                self._record_error(text)
                if is_terminal(exc):
                    logger.error("process-manage stream failed for good: %s", text)
                    if self._on_fatal is not None:
                        self._on_fatal(exc)
                    break
                if must_register_again(exc):
                    self.registered = False  # a restarted ClusterD forgot us: Init/Register again
                    if self._forget_conflict("ClusterD forgot the job or went away"):
                        conflict_delays = backoff_delays(settings.conflict_backoff_s, settings.conflict_backoff_max_s)
                if failing != text:
                    logger.warning("process-manage stream error, will retry: %s", text)
                    failing = text
                reason = text
                delay = next(delays)
            finally:
                with self._signalled:  # (wait_flow_finished waits for this)
                    self._stream_live = False  # no report for this stream from now on
                    self._signalled.notify_all()
                self.gate.close(lost)
                self._set_call(None)
            if opened and self._on_stream_end is not None and not self._stop.is_set():
                try:
                    self._on_stream_end(reason)
                except Exception:
                    logger.exception("stream-end handler failed; ignored")
            if fighting:
                if self._back_off_from_conflict(delay):
                    break
                if not self.conflict:  # cut short: ClusterD went away, and the fight with it
                    conflict_delays = backoff_delays(settings.conflict_backoff_s, settings.conflict_backoff_max_s)
            elif delay > 0 and self._stop.wait(delay):
                break

    def _record_error(self, text: str) -> None:
        with self._lock:
            self.errors += 1
            self._error(text)

    def _works(self) -> None:
        """The stream works (ClusterD answered, or the stream is open on a READY channel): no
        error now, unless another client still fights for the stream."""
        with self._lock:
            if not self.conflict:
                self._error_gone()

    def _quiet_end(self) -> bool:
        """Our stream ended cleanly with no signal: another client's subscribe, most likely. True
        when that makes (or continues) a conflict, after telling the log and ``on_conflict``."""
        with self._lock:
            self.conflict_resets += 1
        if not self._conflicts.quiet_end() and not self.conflict:
            return False
        if self.conflict:
            return True  # still fighting after a pause: pause longer
        s = self._settings
        text = CONFLICT_CAUSE.format(job=s.job_id, resets=s.conflict_resets, window=s.conflict_window_s)
        logger.warning("%s", text)  # first: whoever sees the state can find the line that explains it
        with self._lock:
            self.conflict = text
            self._error(text)
        if self._on_conflict is not None:
            try:
                self._on_conflict(text)
            except Exception:
                logger.exception("conflict handler failed; ignored")
        return True

    def _back_off_from_conflict(self, delay: float) -> bool:
        """Leave the stream to the other client for ``delay`` s, or until the connection to
        ClusterD is lost: a ClusterD that went away (a restart) took the fight with it, so the
        stream is reopened as soon as it answers again, not minutes later. True if stop() came."""
        logger.info("process-manage stream: subscribing again in %.0f s (another client holds it), or as soon "
                    "as ClusterD comes back if it goes away", delay)
        self._wake.clear()
        self._dropped = not self._watch.ready
        deadline = time.monotonic() + delay
        while not self._stop.is_set():
            if self._dropped:
                self._forget_conflict("the connection to ClusterD was lost during the conflict backoff")
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # The watch holds no subscription while the channel is READY (it would wake gRPC's
            # poller every 200 ms for the agent's whole life), so nobody tells us when the
            # connection drops: read the state now and then. A dropped connection stays not
            # READY until something dials again, so a quick restart is not missed between reads.
            self._wake.wait(min(remaining, CONFLICT_CONNECTION_READ_S))
            self._wake.clear()
            if not self._watch.ready:
                self._dropped = True
        return True

    def _forget_conflict(self, why: str) -> bool:
        """ClusterD lost the job (it restarted, or went away): what looked like another client
        fighting for the stream is not evidence any more. True if a conflict was on."""
        self._conflicts.signal()
        with self._lock:
            was, self.conflict = self.conflict, ""
        if was:
            logger.info("process-manage stream: %s; the conflict is over for now, subscribing again", why)
        return bool(was)

    def _conflict_over(self) -> None:
        with self._lock:
            self.conflict = ""
            self._error_gone()  # the stream is held, and a signal came on it
        self._conflicts.signal()
        logger.info("process-manage stream held again: the other process-manage client is gone")

    def _describe(self, exc: grpc.RpcError) -> str:
        """The error in words. Our calls wait for a connection, so one that cannot be made (a
        plaintext/TLS mismatch, say) ends as a bare deadline: ask the channel why."""
        if classify(exc).kind is Kind.DEADLINE:
            client = pb.ClientInfo(jobId=self._settings.job_id, role=self._settings.role)
            problem = connect_problem(self._stub, client, min(1.0, self._settings.rpc_timeout_s))
            if problem:
                return problem
        return describe(exc)

    def _dispatch(self, signal: pb.ProcessManageSignal) -> None:
        with self._lock:
            self.signals += 1
        if signal.jobId and signal.jobId != self._settings.job_id:
            logger.warning("ignoring a process-manage signal for job %r: %s", signal.jobId[:128],
                           describe_signal(signal))
            return
        self._works()
        if signal.signalType == KEEP_ALIVE:
            self.last_keepalive_mono = time.monotonic()
            return
        with self._signalled:
            self._real_signals += 1
            self._signalled.notify_all()
        try:
            self._on_signal(signal)
        except Exception:
            logger.exception("signal handler failed on %s; ignored", describe_signal(signal))


def _not_inited(exc: BaseException) -> bool:
    """Register answered 408: Init again (another round of :meth:`ProcessManageClient._register`)."""
    return isinstance(exc, RegistrationRefused) and exc.method == "Register" and exc.code == CODE_NOT_INITED
