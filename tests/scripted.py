"""A scripted ClusterD for fault tests: a real gRPC server on 127.0.0.1:0 on the exact paths.

Each SubscribeNotifySwitch stream that the client opens takes the next script from
``notify_scripts``; a script is a list of actions run in order (send a list, end cleanly, fail
with a status, hold the stream open). With no script left, a stream is held open until the
client cancels or the server stops. Each ReplySwitchNicResult takes the next action from
``reply_script`` (default: answer code 0). Everything received is recorded.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd import channel as transport


@dataclass(frozen=True)
class Send:
    message: pb.SwitchRankList


@dataclass(frozen=True)
class End:
    """Return normally: the client sees a clean end of stream (status OK)."""


@dataclass(frozen=True)
class Fail:
    code: grpc.StatusCode
    details: str


@dataclass(frozen=True)
class Hold:
    """Keep the stream open until the client cancels, the server stops, or ``until`` is set."""

    until: threading.Event | None = None


@dataclass(frozen=True)
class WaitFor:
    event: threading.Event


@dataclass(frozen=True)
class Answer:
    code: int = 0
    info: str = "reply success"


@dataclass(frozen=True)
class Block:
    """Block the reply handler until ``release`` is set (like ClusterD's full one-slot channel)."""

    release: threading.Event


def rank_list(ranks: list[str], ops: list[bool], job_id: str = "job-1") -> pb.SwitchRankList:
    return pb.SwitchRankList(rankID=ranks, op=ops, jobId=job_id)


class ScriptedClusterD:
    def __init__(self, port: int = 0) -> None:
        self.notify_scripts: deque[list[Any]] = deque()
        self.reply_script: deque[Any] = deque()
        self.replies: list[pb.SwitchResult] = []
        self.opens = 0
        self.open_now = 0
        self.client_infos: list[pb.ClientInfo] = []
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="scripted"))
        self._server.add_generic_rpc_handlers((transport.generic_handler({
            "SubscribeNotifySwitch": self._subscribe,
            "ReplySwitchNicResult": self._reply,
            "HealthCheck": lambda request, context: pb.Status(info=f"jobId={request.jobId}, receive HeathCheck"),
        }),))
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"

    # -- control -----------------------------------------------------------------------------

    def start(self) -> ScriptedClusterD:
        self._server.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._server.stop(grace=0).wait()

    def script(self, *actions: Any) -> None:
        with self._cond:
            self.notify_scripts.append(list(actions))

    def script_only(self, *actions: Any) -> None:
        """The next stream's script, in place of every one still queued: in one hold of the lock, so
        no stream opened between a clear and an append finds the queue empty (and holds, unscripted)."""
        with self._cond:
            self.notify_scripts.clear()
            self.notify_scripts.append(list(actions))

    def wait_for(self, predicate: Callable[[ScriptedClusterD], bool], timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def wait_replies(self, count: int, timeout: float = 10.0) -> list[pb.SwitchResult]:
        assert self.wait_for(lambda s: len(s.replies) >= count, timeout), (
            f"expected {count} replies, got {len(self.replies)}"
        )
        return list(self.replies)

    # -- handlers ----------------------------------------------------------------------------

    def _subscribe(self, request: pb.ClientInfo, context: grpc.ServicerContext) -> Iterator[pb.SwitchRankList]:
        with self._cond:
            self.opens += 1
            self.open_now += 1
            self.client_infos.append(request)
            script = self.notify_scripts.popleft() if self.notify_scripts else [Hold()]
            self._cond.notify_all()
        try:
            for action in script:
                if isinstance(action, Send):
                    yield action.message
                elif isinstance(action, End):
                    return
                elif isinstance(action, Fail):
                    context.abort(action.code, action.details)
                elif isinstance(action, WaitFor):
                    while not action.event.wait(0.02):
                        if not context.is_active() or self._stopping.is_set():
                            return
                elif isinstance(action, Hold):
                    while context.is_active() and not self._stopping.is_set():
                        if action.until is not None and action.until.is_set():
                            break
                        with self._cond:
                            self._cond.wait(0.05)
                    if action.until is None:
                        return
            while context.is_active() and not self._stopping.is_set():  # script done: hold
                with self._cond:
                    self._cond.wait(0.05)
        finally:
            with self._cond:
                self.open_now -= 1
                self._cond.notify_all()

    def _reply(self, request: pb.SwitchResult, context: grpc.ServicerContext) -> pb.Status:
        with self._cond:
            self.replies.append(request)
            action = self.reply_script.popleft() if self.reply_script else Answer()
            self._cond.notify_all()
        if isinstance(action, Fail):
            context.abort(action.code, action.details)
        if isinstance(action, Block):
            action.release.wait(30)
            return pb.Status(info="reply success")
        assert isinstance(action, Answer)
        return pb.Status(code=action.code, info=action.info)
