"""Channels and stubs for ClusterD's ``Recover`` service on its exact method paths.

Upstream ``recover.proto`` has no ``package`` line, so every method lives at ``/Recover/<Method>``.
Our generated messages carry a package of their own (so they never collide with TaskD's copy in
the same process), therefore we do not use generated service stubs: they would call
``/nicswitch_agent.v1.Recover/...`` and ClusterD would answer UNIMPLEMENTED. Instead the paths
below are spelled out once and shared by the client (:class:`RecoverStub`) and the simulator.

This is the only module that dials; it knows nothing about switches, retries or threads. It
also turns gRPC's words for a failed connection into plain ones (:func:`explain_connect_failure`):
a plaintext/TLS mismatch otherwise reads as ``Socket closed`` or ``WRONG_VERSION_NUMBER``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.experimental

from nicswitch_agent import process_hooks
from nicswitch_agent._pb.service import METHODS, SERVICE, Method, RecoverStub, generic_handler
from nicswitch_agent.clusterd.rpc_policy import HANDSHAKE_WORDS, Kind, classify
from nicswitch_agent.errors import ConfigError

process_hooks.warn_if_unsafe()  # once: grpc was set up for forks by the package's __init__, unless too late

logger = logging.getLogger("nicswitch_agent.transport")

@dataclass(frozen=True)
class TlsSettings:
    """TLS on the channel to ClusterD. ClusterD itself serves plaintext; this is for a TLS endpoint
    in front of it (MindCluster's own way is a local nginx sidecar, dialed in plaintext).

    Attributes:
        ca_file: PEM file of the CA(s) the server's certificate must chain to; None: gRPC's
            default roots (its bundled roots, or ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``).
        cert_file: PEM client certificate (chain), for a server that requires one (mutual TLS).
        key_file: PEM private key of ``cert_file`` (unencrypted); given with it or not at all.
        server_name: The name the server's certificate must hold, instead of the target's host
            (``grpc.ssl_target_name_override``); e.g. when dialing an IP address.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """Read the PEM files (once, now) and build the channel credentials.

        Raises:
            ConfigError: a file cannot be read or holds no PEM block (named by path; the content,
                a private key included, is never shown).
        """
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("tls_cert_file and tls_key_file go together: a client certificate needs its key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem("tls_ca_file", self.ca_file),
            private_key=_read_pem("tls_key_file", self.key_file),
            certificate_chain=_read_pem("tls_cert_file", self.cert_file),
        )

    def describe(self) -> str:
        """``tls=on, CA ..., client certificate ..., server name ...``: paths only, for logs and errors."""
        parts = [
            "tls=on",
            f"CA {self.ca_file}" if self.ca_file else "CA: gRPC's default roots",
            f"client certificate {self.cert_file}" if self.cert_file else "no client certificate",
        ]
        if self.server_name:
            parts.append(f"server name {self.server_name}")
        return ", ".join(parts)


def _read_pem(name: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ConfigError(f"{name}={path!r} cannot be read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{name}={path!r} holds no PEM block (gRPC needs PEM, not DER)")
    return data


@dataclass(frozen=True)
class ChannelSettings:
    """What a channel to ClusterD needs; built from :class:`~nicswitch_agent.config.AgentConfig`."""

    target: str
    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    reconnect_initial_s: float = 0.2
    reconnect_max_s: float = 1.0
    connect_timeout_s: float = 20.0
    max_receive_bytes: int = 8 * 1024 * 1024
    max_send_bytes: int = 4 * 1024 * 1024
    tls: TlsSettings | None = None
    """None: plaintext (ClusterD's own way, and a local sidecar's)."""
    transparent_retries: bool = True
    """gRPC core resends a call that a GOAWAY shows the server never took. False (the operator
    tools, whose loops retry on their own): grpcio 1.85 can lose such a call for good when the
    server goes away with it: a call without a deadline then never returns, not even once the
    server is back (3 of about 380 stream opens racing a simulator's stop here, none of 250
    without). The agent keeps them: a reply racing a GOAWAY is delivered, not left uncertain."""
    single_threaded_streams: bool = False
    """Server streams are read on the reading thread alone, blocked in gRPC core (grpcio's
    experimental ``SingleThreadedUnaryStream``), instead of through grpcio's channel thread and
    100 ms wait slices in Python: an idle stream then runs no Python. ``cancel()`` from another
    thread still ends a blocked read at once; the call's future methods (``result()``,
    ``exception()``) do not block. For the leader's channel (its streams are only iterated)."""

    def options(self) -> list[tuple[str, int | str]]:
        """Channel arguments.

        ClusterD enforces ``MinTime: 3s`` with ``PermitWithoutStream: true``: pinging more often
        earns GOAWAY ``too_many_pings`` (and when the pinging client is the job's process-manage
        client, a reset of the whole job). ``max_pings_without_data=0`` keeps pings flowing on an
        idle stream, so a half-open connection is detected instead of waiting forever.
        """
        options: list[tuple[str, int | str]] = [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),  # what grpcio waits (else 1 min)
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", int(self.reconnect_initial_s * 1000)),
            # Despite its name, gRPC core's MIN_CONNECT_TIMEOUT: how long one connection attempt may
            # take. Set to the first backoff (0.2 s) it failed every attempt over a slow link.
            ("grpc.min_reconnect_backoff_ms", int(self.connect_timeout_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.reconnect_max_s * 1000)),
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            # One subchannel per channel object: the agent's streams never share a connection
            # with another library's channel to the same address.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.tls is not None and self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        if not self.transparent_retries:
            options.append(("grpc.enable_retries", 0))
        if self.single_threaded_streams:
            options.append((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1))
        return options


# The settings each channel was opened with, so that an error on it can be explained with them
# (tls on or off) by whoever holds only the channel. Weak: a closed, dropped channel leaves.
_OPENED_WITH: weakref.WeakKeyDictionary[Any, ChannelSettings] = weakref.WeakKeyDictionary()


def open_channel(settings: ChannelSettings) -> grpc.Channel:
    """Open a channel: plaintext by default (ClusterD has no TLS of its own; MindCluster adds nginx
    sidecars), TLS when ``settings.tls`` is given (its PEM files are read here, once).

    Raises:
        ConfigError: a TLS file cannot be read or is not PEM.
    """
    if settings.tls is None:
        channel = grpc.insecure_channel(settings.target, options=settings.options())
    else:
        channel = grpc.secure_channel(settings.target, settings.tls.credentials(), options=settings.options())
    _OPENED_WITH[channel] = settings
    return channel


def settings_of(channel: Any) -> ChannelSettings | None:
    """The settings :func:`open_channel` opened ``channel`` with (None for any other channel)."""
    try:
        return _OPENED_WITH.get(channel)
    except TypeError:  # not weak-referenceable: a test double
        return None


# How long close_channel waits for grpcio's call thread to let go of the last calls' events.
_CALLS_HANDLED_S = 2.0


def close_channel(channel: grpc.Channel, timeout_s: float = _CALLS_HANDLED_S) -> None:
    """``channel.close()``, then a wait (bounded) until grpcio's Python thread that serves the
    channel's streaming calls has handled their last events.

    ``close()`` returns once the C core is done with the calls; that thread may still be running a
    call's event handler, which holds the call's lock. A process that exits meanwhile (a command
    right after Ctrl-C) ends that thread at the interpreter's shutdown with the lock held, and the
    final garbage collection of the call (its ``__del__`` takes the lock) then waits forever: seen
    with ``watch`` after Ctrl-C, 5 exits in 120 on a loaded machine (tests/test_channel_close.py).
    grpcio counts those calls on the channel (``_call_state.managed_calls``, private: without it,
    no wait).
    """
    channel.close()
    state = getattr(channel, "_call_state", None)
    deadline = time.monotonic() + timeout_s
    while getattr(state, "managed_calls", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.002)


# gRPC's words for what went wrong while connecting (rpc_policy tells that no connection was made).
_PLAINTEXT_PEER = ("wrong_version_number", "http_request", "packet_length_too_long", "record_too_large")
_UNTRUSTED = ("certificate_verify_failed", "certificate verify failed")
_WRONG_NAME = ("hostname verification", "no match found for server name", "name mismatch")
_CLOSED = ("socket closed", "connection reset", "end of file", "broken pipe")
_LOCAL_TLS = "failed to create security handshaker"


def explain_connect_failure(exc: BaseException, settings: ChannelSettings | None = None) -> str | None:
    """Plain words for a call that failed because no connection could be made, naming a
    plaintext/TLS mismatch, an untrusted certificate or a missing client certificate; None for
    any other error (a refused port is already plain: gRPC's own text is kept for it).

    Args:
        exc: The error of a call.
        settings: What the channel was opened with (see :func:`settings_of`); None: unknown.
    """
    failure = classify(exc)
    if failure.kind not in (Kind.CONNECT_FAILED, Kind.HANDSHAKE_FAILED):
        return None  # e.g. "Socket closed" on a stream that was open: the server went away
    details = failure.details
    text = details.lower()
    handshake = any(word in text for word in HANDSHAKE_WORDS)
    target = settings.target if settings is not None else "the server"
    tls = settings.tls if settings is not None else None
    known = settings is not None
    if _LOCAL_TLS in text:
        what = ("TLS could not be set up on our side: the CA file, or the client certificate and key, "
                "are not usable together (a key that does not belong to its certificate?)")
    elif any(word in text for word in _PLAINTEXT_PEER):
        what = (f"TLS handshake with {target} failed: it answered in plaintext. Is the server plaintext? "
                "(ClusterD itself is; dial it, or a local sidecar, with TLS off)")
    elif any(word in text for word in _UNTRUSTED):
        ca = f"the CA in {tls.ca_file}" if tls is not None and tls.ca_file else "a CA we trust"
        what = (f"TLS handshake with {target} failed: its certificate is not signed by {ca}. "
                "Wrong CA? (set tls_ca_file to the CA that signed the server's certificate)")
    elif any(word in text for word in _WRONG_NAME):
        name = tls.server_name if tls is not None and tls.server_name else target.rpartition(":")[0] or target
        what = (f"TLS handshake with {target} failed: its certificate does not hold the name {name!r} "
                "(set tls_server_name to a name the certificate holds)")
    elif handshake:
        what = f"TLS handshake with {target} failed"
    elif any(word in text for word in _CLOSED):
        if known and tls is None:
            what = (f"{target} closed the connection before gRPC could start. Is the server TLS? "
                    "(we dial plaintext; turn TLS on with tls=true or tls_ca_file)")
        elif tls is not None and tls.cert_file is None:
            what = (f"{target} closed the connection during the TLS handshake. Does it require a client "
                    "certificate (mutual TLS)? None is configured (tls_cert_file, tls_key_file)")
        elif tls is not None:
            what = (f"{target} closed the connection during the TLS handshake. Does it trust our client "
                    f"certificate {tls.cert_file}?")
        else:
            return None
    else:
        return None
    setting = "tls=off" if known and tls is None else (tls.describe() if tls is not None else "")
    grpc_words = details.split("last error: ", 1)[-1]
    return f"{what} [{setting + '; ' if setting else ''}gRPC: {grpc_words}]"


def connect_problem(stub: RecoverStub, client: Any, timeout_s: float = 1.0) -> str | None:
    """Why ``stub``'s channel cannot connect, in plain words; None when it can, or when the call
    fails for another reason.

    For callers whose own call waited for a connection (``wait_for_ready``) and timed out, which
    says nothing of why: this makes one ``HealthCheck`` that does not wait (it fails at once while
    the channel is failing to connect, with gRPC's reason). HealthCheck changes nothing in ClusterD.

    Args:
        client: The ``ClientInfo`` to send (ClusterD logs its job id and role).
    """
    try:
        stub.HealthCheck(client, timeout=timeout_s, wait_for_ready=False)
    except grpc.RpcError as exc:
        return explain_connect_failure(exc, settings_of(stub.channel))
    return None


def _state_reader(channel: Any) -> Callable[[bool], grpc.ChannelConnectivity] | None:
    """How to read ``channel``'s connectivity now, without subscribing; None if this channel cannot.

    grpcio tells a channel's state only to subscribers, and a subscription keeps one gRPC thread
    awake every 200 ms for as long as it lasts. The state itself is one call into gRPC core, the one
    that thread makes (``check_connectivity_state`` on the channel's core object, which grpcio keeps in
    ``Channel._channel``). A channel without it (another grpcio, a test double) is watched as before:
    subscribed for its lifetime.
    """
    check = getattr(getattr(channel, "_channel", None), "check_connectivity_state", None)
    if not callable(check):
        return None
    by_number = {state.value[0]: state for state in grpc.ChannelConnectivity}

    def read(try_to_connect: bool) -> grpc.ChannelConnectivity:
        try:
            return by_number.get(check(try_to_connect), grpc.ChannelConnectivity.SHUTDOWN)
        except ValueError:  # "Channel closed!"
            return grpc.ChannelConnectivity.SHUTDOWN

    return read


class ConnectivityWatch:
    """Whether a channel is READY, and word to listeners when it becomes so.

    One per channel, shared by everything that needs to know (the notify subscriber, the
    process-manage client, the replier, and through them ``status()``). A subscription
    (``channel.subscribe``) keeps one gRPC polling thread waking every 200 ms while it lasts
    (docs/performance.md, "Idle CPU"), so the watch holds one only while someone waits for READY:
    from :meth:`start`, :meth:`wait_ready`, or a read of :attr:`state` that finds the channel not
    READY, until READY arrives. Then it lets go, and :attr:`state` is read from gRPC core on demand.

    So listeners hear every change on the way to READY, and none away from it: a connection that
    goes away ends the streams on it (which is how their owners hear it), and the next read of the
    state sees the change and subscribes again. A polling thread that starts just before
    ``close()`` dies with "Channel closed!", so :meth:`close` waits until gRPC's poller has let go.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._read_now = _state_reader(channel)
        self._cond = threading.Condition()  # guards the fields below; taken before gRPC's own lock
        self._state: grpc.ChannelConnectivity | None = None
        self._closed = False
        self._subscribed = False  # nothing subscribed until someone asks: an unused watch costs nothing
        self._listeners: list[Callable[[grpc.ChannelConnectivity], None]] = []
        self.subscriptions = 0  # how often the watch subscribed (each starts gRPC's poller if none runs)

    def _on_change(self, state: grpc.ChannelConnectivity) -> None:
        with self._cond:
            if self._closed or not self._subscribed:
                return  # a delivery that crossed our unsubscribe: the state is read on demand now
            self._state = state
            listeners = list(self._listeners)
            if state is grpc.ChannelConnectivity.READY and self._read_now is not None:
                self._subscribed = False  # nobody waits any more; gRPC's poller ends within 0.2 s
                self._channel.unsubscribe(self._on_change)
            self._cond.notify_all()
        for listener in listeners:  # outside the lock: a listener may read the watch
            try:
                listener(state)
            except Exception:
                logger.exception("connectivity listener failed; ignored")

    def _subscribe_locked(self) -> None:
        if not self._subscribed and not self._closed:
            self._subscribed = True
            self.subscriptions += 1
            self._channel.subscribe(self._on_change, try_to_connect=True)

    def _refresh_locked(self, try_to_connect: bool) -> None:
        """Read the state now unless a subscription keeps it fresh; subscribe if it is not READY."""
        if self._closed:
            return
        if self._read_now is None:
            self._subscribe_locked()  # no way to read on demand: stay subscribed
            return
        if self._subscribed:
            return
        self._state = self._read_now(try_to_connect)
        if self._state is not grpc.ChannelConnectivity.READY:
            self._subscribe_locked()

    def start(self) -> ConnectivityWatch:
        """Start connecting, and subscribe unless the channel is READY already, so that listeners
        hear when it becomes READY."""
        with self._cond:
            self._refresh_locked(try_to_connect=True)
        return self

    def add_listener(self, listener: Callable[[grpc.ChannelConnectivity], None]) -> None:
        """Call ``listener(state)`` on every change heard while subscribed (see the class docstring),
        on gRPC's delivery thread (it must not block). Does not subscribe by itself."""
        with self._cond:
            self._listeners.append(listener)

    @property
    def subscribed(self) -> bool:
        """A subscription is held now (someone waits for READY)."""
        return self._subscribed

    @property
    def state(self) -> grpc.ChannelConnectivity | None:
        """The channel's state now (None until first known). Reading a state other than READY
        subscribes, so that listeners hear when the channel becomes READY."""
        with self._cond:
            self._refresh_locked(try_to_connect=False)
            return self._state

    @property
    def ready(self) -> bool:
        """The channel is READY now (a connection is up)."""
        return self.state is grpc.ChannelConnectivity.READY and not self._closed

    def wait_ready(self, timeout: float) -> bool:
        """True once the channel is READY; False if it is not within ``timeout``."""
        with self._cond:
            self._refresh_locked(try_to_connect=True)
            if self._state is grpc.ChannelConnectivity.IDLE and self._subscribed:
                # Nothing else is dialing: ask for a connection (a fresh subscription does).
                if self._read_now is not None:
                    self._read_now(True)
                else:
                    self._channel.unsubscribe(self._on_change)
                    self._channel.subscribe(self._on_change, try_to_connect=True)
            return self._cond.wait_for(
                lambda: self._closed or self._state is grpc.ChannelConnectivity.READY, timeout
            ) and not self._closed

    def close(self, timeout: float = 1.0) -> None:
        """Unsubscribe, and wait (bounded) until gRPC's polling thread has let go of the channel,
        so that the channel can be closed next. Idempotent.

        A channel closed under that thread makes it die with "Channel closed!": it reads the
        channel once when it starts, then after each 0.2 s watch until it sees no subscriber. It
        may still run after an unsubscribe of a moment ago, so the wait does not depend on one
        being held now.
        """
        with self._cond:
            self._closed = True
            subscribed, self._subscribed = self._subscribed, False
            self._listeners.clear()
            self._cond.notify_all()
            if subscribed:
                self._channel.unsubscribe(self._on_change)
        # grpcio keeps the thread's flag in a private field; without it, do not wait.
        polling = getattr(self._channel, "_connectivity_state", None)
        deadline = time.monotonic() + timeout
        while getattr(polling, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.01)  # the thread looks every 0.2 s; nothing to wait on but its flag


def status_code(status: Any) -> int:
    """The ``code`` of a ``Status`` reply (absent on the wire when it is 0)."""
    return int(status.code)


__all__: Sequence[str] = (
    "METHODS",
    "SERVICE",
    "ChannelSettings",
    "ConnectivityWatch",
    "Method",
    "RecoverStub",
    "TlsSettings",
    "close_channel",
    "connect_problem",
    "explain_connect_failure",
    "generic_handler",
    "open_channel",
    "settings_of",
)
