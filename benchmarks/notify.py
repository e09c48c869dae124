"""Benchmark 2: the server sends a SwitchRankList -> the switch hook starts (one process, loopback).

The server is a scripted ``Recover`` server (:class:`~benchmarks._servers.NotifyServer`) that stamps
just before it yields the list; the hook stamps first thing. The agent runs as a single rank in pause
mode external (no pause needed before the list), so the path is the agent's whole list path: notify
thread (validate, enqueue) -> executor -> coordinator -> member -> hook thread.

The floor, measured in the same run and interleaved round by round: a bare grpcio client on a second,
identical server reading the same stream message (yield -> received), plus one unary HealthCheck
round trip. Our latency is reported as a multiple of that floor.
"""

from __future__ import annotations

import threading
import time

from benchmarks._common import (
    BenchResult,
    Settings,
    dist_metric,
    ms,
    percentile,
    rounds_metric,
    single_metric,
)
from benchmarks._servers import FloorClient, NotifyServer
from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.observability.events import AgentEvent

JOB = "bench-notify"


class Stamps:
    def __init__(self) -> None:
        self.hook: list[float] = []
        self.on_list: list[float] = []
        self.received_event: list[float] = []
        self.cond = threading.Condition()

    def hook_called(self, order: SwitchOrder) -> bool:
        with self.cond:
            self.hook.append(time.monotonic())
            self.cond.notify_all()
        return True

    def on_event(self, event: AgentEvent) -> None:
        if event.kind == "list_received":
            self.received_event.append(event.mono)


def start_agent(address: str, stamps: Stamps) -> SwitchAgent:
    agent = SwitchAgent(server=address, job_id=JOB, pause="external", switch_hook=stamps.hook_called,
                        on_event=stamps.on_event)
    agent.start()
    subscriber = agent._session.subscriber  # benchmark instrumentation: stamp the notify thread's callback
    assert subscriber is not None
    on_list = subscriber._on_list

    def stamped(message: pb.SwitchRankList) -> None:
        stamps.on_list.append(time.monotonic())
        on_list(message)

    subscriber._on_list = stamped
    return agent


def run(settings: Settings) -> BenchResult:
    result = BenchResult("notify_to_hook", "2. list sent by the server -> switch hook starts, against a bare "
                                           "grpcio floor")
    rounds = settings.pick(2, 7)
    per_round = settings.pick(10, 60)
    message = pb.SwitchRankList(rankID=["0"], op=[True], jobId=JOB)
    agent_server, floor_server = NotifyServer().start(), NotifyServer().start()
    stamps = Stamps()
    agent = start_agent(agent_server.address, stamps)
    floor = FloorClient(floor_server.address)
    latencies: list[float] = []
    wire, validate, dispatch = [], [], []
    floor_stream: list[float] = []
    floor_unary: list[float] = []
    floor_total: list[float] = []
    ratios, ratios_stream = [], []
    try:
        if not agent_server.wait_opened(1) or not floor_server.wait_opened(1):
            raise RuntimeError("streams did not open")
        time.sleep(0.2)
        for r in range(rounds):
            round_agent: list[float] = []
            round_floor: list[float] = []
            round_stream: list[float] = []
            for side in (("agent", "floor") if r % 2 == 0 else ("floor", "agent")):
                for _ in range(per_round):
                    if side == "agent":
                        i = len(agent_server.sent)
                        agent_server.send(message)
                        if not agent_server.wait_replies(i + 1):
                            raise RuntimeError("the agent did not reply")
                        with stamps.cond:
                            stamps.cond.wait_for(lambda: len(stamps.hook) > len(agent_server.sent) - 1, 5)
                        sent = agent_server.sent[i]
                        latency = stamps.hook[i] - sent
                        round_agent.append(latency)
                        wire.append(stamps.on_list[i] - sent)
                        validate.append(stamps.received_event[i] - stamps.on_list[i])
                        dispatch.append(stamps.hook[i] - stamps.received_event[i])
                    else:
                        i = len(floor_server.sent)
                        floor_server.send(message)
                        if not floor.wait_received(i + 1):
                            raise RuntimeError("the floor client received nothing")
                        stream = floor.received[i] - floor_server.sent[i]
                        unary = floor.unary()
                        floor_stream.append(stream)
                        floor_unary.append(unary)
                        round_stream.append(stream)
                        round_floor.append(stream + unary)
                    time.sleep(0.002)  # let every thread go back to idle
            latencies += round_agent
            floor_total += round_floor
            ratios.append(percentile(round_agent, 50) / percentile(round_floor, 50))
            ratios_stream.append(percentile(round_agent, 50) / percentile(round_stream, 50))
    finally:
        floor.close()
        agent.stop()
        agent_server.stop()
        floor_server.stop()
    lat_ms = [ms(v) for v in latencies]
    result.add(dist_metric("list sent -> hook starts, p50", lat_ms, "ms"))
    result.add(dist_metric("list sent -> hook starts, p99", lat_ms, "ms", q=99, target="< 10 ms",
                           ok=lambda v: v < 10))
    result.add(dist_metric("floor: stream message (yield -> received)", [ms(v) for v in floor_stream], "ms"))
    result.add(dist_metric("floor: one unary round trip", [ms(v) for v in floor_unary], "ms"))
    result.add(dist_metric("floor: stream message + unary", [ms(v) for v in floor_total], "ms"))
    result.add(rounds_metric("p50 / floor (stream + unary)", ratios, "x", target="<= 3x", ok=lambda v: v <= 3,
                             note=f"{per_round} samples per side per round, sides alternate"))
    result.add(rounds_metric("p50 / stream message alone", ratios_stream, "x"))
    result.add(dist_metric("part: server yield -> notify callback", [ms(v) for v in wire], "ms"))
    result.add(dist_metric("part: validate + enqueue", [ms(v) for v in validate], "ms"))
    result.add(dist_metric("part: executor -> coordinator -> member -> hook thread", [ms(v) for v in dispatch], "ms"))
    result.add(single_metric("samples", len(latencies), ""))
    result.limits = (
        "After the wire, the list crosses four threads (notify -> executor -> member -> a fresh hook thread), "
        "each a GIL hand-off, and the coordinator's Store writes; with the server in the same process every "
        "hand-off competes with gRPC's own threads on 2 cores."
    )
    return result
