"""Helpers for driving the simulator with plain grpcio clients, as the observed transcripts did.

Three roles, each on its own channel like separate processes: ``agent`` (the process-manage
client), ``worker`` (the SubscribeNotifySwitch subscriber) and ``om`` (the operator).
Synchronisation is on stream messages, stream ends and ``Simulator.wait_until``; never sleeps.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import pytest

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import RecoverStub
from nicswitch_agent.sim import SimJob, SimSettings, Simulator
from nicswitch_agent.sim import codes as P

JOB = "job-uid-0001"
NODES = {"node-0": ["0", "1"], "node-1": ["0", "1"]}
# The request of every observed run: node-1's devices 0,1 are global ranks 2,3.
NIC_OPS = {"node-1": (["0", "1"], [True, False])}

FAST = {
    "report_timeout_s": 10.0,
    "keepalive_interval_s": 60.0,
    "enqueue_timeout_s": 1.0,
    "fault_flush_s": 0.01,
    "force_release_s": 0.02,
    "schedule_wait_s": 0.02,
    "restart_wait_s": 0.03,
    "shuffle_nodes": False,
}

OK = grpc.StatusCode.OK
UNKNOWN = grpc.StatusCode.UNKNOWN
WAIT = 5.0

_END = object()


class StreamReader:
    """Reads a server stream on a thread: messages, then how it ended, through one queue."""

    def __init__(self, call: Any, name: str) -> None:
        self.call = call
        self.name = name
        self._queue: queue.Queue[Any] = queue.Queue()
        self.end: tuple[grpc.StatusCode, str] | None = None
        self._thread = threading.Thread(target=self._run, name=f"reader-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self.call:
                self._queue.put(message)
            self._queue.put((_END, OK, ""))
        except grpc.RpcError as exc:
            self._queue.put((_END, exc.code(), exc.details() or ""))

    def _next(self, timeout: float) -> Any:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: nothing within {timeout} s") from None
        if isinstance(item, tuple) and item and item[0] is _END:
            self.end = (item[1], item[2])
            self._queue.put(item)  # stay ended for later calls
        return item

    def get(self, timeout: float = WAIT, skip_keepalive: bool = True) -> Any:
        """The next message; fails if the stream ends first."""
        while True:
            item = self._next(timeout)
            if isinstance(item, tuple) and item and item[0] is _END:
                raise AssertionError(f"{self.name}: stream ended {item[1]} {item[2]!r} instead of a message")
            if skip_keepalive and isinstance(item, pb.ProcessManageSignal) and item.signalType == P.KEEP_ALIVE:
                continue
            return item

    def wait_end(self, timeout: float = WAIT, skip_keepalive: bool = True) -> tuple[grpc.StatusCode, str]:
        """How the stream ended; fails on any (non keep-alive) message before the end."""
        while True:
            item = self._next(timeout)
            if isinstance(item, tuple) and item and item[0] is _END:
                return item[1], item[2]
            if skip_keepalive and isinstance(item, pb.ProcessManageSignal) and item.signalType == P.KEEP_ALIVE:
                continue
            raise AssertionError(f"{self.name}: got {item!r} instead of the end of the stream")

    def assert_quiet(self, timeout: float) -> None:
        """No message and no end within ``timeout`` (a bounded wait on the stream itself)."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        raise AssertionError(f"{self.name}: expected silence, got {item!r}")

    def cancel(self) -> tuple[grpc.StatusCode, str]:
        self.call.cancel()
        self._thread.join(WAIT)
        while True:
            item = self._queue.get(timeout=WAIT)
            if isinstance(item, tuple) and item and item[0] is _END:
                return item[1], item[2]


class Client:
    """One role's channel and stub, with the calls the transcripts make."""

    def __init__(self, address: str, job_id: str = JOB, role: str = "agent") -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = RecoverStub(self.channel)
        self.job_id = job_id
        self.role = role
        self.readers: list[StreamReader] = []

    def info(self) -> pb.ClientInfo:
        return pb.ClientInfo(jobId=self.job_id, role=self.role)

    # registration
    def init(self) -> pb.Status:
        return self.stub.Init(self.info(), timeout=WAIT)

    def register(self) -> pb.Status:
        return self.stub.Register(self.info(), timeout=WAIT)

    # streams
    def _reader(self, call: Any, name: str) -> StreamReader:
        reader = StreamReader(call, name)
        self.readers.append(reader)
        return reader

    def subscribe_process_manage(self) -> StreamReader:
        return self._reader(self.stub.SubscribeProcessManageSignal(self.info()), f"{self.role}/pm")

    def subscribe_notify(self) -> StreamReader:
        return self._reader(self.stub.SubscribeNotifySwitch(self.info()), f"{self.role}/notify")

    def subscribe_result(self) -> StreamReader:
        return self._reader(
            self.stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=self.job_id)), f"{self.role}/om"
        )

    # unary
    def track(self, nic_ops: Mapping[str, tuple[Sequence[str], Sequence[bool]]] = NIC_OPS) -> pb.Status:
        request = pb.SwitchNics(jobID=self.job_id)
        for node, (devs, ops) in nic_ops.items():
            request.nicOps[node].dev.extend(devs)
            request.nicOps[node].op.extend(ops)
        return self.stub.SwitchNicTrack(request, timeout=WAIT)

    def reply(self, result: bool, timeout: float = WAIT) -> pb.Status:
        return self.stub.ReplySwitchNicResult(pb.SwitchResult(jobId=self.job_id, result=result), timeout=timeout)

    def stop_complete(self, code: int = 0) -> pb.Status:
        request = pb.StopCompleteRequest(jobId=self.job_id, status=pb.Status(code=code))
        return self.stub.ReportStopComplete(request, timeout=WAIT)

    def recover_status(self, code: int = 0, strategy: str = "continue") -> pb.Status:
        request = pb.RecoverStatusRequest(jobId=self.job_id, status=pb.Status(code=code), strategy=strategy)
        return self.stub.ReportRecoverStatus(request, timeout=WAIT)

    def recover_strategy(self, strategies: Sequence[str]) -> pb.Status:
        request = pb.RecoverStrategyRequest(jobId=self.job_id, strategies=list(strategies))
        return self.stub.ReportRecoverStrategy(request, timeout=WAIT)

    def close(self) -> None:
        for reader in self.readers:
            reader.call.cancel()
        self.channel.close()


def received(job: str, uuid: str, method: str) -> str:
    return f"jobId={job}, uuid={uuid}, receive {method}"


def streams(sim: Simulator, method: str, job: str = JOB) -> int:
    return sim.job_view(job).open_streams[method]


def wait_streams(sim: Simulator, method: str, count: int, job: str = JOB) -> None:
    assert sim.wait_until(lambda s: streams(s, method, job) == count, WAIT), (
        f"{method}: {streams(sim, method, job)} open, expected {count}"
    )


def wait_state(sim: Simulator, state: str, job: str = JOB) -> None:
    assert sim.wait_until(lambda s: s.job_view(job).state == state, WAIT), (
        f"state {sim.job_view(job).state}, expected {state}"
    )


class Setup:
    """A running simulator plus the three roles of the observed runs."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.agent = Client(sim.address, role="agent")
        self.worker = Client(sim.address, role="worker")
        self.om = Client(sim.address, role="om")
        self.others: list[Client] = []

    def client(self, role: str) -> Client:
        """One more client on its own channel (closed with the others)."""
        client = Client(self.sim.address, role=role)
        self.others.append(client)
        return client

    def view(self, job: str = JOB) -> Any:
        return self.sim.job_view(job)

    def register_agent(self) -> StreamReader:
        """Init, Register, SubscribeProcessManageSignal (and wait until the server took it)."""
        assert self.agent.init().code == 0
        assert self.agent.register().code == 0
        reader = self.agent.subscribe_process_manage()
        wait_streams(self.sim, P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, 1)
        return reader

    def subscribe_worker(self, client: Client | None = None) -> StreamReader:
        before = streams(self.sim, P.SUBSCRIBE_NOTIFY_SWITCH)
        reader = (client or self.worker).subscribe_notify()
        wait_streams(self.sim, P.SUBSCRIBE_NOTIFY_SWITCH, before + 1)
        return reader

    def start_switch(self, nic_ops: Mapping[str, tuple[Sequence[str], Sequence[bool]]] = NIC_OPS) -> StreamReader:
        """SwitchNicTrack, then the result stream, waited for until the server has taken it: the
        call goes out on gRPC's thread, and under load it reached the simulator after the test had
        driven the whole switch ("not swtiching nic")."""
        status = self.om.track(nic_ops)
        assert (status.code, status.info) == (0, P.DISTRIBUTED)
        before = self.view().stream_opens[P.SUBSCRIBE_SWITCH_NIC_SIGNAL]
        reader = self.om.subscribe_result()
        assert self.sim.wait_until(lambda s: s.job_view(JOB).stream_opens[P.SUBSCRIBE_SWITCH_NIC_SIGNAL] > before,
                                   WAIT), "the result stream never reached the simulator"
        return reader

    def ready(self) -> tuple[StreamReader, StreamReader]:
        """Agent subscribed first, then the worker: the order a correct client uses."""
        agent = self.register_agent()
        worker = self.subscribe_worker()
        return agent, worker

    def close(self) -> None:
        for client in (self.agent, self.worker, self.om, *self.others):
            client.close()


@pytest.fixture
def make_sim() -> Iterator[Callable[..., Simulator]]:
    sims: list[Simulator] = []

    def make(jobs: Sequence[SimJob] | None = None, standin: bool = False, **overrides: Any) -> Simulator:
        settings = SimSettings(**{**FAST, **overrides})
        sim = Simulator(jobs=jobs if jobs is not None else [SimJob(JOB, NODES)], settings=settings, standin=standin)
        sims.append(sim)
        sim.start()
        return sim

    yield make
    for sim in sims:
        sim.stop()


@pytest.fixture
def make_setup(make_sim: Callable[..., Simulator]) -> Iterator[Callable[..., Setup]]:
    setups: list[Setup] = []

    def make(**kwargs: Any) -> Setup:
        setup = Setup(make_sim(**kwargs))
        setups.append(setup)
        return setup

    yield make
    for setup in setups:
        setup.close()
