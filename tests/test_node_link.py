"""The node link (coordination/node_link.py): the node's Store without a server thread.

Real Unix sockets throughout, and real processes where a side's death is the point. What the
coordination relies on: a key the hub sets reaches every rank before any event pushed after it;
a push to a rank's queue reaches that rank alone, a rank's answer the hub; a rank starting late
starts with an empty queue; a rank's stop wakes its own waits without the hub; whichever thread
reads the sockets, the thread waiting for an answer gets it; a hub that dies is coordination
lost at once for its ranks, after what it sent them; a rank that dies or stops reading is dropped.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import support

from nicswitch_agent.coordination import KV, node_link, node_wire, queues, topology
from nicswitch_agent.coordination import messages as p
from nicswitch_agent.coordination.kv import GONE, WOKEN
from nicswitch_agent.coordination.messages import LevelStopped
from nicswitch_agent.coordination.node_link import LinkClosed, LinkLost, NodeHub, NodeLink
from nicswitch_agent.errors import ConfigError

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not node_link.supported(), reason="the node link needs Linux")]

PREFIX = "nicswitch/job-link/0"


def queue(slot: int) -> str:
    return f"{PREFIX}/q/{slot}"


@pytest.fixture
def hub() -> Iterator[NodeHub]:
    hub = NodeHub()
    yield hub
    hub.close()


def link(hub: NodeHub | str, slot: int) -> NodeLink:
    return NodeLink(hub if isinstance(hub, str) else hub.address, queue(slot), 5.0)


def test_a_key_set_on_the_hub_reaches_every_rank_before_the_events_pushed_after_it(hub: NodeHub) -> None:
    ranks = [link(hub, slot) for slot in (1, 2, 3)]
    hub.set(f"{PREFIX}/order/x", "the order")
    for slot in (1, 2, 3):
        hub.queue_push(queue(slot), f"event for {slot}")
    for slot, rank in enumerate(ranks, 1):
        assert rank.queue_pop_within(queue(slot), 5.0) == f"event for {slot}".encode()
        assert rank.check([f"{PREFIX}/order/x"]) and rank.get(f"{PREFIX}/order/x") == b"the order"
        assert rank.queue_len(queue(slot)) == 0  # its own event only: nobody else's reached it
    hub.delete_keys([f"{PREFIX}/order/x"])
    hub.queue_push(queue(1), "after the delete")
    assert ranks[0].queue_pop_within(queue(1), 5.0) == b"after the delete"
    assert not ranks[0].check([f"{PREFIX}/order/x"])  # the delete came first, on the same socket


def test_answers_reach_the_hub_and_a_ranks_queue_is_held_by_that_rank_alone(hub: NodeHub) -> None:
    one, two = link(hub, 1), link(hub, 2)
    one.queue_push(f"{PREFIX}/a/1/c", "from 1")
    two.queue_push(f"{PREFIX}/a/1/c", "from 2")
    got = {hub.queue_pop_within(f"{PREFIX}/a/1/c", 5.0), hub.queue_pop_within(f"{PREFIX}/a/1/c", 5.0)}
    assert got == {b"from 1", b"from 2"}
    assert hub.queue_pop_within(f"{PREFIX}/a/1/c", 0.05) is None
    hub.queue_push(queue(2), "for 2")
    assert hub.queue_len(queue(2)) == 0  # sent: in rank 2's socket, which outlives the hub
    assert one.queue_pop_within(queue(2), 0.1) is None  # rank 1 never sees rank 2's queue
    assert two.queue_pop_within(queue(2), 5.0) == b"for 2"
    hub.queue_push(queue(0), "for local rank 0")  # no link reads it: the hub's own member does
    assert hub.queue_len(queue(0)) == 1 and hub.queue_pop_within(queue(0), 1.0) == b"for local rank 0"


def test_a_rank_that_joins_late_starts_with_an_empty_queue_and_every_key_set_before(hub: NodeHub) -> None:
    hub.set(f"{PREFIX}/go/1", "set before it dialled")
    hub.queue_push(queue(1), "published before it dialled")  # held for no one: dropped when it comes
    late = link(hub, 1)
    hub.queue_push(queue(1), "published after")
    assert late.queue_pop_within(queue(1), 5.0) == b"published after"
    assert late.get(f"{PREFIX}/go/1") == b"set before it dialled"


def test_a_ranks_stop_wakes_its_own_waits_and_the_hub_hears_nothing_of_it(hub: NodeHub) -> None:
    rank = link(hub, 1)
    kv = KV(rank, PREFIX, queues=True)
    with ThreadPoolExecutor(2) as pool:
        popping = pool.submit(kv.pop, "q/1", 3600.0)
        waiting = pool.submit(kv.get_when_set, "go/7", 3600.0)
        assert support.wait_until(lambda: rank._reading, 10)
        kv.clone().push("q/1", "wake")  # as Member.stop(): through its wake KV (the same copy)
        kv.clone().set("go/7", "woken")
        assert popping.result(10) == "wake" and waiting.result(10) == "woken"
    assert hub.queue_len(queue(1)) == 0 and not hub.check([f"{PREFIX}/go/7"])


def test_a_ranks_stop_wakes_its_members_wait_for_the_next_event_alone(hub: NodeHub) -> None:
    """The member's read of its own queue (one recv, no general wait around it) still says that
    it reads: the stop's wake must shut the socket under it, or the wait lasts its whole bound."""
    rank = link(hub, 1)
    kv = KV(rank, PREFIX, queues=True)
    with ThreadPoolExecutor(1) as pool:
        popping = pool.submit(kv.pop, "q/1", 3600.0)
        assert support.wait_until(lambda: rank._reading, 10)
        kv.clone().push("q/1", "wake")  # as Member.stop()
        assert popping.result(20) == "wake"


def test_a_wait_for_the_next_event_takes_its_own_bound_after_a_longer_one(hub: NodeHub) -> None:
    """The link sets its socket's receive bound only when the wait's bound changes (the member
    waits an hour when idle, max_parked_s when parked): a shorter wait after a longer must end
    at its own bound, not the hour's."""
    rank = link(hub, 1)
    hub.queue_push(queue(1), "the pause")
    assert rank.queue_pop_within(queue(1), 3600.0) == b"the pause"
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(rank.queue_pop_within, queue(1), 0.2).result(30) is None
        hub.queue_push(queue(1), "the target")
        assert pool.submit(rank.queue_pop_within, queue(1), 3600.0).result(30) == b"the target"


def test_a_members_look_for_a_next_event_reads_no_socket(hub: NodeHub) -> None:
    """queues.waiting (is the leader past this order?) answers from the rank's copy: a read of the
    socket would be a system call and a release of the GIL on every order, on every rank."""
    from nicswitch_agent.coordination import queues

    rank = link(hub, 1)
    kv = KV(rank, PREFIX, queues=True)
    hub.queue_push(queue(1), "the order")
    hub.queue_push(queue(1), "the release")
    assert kv.pop("q/1", 5.0) == "the order"  # one recv took both: the release is in the copy
    reads: list[object] = []
    real_read = rank._read
    rank._read = lambda *args: reads.append(args) or real_read(*args)  # type: ignore[method-assign]
    assert queues.waiting(kv, 1, 2) and reads == []
    assert kv.pop("q/1", 5.0) == "the release" and not queues.waiting(kv, 1, 3) and reads == []
    hub.queue_push(queue(1), "unread: still in the socket")
    assert not queues.waiting(kv, 1, 3) and reads == []  # arrived a moment later, as far as this look knows
    assert kv.queued("q/1") == 1  # a Store's count still reads what has arrived


def test_a_link_closed_while_a_thread_waits_in_its_recv_ends_that_wait(hub: NodeHub) -> None:
    """A rank's link reads with one blocking recv (no poll, no wake pipe): closing the socket alone
    would leave that recv blocked for the wait's whole bound; close() must end it (LinkLost now)."""
    rank = link(hub, 1)
    with ThreadPoolExecutor(1) as pool:
        popping = pool.submit(rank.queue_pop_within, queue(1), 3600.0)
        assert support.wait_until(lambda: rank._reading, 10)
        rank.close()
        with pytest.raises(LinkLost, match="closed"):
            popping.result(20)


def test_a_ranks_link_woken_by_its_stop_reads_no_more_and_the_hub_takes_the_rank_for_gone(hub: NodeHub) -> None:
    """The stop's wake shuts the link's reading side: what the copy holds is still taken, later
    waits see this copy only (they neither spin nor fail), and the hub's next send finds the
    rank gone (as when its process ends), so the relay need not wait out a phase for it."""
    rank = link(hub, 1)
    kv = KV(rank, PREFIX, queues=True)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(kv.get_when_set, "go/3", 3600.0)
        assert support.wait_until(lambda: rank._reading, 10)
        kv.push("q/1", "wake")  # the stop's wake of its own queue, while another wait reads
        assert kv.pop("q/1", 5.0) == "wake"
        kv.set("go/3", "woken")
        assert waiting.result(10) == "woken"
    rank._read = lambda *_: pytest.fail("a link woken by its stop read its socket again")  # type: ignore[method-assign]
    assert kv.pop("q/1", 0.2) is None and not rank.lost
    hub.queue_push(queue(1), "an event after the stop")
    assert queue(1) in hub.gone_queues()
    assert kv.pop("q/1", 0.2) is None


def test_whichever_thread_reads_the_sockets_the_one_waiting_for_an_answer_gets_it(hub: NodeHub) -> None:
    """Another thread of the hub's process waits an hour for a queue the ranks may push to, and so
    reads the sockets; the relay waiting for the answers is handed them, also from a rank that
    dialled after that read began."""
    early = link(hub, 1)
    with ThreadPoolExecutor(2) as pool:
        idle = pool.submit(hub.queue_pop_within, f"{PREFIX}/a/9/c", 3600.0)
        assert support.wait_until(lambda: hub._reading, 10)
        answers = pool.submit(lambda: [hub.queue_pop_within(f"{PREFIX}/a/2/parked", 30.0) for _ in range(2)])
        late = link(hub, 2)
        early.queue_push(f"{PREFIX}/a/2/parked", "1 parked")
        late.queue_push(f"{PREFIX}/a/2/parked", "2 parked")
        assert sorted(answers.result(20)) == [b"1 parked", b"2 parked"]  # long before the hour
        assert not idle.done()
        hub.queue_push(f"{PREFIX}/a/9/c", "the end")
        assert idle.result(10) == b"the end"


def test_local_rank_0s_member_waiting_idle_leaves_the_sockets_to_the_relay() -> None:
    """Its queue is pushed to from its own process only: were its idle wait the one reading the
    sockets, every answer would reach the relay through a thread hand-off. Nor does an answer the
    relay reads wake it (it would find nothing, every answer of every switch)."""
    hub = NodeHub(local_queue=queue(0))
    looks: list[str] = []
    take = hub._take

    def counted_take(key: str) -> bytes | None:
        looks.append(key)
        return take(key)

    hub._take = counted_take  # type: ignore[method-assign]
    try:
        rank = link(hub, 1)
        assert support.wait_until(lambda: hub.ranks_connected == 1, 10)  # taken in before the waits begin
        with ThreadPoolExecutor(2) as pool:
            idle = pool.submit(hub.queue_pop_within, queue(0), 3600.0)
            waiting = pool.submit(hub.get, f"{PREFIX}/go/0")  # keys too are set in this process only
            assert support.wait_until(lambda: len(hub._local_cond._waiters) == 2, 10)  # type: ignore[attr-defined]
            assert not hub._reading
            for n in range(20):
                rank.queue_push(f"{PREFIX}/a/1/c", f"answer {n}")
                assert hub.queue_pop_within(f"{PREFIX}/a/1/c", 5.0) == f"answer {n}".encode()  # this thread read it
            looked = looks.count(queue(0))  # (asserted once the waits are over: a failure must not hang the pool)
            hub.queue_push(queue(0), "release")
            hub.set(f"{PREFIX}/go/0", "go")
            assert idle.result(10) == b"release" and waiting.result(10) == b"go"
        assert looked == 1  # the idle member looked once, when it began to wait: no answer woke it
    finally:
        hub.close()


HUB = """
import sys
from nicswitch_agent.coordination.node_link import NodeHub
hub = NodeHub()
print(hub.address, flush=True)
for line in sys.stdin:
    target, _, value = line.strip().partition(" ")
    hub.queue_push(target, value)
    print("sent", flush=True)
"""


def test_a_hub_killed_is_coordination_lost_at_once_for_its_ranks_after_what_it_sent() -> None:
    process = subprocess.Popen([sys.executable, "-c", HUB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdin is not None
        rank = link(process.stdout.readline().strip(), 1)
        process.stdin.write(f"{queue(1)} training must stop\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "sent"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        assert rank.queue_pop_within(queue(1), 3600.0) == b"training must stop"  # sent before it died
        started = time.monotonic()
        with pytest.raises(LinkLost, match=r"the node's relay \(local rank 0\) is gone"):
            rank.queue_pop_within(queue(1), 3600.0)
        assert time.monotonic() - started < 600  # not the hour: a bound, not a timing
        with pytest.raises(LinkLost):
            rank.queue_push(f"{PREFIX}/a/1/c", "an answer nobody reads")
        assert isinstance(LinkLost("x"), RuntimeError)  # what the member and relay take for a lost Store
    finally:
        process.kill()
        process.wait()


def test_a_hub_closed_on_purpose_tells_its_ranks_so_after_what_it_sent() -> None:
    """The agent of local rank 0 stopping closes its hub with a reason: the node's ranks take what
    it sent first, then raise LinkClosed (nothing failed: their member logs it as a stop), where a
    hub that just vanishes is LinkLost only."""
    hub = NodeHub()
    ranks = [link(hub, 1), link(hub, 2)]
    assert support.wait_until(lambda: hub.ranks_connected == 2, 20)
    hub.queue_push(queue(1), "the last release")
    hub.close("local rank 0's agent stopped (signal SIGINT)")
    assert ranks[0].queue_pop_within(queue(1), 3600.0) == b"the last release"
    for slot, rank in enumerate(ranks, 1):
        with pytest.raises(LinkClosed, match=r"^the node's relay \(local rank 0\) stopped: local rank 0's agent "
                                             r"stopped \(signal SIGINT\)$"):
            rank.queue_pop_within(queue(slot), 3600.0)
        with pytest.raises(LinkClosed):
            rank.queue_push(f"{PREFIX}/a/1/c", "an answer nobody reads")
    assert issubclass(LinkClosed, LinkLost) and issubclass(LinkClosed, LevelStopped)
    silent = NodeHub()
    rank = link(silent, 1)
    assert support.wait_until(lambda: silent.ranks_connected == 1, 20)
    silent.close()  # no reason: a close nobody announced is a loss like any other
    with pytest.raises(LinkLost) as lost:
        rank.queue_pop_within(queue(1), 3600.0)
    assert not isinstance(lost.value, LinkClosed), lost.value


RANK = """
import sys, time
from nicswitch_agent.coordination.node_link import NodeLink
link = NodeLink(sys.argv[1], sys.argv[2], 5.0)
print("dialled", flush=True)
time.sleep(3600)
"""


def test_a_rank_that_dies_is_dropped_and_its_successor_takes_its_queue(hub: NodeHub) -> None:
    process = subprocess.Popen([sys.executable, "-c", RANK, hub.address, queue(1)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "dialled"
        assert hub.ranks_connected == 1
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        assert support.wait_until(lambda: (hub.queue_len(queue(0)), hub.ranks_connected)[1] == 0, 10)
        hub.queue_push(queue(1), "for nobody")  # no error: the rank is gone
        successor = link(hub, 1)
        hub.queue_push(queue(1), "for the successor")
        assert successor.queue_pop_within(queue(1), 5.0) == b"for the successor"
    finally:
        process.kill()
        process.wait()


def test_a_rank_that_stops_reading_is_dropped_once_a_send_to_it_cannot_finish(
        hub: NodeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_wire, "SEND_TIMEOUT_S", 0.2)
    stuck, reading = link(hub, 1), link(hub, 2)
    assert hub.ranks_connected == 2
    block = "x" * (1 << 20)
    for _ in range(16):  # far more than a Unix socket buffers: the sends to rank 1 time out
        hub.queue_push(queue(1), block)
        if hub.ranks_connected == 1:
            break
    assert hub.ranks_connected == 1
    hub.set(f"{PREFIX}/k", "still reaches the others")
    assert reading.get(f"{PREFIX}/k") == b"still reaches the others"
    del stuck


def test_the_node_store_is_the_link_on_linux_and_a_tcpstore_when_asked() -> None:
    job = KV(support.tcp_store(), PREFIX)
    hosted, hub = topology.node_kv(job, 0, 0, 10.0, 2)
    joined, kept = topology.node_kv(job, 0, 1, 10.0, 2, transport="store")  # follows its host
    assert isinstance(hub, NodeHub) and isinstance(kept, NodeLink) and hosted.queues and joined.queues
    hosted.push("q/1", "over the link")
    assert joined.pop("q/1", 5.0) == "over the link"
    stored, keep = topology.node_kv(job, 1, 0, 10.0, 2, transport="store")
    assert not isinstance(stored.store, NodeHub | NodeLink) and stored.queues
    hub.close()
    del keep


def test_socket_is_refused_where_abstract_unix_names_do_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_link, "supported", lambda: False)
    with pytest.raises(ConfigError, match=r"node_transport='socket' needs Linux"):
        topology.use_node_link("socket")
    assert not topology.use_node_link("auto") and not topology.use_node_link("store")


def test_a_thread_blocked_reading_wakes_when_another_thread_changes_the_copy(hub: NodeHub) -> None:
    """The reading thread sleeps in select(); a local push from another thread must end it (the
    wake pipe), or a stop would wait for the reader's whole timeout."""
    done = threading.Event()

    def reader() -> None:
        hub.queue_pop_within(queue(0), 3600.0)
        done.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    assert support.wait_until(lambda: hub._reading, 10)
    hub.queue_push(queue(0), "wake")
    assert done.wait(20)


def test_a_tcpstore_client_is_not_taken_for_a_store_with_the_links_calls() -> None:
    """fd_budget.StoreClient answers any attribute (it forwards to torch's client): the KV must
    ask the type, or it calls the link's ``queue_pop_within``/``delete_keys`` on a TCPStore."""
    from nicswitch_agent.coordination.fd_budget import StoreClient

    server = support.tcp_store()
    kv = KV(StoreClient("127.0.0.1", server.port, 10.0, 1, libuv=True), PREFIX, queues=True)
    kv.push("q/1", "an event")
    assert kv.pop("q/1", 5.0) == "an event"
    kv.set("k", "v")
    kv.delete(["k"])
    assert not kv.check(["k"])


def test_the_link_works_in_a_process_holding_more_than_1024_descriptors(hub: NodeHub) -> None:
    """select() cannot watch a descriptor above 1,023 (a training process with data loaders and
    collectives often holds more): seen as dead members at 1,024 ranks in benchmarks/store_scale.py."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if hard == resource.RLIM_INFINITY
                                                else min(hard, max(soft, 1200)), hard))
    # Every free descriptor up to past 1,024 held, with nothing of an earlier test left to close
    # one below meanwhile (its garbage collected first, no collection while they are taken).
    gc.collect()
    gc.disable()
    held: list[tuple[int, int]] = []
    try:
        while not held or held[-1][0] < 1100:
            held.append(os.pipe())
        rank = link(hub, 1)
        gc.enable()
        assert rank._peer.sock.fileno() > 1024
        hub.queue_push(queue(1), "past select()'s limit")
        assert rank.queue_pop_within(queue(1), 5.0) == b"past select()'s limit"
        rank.queue_push(f"{PREFIX}/a/1/c", "and back")
        assert hub.queue_pop_within(f"{PREFIX}/a/1/c", 5.0) == b"and back"
    finally:
        gc.enable()
        for r, w in held:
            os.close(r)
            os.close(w)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_rank_that_finds_a_gone_hubs_address_dials_its_successor_or_says_so() -> None:
    """Under a launcher the keys outlive a restart: a restarting rank may read the address of its
    node's previous hub before the new one is published."""
    from nicswitch_agent.coordination.messages import node_store_key

    job = KV(support.tcp_store(), PREFIX)
    gone, successor = NodeHub(), NodeHub()
    job.set(node_store_key(0), gone.address)
    gone.close()
    with pytest.raises(ConfigError, match=r"could not reach the node's relay at unix:@.* \(within "
                                          r"node_store_timeout_s=0.3 s\)"):
        topology.node_kv(job, 0, 1, 0.3, 2)
    publisher = threading.Timer(0.2, lambda: job.clone().set(node_store_key(0), successor.address))
    publisher.start()
    try:
        joined, _ = topology.node_kv(job, 0, 1, 30.0, 2)
        successor.queue_push(f"{joined.prefix}q/1", "from the successor")
        assert joined.pop("q/1", 5.0) == "from the successor"
    finally:
        publisher.join()
        successor.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to dial as another user")
def test_a_process_of_another_user_cannot_join_the_node(hub: NodeHub) -> None:
    """Any process of the network namespace can dial an abstract name: only the job's user's are ranks."""
    dial = ("import socket, struct, sys; s = socket.socket(socket.AF_UNIX); s.connect('\\0' + sys.argv[1]); "
            "body = sys.argv[2].encode() + b'\\0'; s.sendall(struct.pack('!IB', len(body), 72) + body); "
            "\ntry:\n    print(s.recv(10) == b'', flush=True)\n"
            "except ConnectionResetError:\n    print(True, flush=True)")
    python = "/usr/bin/python3"  # the venv's may be under a directory another user cannot enter
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} to run as another user")
    intruder = subprocess.Popen([python, "-c", dial, hub.address[len("unix:@"):], queue(1)], cwd="/",
                                preexec_fn=lambda: os.setuid(65534), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert support.wait_until(lambda: (hub.ranks_connected, intruder.poll())[1] is not None, 20)
        out, err = intruder.communicate(timeout=10)
        assert out.strip() == "True", err  # its connection was closed at once
        assert hub.ranks_connected == 0
    finally:
        intruder.kill()
        intruder.wait()
    rank = link(hub, 1)  # the job's own user is let in
    assert hub.ranks_connected == 1
    del rank


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} spell them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_a_node_tcpstore_listens_on_127_0_0_1_only() -> None:
    """torch binds a TCPStore server on every interface whatever host it is given; a node's Store
    is the node's alone (docs/security.md)."""
    job = KV(support.tcp_store(), PREFIX)
    stored, server = topology.node_kv(job, 0, 0, 10.0, 2, transport="store")
    assert _listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, and nothing else
    joined, _ = topology.node_kv(job, 0, 1, 10.0, 2, transport="store")
    stored.push("q/1", "over 127.0.0.1")
    assert joined.pop("q/1", 5.0) == "over 127.0.0.1"


def test_a_go_key_reaches_only_the_copy_of_the_rank_it_is_for(hub: NodeHub) -> None:
    """A relay writes its slots' go keys in one multi-set (relay.py _forward_go): at n ranks a node
    would parse n x n of them if every copy got every key."""
    ranks = [link(hub, slot) for slot in (1, 2)]
    kv = KV(hub, PREFIX, queues=True)
    kv.set_for_readers(["go/x/1", "go/x/2"], ["for 1", "for 2"], ["q/1", "q/2"])
    for slot, rank in enumerate(ranks, 1):
        hub.queue_push(queue(slot), "after")  # on the same socket, after the key
        assert rank.queue_pop_within(queue(slot), 5.0) == b"after"
        assert rank.get(f"{PREFIX}/go/x/{slot}") == f"for {slot}".encode()
        assert not rank.check([f"{PREFIX}/go/x/{3 - slot}"]), "another rank's go key reached this copy"
    assert hub.check([f"{PREFIX}/go/x/1", f"{PREFIX}/go/x/2"])  # for local rank 0's member, and a rank that redials
    sent: list[tuple[str | None, bytes]] = []
    send = hub._send
    hub._send = lambda peer, data: (sent.append((peer.queue, data)), send(peer, data))[1]  # type: ignore[method-assign]
    kv.delete(["go/x/1", "go/x/2"])  # as the cleanup does: each delete to the one copy that has the key
    assert sorted((reader, data.count(b"/go/x/")) for reader, data in sent) == [(queue(1), 1), (queue(2), 1)], sent
    for slot, rank in enumerate(ranks, 1):
        hub.queue_push(queue(slot), "after the delete")
        assert rank.queue_pop_within(queue(slot), 5.0) == b"after the delete"
        assert not rank.check([f"{PREFIX}/go/x/{slot}"])
    kv.set_for_readers(["go/y/1", "go/y/2"], ["for 1", "for 2"], ["q/1", "q/2"])
    again = link(hub, 1)  # rank 1 dials again: its own key comes back to it, rank 2's does not
    hub.set(f"{PREFIX}/order/z", "the order")  # the hub takes dialled ranks in as it sets a key
    hub.queue_push(queue(1), "after it dialled")
    assert again.queue_pop_within(queue(1), 5.0) == b"after it dialled"
    assert again.check([f"{PREFIX}/go/y/1"]) and not again.check([f"{PREFIX}/go/y/2"])


def test_the_relay_takes_the_answers_that_arrived_together_in_one_call(hub: NodeHub) -> None:
    """What one read of the ranks' sockets brought is taken at once (NodeHub.queue_pop_all_within):
    in order, nothing left behind; nothing within the bound is []; a rank's link closing while
    the relay waits ends the wait with GONE, as a single pop's does."""
    answers = f"{PREFIX}/a/1/c"
    ranks = [link(hub, slot) for slot in (1, 2, 3)]
    for slot, rank in enumerate(ranks, 1):
        rank.queue_push(answers, f"from {slot}")
    got: list[bytes] = []
    while len(got) < 3:
        got += hub.queue_pop_all_within(answers, 5.0)
    assert sorted(got) == [b"from 1", b"from 2", b"from 3"]
    assert hub.queue_pop_all_within(answers, 0.05) == []
    hub.queue_push(answers, "local 1")  # local rank 0's member answers in process
    hub.queue_push(answers, "local 2")
    assert hub.queue_pop_all_within(answers, 5.0) == [b"local 1", b"local 2"]
    ranks[0].close()
    assert hub.queue_pop_all_within(answers, 30.0) == [GONE.encode()]


def test_a_gather_takes_what_came_before_a_wake_and_nothing_after_it(hub: NodeHub) -> None:
    """A stop's wake pushed behind answers that arrive with it in one batch: the answers before
    it count, the wait ends at it (queues._arrivals), what came after it is not taken as an answer."""
    kv = KV(hub, PREFIX, queues=True)
    for slot in (0, 1):
        kv.push(queues.answers(7, "c"), p.encode({"t": queues.ANSWER, "s": slot, "v": 5}))
    kv.push(queues.answers(7, "c"), WOKEN)
    kv.push(queues.answers(7, "c"), p.encode({"t": queues.ANSWER, "s": 2, "v": 5}))
    got = queues.gather(kv, 7, "c", 3, time.monotonic() + 3600, None)
    assert sorted(got) == [0, 1]


def test_one_read_of_the_wake_pipe_takes_every_wake_written(hub: NodeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading thread's poll wakes for the pipe that local changes write to; one read empties
    it (a second only finds it empty: one more system call and GIL release per local answer)."""
    reads: list[int] = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        if fd == hub._wake_r:
            reads.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(node_link.os, "read", counting_read)
    for _ in range(3):  # three wakes waiting in the pipe
        os.write(hub._wake_w, b"x")
    assert hub.queue_pop_all_within(f"{PREFIX}/a/1/c", 0.0) == []
    assert len(reads) == 1
    assert hub.queue_pop_all_within(f"{PREFIX}/a/1/c", 0.0) == []  # nothing left to read: no wake
    assert len(reads) == 1
