"""Our hand-written client against a server built from upstream's *generated* servicer.

The server is ``recover_pb2_grpc.add_RecoverServicer_to_server`` from tests/interop/upstream (a
package-less copy of ClusterD's recover.proto), so its method paths are exactly what protoc makes
for upstream. Our client (``transport.RecoverStub``, packaged messages) must reach every method.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd import channel as transport

pytestmark = pytest.mark.timeout(30)

UPSTREAM_DIR = Path(__file__).resolve().parent / "interop/upstream"
NOT_IMPLEMENTED = "Method not implemented!"  # what the generated servicer base answers
OVERRIDDEN = {"HealthCheck", "SubscribeNotifySwitch", "ReplySwitchNicResult"}
JOB = "3f2a-uid"


def _import_upstream() -> tuple[ModuleType, ModuleType]:
    sys.path.insert(0, str(UPSTREAM_DIR))
    try:
        messages = importlib.import_module("recover_pb2")
        services = importlib.import_module("recover_pb2_grpc")
    finally:
        sys.path.remove(str(UPSTREAM_DIR))
    assert Path(messages.__file__ or "").resolve().parent == UPSTREAM_DIR
    assert Path(services.__file__ or "").resolve().parent == UPSTREAM_DIR
    return messages, services


upstream_pb, upstream_grpc = _import_upstream()


class UpstreamClusterD(upstream_grpc.RecoverServicer):  # type: ignore[name-defined,misc]
    """Generated servicer with three methods filled in; every other method is the generated base.

    Each SubscribeNotifySwitch takes the next list from ``lists``, sends it and returns (a clean
    end, as ClusterD does after a switch); with no list left, the stream stays open until the
    client cancels or the server stops.
    """

    def __init__(self) -> None:
        self.lists: deque[Any] = deque()
        self.replies: list[Any] = []
        self.health: list[Any] = []
        self.subscribes: list[Any] = []
        self.cond = threading.Condition()

    def HealthCheck(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.cond:
            self.health.append(request)
            self.cond.notify_all()
        return upstream_pb.Status(code=0, info=f"jobId={request.jobId}, receive HeathCheck")

    def SubscribeNotifySwitch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with self.cond:
            self.subscribes.append(request)
            message = self.lists.popleft() if self.lists else None
            self.cond.notify_all()
        if message is not None:
            yield message
            return
        ended = threading.Event()
        if context.add_callback(ended.set):  # fires on client cancel or server stop
            ended.wait(25)

    def ReplySwitchNicResult(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.cond:
            self.replies.append(request)
            self.cond.notify_all()
        return upstream_pb.Status(code=0, info="reply success")

    def wait(self, predicate: Any, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "timed out waiting for the client"


@pytest.fixture
def servicer() -> UpstreamClusterD:
    return UpstreamClusterD()


@pytest.fixture
def address(servicer: UpstreamClusterD) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="upstream"))
    upstream_grpc.add_RecoverServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=0).wait(5)


@pytest.fixture
def channel(address: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(address) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.Channel) -> transport.RecoverStub:
    return transport.RecoverStub(channel)


# -- method table ------------------------------------------------------------------------------


def test_methods_are_upstreams_methods() -> None:
    service = upstream_pb.DESCRIPTOR.services_by_name["Recover"]
    assert service.full_name == "Recover"
    assert {m.name for m in transport.METHODS} == {m.name for m in service.methods}
    assert len(transport.METHODS) == len(service.methods)


@pytest.mark.parametrize("method", transport.METHODS, ids=lambda m: m.name)
def test_method_path_and_types(method: transport.Method) -> None:
    assert method.path == f"/Recover/{method.name}"
    upstream_method = upstream_pb.DESCRIPTOR.services_by_name["Recover"].methods_by_name[method.name]
    assert method.request.DESCRIPTOR.name == upstream_method.input_type.name
    assert method.response.DESCRIPTOR.name == upstream_method.output_type.name
    assert method.server_streaming == upstream_method.server_streaming
    assert not upstream_method.client_streaming
    # and the generated upstream stub calls the very same path
    assert callable(getattr(upstream_grpc.RecoverServicer, method.name))


# -- every method reaches the servicer ---------------------------------------------------------


def _call(stub: transport.RecoverStub, method: transport.Method) -> Any:
    call = getattr(stub, method.name)
    if method.server_streaming:
        return list(call(method.request(), timeout=5))
    return call(method.request(), timeout=5)


@pytest.mark.parametrize(
    "method", [m for m in transport.METHODS if m.name not in OVERRIDDEN], ids=lambda m: m.name
)
def test_not_overridden_methods_reach_the_generated_base(stub: transport.RecoverStub, method: transport.Method) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _call(stub, method)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    # The servicer's own answer, so the path exists; a missing path says "Method not found!".
    assert info.value.details() == NOT_IMPLEMENTED


def test_a_missing_path_is_told_apart(channel: grpc.Channel) -> None:
    # What a packaged generated stub would call: the server has no such method.
    wrong = channel.unary_unary(
        "/nicswitch_agent.v1.Recover/HealthCheck",
        request_serializer=pb.ClientInfo.SerializeToString,
        response_deserializer=pb.Status.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        wrong(pb.ClientInfo(jobId=JOB), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert info.value.details() != NOT_IMPLEMENTED


def test_health_check(stub: transport.RecoverStub, servicer: UpstreamClusterD) -> None:
    status = stub.HealthCheck(pb.ClientInfo(jobId=JOB, role="nicswitch-agent"), timeout=5)
    assert isinstance(status, pb.Status)
    assert transport.status_code(status) == 0
    assert status.info == f"jobId={JOB}, receive HeathCheck"
    assert [(r.jobId, r.role) for r in servicer.health] == [(JOB, "nicswitch-agent")]


def test_subscribe_notify_switch_stream(stub: transport.RecoverStub, servicer: UpstreamClusterD) -> None:
    servicer.lists.append(upstream_pb.SwitchRankList(rankID=["16", "0", "31"], op=[True, False, True], jobId=JOB))
    received = list(stub.SubscribeNotifySwitch(pb.ClientInfo(jobId=JOB, role="taskd"), timeout=5))
    assert len(received) == 1
    (got,) = received
    assert isinstance(got, pb.SwitchRankList)
    assert (list(got.rankID), list(got.op), got.jobId) == (["16", "0", "31"], [True, False, True], JOB)
    assert [(r.jobId, r.role) for r in servicer.subscribes] == [(JOB, "taskd")]


def test_reply_switch_nic_result(stub: transport.RecoverStub, servicer: UpstreamClusterD) -> None:
    status = stub.ReplySwitchNicResult(pb.SwitchResult(jobId=JOB, result=True), timeout=5)
    assert (status.code, status.info) == (0, "reply success")
    status = stub.ReplySwitchNicResult(pb.SwitchResult(jobId=JOB, result=False), timeout=5)
    assert [(r.jobId, r.result) for r in servicer.replies] == [(JOB, True), (JOB, False)]
    assert all(isinstance(r, upstream_pb.SwitchResult) for r in servicer.replies)


def test_stub_through_agent_channel_settings(address: str, servicer: UpstreamClusterD) -> None:
    # The channel options the agent uses are accepted by a stock server.
    ch = transport.open_channel(transport.ChannelSettings(target=address))
    try:
        status = transport.RecoverStub(ch).HealthCheck(pb.ClientInfo(jobId=JOB), timeout=5)
    finally:
        ch.close()
    assert status.info == f"jobId={JOB}, receive HeathCheck"


def test_unknown_stub_attribute(stub: transport.RecoverStub) -> None:
    with pytest.raises(AttributeError):
        _ = stub.NoSuchMethod


# -- the whole agent against the upstream-generated server ---------------------------------------


class Hook:
    def __init__(self) -> None:
        self.orders: list[SwitchOrder] = []
        self.called = threading.Event()

    def __call__(self, order: SwitchOrder) -> bool:
        self.orders.append(order)
        self.called.set()
        return True


def test_agent_switches_and_replies_once(
    address: str, servicer: UpstreamClusterD, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: a job of rank 0 alone
    servicer.lists.append(upstream_pb.SwitchRankList(rankID=["0"], op=[False], jobId=JOB))
    hook = Hook()
    agent = SwitchAgent(server=address, job_id=JOB, switch_hook=hook, pause="external")
    try:
        agent.start()
        servicer.wait(lambda: len(servicer.replies) >= 1)
        # The stream ended after the list; the agent resubscribes and waits for the next one.
        servicer.wait(lambda: len(servicer.subscribes) >= 2)
    finally:
        agent.stop("test done")
    assert hook.called.is_set()
    assert len(hook.orders) == 1
    (order,) = hook.orders
    assert (order.ranks, order.ops, order.job_id) == ((0,), (False,), JOB)
    assert [(r.jobId, r.result) for r in servicer.replies] == [(JOB, True)]
    assert all(r.jobId == JOB for r in servicer.subscribes)
    status = agent.status()
    assert status["state"] == "stopped"
    assert status["counters"]["replies_delivered"] == 1
    assert status["counters"]["switches_ok"] == 1
