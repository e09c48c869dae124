"""Benchmark 7: the real coordination at thousands of ranks over ONE real torch TCPStore.

What one switch in pause mode ``agent`` costs the job's Store as the job grows: the library's own
:class:`~nicswitch_agent.coordination.Coordinator` (the leader) and one
:class:`~nicswitch_agent.coordination.Member` plus one ParkingLot and one training thread per rank,
all on one ``torch.distributed.TCPStore`` whose server runs in a process of its own, so its CPU,
its sockets and its bytes can be read from ``/proc/<pid>``.

Processes (all children of the benchmark, all on CLOCK_MONOTONIC):

- ``server``: the TCPStore server (libuv, as torch 2.x makes it), nothing else;
- ``node`` x K: one "node" of ranks each (LOCAL_WORLD_SIZE = ranks / K, as torchrun would set it),
  ranks as threads: per rank a Member (its Store connections made exactly as ``SwitchAgent`` makes
  them: ``kv.clone()`` for the member, one more clone in ``Member.start()`` to wake it on stop), a
  ParkingLot and a training thread that calls what ``agent.step()`` does;
- ``leader``: the Coordinator on its own clone, as the leader's agent makes it.

One switch = pause request -> all parked (``Coordinator.pause``), order out -> all results
(``Coordinator.run``, which also publishes the outcome), release -> every training thread resumed
(``Coordinator.release``; the resume is stamped on the training threads). The training threads are
blocked between steps while idle and step at once when a pause arms them: the pause phase holds no
wait for a step boundary, only coordination.

Counted per switch (window: pause start -> every rank resumed and the leader's key cleanup done, so
each window holds one cleanup, of the previous switch's keys; one warm-up switch comes first):

- Store requests, by call, in every process (a wrapper around each Store client, clones included);
- the server's ``read()``/``write()`` calls and bytes (``/proc/<pid>/io``: libuv reads and writes
  TCP sockets with read/write, so ``rchar``/``wchar`` are the bytes on the wire at the server);
- the server's CPU time (``/proc/<pid>/task/*/schedstat``, nanoseconds; ``/proc/<pid>/stat`` ticks
  as a cross-check);
- sockets: the server process's open sockets (``/proc/<pid>/fd``) minus its own before any client.

Then a least-squares fit ``a + b x ranks`` of the server's CPU and of the wall time per switch,
extrapolated to 16,384 ranks. The file-descriptor soft limit is raised to the hard limit first;
sizes the machine cannot host (descriptors on the Store's host, thread ids, ephemeral ports) are
skipped with the reason.

The server listens on an IPv4 socket handed to TCPStore (``master_listen_fd``): torch's default
dual-stack listener makes the server's one event-loop thread reverse-resolve every new client
(``::ffff:127.0.0.1`` is in no hosts file), and where the resolver drops a query that freezes the
whole Store for 5 s: resolver time, not coordination time. ``--dual-stack`` measures with it.

Thousands of ranks in one interpreter need two adjustments that touch no Store key (see
:func:`hosted_slices`; ``--as-is`` turns them off): the library's short wait slices and the
interpreter's 5 ms switch interval are raised in the node processes, or GIL hand-offs eat the cores.

``--ranks-per-node P`` measures node-local fan-out (a relay per node and the node's Store, in its
node process: the node link by default, a 127.0.0.1 TCPStore with ``--node-transport store``;
``--compare`` runs both); ``--nodes-per-group G`` (``auto``: as ``fan_out=group`` picks) adds groups of
nodes: each group's Store is a TCPStore in the node process hosting the group's first node, reached
over loopback TCP from the others, and its requests and its server thread's CPU are counted per
switch (counter polls apart: their number follows the wait, so this machine's load).

``--floor`` runs, in the same processes with the same training threads and measurements, the
protocol's messages alone instead of the library's coordination (benchmarks/pause_floor.py): what
no coordination of this protocol in Python goes under here; ``--compare`` always adds its flat and
node rows after the library's.

``python -m benchmarks.store_scale --sizes 64,1024,4096,8192`` runs it alone (``--help``);
docs/performance.md has the method, the numbers and the exact command.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, BenchResult, Settings, median, rounds_metric, single_metric

EXEC_STARTED = time.monotonic()
JOB = "bench-store-scale"
FULL_SIZES = (64, 1024, 4096, 8192, 16384)
QUICK_SIZES = (8,)
EXTRAPOLATE_TO = 16_384
STORE_PREFIX = "default_pg/0/"  # keys land under the default store's PrefixStore, as in a torch job
SETUP_THREADS = 32  # per node process: connections are made in parallel, as separate ranks would
THREAD_STACK = 512 * 1024  # thousands of threads per process: 512 KiB stacks instead of 8 MiB
# Wait slices the library keeps short for one rank per process (a parked main thread must run
# signal handlers; a member looks again for a hook that started): harmless there, but with a
# thousand ranks in one interpreter every slice is a GIL hand-off, tens of thousands a second.
# They touch no Store key, so raising them changes no request and no byte (see hosted_slices).
HOSTED_SLICE_S = 30.0
SLICES = (("ParkingLot", "WAIT_SLICE_S"), ("Member", "IDLE_SLICE_S"))
# CPython: a thread waiting for the GIL wakes every switch interval (5 ms) to demand it. With
# hundreds of rank threads of one process waiting at once (each Store reply wakes one) that is a
# storm of futex calls that ate most of the 2 cores (1,024 ranks: 0.9 s of node CPU per process
# per switch, 0.3 s with 0.5 s; 4,096 ranks never finished a pause). A rank per process has no
# such storm. Threads that block in a Store call hand the GIL over at once either way.
HOSTED_SWITCH_INTERVAL_S = 0.5
# The training threads' step period (--step-ms): each step is due this long after the previous
# one began (after a park, at the resume). A step that starts later than due is late: what the
# switch's coordination costs the training steps still running (CPU, GIL, cores).
DEFAULT_STEP_S = 0.1


def default_switches(ranks: int) -> int:
    """Measured switches per size (after one warm-up): fewer where one switch takes seconds."""
    return 3 if ranks <= 4096 else 2


# -- /proc readings (the Store server's process) ---------------------------------------------------


def proc_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` in ns (schedstat: on-CPU time, nanosecond resolution)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended meanwhile
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def proc_cpu_ticks_s(pid: int) -> float:
    """utime + stime of ``pid`` from /proc/<pid>/stat, in seconds (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_user_sys_s(pid: int) -> tuple[float, float]:
    """User and system CPU of every thread of ``pid``, in seconds (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def proc_io(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


def proc_sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


STORE_THREAD = "pt_tcpstore_uv"  # the name torch gives a TCPStore server's (libuv) event-loop thread


def store_threads() -> set[int]:
    """This process's TCPStore server threads (a node process hosts its nodes' and groups' Stores)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == STORE_THREAD:
                found.add(int(tid))
    return found


def threads_cpu_ns(tids: set[int]) -> int:
    total = 0
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
    return total


def server_snapshot(pid: int) -> dict[str, float]:
    io = proc_io(pid)
    return {"cpu_ns": proc_cpu_ns(pid), "cpu_ticks_s": proc_cpu_ticks_s(pid), "rchar": io["rchar"],
            "wchar": io["wchar"], "syscr": io["syscr"], "syscw": io["syscw"], "t": time.monotonic()}


def raise_fd_limit() -> dict[str, int]:
    """Raise this process's soft RLIMIT_NOFILE to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
    return {"soft_before": soft, "hard": hard, "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def host_limits() -> dict[str, int]:
    def read_int(path: str, default: int) -> int:
        try:
            return int(Path(path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return default

    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    tasks = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                tasks += len(os.listdir(f"/proc/{entry}/task"))
    return {"pid_max": read_int("/proc/sys/kernel/pid_max", 32768),
            "threads_max": read_int("/proc/sys/kernel/threads-max", 1 << 20),
            "tasks_now": tasks, "ephemeral_ports": high - low + 1}


def feasible(ranks: int, nodes: int, fd_soft: int, limits: dict[str, int], per_node: int | None = None,
             groups: int = 0) -> str:
    """Why this machine cannot host ``ranks`` ("" if it can). Flat, every rank holds 2 Store
    connections: 2 descriptors on the server, 2 on the node, 2 local ports, 2 threads. With
    node-local fan-out (``per_node``) the job's Store holds one connection per node; each rank's 2
    connections go to its node's Store, whose server (and so both ends) is in the node process.
    With ``groups`` the job's Store holds one per group; each node relay holds 2 on its group's
    Store (both ends in the node processes), each group relay a Store server and a relay thread."""
    if per_node is not None:
        relays = ranks // per_node
        upstream = groups if groups else relays
        server_fds = upstream + nodes + 2 + 32
        node_fds = 4 * math.ceil(ranks / nodes) + 3 * math.ceil(relays / nodes) + 64
        node_fds += (4 * math.ceil(relays / nodes) + 3 * math.ceil(groups / nodes) + nodes) if groups else 0
        threads = 2 * ranks + 2 * relays + 2 * groups + 64 * (nodes + 2)
        if server_fds > fd_soft:
            return f"the Store's host needs {server_fds:,} descriptors, the limit is {fd_soft:,}"
        if node_fds > fd_soft:
            return f"a node process needs {node_fds:,} descriptors (both ends of its nodes' Stores), the limit is " \
                   f"{fd_soft:,}"
        room = min(limits["pid_max"], limits["threads_max"]) - limits["tasks_now"]
        if threads > room:
            return (f"{threads:,} threads (a member and a training thread per rank, a relay and a Store server per "
                    f"node) exceed the {room:,} thread ids free (pid_max {limits['pid_max']:,})")
        return ""
    server_fds = 2 * ranks + nodes + 2 + 32  # + the node bases, the leader's, the server's own
    node_fds = 2 * math.ceil(ranks / nodes) + 64
    threads = 2 * ranks + 64 * (nodes + 2)
    if server_fds > fd_soft:
        return (f"the Store's host needs {server_fds:,} descriptors (2 per rank), the limit is "
                f"{fd_soft:,} (RLIMIT_NOFILE, raised to its hard limit)")
    if node_fds > fd_soft:
        return f"a node process needs {node_fds:,} descriptors, the limit is {fd_soft:,}"
    if 2 * ranks + nodes + 8 > limits["ephemeral_ports"]:
        return (f"{2 * ranks:,} client connections to one address need as many local ports; the ephemeral "
                f"range has {limits['ephemeral_ports']:,}")
    room = min(limits["pid_max"], limits["threads_max"]) - limits["tasks_now"]
    if threads > room:
        return (f"{threads:,} threads (a member and a training thread per rank) exceed the {room:,} thread ids "
                f"free (pid_max {limits['pid_max']:,})")
    return ""


# -- counting Store wrapper (node and leader processes) ---------------------------------------------


class Registry:
    """Every CountingStore of a process. Each instance is used by one thread at a time (the
    library's rule: a clone per thread), so its counters need no lock; the list has one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stores: list[CountingStore] = []

    def add(self, store: CountingStore) -> None:
        with self.lock:
            self.stores.append(store)

    def totals(self) -> dict[str, Any]:
        with self.lock:
            stores = list(self.stores)
        calls: Counter[str] = Counter()
        sent: Counter[str] = Counter()
        received: Counter[str] = Counter()
        for s in stores:
            calls.update(s.calls)
            sent.update(s.sent)
            received.update(s.received)
        return {"connections": len(stores), "calls": dict(calls), "sent": dict(sent), "received": dict(received)}


class CountingStore:
    """Counts the calls (and their keys' and values' bytes) made on one Store client; calls through.

    ``clone()`` returns a counting wrapper around the clone, registered too: every connection the
    library opens is counted, the leader's per-switch cleanup connection included.
    """

    def __init__(self, store: Any, registry: Registry) -> None:
        self._store = store
        self._registry = registry
        self.calls: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()  # key and value bytes (payload, no framing)
        self.received: Counter[str] = Counter()
        registry.add(self)

    def clone(self) -> CountingStore:
        return CountingStore(self._store.clone(), self._registry)

    @property
    def _underlying_non_prefix_store(self) -> Any:
        """The TCPStore under the PrefixStore: where topology.advertised_host finds the job Store's
        address (a group Store is published as reachable from the same interface)."""
        return getattr(self._store, "_underlying_non_prefix_store", self._store)

    def set(self, key: str, value: str) -> None:
        self.calls["set"] += 1
        self.sent["set"] += len(key) + len(value)
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self.calls["get"] += 1
        self.sent["get"] += len(key)
        value: bytes = self._store.get(key)
        self.received["get"] += len(value)
        return value

    def check(self, keys: list[str]) -> bool:
        self.calls["check"] += 1
        self.sent["check"] += sum(map(len, keys))
        return bool(self._store.check(keys))

    def set_timeout(self, timeout: datetime.timedelta) -> None:  # the client's own setting: no request
        self._store.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:  # read back, as torch's Stores let KV do
        value: datetime.timedelta = self._store.timeout
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.calls["wait"] += 1
        self.sent["wait"] += sum(map(len, keys))
        self._store.wait(keys, timeout)

    def add(self, key: str, value: int) -> int:
        # add(key, 0) is a counter poll (KV.poll_count): how many there are depends on how long
        # the poller waits (on this machine, on the load), unlike every other request.
        self.calls["add" if value else "add(0) poll"] += 1
        self.sent["add"] += len(key) + 8
        result: int = self._store.add(key, value)
        return result

    def delete_key(self, key: str) -> bool:
        self.calls["delete_key"] += 1
        self.sent["delete_key"] += len(key)
        return bool(self._store.delete_key(key))

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        self.calls["multi_set"] += 1
        self.sent["multi_set"] += sum(map(len, keys)) + sum(map(len, values))
        self._store.multi_set(keys, values)

    def queue_push(self, key: str, value: str) -> None:
        self.calls["queue_push"] += 1
        self.sent["queue_push"] += len(key) + len(value)
        self._store.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self.calls["queue_pop"] += 1
        self.sent["queue_pop"] += len(key)
        value: bytes = self._store.queue_pop(key, block)
        self.received["queue_pop"] += len(value)
        return value

    def queue_len(self, key: str) -> int:
        self.calls["queue_len"] += 1
        self.sent["queue_len"] += len(key)
        return int(self._store.queue_len(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls["multi_get"] += 1
        self.sent["multi_get"] += sum(map(len, keys))
        values: list[bytes] = self._store.multi_get(keys)
        self.received["multi_get"] += sum(map(len, values))
        return values


def _connect(port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]
    base = tcp_store("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    return dist.PrefixStore(STORE_PREFIX, base)  # type: ignore[attr-defined]


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child_setup() -> None:
    with contextlib.suppress(OSError, AttributeError):  # die with the benchmark (Linux prctl PR_SET_PDEATHSIG)
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import logging

    logging.getLogger("nicswitch_agent").setLevel(logging.ERROR)  # INFO per rank per park is not the subject
    raise_fd_limit()
    threading.stack_size(THREAD_STACK)


# -- the server process ------------------------------------------------------------------------------


def listening_socket(dual_stack: bool) -> socket.socket:
    """The Store's listening socket, made here so every child can start at once (the server gets
    it through ``master_listen_fd``). Dual stack is what torch binds by default: IPv4 clients then
    arrive as ``::ffff:127.0.0.1``, which the server reverse-resolves on its event-loop thread."""
    if dual_stack:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
    sock.listen(min(4096, socket.SOMAXCONN * 32))
    return sock


def server_main(fd: int, timeout_s: float) -> None:
    """Host a TCPStore server on the listening socket ``fd`` until stdin closes."""
    _child_setup()
    import torch.distributed as dist

    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]
    port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
    store = tcp_store("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                      wait_for_workers=False, master_listen_fd=fd)
    _reply({"port": store.port, "pid": os.getpid(), "libuv": bool(getattr(store, "libuvBackend", False))})
    sys.stdin.read()  # until the benchmark closes our stdin


# -- a node process: ranks as threads ----------------------------------------------------------------


def hosted_slices() -> dict[str, list[float]]:
    """Raise the library's wait slices (SLICES) and the interpreter's switch interval in this
    process; returns {name: [was, now]}.

    Found through the classes' own modules, so the patch follows the code wherever it lives.
    """
    import importlib

    from nicswitch_agent.coordination import Member
    from nicswitch_agent.coordination.parking import ParkingLot

    classes = {"ParkingLot": ParkingLot, "Member": Member}
    patched: dict[str, list[float]] = {"sys.switchinterval": [sys.getswitchinterval(), HOSTED_SWITCH_INTERVAL_S]}
    sys.setswitchinterval(HOSTED_SWITCH_INTERVAL_S)
    for cls_name, attr in SLICES:
        module = importlib.import_module(classes[cls_name].__module__)
        if hasattr(module, attr):
            patched[f"{module.__name__}.{attr}"] = [getattr(module, attr), HOSTED_SLICE_S]
            setattr(module, attr, HOSTED_SLICE_S)
    return patched


class RankThread:
    """One rank: its ParkingLot, its Member and a training thread doing what ``agent.step()`` does.

    With a step period (``node.step_s`` > 0) the training thread calls ``step()`` every period
    (a step "computes" by sleeping until the next one is due) and records how late each step
    began: the steps a switch's coordination delays. Without one (0) it is blocked between steps
    while idle and steps at once while a pause request is pending, so every rank reaches its
    boundary as soon as it can: the pause then measures coordination only.
    """

    def __init__(self, rank: int, node: NodeProcess) -> None:
        from nicswitch_agent.coordination.parking import ParkingLot

        self.rank = rank
        self.node = node
        self.last_step: int | None = None
        self.armed = False
        self.go = threading.Event()
        self.compute = threading.Event()
        self.quit = False
        # align_timeout_s: a rank waiting for S gives up after it (60 s by default); thousands of
        # ranks on 2 cores can take longer than that to publish their steps.
        self.lot = ParkingLot(on_event=self._on_lot_event, on_armed=self._set_armed,
                              align_timeout_s=node.timeout_s)
        self.resumed = False  # set when the lot resumes the thread: the next step is due then
        # (due time, how late the step began, whether the step before it waited at its boundary for
        # the pause's target step), per step; appended by the training thread only.
        self.lateness: list[tuple[float, float, bool]] = []
        self.thread = threading.Thread(target=self._train if node.step_s <= 0 else self._train_periodic,
                                       name=f"train-{rank}", daemon=True)

    def _set_armed(self, armed: bool) -> None:  # the agent's _set_armed, plus waking the idle loop
        self.armed = armed
        if armed:
            self.go.set()
        else:
            self.go.clear()

    def _on_lot_event(self, kind: str, detail: dict[str, Any]) -> None:
        if kind == "parked":
            self.node.stamp("parked")
        elif kind == "resumed":
            self.resumed = True
            self.node.stamp("resumed")

    def _train(self) -> None:
        from nicswitch_agent import TrainingStopped

        step = 0
        while True:
            step += 1
            self.last_step = step  # agent.step(step): record the step, then check the flag
            if self.armed:
                try:
                    self.lot.at_step_boundary(step)
                except TrainingStopped:
                    return
            self.go.wait()
            if self.quit:
                return

    def _train_periodic(self) -> None:
        from nicswitch_agent import TrainingStopped

        period = self.node.step_s
        step, due, held = 0, time.monotonic(), False
        while not self.quit:
            step += 1
            began = time.monotonic()
            self.lateness.append((due, began - due, held))
            self.last_step = step
            held = False
            if self.armed:
                try:
                    self.lot.at_step_boundary(step)
                except TrainingStopped:
                    return
                held = time.monotonic() - began > period / 2  # it waited for the target step
            if self.resumed:  # it was parked: the next step is due a period after the resume
                self.resumed, began = False, time.monotonic()
            due = began + period
            pause = due - time.monotonic()
            if pause > 0:
                self.compute.wait(pause)  # the step's compute: nothing sets it (a pause does not cut it short)


class NodeProcess:
    """K ranks as threads of this process: whole nodes, or a part of one node (``split``)."""

    def __init__(self, port: int, node: int, nodes: int, world: int, timeout_s: float, *,
                 as_is: bool = False, per_node: int | None = None, per_group: int | None = None,
                 step_s: float = 0.0, transport: str = "auto") -> None:
        self.slices = {} if as_is else hosted_slices()
        self.transport = transport  # node_transport: how a node's ranks reach their relay
        self.step_s = step_s
        self.per_node = per_node  # node-local fan-out: this process hosts several nodes of this many ranks
        self.per_group = per_group  # groups of this many nodes (None: nodes answer on the job's Store)
        self.relays: list[Any] = []
        self.local_servers: list[Any] = []
        # Per group this process speaks to: a registry of its connections to the group's Store;
        # per group whose Store this process hosts: that Store's server thread(s).
        self.group_registries: dict[int, Registry] = {}
        self.group_tids: dict[int, set[int]] = {}
        self.port, self.node, self.nodes, self.world, self.timeout_s = port, node, nodes, world, timeout_s
        self.local_world = math.ceil(world / nodes)
        self.ranks = list(range(node * self.local_world, min(world, (node + 1) * self.local_world)))
        # Fewer ranks here than a node has: the node's ranks are in several processes (see start).
        self.split = per_node is not None and self.local_world < per_node
        self.registry = Registry()
        self.node_registry = Registry()  # the node Stores' clients (node-local fan-out)
        self._cond = threading.Condition()
        self.counts: Counter[str] = Counter()
        self.last: dict[str, float] = {}
        self.members: list[Any] = []
        self.rank_threads: list[RankThread] = []

    def stamp(self, kind: str) -> None:
        now = time.monotonic()
        with self._cond:
            self.counts[kind] += 1
            self.last[kind] = now
            self._cond.notify_all()

    def start(self) -> dict[str, Any]:
        from concurrent.futures import ThreadPoolExecutor

        from nicswitch_agent.coordination import KV, Member, MemberHooks, key_prefix
        from nicswitch_agent.orders import RankMap

        started = time.monotonic()
        kv = KV(CountingStore(_connect(self.port, self.timeout_s), self.registry), key_prefix(JOB, "0"))
        connected = time.monotonic()
        if floor():
            self._start_floor(kv.store)
            return self._ready(started, connected)
        rank_map = RankMap(self.local_world, self.node)

        def hook(order: Any) -> bool:
            return True

        local_kv: dict[int, Any] = {}  # first rank of a node -> its node's Store (node-local fan-out)
        fan_outs: dict[int, Any] = {}  # rank -> its RankFanOut (nodes split over processes)
        if self.split:
            # A node's ranks live in several processes (one rank per process: the deployment's
            # shape): each rank builds its Stores and relays as SwitchAgent does (RankFanOut), its
            # local rank 0 hosting the node's Store, the others dialing it over loopback TCP.
            from nicswitch_agent.coordination.fan_out import RankFanOut
            from nicswitch_agent.coordination.topology import Layout

            assert self.per_node is not None
            layout = Layout(self.world, self.per_node, self.per_group)
            # Hosts first (slot 0 of a node), so the others find the address at once.
            for rank in sorted(self.ranks, key=lambda r: r % self.per_node != 0):
                fan_out = RankFanOut(kv, layout, rank, node_store_timeout_s=self.timeout_s, stop_timeout_s=1.0,
                                     **_transport(RankFanOut, self.transport))
                fan_out.start()
                fan_outs[rank] = fan_out
                self.relays += [relay for relay in (fan_out.group_relay, fan_out.node_relay) if relay is not None]
        elif self.per_node is not None:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            from nicswitch_agent.coordination.relay import NodeRelay

            upstream = self._groups(kv) if self.per_group else {}
            for first in range(self.ranks[0], self.ranks[-1] + 1, self.per_node):
                if self._link():  # as topology.node_kv on local rank 0: the node link's hub
                    from nicswitch_agent.coordination.node_link import NodeHub
                    from nicswitch_agent.coordination.queues import queue_name

                    hub = NodeHub(local_queue=key_prefix(JOB, "0") + "/" + queue_name(0))
                    self.local_servers.append(hub)
                    local_kv[first] = KV(hub, key_prefix(JOB, "0"), queues=True)  # messages, not requests: uncounted
                else:
                    # As SwitchAgent._start on local rank 0: host the node's Store on 127.0.0.1, relay for it.
                    server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=self.timeout_s),
                                      wait_for_workers=False)
                    self.local_servers.append(server)
                    # Counted: every request on the node's Store (its members' and its relay's).
                    local_kv[first] = KV(CountingStore(server, self.node_registry), key_prefix(JOB, "0"),
                                         **_queues(KV, True))
                node = first // self.per_node
                # As RankFanOut: with groups the node relay answers on its group's Store, at its index there.
                up, index = (upstream[node // self.per_group], node % self.per_group) if self.per_group \
                    else (kv, node)
                relay = NodeRelay(up.clone(), up, local_kv[first].clone(), index,
                                  list(range(first, first + self.per_node)), stop_timeout_s=1.0,
                                  **_local_wake(NodeRelay, local_kv[first]))
                relay.start()
                self.relays.append(relay)

        def start_rank(rank: int) -> tuple[RankThread, Any]:
            r = RankThread(rank, self)
            base, slot = kv, None
            if rank in fan_outs and self._link():  # the node link as RankFanOut made it (messages: uncounted)
                base, slot = fan_outs[rank].member_kv, fan_outs[rank].slot
            elif rank in fan_outs:  # its node's Store as RankFanOut connected it (counted from here on)
                fan_out = fan_outs[rank]
                base, slot = KV(CountingStore(fan_out.member_kv.store, self.node_registry), fan_out.member_kv.prefix,
                                **_queues(KV, bool(getattr(fan_out.member_kv, "queues", False)))), fan_out.slot
            elif self.per_node is not None:  # its keys on its node's Store, at its local slot
                slot = rank % self.per_node
                base = local_kv[rank - slot]
                if slot and self._link():  # as topology.node_kv on the node's other ranks: a link to the hub
                    from nicswitch_agent.coordination.node_link import NodeLink
                    from nicswitch_agent.coordination.queues import queue_name

                    link = NodeLink(base.store.address, base.prefix + queue_name(slot), self.timeout_s)
                    self.local_servers.append(link)
                    base = KV(link, base.prefix, queues=True)
            member = Member(base.clone(), rank, r.lot,  # as SwitchAgent._start: a clone of its store
                            MemberHooks(switch_hook=hook, checkpoint_hook=_no_op_guard() if guarded() else None,
                                        guard_timeout_s=60.0,
                                        switch_timeout_s=60.0, dry_run=False, local_ranks=rank_map.local_ranks),
                            lambda: r.last_step, max_parked_s=1800.0, stop_timeout_s=1.0, slot=slot)
            r.thread.start()
            member.start()  # opens the connection stop() wakes it with
            return r, member

        with ThreadPoolExecutor(SETUP_THREADS) as pool:
            for r, member in pool.map(start_rank, self.ranks):
                self.rank_threads.append(r)
                self.members.append(member)
        return self._ready(started, connected)

    def _start_floor(self, store: Any) -> None:
        """The floor's members (and relays, with ``per_node``) instead of the library's."""
        from benchmarks import pause_floor

        if self.split or self.per_group:
            raise SystemExit("--floor runs flat or with whole nodes per process (no groups, no split nodes)")
        self.rank_threads = [RankThread(rank, self) for rank in self.ranks]
        for r in self.rank_threads:
            r.thread.start()
        if self.per_node is None:
            self.members = list(pause_floor.start_flat(self.rank_threads, store, self.world))
        else:
            members, relays = pause_floor.start_node(self.rank_threads, store, self.per_node, self.world)
            self.members, self.relays = list(members), list(relays)

    def _ready(self, started: float, connected: float) -> dict[str, Any]:
        # Every training thread has recorded its first step and waits (idle) before we say ready.
        deadline = time.monotonic() + self.timeout_s
        while any(r.last_step is None for r in self.rank_threads) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"ready": True, "ranks": len(self.ranks), "setup_s": time.monotonic() - started,
                "connect_s": connected - started, "slices": self.slices,
                "since_exec_s": time.monotonic() - EXEC_STARTED,
                "connections": self.registry.totals()["connections"], "threads": threading.active_count()}

    def _link(self) -> bool:
        """The node's ranks reach their relay over the node link (as ``node_transport`` picks)."""
        try:
            from nicswitch_agent.coordination.topology import use_node_link
        except ImportError:  # the code before the node link
            return False
        return use_node_link(self.transport)

    def _groups(self, kv: Any) -> dict[int, Any]:
        """Each group of this process's nodes: its Store's KV (counted per group), as RankFanOut
        builds them. The groups whose first node is here are hosted first, one by one, so each
        Store's server thread is known (its CPU is read per group), and their relays started."""
        from nicswitch_agent.coordination import KV, topology
        from nicswitch_agent.coordination.relay import NodeRelay

        assert self.per_node is not None and self.per_group is not None
        layout = topology.Layout(self.world, self.per_node, self.per_group)
        per_node, per_group = self.per_node, self.per_group
        nodes = range(self.ranks[0] // per_node, self.ranks[-1] // per_node + 1)
        groups = sorted({n // per_group for n in nodes})
        hosted = [g for g in groups if g * per_group in nodes]
        upstream: dict[int, Any] = {}
        for g in [*hosted, *(g for g in groups if g not in hosted)]:
            members = layout.nodes_of(g)
            before = store_threads()
            # The library's own: hosts (publishing 127.0.0.1:port on the job's Store, the address
            # this host reaches it from) or waits for the address and connects (over loopback TCP).
            group, server = topology.group_kv(kv, g, len(members), hosts=g in hosted, timeout_s=self.timeout_s)
            if server is not None:
                self.local_servers.append(server)
                self.group_tids[g] = store_threads() - before
            self.group_registries[g] = Registry()
            upstream[g] = KV(CountingStore(group.store, self.group_registries[g]), group.prefix,
                             **_queues(KV, getattr(group, "queues", False)))
            if g in hosted:
                relay = NodeRelay(kv.clone(), kv, upstream[g].clone(), g, [n * per_node for n in members],
                                  stop_timeout_s=1.0, label="group", **_local_wake(NodeRelay, upstream[g]),
                                  names=[f"{n} (ranks {n * per_node}-{(n + 1) * per_node - 1})" for n in members])
                relay.start()
                self.relays.append(relay)
        return upstream

    def wait_for(self, kind: str, count: int, timeout_s: float) -> dict[str, Any]:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.counts[kind] >= count, timeout_s)
            return {"ok": ok, "count": self.counts[kind], "last": self.last.get(kind)}

    def thread_roles(self) -> dict[int, str]:
        """Thread id -> role, for the CPU by role: members, node relays, group relays, training."""
        roles: dict[int, str] = {}
        for m in self.members:
            thread = getattr(m, "_thread", None)
            if thread is not None and thread.native_id is not None:
                roles[thread.native_id] = "member"
        for relay in self.relays:
            thread = getattr(relay, "_thread", None)
            if thread is not None and thread.native_id is not None:
                roles[thread.native_id] = "group relay" if str(getattr(relay, "_label", "")).startswith("group") \
                    else "node relay"
        for r in self.rank_threads:
            if r.thread.native_id is not None:
                roles[r.thread.native_id] = "training"
        for tid in store_threads():
            roles[tid] = "Store servers"
        return roles

    def cpu_by_role(self) -> dict[str, int]:
        """CPU (ns, schedstat) of every thread of this process by role; "other": the rest (the main
        thread, torch's own threads)."""
        roles = self.thread_roles()
        out: Counter[str] = Counter()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
                out[roles.get(int(tid), "other")] += ns
        return dict(out)

    def late(self, start: float, end: float, half: float) -> dict[str, float]:
        """The steps due in [start, end): how many, their summed lateness, how many were more than
        ``half`` late, and the largest."""
        n, total, over, worst, held, held_sum = 0, 0.0, 0, 0.0, 0, 0.0
        for r in self.rank_threads:
            for due, late, waited in list(r.lateness):
                if start <= due < end:
                    n += 1
                    total += late
                    over += late > half
                    worst = max(worst, late)
                    held += waited
                    held_sum += late if waited else 0.0
        return {"steps": n, "sum_s": total, "over_half": over, "max_s": worst, "held": held, "held_sum_s": held_sum}

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            counts = dict(self.counts)
        group_tids = set().union(*self.group_tids.values()) if self.group_tids else set()
        return {"store": self.registry.totals(), "node_stores": self.node_registry.totals(), "counts": counts,
                "events": sum(m.events_handled for m in self.members),
                "lost": [m.rank for m in self.members if m.lost] + [f"relay {r.node}" for r in self.relays if r.lost],
                "groups": {str(g): reg.totals() for g, reg in self.group_registries.items()},
                "group_cpu_ns": {str(g): threads_cpu_ns(tids) for g, tids in self.group_tids.items()},
                "node_stores_cpu_ns": threads_cpu_ns(store_threads() - group_tids),
                "cpu_by_role_ns": self.cpu_by_role()}


def _queues(kv_class: Any, queues: bool) -> dict[str, Any]:
    """``queues=...`` where KV takes it (the node and group Stores have queues, as topology.py
    builds them); nothing for a KV of an earlier version (a before/after run of the code before it)."""
    import inspect

    return {"queues": queues} if "queues" in inspect.signature(kv_class).parameters else {}


def _transport(fan_out_class: Any, transport: str) -> dict[str, Any]:
    """``node_transport=...`` where RankFanOut takes it (nothing for the code before the node link)."""
    import inspect

    return {"node_transport": transport} if "node_transport" in inspect.signature(fan_out_class).parameters else {}


def _local_wake(relay_class: Any, kv: Any) -> dict[str, Any]:
    """``local_wake=kv`` where NodeRelay takes it (as RankFanOut passes it); nothing for a
    NodeRelay of an earlier version (a before/after run of the code before it)."""
    import inspect

    return {"local_wake": kv} if "local_wake" in inspect.signature(relay_class).parameters else {}


def node_main(port: int, node: int, nodes: int, world: int, timeout_s: float, as_is: bool,
              per_node: int | None, per_group: int | None = None, step_s: float = 0.0, transport: str = "auto") -> None:
    _child_setup()
    proc = NodeProcess(port, node, nodes, world, timeout_s, as_is=as_is, per_node=per_node, per_group=per_group,
                       step_s=step_s, transport=transport)
    _reply(proc.start())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "snap":
            _reply(proc.snapshot())
        elif cmd["cmd"] == "wait":
            _reply(proc.wait_for(cmd["kind"], int(cmd["count"]), float(cmd["timeout"])))
        elif cmd["cmd"] == "late":
            _reply(proc.late(float(cmd["start"]), float(cmd["end"]), float(cmd["half"])))
        elif cmd["cmd"] == "roles":
            _reply({"roles": {str(tid): role for tid, role in proc.thread_roles().items()}})
        elif cmd["cmd"] == "exit":
            break
    sys.stdout.flush()
    os._exit(0)  # thousands of daemon threads blocked in Store waits: no orderly teardown needed


# -- the leader process ------------------------------------------------------------------------------


def leader_main(port: int, world: int, listed: int, timeout_s: float, per_node: int | None,
                per_group: int | None = None) -> None:
    _child_setup()
    from nicswitch_agent import SwitchOrder
    from nicswitch_agent.coordination import KIND_SWITCH, KV, Coordinator, key_prefix, messages
    from nicswitch_agent.coordination.topology import Layout

    registry = Registry()
    kv = KV(CountingStore(_connect(port, timeout_s), registry), key_prefix(JOB, "0"))
    if floor():
        _floor_leader(kv.store, world // per_node if per_node else world, registry)
        return
    # As SwitchAgent._start_leader: counting ranks, nodes with node-local fan-out, or groups.
    layout = Layout(world, per_node, per_group) if per_node else Layout(world)
    coordinator = Coordinator(kv.clone(), layout.answerers, layout=layout)
    # When the pause's target step went out, its first round ended: seen by wrapping the
    # Coordinator's one way to publish an event (without it the round reads as the whole pause).
    target_out: list[float] = []
    publish = coordinator._publish

    def timed_publish(message: dict[str, object]) -> None:
        if message.get("t") == messages.TARGET:
            target_out.append(time.monotonic())
        publish(message)

    coordinator._publish = timed_publish  # type: ignore[method-assign]
    _reply({"ready": True, "connections": registry.totals()["connections"]})
    n = min(listed, world) if listed > 0 else world
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "switch":
            seq = int(cmd["seq"])
            # The job's last ``n`` ranks (one node's worth by default): the order every member reads.
            order = SwitchOrder(seq=seq, job_id=JOB, ranks=tuple(range(world - n, world)),
                                ops=tuple(seq % 2 == 1 for _ in range(n)))
            t0 = time.monotonic()
            paused = coordinator.pause(timeout_s)
            t1 = time.monotonic()
            if not paused.ok:
                _reply({"ok": False, "why": f"pause: {paused.reason}"})
                continue
            outcome = coordinator.run(order, kind=KIND_SWITCH, budget_s=timeout_s,
                                      **({"guard_budget_s": timeout_s} if guarded() else {}))
            t2 = time.monotonic()
            coordinator.release()
            t3 = time.monotonic()
            _reply({"ok": outcome.ok, "why": outcome.reason, "t_pause": t0, "t_parked": t1, "t_results": t2,
                    "t_released": t3, "step": paused.step, "t_target": target_out[-1] if target_out else t1})
        elif cmd["cmd"] == "quiesce":
            # The previous switch's keys are deleted on a thread the pause started: wait for it.
            for thread in threading.enumerate():
                if thread.name == "nicswitch-store-cleanup":
                    thread.join(timeout_s)
            _reply({"store": registry.totals()})
        elif cmd["cmd"] == "exit":
            break
    os._exit(0)


def _floor_leader(store: Any, answerers: int, registry: Registry) -> None:
    from benchmarks.pause_floor import FloorLeader

    leader = FloorLeader(store.clone(), answerers)
    _reply({"ready": True, "connections": registry.totals()["connections"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "switch":
            t0 = time.monotonic()
            step = leader.pause()
            t1 = time.monotonic()
            t_target = leader.target_out
            leader.run()
            t2 = time.monotonic()
            leader.release()
            t3 = time.monotonic()
            _reply({"ok": True, "why": "", "t_pause": t0, "t_parked": t1, "t_results": t2, "t_released": t3,
                    "step": step, "t_target": t_target})
        elif cmd["cmd"] == "quiesce":
            _reply({"store": registry.totals()})
        elif cmd["cmd"] == "exit":
            break
    os._exit(0)


# -- the benchmark (parent) side ------------------------------------------------------------------


class Child:
    """A child process spoken to in JSON lines on stdin/stdout; stderr goes to a file."""

    def __init__(self, args: list[str], name: str, log_dir: Path, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        # RES_OPTIONS: torch's client reverse-resolves the address of every connection it opens
        # (here ::ffff:127.0.0.1, in no hosts file); where the resolver drops the query that
        # stalls 5 s. It bounds the stall to 1 s: setup time only, no Store traffic changes.
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TORCH_CPP_LOG_LEVEL="ERROR", RES_OPTIONS="timeout:1 attempts:1")
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.store_scale", *args], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file, text=True,
                                     pass_fds=pass_fds)
        self._buf = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout_s
        while "\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no answer within {timeout_s:.0f} s; log: {self._tail()}")
            ready, _, _ = select.select([out], [], [], remaining)
            if ready:
                chunk = os.read(out.fileno(), 65536).decode()
                if not chunk:
                    raise RuntimeError(f"{self.name} exited ({self.proc.poll()}); log: {self._tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, obj: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(obj)
        return self.read(timeout_s)

    def _tail(self) -> str:
        try:
            return self.log.read_text()[-1500:]
        except OSError:
            return ""

    def close(self, timeout_s: float = 10.0) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self.send({"cmd": "exit"})
                    assert self.proc.stdin is not None
                    self.proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
        finally:
            self._log_file.close()


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _sum_store(snaps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"connections": 0, "calls": Counter(), "sent": Counter(), "received": Counter()}
    for s in snaps:
        out["connections"] += s["connections"]
        for key in ("calls", "sent", "received"):
            out[key].update(s[key])
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in out.items()}


def _store_diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {"connections": after["connections"] - before["connections"],
            **{key: _diff(after[key], before[key]) for key in ("calls", "sent", "received")}}


@dataclass
class SizeRun:
    ranks: int
    nodes: int
    per_group: int = 0  # nodes per group (0: no groups)
    skipped: str = ""
    error: str = ""
    setup_s: float = 0.0
    sockets: dict[str, float] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=dict)
    switches: list[dict[str, Any]] = field(default_factory=list)
    perf: dict[str, Any] = field(default_factory=dict)  # --perf: the measured switches sampled (perf_roles.py)


FLOOR_ENV = "STORE_SCALE_FLOOR"  # --floor: the protocol's messages alone (benchmarks/pause_floor.py), inherited
GUARD_ENV = "STORE_SCALE_GUARD"  # --guard: every rank has a checkpoint guard (a no-op); the children inherit it
PERF_ENV = "STORE_SCALE_PERF"  # --perf DIR: sample the node processes during the measured switches (perf_roles.py)


def floor() -> bool:
    """Whether this run's coordination is the floor (benchmarks/pause_floor.py), not the library's."""
    return os.environ.get(FLOOR_ENV) == "1"


def guarded() -> bool:
    """Whether this run's ranks have a checkpoint guard: the leader then runs the guard round."""
    return os.environ.get(GUARD_ENV) == "1"


def _no_op_guard() -> Callable[[Any], None]:
    def guard(order: Any) -> None:  # what the guard round costs, not what a checkpoint does
        return None
    return guard


def run_size(ranks: int, nodes: int, switches: int, listed: int, *, dual_stack: bool, as_is: bool,
             timeout_s: float, idle_s: float, log_dir: Path, per_node: int | None = None,
             per_group: int | None = None, step_s: float = DEFAULT_STEP_S, transport: str = "auto") -> SizeRun:
    """Start server, nodes and leader for ``ranks``; one warm-up switch, then ``switches`` measured."""
    result = SizeRun(ranks, nodes, per_group=per_group or 0)
    fan_out = [*(["--ranks-per-node", str(per_node)] if per_node else []),
               *(["--nodes-per-group", str(per_group)] if per_group else [])]
    node_transport = ["--node-transport", transport] if per_node else []
    children: list[Child] = []
    recording = None  # --perf
    try:
        listener = listening_socket(dual_stack)
        port = listener.getsockname()[1]
        started = time.monotonic()
        server = Child(["--role", "server", "--fd", str(listener.fileno()), "--timeout", str(timeout_s)],
                       f"server-{ranks}", log_dir, pass_fds=(listener.fileno(),))
        children.append(server)
        # Nodes and leader start with the server: their connections wait in the listen backlog.
        node_children = [Child(["--role", "node", "--port", str(port), "--node", str(i), "--nodes", str(nodes),
                                "--world", str(ranks), "--timeout", str(timeout_s), "--step-ms", str(step_s * 1e3),
                                *(["--as-is"] if as_is else []), *fan_out, *node_transport],
                               f"node{i}-{ranks}", log_dir)
                         for i in range(nodes)]
        children += node_children
        leader = Child(["--role", "leader", "--port", str(port), "--world", str(ranks), "--listed", str(listed),
                        "--timeout", str(timeout_s), *fan_out],
                       f"leader-{ranks}", log_dir)
        children.append(leader)
        listener.close()  # the server holds it now
        spid = int(server.read(timeout_s)["pid"])
        ready = [c.read(timeout_s) for c in node_children]
        leader_ready = leader.read(timeout_s)
        result.setup_s = time.monotonic() - started
        total_sockets = proc_sockets(spid)
        # Minus each node process's base connection; with fan-out these are the relays' (members'
        # connections go to their node's Store, not counted here).
        member_conns = sum(r["connections"] for r in ready) - nodes
        result.sockets = {
            "server_total": total_sockets, "member_connections": member_conns,
            "node_base_connections": nodes, "leader_connections": leader_ready["connections"],
            "member_per_rank": member_conns / ranks,
            "node_setup_s": max(r["setup_s"] for r in ready),
            "slices": ready[0].get("slices", {}),
            "node_ready_since_exec_s": max(r["since_exec_s"] for r in ready),
        }
        # Idle: everything started, nobody switching.
        time.sleep(min(1.0, idle_s))
        s0 = server_snapshot(spid)
        ranks0 = sum(proc_cpu_ns(c.pid) for c in node_children)
        time.sleep(idle_s)
        s1 = server_snapshot(spid)
        ranks1 = sum(proc_cpu_ns(c.pid) for c in node_children)
        idle_late = _late(node_children, s0["t"], s1["t"], step_s, timeout_s)
        result.idle = {"seconds": s1["t"] - s0["t"], "cpu_s": (s1["cpu_ns"] - s0["cpu_ns"]) / 1e9,
                       "bytes": (s1["rchar"] - s0["rchar"]) + (s1["wchar"] - s0["wchar"]),
                       "rank_cpu_s": (ranks1 - ranks0) / 1e9, **{f"late_{k}": v for k, v in idle_late.items()}}
        for i in range(switches + 1):  # the first is the warm-up: afterwards each window holds one cleanup
            if i == 1 and os.environ.get(PERF_ENV):
                recording = _start_perf(node_children, ranks, result)
            node_before = [c.ask({"cmd": "snap"}, timeout_s) for c in node_children]
            lead_before = leader.ask({"cmd": "quiesce"}, timeout_s)["store"]
            s0 = server_snapshot(spid)
            cpu0 = {c.name.split("-")[0]: proc_user_sys_s(c.pid) for c in [*node_children, leader]}
            ranks0 = sum(proc_cpu_ns(c.pid) for c in node_children)
            answer = leader.ask({"cmd": "switch", "seq": i + 1}, timeout_s)
            if not answer.get("ok"):
                raise RuntimeError(f"switch {i + 1} at {ranks} ranks failed: {answer.get('why')}")
            target = [snap["counts"].get("resumed", 0) + len(range(*_slice(n, nodes, ranks)))
                      for n, snap in enumerate(node_before)]
            resumed = [c.ask({"cmd": "wait", "kind": "resumed", "count": t, "timeout": timeout_s}, timeout_s + 5)
                       for c, t in zip(node_children, target, strict=True)]
            if not all(r["ok"] for r in resumed):
                raise RuntimeError(f"switch {i + 1} at {ranks} ranks: not every rank resumed")
            lead_after = leader.ask({"cmd": "quiesce"}, timeout_s)["store"]
            s1 = server_snapshot(spid)
            cpu1 = {c.name.split("-")[0]: proc_user_sys_s(c.pid) for c in [*node_children, leader]}
            ranks1 = sum(proc_cpu_ns(c.pid) for c in node_children)
            # The steps due from the pause request until a step after the last resume.
            late = _late(node_children, answer["t_pause"], last_resumed_at(resumed) + step_s, step_s, timeout_s)
            # The same steps split where every rank had parked: while the pause spreads (every
            # member woken within a few ms of the others) and after it.
            late_spread = _late(node_children, answer["t_pause"], answer["t_parked"], step_s, timeout_s)
            node_after = [c.ask({"cmd": "snap"}, timeout_s) for c in node_children]
            last_resumed = max(r["last"] for r in resumed)
            members = _store_diff(_sum_store([s["store"] for s in node_after]),
                                  _sum_store([s["store"] for s in node_before]))
            lead = _store_diff(lead_after, lead_before)
            if i == 0:
                continue
            # Each group's Store: the requests of every connection to it (its relay's and its node
            # relays', in whichever process), and its server thread's CPU (in the hosting process).
            groups: dict[str, dict[str, Any]] = {}
            for before, after in zip(node_before, node_after, strict=True):
                for g, totals in after.get("groups", {}).items():
                    calls = _diff(totals["calls"], before["groups"][g]["calls"])
                    entry = groups.setdefault(g, {"calls": {}, "cpu_s": 0.0})
                    entry["calls"] = dict(Counter(entry["calls"]) + Counter(calls))
                for g, ns in after.get("group_cpu_ns", {}).items():
                    groups.setdefault(g, {"calls": {}, "cpu_s": 0.0})["cpu_s"] += (ns - before["group_cpu_ns"][g]) / 1e9
            result.switches.append({
                "pause_s": answer["t_parked"] - answer["t_pause"],
                # The pause's first round: every rank's last completed step in, the target step out.
                "pause_round_s": answer.get("t_target", answer["t_parked"]) - answer["t_pause"],
                "order_s": answer["t_results"] - answer["t_parked"],
                "release_s": last_resumed - answer["t_results"],
                "release_publish_s": answer["t_released"] - answer["t_results"],
                "total_s": last_resumed - answer["t_pause"],
                "server_cpu_s": (s1["cpu_ns"] - s0["cpu_ns"]) / 1e9,
                "server_cpu_ticks_s": s1["cpu_ticks_s"] - s0["cpu_ticks_s"],
                "server_rchar": s1["rchar"] - s0["rchar"], "server_wchar": s1["wchar"] - s0["wchar"],
                "server_syscr": s1["syscr"] - s0["syscr"], "server_syscw": s1["syscw"] - s0["syscw"],
                "window_s": s1["t"] - s0["t"],
                "cpu_user_sys_s": {k: [round(cpu1[k][j] - cpu0[k][j], 2) for j in (0, 1)] for k in cpu0},
                "members": members, "leader": lead, "lost": sum(len(s["lost"]) for s in node_after),
                "groups": groups,
                "node_stores_cpu_s": sum(a["node_stores_cpu_ns"] - b["node_stores_cpu_ns"]
                                         for a, b in zip(node_after, node_before, strict=True)) / 1e9,
                "rank_cpu_s": (ranks1 - ranks0) / 1e9,
                "node_stores": _store_diff(_sum_store([s["node_stores"] for s in node_after]),
                                           _sum_store([s["node_stores"] for s in node_before])),
                "cpu_by_role_s": {k: v / 1e9 for k, v in _diff(
                    dict(sum((Counter(a.get("cpu_by_role_ns", {})) for a in node_after), Counter())),
                    dict(sum((Counter(b.get("cpu_by_role_ns", {})) for b in node_before), Counter()))).items()},
                "late": late, "late_spread": late_spread,
            })
        if recording is not None:
            _perf_split(recording, node_children, result, timeout_s)
            recording = None
        # The server's own sockets (its listener, its in-process client and that client's accepted
        # end): what is left once every client process has gone.
        for child in children[1:]:
            child.close()
        own = proc_sockets(spid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = proc_sockets(spid)
            if now == own:
                break
            own = now
        result.sockets.update({"server_own": own, "clients": total_sockets - own,
                               "per_rank": (total_sockets - own) / ranks})
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if recording is not None:  # a failed run: perf stops with it
            recording.stop()
        for child in reversed(children):
            child.close()
    return result


def _start_perf(node_children: list[Child], ranks: int, result: SizeRun) -> Any:
    """``perf record`` of the node processes from now on (None, and why in ``result.perf``, if it cannot)."""
    from benchmarks import perf_roles

    why = perf_roles.available()
    if why:
        result.perf = {"why": why}
        return None
    out = Path(os.environ[PERF_ENV]) / f"{'floor-' if floor() else ''}{ranks}-{time.monotonic_ns()}.perf.data"
    out.parent.mkdir(parents=True, exist_ok=True)
    recording = perf_roles.Recording([c.pid for c in node_children], out)
    try:
        recording.start()
    except (OSError, RuntimeError) as exc:  # the run goes on, unsampled, and says why
        result.perf = {"why": f"{type(exc).__name__}: {exc}"}
        return None
    return recording


def _perf_split(recording: Any, node_children: list[Child], result: SizeRun, timeout_s: float) -> None:
    """Stop the recording; its samples by thread role (the node processes say which thread is which)."""
    from benchmarks import perf_roles

    recording.stop()
    roles: dict[int, str] = {}
    for child in node_children:
        roles.update({int(tid): role for tid, role in child.ask({"cmd": "roles"}, timeout_s)["roles"].items()})
    result.perf = {"file": str(recording.out), "switches": len(result.switches), "hz": perf_roles.HZ,
                   "by_role": perf_roles.split(perf_roles.samples(recording.out), roles)}


def last_resumed_at(resumed: list[dict[str, Any]]) -> float:
    return max(float(r["last"]) for r in resumed)


def _late(node_children: list[Child], start: float, end: float, step_s: float, timeout_s: float) -> dict[str, float]:
    """The training steps due in [start, end) over every node process (none without a step period)."""
    if step_s <= 0:
        return {"steps": 0, "sum_s": 0.0, "over_half": 0, "max_s": 0.0, "held": 0, "held_sum_s": 0.0}
    parts = [c.ask({"cmd": "late", "start": start, "end": end, "half": step_s / 2}, timeout_s) for c in node_children]
    return {**{k: sum(q.get(k, 0) for q in parts) for k in ("steps", "sum_s", "over_half", "held", "held_sum_s")},
            "max_s": max(q["max_s"] for q in parts)}


def _slice(node: int, nodes: int, world: int) -> tuple[int, int]:
    local = math.ceil(world / nodes)
    return node * local, min(world, (node + 1) * local)


def group_layout(ranks: int, per_node: int, per_group: int | str) -> Any:
    """The layout ``fan_out=group`` gives ``ranks`` in nodes of ``per_node``: the library's own
    choice (topology.choose_layout), so "auto" is ceil(sqrt(nodes)) and one group is no group."""
    from nicswitch_agent import AgentConfig
    from nicswitch_agent.coordination.topology import choose_layout

    cfg = AgentConfig(server="127.0.0.1:1", job_id=JOB, fan_out="group", local_world_size=per_node,
                      nodes_per_group=None if per_group == "auto" else int(per_group))
    return choose_layout(cfg, ranks)


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R^2)."""
    n = len(xs)
    if n < 2:
        return math.nan, math.nan, math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan, math.nan, math.nan
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1 - ss_res / ss_tot if ss_tot else 1.0


# One node's own round (16 ranks, one node process, alone on this machine): the time a node adds
# below its relay; measured once with --ranks-per-node 16 --sizes 16 (docs/performance.md).
NODE_ROUND_S = 0.040
POLL_INTERVAL_S = 0.005  # KV.poll_count's longest interval: a waiting leader polls at most this often


def _group_metrics(result: BenchResult, r: SizeRun, label: str, per_node: int) -> dict[str, float]:
    """The groups' part of one size: the job's Store per group, each group's Store (requests,
    measured CPU, and the CPU its requests would cost at the job Store's per-request cost)."""
    from nicswitch_agent.coordination.topology import Layout

    layout = Layout(r.ranks, per_node, r.per_group)
    sw = r.switches
    job_cpu = median([s["server_cpu_s"] for s in sw])
    requests = [sum(s["members"]["calls"].values()) + sum(s["leader"]["calls"].values()) for s in sw]
    per_request = median([s["server_cpu_s"] / q for s, q in zip(sw, requests, strict=True) if q])
    # The leader's counter polls: one per 0.5-5 ms while it waits, so their number follows the
    # switch's wall time, which on this saturated machine is tens of times a cluster's. The rest
    # (the groups' answers, the relays' reads, the leader's events and deletes) is per switch.
    polls = [s["leader"]["calls"].get("add(0) poll", 0) + s["members"]["calls"].get("add(0) poll", 0) for s in sw]
    job_cpu_no_polls = median([s["server_cpu_s"] * (q - n) / q for s, q, n in zip(sw, requests, polls, strict=True)
                               if q])
    largest_req, largest_polls, largest_cpu, mean_req = [], [], [], []
    for s in sw:
        req = {g: sum(v["calls"].values()) for g, v in s["groups"].items()}
        if not req:  # nodes split over processes: RankFanOut's group Stores are not counted
            continue
        top = max(req, key=lambda g: req[g])
        largest_req.append(float(req[top]))
        largest_polls.append(float(s["groups"][top]["calls"].get("add(0) poll", 0)))
        largest_cpu.append(max(float(v["cpu_s"]) for v in s["groups"].values()))
        mean_req.append(sum(req.values()) / len(req))
    result.add(single_metric(f"{label}: groups (who answers on the job's Store)", layout.groups, "",
                             note=f"{layout.nodes:,} nodes of {per_node} in {layout.groups} groups of up to "
                                  f"{layout.nodes_per_group} nodes"))
    result.add(single_metric(f"{label}: job Store server CPU per switch, per group", job_cpu / layout.groups * 1e3,
                             "ms", note=f"{job_cpu * 1e3:.1f} ms per switch; {median(requests):.0f} requests, "
                                        f"{per_request * 1e6:.1f} us of server CPU per request"))
    result.add(single_metric(f"{label}: job Store server CPU per switch without the leader's polls (estimate)",
                             job_cpu_no_polls, "s",
                             note=f"{median(polls):.0f} of {median(requests):.0f} requests are the leader's counter "
                                  f"polls, as many as this machine's long waits allow; the rest "
                                  f"({(median(requests) - median(polls)) / layout.groups:.0f} per group) at the "
                                  "measured CPU per request"))
    if largest_req:  # (none counted with nodes split over processes)
        result.add(rounds_metric(f"{label}: requests per switch on the largest group's Store", largest_req, "",
                                 note=f"{median(largest_req) / layout.nodes_per_group:.0f} per node of the group; "
                                      f"of which counter polls (add 0, more the longer the relay waits: load) "
                                      f"{median(largest_polls):.0f}; mean over groups {median(mean_req):.0f}"))
        estimate = median(largest_req) * per_request
        result.add(rounds_metric(f"{label}: group Store server CPU per switch (largest, measured)", largest_cpu,
                                 "s", note=f"its server thread (schedstat) in the node process hosting it, which "
                                           f"shares the cores; estimated from its requests x the job Store's CPU "
                                           f"per request: {estimate * 1e3:.1f} ms"))
    node_cpu = median([s["node_stores_cpu_s"] for s in sw]) / layout.nodes
    result.add(single_metric(f"{label}: a node Store's server CPU per switch", node_cpu * 1e3, "ms",
                             note="mean over the nodes (schedstat of their server threads)"))
    return {"ranks": r.ranks, "groups": layout.groups, "per_group": layout.nodes_per_group or 0, "job_cpu": job_cpu,
            "job_cpu_no_polls": job_cpu_no_polls, "per_request": per_request,
            "group_cpu": median(largest_cpu) if largest_cpu else math.nan,
            "group_estimate": median(largest_req) * per_request if largest_req else math.nan, "node_cpu": node_cpu}


def _group_fit(result: BenchResult, grouped: list[dict[str, float]], per_node: int, per_group: int | str) -> None:
    """Job Store CPU ~ groups, the largest group Store's CPU ~ its nodes; both extrapolated to the
    layout ``fan_out=group`` gives 16,384 ranks, and the coordination-overhead model's terms."""
    far = group_layout(EXTRAPOLATE_TO, per_node, per_group)
    many = (f"{EXTRAPOLATE_TO:,} ranks ({far.nodes:,} nodes of {per_node} in {far.groups} groups of up to "
            f"{far.nodes_per_group})")
    over = ", ".join(f"{int(g['ranks']):,}" for g in grouped)
    a, b, r2 = fit([g["groups"] for g in grouped], [g["job_cpu"] for g in grouped])
    job = a + b * far.groups
    result.add(single_metric("fit: job Store server CPU per switch, per group", b * 1e3, "ms",
                             note=f"{a * 1e3:.1f} ms + {b * 1e3:.2f} ms x groups, R^2 {r2:.3f}, over {over} ranks"))
    ag, bg, r2g = fit([g["per_group"] for g in grouped], [g["group_cpu"] for g in grouped])
    group = ag + bg * (far.nodes_per_group or 0)
    result.add(single_metric("fit: largest group Store's server CPU per switch, per node of the group", bg * 1e3, "ms",
                             note=f"{ag * 1e3:.1f} ms + {bg * 1e3:.2f} ms x nodes per group, R^2 {r2g:.3f} (measured "
                                  f"CPU of its server thread)"))
    ap, bp, r2p = fit([g["groups"] for g in grouped], [g["job_cpu_no_polls"] for g in grouped])
    job_no_polls = ap + bp * far.groups
    result.add(single_metric("fit: job Store server CPU per switch without the leader's polls, per group", bp * 1e3,
                             "ms", note=f"{ap * 1e3:.1f} ms + {bp * 1e3:.2f} ms x groups, R^2 {r2p:.3f} (estimate)"))
    ae, be, _ = fit([g["per_group"] for g in grouped], [g["group_estimate"] for g in grouped])
    result.add(single_metric(f"extrapolated to {many}: job Store server CPU per switch", job, "s",
                             target="< 1 s", ok=lambda v: v < 1.0,
                             note="the fit over groups, measured CPU: with this machine's load-inflated polls"))
    # On a cluster the leader waits about the switch's own length: one poll per 5 ms of it at most.
    poll_cpu = (job_no_polls + group + NODE_ROUND_S) / POLL_INTERVAL_S * median([g["per_request"] for g in grouped])
    result.add(single_metric(f"extrapolated to {many}: job Store server CPU per switch without this machine's polls",
                             job_no_polls + poll_cpu, "s", target="< 1 s", ok=lambda v: v < 1.0,
                             note=f"the poll-free fit ({job_no_polls * 1e3:.0f} ms, an estimate) + the polls of a "
                                  f"switch as long as the model below, one per {POLL_INTERVAL_S * 1e3:.0f} ms "
                                  f"({poll_cpu * 1e3:.1f} ms)"))
    result.add(single_metric(f"extrapolated to {many}: largest group Store's server CPU per switch", group, "s",
                             note=f"the fit over nodes per group; from its requests x the job Store's CPU per "
                                  f"request instead: {(ae + be * (far.nodes_per_group or 0)) * 1e3:.0f} ms"))
    cluster_job = job_no_polls + poll_cpu
    result.add(single_metric(f"extrapolated to {many}: coordination overhead model", cluster_job + group + NODE_ROUND_S,
                             "s", target="< 1 s", ok=lambda v: v < 1.0,
                             note=f"job Store {cluster_job * 1e3:.0f} ms (without this machine's polls; "
                                  f"{job * 1e3:.0f} ms with them) + largest group Store {group * 1e3:.0f} ms + one "
                                  f"node's own round {NODE_ROUND_S * 1e3:.0f} ms (measured alone, 16 ranks); "
                                  "per-hop network latency not included (loopback here)"))


ROLES = ("member", "node relay", "group relay", "Store servers", "training", "other")


def _rank_metrics(result: BenchResult, r: SizeRun, label: str, step_s: float) -> dict[str, Any]:
    """The ranks' own side of one size: the CPU of the rank processes per rank per switch (by
    thread role) and how late the training steps due during the switch began."""
    sw = r.switches
    total = [s["rank_cpu_s"] / r.ranks * 1e6 for s in sw]
    roles = {role: median([s["cpu_by_role_s"].get(role, 0.0) for s in sw]) / r.ranks * 1e6 for role in ROLES}
    coordination = [(s["rank_cpu_s"] - s["cpu_by_role_s"].get("training", 0.0)) / r.ranks * 1e6 for s in sw]
    idle_rate = r.idle.get("rank_cpu_s", 0.0) / max(r.idle["seconds"], 1e-9)
    result.add(rounds_metric(f"{label}: rank processes' CPU per rank per switch", total, "us",
                             target="<= 1000", ok=lambda v: v <= 1000,
                             note="every thread of the node processes (schedstat), pause request -> every rank "
                                  "resumed; by role per rank: " + ", ".join(f"{k} {v:.0f}" for k, v in roles.items()
                                                                            if v >= 0.5)
                                  + f"; idle (steps only) {idle_rate / r.ranks * 1e6:.0f} us per rank per second"))
    result.add(rounds_metric(f"{label}: ... of which coordination (all but the training threads)", coordination, "us"))
    if r.perf.get("by_role"):
        from benchmarks import perf_roles

        by_role = r.perf["by_role"]
        members = by_role.get("member", {}).get("samples", 0)
        result.add(single_metric(
            f"{label}: member CPU per rank per switch, sampled by perf", members / r.perf["hz"]
            / max(1, r.perf["switches"]) / r.ranks * 1e6, "us",
            note="perf record of the node processes over the measured switches (larger than without perf: "
                 "sampling makes context switches dearer); per rank per switch, and where it ran: "
                 + perf_roles.describe(by_role, 1 / r.perf["hz"], max(1, r.perf["switches"]) * r.ranks)
                 + f"; samples in {r.perf['file']}"))
    elif r.perf.get("why"):
        result.add(single_metric(f"{label}: member CPU per rank per switch, sampled by perf", math.nan, "us",
                                 note=f"not sampled: {r.perf['why']}"))
    node_calls: Counter[str] = Counter()
    for s in sw:
        node_calls.update(s["node_stores"]["calls"])
    if node_calls:
        result.add(single_metric(f"{label}: node Store requests per rank per switch", sum(node_calls.values())
                                 / len(sw) / r.ranks, "", note="members' and node relays': "
                                 + _per_rank_calls(dict(node_calls), len(sw) * r.ranks)))
    summary: dict[str, Any] = {"ranks": r.ranks, "per_group": r.per_group,
                               "total_s": median([s["total_s"] for s in sw]),
                               "pause_round_s": median([s.get("pause_round_s", math.nan) for s in sw]),
                               "rank_cpu_us": median(total), "coordination_cpu_us": median(coordination),
                               "roles_us": roles,
                               "node_requests": sum(node_calls.values()) / len(sw) / r.ranks,
                               "job_store_cpu_us": median([s["server_cpu_s"] for s in sw]) / r.ranks * 1e6,
                               "sockets_per_rank": r.sockets.get("per_rank", math.nan)}
    if step_s > 0:
        steps = [s["late"]["steps"] for s in sw]
        mean = [s["late"]["sum_s"] / max(1, s["late"]["steps"]) * 1e3 for s in sw]
        # Without the steps that follow a wait at the boundary for the target step (the pause's own
        # wait, as long as the pause round): what the coordination's CPU alone costs the steps.
        free = [(s["late"]["sum_s"] - s["late"].get("held_sum_s", 0.0))
                / max(1, s["late"]["steps"] - s["late"].get("held", 0)) * 1e3 for s in sw]
        over = [float(s["late"]["over_half"]) for s in sw]
        idle_mean = r.idle.get("late_sum_s", 0.0) / max(1, r.idle.get("late_steps", 0)) * 1e3
        result.add(rounds_metric(f"{label}: training steps late during the switch, mean", mean, "ms",
                                 target="<= 5", ok=lambda v: v <= 5,
                                 note=f"steps due from the pause request to a step after the last resume "
                                      f"({median(steps):.0f} steps of {step_s * 1e3:g} ms); more than half a step "
                                      f"late: {median(over):.0f}; worst "
                                      f"{median([s['late']['max_s'] for s in sw]) * 1e3:.0f} ms;"
                                      f" idle: {idle_mean:.2f} ms mean, {r.idle.get('late_over_half', 0):.0f} of "
                                      f"{r.idle.get('late_steps', 0):.0f} more than half a step late"))
        result.add(rounds_metric(f"{label}: ... mean without the steps after a wait for the target step", free, "ms",
                                 note=f"{median([s['late'].get('held', 0) for s in sw]):.0f} steps came after a wait "
                                      "at the boundary for the target (the pause's own wait)"))
        # Split at "every rank parked": the steps due while the pause spreads (the burst of every
        # member waking at once) against the rest of the switch.
        spread = [s["late_spread"]["sum_s"] / max(1, s["late_spread"]["steps"]) * 1e3 for s in sw]
        rest = [(s["late"]["sum_s"] - s["late_spread"]["sum_s"])
                / max(1, s["late"]["steps"] - s["late_spread"]["steps"]) * 1e3 for s in sw]
        result.add(rounds_metric(f"{label}: ... mean of the steps due while the pause spreads", spread, "ms",
                                 note=f"pause request -> every rank parked "
                                      f"({median([s['late_spread']['steps'] for s in sw]):.0f} steps); the rest of "
                                      f"the switch: {median(rest):.1f} ms mean"))
        summary.update({"late_mean_ms": median(mean), "late_over_half": median(over), "late_steps": median(steps),
                        "idle_late_mean_ms": idle_mean, "late_free_ms": median(free),
                        "late_spread_ms": median(spread), "late_rest_ms": median(rest)})
    return summary


def _per_rank_calls(calls: dict[str, float], ranks: int) -> str:
    return ", ".join(f"{k} {v / ranks:.2g}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v)


def _suffix(transport: str) -> str:
    """The result's name: the library's default way unmarked, the TCPStore way marked."""
    return "_tcpstore" if transport == "store" else ""


def _over(transport: str) -> str:
    return "the node's ranks over a TCPStore per node" if transport == "store" else \
        "the node's ranks over the node link (Unix sockets, no Store server)"


def run(settings: Settings, *, sizes: Sequence[int] | None = None, processes: int | None = None,
        switches: int | None = None, listed: int = 16, dual_stack: bool = False, as_is: bool = False,
        timeout_s: float = 600.0, per_node: int | None = None, per_group: int | str | None = None,
        step_s: float = DEFAULT_STEP_S, transport: str = "auto") -> BenchResult:
    """``per_group``: nodes per group (``"auto"``: as ``fan_out=group`` picks them, ceil(sqrt(nodes)));
    None or 0: no groups. Groups need ``per_node``. ``transport``: how a node's ranks reach their
    relay (``node_transport``: ``auto`` is the node link on Linux, ``store`` a TCPStore per node)."""
    if per_group and per_node is None:
        raise ValueError("groups of nodes need ranks per node (per_node)")
    if per_node is None:
        result = BenchResult("store_scale", "7. one switch (pause mode agent) at 64-16,384 ranks over one real "
                                            "TCPStore, every rank on it (fan_out flat): phases, Store requests, bytes, "
                                            "server CPU, sockets")
    elif per_group:
        result = BenchResult("store_scale_group" + _suffix(transport),
                             f"7c. the same with groups of nodes ({per_node} ranks per node, {per_group} nodes per "
                             f"group, a relay and a Store per group; {_over(transport)}): the job's Store sees groups, "
                             "each group's Store its nodes")
    else:
        result = BenchResult("store_scale_node" + _suffix(transport),
                             f"7b. the same with node-local fan-out ({per_node} ranks per node, a relay per node; "
                             f"{_over(transport)}): the job's Store sees nodes")
    if floor():
        result.name += "_floor"
        result.title += "; the floor: the protocol's messages alone (benchmarks/pause_floor.py)"
    sizes = tuple(sizes or settings.pick(QUICK_SIZES, FULL_SIZES))
    nodes = processes or settings.pick(1, 4)
    limits_fd = raise_fd_limit()
    limits = host_limits()
    idle_s = settings.pick(0.3, 2.0)
    runs: list[SizeRun] = []
    with tempfile.TemporaryDirectory(prefix="nicswitch-store-scale-") as tmp:
        for n in sizes:
            k = min(nodes, n)
            layout = group_layout(n, per_node, per_group) if per_group and per_node else None
            groups = layout.groups if layout is not None and layout.nodes_per_group else 0
            why = feasible(n, k, limits_fd["soft"], host_limits(), per_node, groups)
            if not why and per_node is not None and n % (k * per_node) and (n % k or per_node % (n // k)):
                why = (f"{n:,} ranks do not split into {k} processes of whole nodes of {per_node}, nor into "
                       f"processes of equal parts of a node")
            if not why and floor() and per_node is not None and n % (k * per_node):
                why = f"the floor hosts whole nodes of {per_node} per process; {n:,} ranks in {k} processes do not"
            if why:
                runs.append(SizeRun(n, k, skipped=why))
                print(f"   store_scale: {n:,} ranks skipped: {why}", file=sys.stderr, flush=True)
                continue
            t0 = time.monotonic()
            m = switches or settings.pick(1, default_switches(n))
            runs.append(run_size(n, k, m, listed, dual_stack=dual_stack, as_is=as_is,
                                 timeout_s=timeout_s, idle_s=idle_s,
                                 log_dir=Path(tmp), per_node=per_node,
                                 per_group=layout.nodes_per_group if layout is not None else None, step_s=step_s,
                                 transport=transport))
            print(f"   store_scale: {n:,} ranks in {k} processes: {time.monotonic() - t0:.1f} s"
                  f"{' ERROR ' + runs[-1].error if runs[-1].error else ''}", file=sys.stderr, flush=True)
    errors = [f"{r.ranks} ranks: {r.error}" for r in runs if r.error]
    if errors:
        result.error = "; ".join(errors)
    xs: list[float] = []
    cpu: list[float] = []
    wall: list[float] = []
    grouped: list[dict[str, float]] = []
    summaries: list[dict[str, Any]] = []
    for r in runs:
        label = f"{r.ranks:,} ranks"
        if r.skipped:
            result.add(single_metric(f"{label}: not run on this machine", math.nan, "", note=r.skipped))
            continue
        if not r.switches:
            continue
        sw = r.switches
        per = len(sw)

        def col(key: str, sw: list[dict[str, Any]] = sw) -> list[float]:
            return [float(s[key]) for s in sw]

        total = col("total_s")
        result.add(rounds_metric(f"{label}: one switch, coordination (pause start -> all resumed)", total, "s",
                                 note=f"{r.nodes} node processes of {math.ceil(r.ranks / r.nodes):,} ranks"))
        result.add(rounds_metric(f"{label}: pause request -> all parked", col("pause_s"), "s"))
        result.add(rounds_metric(f"{label}: ... of which its first round (request -> target step out)",
                                 col("pause_round_s"), "s",
                                 note="a rank at a step boundary meanwhile waits there for the target"))
        result.add(rounds_metric(f"{label}: order out -> all results", col("order_s"), "s"))
        result.add(rounds_metric(f"{label}: release -> all resumed", col("release_s"), "s"))
        server_cpu = col("server_cpu_s")
        result.add(rounds_metric(f"{label}: Store server CPU per switch", server_cpu, "s",
                                 note=f"{median(server_cpu) / r.ranks * 1e6:.0f} us per rank"))
        member_calls: Counter[str] = Counter()
        leader_calls: Counter[str] = Counter()
        for s in sw:
            member_calls.update(s["members"]["calls"])
            leader_calls.update(s["leader"]["calls"])
        member_rt = sum(member_calls.values()) / per / r.ranks
        leader_rt = sum(leader_calls.values()) / per
        result.add(single_metric(f"{label}: Store requests per rank per switch (members + leader/ranks)",
                                 member_rt + leader_rt / r.ranks, "",
                                 note=f"members {member_rt:.1f} ({_per_rank_calls(dict(member_calls), per * r.ranks)});"
                                      f" leader {leader_rt:.0f} per switch "
                                      f"({_per_rank_calls(dict(leader_calls), per)}); a TCPStore get is 2 exchanges "
                                      "(wait, then get)"))
        wire = [(s["server_rchar"] + s["server_wchar"]) / r.ranks for s in sw]
        result.add(rounds_metric(f"{label}: bytes on the wire at the Store per rank per switch", wire, "B",
                                 note="server read+write (/proc io); "
                                      f"{median([s['server_syscr'] / r.ranks for s in sw]):.1f} reads, "
                                      f"{median([s['server_syscw'] / r.ranks for s in sw]):.1f} writes per rank"))
        result.add(single_metric(f"{label}: Store sockets per rank on the Store's host", r.sockets["per_rank"], "",
                                 target="<= 1", ok=lambda v: v <= 1.0,
                                 note=f"{r.sockets['clients']:,} client sockets: members "
                                      f"{r.sockets['member_connections']:,}, {r.nodes} node and "
                                      f"{r.sockets['leader_connections']} leader connections; "
                                      f"torch's own (one per rank) not included"))
        result.add(single_metric(f"{label}: idle Store traffic", r.idle["bytes"] / max(r.idle["seconds"], 1e-9), "B/s",
                                 note=f"server CPU {r.idle['cpu_s'] * 1e3:.1f} ms over {r.idle['seconds']:.1f} s"))
        summaries.append(_rank_metrics(result, r, label, step_s))
        if r.per_group and per_node:
            grouped.append(_group_metrics(result, r, label, per_node))
        xs.append(r.ranks)
        cpu.append(median(server_cpu))
        wall.append(median(total))
    if len(grouped) >= 2 and per_node and per_group and not any(math.isnan(g["group_cpu"]) for g in grouped):
        _group_fit(result, grouped, per_node, per_group)
    if len(xs) >= 2:
        a, b, r2 = fit(xs, cpu)
        result.add(single_metric("fit: Store server CPU per switch, per rank", b * 1e6, "us",
                                 note=f"{a * 1e3:.1f} ms + {b * 1e6:.0f} us x ranks, R^2 {r2:.3f}, over "
                                      f"{', '.join(f'{int(x):,}' for x in xs)}"))
        if per_node is None:
            result.add(single_metric(f"extrapolated to {EXTRAPOLATE_TO:,} ranks: Store server CPU per switch",
                                     a + b * EXTRAPOLATE_TO, "s", target="grows with nodes only", ok=lambda v: False,
                                     note="the fit above: it grows with ranks; one server thread does this work"))
        elif not per_group:
            nodes_x = [x / per_node for x in xs]
            an, bn, r2n = fit(nodes_x, cpu)
            result.add(single_metric("fit: Store server CPU per switch, per node", bn * 1e3, "ms",
                                     note=f"{an * 1e3:.1f} ms + {bn * 1e3:.2f} ms x nodes, R^2 {r2n:.3f}, nodes of "
                                          f"{per_node} ranks"))
            many = f"{EXTRAPOLATE_TO:,} ranks ({EXTRAPOLATE_TO // per_node:,} nodes)"
            result.add(single_metric(f"extrapolated to {many}: Store server CPU per switch",
                                     an + bn * EXTRAPOLATE_TO / per_node, "s",
                                     target="< 1 s", ok=lambda v: v < 1.0,
                                     note="the fit over nodes; one server thread does this work"))
        _, k, r2k = fit([math.log(x) for x in xs], [math.log(y) for y in cpu]) if min(cpu) > 0 else (0, 0, 0)
        result.add(single_metric("Store server CPU per switch grows as ranks^k, k", k, "",
                                 note=f"log-log fit, R^2 {r2k:.3f}; per rank: " + ", ".join(
                                     f"{int(x):,}: {y / x * 1e6:.0f} us" for x, y in zip(xs, cpu, strict=True))
                                 + "; k > 1: the linear fit's extrapolation is a lower bound"))
        a, b, r2 = fit(xs, wall)
        result.add(single_metric("fit: coordination wall time per switch, per rank", b * 1e6, "us",
                                 note=f"{a * 1e3:.1f} ms + {b * 1e6:.0f} us x ranks, R^2 {r2:.3f}"))
        result.add(single_metric(f"extrapolated to {EXTRAPOLATE_TO:,} ranks: coordination per switch",
                                 a + b * EXTRAPOLATE_TO, "s", target="< 1 s", ok=lambda v: v < 1.0,
                                 note="on this 2-core machine, all ranks' Python sharing it"))
    result.details = {
        "summary": summaries, "step_s": step_s,
        "fd_limit": limits_fd, "host_limits": limits, "nodes": nodes, "listed": listed, "dual_stack": dual_stack,
        "as_is": as_is,
        "sizes": [r.__dict__ for r in runs],
    }
    result.limits = (
        f"RLIMIT_NOFILE soft {limits_fd['soft_before']:,} raised to {limits_fd['soft']:,} "
        f"(hard {limits_fd['hard']:,}). "
        "Every rank of every node shares this machine's cores (the Store server, the leader and all ranks' Python): "
        "wall times are those of a saturated host, the server's CPU and the request counts are not."
    )
    return result


NODE_RANKS_PER_NODE = 16  # an Ascend node's 8 or 16 NPUs: 16 in the suite
# The smoke run: 8 ranks = 1 node of 8 split over 2 processes (each rank as SwitchAgent builds it,
# the second process's ranks dialing the node's Store over loopback); the group smoke run below
# has whole nodes in each process.
QUICK_RANKS_PER_NODE = 8
QUICK_NODE_PROCESSES = 2


def run_node(settings: Settings) -> BenchResult:
    """The suite's benchmark 7b: :func:`run` with node-local fan-out."""
    return run(settings, per_node=settings.pick(QUICK_RANKS_PER_NODE, NODE_RANKS_PER_NODE),
               processes=settings.pick(QUICK_NODE_PROCESSES, None))


# The smoke run of 7c: 16 ranks = 8 nodes of 2 in groups of 3 (3, 3, 2 nodes) over 2 processes of 4
# nodes, so one group's nodes are in both processes: its Store is reached over loopback TCP.
QUICK_GROUP_SIZES = (16,)
QUICK_GROUP_RANKS_PER_NODE = 2


def run_group(settings: Settings) -> BenchResult:
    """The suite's benchmark 7c: :func:`run` with groups of nodes (as many as ``fan_out=group`` picks)."""
    return run(settings, sizes=settings.pick(QUICK_GROUP_SIZES, FULL_SIZES), processes=settings.pick(2, 4),
               per_node=settings.pick(QUICK_GROUP_RANKS_PER_NODE, NODE_RANKS_PER_NODE), per_group="auto")


def _cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_scale",
                                     description="The real coordination at scale over one TCPStore (benchmark 7).")
    parser.add_argument("--role", choices=("main", "server", "node", "leader"), default="main", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(map(str, FULL_SIZES)), help="comma-separated rank counts")
    parser.add_argument("--processes", type=int, default=4,
                        help="node processes (ranks are threads of these; with fewer ranks per process than a node "
                             "has, each node is split over processes, its ranks built as SwitchAgent builds them: "
                             "--processes equal to the ranks is the deployment's one rank per process)")
    parser.add_argument("--switches", type=int, default=0,
                        help="measured switches per size (default: 3 up to 4,096 ranks, then 2)")
    parser.add_argument("--listed", type=int, default=16, help="ranks in the order (0: every rank)")
    parser.add_argument("--dual-stack", action="store_true", help="torch's default listener (reverse DNS per client)")
    parser.add_argument("--as-is", action="store_true",
                        help="leave the library's wait slices and the switch interval as they are (see hosted_slices)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-wait bound in seconds")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="node-local fan-out with this many ranks per node (0: every rank on the job's Store)")
    parser.add_argument("--nodes-per-group", default="0",
                        help="groups of nodes with this many nodes each ('auto': ceil(sqrt(nodes)), as fan_out=group "
                             "picks; 0: none); needs --ranks-per-node")
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_S * 1e3,
                        help="the training threads' step period in ms, for the steps' lateness (0: step only when a "
                             "pause arms them, the coordination alone)")
    parser.add_argument("--node-transport", choices=("auto", "socket", "store"), default="auto",
                        help="how a node's ranks reach their relay (node_transport; auto: the node link on Linux)")
    parser.add_argument("--compare", action="store_true",
                        help="flat, node (--ranks-per-node, default 8) and group fan-out (auto) side by side, one run, "
                             "then the protocol's floor flat and node (--floor)")
    parser.add_argument("--quick", action="store_true", help="the smoke test's tiny run")
    parser.add_argument("--perf", metavar="DIR", default="",
                        help="sample the node processes with Linux perf over the measured switches and report, per "
                             "thread role, where its CPU ran (kernel, CPython, libc); the samples go to DIR "
                             "(benchmarks/perf_roles.py)")
    parser.add_argument("--floor", action="store_true",
                        help="the protocol's messages alone instead of the library's coordination (flat, or whole "
                             "nodes with --ranks-per-node; --compare adds both after the library's, unless --guard)")
    parser.add_argument("--guard", action="store_true",
                        help="every rank has a (no-op) checkpoint guard: a switch is a guard round, then the switch")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "store_scale.json")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--node", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        server_main(args.fd, args.timeout)
    elif args.role == "node":
        node_main(args.port, args.node, args.nodes, args.world, args.timeout, args.as_is, args.ranks_per_node or None,
                  int(args.nodes_per_group) or None, args.step_ms / 1e3, args.node_transport)
    elif args.role == "leader":
        leader_main(args.port, args.world, args.listed, args.timeout, args.ranks_per_node or None,
                    int(args.nodes_per_group) or None)
    else:
        main_standalone(args)


def main_standalone(args: argparse.Namespace) -> None:
    from benchmarks import SCHEMA_VERSION
    from benchmarks._common import machine, quiet_logging, render_markdown, render_table

    quiet_logging()
    if args.guard:
        os.environ[GUARD_ENV] = "1"  # the node and leader processes read it
    if args.perf:
        os.environ[PERF_ENV] = str(Path(args.perf).resolve())  # run_size reads it
    started_wall = datetime.datetime.now(datetime.timezone.utc)
    started = time.monotonic()
    host = machine()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    per_group: int | str | None = args.nodes_per_group if args.nodes_per_group == "auto" \
        else int(args.nodes_per_group) or None
    if per_group and not args.ranks_per_node:
        raise SystemExit("--nodes-per-group needs --ranks-per-node")
    if args.floor and (args.guard or per_group or args.compare):
        raise SystemExit("--floor runs alone, flat or with --ranks-per-node: it has no guard round and no groups "
                         "(--compare adds its rows itself)")
    common = {"sizes": sizes, "processes": args.processes, "switches": args.switches or None, "listed": args.listed,
              "dual_stack": args.dual_stack, "as_is": args.as_is, "timeout_s": args.timeout,
              "step_s": args.step_ms / 1e3}
    if args.compare:  # flat, then node and group fan-out, each over a TCPStore per node and over the node link
        per_node = args.ranks_per_node or 8
        results = [run(Settings(quick=args.quick), **common)]
        for groups in (None, per_group or "auto"):
            for transport in ("store", "socket"):
                results.append(run(Settings(quick=args.quick), per_node=per_node, per_group=groups,
                                   transport=transport, **common))
        if not args.guard:  # the floor has no guard round: its rows would compare unlike with like
            # The floor's rows, flat and node, after the library's: what the same protocol costs
            # with nothing but its messages, side by side.
            os.environ[FLOOR_ENV] = "1"
            results += [run(Settings(quick=args.quick), **common),
                        run(Settings(quick=args.quick), per_node=per_node, **common)]
            del os.environ[FLOOR_ENV]
    else:
        if args.floor:
            os.environ[FLOOR_ENV] = "1"
        results = [run(Settings(quick=args.quick), per_node=args.ranks_per_node or None, per_group=per_group,
                       transport=args.node_transport, **common)]
    duration = time.monotonic() - started
    for result in results:
        result.duration_s = duration / len(results)
    host["load_average_end"] = machine()["load_average"]
    document = {
        "schema": SCHEMA_VERSION, "mode": "quick" if args.quick else "full",
        "started": started_wall.isoformat(timespec="seconds"), "duration_s": round(result.duration_s, 1),
        "machine": host, "command": " ".join(["python -m benchmarks.store_scale", *sys.argv[1:]]), "runs": 1,
        "benchmarks": {result.name: result.as_dict() for result in results},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(render_table(results))
    side_by_side = compare_table(results)
    if args.compare:
        print("\n" + side_by_side)
    if args.markdown is not None:
        args.markdown.write_text(render_markdown(results) + "\n\n" + side_by_side + "\n", encoding="utf-8")
    print(f"\n{duration:.1f} s on {host['nproc']} CPU(s); load average {host['load_average']} -> "
          f"{host['load_average_end']}; JSON: {args.out}")
    sys.exit(1 if any(result.error for result in results) else 0)


def compare_table(results: Sequence[BenchResult]) -> str:
    """The ranks' side of each fan-out, one row per fan-out and size (Markdown)."""
    rows = ["| fan-out | ranks | requested -> finished | pause: request -> target out | rank CPU / rank | "
            "of which coordination | members | "
            "node relays | group relays | Store servers (node, group) | steps late: mean / > half a step (mean without "
            "those after a wait for S) | steps late while the pause spreads / after | "
            "job Store CPU / rank | job Store sockets / rank |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for s in result.details.get("summary", []):
            roles = s["roles_us"]
            late = (f"{s['late_mean_ms']:.1f} ms / {s['late_over_half']:.0f} of {s['late_steps']:.0f} "
                    f"({s['late_free_ms']:.1f} ms)" if "late_mean_ms" in s else "-")
            split = (f"{s['late_spread_ms']:.1f} / {s['late_rest_ms']:.1f} ms" if "late_spread_ms" in s else "-")
            rows.append(f"| {result.name} | {s['ranks']:,} | {s['total_s']:.2f} s | "
                        f"{s.get('pause_round_s', math.nan) * 1e3:.0f} ms | {s['rank_cpu_us']:,.0f} us | "
                        f"{s['coordination_cpu_us']:,.0f} us | {roles['member']:,.0f} us | "
                        f"{roles['node relay']:,.0f} us | {roles['group relay']:,.0f} us | "
                        f"{roles['Store servers']:,.0f} us | {late} | {split} | "
                        f"{s['job_store_cpu_us']:,.0f} us | {s['sockets_per_rank']:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    _cli()
