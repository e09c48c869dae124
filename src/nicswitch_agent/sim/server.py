"""The simulated ClusterD ``Recover`` service: a real gRPC server on the exact upstream paths.

:class:`Simulator` owns the gRPC server and one :class:`~nicswitch_agent.sim.event_controller.JobController`
per job. Handlers here only adapt RPCs (contexts, aborts, termination callbacks) to the
controllers; protocol behaviour lives in the controller.

How ClusterD answers, and therefore how this server answers (docs/clusterd.md#errors-before-registration,
docs/clusterd.md#messages-and-field-numbers):
unary methods always end with gRPC OK and put the outcome in ``Status{code, info}``; stream
methods report errors as gRPC UNKNOWN with the message as details, and end with OK when the
server returns normally.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent._pb.service import generic_handler
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim import faults as F
from nicswitch_agent.sim.event_controller import FATAL_PREFIX, JobController, JobView, RpcAbort, StreamToken
from nicswitch_agent.sim.faults import SimFaults
from nicswitch_agent.sim.settings import SimJob, SimSettings
from nicswitch_agent.sim.standin import MindIOStandIn

logger = logging.getLogger("nicswitch_agent.sim")

__all__ = ["ServerTls", "Simulator"]


@dataclass(frozen=True)
class ServerTls:
    """TLS for the simulator's port (the real ClusterD has none; its nginx proxy does this).

    Attributes:
        cert_file: PEM server certificate (chain); give it the names clients dial (SAN).
        key_file: Its unencrypted PEM private key.
        client_ca_file: PEM CA(s) for client certificates. Given: every client must present a
            certificate signed by it (mutual TLS); None: no client certificate is asked for.
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        """Read the PEM files and build the server credentials. Raises OSError naming a file."""

        def read(path: str) -> bytes:
            with open(path, "rb") as file:
                return file.read()

        client_ca = None if self.client_ca_file is None else read(self.client_ca_file)
        return grpc.ssl_server_credentials(
            [(read(self.key_file), read(self.cert_file))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def describe(self) -> str:
        return "mutual TLS (client certificates required)" if self.client_ca_file else "TLS"


class _Notifier:
    """A version counter every controller bumps on change; ``wait_until`` sleeps on it.

    Its lock is only ever taken last (after a job's lock), and never held while a predicate
    reads the jobs, so it cannot deadlock with them.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0

    def bump(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def version(self) -> int:
        with self._cond:
            return self._version

    def wait_change(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen, timeout)


def _server_options() -> list[tuple[str, int]]:
    """ClusterD's server options (docs/clusterd.md#transport-address-and-server-options, upstream ``main.go``
    ``initGrpcServer``)."""
    return [
        ("grpc.max_receive_message_length", P.MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", P.MAX_SEND_BYTES),
        ("grpc.max_concurrent_streams", P.MAX_CONCURRENT_STREAMS),
        # ServerParameters{Time: 1m, Timeout: 5s}
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        # EnforcementPolicy{MinTime: 3s, PermitWithoutStream: true}: a client pinging more often
        # gets GOAWAY too_many_pings (docs/clusterd.md#keepalive-policy). gRPC core's default is 5 min, far stricter.
        # The key is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, whose string lacks
        # "recv": a misspelt key is silently ignored, and the 5 min default then cut off any
        # client that pinged 3 times without hearing data (tests/test_keepalive.py).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", P.KEEPALIVE_MIN_TIME_MS),
        # grpc-go (ClusterD) allows 2 strikes and sends GOAWAY on the 3rd; the first ping after
        # a header or data frame from the server is forgiven, and so is a connection's first
        # ping. gRPC core counts the same way, but a connection WINDOW_UPDATE resets its count
        # too, and it sends the one owed for a request with its next write. So both subscribe
        # handlers send their headers at once (that write carries the update): from then on
        # the count is grpc-go's, and a client pinging every 1 s on an idle stream is cut off
        # on its 4th ping, as recorded on ClusterD (tests/sim/test_keepalive_policy.py).
        ("grpc.http2.max_ping_strikes", P.KEEPALIVE_MAX_PING_STRIKES),
        # A second simulator on a fixed port must fail, not share the port.
        ("grpc.so_reuseport", 0),
    ]


class Simulator:
    """A ClusterD-compatible ``Recover`` server in-process, for tests, the demo and rehearsals.

    Args:
        jobs: the jobs ClusterD knows (its PodGroup/job caches); other job ids behave as unknown.
        settings: timings; defaults are the real server's.
        host, port: where to listen; ``port=0`` picks a free port (see :meth:`start`).
        standin: also run one :class:`~nicswitch_agent.sim.standin.MindIOStandIn` per job, the
            MindIO/TaskD process-manage client, so the switch half can be driven alone
            ("pause mode external").
        standin_register_delay_s: the stand-ins wait this long before registering (TaskD, after a
            ClusterD restart, sleeps 10 s first); ``start()`` waits for them.
        tls: serve TLS (or mutual TLS) instead of plaintext. The stand-ins, which play a client
            inside the training pod, then reach the server through a second, plaintext port on
            127.0.0.1, as MindIO reaches ClusterD through its local sidecar.
        faults: test hook (see :mod:`nicswitch_agent.sim.faults`): faults armed there are
            injected into the next matching RPCs; default: a fresh, empty one (``self.faults``).
        on_crash: called once, with the reason, when the simulator crashes like the real
            ClusterD (``settings.crash_like_clusterd``); the CLI uses it to exit with status 2.

    Where the real ClusterD would crash, :meth:`crash_points` lists why (whatever the mode).
    With ``settings.crash_like_clusterd`` the simulator then goes down: :attr:`crashed` holds the
    reason, every open stream and call ends with UNAVAILABLE, the port closes and later calls are
    refused (UNAVAILABLE). A test that must prove an agent never crashes ClusterD runs with it on
    and asserts ``sim.crashed is None`` (and ``sim.crash_points() == []``).

    Example::

        with Simulator(jobs=[SimJob("job-1", {"node-0": ["0", "1"]})]) as sim:
            channel = grpc.insecure_channel(sim.address)
    """

    def __init__(
        self,
        jobs: Iterable[SimJob] = (),
        settings: SimSettings | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        standin: bool = False,
        standin_register_delay_s: float = 0.0,
        faults: SimFaults | None = None,
        tls: ServerTls | None = None,
        on_crash: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else SimSettings()
        self.faults = faults if faults is not None else SimFaults()
        self.host = host
        self.port = port
        self.tls = tls
        self._standin_address: str | None = None  # the plaintext side port for stand-ins, with TLS
        self._use_standin = standin
        self._standin_register_delay_s = standin_register_delay_s
        self._notifier = _Notifier()
        self._on_crash = on_crash
        # Guards the lifecycle and crash fields below; never held while calling into gRPC or a
        # job (a job's lock may be held while taking it, never the other way round).
        self._lock = threading.Lock()
        self._server: Any = None
        self._address: str | None = None
        self._started = False
        self._stopped = False
        self._standins: list[MindIOStandIn] = []
        self._crash_points: list[str] = []
        self._crashed: str | None = None
        self._crash_done = threading.Event()
        self._controllers: dict[str, JobController] = {}
        for job in jobs:
            if job.job_id in self._controllers:
                raise ValueError(f"duplicate job id {job.job_id!r}")
            seed = None if self.settings.seed is None else f"{self.settings.seed}/{job.job_id}"
            self._controllers[job.job_id] = JobController(
                job, self.settings, random.Random(seed), self._notifier.bump, on_fatal=self._fatal
            )

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        if self._address is None:
            raise RuntimeError("simulator not started")
        return self._address

    def start(self) -> str:
        """Start serving; returns ``host:port``. With ``standin=True``, also waits until every
        job's stand-in holds its process-manage stream."""
        with self._lock:
            if self._started or self._stopped:
                raise RuntimeError("a Simulator starts once")
            self._started = True
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.settings.max_workers, thread_name_prefix="nicswitch-sim-rpc"),
            options=_server_options(),
        )
        server.add_generic_rpc_handlers((generic_handler(self._handlers()),))
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        try:
            if self.tls is None:
                bound = server.add_insecure_port(f"{host}:{self.port}")
            else:
                bound = server.add_secure_port(f"{host}:{self.port}", self.tls.credentials())
                if bound and self._use_standin:
                    side = server.add_insecure_port("127.0.0.1:0")
                    self._standin_address = f"127.0.0.1:{side}" if side else None
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {host}:{self.port}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot listen on {host}:{self.port}")
        if self._use_standin and self.tls is not None and self._standin_address is None:
            raise OSError("cannot listen on 127.0.0.1 for the stand-ins' plaintext port")
        server.start()
        with self._lock:
            self._server = server
            self._address = f"{host}:{bound}"
        logger.info("ClusterD simulator serving on %s%s (jobs: %s)", self._address,
                    "" if self.tls is None else f" with {self.tls.describe()}", sorted(self._controllers))
        if self._use_standin:
            self._start_standins()
        return self._address

    def _start_standins(self) -> None:
        for job_id in self._controllers:
            standin = MindIOStandIn(self._standin_address or self.address, job_id,
                                    register_delay_s=self._standin_register_delay_s)
            with self._lock:
                self._standins.append(standin)
            standin.start()
        method = P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL
        within = 10.0 + self._standin_register_delay_s  # they register only after their delay (TaskD's: 10 s)
        ready = self.wait_until(
            lambda sim: all(sim.job_view(j).open_streams[method] >= 1 for j in self._controllers),
            timeout=within,
        )
        if not ready:
            self.stop()
            raise RuntimeError(f"MindIO stand-ins did not subscribe within {within:g} s")

    # ------------------------------------------------------------------ crashing like ClusterD

    @property
    def crashed(self) -> str | None:
        """Why the simulator crashed (``crash_like_clusterd``), or None while it serves."""
        with self._lock:
            return self._crashed

    def crash_points(self) -> list[str]:
        """Every point where the real ClusterD would have crashed, oldest first (either mode)."""
        with self._lock:
            return list(self._crash_points)

    def wait_crashed(self, timeout: float) -> bool:
        """Wait until a crash has cut every stream and closed the port; False on timeout."""
        return self._crash_done.wait(timeout)

    def _fatal(self, reason: str, log: bool = False) -> None:
        """Something the real ClusterD dies of happened (a job's controller has logged it unless
        ``log``). May be called with a job's lock held: records, and with ``crash_like_clusterd``
        goes down on another thread."""
        with self._lock:
            self._crash_points.append(reason)
            crash = self.settings.crash_like_clusterd and self._crashed is None and not self._stopped
            if crash:
                self._crashed = reason
        if log:
            logger.error("protocol misuse: %s%s", FATAL_PREFIX, reason)
        if not crash:
            self._notifier.bump()
            return
        logger.error("ClusterD simulator crashing as the real server would (exit status 2): %s", reason)
        threading.Thread(target=self._go_down, args=(reason,), name="nicswitch-sim-crash", daemon=True).start()
        self._notifier.bump()

    def _go_down(self, reason: str) -> None:
        """The crash itself: cancel every call (UNAVAILABLE), close the port, end the jobs' threads."""
        with self._lock:
            server, standins = self._server, list(self._standins)
        if server is not None:
            server.stop(0).wait(5.0)
        for standin in standins:
            standin.stop()
        for controller in self._controllers.values():
            controller.stop()
        self._crash_done.set()
        self._notifier.bump()
        if self._on_crash is not None:
            try:
                self._on_crash(reason)
            except Exception:
                logger.exception("on_crash callback failed")

    def _refuse_if_crashed(self, context: Any) -> None:
        """After a crash, calls that slip in before the port closes fail as on a dead server."""
        if self.crashed is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "simulated ClusterD crashed (connection refused)")

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving and end every stream; idempotent. Stand-ins stop first."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            server, standins = self._server, list(self._standins)
        for standin in standins:
            standin.stop()
        # The server first: the real one's open streams end with UNAVAILABLE when it goes down,
        # SIGTERM included (docs/clusterd.md#restarts). Controllers stopped first would end them
        # cleanly, which a client takes for a reset, and leave a stopping server that accepts
        # subscribes and ends each at once.
        if server is not None:
            server.stop(grace).wait(5.0)
        for controller in self._controllers.values():
            controller.stop()
        logger.info("ClusterD simulator stopped")

    def __enter__(self) -> Simulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ introspection

    def job_view(self, job_id: str) -> JobView:
        """A thread-safe snapshot of one job (KeyError for a job the simulator does not know)."""
        return self._controllers[job_id].view()

    def reset_count(self, job_id: str) -> int:
        """How many times the job's controller was reset."""
        return self._controllers[job_id].reset_count()

    def job_ids(self) -> list[str]:
        return list(self._controllers)

    def wait_until(self, predicate: Callable[[Simulator], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` holds (re-checked on every state change); False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self._notifier.version()
            if predicate(self):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._notifier.wait_change(seen, remaining)

    def wait_idle(self, job_id: str, timeout: float) -> bool:
        """Wait until the job is in INIT with a process-manage stream open, i.e. a SwitchNicTrack
        now starts a switch at once (after a finished switch the MindIO side must resubscribe
        first, or its subscribe resets the new switch)."""

        def idle(sim: Simulator) -> bool:
            view = sim.job_view(job_id)
            return view.state == P.INIT and view.open_streams[P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL] >= 1

        return self.wait_until(idle, timeout)

    # ------------------------------------------------------------------ RPC handlers

    def _handlers(self) -> dict[str, Callable[..., Any]]:
        handlers: dict[str, Callable[..., Any]] = {
            "Init": self._init,
            "Register": self._register,
            "SubscribeProcessManageSignal": self._subscribe_process_manage,
            "ReportStopComplete": self._report_stop_complete,
            "ReportRecoverStrategy": self._report_recover_strategy,
            "ReportRecoverStatus": self._report_recover_status,
            "HealthCheck": self._health_check,
            "SwitchNicTrack": self._switch_nic_track,
            "SubscribeSwitchNicSignal": self._subscribe_switch_nic_signal,
            "SubscribeNotifySwitch": self._subscribe_notify_switch,
            "ReplySwitchNicResult": self._reply_switch_nic_result,
        }
        return {name: self._guarded(handler) for name, handler in handlers.items()}

    def _guarded(self, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def guarded(request: Any, context: Any) -> Any:
            self._refuse_if_crashed(context)
            return handler(request, context)

        return guarded

    def _registered(self, job_id: str) -> JobController | None:
        controller = self._controllers.get(job_id)
        if controller is None or not controller.is_registered():
            return None
        return controller

    def _init(self, request: pb.ClientInfo, context: Any) -> pb.Status:
        controller = self._controllers.get(request.jobId)
        if controller is None:
            # No PodGroup for this job: getJobBaseInfo's first failure, 502 OperatePodGroupError
            # (docs/clusterd.md#registration-init-and-register: "502 / other codes on PodGroup errors").
            return pb.Status(code=P.OPERATE_POD_GROUP_ERROR, info=P.INIT_NO_POD_GROUP.format(job=request.jobId))
        return controller.init()

    def _register(self, request: pb.ClientInfo, context: Any) -> pb.Status:
        controller = self._controllers.get(request.jobId)
        if controller is None:
            return pb.Status(code=P.UN_INIT, info=P.NOT_INITED.format(job=request.jobId))
        return controller.register()

    def _health_check(self, request: pb.ClientInfo, context: Any) -> pb.Status:
        return pb.Status(code=P.OK, info=P.HEALTH_CHECK.format(job=request.jobId))

    def _switch_nic_track(self, request: pb.SwitchNics, context: Any) -> pb.Status:
        controller = self._controllers.get(request.jobID)
        if controller is None:
            return pb.Status(code=P.OM_PARAM_INVALID, info=P.JOB_NOT_EXIST_MSG.format(job=request.jobID))
        return controller.switch_nic_track(request)

    def _reply_switch_nic_result(self, request: pb.SwitchResult, context: Any) -> pb.Status:
        if self.faults.take(F.REPLY_QPS_EXCEEDED):
            context.abort(grpc.StatusCode.UNKNOWN, "qps exceeded, method=/Recover/ReplySwitchNicResult")
        if self.faults.take(F.REPLY_UNAVAILABLE_LOST):
            context.abort(grpc.StatusCode.UNAVAILABLE, "simulated fault: reply lost before ClusterD saw it")
        controller = self._registered(request.jobId)
        if controller is None:
            return pb.Status(code=P.UN_REGISTRY, info=P.NOT_REGISTED.format(job=request.jobId))
        try:
            status = controller.reply_switch_nic_result(request)
        except RpcAbort as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), exc.details)
            raise  # unreachable: abort raises
        if self.faults.take(F.REPLY_UNAVAILABLE_DELIVERED):
            context.abort(grpc.StatusCode.UNAVAILABLE, "simulated fault: reply taken, then the call failed")
        return status

    def _missing_status(
        self, method: str, request: pb.StopCompleteRequest | pb.RecoverStatusRequest, context: Any
    ) -> None:
        """A report without ``status``: ClusterD logs ``request.Status.Code`` before anything
        else, dereferences nil and dies, whatever the job. Recorded (on the job if known); with
        ``crash_like_clusterd`` the simulator dies too and this call ends with UNAVAILABLE."""
        if request.HasField("status"):
            return
        why = (
            f"{method} without a status field: ClusterD reads request.Status.Code before anything else, "
            "dereferences nil and panics; the whole server process exits (status 2), every stream and "
            "call fails with UNAVAILABLE and every job on it is lost"
        )
        controller = self._controllers.get(request.jobId)
        if controller is not None:
            controller.record_fatal(why)
        else:
            self._fatal(f"jobId={request.jobId}: {why}", log=True)
        if self.crashed is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (simulated ClusterD crash: nil status)")

    def _report_stop_complete(self, request: pb.StopCompleteRequest, context: Any) -> pb.Status:
        self._missing_status(P.REPORT_STOP_COMPLETE, request, context)
        controller = self._registered(request.jobId)
        if controller is None:
            return pb.Status(code=P.UN_REGISTRY, info=P.NOT_REGISTED.format(job=request.jobId))
        return controller.report_stop_complete(request)

    def _report_recover_strategy(self, request: pb.RecoverStrategyRequest, context: Any) -> pb.Status:
        controller = self._registered(request.jobId)
        if controller is None:
            return pb.Status(code=P.UN_REGISTRY, info=P.NOT_REGISTED.format(job=request.jobId))
        return controller.report_recover_strategy(request)

    def _report_recover_status(self, request: pb.RecoverStatusRequest, context: Any) -> pb.Status:
        self._missing_status(P.REPORT_RECOVER_STATUS, request, context)
        controller = self._registered(request.jobId)
        if controller is None:
            return pb.Status(code=P.UN_REGISTRY, info=P.NOT_REGISTED.format(job=request.jobId))
        return controller.report_recover_status(request)

    @staticmethod
    def _watch(context: Any, controller: JobController, token: StreamToken) -> None:
        """Tell the controller when the RPC ends, whatever ends it (client cancel included)."""
        if not context.add_callback(lambda: controller.stream_terminated(token)):
            controller.stream_terminated(token)

    def _subscribe_process_manage(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.ProcessManageSignal]:
        """``SubscribeProcessManageSignal``: reset the job, then forward signals
        (docs/clusterd.md#registration-init-and-register, docs/clusterd.md#resets-and-stream-ends)."""
        controller = self._registered(request.jobId)
        if controller is None:
            context.abort(grpc.StatusCode.UNKNOWN, P.NOT_REGISTED.format(job=request.jobId))
            return
        token = controller.open_stream(P.SUBSCRIBE_PROCESS_MANAGE_SIGNAL, context.peer())
        self._watch(context, controller, token)
        # Headers right away: a client can tell its subscribe (and the reset) has happened, and
        # the ping count starts here (_server_options). grpc-go ClusterD sends them with the first
        # message; iterating clients see no difference.
        context.send_initial_metadata(())
        while True:
            signal = controller.next_signal(token)
            if signal is None:
                return
            try:
                yield signal
            except GeneratorExit:
                # gRPC dropped the generator without resuming it: the client went away as the message
                # went out (it may well have read it). ClusterD's Send into a dying stream returns nil
                # and its send result runs as for any send (docs/clusterd.md#the-reconnect-race): the
                # signal counts as sent (a killMaster the leader acted on was otherwise never recorded).
                controller.signal_sent(token, signal)
                raise
            # Reaching here means the message was written: gRPC resumes a response generator
            # only after the previous send completed.
            controller.signal_sent(token, signal)

    def _subscribe_notify_switch(self, request: pb.ClientInfo, context: Any) -> Iterator[pb.SwitchRankList]:
        """``SubscribeNotifySwitch``: competing readers of the job's one-slot rank-list channel."""
        controller = self._registered(request.jobId)
        if controller is None:
            context.abort(grpc.StatusCode.UNKNOWN, P.NOT_REGISTED_WAIT_AGENT.format(job=request.jobId))
            return
        token = controller.open_stream(P.SUBSCRIBE_NOTIFY_SWITCH, context.peer())
        self._watch(context, controller, token)
        context.send_initial_metadata(())  # the ping count starts here (_server_options)
        while True:
            rank_list = controller.next_rank_list(token)
            if rank_list is None:
                return
            if self.faults.take(F.NOTIFY_DROP_BEFORE_SEND):
                controller.rank_list_not_sent(token, rank_list)
                context.abort(grpc.StatusCode.UNAVAILABLE, "simulated fault: stream dropped before the send")
            try:
                yield rank_list
            except GeneratorExit:
                # gRPC dropped the generator without resuming it: the send never completed.
                controller.rank_list_unconfirmed(token)
                raise
            controller.rank_list_sent(token, rank_list)
            if self.faults.take(F.NOTIFY_DROP_AFTER_SEND):
                context.abort(grpc.StatusCode.UNAVAILABLE, "simulated fault: stream dropped after the send")

    def _subscribe_switch_nic_signal(
        self, request: pb.SwitchNicRequest, context: Any
    ) -> Iterator[pb.SwitchNicResponse]:
        """``SubscribeSwitchNicSignal``: only while switching; at most one message
        (docs/clusterd.md#the-operators-result-stream)."""
        controller = self._registered(request.jobID)
        if controller is None:
            context.abort(grpc.StatusCode.UNKNOWN, P.NOT_REGISTED.format(job=request.jobID))
            return
        token = controller.open_om_stream(context.peer())
        if token is None:
            context.abort(grpc.StatusCode.UNKNOWN, P.NOT_SWITCHING.format(job=request.jobID))
            return
        self._watch(context, controller, token)
        response = controller.next_om_response(token)
        if response is not None:
            yield response
