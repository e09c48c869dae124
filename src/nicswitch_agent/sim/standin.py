"""A stand-in for MindIO/TaskD's process-manage client: the half of the protocol the agent
does not own in "pause mode external".

It is a real gRPC client in its own thread and does exactly what an external MindIO does
(docs/clusterd.md#upstreams-job-side-taskd-and-mindio, docs/clusterd.md#process-manage-signals): Init, Register,
SubscribeProcessManageSignal (reopened after every clean end, as the upstream client does),
and answers

* ``stopTrain``/``pause_train`` with ``ReportStopComplete(0)`` (499 with ``fail_pause``),
* ``changeStrategy``/``continue`` with ``ReportRecoverStatus(0, "continue")``,
* ``stopTrain``/``stop_train`` with ``ReportStopComplete(0)``,
* ``globalFault`` with ``ReportRecoverStrategy(["exit"])``,
* ``changeStrategy`` retry/recover/dump (never picked for an ``exit``-only offer) by echoing
  the name in ``ReportRecoverStatus(0, name)``,

and nothing else (``exit``, ``dump_exit``, ``killMaster`` and keep-alives need no answer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent._pb.service import RecoverStub
from nicswitch_agent.sim import codes as P

logger = logging.getLogger("nicswitch_agent.sim")

__all__ = ["MindIOStandIn"]

_CALL_TIMEOUT_S = 5.0
_BACKOFF_INITIAL_S = 0.05
_BACKOFF_MAX_S = 1.0


def _backoff() -> Iterator[float]:
    """0.05 s doubling to 1 s, without jitter: one client against a test server, and the
    simulator shares no logic with the client it tests (so not nicswitch_agent.clusterd.rpc_policy's)."""
    delay = _BACKOFF_INITIAL_S
    while True:
        yield delay
        delay = min(delay * 2, _BACKOFF_MAX_S)


class MindIOStandIn:
    """Play MindIO/TaskD's process-manage client for one job.

    Args:
        address: ClusterD (or simulator) ``host:port``.
        job_id: the job to register and subscribe for.
        pause_delay_s: wait before acknowledging ``pause_train`` (MindIO pauses at a step end).
        continue_delay_s: wait before reporting ``continue`` done.
        fail_pause: acknowledge ``pause_train`` with 499 (ClusterD then kills the job).
        role: ``ClientInfo.role`` (only logged by ClusterD).
        register_delay_s: wait before the first Init/Register. TaskD notices a restarted ClusterD by
            its 1 s health check and sleeps 10 s before registering again (docs/clusterd.md#timings);
            a stand-in started with a restarted simulator models that with this delay.

    ``ready`` is set once the first process-manage stream is open (the simulator sends headers
    right after the subscribe's reset; against a real ClusterD, with the first signal).
    """

    def __init__(
        self,
        address: str,
        job_id: str,
        pause_delay_s: float = 0.0,
        continue_delay_s: float = 0.0,
        fail_pause: bool = False,
        role: str = "mindio-standin",
        register_delay_s: float = 0.0,
    ) -> None:
        self.address = address
        self.job_id = job_id
        self.pause_delay_s = pause_delay_s
        self.continue_delay_s = continue_delay_s
        self.fail_pause = fail_pause
        self.role = role
        self.register_delay_s = register_delay_s
        self.ready = threading.Event()
        self._stop = threading.Event()
        # Guards _call, _started, _signals and _streams_opened.
        self._lock = threading.Lock()
        self._call: Any = None
        self._started = False
        self._signals: list[pb.ProcessManageSignal] = []
        self._streams_opened = 0
        self._channel: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> MindIOStandIn:
        """Start the client thread (once)."""
        with self._lock:
            if self._started:
                raise RuntimeError("MindIOStandIn already started")
            self._started = True
        self._channel = grpc.insecure_channel(self.address, options=[  # reconnect fast, as MindIO's client does
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 5000)])
        self._thread = threading.Thread(target=self._run, name=f"nicswitch-sim-standin-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel the stream, join the thread (bounded), close the channel. Idempotent."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("MindIO stand-in for %s did not stop within %.1f s", self.job_id, timeout)
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> MindIOStandIn:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def signals(self) -> list[pb.ProcessManageSignal]:
        """Every signal received so far except keep-alives, in order."""
        with self._lock:
            return list(self._signals)

    @property
    def streams_opened(self) -> int:
        with self._lock:
            return self._streams_opened

    # ------------------------------------------------------------------ the client loop

    def _run(self) -> None:
        stub = RecoverStub(self._channel)
        info = pb.ClientInfo(jobId=self.job_id, role=self.role)
        registered = False
        delays = _backoff()
        if self.register_delay_s > 0 and self._stop.wait(self.register_delay_s):
            return
        while not self._stop.is_set():
            try:
                if not registered:
                    registered = self._register(stub, info)
                    if not registered:
                        self._stop.wait(next(delays))
                        continue
                call = stub.SubscribeProcessManageSignal(info, wait_for_ready=True)
                with self._lock:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                    break
                call.initial_metadata()
                if not call.done():
                    with self._lock:
                        self._streams_opened += 1
                    self.ready.set()
                for signal in call:
                    self._on_signal(stub, signal)
                    if self._stop.is_set():
                        break
                # A clean end (every reset ends the stream): resubscribe at once.
                delays = _backoff()
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                details = exc.details() or ""
                if P.NOT_REGISTED_WORDS in details:
                    registered = False
                logger.debug("MindIO stand-in %s: stream error %s %s", self.job_id, exc.code(), details)
                self._stop.wait(next(delays))
            except Exception:  # keep the stand-in alive whatever a test server does
                logger.exception("MindIO stand-in %s failed; retrying", self.job_id)
                self._stop.wait(next(delays))
            finally:
                with self._lock:
                    self._call = None

    def _register(self, stub: RecoverStub, info: pb.ClientInfo) -> bool:
        init = stub.Init(info, timeout=_CALL_TIMEOUT_S, wait_for_ready=True)
        if init.code != P.OK:
            logger.warning("MindIO stand-in %s: Init -> %d %s", self.job_id, init.code, init.info)
            return False
        register = stub.Register(info, timeout=_CALL_TIMEOUT_S, wait_for_ready=True)
        if register.code != P.OK:
            logger.warning("MindIO stand-in %s: Register -> %d %s", self.job_id, register.code, register.info)
            return False
        return True

    def _on_signal(self, stub: RecoverStub, signal: pb.ProcessManageSignal) -> None:
        if signal.signalType == P.KEEP_ALIVE:
            return
        with self._lock:
            self._signals.append(signal)
        actions = list(signal.actions)
        logger.debug("MindIO stand-in %s <- %s %s %s", self.job_id, signal.signalType, actions, signal.changeStrategy)
        if signal.signalType == P.STOP_TRAIN and P.PAUSE_TRAIN_ACTION in actions:
            if self._stop.wait(self.pause_delay_s):
                return
            code = P.CLIENT_ERROR if self.fail_pause else P.OK
            self._call_unary(stub.ReportStopComplete, self._stop_complete(code))
        elif signal.signalType == P.STOP_TRAIN:
            self._call_unary(stub.ReportStopComplete, self._stop_complete(P.OK))
        elif signal.signalType == P.GLOBAL_FAULT:
            self._call_unary(
                stub.ReportRecoverStrategy, pb.RecoverStrategyRequest(jobId=self.job_id, strategies=[P.EXIT])
            )
        elif signal.signalType == P.CHANGE_STRATEGY and not signal.extraParams:
            if signal.changeStrategy == P.CONTINUE:
                if self._stop.wait(self.continue_delay_s):
                    return
            elif signal.changeStrategy not in (P.RETRY, P.RECOVER, P.DUMP):
                return  # exit: nothing is reported (docs/clusterd.md#failed-switch-and-fault-recovery)
            self._call_unary(
                stub.ReportRecoverStatus,
                pb.RecoverStatusRequest(jobId=self.job_id, status=pb.Status(code=P.OK), strategy=signal.changeStrategy),
            )

    def _stop_complete(self, code: int) -> pb.StopCompleteRequest:
        return pb.StopCompleteRequest(jobId=self.job_id, status=pb.Status(code=code))

    def _call_unary(self, method: Any, request: Any) -> None:
        try:
            reply = method(request, timeout=_CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                logger.warning("MindIO stand-in %s: %s failed: %s", self.job_id, type(request).__name__, exc.code())
            return
        logger.debug("MindIO stand-in %s: %s -> %d %s", self.job_id, type(request).__name__, reply.code, reply.info)
