"""The Recover service as the wire sees it: method paths, kinds and message types, a client stub
and a server handler on exactly upstream's paths.

This is the wire contract, like the generated messages beside it, and the only code the client
(clusterd/) and the simulator (sim/) share: the simulator must behave like the real server, so it
shares no logic with the client, only what both must spell the same way on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
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


__all__ = ["METHODS", "SERVICE", "Method", "RecoverStub", "generic_handler"]
