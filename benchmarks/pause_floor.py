"""The floor under a paused switch: the same protocol with nothing but its messages.

``store_scale --floor`` runs, in the same processes, with the same training threads, the same
``ParkingLot`` and the same measurements, a coordination that does only what the step-aligned
pause and a switch need (docs/architecture.md): the leader's four events (pause, target step,
order, release) and the ranks' three answers (the last completed step, parked, the result), with
no message encoding beyond a short string, no queues, no listeners, no timeouts beyond the
blocking calls', no key deletes, no failure handling. Two shapes:

- ``flat``: every rank's member blocks in one ``get`` of the event's key on the job's TCPStore
  (one ``set`` by the leader wakes them all), answers with a ``set`` and an ``add``; the answer
  that completes the count sets the ``done`` key the leader blocks on.
- ``node``: a relay thread per node blocks on the job's Store as a flat member does and passes
  each event to its node's members over one Unix socket pair each (a ``send``; the member blocks
  in ``recv``), gathers their answers (one ``recv`` each) and answers once for the node.

What the library's coordination costs beyond this, at the same size on the same machine, is
what its messages' Python, its guarantees and its failure handling cost; what the floor itself
costs (the training threads' lateness among them) is what no coordination of this protocol in
Python can go under here. Not a design to use: a rank that dies hangs it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

PAUSE, TARGET, ORDER, RELEASE, STOP = "p", "t", "o", "r", "s"
PREFIX = "floor/"


def _event(kind: str, epoch: int, value: int = 0) -> str:
    return f"{kind}:{epoch}:{value}"


def _parse(text: bytes | str) -> tuple[str, int, int]:
    kind, epoch, value = (text.decode() if isinstance(text, bytes) else text).split(":")
    return kind, int(epoch), int(value)


class FloorMember:
    """One rank: reads an event, drives its ParkingLot as the library's Member does, answers."""

    def __init__(self, rank: int, lot: Any, last_step: Callable[[], int | None],
                 receive: Callable[[int], str], answer: Callable[[int, str], None]) -> None:
        self.rank, self.lot, self._last_step = rank, lot, last_step
        self._receive, self._answer = receive, answer
        self._local: dict[int, int] = {}
        self.events_handled = 0
        self.switched_on: list[str] = []  # the threads the switch hook ran on
        self.lost = ""
        self._thread = threading.Thread(target=self._run, name="floor-member", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _switch(self) -> bool:
        """The switch hook (a no-op, as store_scale's): notes the thread it ran on."""
        self.switched_on.append(threading.current_thread().name)
        return True

    def _run(self) -> None:
        n = 0
        while True:
            n += 1
            kind, epoch, value = _parse(self._receive(n))
            if kind == STOP:
                return
            self.events_handled += 1
            lot = self.lot
            if kind == PAUSE:
                self._local[epoch] = lot.request(aligned=True, label=epoch)  # the flag, then the step
                step = self._last_step()
                self._answer(n, str(-1 if step is None else step))
            elif kind == TARGET:
                lot.set_target(self._local[epoch], value)
                self._answer(n, "1" if lot.wait_parked(self._local[epoch], 600.0) else "0")
            elif kind == ORDER:  # the switch hook runs on the parked training thread, as in pause mode agent
                self._answer(n, "1" if lot.run_parked(self._switch).result(600.0) else "0")
            elif kind == RELEASE:
                self._local.pop(epoch, None)
                lot.release()


class FloorRelay:
    """One node: the job Store's events to its members over socket pairs, their answers up once."""

    def __init__(self, store: Any, node: int, nodes_above: int, sockets: list[socket.socket]) -> None:
        self.store, self.node, self._above, self._sockets = store, node, nodes_above, sockets
        self._label = "node"
        self.lost = ""
        self._thread = threading.Thread(target=self._run, name="floor-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while True:
            n += 1
            text = self.store.get(f"{PREFIX}ev/{n}")
            data = text if isinstance(text, bytes) else text.encode()
            for sock in self._sockets:
                sock.sendall(data)
            kind = _parse(data)[0]
            if kind == STOP:
                return
            if kind == RELEASE:
                continue
            values = [int(sock.recv(64)) for sock in self._sockets]
            answer_up(self.store, n, self.node, self._above, str(max(values) if kind == PAUSE else min(values)))


def answer_up(store: Any, n: int, index: int, expected: int, value: str) -> None:
    """One answer to event ``n`` on the job's Store; the one completing the count sets ``done``."""
    store.set(f"{PREFIX}a/{n}/{index}", value)
    if store.add(f"{PREFIX}c/{n}", 1) == expected:
        store.set(f"{PREFIX}done/{n}", "1")


def start_flat(ranks: list[Any], store: Any, world: int) -> list[FloorMember]:
    """Every rank a member on the job's Store (``ranks``: store_scale's RankThreads, started)."""
    members = []
    for r in ranks:
        own = store.clone()

        def receive(n: int, own: Any = own) -> str:
            value = own.get(f"{PREFIX}ev/{n}")
            return value.decode() if isinstance(value, bytes) else str(value)

        def answer(n: int, value: str, own: Any = own, rank: int = r.rank) -> None:
            answer_up(own, n, rank, world, value)

        members.append(FloorMember(r.rank, r.lot, lambda r=r: r.last_step, receive, answer))
    for m in members:
        m.start()
    return members


def start_node(ranks: list[Any], store: Any, per_node: int, world: int) -> tuple[list[FloorMember], list[FloorRelay]]:
    """A relay per node of ``per_node`` ranks (this process hosts whole nodes), its members on socket pairs."""
    members, relays = [], []
    for first in range(0, len(ranks), per_node):
        node_ranks = ranks[first:first + per_node]
        # SOCK_SEQPACKET: a release and the next pause sent before the member reads stay two messages.
        ends = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in node_ranks]
        relays.append(FloorRelay(store.clone(), node_ranks[0].rank // per_node, world // per_node,
                                 [relay_end for relay_end, _ in ends]))
        for r, (_, member_end) in zip(node_ranks, ends, strict=True):
            def receive(n: int, sock: socket.socket = member_end) -> str:
                return sock.recv(64).decode()

            def answer(n: int, value: str, sock: socket.socket = member_end) -> None:
                sock.sendall(value.encode())

            members.append(FloorMember(r.rank, r.lot, lambda r=r: r.last_step, receive, answer))
    for thread in [*relays, *members]:
        thread.start()
    return members, relays


class FloorLeader:
    """The leader's side: one event per phase, one blocking wait for its answers."""

    def __init__(self, store: Any, answerers: int) -> None:
        self.store, self.answerers = store, answerers
        self._n = 0
        self._epoch = 0
        self.target_out = 0.0  # when the last pause's target step went out (monotonic)

    def _phase(self, kind: str, value: int = 0, *, answered: bool = True) -> list[int]:
        self._n += 1
        n = self._n
        self.store.set(f"{PREFIX}ev/{n}", _event(kind, self._epoch, value))
        if not answered:
            return []
        self.store.get(f"{PREFIX}done/{n}")  # blocks until the last answer
        values = [int(v) for v in self.store.multi_get([f"{PREFIX}a/{n}/{i}" for i in range(self.answerers)])]
        if kind != PAUSE and min(values) != 1:
            raise RuntimeError(f"floor: event {n} ({kind}) answered {values.count(0)} times false")
        return values

    def pause(self) -> int:
        """Pause every rank at one step; returns it."""
        self._epoch += 1
        target = max(self._phase(PAUSE)) + 1
        self.target_out = time.monotonic()
        self._phase(TARGET, target)
        return target

    def run(self) -> None:
        self._phase(ORDER)

    def release(self) -> None:
        self._phase(RELEASE, answered=False)

    def stop(self) -> None:
        """End every member and relay thread (the benchmark's processes just exit)."""
        self._phase(STOP, answered=False)
