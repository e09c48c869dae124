"""``python -m benchmarks.node_transport``: the floor of a node's fan-out, by how its messages travel.

Issue 21 asks the node layer (a relay and its node's members) to cost less than flat. Its bill is
Python around the events, and the messages themselves. This benchmark prices the messages alone,
in the shape of one switch with node fan-out, with real processes: one relay process and
``--members`` member processes per node, ``--nodes`` nodes at once. A switch is 4 events from the
relay to each member (pause, target, order, release); a member answers the first three, and the
relay waits for every member's answer before the next event. Nothing else runs: no training
thread, no decoding, no hooks. Three ways to carry the messages, run side by side in one
invocation, in interleaved rounds:

- ``store-queues``: what the agent does today (coordination/queues.py). The relay hosts a torch
  TCPStore (libuv; its server thread is in the relay's process); an event is a ``queue_push`` to
  each member's queue, which the member's blocking ``queue_pop`` takes; an answer is a
  ``queue_push`` to the phase's queue, which the relay pops once per member.
- ``store-wait``: the same Store, answers as keys: each member ``set``s its own key (no reply);
  the relay blocks in one ``wait`` on all of them, reads them with one ``multi_get`` and deletes
  them (one ``delete_key`` each: the Store has no multi-delete).
- ``sockets``: no Store: each member holds a Unix socket to its relay; an event is one framed
  ``sendall`` to each member's socket, which the member's blocking ``recv`` takes; an answer is one
  framed ``sendall`` back, and the relay reads whichever member sockets are ready (``selectors``).
- ``py-store``: a Store of queues written in Python and hosted in the relay's process, which a
  Store-shaped node transport would be (the same calls as ``store-queues``, so the coordination
  above it would not change): a member's ``pop`` is a request over its Unix socket, answered at
  once if its queue holds an event or else by the relay's next push to it, which the relay's
  thread writes to that member's socket itself; a member's ``push`` of an answer is one frame (no
  reply), which the Store's thread (a ``selectors`` loop in the relay's process) queues and hands
  to the relay's thread, waiting on a condition.
- ``link``: the agent's node link (coordination/node_link.py, ``node_transport`` ``auto`` on
  Linux) through the agent's own calls (``KV.push``/``KV.pop``): the relay's process holds the
  node's queues (``NodeHub``), each member one Unix socket and a copy (``NodeLink``); the relay's
  thread reads the members' sockets itself while it waits for their answers. No server thread.

Reported per rank per switch: CPU of the members, of the relay's thread, and of the rest of the
relay's process (the Store's server thread; about nothing with sockets), and the relay's wall time
per switch. Standalone, not in ``python -m benchmarks``: a reference for a design choice, not a
target.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import multiprocessing as mp
import os
import selectors
import socket
import statistics
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

WAYS = ("store-queues", "store-wait", "sockets", "py-store", "link")
PREFIX = "nicswitch/bench/0"
EVENTS = (  # about the size of the agent's events (coordination/messages.py)
    b'{"t":"pause","e":7,"n":8,"d":1733400000.123,"m":"agent"}',
    b'{"t":"target","e":7,"n":8,"s":1234,"d":1733400000.456}',
    b'{"t":"order","e":7,"n":8,"k":"o7","r":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15],"b":1,"v":0}',
    b'{"t":"release","e":7,"oc":{"k":"o7","ok":1,"at":1733400000.789}}',
)
ANSWERED = 3  # the first three events are answered
GAP_S = 0.02  # between switches: a switch is a rare event, each starts from blocked readers
FRAME = struct.Struct("!I")


def _answer(slot: int, event: int) -> bytes:
    return b'{"t":"a","s":%d,"v":1234,"ev":%d}' % (slot, event)


# -- the members -----------------------------------------------------------------------------


def _member(way: str, address: str, slot: int, switches: int, out: Any) -> None:
    if way == "sockets":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        sock.sendall(FRAME.pack(slot))
        reader = sock.makefile("rb", buffering=0)

        def read() -> bytes:
            (size,) = FRAME.unpack(_exactly(reader, FRAME.size))
            return _exactly(reader, size)

        def answer(switch: int, event: int) -> None:
            text = _answer(slot, event)
            sock.sendall(FRAME.pack(len(text)) + text)
    elif way == "link":
        from nicswitch_agent.coordination import KV
        from nicswitch_agent.coordination.node_link import NodeLink

        kv = KV(NodeLink(address, f"{PREFIX}/q/{slot}", 60.0), PREFIX, queues=True)

        def read() -> bytes:
            text = kv.pop(f"q/{slot}", 60.0)
            assert text is not None
            return text.encode()

        def answer(switch: int, event: int) -> None:
            kv.push(f"a/{switch}/{event}", _answer(slot, event).decode())
    elif way == "py-store":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        reader = sock.makefile("rb", buffering=0)
        pop = _request(b"P" + f"q/{slot}".encode())

        def read() -> bytes:
            sock.sendall(pop)
            (size,) = FRAME.unpack(_exactly(reader, FRAME.size))
            return _exactly(reader, size)

        def answer(switch: int, event: int) -> None:
            sock.sendall(_request(b"U" + f"a/{switch}/{event}".encode() + b"\0" + _answer(slot, event)))
    else:
        from torch.distributed import TCPStore

        host, port = address.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60), use_libuv=True)
        queue = f"q/{slot}"

        def read() -> bytes:
            return bytes(store.queue_pop(queue))

        if way == "store-queues":
            def answer(switch: int, event: int) -> None:
                store.queue_push(f"a/{switch}/{event}", _answer(slot, event))
        else:
            def answer(switch: int, event: int) -> None:
                store.set(f"a/{switch}/{event}/{slot}", _answer(slot, event))
    spent = 0.0
    for switch in range(switches):
        start = time.process_time()
        for event in range(len(EVENTS)):
            read()
            if event < ANSWERED:
                answer(switch, event)
        spent += time.process_time() - start if switch > 0 else 0.0  # switch 0 warms up
    out.send(spent)


def _request(body: bytes) -> bytes:
    return FRAME.pack(len(body)) + body


def _frames(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole length-prefixed frames at the start of ``buffer`` (their bodies), and the rest."""
    bodies = []
    while len(buffer) >= FRAME.size:
        (size,) = FRAME.unpack_from(buffer)
        if len(buffer) < FRAME.size + size:
            break
        bodies.append(buffer[FRAME.size:FRAME.size + size])
        buffer = buffer[FRAME.size + size:]
    return bodies, buffer


def _exactly(reader: Any, size: int) -> bytes:
    data = reader.read(size)
    if data is None or len(data) != size:
        raise ConnectionError("the relay went away")
    return bytes(data)


# -- the relay ---------------------------------------------------------------------------------


@dataclass
class Round:
    way: str
    members: float  # CPU per rank per switch, us
    relay: float
    server: float
    wall_ms: float  # per switch, median


class _PyQueueStore:
    """``py-store``'s Store: queues in the relay's process, its members' requests served by a thread."""

    def __init__(self, conns: list[socket.socket]) -> None:
        self._queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._waiting: dict[str, socket.socket] = {}  # a member's pop that found its queue empty
        self._cond = threading.Condition()
        self._conns = conns
        threading.Thread(target=self._serve, daemon=True).start()

    def push(self, queue: str, value: bytes) -> None:
        """The relay's push: straight to a member blocked on ``queue``, from this thread."""
        with self._cond:
            conn = self._waiting.pop(queue, None)
            if conn is None:
                self._queues[queue].append(value)
                self._cond.notify_all()
                return
        conn.sendall(FRAME.pack(len(value)) + value)

    def pop(self, queue: str) -> bytes:
        """The relay's pop: waits on the condition the Store's thread notifies."""
        with self._cond:
            while not self._queues[queue]:
                self._cond.wait()
            return self._queues[queue].popleft()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        buffers: dict[socket.socket, bytes] = {}
        for conn in self._conns:
            selector.register(conn, selectors.EVENT_READ)
            buffers[conn] = b""
        while True:
            for key, _ in selector.select():
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                data = conn.recv(65536)
                if not data:
                    selector.unregister(conn)
                    continue
                bodies, buffers[conn] = _frames(buffers[conn] + data)
                for body in bodies:
                    self._handle(conn, body)

    def _handle(self, conn: socket.socket, body: bytes) -> None:
        if body[:1] == b"U":
            queue, value = body[1:].split(b"\0", 1)
            self.push(queue.decode(), value)
            return
        queue = body[1:].decode()  # b"P": a pop
        with self._cond:
            if not self._queues[queue]:
                self._waiting[queue] = conn
                return
            value = self._queues[queue].popleft()
        conn.sendall(FRAME.pack(len(value)) + value)


def _run_node(way: str, members: int, switches: int, ready: Any, go: Any, out: Any) -> None:
    """One node: start its members, run ``switches`` switches, send back (members, relay, server, walls)."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        if way == "link":
            from nicswitch_agent.coordination import KV
            from nicswitch_agent.coordination.node_link import NodeHub

            hub = NodeHub(local_queue=f"{PREFIX}/q/none")
            address = hub.address
        elif way in ("sockets", "py-store"):
            address = os.path.join(tmp, "relay.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)
            listener.listen(members)
        else:
            from torch.distributed import TCPStore

            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=60), use_libuv=True)
            address = f"127.0.0.1:{store.port}"
        for slot in range(members):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_member, args=(way, address, slot, switches, theirs), daemon=True)
            proc.start()
            pipes.append(mine)
            procs.append(proc)
        if way == "link":
            hub_kv = KV(hub, PREFIX, queues=True)
            while hub.ranks_connected < members:
                time.sleep(0.01)

            def publish(switch: int, event: int) -> None:
                for slot in range(members):
                    hub_kv.push(f"q/{slot}", EVENTS[event].decode())

            def gather(switch: int, event: int) -> None:
                for _ in range(members):
                    assert hub_kv.pop(f"a/{switch}/{event}", 60.0) is not None
        elif way == "py-store":
            py_store = _PyQueueStore([listener.accept()[0] for _ in range(members)])

            def publish(switch: int, event: int) -> None:
                for slot in range(members):
                    py_store.push(f"q/{slot}", EVENTS[event])

            def gather(switch: int, event: int) -> None:
                for _ in range(members):
                    py_store.pop(f"a/{switch}/{event}")
        elif way == "sockets":
            socks: list[socket.socket] = [socket.socket()] * members
            for _ in range(members):
                conn, _ = listener.accept()
                (slot,) = FRAME.unpack(conn.recv(FRAME.size, socket.MSG_WAITALL))
                socks[slot] = conn
            selector = selectors.DefaultSelector()
            for slot, conn in enumerate(socks):
                selector.register(conn, selectors.EVENT_READ, slot)
            buffers = [b""] * members

            def publish(switch: int, event: int) -> None:
                frame = FRAME.pack(len(EVENTS[event])) + EVENTS[event]
                for conn in socks:
                    conn.sendall(frame)

            def gather(switch: int, event: int) -> None:
                got = 0
                while got < members:
                    for key, _ in selector.select():
                        slot = key.data
                        data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                        if not data:
                            raise ConnectionError(f"member {slot} went away")
                        bodies, buffers[slot] = _frames(buffers[slot] + data)
                        got += len(bodies)
        else:
            store.set_timeout(datetime.timedelta(seconds=60))

            def publish(switch: int, event: int) -> None:
                for slot in range(members):
                    store.queue_push(f"q/{slot}", EVENTS[event])

            if way == "store-queues":
                def gather(switch: int, event: int) -> None:
                    for _ in range(members):
                        store.queue_pop(f"a/{switch}/{event}")
            else:
                def gather(switch: int, event: int) -> None:
                    keys = [f"a/{switch}/{event}/{slot}" for slot in range(members)]
                    store.wait(keys)
                    store.multi_get(keys)
                    for key in keys:
                        store.delete_key(key)
        ready.send(True)
        go.recv()
        walls: list[float] = []
        relay = process = 0.0
        for switch in range(switches):
            time.sleep(GAP_S)
            wall, thread, proc_cpu = time.perf_counter(), time.thread_time(), time.process_time()
            for event in range(len(EVENTS)):
                publish(switch, event)
                if event < ANSWERED:
                    gather(switch, event)
            if switch > 0:
                walls.append(time.perf_counter() - wall)
                relay += time.thread_time() - thread
                process += time.process_time() - proc_cpu
        spent = sum(pipe.recv() for pipe in pipes)
        for proc in procs:
            proc.join(30)
        out.send((spent, relay, max(process - relay, 0.0), walls))


def run_round(way: str, nodes: int, members: int, switches: int) -> Round:
    ctx = mp.get_context("spawn")
    links, procs = [], []
    for _ in range(nodes):
        ready_here, ready_there = ctx.Pipe()
        go_here, go_there = ctx.Pipe()
        out_here, out_there = ctx.Pipe()
        proc = ctx.Process(target=_run_node, args=(way, members, switches, ready_there, go_there, out_there))
        proc.start()
        links.append((ready_here, go_here, out_here))
        procs.append(proc)
    for ready, _, _ in links:
        ready.recv()
    for _, go, _ in links:
        go.send(True)  # every node's switches start together: the nodes share the cores
    results = [out.recv() for _, _, out in links]
    for proc in procs:
        proc.join(30)
    per = 1e6 / (nodes * members * (switches - 1))
    return Round(way, members=sum(r[0] for r in results) * per, relay=sum(r[1] for r in results) * per,
                 server=sum(r[2] for r in results) * per,
                 wall_ms=statistics.median(w for r in results for w in r[3]) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1, help="nodes switching at once (default 1)")
    parser.add_argument("--members", type=int, default=8, help="members per node (default 8)")
    parser.add_argument("--switches", type=int, default=200, help="switches per round, the first a warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every way (default 3)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"which, comma-separated (default {','.join(WAYS)})")
    args = parser.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or args.switches < 2 or args.nodes < 1 or args.members < 1 or args.rounds < 1:
        parser.error(f"--ways must name {', '.join(WAYS)} (got {unknown}); --switches >= 2, the rest >= 1")
    rounds: dict[str, list[Round]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            rounds[way].append(run_round(way, args.nodes, args.members, args.switches))
    print(f"{args.nodes} node(s) of {args.members} members, {args.switches - 1} switches a round, "
          f"{args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}")
    print("| way | members | relay thread | relay process, rest (Store server) | node total | wall per switch |")
    print("|---|---|---|---|---|---|")
    for way in ways:
        rs = rounds[way]

        def span(values: list[float], digits: int = 0) -> str:
            return f"{min(values):,.{digits}f}-{max(values):,.{digits}f}"

        print(f"| {way} | {span([r.members for r in rs])} us | {span([r.relay for r in rs])} us | "
              f"{span([r.server for r in rs])} us | {span([r.members + r.relay + r.server for r in rs])} us | "
              f"{span([r.wall_ms for r in rs], 2)} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
