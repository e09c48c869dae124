"""What ClusterD answers an operator, as values: the errors of ``SwitchNicTrack``, the outcome of
following ``SubscribeSwitchNicSignal``, and what each message or stream error means.

The messages are ClusterD's verbatim (docs/clusterd.md#the-operators-result-stream); this module
only names and classifies them. The calls themselves live in :mod:`nicswitch_agent.ops.om` and
:mod:`nicswitch_agent.ops.om_follow`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from nicswitch_agent.clusterd.channel import ChannelSettings, explain_connect_failure
from nicswitch_agent.clusterd.rpc_policy import Kind, classify
from nicswitch_agent.errors import NicSwitchError

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
        code, details = code_and_details(exc)
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
    UNREACHABLE = "unreachable"  # ClusterD answered, then stayed unreachable past the follow's limit
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
        stopped: None when ``count`` results arrived; else TIMED_OUT, CANCELLED, RPC_ERROR
            or UNREACHABLE (ClusterD silent for ``max_unreachable_s`` after it had answered).
        detail: why it stopped, in words.
        rpc_code: the gRPC code of an RPC_ERROR or UNREACHABLE.
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


def code_and_details(exc: BaseException) -> tuple[str, str]:
    """A gRPC error's code name and ClusterD's words (the whole error when it has none)."""
    failure = classify(exc)
    return failure.code_name, failure.details or str(exc)


def classify_stream_error(exc: grpc.RpcError) -> StreamError:
    """What an error ending SubscribeSwitchNicSignal means for the follower (table-tested)."""
    return _STREAM_ERRORS.get(classify(exc).kind, StreamError.FATAL)


__all__ = [
    "CODE_BUSY",
    "CODE_INVALID",
    "CODE_OK",
    "FAILURE_MESSAGES",
    "SWITCH_FINISH",
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
    "classify_message",
    "classify_stream_error",
    "code_and_details",
]
