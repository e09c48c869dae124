"""A raw server that sends malformed and oversized messages: the agent says so, keeps running,
and never replies for a list it could not decode."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent._pb import recover_pb2 as pb

pytestmark = pytest.mark.timeout(30)


class RawServer:
    """SubscribeNotifySwitch sends the scripted raw byte strings, one stream each, then a valid list."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = list(payloads)
        self.replies: list[pb.SwitchResult] = []
        self.opens = 0
        self.cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.max_send_message_length", 64 << 20)])
        handlers = {
            # Identity serializer: whatever bytes the script holds go on the wire as the message.
            "SubscribeNotifySwitch": grpc.unary_stream_rpc_method_handler(
                self._subscribe, request_deserializer=pb.ClientInfo.FromString, response_serializer=lambda b: b),
            "ReplySwitchNicResult": grpc.unary_unary_rpc_method_handler(
                self._reply, request_deserializer=pb.SwitchResult.FromString,
                response_serializer=pb.Status.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("Recover", handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _subscribe(self, request: pb.ClientInfo, context: Any) -> Iterator[bytes]:
        with self.cond:
            self.opens += 1
            payload = self.payloads.pop(0) if self.payloads else None
            self.cond.notify_all()
        if payload is not None:
            yield payload
            return
        yield pb.SwitchRankList(rankID=["0"], op=[True], jobId="job-1").SerializeToString()
        while context.is_active():
            with self.cond:
                self.cond.wait(0.05)

    def _reply(self, request: pb.SwitchResult, context: Any) -> pb.Status:
        with self.cond:
            self.replies.append(request)
            self.cond.notify_all()
        return pb.Status(info="reply success")

    def stop(self) -> None:
        self.server.stop(0).wait()


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",  # not a protobuf message at all
    b"\x0a\x05ab",  # a length-delimited field cut short
    pb.SwitchRankList(rankID=["1"] * 300_000, op=[True] * 300_000, jobId="job-1").SerializeToString(),  # > 1 MiB
], ids=["garbage", "truncated", "oversized"])
def test_undecodable_or_oversized_list_gets_no_reply_and_the_agent_goes_on(payload: bytes) -> None:
    server = RawServer([payload])
    calls: list[SwitchOrder] = []
    replied = threading.Event()
    agent = SwitchAgent(server=server.address, job_id="job-1", pause="external", switch_hook=calls.append,
                        max_message_bytes=1 << 20, reconnect_initial_s=0.01, reconnect_max_s=0.05,
                        on_event=lambda e: e.kind == "reply_sent" and replied.set()).start()
    try:
        assert replied.wait(15), agent.status()
        # Exactly one reply: for the valid list that followed, never for the bytes it could not decode.
        assert [r.result for r in server.replies] == [True]
        assert [c.ranks for c in calls] == [(0,)]
        status = agent.status()
        assert status["stream"]["errors"] >= 1
        # The stream works again (a list came on it): no error now, the bad bytes' error in the history.
        seen = status["last_error_seen"]["error"]
        assert status["last_error"] == "" and (("INTERNAL" in seen) or ("RESOURCE_EXHAUSTED" in seen)), status
        assert status["counters"]["lists_received"] == 1
    finally:
        agent.stop()
        server.stop()
