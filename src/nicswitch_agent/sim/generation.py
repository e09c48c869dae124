"""What one reset of a simulated job throws away: its generation of one-slot channels.

A reset closes the :class:`Generation` and opens a new one, so every stream, wait and blocked
call of the old one ends; stream handlers keep the generation they started in, as upstream
handlers keep the context and channel they grabbed at subscribe time
(docs/clusterd.md#delivery-of-the-rank-list). Plain data: the controller's lock guards it.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from nicswitch_agent._pb import recover_pb2 as pb

_M = TypeVar("_M", pb.ProcessManageSignal, pb.SwitchRankList)

UNCONFIRMED_LIST = (
    "rank list handed to a SubscribeNotifySwitch stream that ended before the send completed, and no "
    "reply came: the subscriber may never have seen it, and ClusterD waits for a reply until its report "
    "timeout (docs/clusterd.md#the-reconnect-race)"
)


class Cancelled(Exception):
    """The handler's generation was reset, or the simulator stops (upstream: ``ctx.Done()``)."""


def new_event_id() -> str:
    """A uuid in upstream's ``NewEventId(16)`` style: ``<ns clock, 16 HEX>-<16 random bytes hex>``.

    Observed: ``18ED756E7D881635-b290e7fa92c6d16f97b2a93caddea1a1``.
    """
    return f"{time.time_ns():016X}-{secrets.token_hex(16)}"


def copy_message(message: _M) -> _M:
    """A detached copy: a snapshot must not change when the controller reuses a message."""
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate


@dataclass(eq=False)
class Generation:
    """Everything a reset throws away: upstream's controller context, channels and slices."""

    number: int
    keepalive_due: float
    closed: bool = False
    uuid: str = ""
    events: deque[str] = field(default_factory=deque)
    # One-slot channels (NewEventController / initControllerChan).
    signal: pb.ProcessManageSignal | None = None  # signalChan
    rank_list: pb.SwitchRankList | None = None  # switchRankList
    result: bool | None = None  # switchRankResult
    stop_report: pb.StopCompleteRequest | None = None  # reportStopCompleteChan
    strategy_report: pb.RecoverStrategyRequest | None = None  # reportRecoverStrategyChan
    status_report: pb.RecoverStatusRequest | None = None  # reportStatusChan
    # Simulator bookkeeping: the status report came before a reply that is also pending. A Go
    # select already blocked takes whichever arrives first; a handler thread that wakes late here
    # must do the same rather than prefer the reply.
    status_report_first: bool = False
    om: deque[pb.SwitchNicResponse] = field(default_factory=deque)  # switchNicResponse (10)
    # Stream handlers blocked on a channel, longest-waiting first: a Go channel hands each value
    # to the receiver that has waited longest, so that one gets the next list (or O&M message).
    list_waiters: deque[StreamToken] = field(default_factory=deque)
    om_waiters: deque[StreamToken] = field(default_factory=deque)
    # Controller slices cleaned by reset.
    switch_ranks: list[str] = field(default_factory=list)  # globalSwitchRankIDs
    switch_ops: list[bool] = field(default_factory=list)  # globalOps
    agent_strategies: list[str] = field(default_factory=list)  # agentReportStrategies
    latest_strategy: list[str] = field(default_factory=list)
    latest_results: list[pb.RecoverStatusRequest] = field(default_factory=list)
    # Simulator bookkeeping (not upstream): what a correct client is expected to send next.
    awaiting_reply: bool = False
    # A list handed to a stream that ended before its send was confirmed: UNCONFIRMED_LIST unless
    # a reply in this generation shows the subscriber saw it (streams.rank_list_unconfirmed).
    unconfirmed_send: bool = False
    expecting: set[str] = field(default_factory=set)
    ordered_strategy: str = ""


@dataclass(eq=False)
class StreamToken:
    """One open server stream: its method, the generation it belongs to, and its peer."""

    method: str
    gen: Generation
    peer: str
    dead: bool = False
    in_flight: bool = False


def discard_waiter(waiters: deque[StreamToken], token: StreamToken) -> None:
    if token in waiters:
        waiters.remove(token)
