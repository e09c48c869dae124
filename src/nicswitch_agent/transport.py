"""Channels and stubs for ClusterD's ``Recover`` service on its exact method paths.

Upstream ``recover.proto`` has no ``package`` line, so every method lives at ``/Recover/<Method>``.
Our generated messages carry a package of their own (so they never collide with TaskD's copy in
the same process), therefore we do not use generated service stubs: they would call
``/nicswitch_agent.v1.Recover/...`` and ClusterD would answer UNIMPLEMENTED. Instead the paths
below are spelled out once and shared by the client (:class:`RecoverStub`) and the simulator.

This is the only module that dials; it knows nothing about switches, retries or threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb

SERVICE = "Recover"


@dataclass(frozen=True)
class Method:
    """One RPC of the Recover service: its path, kind and message types."""

    name: str
    request: Any
    response: Any
    server_streaming: bool = False

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


INIT = Method("Init", pb.ClientInfo, pb.Status)
REGISTER = Method("Register", pb.ClientInfo, pb.Status)
SUBSCRIBE_PROCESS_MANAGE_SIGNAL = Method(
    "SubscribeProcessManageSignal", pb.ClientInfo, pb.ProcessManageSignal, server_streaming=True
)
REPORT_STOP_COMPLETE = Method("ReportStopComplete", pb.StopCompleteRequest, pb.Status)
REPORT_RECOVER_STRATEGY = Method("ReportRecoverStrategy", pb.RecoverStrategyRequest, pb.Status)
REPORT_RECOVER_STATUS = Method("ReportRecoverStatus", pb.RecoverStatusRequest, pb.Status)
HEALTH_CHECK = Method("HealthCheck", pb.ClientInfo, pb.Status)
SWITCH_NIC_TRACK = Method("SwitchNicTrack", pb.SwitchNics, pb.Status)
SUBSCRIBE_SWITCH_NIC_SIGNAL = Method(
    "SubscribeSwitchNicSignal", pb.SwitchNicRequest, pb.SwitchNicResponse, server_streaming=True
)
SUBSCRIBE_NOTIFY_SWITCH = Method(
    "SubscribeNotifySwitch", pb.ClientInfo, pb.SwitchRankList, server_streaming=True
)
REPLY_SWITCH_NIC_RESULT = Method("ReplySwitchNicResult", pb.SwitchResult, pb.Status)

METHODS: tuple[Method, ...] = (
    INIT,
    REGISTER,
    SUBSCRIBE_PROCESS_MANAGE_SIGNAL,
    REPORT_STOP_COMPLETE,
    REPORT_RECOVER_STRATEGY,
    REPORT_RECOVER_STATUS,
    HEALTH_CHECK,
    SWITCH_NIC_TRACK,
    SUBSCRIBE_SWITCH_NIC_SIGNAL,
    SUBSCRIBE_NOTIFY_SWITCH,
    REPLY_SWITCH_NIC_RESULT,
)


@dataclass(frozen=True)
class ChannelSettings:
    """What a channel to ClusterD needs; built from :class:`~nicswitch_agent.config.AgentConfig`."""

    target: str
    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    reconnect_initial_s: float = 0.2
    reconnect_max_s: float = 5.0
    max_receive_bytes: int = 8 * 1024 * 1024
    max_send_bytes: int = 4 * 1024 * 1024

    def options(self) -> list[tuple[str, int]]:
        """Channel arguments.

        ClusterD enforces ``MinTime: 3s`` with ``PermitWithoutStream: true``: pinging more often
        earns GOAWAY ``too_many_pings`` (and when the pinging client is the job's process-manage
        client, a reset of the whole job). ``max_pings_without_data=0`` keeps pings flowing on an
        idle stream, so a half-open connection is detected instead of waiting forever.
        """
        return [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", int(self.reconnect_initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.reconnect_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.reconnect_max_s * 1000)),
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            # One subchannel per channel object: the agent's streams never share a connection
            # with another library's channel to the same address.
            ("grpc.use_local_subchannel_pool", 1),
        ]


def open_channel(settings: ChannelSettings) -> grpc.Channel:
    """Open a plaintext channel (ClusterD has no TLS of its own; MindCluster adds nginx sidecars)."""
    return grpc.insecure_channel(settings.target, options=settings.options())


class ConnectivityWatch:
    """Tracks whether a channel is READY, with one subscription for the channel's lifetime.

    ``grpc.channel_ready_future`` per call would spawn a polling thread each time, and one
    spawned just before ``close()`` dies with "Channel closed!"; a single subscription made at
    start and removed before close avoids that.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._cond = threading.Condition()
        self._state: grpc.ChannelConnectivity | None = None
        self._closed = False
        # Subscribed on first use, not here: gRPC's polling thread, if it starts right before the
        # channel is closed (an agent stopped just after it started), dies with "Channel closed!".
        self._subscribed = False

    def _on_change(self, state: grpc.ChannelConnectivity) -> None:
        with self._cond:
            self._state = state
            self._cond.notify_all()

    @property
    def state(self) -> grpc.ChannelConnectivity | None:
        return self._state

    def wait_ready(self, timeout: float) -> bool:
        """True once the channel is READY; False if it is not within ``timeout``."""
        with self._cond:
            if not self._subscribed and not self._closed:
                self._subscribed = True
                self._channel.subscribe(self._on_change, try_to_connect=True)
            if self._state is grpc.ChannelConnectivity.IDLE and not self._closed:
                # Nothing else is dialing: ask for a connection (a fresh subscription does).
                self._channel.unsubscribe(self._on_change)
                self._channel.subscribe(self._on_change, try_to_connect=True)
            return self._cond.wait_for(
                lambda: self._closed or self._state is grpc.ChannelConnectivity.READY, timeout
            ) and not self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            subscribed = self._subscribed
            self._cond.notify_all()
        if subscribed:
            self._channel.unsubscribe(self._on_change)


class RecoverStub:
    """Multicallables for every Recover method, on the exact upstream paths.

    Channels and multicallables are thread-safe; one stub is shared by the agent's threads.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self._calls: dict[str, Any] = {}
        for method in METHODS:
            factory = channel.unary_stream if method.server_streaming else channel.unary_unary
            self._calls[method.name] = factory(
                method.path,
                request_serializer=method.request.SerializeToString,
                response_deserializer=method.response.FromString,
            )

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_calls"][name]
        except KeyError:
            raise AttributeError(name) from None


def generic_handler(
    handlers: dict[str, Callable[..., Any]],
) -> grpc.GenericRpcHandler:
    """Serve ``handlers`` (method name -> behaviour) on the exact ``/Recover/<Method>`` paths.

    Used by the simulator and by tests' scripted servers. Unknown names are a programming error.
    """
    unknown = set(handlers) - {m.name for m in METHODS}
    if unknown:
        raise ValueError(f"unknown Recover methods: {sorted(unknown)}")
    rpc_handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in METHODS:
        behaviour = handlers.get(method.name)
        if behaviour is None:
            continue
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else (
            grpc.unary_unary_rpc_method_handler
        )
        rpc_handlers[method.name] = make(
            behaviour,
            request_deserializer=method.request.FromString,
            response_serializer=method.response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE, rpc_handlers)


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
    "generic_handler",
    "open_channel",
)
