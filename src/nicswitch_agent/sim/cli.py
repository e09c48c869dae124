"""``nicswitch-agent sim``: serve a simulated ClusterD until SIGINT/SIGTERM.

The lead wires :func:`add_arguments` and :func:`run` into the main CLI; ``python -m
nicswitch_agent.sim`` runs them standalone.

Example::

    nicswitch-agent sim --port 8899 --job job-1 --nodes node-0:0,1 --nodes node-1:0,1 --standin

With ``--tls-cert``/``--tls-key`` it serves TLS (the real ClusterD does not: its nginx proxy does),
and with ``--tls-client-ca`` mutual TLS, to rehearse an agent's TLS settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any, TextIO

from nicswitch_agent.sim.ranktable import RankTable
from nicswitch_agent.sim.server import ServerTls, Simulator
from nicswitch_agent.sim.settings import SimJob, SimSettings

__all__ = ["add_arguments", "main", "parse_nodes", "run", "server_tls"]

_DEFAULT_NODES = ("node-0:0,1", "node-1:0,1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nicswitch-agent sim``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8899, help="port (ClusterD's is 8899; 0 picks a free one)")
    parser.add_argument("--job", default="job-1", help="job id (MINDX_TASK_ID) the simulator knows")
    parser.add_argument(
        "--nodes",
        action="append",
        metavar="NODE:DEV,DEV",
        help=f"a node and its device ids, in pod-rank order; repeat per node (default: {' '.join(_DEFAULT_NODES)})",
    )
    parser.add_argument(
        "--standin",
        action="store_true",
        help="also run a MindIO stand-in (answers pause/continue), for pause mode external",
    )
    parser.add_argument(
        "--report-timeout",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="ClusterD's wait for each report and for the switch reply (default 900)",
    )
    parser.add_argument("--keepalive", type=float, default=5.0, metavar="SECONDS", help="keep-alive period")
    parser.add_argument(
        "--strategies",
        default="retry,recover,dump",
        help="the PodGroup recover-strategy annotation (exit is always allowed)",
    )
    parser.add_argument("--not-running", action="store_true", help="the job is not running (SwitchNicTrack: 413)")
    parser.add_argument(
        "--quick-recovery",
        action="store_true",
        help="shrink the fault-recovery waits (about 80 s after a failed switch) to under a second",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for the random node order")
    parser.add_argument("--no-shuffle", action="store_true", help="keep the request's node order")
    parser.add_argument("-v", "--verbose", action="store_true", help="also print every signal, list, reply and report")
    tls = parser.add_argument_group("TLS (the real ClusterD serves plaintext; its nginx proxy does TLS)")
    tls.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this server certificate (needs --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", help="the server certificate's unencrypted private key")
    tls.add_argument("--tls-client-ca", metavar="PEM",
                     help="require client certificates signed by this CA (mutual TLS; needs --tls-cert)")


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    """``--tls-cert/--tls-key/--tls-client-ca`` as :class:`ServerTls`; None: plaintext. ValueError on misuse."""
    cert, key, client_ca = (getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_client_ca"))
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerTls(cert_file=cert, key_file=key, client_ca_file=client_ca)


def parse_nodes(values: Sequence[str]) -> dict[str, list[str]]:
    """``["node-0:0,1", ...]`` -> ``{"node-0": ["0", "1"], ...}``; ValueError on bad input."""
    nodes: dict[str, list[str]] = {}
    for value in values:
        name, sep, devices = value.partition(":")
        name = name.strip()
        devs = [d.strip() for d in devices.split(",") if d.strip()]
        if not sep or not name or not devs:
            raise ValueError(f"--nodes {value!r}: expected NODE:DEV[,DEV...]")
        if name in nodes:
            raise ValueError(f"--nodes: node {name!r} given twice")
        nodes[name] = devs
    return nodes


class _LineHandler(logging.Handler):
    """Prints the simulator's log to the operator's terminal: at INFO, one line per state change
    (and per reset); protocol misuse as WARNING; with ``--verbose`` every message as well."""

    def __init__(self, out: TextIO) -> None:
        super().__init__(logging.INFO)
        self._out = out
        self.setFormatter(logging.Formatter("%(asctime)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._out.write(self.format(record) + "\n")
            self._out.flush()
        except Exception:
            self.handleError(record)


def run(args: argparse.Namespace, *, stop_event: threading.Event | None = None, out: TextIO | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or ``stop_event``, for embedding and tests). Returns 0.

    Prints the address, the rank table, then one line per state change.
    """
    out = out if out is not None else sys.stdout
    try:
        nodes = parse_nodes(args.nodes or _DEFAULT_NODES)
        job = SimJob(
            job_id=args.job,
            nodes=nodes,
            running=not args.not_running,
            recover_strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
        )
        settings = SimSettings(
            report_timeout_s=args.report_timeout,
            keepalive_interval_s=args.keepalive,
            shuffle_nodes=not args.no_shuffle,
            seed=args.seed,
        )
        tls = server_tls(args)
        if args.quick_recovery:
            # The whole recovery tail after a failed switch (about 80 s upstream) in under a second.
            settings = dataclasses.replace(
                settings, fault_flush_s=0.05, force_release_s=0.1, schedule_wait_s=0.1, restart_wait_s=0.2
            )
    except ValueError as exc:
        print(f"nicswitch-agent sim: {exc}", file=sys.stderr)
        return 2

    stop = stop_event if stop_event is not None else threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def _on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, _on_signal)

    sim_logger = logging.getLogger("nicswitch_agent.sim")
    handler = _LineHandler(out)
    sim_logger.addHandler(handler)
    old_level, old_propagate = sim_logger.level, sim_logger.propagate
    sim_logger.propagate = False  # our handler prints each line; the root handler must not print it again
    wanted = logging.DEBUG if args.verbose else logging.INFO
    handler.setLevel(wanted)
    if sim_logger.getEffectiveLevel() > wanted:
        sim_logger.setLevel(wanted)
    sim = Simulator(jobs=[job], settings=settings, host=args.host, port=args.port, standin=args.standin, tls=tls)
    try:
        try:
            address = sim.start()
        except (OSError, RuntimeError) as exc:
            print(f"nicswitch-agent sim: {exc}", file=sys.stderr)
            return 1
        out.write(f"ClusterD simulator listening on {address}{'' if tls is None else ' with ' + tls.describe()}\n")
        for server in RankTable(job.nodes).servers:
            pairs = " ".join(f"{d}->{r}" for d, r in zip(server.device_ids, server.rank_ids, strict=True))
            out.write(f"  job {job.job_id} node {server.server_name}: device->rank {pairs}\n")
        if args.standin:
            out.write("  MindIO stand-in subscribed (pause mode external)\n")
        out.write("Ctrl-C to stop.\n")
        out.flush()
        stop.wait()
        return 0
    finally:
        sim.stop()
        sim_logger.removeHandler(handler)
        sim_logger.setLevel(old_level)
        sim_logger.propagate = old_propagate
        for signum, old in previous.items():
            signal.signal(signum, old)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m nicswitch_agent.sim``)."""
    parser = argparse.ArgumentParser(prog="nicswitch-agent sim", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
