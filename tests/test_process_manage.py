"""ProcessManageClient against scripted servers: registration codes, signal dispatch, the gate."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from nicswitch_agent import transport
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.process_manage import ProcessManageClient, ProcessManageSettings, RegistrationRefused
from nicswitch_agent.transport import ChannelSettings, RecoverStub, open_channel

pytestmark = pytest.mark.timeout(20)


class Server:
    """Init/Register answer from scripts; the signal stream sends a script then holds."""

    def __init__(self, init_codes: list[int], register_codes: list[int],
                 signals: list[pb.ProcessManageSignal] | None = None) -> None:
        self.init_codes, self.register_codes = list(init_codes), list(register_codes)
        self.calls: list[str] = []
        self.signals = list(signals or [])
        self.stream_open = threading.Event()
        self.done = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        self.server.add_generic_rpc_handlers((transport.generic_handler({
            "Init": self._init, "Register": self._register, "SubscribeProcessManageSignal": self._subscribe,
        }),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _init(self, request: pb.ClientInfo, context: Any) -> pb.Status:
        self.calls.append("Init")
        return pb.Status(code=self.init_codes.pop(0) if self.init_codes else 0, info="init")

    def _register(self, request: pb.ClientInfo, context: Any) -> pb.Status:
        self.calls.append("Register")
        code = self.register_codes.pop(0) if self.register_codes else 0
        return pb.Status(code=code, info="jobId=j not inited" if code == 408 else "register")

    def _subscribe(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.ProcessManageSignal]:
        self.calls.append("Subscribe")
        self.stream_open.set()
        yield from self.signals
        while context.is_active() and not self.done.wait(0.05):
            pass

    def stop(self) -> None:
        self.done.set()
        self.server.stop(0).wait()


def make_client(server: Server, on_signal: Any, on_fatal: Any = None) -> tuple[ProcessManageClient, Any]:
    channel = open_channel(ChannelSettings(target=server.address))
    client = ProcessManageClient(RecoverStub(channel), ProcessManageSettings(job_id="j", role="r",
                                                                            reconnect_initial_s=0.01),
                                 on_signal, on_fatal=on_fatal)
    return client, channel


def test_408_is_answered_by_init_again() -> None:
    server = Server(init_codes=[0, 0], register_codes=[408, 0])
    client, channel = make_client(server, lambda s: None)
    try:
        client.start()
        assert server.stream_open.wait(10)
        assert server.calls[:5] == ["Init", "Register", "Init", "Register", "Subscribe"]
        assert client.registered
        assert client.gate.wait_open(5)
    finally:
        client.stop()
        channel.close()
        server.stop()


@pytest.mark.parametrize(("init", "register", "needle"), [
    ([403], [], "ClusterD refused Init: code 403"),
    ([0], [402], "ClusterD refused Register: code 402"),
    ([0], [500], "maximum number of jobs"),
])
def test_other_codes_are_fatal_with_a_clear_message(init: list[int], register: list[int], needle: str) -> None:
    server = Server(init_codes=init, register_codes=register)
    fatal: list[BaseException] = []
    got = threading.Event()
    client, channel = make_client(server, lambda s: None, on_fatal=lambda e: (fatal.append(e), got.set()))
    try:
        client.start()
        assert got.wait(10)
        assert isinstance(fatal[0], RegistrationRefused) and needle in str(fatal[0])
        assert "Subscribe" not in server.calls
        assert not client.gate.is_set()
    finally:
        client.stop()
        channel.close()
        server.stop()


def test_signals_for_this_job_reach_the_handler_keepalives_and_foreign_jobs_do_not() -> None:
    signals = [
        pb.ProcessManageSignal(uuid="u", jobId="j", signalType="keep-alive"),
        pb.ProcessManageSignal(uuid="u", jobId="other", signalType="stopTrain", actions=["pause_train"]),
        pb.ProcessManageSignal(uuid="u", jobId="j", signalType="stopTrain", actions=["pause_train"]),
    ]
    server = Server([], [], signals)
    seen: list[pb.ProcessManageSignal] = []
    got = threading.Event()
    client, channel = make_client(server, lambda s: (seen.append(s), got.set()))
    try:
        client.start()
        assert got.wait(10)
        assert [(s.jobId, s.signalType) for s in seen] == [("j", "stopTrain")]
        assert client.last_keepalive_mono is not None
    finally:
        client.stop()
        channel.close()
        server.stop()
