"""``python -m benchmarks.wake_cost [--n N]``: what one Store request and one thread hand-off cost
on this machine, the units a rank's coordination bill is made of (docs/performance.md "The floor").

Each line is the CPU of the thread (or process) that pays it, median of 5 batches of N:

- a request that waits for its reply (``get`` of a key that exists; ``queue_pop`` of a queued value);
- a request that does not (``set``, ``queue_push``);
- a ``queue_pop`` that blocks until another thread pushes 2 ms later: the reader sleeps and is woken;
- a ``threading.Event`` hand-off between two threads (the woken thread's CPU: what a member pays
  each time it waits for the training thread, and the other way round);
- the Store server's CPU per request (the TCPStore's host in a process of its own, libuv backend).

Standalone, not in ``python -m benchmarks``: a reference for the floor, not a target.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

GAP_S = 0.002  # the writer's pause before each push a blocked reader waits for


def _batches(fn: Callable[[int], float], n: int, batches: int = 5) -> float:
    return statistics.median(fn(n) for _ in range(batches))


def _per_call(call: Callable[[], Any], n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        call()
    return (time.thread_time() - start) / n * 1e6


def _woken_pop(reader: Any, writer: Any, n: int) -> float:
    spent: list[float] = []

    def read() -> None:
        start = time.thread_time()
        for _ in range(n):
            reader.queue_pop("woken")
        spent.append((time.thread_time() - start) / n * 1e6)

    thread = threading.Thread(target=read)
    thread.start()
    for _ in range(n):
        time.sleep(GAP_S)
        writer.queue_push("woken", "v")
    thread.join()
    return spent[0]


def _hand_off(n: int) -> float:
    go, back, spent = threading.Event(), threading.Event(), []

    def woken() -> None:
        start = time.thread_time()
        for _ in range(n):
            go.wait()
            go.clear()
            back.set()
        spent.append((time.thread_time() - start) / n * 1e6)

    thread = threading.Thread(target=woken)
    thread.start()
    for _ in range(n):
        time.sleep(GAP_S)
        go.set()
        back.wait()
        back.clear()
    thread.join()
    return spent[0]


def _host() -> None:
    """The child: host a TCPStore, print its port, report this process's CPU on request."""
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    print(master.port, flush=True)
    for _ in sys.stdin:
        print(time.process_time(), flush=True)


def measure(n: int) -> dict[str, float]:
    """Each unit cost in microseconds of CPU."""
    from torch.distributed import TCPStore

    host = subprocess.Popen([sys.executable, "-m", "benchmarks.wake_cost", "--host"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdin is not None
        port = int(host.stdout.readline())
        a = TCPStore("127.0.0.1", port, is_master=False, use_libuv=True)
        b = TCPStore("127.0.0.1", port, is_master=False, use_libuv=True)
        a.set("x", "1")

        def host_cpu() -> float:
            assert host.stdin is not None and host.stdout is not None
            host.stdin.write("\n")
            host.stdin.flush()
            return float(host.stdout.readline())

        def server_per_request(count: int) -> float:
            before = host_cpu()
            for _ in range(count):
                a.get("x")
            return (host_cpu() - before) / count * 1e6

        def pushed_then_popped(count: int) -> float:
            for _ in range(count):
                a.queue_push("q", "v")
            return _per_call(lambda: a.queue_pop("q"), count)

        return {
            "request with a reply (get)": _batches(lambda k: _per_call(lambda: a.get("x"), k), n),
            "queue_pop of a queued value": _batches(pushed_then_popped, n),
            "request without a reply (set)": _batches(lambda k: _per_call(lambda: a.set("y", "1"), k), n),
            "queue_push": _batches(lambda k: _per_call(lambda: a.queue_push("p", "v"), k), n),
            "queue_pop woken by a push 2 ms later (reader)": _batches(lambda k: _woken_pop(a, b, k), n),
            "thread hand-off (threading.Event, the woken thread)": _batches(_hand_off, n),
            "Store server per request (get)": _batches(server_per_request, n),
        }
    finally:
        host.kill()
        host.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="calls per batch (5 batches)")
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host:
        _host()
        return
    for name, us in measure(args.n).items():
        print(f"{name:52s} {us:7.1f} us of CPU")


if __name__ == "__main__":
    main()
