"""ReplySwitchNicResult, exactly once per received list.

Why "exactly once" is not pedantry: ClusterD pushes every reply into a one-slot channel without
checking its state. A stray reply is taken as the result of the *next* switch, and a reply that
finds the slot full blocks its handler until the next reset, which then panics and kills the
server (docs/clusterd.md#reply-timing-and-the-crash). So a reply is retried only when the failure proves that the
request never reached ClusterD:

- the channel never became ready within the attempt (nothing was sent), or
- gRPC ``UNKNOWN`` "qps exceeded" (ClusterD's rate limiter refused it before the handler ran).

Anything else (DEADLINE_EXCEEDED or UNAVAILABLE on a connected channel, ...) may have been
delivered, so it is reported as ``UNCERTAIN`` and never resent.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tenacity import wait_random_exponential

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ConnectivityWatch, RecoverStub
from nicswitch_agent.clusterd.rpc_policy import bounded, describe, refused_unhandled

logger = logging.getLogger("nicswitch_agent.reply")


class ReplyOutcome(str, Enum):
    DELIVERED = "delivered"  # ClusterD answered code 0
    REJECTED = "rejected"  # ClusterD answered a non-zero code (e.g. 400: job not registered)
    NOT_DELIVERED = "not_delivered"  # provably never reached ClusterD within the budget
    UNCERTAIN = "uncertain"  # may have reached ClusterD; not resent


@dataclass(frozen=True)
class ReplyPolicy:
    """How long to try delivering one reply, and how to pace retries."""

    total_timeout_s: float = 60.0
    attempt_timeout_s: float = 10.0
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0


@dataclass(frozen=True)
class ReplyReport:
    job_id: str
    result: bool
    outcome: ReplyOutcome
    attempts: int
    duration_s: float
    code: int | None = None
    info: str = ""
    error: str = ""
    sent_at: float | None = None  # wall clock as the last call went out (None: no call was sent)

    @property
    def delivered(self) -> bool:
        return self.outcome is ReplyOutcome.DELIVERED


class NotConnected(Exception):
    """The channel did not become ready in time: the request was not sent."""


def is_undelivered(exc: BaseException) -> bool:
    """True only for failures that prove ClusterD never received the request."""
    return isinstance(exc, NotConnected) or refused_unhandled(exc)


class Replier:
    """Sends ReplySwitchNicResult with the retry rules above. Thread-safe; holds no per-order state."""

    def __init__(self, stub: RecoverStub, policy: ReplyPolicy, watch: ConnectivityWatch | None = None) -> None:
        self._stub = stub
        self._policy = policy
        self._owns_watch = watch is None
        self._watch = watch or ConnectivityWatch(stub.channel)

    def close(self) -> None:
        """Drop the connectivity subscription (call before closing the channel)."""
        if self._owns_watch:
            self._watch.close()

    def send(self, job_id: str, result: bool, *, abort: threading.Event | None = None,
             total_timeout_s: float | None = None) -> ReplyReport:
        """Deliver one reply; never raises. ``abort`` cuts retries short (not an attempt in flight)."""
        policy = self._policy
        total = policy.total_timeout_s if total_timeout_s is None else total_timeout_s
        abort = abort or threading.Event()
        started = time.monotonic()
        deadline = started + total
        attempts = 0
        sent_at: float | None = None
        request = pb.SwitchResult(jobId=job_id, result=result)

        def attempt() -> Any:
            nonlocal attempts, sent_at
            attempts += 1
            budget = max(0.001, min(policy.attempt_timeout_s, deadline - time.monotonic()))
            if not self._watch.wait_ready(budget):
                raise NotConnected(f"ClusterD not reachable within {budget:.3g} s")
            budget = max(0.001, min(policy.attempt_timeout_s, deadline - time.monotonic()))
            sent_at = time.time()  # the timeline's "reply sent": the call returns after ClusterD took it
            return self._stub.ReplySwitchNicResult(request, timeout=budget, wait_for_ready=True)

        def pause(seconds: float) -> None:
            abort.wait(max(0.0, min(seconds, deadline - time.monotonic())))

        # Full jitter (a random wait below a bound that doubles): replies from many jobs refused
        # together by ClusterD's rate limiter spread out.
        retrying = bounded(
            is_undelivered,
            within_s=total,
            stop_event=abort,
            wait=wait_random_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s),
            sleep=pause,
        )
        try:
            status = retrying(attempt)
        except BaseException as exc:  # every failure becomes a report
            outcome = ReplyOutcome.NOT_DELIVERED if is_undelivered(exc) else ReplyOutcome.UNCERTAIN
            return ReplyReport(job_id, result, outcome, attempts, time.monotonic() - started,
                               error=describe(exc), sent_at=sent_at)
        code = int(status.code)
        outcome = ReplyOutcome.DELIVERED if code == 0 else ReplyOutcome.REJECTED
        return ReplyReport(job_id, result, outcome, attempts, time.monotonic() - started, code=code,
                           info=status.info, sent_at=sent_at)

