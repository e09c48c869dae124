"""Servers the benchmarks time against: a scripted notify server, and a stamped simulator.

Both stamp ``time.monotonic()`` at the exact points the benchmarks measure from (just before a
stream message is yielded, on entry of a unary handler). ``time.monotonic`` is CLOCK_MONOTONIC on
Linux, shared by every process on the machine, and it is the clock of ``AgentEvent.mono``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Generator, Iterator
from concurrent import futures
from typing import Any, cast

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd import channel as transport
from nicswitch_agent.sim import Simulator
from nicswitch_agent.sim import codes as P

END = None  # a command: end the current stream cleanly (status OK), as ClusterD does after a switch


class NotifyServer:
    """SubscribeNotifySwitch driven by commands, ReplySwitchNicResult and HealthCheck; all stamped.

    ``send(message)`` makes the open stream yield ``message``; ``end()`` makes it return (a clean end).
    Used both for the agent and, on a second instance, for the bare grpcio floor.
    """

    def __init__(self) -> None:
        self._commands: queue.Queue[pb.SwitchRankList | None] = queue.Queue()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self.opened: list[float] = []  # handler entry of each SubscribeNotifySwitch
        self.sent: list[float] = []  # just before each yield
        self.ended: list[float] = []  # just before each clean return
        self.replies: list[tuple[float, bool]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="bench-notify"))
        self._server.add_generic_rpc_handlers((transport.generic_handler({
            "SubscribeNotifySwitch": self._subscribe,
            "ReplySwitchNicResult": self._reply,
            "HealthCheck": self._health,
        }),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"

    def start(self) -> NotifyServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._server.stop(grace=0).wait(5)

    def send(self, message: pb.SwitchRankList) -> None:
        self._commands.put(message)

    def end(self) -> None:
        self._commands.put(END)

    def wait_opened(self, count: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.opened) >= count, timeout)

    def wait_replies(self, count: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.replies) >= count, timeout)

    def _subscribe(self, request: pb.ClientInfo, context: grpc.ServicerContext) -> Iterator[pb.SwitchRankList]:
        with self._cond:
            self.opened.append(time.monotonic())
            self._cond.notify_all()
        while context.is_active() and not self._stopping.is_set():
            try:
                item = self._commands.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is END:
                self.ended.append(time.monotonic())
                return
            self.sent.append(time.monotonic())
            yield item

    def _reply(self, request: pb.SwitchResult, context: grpc.ServicerContext) -> pb.Status:
        with self._cond:
            self.replies.append((time.monotonic(), bool(request.result)))
            self._cond.notify_all()
        return pb.Status(code=0, info="reply success")

    def _health(self, request: pb.ClientInfo, context: grpc.ServicerContext) -> pb.Status:
        return pb.Status(code=0, info="ok")


class FloorClient:
    """The floor: a plain grpcio channel reading one server stream and making unary calls."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = transport.RecoverStub(self.channel)
        self.received: list[float] = []
        self._cond = threading.Condition()
        self._call: Any = self.stub.SubscribeNotifySwitch(pb.ClientInfo(jobId="floor", role="floor"),
                                                          wait_for_ready=True)
        self._thread = threading.Thread(target=self._read, name="bench-floor-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for _message in self._call:
                with self._cond:
                    self.received.append(time.monotonic())
                    self._cond.notify_all()
        except grpc.RpcError:
            pass

    def wait_received(self, count: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.received) >= count, timeout)

    def unary(self) -> float:
        """One HealthCheck round trip, seconds."""
        started = time.monotonic()
        self.stub.HealthCheck(pb.ClientInfo(jobId="floor", role="floor"), timeout=5)
        return time.monotonic() - started

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(2)
        self.channel.close()


class FloorResubscriber:
    """The resubscribe floor: a plain grpcio client that reopens the stream the moment it ends."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = transport.RecoverStub(self.channel)
        self._stop = threading.Event()
        self._call: Any = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-floor-resubscribe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = pb.ClientInfo(jobId="floor", role="floor")
        while not self._stop.is_set():
            call = self.stub.SubscribeNotifySwitch(request, wait_for_ready=True)
            with self._lock:
                self._call = call
            try:
                for _message in call:
                    pass
            except grpc.RpcError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(2)
        self.channel.close()


class FloorLeader:
    """The idle floor: bare grpcio holding a leader's two streams, as a plain client would write it.

    Init, Register, then ``SubscribeProcessManageSignal`` and ``SubscribeNotifySwitch`` each read by
    ``for message in call`` on a thread of its own, on one channel with the agent's options
    (keep-alive, reconnect backoff, message sizes: :meth:`ChannelSettings.options`). The notify
    stream is reopened after 0.2 s if ClusterD refuses it (the job is not registered yet) or ends it.
    No connectivity subscription, no timers: what grpcio itself costs for the same connection.
    """

    def __init__(self, address: str, job_id: str) -> None:
        self.channel = grpc.insecure_channel(address, options=transport.ChannelSettings(target=address).options())
        self.stub = transport.RecoverStub(self.channel)
        self._info = pb.ClientInfo(jobId=job_id, role="floor")
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _calls
        self._calls: dict[str, Any] = {}
        self.signals = 0
        self.opens = {"SubscribeProcessManageSignal": 0, "SubscribeNotifySwitch": 0}
        for method, name in (("Init", "init"), ("Register", "register")):
            status = getattr(self.stub, method)(self._info, timeout=10, wait_for_ready=True)
            if status.code != P.OK:
                raise RuntimeError(f"floor {name}: {status.code} {status.info!r}")
        self._threads = [
            threading.Thread(target=self._hold, args=(method,), name=f"floor-{method}", daemon=True)
            for method in self.opens
        ]
        for thread in self._threads:
            thread.start()

    def _hold(self, method: str) -> None:
        while not self._stop.is_set():
            call = getattr(self.stub, method)(self._info, wait_for_ready=True)
            with self._lock:
                self._calls[method] = call
                self.opens[method] += 1
            try:
                for _message in call:
                    self.signals += 1
            except grpc.RpcError:
                pass
            with self._lock:
                self._calls.pop(method, None)
            self._stop.wait(0.2)

    def streams_open(self) -> bool:
        """Both streams are in flight (neither ended)."""
        with self._lock:
            calls = list(self._calls.values())
        return len(calls) == 2 and not any(call.done() for call in calls)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        for thread in self._threads:
            thread.join(2)
        self.channel.close()


class StampedSimulator(Simulator):
    """The ClusterD simulator, unchanged, with a monotonic stamp at every point a switch passes.

    Stamps (lists, in order): ``accept`` (SwitchNicTrack answered 0), ``pause_sent`` /
    ``continue_sent`` / ``signal:<type>`` (just before a process-manage signal is yielded; keep-alives
    are not stamped), ``list_sent`` (just before a rank list is yielded), ``stop_complete``, ``reply``,
    ``status`` (entry of ReportStopComplete, ReplySwitchNicResult, ReportRecoverStatus),
    ``pm_open`` and ``notify_open`` (a stream handler starts).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stamps: dict[str, list[float]] = defaultdict(list)

    def __enter__(self) -> StampedSimulator:
        self.start()
        return self

    def _stamp(self, name: str) -> None:
        self.stamps[name].append(time.monotonic())

    def counts(self) -> dict[str, int]:
        return {name: len(values) for name, values in list(self.stamps.items())}

    def _switch_nic_track(self, request: pb.SwitchNics, context: Any) -> pb.Status:
        status = super()._switch_nic_track(request, context)
        if status.code == 0:
            self._stamp("accept")
        return status

    def _report_stop_complete(self, request: pb.StopCompleteRequest, context: Any) -> pb.Status:
        self._stamp("stop_complete")
        return super()._report_stop_complete(request, context)

    def _reply_switch_nic_result(self, request: pb.SwitchResult, context: Any) -> pb.Status:
        self._stamp("reply")
        return super()._reply_switch_nic_result(request, context)

    def _report_recover_status(self, request: pb.RecoverStatusRequest, context: Any) -> pb.Status:
        self._stamp("status")
        return super()._report_recover_status(request, context)

    def _subscribe_process_manage(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.ProcessManageSignal]:
        self._stamp("pm_open")
        inner = cast(Generator[pb.ProcessManageSignal, None, None],
                     super()._subscribe_process_manage(request, context))
        try:
            for signal in inner:
                if signal.signalType == P.STOP_TRAIN and P.PAUSE_TRAIN_ACTION in signal.actions:
                    self._stamp("pause_sent")
                elif signal.signalType == P.CHANGE_STRATEGY and signal.changeStrategy == P.CONTINUE:
                    self._stamp("continue_sent")
                elif signal.signalType != P.KEEP_ALIVE:
                    self._stamp(f"signal:{signal.signalType}")
                yield signal
        finally:
            inner.close()

    def _subscribe_notify_switch(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.SwitchRankList]:
        self._stamp("notify_open")
        inner = cast(Generator[pb.SwitchRankList, None, None], super()._subscribe_notify_switch(request, context))
        try:
            for rank_list in inner:
                self._stamp("list_sent")
                yield rank_list
        finally:
            inner.close()
