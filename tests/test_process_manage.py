"""ProcessManageClient against scripted servers: registration codes, signal dispatch, the gate."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import support

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd import channel as transport
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.clusterd.process_manage import (
    ProcessManageClient,
    ProcessManageSettings,
    RegistrationRefused,
    StreamGate,
)

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


class EndingServer(Server):
    """Each subscribe takes the next script: "end" (a clean end at once), "keep-alive" (one, then a
    clean end), or a gRPC failure (code, details); with none left the stream is held open."""

    def __init__(self, scripts: list[Any]) -> None:
        super().__init__([], [])
        self.scripts = list(scripts)
        self.subscribes = threading.Semaphore(0)

    def _subscribe(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.ProcessManageSignal]:
        self.calls.append("Subscribe")
        self.subscribes.release()
        script = self.scripts.pop(0) if self.scripts else None
        if script == "keep-alive":
            yield pb.ProcessManageSignal(uuid="u", jobId="j", signalType="keep-alive")
        elif isinstance(script, tuple):
            context.abort(*script)
        elif script is None:
            while context.is_active() and not self.done.wait(0.05):
                pass


def make_client(server: Server, on_signal: Any, on_fatal: Any = None,
                reconnect_initial_s: float = 0.01) -> tuple[ProcessManageClient, Any]:
    channel = open_channel(ChannelSettings(target=server.address))
    settings = ProcessManageSettings(job_id="j", role="r", reconnect_initial_s=reconnect_initial_s,
                                     reconnect_max_s=max(5.0, reconnect_initial_s))
    client = ProcessManageClient(RecoverStub(channel), settings, on_signal, on_fatal=on_fatal)
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


def test_register_gives_up_after_three_rounds_of_408() -> None:
    server = Server(init_codes=[0, 0, 0], register_codes=[408, 408, 408])
    fatal: list[BaseException] = []
    got = threading.Event()
    client, channel = make_client(server, lambda s: None, on_fatal=lambda e: (fatal.append(e), got.set()))
    try:
        client.start()
        assert got.wait(10)
        assert server.calls == ["Init", "Register"] * 3
        assert isinstance(fatal[0], RegistrationRefused) and fatal[0].code == 408
        assert "still not inited after Init" in str(fatal[0])
        assert not client.registered
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


def test_a_stream_that_ends_at_once_is_not_reopened_at_once() -> None:
    server = EndingServer(["end"] * 20)
    client, channel = make_client(server, lambda s: None, reconnect_initial_s=60.0)
    try:
        client.start()
        assert server.subscribes.acquire(timeout=10)
        # Ended at once with no signal: the next subscribe waits 30-60 s (a server that ends every
        # stream at once is not hammered). Without the rule it would come within milliseconds.
        assert not server.subscribes.acquire(timeout=1.5), server.calls
    finally:
        assert client.stop()  # prompt in the middle of the wait
        channel.close()
        server.stop()


def test_a_stream_that_brought_a_signal_is_reopened_at_once() -> None:
    server = EndingServer(["keep-alive"])
    client, channel = make_client(server, lambda s: None, reconnect_initial_s=60.0)
    try:
        client.start()
        assert server.subscribes.acquire(timeout=10)
        assert server.subscribes.acquire(timeout=10), server.calls
    finally:
        client.stop()
        channel.close()
        server.stop()


@pytest.mark.parametrize(("failure", "again"), [
    ((grpc.StatusCode.UNKNOWN, "jobId=j not registed"), True),  # ClusterD restarted and forgot us
    ((grpc.StatusCode.UNAVAILABLE, "Socket closed"), True),  # it may have: it went away
    ((grpc.StatusCode.INTERNAL, "RST_STREAM"), False),  # a proxy cut the stream: still registered
    ((grpc.StatusCode.UNKNOWN, "qps exceeded"), False),
])
def test_registers_again_only_when_clusterd_forgot_the_job(failure: tuple[grpc.StatusCode, str], again: bool) -> None:
    server = EndingServer([failure])
    client, channel = make_client(server, lambda s: None)
    try:
        client.start()
        assert server.subscribes.acquire(timeout=10) and server.subscribes.acquire(timeout=10)
        twice = ["Init", "Register"] if again else []
        assert server.calls == ["Init", "Register", "Subscribe", *twice, "Subscribe"]
        assert client.errors == 1 and client.last_error_seen["error"] == f"{failure[0].name}: {failure[1]}"
    finally:
        client.stop()
        channel.close()
        server.stop()


class HeldHealthServer(Server):
    """HealthCheck is held until ``release`` is set, and records whether the gate was open while held."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.health_entered = threading.Event()
        super().__init__([], [])
        self.server.add_generic_rpc_handlers((transport.generic_handler({"HealthCheck": self._health}),))

    def _health(self, request: pb.ClientInfo, context: Any) -> pb.Status:
        self.calls.append("HealthCheck")
        self.health_entered.set()
        self.release.wait(10)
        return pb.Status(info="ok")


def test_the_gate_opens_only_once_a_healthcheck_after_the_subscribe_is_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The notify stream must not overtake the subscribe's reset: the gate waits for a round trip
    sent after the subscribe on the same connection (a fixed pause was overtaken under load)."""
    from nicswitch_agent.clusterd import process_manage

    monkeypatch.setattr(process_manage, "GATE_BARRIER_S", 30.0)  # only the answer opens the gate here
    server = HeldHealthServer()
    client, channel = make_client(server, lambda s: None)
    try:
        client.start()
        assert server.health_entered.wait(10) and server.stream_open.wait(10)
        # (the server may start the two handlers in either order: that is why the client waits)
        assert sorted(server.calls[-2:]) == ["HealthCheck", "Subscribe"]
        # The subscribe was sent and the barrier is held: a gate that opened on a timer would be
        # open after the barrier's settle, so give it that long (and more) to show itself.
        assert not client.gate.wait_open(10 * process_manage.GATE_SETTLE_S)
        server.release.set()
        assert client.gate.wait_open(10)
    finally:
        server.release.set()
        client.stop()
        channel.close()
        server.stop()


class _Call:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1


def test_the_gate_starts_nothing_while_closed_and_its_close_cancels_what_it_started() -> None:
    """StreamGate.start runs under the gate's lock: a closed gate starts no stream, and close()
    cancels the stream started under it before it returns (then forgets it)."""
    gate = StreamGate()
    started: list[_Call] = []

    def open_call() -> _Call:
        started.append(_Call())
        return started[-1]

    assert gate.start(open_call) is None and started == []
    gate.open()
    result = gate.start(open_call)
    assert result is not None and result == (started[0], 1)
    gate.close()
    assert started[0].cancels == 1 and gate.cancelled(started[0])
    assert gate.lost_with(started[0]) is None  # a clean end: nothing was lost
    gate.finish(started[0])
    assert not gate.cancelled(started[0])
    gate.open()
    gate.close()
    assert started[0].cancels == 1  # finished calls are not cancelled again
    gate.open()
    second = gate.start(open_call)
    assert second is not None
    gate.close("UNAVAILABLE: Socket closed")  # the process-manage stream failed: the connection went
    assert gate.cancelled(started[1]) and gate.lost_with(started[1]) == "UNAVAILABLE: Socket closed"
    assert gate.lost_with(started[0]) is None


class EndOnCueServer(Server):
    """The first signal stream is held until ``end`` is set, then fails with ``failure`` (None: ends
    cleanly, as a reset does); later ones are held open."""

    def __init__(self, failure: tuple[grpc.StatusCode, str] | None) -> None:
        super().__init__([], [])
        self.failure = failure
        self.end = threading.Event()
        self.first = True

    def _subscribe(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.ProcessManageSignal]:
        first, self.first = self.first, False
        if first:
            self.end.wait(10)
            if self.failure is not None:
                context.abort(*self.failure)
            return
        yield from super()._subscribe(request, context)


@pytest.mark.parametrize("failure", [(grpc.StatusCode.UNAVAILABLE, "Socket closed"), None])
def test_a_failed_stream_closes_the_gate_with_its_error_and_a_clean_end_without(
        failure: tuple[grpc.StatusCode, str] | None) -> None:
    """The notify stream the gate cancels was lost with the connection only when the process-manage
    stream failed: the gate's close carries the error then (the notify side counts it), not on a reset."""
    server = EndOnCueServer(failure)
    client, channel = make_client(server, lambda s: None)
    try:
        client.start()
        assert client.gate.wait_open(10)
        notify = _Call()
        assert client.gate.start(lambda: notify) is not None
        server.end.set()
        assert support.wait_until(lambda: notify.cancels == 1, 10)
        expected = None if failure is None else f"{failure[0].name}: {failure[1]}"
        assert client.gate.lost_with(notify) == expected
    finally:
        client.stop()
        channel.close()
        server.stop()

