"""What MindSpore's TCPStore costs the coordination, side by side with torch's, in one run.

``python -m benchmarks.ms_store [--window 10]`` (needs torch and mindspore==2.10.0 with numpy<2,
ci/constraints-mindspore.txt). Prints a JSON line per measure:

- ``round_trip_us``: one call through the backend (median of 2,000, loopback): ``set``, ``get``
  of an existing key, ``check``, ``add``; torch's TCPStore against ``MindSporeStore`` (whose
  ``set`` is two MindSpore calls and whose ``get`` checks first, coordination/ms_store.py);
- ``idle_wait_cpu_pct``: a member-like waiter in a child process, ``KV.get_when_set(key, window)``
  on a key nobody writes, for ``window`` seconds: the child's CPU (% of one core) and the Store
  host's (this process), for torch (one blocking request) and MindSpore (polls every 20 ms);
- ``wake_ms``: a child waiting for a key this process then writes: set -> the child has the value
  (median of 20), for both.

In the suite (``python -m benchmarks --only ms_store``, :func:`run`) the same measures, 10 s idle
window (1 s with ``--quick``); skipped, with the reason as the metric's note, when torch or
MindSpore cannot be imported (the torch-only and the MindSpore-only environments of CI).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import BenchResult, Settings, single_metric

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host(kind: str, port: int) -> Any:
    if kind == "torch":
        from torch.distributed import TCPStore

        return TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    from mindspore.mint.distributed import TCPStore as MsTCPStore

    return MsTCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)


def client(kind: str, port: int) -> Any:
    if kind == "torch":
        from torch.distributed import TCPStore

        return TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
    from nicswitch_agent.coordination.ms_store import MindSporeStore

    return MindSporeStore("127.0.0.1", port, 60.0)


def round_trips(kind: str, port: int, n: int = 2000) -> dict[str, float]:
    store = client(kind, port)
    store.set("rt/k", "v")
    calls = {"set": lambda: store.set("rt/k", "v"), "get": lambda: store.get("rt/k"),
             "check": lambda: store.check(["rt/k"]), "add": lambda: store.add("rt/n", 1)}
    out = {}
    for name, call in calls.items():
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t)
        out[name] = round(statistics.median(samples) * 1e6, 1)
    return out


def child(kind: str, port: int, mode: str, window: float) -> None:
    from nicswitch_agent.coordination.kv import KV

    kv = KV(client(kind, port), "b")
    print("ready", flush=True)
    if mode == "idle":
        start = time.process_time()
        kv.get_when_set("never", window)
        print(json.dumps({"cpu_s": time.process_time() - start}), flush=True)
        return
    for i in range(20):
        kv.get_when_set(f"wake{i}", 60.0)
        print(json.dumps({"got": i, "t": time.time()}), flush=True)


def spawn(kind: str, port: int, mode: str, window: float) -> subprocess.Popen[str]:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # the caller's too (src/)
    env = {**os.environ, "GLOG_v": "3", "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.ms_store", "--child", kind, str(port), mode,
                             str(window)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def measure(kind: str, window: float) -> dict[str, Any]:
    port = free_port()
    server = host(kind, port)  # noqa: F841 - kept alive for the measure (never destroyed: ms_store.py)
    result: dict[str, Any] = {"backend": kind, "round_trip_us": round_trips(kind, port)}
    proc = spawn(kind, port, "idle", window)
    host_start = time.process_time()
    assert proc.stdout is not None
    cpu = json.loads(proc.stdout.readline())["cpu_s"]
    proc.wait()
    result["idle_wait_cpu_pct"] = {"waiter": round(100 * cpu / window, 3),
                                   "store_host": round(100 * (time.process_time() - host_start) / window, 3)}
    writer = client(kind, port)
    proc = spawn(kind, port, "wake", window)
    lat = []
    for i in range(20):
        time.sleep(0.05)  # not synchronisation: the child is waiting for wake{i} by now
        t = time.time()
        writer.set(f"b/wake{i}", "x")
        lat.append(json.loads(proc.stdout.readline())["t"] - t)
    proc.wait()
    result["wake_ms"] = {"median": round(statistics.median(lat) * 1e3, 2), "max": round(max(lat) * 1e3, 2)}
    return result


def switch_times(kind: str, switches: int, world: int = 4) -> list[float]:
    """Seconds from SwitchNicTrack to "switch nic finish" for ``switches`` switches of a ``world``-process
    job over ``kind``'s TCPStore (benchmarks/_ms_switch_worker.py), pause mode agent, the simulator as
    ClusterD: the same job and the same operator for both kinds."""
    import tempfile

    from nicswitch_agent._pb import recover_pb2 as pb
    from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
    from nicswitch_agent.sim import SimJob, SimSettings, Simulator

    job = f"ms-store-{kind}"
    settings = SimSettings(report_timeout_s=60.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                           schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
    times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, Simulator(jobs=[SimJob(
            job_id=job, nodes={"node-0": [str(d) for d in range(world)]},
            framework="pytorch" if kind == "torch" else kind)], settings=settings) as sim:
        stop, port = os.path.join(tmp, "stop"), free_port()
        path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        procs = []
        for rank in range(world):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("NICSWITCH_", "MS_", "NSW_"))}
            env.update({"GLOG_v": "3", "PYTHONPATH": path, "NSW_KIND": kind, "NSW_RANK": str(rank),
                        "NSW_WORLD": str(world), "NSW_STORE_PORT": str(port), "NSW_STOP": stop,
                        "NICSWITCH_SERVER": sim.address, "NICSWITCH_JOB_ID": job, "NICSWITCH_FRAMEWORK": kind,
                        "NICSWITCH_PAUSE": "agent"})
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks._ms_switch_worker"], env=env, cwd=ROOT,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        channel = open_channel(ChannelSettings(target=sim.address))
        try:
            stub = RecoverStub(channel)

            def idle(s: Simulator) -> bool:
                view = s.job_view(job)
                return view.state == "INIT" and view.open_streams.get("SubscribeProcessManageSignal", 0) == 1 and (
                    view.open_streams.get("SubscribeNotifySwitch", 0) == 1)

            deadline = time.monotonic() + 90  # a rank that starts after a pause was published never sees it
            while not all(os.path.exists(f"{stop}.ready{rank}") for rank in range(world)):
                if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
                    raise RuntimeError(f"{kind}: the ranks did not all start stepping")
                time.sleep(0.05)
            for index in range(switches):
                if not sim.wait_until(idle, 90):
                    raise RuntimeError(f"{kind}: the job's agent did not come up (or back) within 90 s")
                request = pb.SwitchNics(jobID=job)
                request.nicOps["node-0"].dev.extend([str(world - 1), "0"])
                request.nicOps["node-0"].op.extend([index % 2 == 0, False])
                began = time.perf_counter()
                if stub.SwitchNicTrack(request, timeout=5).code != 0:
                    raise RuntimeError(f"{kind}: SwitchNicTrack refused")
                message = next(iter(stub.SubscribeSwitchNicSignal(pb.SwitchNicRequest(jobID=job), timeout=60)))
                if message.msg != "switch nic finish":
                    raise RuntimeError(f"{kind}: switch {index + 1}: {message.msg!r}")
                times.append(time.perf_counter() - began)
        finally:
            channel.close()
            Path(stop).touch()  # the workers stop
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return times


def unavailable() -> str:
    """Why the measure cannot run here ("" when it can): it needs torch and MindSpore in one process."""
    missing = []
    for module in ("torch.distributed", "mindspore.mint.distributed"):
        try:
            __import__(module)
        except Exception as exc:  # MindSpore under NumPy 2 raises more than ImportError
            missing.append(f"{module.split('.')[0]} ({type(exc).__name__}: {str(exc)[:120]})")
    if not missing:
        return ""
    return (f"skipped: {' and '.join(missing)} not importable; needs torch and mindspore==2.10.0 with numpy<2 "
            "(ci/constraints-mindspore.txt)")


def run(settings: Settings) -> BenchResult:
    result = BenchResult("ms_store", "MindSpore's TCPStore beside torch's (coordination/ms_store.py)",
                         limits="one machine, loopback; the idle waiter is one member-like get_when_set")
    why = unavailable()
    if why:
        result.add(single_metric("not run on this environment", math.nan, "", note=why))
        return result
    os.environ.setdefault("GLOG_v", "3")
    window = settings.pick(1.0, 10.0)
    switches = settings.pick(2, 7)
    medians = {}
    for kind in ("torch", "mindspore"):
        times = switch_times(kind, switches)
        medians[kind] = statistics.median(times) * 1e3
        result.details[f"{kind}_switch_ms"] = [round(t * 1e3, 2) for t in times]
        result.add(single_metric(f"{kind}: switch at 4 processes (median of {switches})", medians[kind], "ms",
                                 note=f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms"))
    result.add(single_metric("MindSpore / torch switch", medians["mindspore"] / medians["torch"], "x",
                             target="<= 2", ok=lambda ratio: ratio <= 2.0))
    for kind in ("torch", "mindspore"):
        measured = measure(kind, window)
        result.details[kind] = measured
        cpu, wake = measured["idle_wait_cpu_pct"], measured["wake_ms"]
        result.add(single_metric(f"{kind}: idle waiter CPU ({window:g} s)", cpu["waiter"], "% of a core"))
        result.add(single_metric(f"{kind}: Store host CPU while it waits", cpu["store_host"], "% of a core"))
        result.add(single_metric(f"{kind}: write -> waiter in another process (median of 20)", wake["median"], "ms",
                                 note=f"max {wake['max']} ms"))
        for call, us in measured["round_trip_us"].items():
            result.add(single_metric(f"{kind}: {call} (median of 2,000)", us, "us"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--child", nargs=4)
    args = parser.parse_args()
    if args.child:
        kind, port, mode, window = args.child
        child(kind, int(port), mode, float(window))
        return
    os.environ.setdefault("GLOG_v", "3")
    print(json.dumps({"load_average": os.getloadavg()}))
    for kind in ("torch", "mindspore"):
        print(json.dumps(measure(kind, args.window)), flush=True)


if __name__ == "__main__":
    main()
