"""The leader's SubscribeNotifySwitch stream: one named daemon thread that resubscribes forever.

ClusterD ends this stream cleanly after every switch and after every controller reset, answers
gRPC ``UNKNOWN`` "not registed, please wait agent register" until the job's process-manage
client has registered, and restarts lose everything. So the stream is reopened:

- at once after a clean end (the upstream client sleeps 1 s here), throttled only if the server
  keeps ending it immediately (:class:`~nicswitch_agent.clusterd.rpc_policy.EndsAtOnce`);
- after a capped, jittered exponential backoff after any other error;
- never after errors that retrying cannot fix (:func:`~nicswitch_agent.clusterd.rpc_policy.is_terminal`:
  not ClusterD, or refused credentials); the owner is told through ``on_fatal`` and the thread ends.

How an error is read and how long to wait are :mod:`nicswitch_agent.clusterd.rpc_policy`'s.

A stream opened with ``wait_for_ready`` waits silently while no connection can be made, so the
first open (and each one after an error) fails fast instead: a connection that cannot be made
then shows up at once in ``last_error`` (until a stream is established) and the log, in plain
words (a plaintext/TLS mismatch above all, see
:func:`~nicswitch_agent.clusterd.channel.explain_connect_failure`), and the stream is reopened at
once, waiting for the connection as before.

"Connected" means a stream is established: one is in flight, the channel is READY, and either a
message came on it or it has stayed so for ``establish_s`` (ClusterD sends nothing on subscribe,
and refuses a subscription it does not like within a round trip). It goes false as soon as the
stream ends (a server that goes away ends it); the channel's :class:`~nicswitch_agent.clusterd.channel.
ConnectivityWatch` (one per channel, shared with the process-manage client and the replier) tells
when the channel is READY again, subscribing to gRPC's connectivity only while someone waits for it.
``on_connection`` hears every change.

Received lists are handed to ``on_list`` at once; that callback must not block (the agent only
validates and enqueues), so the stream keeps being read and ``stop()`` stays prompt.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ConnectivityWatch, RecoverStub, explain_connect_failure, settings_of
from nicswitch_agent.clusterd.rpc_policy import (
    EndsAtOnce,
    backoff_delays,
    describe,
    is_terminal,
    job_unknown,
    nothing_sent,
)
from nicswitch_agent.clusterd.stream_thread import StreamThread

if TYPE_CHECKING:
    from nicswitch_agent.clusterd.stream_gate import StreamGate

logger = logging.getLogger("nicswitch_agent.subscriber")

# The window of SubscriberSettings.eof_burst (see rpc_policy.EndsAtOnce).
EOF_BURST_WINDOW_S = 1.0

@dataclass(frozen=True)
class SubscriberSettings:
    job_id: str
    role: str
    reconnect_initial_s: float = 0.2
    reconnect_max_s: float = 1.0
    resubscribe_after_eof_s: float = 0.0
    stop_timeout_s: float = 1.0
    # This many clean ends in a row with no message, within EOF_BURST_WINDOW_S, look like a
    # server that ends every stream at once; back off instead of spinning.
    eof_burst: int = 5
    # A stream in flight on a READY channel for this long, with no error, counts as established.
    establish_s: float = 0.5
    # After a clean end (ClusterD reset the job): how long to wait for the process-manage stream
    # to be reopened (a newer gate generation) before opening anyway.
    reopen_wait_s: float = 5.0


class NotifySubscriber(StreamThread):
    """Keeps one SubscribeNotifySwitch stream open and passes every received list on."""

    def __init__(
        self,
        stub: RecoverStub,
        settings: SubscriberSettings,
        on_list: Callable[[pb.SwitchRankList], None],
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_health: Callable[[bool, str], None] | None = None,
        gate: StreamGate | None = None,
        watch: ConnectivityWatch | None = None,
        on_connection: Callable[[bool, str], None] | None = None,
    ) -> None:
        super().__init__("nicswitch-notify", settings.stop_timeout_s)
        self._stub = stub
        self._settings = settings
        self._on_list = on_list
        self._on_fatal = on_fatal
        self._on_health = on_health
        self._gate = gate  # when given, open only while it is set (the process-manage stream is open)
        self._ready = threading.Event()
        self.opens = 0
        self.clean_ends = 0
        self.errors = 0
        # Times ClusterD answered that it does not know the job ("not registed"): it restarted (or
        # was never told) and has lost every switch in flight. The agent compares it before replying.
        self.job_unknown = 0
        self.messages = 0
        self.last_message_mono: float | None = None
        self.last_open_mono: float | None = None
        # Optimistic until the first error: a stream that is open but silent looks the same as
        # a healthy idle one (ClusterD sends no headers before the first message).
        self.healthy = True
        self._owns_watch = watch is None
        self._watch = watch or ConnectivityWatch(stub.channel)
        self._on_connection = on_connection
        self._conn_lock = threading.Lock()  # guards the connection fields below and `healthy` changes
        self._conn_call: object | None = None  # the stream in flight, as far as "connected" goes
        self._connected = False
        self._establish_timer: threading.Timer | None = None
        self.connection_changed_mono = time.monotonic()  # when `connected` last changed (or creation)
        self._watch.add_listener(self._on_channel)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread; returns once it runs. A second start() is refused."""
        self._watch.start()
        super().start()
        self._ready.wait()

    def stop(self) -> bool:
        ended = super().stop()
        self._track(None, "stopped")
        if self._owns_watch:
            self._watch.close()
        return ended

    def connected(self) -> bool:
        """True while a stream is established (see the module docstring)."""
        return self._connected

    # -- connection state ----------------------------------------------------------------------

    def _track(self, call: object | None, why: str) -> None:
        """A stream was opened (``call``) or ended (None): (re)arm or drop "connected"."""
        with self._conn_lock:
            self._conn_call = call
            self._cancel_timer_locked()
            lost = self._set_connected_locked(False) if call is None else False
        if lost:
            self._tell_connection(False, why)
        if call is not None and self._watch.ready:
            self._arm(call)

    def _arm(self, call: object) -> None:
        """Count ``call`` as established after ``establish_s`` on a READY channel with no error."""
        with self._conn_lock:
            if call is not self._conn_call or self._connected or self._stop.is_set():
                return
            self._cancel_timer_locked()
            timer = threading.Timer(self._settings.establish_s, self._establish, (call, "no error on the stream"))
            timer.daemon = True
            timer.name = "nicswitch-notify-establish"
            self._establish_timer = timer
        timer.start()

    def _establish(self, call: object, why: str) -> None:
        with self._conn_lock:
            done = getattr(call, "done", None)
            if (call is not self._conn_call or not self._watch.ready
                    or (callable(done) and done()) or not self._set_connected_locked(True)):
                return
        with self._lock:
            self._error_gone()  # established: whatever kept it from being so is over
        self._tell_connection(True, why)
        if why != "message received":  # the message path tells the health itself
            self._set_health(True, "stream established")

    def _on_channel(self, state: grpc.ChannelConnectivity) -> None:
        """The shared watch's listener (gRPC's delivery thread)."""
        if state is grpc.ChannelConnectivity.READY:
            call = self._conn_call
            if call is not None:
                self._arm(call)
            return
        with self._conn_lock:
            self._cancel_timer_locked()
            lost = self._set_connected_locked(False)
        if lost:
            self._tell_connection(False, f"channel {state.name}")

    def _cancel_timer_locked(self) -> None:
        if self._establish_timer is not None:
            self._establish_timer.cancel()
            self._establish_timer = None

    def _set_connected_locked(self, connected: bool) -> bool:
        if connected == self._connected:
            return False
        self._connected = connected
        self.connection_changed_mono = time.monotonic()
        return True

    def _tell_connection(self, connected: bool, why: str) -> None:
        logger.debug("notify stream %s: %s", "established" if connected else "not established", why)
        if self._on_connection is not None:
            try:
                self._on_connection(connected, why)
            except Exception:
                logger.exception("connection callback failed; ignored")

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        settings = self._settings
        request = pb.ClientInfo(jobId=settings.job_id, role=settings.role)
        delays = backoff_delays(settings.reconnect_initial_s, settings.reconnect_max_s)
        ends_at_once = EndsAtOnce(settings.eof_burst, EOF_BURST_WINDOW_S)
        throttled = False  # backing off from a server that ends every stream at once
        failing_since: str | None = None
        self._ready.set()
        used_generation = 0
        ended_cleanly = False
        fail_fast = True  # the next open fails at once if no connection can be made (and says why)
        while not self._stop.is_set():
            got_message = False
            gate = self._gate
            call: Any = None
            if gate is not None:
                # A stream opened before the process-manage stream's reset would be ended by it.
                # A clean end means ClusterD reset the job (which also ends the process-manage
                # stream): wait for it to be reopened, briefly, then for it to be open at all.
                if ended_cleanly:
                    self._wait_gate(gate, used_generation, settings.reopen_wait_s)
                self._wait_gate(gate, None, None)
                if self._stop.is_set():
                    return
                # Started under the gate's lock: the gate's close() cancels it (StreamGate).
                started = gate.start(functools.partial(self._stub.SubscribeNotifySwitch, request,
                                                       wait_for_ready=not fail_fast))
                if started is None:
                    continue  # closed again (or dropped) since the wait: wait again
                call, used_generation = started
            ended_cleanly = False
            try:
                if call is None:
                    call = self._stub.SubscribeNotifySwitch(request, wait_for_ready=not fail_fast)
                self._set_call(call)
                self._track(call, "opened")
                with self._lock:
                    self.opens += 1
                    self.last_open_mono = opened_at = time.monotonic()
                    opens = self.opens
                self._opened(opens)
                for message in call:
                    if not got_message:
                        self._establish(call, "message received")
                    got_message = True
                    self._set_health(True, "message received")
                    with self._lock:
                        self.messages += 1
                        self.last_message_mono = time.monotonic()
                    self._on_list(message)
                with self._lock:
                    self.clean_ends += 1
                ended_cleanly = True
                fail_fast = True
                self._set_health(True, "stream ended cleanly")
                logger.debug("notify stream ended cleanly; resubscribing")
                if failing_since is not None:
                    logger.info("notify stream restored after: %s", failing_since)
                    failing_since = None
                delay = settings.resubscribe_after_eof_s
                ended_at = time.monotonic()
                quick = not got_message and ended_at - opened_at < EOF_BURST_WINDOW_S
                if ends_at_once.ended(opened_at, ended_at, got_message) or (throttled and quick):
                    # The server keeps ending streams at once: wait longer each time, up to
                    # reconnect_max_s, until a stream lasts or brings a list.
                    throttled = True
                    delay = max(delay, next(delays))
                else:
                    throttled = False
                    delays = backoff_delays(settings.reconnect_initial_s, settings.reconnect_max_s)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                if gate is not None and gate.cancelled(call):
                    # Our process-manage stream ended (ClusterD reset the job, or the connection
                    # went): the gate cancelled this stream. Reopen after the next subscribe.
                    ended_cleanly = True
                    lost = gate.lost_with(call)
                    if lost is None:
                        logger.debug("notify stream closed with the process-manage stream")
                        continue
                    # The connection went: this stream was lost with it, whichever end saw it first.
                    with self._lock:
                        self.errors += 1
                        self._error(lost)
                    self._set_health(False, lost)
                    continue
                unreachable = explain_connect_failure(exc, settings_of(self._stub.channel))
                text = unreachable or describe(exc)
                with self._lock:
                    self.errors += 1
                    self._error(text)
                    if job_unknown(exc):
                        self.job_unknown += 1
                self._set_health(False, text)
                if fail_fast and not got_message and nothing_sent(exc):
                    # Nothing was sent: now wait for the connection (gRPC keeps dialing, with its
                    # own backoff) instead of failing again and again.
                    if failing_since != text:
                        log = logger.error if unreachable else logger.warning
                        log("cannot connect to ClusterD, waiting for it: %s", text)
                        failing_since = text
                    fail_fast = False
                    continue
                fail_fast = True
                if is_terminal(exc):
                    logger.error("notify stream failed for good (%s); the agent cannot take part in "
                                 "switches until restarted with a correct server", text)
                    if self._on_fatal is not None:
                        self._on_fatal(exc)
                    break
                if got_message:
                    delays = backoff_delays(settings.reconnect_initial_s, settings.reconnect_max_s)
                if failing_since != text:
                    logger.warning("notify stream error, will resubscribe: %s", text)
                    failing_since = text
                delay = next(delays)
            except Exception as exc:  # a bug in on_list must not end the subscription
                logger.exception("notify stream handler failed; resubscribing")
                with self._lock:
                    self.errors += 1
                    self._error(f"{type(exc).__name__}: {exc}")
                delay = next(delays)
            finally:
                if gate is not None and call is not None:
                    gate.finish(call)
                self._set_call(None)
                self._track(None, "stream ended")
            if delay > 0 and self._stop.wait(delay):
                break

    def ungate(self) -> None:
        """Open streams without waiting for the process-manage stream from now on (the agent fell
        back to pause mode external)."""
        self._gate = None

    def _wait_gate(self, gate: StreamGate, newer_than: int | None, limit: float | None) -> None:
        """Wait until the gate is open (with a generation above ``newer_than`` when given), stop()
        is called, the gate is dropped (:meth:`ungate`), or ``limit`` seconds pass; in short
        slices so stop() stays prompt."""
        deadline = None if limit is None else time.monotonic() + limit
        while not self._stop.is_set() and self._gate is not None:
            ok = gate.wait_open(0.05) if newer_than is None else gate.wait(newer_than, 0.05)
            if ok or (deadline is not None and time.monotonic() >= deadline):
                return

    def _set_health(self, healthy: bool, why: str) -> None:
        with self._conn_lock:
            changed = healthy != self.healthy
            self.healthy = healthy
        if changed and self._on_health is not None:
            try:
                self._on_health(healthy, why)
            except Exception:
                logger.exception("health callback failed; ignored")
