"""A channel to ClusterD connects over a slow link (clusterd/channel.py, ``connect_timeout_s``).

gRPC core takes ``grpc.min_reconnect_backoff_ms`` as the time one connection attempt may take.
It was once set to the first backoff (0.2 s), and then every attempt over a link whose handshake
took longer failed: ``switch``, ``watch`` and ``doctor`` could not reach a ClusterD that a plain
grpcio channel reached in 0.3 s. Here a relay delays every chunk each way, so the handshake (TCP,
then the HTTP/2 preface and settings both ways) takes well over 0.2 s.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.sim import SimJob, Simulator

JOB = "job-slow-link"
DELAY_S = 0.4  # per chunk, each way: the handshake alone crosses it at least twice


@contextlib.contextmanager
def slow_link(target: str, delay_s: float) -> Iterator[str]:
    """A TCP relay to ``target`` that holds every chunk ``delay_s`` before passing it on (a link
    with that latency); yields the address to dial."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = target.rsplit(":", 1)
    sockets: list[socket.socket] = []
    lock = threading.Lock()

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                time.sleep(delay_s)  # the link's latency, not a synchronisation
                sink.sendall(chunk)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
                server = socket.create_connection((host, int(port)), timeout=10)
            except OSError:
                return
            server.settimeout(None)
            with lock:
                sockets.extend((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=pump, args=(source, sink), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        with lock:
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


@pytest.fixture
def sim() -> Iterator[Simulator]:
    with Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0"]})]) as server:
        yield server


def health_check(target: str, **settings: float) -> str:
    channel = open_channel(ChannelSettings(target=target, **settings))
    try:
        reply = RecoverStub(channel).HealthCheck(pb.ClientInfo(jobId=JOB, role="agent"), timeout=30)
        return str(reply.info)
    finally:
        channel.close()


def test_the_default_channel_connects_over_a_link_slower_than_the_first_backoff(sim: Simulator) -> None:
    """What the command-line tools open (ChannelSettings' defaults) reaches ClusterD through it."""
    with slow_link(sim.address, DELAY_S) as address:
        assert health_check(address) == f"jobId={JOB}, receive HeathCheck"


def test_an_attempt_shorter_than_the_handshake_never_connects(sim: Simulator) -> None:
    """The link is slow enough to matter: with attempts bounded by 0.2 s (the old setting) no
    attempt ever completes, and the call fails UNAVAILABLE long before its own deadline."""
    with slow_link(sim.address, DELAY_S) as address, pytest.raises(grpc.RpcError) as failure:
        health_check(address, connect_timeout_s=0.2, reconnect_initial_s=0.2, reconnect_max_s=0.2)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value


def test_the_agents_setting_reaches_the_channel() -> None:
    options = dict(ChannelSettings(target="127.0.0.1:1", connect_timeout_s=7.5).options())
    assert options["grpc.min_reconnect_backoff_ms"] == 7500
    assert options["grpc.initial_reconnect_backoff_ms"] == 200  # the first backoff stays its own


def test_the_agents_channel_is_opened_with_its_connect_timeout(sim: Simulator) -> None:
    from nicswitch_agent import SwitchAgent
    from nicswitch_agent.clusterd import channel as channel_module

    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", dry_run=True, connect_timeout_s=7.5)
    agent.start()
    try:
        opened = [s for s in list(channel_module._OPENED_WITH.values()) if s.target == sim.address]
    finally:
        agent.stop("test done")
    assert opened and all(s.connect_timeout_s == 7.5 for s in opened), opened
