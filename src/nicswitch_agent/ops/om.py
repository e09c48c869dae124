"""Operator (O&M) side: ask ClusterD for a link switch and read its result.

ClusterD gives an operator two RPCs (docs/clusterd.md#switchnictrack-validation,
docs/clusterd.md#the-operators-result-stream):

* ``SwitchNicTrack(SwitchNics)`` answers a ``Status``: 0 accepted, 411 another switch or a recovery
  is running, 413 invalid request (``info`` says why).
* ``SubscribeSwitchNicSignal(SwitchNicRequest)`` is accepted only while a switch is in progress and
  delivers **at most one** ``SwitchNicResponse`` (``"switch nic finish"`` or a failure message),
  then returns. It can also end cleanly with no message (a controller reset), and it answers gRPC
  UNKNOWN ``"... is not swtiching nic"`` / ``"... not registed"`` (sic) when there is nothing to watch.

:class:`OmClient` turns those into values: :meth:`OmClient.switch` returns :class:`SwitchAccepted`
or raises an :class:`OmError`; :meth:`OmClient.follow` always returns an :class:`Outcome`.
Input parsing for the CLI (``--node/--dev/--op``) lives here too so that it is tested with the
validation it feeds. Nothing here prints; ``om_cli`` does.

ClusterD hands the one result message to exactly one ``SubscribeSwitchNicSignal`` subscriber, so
two followers of the same job compete: one gets the message, the other sees the stream end empty.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import (
    ChannelSettings,
    RecoverStub,
    TlsSettings,
    explain_connect_failure,
    open_channel,
    settings_of,
)
from nicswitch_agent.clusterd.rpc_policy import Kind, RetryAfter, bounded, classify, wait_as_asked
from nicswitch_agent.clusterd.rpc_policy import backoff_delays as _backoff_delays
from nicswitch_agent.errors import NicSwitchError

# A literal name, not __name__: operators filter on it, and it must not follow the module's path.
_LOG = logging.getLogger("nicswitch_agent.om")

#: ClusterD waits 15 min per phase (``reportTimeoutMinutes``); we wait a minute longer so that
#: ClusterD's own verdict, not our impatience, ends a slow switch.
DEFAULT_FOLLOW_TIMEOUT_S = 16 * 60.0
#: Deadline for each unary call. ClusterD answers in milliseconds on loopback.
DEFAULT_RPC_TIMEOUT_S = 10.0
#: How often :meth:`OmClient.watch` asks again while no switch runs. ClusterD accepts the result
#: stream only while a switch runs, and a switch with a quick job takes a few milliseconds (7-15 ms
#: against the simulator with an agent answering: a 20 ms poll saw 2 of 10, 5 ms saw 10 of 10). A
#: refused call changes nothing in ClusterD and costs both sides a fraction of a millisecond; 200
#: per second cost the watch about 14% of a core and the Python simulator 10%.
DEFAULT_WATCH_POLL_S = 0.005

CODE_OK = 0
CODE_BUSY = 411  # OMIsRunning
CODE_INVALID = 413  # OMParamInvalid

#: The only success message on SubscribeSwitchNicSignal.
SWITCH_FINISH = "switch nic finish"
#: Every other message ClusterD writes for the O&M stream (verbatim, typos included).
FAILURE_MESSAGES: frozenset[str] = frozenset(
    {
        "switch nic failed, switch nic failed",
        "switch nic failed, report error when switching nic",
        "switch nic failed, report switch nic timeout",
        "switch nic failed, job service not ready",
        "pause train failed, job service not ready",
        "om failed, pause train failed",
        "pause train timeout",
        "switch nic failed, continue train failed",
        "switch nic failed, continue train timeout",
        "continue train failed, job service not ready",
        "send switch nic signal failed, please check manually",
        "om failed, send signal failed",
        "report switch nic result timeout, please check manually",
    }
)

_STANDBY_WORDS = frozenset({"standby", "backup", "true"})
_PRIMARY_WORDS = frozenset({"primary", "false"})

NicOps = Mapping[str, tuple[Sequence[str], Sequence[bool]]]
"""node name -> (device ids, ops); ``True`` = standby (backup) NIC, ``False`` = primary."""


# --------------------------------------------------------------------------------------------
# Input parsing (CLI) and validation (every request)
# --------------------------------------------------------------------------------------------


def parse_op(word: str) -> bool:
    """``standby``/``backup``/``true`` -> True, ``primary``/``false`` -> False (any case).

    Raises:
        ValueError: naming ``--op`` and the bad value.
    """
    token = word.strip().lower()
    if token in _STANDBY_WORDS:
        return True
    if token in _PRIMARY_WORDS:
        return False
    raise ValueError(f"--op: unknown value {word!r} (use standby, backup, true, primary or false)")


def _split(flag: str, text: str) -> list[str]:
    items = [part.strip() for part in text.split(",")]
    if not text.strip():
        raise ValueError(f"{flag}: empty value")
    if any(not item for item in items):
        raise ValueError(f"{flag}: empty item in {text!r}")
    bad = [item for item in items if any(ch.isspace() for ch in item)]
    if bad:
        raise ValueError(f"{flag}: {bad[0]!r} contains whitespace")
    return items


def parse_nic_ops(node: str, devs: str, ops: str) -> dict[str, tuple[list[str], list[bool]]]:
    """Parse one ``--node N --dev 0,1 --op standby,primary`` group.

    A single op applies to every device. Devices are ClusterD's rank-table ``device_id`` strings
    and are passed through as given (ClusterD checks that they exist on the node).

    Raises:
        ValueError: naming the flag and the bad value.
    """
    name = node.strip()
    if not name:
        raise ValueError("--node: empty value")
    if any(ch.isspace() for ch in name):
        raise ValueError(f"--node: {node!r} contains whitespace")
    dev_list = _split("--dev", devs)
    op_list = [parse_op(word) for word in _split("--op", ops)]
    if len(op_list) == 1:
        op_list = op_list * len(dev_list)
    elif len(op_list) != len(dev_list):
        raise ValueError(
            f"--op: {len(op_list)} values {ops!r} for {len(dev_list)} devices {devs!r} "
            "(give one op for all devices, or one per device)"
        )
    seen: set[str] = set()
    for dev in dev_list:
        if dev in seen:
            raise ValueError(f"--dev: device {dev!r} repeated for node {name!r}")
        seen.add(dev)
    return {name: (dev_list, op_list)}


def parse_nic_groups(
    groups: Iterable[tuple[str, str, str]],
) -> dict[str, tuple[list[str], list[bool]]]:
    """Parse several ``(node, devs, ops)`` groups and merge groups naming the same node.

    ``SwitchNics.nicOps`` holds one device list per node, so a node given twice is merged; a device
    given twice for the same node is an error rather than a silent override.

    Raises:
        ValueError: naming the flag and the bad value; or if there are no groups.
    """
    merged: dict[str, tuple[list[str], list[bool]]] = {}
    for node, devs, ops in groups:
        for name, (dev_list, op_list) in parse_nic_ops(node, devs, ops).items():
            have_devs, have_ops = merged.setdefault(name, ([], []))
            for dev, op in zip(dev_list, op_list, strict=True):
                if dev in have_devs:
                    raise ValueError(f"--dev: device {dev!r} repeated for node {name!r}")
                have_devs.append(dev)
                have_ops.append(op)
    if not merged:
        raise ValueError("--node: at least one --node/--dev/--op group is required")
    return merged


def validate_nic_ops(nic_ops: NicOps) -> None:
    """Reject what ClusterD would accept but mishandle, before anything is sent.

    ClusterD does not check for an empty map (the job is paused and then stalls) nor for repeated
    devices (duplicate rank ids reach the job), so we do (docs/clusterd.md#switchnictrack-validation).

    Raises:
        ValueError: with the node and the problem.
    """
    if not nic_ops:
        raise ValueError("nic_ops: no node given (ClusterD would pause the job and then stall)")
    for node, (devs, ops) in nic_ops.items():
        if not node or not node.strip():
            raise ValueError("nic_ops: empty node name")
        if not devs or not ops:
            raise ValueError(f"nic_ops[{node!r}]: dev or op is empty")
        if len(devs) != len(ops):
            raise ValueError(f"nic_ops[{node!r}]: {len(devs)} devices but {len(ops)} ops")
        if any(not isinstance(dev, str) or not dev.strip() for dev in devs):
            raise ValueError(f"nic_ops[{node!r}]: devices must be non-empty strings, got {list(devs)!r}")
        if any(not isinstance(op, bool) for op in ops):
            raise ValueError(f"nic_ops[{node!r}]: ops must be bools, got {list(ops)!r}")
        if len(set(devs)) != len(devs):
            raise ValueError(f"nic_ops[{node!r}]: repeated device in {list(devs)!r}")


def build_switch_request(job_id: str, nic_ops: NicOps) -> Any:
    """Validate and build the ``SwitchNics`` message (``jobID``, capital D, on this message)."""
    if not job_id or not job_id.strip():
        raise ValueError("job_id: empty")
    validate_nic_ops(nic_ops)
    request = pb.SwitchNics(jobID=job_id)
    for node, (devs, ops) in nic_ops.items():
        entry = request.nicOps[node]
        entry.dev.extend(devs)
        entry.op.extend(ops)
    return request


def op_name(op: bool) -> str:
    """The word an operator reads: standby (``op=true``) or primary."""
    return "standby" if op else "primary"


def describe_nic_ops(nic_ops: NicOps) -> str:
    """``node-1: dev 0 -> standby, dev 1 -> primary; node-2: ...`` for logs and the CLI."""
    parts = []
    for node, (devs, ops) in nic_ops.items():
        pairs = ", ".join(f"dev {dev} -> {op_name(op)}" for dev, op in zip(devs, ops, strict=False))
        parts.append(f"{node}: {pairs}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Results and errors
# --------------------------------------------------------------------------------------------


class OmError(NicSwitchError):
    """A switch request that ClusterD did not accept, or could not be asked."""


class SwitchRejected(OmError):
    """``SwitchNicTrack`` answered a non-zero ``Status``; nothing was started."""

    def __init__(self, job_id: str, code: int, info: str) -> None:
        super().__init__(f"job {job_id}: SwitchNicTrack answered {code}: {info}")
        self.job_id = job_id
        self.code = code
        self.info = info


class SwitchBusy(SwitchRejected):
    """411: another switch or a fault recovery is running for the job; retry when it is over."""


class SwitchInvalid(SwitchRejected):
    """413: ClusterD rejected the request; ``info`` names the bad job, node or device."""


class OmRpcError(OmError):
    """The call itself failed (unreachable server, deadline, ...).

    For ``SwitchNicTrack`` a DEADLINE_EXCEEDED is ambiguous: the request may have been accepted.
    """

    def __init__(self, method: str, code: str, details: str) -> None:
        super().__init__(f"{method}: {code}: {details}")
        self.method = method
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, method: str, exc: grpc.RpcError, settings: ChannelSettings | None = None) -> OmRpcError:
        """``details`` in plain words when no connection could be made (a TLS mismatch, say)."""
        code, details = _code_and_details(exc)
        return cls(method, code, explain_connect_failure(exc, settings) or details)

    @property
    def maybe_delivered(self) -> bool:
        """True when the server may have acted on the request although we got no answer."""
        return self.code == "DEADLINE_EXCEEDED"


@dataclass(frozen=True)
class SwitchAccepted:
    """``SwitchNicTrack`` answered 0: ClusterD is pausing the job to switch it."""

    job_id: str
    info: str
    nic_ops: Mapping[str, tuple[tuple[str, ...], tuple[bool, ...]]]
    rpc_s: float


class OutcomeKind(str, enum.Enum):
    """How following a switch ended."""

    FINISHED = "finished"  # "switch nic finish"
    FAILED = "failed"  # any other message: ClusterD has moved the job to fault recovery
    NO_RESULT = "no_result"  # the stream ended without a message and the switch is over
    NOT_SWITCHING = "not_switching"  # UNKNOWN "... is not swtiching nic"
    NOT_REGISTERED = "not_registered"  # UNKNOWN "... not registed"
    TIMED_OUT = "timed_out"  # our own follow deadline
    RPC_ERROR = "rpc_error"  # unreachable server or another gRPC error
    CANCELLED = "cancelled"  # OmClient.close() from another thread


@dataclass(frozen=True)
class Outcome:
    """What ClusterD said about a switch, or why we could not find out."""

    kind: OutcomeKind
    job_id: str
    message: str | None = None
    detail: str = ""
    elapsed_s: float = 0.0
    attempts: int = 1
    rpc_code: str | None = None
    accepted: SwitchAccepted | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.kind is OutcomeKind.FINISHED

    @property
    def documented(self) -> bool:
        """False when ClusterD sent a message this library does not know (still a failure)."""
        return self.message is None or self.message == SWITCH_FINISH or self.message in FAILURE_MESSAGES


@dataclass(frozen=True)
class WatchedSwitch:
    """One switch's result as :meth:`OmClient.watch` saw it arrive.

    ClusterD does not say when a switch started, and its result stream is accepted only while one
    runs; so the switch's duration is known between two bounds: it was already running when the
    stream that delivered the result was opened, and it was not yet running (or was a previous
    switch) when the watch last heard so.

    Attributes:
        seq: 1 for the first result of the watch, then 2, ...
        outcome: kind and message; ``elapsed_s`` is ``at_least_s``.
        at_least_s: the switch ran at least this long (from the opening of the stream that
            delivered the result to the result).
        at_most_s: the switch ran at most this long (from the last sign that it was not running);
            None when it was already running when the watch began.
        wall_time: ``time.time()`` when the result arrived.
    """

    seq: int
    outcome: Outcome
    at_least_s: float
    at_most_s: float | None
    wall_time: float


@dataclass(frozen=True)
class WatchEnd:
    """How :meth:`OmClient.watch` ended.

    Attributes:
        results: every result, in order (also given to ``on_result`` as each arrived).
        stopped: None when ``count`` results arrived; else TIMED_OUT, CANCELLED or RPC_ERROR.
        detail: why it stopped, in words.
        rpc_code: the gRPC code of an RPC_ERROR.
    """

    results: tuple[WatchedSwitch, ...]
    stopped: OutcomeKind | None
    detail: str = ""
    rpc_code: str | None = None


def classify_message(message: str) -> OutcomeKind:
    """``"switch nic finish"`` is the only success; every other message is a failure."""
    return OutcomeKind.FINISHED if message == SWITCH_FINISH else OutcomeKind.FAILED


class StreamError(enum.Enum):
    """What an error ending SubscribeSwitchNicSignal means for the follower."""

    NOT_SWITCHING = "not_switching"
    NOT_REGISTERED = "not_registered"
    DEADLINE = "deadline"
    TRANSIENT = "transient"
    FATAL = "fatal"


# What each kind of failure means for a follower. UNAVAILABLE: connection lost or server
# restarting. INTERNAL: what a proxy's RST_STREAM looks like (nginx's grpc_read_timeout cuts idle
# streams; the O&M stream is idle for the whole switch).
_STREAM_ERRORS: Mapping[Kind, StreamError] = {
    Kind.NOT_SWITCHING: StreamError.NOT_SWITCHING,
    Kind.NOT_REGISTERED: StreamError.NOT_REGISTERED,
    Kind.DEADLINE: StreamError.DEADLINE,
    Kind.CONNECT_FAILED: StreamError.TRANSIENT,
    Kind.HANDSHAKE_FAILED: StreamError.TRANSIENT,
    Kind.UNAVAILABLE: StreamError.TRANSIENT,
    Kind.INTERNAL: StreamError.TRANSIENT,
}

# Retries of the result stream: 0.1 s doubling to 1 s, jittered (ClusterD answers in milliseconds).
_RETRY_INITIAL_S = 0.1
_RETRY_MAX_S = 1.0


def _code_and_details(exc: BaseException) -> tuple[str, str]:
    """The code's name and ClusterD's words (the whole error when it has none)."""
    failure = classify(exc)
    return failure.code_name, failure.details or str(exc)


def classify_stream_error(exc: grpc.RpcError) -> StreamError:
    """What an error ending SubscribeSwitchNicSignal means for the follower (table-tested)."""
    return _STREAM_ERRORS.get(classify(exc).kind, StreamError.FATAL)


def backoff_delays(
    initial_s: float = _RETRY_INITIAL_S, maximum_s: float = _RETRY_MAX_S, multiplier: float = 2.0
) -> Iterator[float]:
    """Capped, jittered exponential delays (:func:`nicswitch_agent.clusterd.rpc_policy.backoff_delays`);
    the caller bounds them by its deadline."""
    return _backoff_delays(initial_s, maximum_s, multiplier=multiplier)


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------


class OmClient:
    """Operator client for one ClusterD: request a switch, follow its result.

    Thread-safety: one follow at a time; :meth:`close` may be called from any thread and makes a
    running :meth:`follow` return ``CANCELLED`` promptly.
    """

    def __init__(
        self,
        target: str,
        *,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        channel: grpc.Channel | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        """Open the channel to ClusterD (or adopt ``channel``).

        Args:
            target: ClusterD's ``host:port``.
            rpc_timeout_s: Deadline of ``SwitchNicTrack``.
            channel: A channel to use (not closed by :meth:`close`); None: one is opened.
            tls: TLS for the channel opened here; None: plaintext (ClusterD's own way).

        Raises:
            ConfigError: a TLS file cannot be read or is not PEM.
        """
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be > 0, got {rpc_timeout_s}")
        self.target = target
        self.rpc_timeout_s = rpc_timeout_s
        self._own_channel = channel is None
        self._channel = channel if channel is not None else open_channel(ChannelSettings(target=target, tls=tls))
        self._stub = RecoverStub(self._channel)
        self._closed = threading.Event()
        # Guards _call: the in-flight SubscribeSwitchNicSignal call, cancelled by close().
        self._lock = threading.Lock()
        self._call: Any = None

    def __enter__(self) -> OmClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop a running follow and close the channel (if ours). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._own_channel:
            self._channel.close()

    # -- SwitchNicTrack ----------------------------------------------------------------------

    def switch(self, job_id: str, nic_ops: NicOps, *, timeout_s: float | None = None) -> SwitchAccepted:
        """Ask ClusterD to switch ``nic_ops`` of ``job_id``; never retried (not idempotent: a
        second call while the first runs gets 411).

        Raises:
            ValueError: bad input, detected before anything is sent.
            SwitchBusy: 411. SwitchInvalid: 413. SwitchRejected: any other non-zero code.
            OmRpcError: the call failed (``maybe_delivered`` on a deadline).
        """
        request = build_switch_request(job_id, nic_ops)
        deadline = self.rpc_timeout_s if timeout_s is None else timeout_s
        _LOG.info("[%s] SwitchNicTrack %s", job_id, describe_nic_ops(nic_ops))
        started = time.monotonic()
        try:
            status = self._stub.SwitchNicTrack(request, timeout=deadline)
        except grpc.RpcError as exc:
            raise OmRpcError.from_rpc_error("SwitchNicTrack", exc, settings_of(self._channel)) from exc
        rpc_s = time.monotonic() - started
        code, info = int(status.code), str(status.info)
        _LOG.info("[%s] SwitchNicTrack -> %d %r (%.1f ms)", job_id, code, info, rpc_s * 1000)
        if code == CODE_OK:
            frozen = {node: (tuple(devs), tuple(ops)) for node, (devs, ops) in nic_ops.items()}
            return SwitchAccepted(job_id=job_id, info=info, nic_ops=frozen, rpc_s=rpc_s)
        if code == CODE_BUSY:
            raise SwitchBusy(job_id, code, info)
        if code == CODE_INVALID:
            raise SwitchInvalid(job_id, code, info)
        raise SwitchRejected(job_id, code, info)

    # -- SubscribeSwitchNicSignal ------------------------------------------------------------

    def follow(
        self,
        job_id: str,
        timeout_s: float = DEFAULT_FOLLOW_TIMEOUT_S,
        *,
        wait_for_start: bool = False,
        server_seen: bool = False,
    ) -> Outcome:
        """Wait for ClusterD's result for the switch of ``job_id``.

        A clean end of stream without a message is followed by a resubscribe: if the switch is
        still in progress (ClusterD's own 15-min O&M timeout, a proxy cutting an idle stream) we
        keep waiting; if ClusterD now says it is not switching, the result was lost (``NO_RESULT``).

        Args:
            timeout_s: our own deadline for the whole wait.
            wait_for_start: retry "not switching"/"not registered" with backoff until the switch
                starts (the ``watch`` command). Otherwise they end the follow at once.
            server_seen: the server already answered us (set after ``SwitchNicTrack``): lost
                connections are then retried instead of reported as unreachable.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        started = time.monotonic()
        deadline = started + timeout_s
        delays = backoff_delays()
        reached = server_seen
        ended_empty = 0
        attempts = 0
        last_problem = ""

        def outcome(kind: OutcomeKind, **kw: Any) -> Outcome:
            return Outcome(kind, job_id, elapsed_s=time.monotonic() - started, attempts=attempts, **kw)

        def cancelled() -> Outcome:
            return outcome(OutcomeKind.CANCELLED, detail="stopped waiting (client closed)")

        def attempt() -> Outcome:
            """One stream: the outcome, or RetryAfter (the wait before asking again)."""
            nonlocal reached, ended_empty, attempts, last_problem
            if self._closed.is_set():
                return cancelled()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return outcome(OutcomeKind.TIMED_OUT, detail=_timeout_detail(timeout_s, last_problem))
            attempts += 1
            try:
                message = self._one_stream(job_id, remaining)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    raise RetryAfter(0.0) from exc
                code, details = _code_and_details(exc)
                kind = classify_stream_error(exc)
                _LOG.debug("[%s] SubscribeSwitchNicSignal #%d: %s %s", job_id, attempts, code, details)
                if kind is StreamError.DEADLINE:  # the deadline we gave the call: ours
                    return outcome(OutcomeKind.TIMED_OUT, detail=_timeout_detail(timeout_s, last_problem))
                if kind in (StreamError.NOT_SWITCHING, StreamError.NOT_REGISTERED):
                    reached = True
                    if ended_empty:
                        return outcome(
                            OutcomeKind.NO_RESULT,
                            rpc_code=code,
                            detail="the result stream ended without a message and ClusterD now says "
                            f"{details!r}: the switch is over but its result was lost",
                        )
                    if wait_for_start:
                        last_problem = details
                        raise RetryAfter(next(delays)) from exc
                    not_switching = kind is StreamError.NOT_SWITCHING
                    return outcome(
                        OutcomeKind.NOT_SWITCHING if not_switching else OutcomeKind.NOT_REGISTERED,
                        rpc_code=code,
                        detail=details,
                    )
                if kind is StreamError.TRANSIENT and reached:
                    last_problem = f"{code}: {details}"
                    raise RetryAfter(next(delays)) from exc
                plain = explain_connect_failure(exc, settings_of(self._channel))
                return outcome(OutcomeKind.RPC_ERROR, rpc_code=code, detail=f"{code}: {plain or details}")
            reached = True
            if message is None:
                if self._closed.is_set():
                    raise RetryAfter(0.0)
                # Clean EOF: a controller reset, or ClusterD's own O&M timeout. Ask again (paced).
                ended_empty += 1
                last_problem = "the result stream ended without a message"
                _LOG.info("[%s] SubscribeSwitchNicSignal ended without a message; resubscribing", job_id)
                raise RetryAfter(0.05 * min(ended_empty, 20))
            kind_done = classify_message(message)
            if kind_done is OutcomeKind.FAILED and message not in FAILURE_MESSAGES:
                _LOG.warning("[%s] undocumented O&M message %r, treated as a failure", job_id, message)
            return outcome(kind_done, message=message)

        # Each attempt checks the deadline itself (after the wait, which the deadline cuts short),
        # so that a follow runs out with TIMED_OUT, not with a wait cut off early.
        retrying = bounded(lambda exc: isinstance(exc, RetryAfter), stop_event=self._closed,
                           wait=wait_as_asked, sleep=lambda seconds: self._pause(seconds, deadline))
        try:
            result: Outcome = retrying(attempt)
        except RetryAfter:  # close() during the follow
            return cancelled()
        return result

    def watch(
        self,
        job_id: str,
        on_result: Callable[[WatchedSwitch], None] | None = None,
        *,
        count: int | None = None,
        timeout_s: float | None = None,
        poll_s: float = DEFAULT_WATCH_POLL_S,
        on_note: Callable[[str], None] | None = None,
    ) -> WatchEnd:
        """Follow every switch of ``job_id``: each result goes to ``on_result`` as it arrives.

        ClusterD accepts SubscribeSwitchNicSignal only while a switch runs, and the stream ends
        after its one result (docs/protocol.md). So the watch keeps a stream open whenever one is
        accepted and re-opens it at once when it ends, at most once per ``poll_s`` (a server that
        refuses or ends streams at once is not hammered); connection errors back off (0.1 s to 1 s).
        A switch shorter than ``poll_s`` plus a round trip can still be missed.

        Args:
            on_result: called on this thread with each result (exceptions propagate).
            count: stop after this many results; None: until ``timeout_s`` or :meth:`close`.
            timeout_s: stop after this long; None: no limit.
            poll_s: least time between two stream openings.
            on_note: called with a line worth telling the operator (job not registered,
                connection lost, regained), never twice in a row with the same line.
        """
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        started = time.monotonic()
        deadline = math.inf if timeout_s is None else started + timeout_s
        delays = backoff_delays()
        results: list[WatchedSwitch] = []
        reached = False
        # What the watch knows of the current switch's start: it began after not_running_at (the
        # opening of a stream ClusterD refused, or a previous result; None: unknown, it may have
        # been running before the watch began) and before running_at (the opening of the first
        # stream ClusterD accepted for it).
        not_running_at: float | None = None
        running_at: float | None = None
        ended_empty_at: float | None = None  # the last stream ended without a message
        last_open = -math.inf
        last_note = ""
        trouble = ""  # the connection problem being retried, if any
        last_answer = ""  # ClusterD's last refusal, for the timeout's detail

        def note(text: str) -> None:
            nonlocal last_note
            if on_note is not None and text != last_note:  # once per outage, not once per retry
                last_note = text
                on_note(text)

        def end(kind: OutcomeKind | None, detail: str = "", rpc_code: str | None = None) -> WatchEnd:
            return WatchEnd(tuple(results), kind, detail, rpc_code)

        def deliver(kind: OutcomeKind, message: str | None, detail: str, ended: float) -> None:
            assert running_at is not None
            at_least = max(0.0, ended - running_at)
            at_most = None if not_running_at is None else max(at_least, ended - not_running_at)
            outcome = Outcome(kind, job_id, message=message, detail=detail, elapsed_s=at_least)
            result = WatchedSwitch(len(results) + 1, outcome, at_least, at_most, time.time())
            results.append(result)
            if on_result is not None:
                on_result(result)

        while True:
            if self._closed.is_set():
                return end(OutcomeKind.CANCELLED, "stopped watching (client closed)")
            if count is not None and len(results) >= count:
                return end(None)
            now = time.monotonic()
            if now >= deadline:
                last = trouble or (f"ClusterD said {last_answer!r}" if last_answer else "")
                text = f"{len(results)} result(s) within {timeout_s:g} s"
                return end(OutcomeKind.TIMED_OUT, text + (f" (last: {last})" if last else ""))
            if now < last_open + poll_s:
                self._pause(last_open + poll_s - now, deadline)
                continue
            opened = last_open = time.monotonic()
            try:
                message = self._one_stream(job_id, None if deadline == math.inf else deadline - opened)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    continue
                code, details = _code_and_details(exc)
                kind = classify_stream_error(exc)
                if kind in (StreamError.NOT_SWITCHING, StreamError.NOT_REGISTERED):
                    if trouble:
                        note("ClusterD answers again")
                    reached, trouble, delays, last_answer = True, "", backoff_delays(), details
                    if ended_empty_at is not None:  # that switch is over, and its result went elsewhere
                        deliver(OutcomeKind.NO_RESULT, None, "the result stream ended without a message and "
                                f"ClusterD now says {details!r}: the switch is over but its result was lost "
                                "(another follower took it, or ClusterD reset the job)", ended_empty_at)
                    not_running_at, running_at, ended_empty_at = opened, None, None
                    if kind is StreamError.NOT_REGISTERED:
                        note(f"ClusterD does not know job {job_id} ({details}); waiting for it to register")
                    continue
                if kind is StreamError.DEADLINE:
                    continue  # the deadline we gave the call: the top of the loop ends the watch
                if kind is StreamError.TRANSIENT and reached:
                    trouble = f"{code}: {details}"
                    note(f"lost ClusterD ({trouble}); retrying")
                    self._pause(next(delays), deadline)
                    continue
                plain = explain_connect_failure(exc, settings_of(self._channel))
                return end(OutcomeKind.RPC_ERROR, f"{code}: {plain or details}", code)
            # ClusterD accepted the stream: a switch was running when it was opened.
            if trouble:
                note("ClusterD answers again")
            reached, trouble, delays = True, "", backoff_delays()
            running_at = opened if running_at is None else running_at
            if message is None:
                if not self._closed.is_set():
                    _LOG.debug("[%s] SubscribeSwitchNicSignal ended without a message; resubscribing", job_id)
                    ended_empty_at = time.monotonic()
                continue
            kind_done = classify_message(message)
            if kind_done is OutcomeKind.FAILED and message not in FAILURE_MESSAGES:
                _LOG.warning("[%s] undocumented O&M message %r, treated as a failure", job_id, message)
            deliver(kind_done, message, "", time.monotonic())
            # ClusterD resets the job before it accepts the next switch: that one starts after now.
            not_running_at, running_at, ended_empty_at = time.monotonic(), None, None

    def switch_and_wait(
        self,
        job_id: str,
        nic_ops: NicOps,
        *,
        timeout_s: float = DEFAULT_FOLLOW_TIMEOUT_S,
        rpc_timeout_s: float | None = None,
    ) -> Outcome:
        """:meth:`switch`, then :meth:`follow` at once (the result stream is only open while the
        switch runs). ``elapsed_s`` counts from the request.

        Raises:
            The errors of :meth:`switch`; the follow itself never raises.
        """
        started = time.monotonic()
        accepted = self.switch(job_id, nic_ops, timeout_s=rpc_timeout_s)
        result = self.follow(job_id, timeout_s, server_seen=True)
        return replace(result, accepted=accepted, elapsed_s=time.monotonic() - started)

    def _one_stream(self, job_id: str, timeout_s: float | None) -> str | None:
        """One SubscribeSwitchNicSignal call: its message, or None on a clean end of stream."""
        call = self._stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=job_id), timeout=timeout_s)
        with self._lock:
            self._call = call
        try:
            if self._closed.is_set():  # close() ran before _call was visible
                call.cancel()
            for response in call:
                if response.jobID and response.jobID != job_id:
                    _LOG.warning("[%s] result for job %r on our stream", job_id, response.jobID)
                return str(response.msg)
            return None
        finally:
            # Frees the server handler if we stop early, and on KeyboardInterrupt in the CLI.
            call.cancel()
            with self._lock:
                self._call = None

    def _pause(self, delay_s: float, deadline: float) -> None:
        """Wait before a retry, never past the deadline; close() wakes it."""
        self._closed.wait(max(0.0, min(delay_s, deadline - time.monotonic())))


def _timeout_detail(timeout_s: float, last_problem: str) -> str:
    text = f"no result within {timeout_s:g} s"
    if last_problem:
        text += f" (last: {last_problem})"
    return text


__all__ = [
    "CODE_BUSY",
    "CODE_INVALID",
    "CODE_OK",
    "DEFAULT_FOLLOW_TIMEOUT_S",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_WATCH_POLL_S",
    "FAILURE_MESSAGES",
    "SWITCH_FINISH",
    "NicOps",
    "OmClient",
    "OmError",
    "OmRpcError",
    "Outcome",
    "OutcomeKind",
    "StreamError",
    "SwitchAccepted",
    "SwitchBusy",
    "SwitchInvalid",
    "SwitchRejected",
    "WatchEnd",
    "WatchedSwitch",
    "backoff_delays",
    "build_switch_request",
    "classify_message",
    "classify_stream_error",
    "describe_nic_ops",
    "op_name",
    "parse_nic_groups",
    "parse_nic_ops",
    "parse_op",
    "validate_nic_ops",
]
