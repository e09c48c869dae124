"""Benchmark 3: a clean end of the notify stream -> the agent's next SubscribeNotifySwitch arrives.

The cycle is the one ClusterD produces after every switch: the stream carries a list, the agent
switches and replies, then the server ends the stream with status OK. Stamps: just before the
server's handler returns, and on entry of the next handler (both server side, one clock). The agent
runs in pause mode external (notify stream only; in pause mode agent the notify stream also waits
for the process-manage stream to reopen first, measured by the e2e benchmark as "reopen").

The floor, interleaved in the same run: a bare grpcio client on a second server that reopens the
stream the moment it ends.
"""

from __future__ import annotations

import time

from benchmarks._common import BenchResult, Settings, dist_metric, ms, percentile, rounds_metric, single_metric
from benchmarks._servers import FloorResubscriber, NotifyServer
from benchmarks.e2e import UPSTREAM_RESUBSCRIBE_S
from benchmarks.notify import Stamps, start_agent
from nicswitch_agent._pb import recover_pb2 as pb

JOB = "bench-notify"  # start_agent's job


def run(settings: Settings) -> BenchResult:
    result = BenchResult("resubscribe", "3. clean end of the notify stream -> next subscribe at the server")
    rounds = settings.pick(1, 5)
    cycles = settings.pick(5, 20)  # per side per round
    server, floor_server = NotifyServer().start(), NotifyServer().start()
    stamps = Stamps()
    agent = start_agent(server.address, stamps)
    floor = FloorResubscriber(floor_server.address)
    gaps: list[float] = []
    floor_gaps: list[float] = []
    ratios: list[float] = []
    try:
        if not server.wait_opened(1) or not floor_server.wait_opened(1):
            raise RuntimeError("the agent never subscribed")
        message = pb.SwitchRankList(rankID=["0"], op=[False], jobId=JOB)
        for r in range(rounds):
            round_agent: list[float] = []
            round_floor: list[float] = []
            for side in (("agent", "floor") if r % 2 == 0 else ("floor", "agent")):
                for _ in range(cycles):
                    if side == "agent":
                        i = len(server.ended)
                        server.send(message)
                        if not server.wait_replies(i + 1):
                            raise RuntimeError("the agent did not reply")
                        server.end()
                        if not server.wait_opened(i + 2, timeout=10):
                            raise RuntimeError(f"the agent did not resubscribe after clean end #{i + 1}")
                        round_agent.append(server.opened[i + 1] - server.ended[i])
                    else:
                        i = len(floor_server.ended)
                        floor_server.end()
                        if not floor_server.wait_opened(i + 2, timeout=10):
                            raise RuntimeError("the floor client did not resubscribe")
                        round_floor.append(floor_server.opened[i + 1] - floor_server.ended[i])
                    time.sleep(0.002)
            gaps += round_agent
            floor_gaps += round_floor
            ratios.append(percentile(round_agent, 50) / percentile(round_floor, 50))
        status = agent.status()
    finally:
        floor.close()
        agent.stop()
        server.stop()
        floor_server.stop()
    gap_ms = [ms(g) for g in gaps]
    result.add(dist_metric("clean end -> next subscribe, p50", gap_ms, "ms", target="< 50 ms", ok=lambda v: v < 50))
    result.add(dist_metric("clean end -> next subscribe, p99", gap_ms, "ms", q=99))
    result.add(dist_metric("floor: bare grpcio client reopening at once", [ms(g) for g in floor_gaps], "ms"))
    result.add(rounds_metric("p50 / floor", ratios, "x", note=f"{cycles} cycles per side per round"))
    result.add(single_metric("upstream TaskD: sleep after a clean end (stated, not measured)",
                             ms(UPSTREAM_RESUBSCRIBE_S), "ms", note="manager.go: waitGapTime = 1 s after io.EOF"))
    result.add(single_metric("upstream's sleep / our p50", UPSTREAM_RESUBSCRIBE_S * 1000 / percentile(gap_ms, 50), "x"))
    result.details = {"stream": status["stream"], "cycles": len(gaps)}
    result.limits = (
        "The reopen is immediate (resubscribe_after_eof_s = 0): what remains is the trailers reaching the "
        "client, the notify thread's loop, and a new call's HTTP/2 stream on the open connection."
    )
    return result
