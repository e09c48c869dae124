"""Benchmark 5 (part 1): a 65,536-rank SwitchRankList, and what the leader's Store traffic costs at scale.

The list's path through the agent, each stage with the library's own code, in a child process (so its
peak resident memory is measured cleanly, C allocations included):

1. parse: ``SwitchRankList.FromString`` of the bytes as received;
2. validate + enqueue: the notify thread's ``SwitchAgent._on_list`` (validation, log line, event, queue)
   on an agent configured for a 65,536-rank job;
3. fan out + aggregate: ``Coordinator.run`` with real ``Member`` threads on an InProcessStore: the order
   is encoded once, every member reads and decodes it, runs the (no-op) hook and answers; the leader
   gathers the answers. With one member this is the job's critical path when members are processes
   of their own (they decode in parallel); with four members in one process they take turns on the GIL.

The wire is measured separately: a bare grpcio stream carrying the same message on loopback.

The leader's Store round trips per switch (one multi_set per event, counters polled, one multi_get
per answer kind; the cleanup thread's deletes are not counted) are counted in small thread jobs (2
and 8 ranks), fitted as a + b x ranks, and multiplied by a TCPStore round trip measured here: an
extrapolation, stated as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, BenchResult, Settings, median, ms, single_metric

JOB = "bench-scale"
RANKS = 65_536


def make_message(ranks: int) -> bytes:
    from nicswitch_agent._pb import recover_pb2 as pb

    message = pb.SwitchRankList(rankID=[str(r) for r in range(ranks)], op=[r % 2 == 0 for r in range(ranks)],
                                jobId=JOB)
    data: bytes = message.SerializeToString()
    return data


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child_main(ranks: int, reps: int, members_list: list[int]) -> dict[str, Any]:
    """Time the stages of one list ``reps`` times; then its memory peak."""
    import logging
    import threading

    from benchmarks._common import quiet_logging
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent._pb import recover_pb2 as pb
    from nicswitch_agent.coordination import KIND_SWITCH, KV, Coordinator, InProcessStore, Member, MemberHooks
    from nicswitch_agent.coordination import messages as proto
    from nicswitch_agent.coordination.parking import ParkingLot
    from nicswitch_agent.orders import RankMap

    quiet_logging()
    logging.getLogger("nicswitch_agent").setLevel(logging.INFO)  # the agent's real log call, formatted
    logging.getLogger("nicswitch_agent").addHandler(logging.NullHandler())
    logging.getLogger("nicswitch_agent").propagate = False
    data = make_message(ranks)
    agent = SwitchAgent(server="127.0.0.1:1", job_id=JOB, pause="external", switch_hook=lambda order: True,
                        world_size=ranks, rank=0)

    def stages(members: int) -> dict[str, float]:
        store = InProcessStore()
        kv = KV(store, proto.key_prefix(JOB))
        threads = []
        for r in range(members):
            member = Member(kv.clone(), r, ParkingLot(),
                            MemberHooks(switch_hook=lambda order: True, checkpoint_hook=None, guard_timeout_s=60,
                                        switch_timeout_s=60, dry_run=False,
                                        local_ranks=RankMap(1, r).local_ranks),
                            lambda: 0)
            member.start()
            threads.append(member)
        coordinator = Coordinator(kv.clone(), members)
        t0 = time.perf_counter()
        message = pb.SwitchRankList.FromString(data)
        t1 = time.perf_counter()
        agent._on_list(message)
        owed = agent._executor.queue.get_nowait()
        t2 = time.perf_counter()
        assert owed is not None and owed.order is not None, owed.rejection if owed else "nothing queued"
        outcome = coordinator.run(owed.order, kind=KIND_SWITCH, budget_s=120)
        t3 = time.perf_counter()
        assert outcome.ok, outcome.reason
        for member in threads:
            member.stop()
        encoded = proto.encode_order(owed.order)
        t4 = time.perf_counter()
        proto.decode_order(encoded)
        t5 = time.perf_counter()
        return {"parse": t1 - t0, "validate": t2 - t1, "run": t3 - t2, "decode": t5 - t4,
                "order_json_bytes": len(encoded)}

    # Memory first, on the first pass: resident peak above the settled process (VmHWM reset through
    # /proc/self/clear_refs), then Python's own allocation peak (tracemalloc) on a second pass.
    rss_before = _vm("VmRSS")
    reset = _reset_hwm()
    hwm_before = _vm("VmHWM")
    stages(1)
    hwm_after = _vm("VmHWM")
    tracemalloc.start()
    stages(1)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    timings: dict[int, list[dict[str, float]]] = {m: [] for m in members_list}
    for _ in range(reps):
        for m in members_list:
            timings[m].append(stages(m))
    return {
        "ranks": ranks,
        "message_bytes": len(data),
        "timings": {str(m): v for m, v in timings.items()},
        "rss_before_kb": rss_before,
        "hwm_before_kb": hwm_before,
        "hwm_after_kb": hwm_after,
        "hwm_reset": reset,
        "rss_peak_growth_kb": max(0, hwm_after - (hwm_before if reset else max(hwm_before, rss_before))),
        "traced_peak_bytes": traced_peak,
        "threads_left": threading.active_count(),
    }


def tcpstore_child(ops: int) -> dict[str, Any]:
    """Round trip of one TCPStore call on loopback (server in this process, a client clone)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import warnings

    warnings.filterwarnings("ignore")
    import datetime

    import torch.distributed as dist

    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]
    server = tcp_store("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    client = tcp_store("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    out: dict[str, Any] = {}
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("check", lambda: client.check(["k"])), ("get", lambda: client.get("k")),
        ("set", lambda: client.set("k", "v")), ("add", lambda: client.add("n", 1)),
    ]
    for name, call in calls:
        samples = []
        for _ in range(ops):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        out[name] = median(samples)
    return out


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCH_CPP_LOG_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"scale child {args} failed: {proc.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def wire_time(data: bytes, reps: int) -> float:
    """Bare grpcio stream, loopback: yield -> received (deserialised) for ``data``."""
    from benchmarks._servers import FloorClient, NotifyServer
    from nicswitch_agent._pb import recover_pb2 as pb

    message = pb.SwitchRankList.FromString(data)
    server = NotifyServer().start()
    client = FloorClient(server.address)
    samples = []
    try:
        server.wait_opened(1)
        for i in range(reps):
            server.send(message)
            if not client.wait_received(i + 1, 30):
                raise RuntimeError("the large message never arrived")
            samples.append(client.received[i] - server.sent[i])
    finally:
        client.close()
        server.stop()
    return median(samples)


def run(settings: Settings) -> BenchResult:
    from benchmarks.e2e import leader_store_per_switch, run_thread_job

    result = BenchResult("scale_list", "5a. a 65,536-rank SwitchRankList: validate, fan out, aggregate; "
                                       "leader Store traffic at scale")
    reps = settings.pick(1, 5)
    big = _child(["--child", "--ranks", str(RANKS), "--reps", str(reps), "--members", settings.pick("1", "1,4")], 300)
    # A quarter of the ranks shows how memory grows (skipped in quick mode, where it would say the same).
    small = big if settings.quick else _child(["--child", "--ranks", str(RANKS // 4), "--reps", "1",
                                               "--members", "1"], 300)
    t1 = big["timings"]["1"]
    t4 = big["timings"].get("4", [])
    parse = median([t["parse"] for t in t1])
    validate = median([t["validate"] for t in t1])
    run1 = median([t["run"] for t in t1])
    total = median([t["parse"] + t["validate"] + t["run"] for t in t1])
    result.add(single_metric("parse (protobuf FromString)", ms(parse), "ms",
                             note=f"{big['message_bytes'] / 1024:.0f} KiB on the wire"))
    result.add(single_metric("validate + log + event + enqueue (SwitchAgent._on_list)", ms(validate), "ms"))
    result.add(single_metric("fan out + hook + aggregate, 1 member (Coordinator.run)", ms(run1), "ms"))
    result.add(single_metric("total: parse + validate + fan out + aggregate (1 member)", ms(total), "ms",
                             target="< 100 ms", ok=lambda v: v < 100,
                             note=f"median of {len(t1)}; members in their own processes decode in parallel"))
    if t4:
        result.add(single_metric("fan out + aggregate, 4 members as threads of one process", ms(median(
            [t["run"] for t in t4])), "ms", note="members take turns on one GIL"))
    result.add(single_metric("one member: decode the order", ms(median([t["decode"] for t in t1])), "ms",
                             note=f"order JSON {t1[0]['order_json_bytes'] / 1024:.0f} KiB, read by every member"))
    wire = wire_time(make_message(RANKS), settings.pick(2, 5))
    result.add(single_metric("wire: bare grpcio stream message of this size, loopback", ms(wire), "ms"))
    result.add(single_metric("total / wire", total / wire, "x", note="the agent's list handling as a multiple of "
                                                                   "receiving the message"))
    per_rank = big["rss_peak_growth_kb"] * 1024 / RANKS
    result.add(single_metric("memory: resident peak growth", big["rss_peak_growth_kb"] / 1024, "MB",
                             target="bounded", ok=lambda v: v < 256,
                             note=f"{per_rank:.0f} B per rank; {small['ranks']:,} ranks: "
                                  f"{small['rss_peak_growth_kb'] / 1024:.1f} MB"))
    result.add(single_metric("memory: Python allocation peak (tracemalloc)", big["traced_peak_bytes"] / 2**20, "MB",
                             note=f"{small['ranks']:,} ranks: {small['traced_peak_bytes'] / 2**20:.1f} MB "
                                  f"({big['traced_peak_bytes'] / max(1, small['traced_peak_bytes']):.2f}x "
                                  f"for {RANKS / small['ranks']:g}x the ranks)"))

    # Leader Store traffic: count in small jobs, fit, extrapolate with a measured TCPStore round trip.
    counts = {}
    for world in (2, 8):
        _, ranks = run_thread_job(world, 0.01, settings.pick(1, 3), settings.seed + world)
        counts[world] = leader_store_per_switch(ranks, settings.pick(1, 3))
    slope = (counts[8]["round_trips"] - counts[2]["round_trips"]) / 6
    base = counts[2]["round_trips"] - 2 * slope
    set_slope = (counts[8]["sets"] - counts[2]["sets"]) / 6
    # The TCPStore round trip needs torch (a 3 s import): measured in full runs only.
    store = {"check": 50e-6, "get": 50e-6, "add": 50e-6, "set": 2e-6, "assumed": 1.0} if settings.quick else \
        _child(["--tcpstore", "--ops", "2000"], 300)
    rtt = median([store["check"], store["get"], store["add"]])
    projected = (base + slope * RANKS) * rtt + set_slope * RANKS * store["set"]
    result.add(single_metric("leader Store round trips per switch, per rank", slope, "",
                             note=f"fit {base:.0f} + {slope:.1f} x ranks (+ {set_slope:.1f} set() per rank), from "
                                  "2- and 8-rank thread jobs"))
    result.add(single_metric("TCPStore round trip (check/get/add), loopback" + (" (assumed in quick mode)" if
                             settings.quick else ""), store["check"] * 1e6, "us",
                             note=f"get {store['get'] * 1e6:.0f} us, add {store['add'] * 1e6:.0f} us, "
                                  f"set {store['set'] * 1e6:.0f} us (not acknowledged)"))
    result.add(single_metric(f"leader Store time per switch at {RANKS:,} ranks (extrapolated)", projected, "s",
                             note="sequential round trips on the leader's one connection; stated, not measured"))
    result.details = {"list": big, "list_quarter": small, "leader_store_per_switch": counts, "tcpstore_s": store}
    result.limits = (
        "List handling is linear in the list and dominated by per-entry Python work (the log line and event, "
        "building tuples; ids are checked by one regex over the joined list). Members get the order as base64 "
        "uint32 ranks and a 0/1 string. The leader's Store traffic is a few round trips per event whatever the "
        "ranks (multi_set, counters, multi_get), though each carries data for every rank; an epoch's keys are "
        "deleted one by one on a cleanup thread, off the switch's path."
    )
    return result


def _cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--tcpstore", action="store_true")
    parser.add_argument("--ranks", type=int, default=RANKS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--members", default="1")
    parser.add_argument("--ops", type=int, default=1000)
    args = parser.parse_args()
    if args.tcpstore:
        print(json.dumps(tcpstore_child(args.ops)))
    else:
        print(json.dumps(child_main(args.ranks, args.reps, [int(m) for m in args.members.split(",")])))


if __name__ == "__main__":
    _cli()
