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
import contextlib
import dataclasses
import errno
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TextIO

from nicswitch_agent.config import pem
from nicswitch_agent.sim import codes as P
from nicswitch_agent.sim.ranktable import RankTable
from nicswitch_agent.sim.server import ServerTls, Simulator
from nicswitch_agent.sim.settings import SimJob, SimSettings

__all__ = ["add_arguments", "main", "parse_nodes", "run", "server_tls", "settings_from"]

_DEFAULT_NODES = ("node-0:0,1", "node-1:0,1")
_SETTINGS = SimSettings()  # the real server's timings: every default shown below comes from here
_JOB = SimJob("job-1", {"node-0": ["0"]})
# --quick-recovery: the whole recovery tail after a failed switch (about 80 s upstream) in under a
# second; an explicit --fault-flush/--force-release/--schedule-wait/--restart-wait still wins.
_QUICK_RECOVERY = {"fault_flush_s": 0.05, "force_release_s": 0.1, "schedule_wait_s": 0.1, "restart_wait_s": 0.2}

_DESCRIPTION = """\
Serve a simulated MindCluster ClusterD (the Recover gRPC service on its real method paths, with its
codes, strings, state machine and timeouts) until Ctrl-C, to rehearse a link switch with
nicswitch-agent or TaskD before doing it for real.

Every default is the real server's. The timings can be shrunk so that failure paths take
milliseconds, and the job can be given the PodGroup settings ClusterD would read (framework,
process-recover-enable, recover-strategy). Where the real ClusterD crashes (a report without
status, a second reply blocked when the job resets), the simulator logs an ERROR saying so and
keeps serving; with --crash-like-clusterd it exits with status 2 instead, as ClusterD does.
docs/operations.md lists every setting and the differences from the real server."""

_EPILOG = """\
exit status: 0 stopped by Ctrl-C/SIGTERM; 1 cannot listen; 2 usage error (the port in use, a --host
this machine does not have, a --tls-* file that cannot serve TLS, among them: checked before listening),
or crashed as the real ClusterD would
(--crash-like-clusterd)

example:
  nicswitch-agent sim --port 8899 --job job-1 --nodes node-0:0,1 --nodes node-1:0,1 --standin"""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535; 0 picks a free one)")
    return port


# The longest duration a flag takes: the client's own limit (ops/durations.py, which the simulator
# does not import: it shares no code with the client), far past any of ClusterD's waits; a larger one
# (``1e20``) would crash a wait with an OverflowError.
MAX_SECONDS = 7 * 24 * 3600.0


def _seconds(positive: bool) -> Callable[[str], float]:
    """argparse type: a finite number of seconds up to :data:`MAX_SECONDS`, above 0 if ``positive``;
    the messages are ops/durations.py's."""
    kind = "positive" if positive else "non-negative"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds")
        if value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text!r} must be a {kind} number of seconds")
        if value > MAX_SECONDS:
            raise argparse.ArgumentTypeError(f"{text!r} is above the limit of {MAX_SECONDS:.0f} s "
                                             f"({MAX_SECONDS / 86400:g} days)")
        return value

    parse.__name__ = "seconds"  # argparse names the type in "invalid seconds value" messages
    return parse


def _strategies(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in P.STRATEGIES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(repr(n) for n in unknown)} (known: {', '.join(P.STRATEGIES)})"
        )
    return names


def _node(text: str) -> str:
    try:
        parse_nodes([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _superpod(text: str) -> tuple[str, int]:
    node, sep, number = text.rpartition(":")
    try:
        superpod = int(number)
    except ValueError:
        superpod = None
    if not sep or not node.strip() or superpod is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NODE:SUPERPOD_ID (an integer)")
    return node.strip(), superpod


def _workers(text: str) -> int:
    try:
        workers = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of threads") from None
    if workers < 8:
        raise argparse.ArgumentTypeError(f"{workers}: at least 8 (every open stream holds a thread)")
    return workers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nicswitch-agent sim`` (and ``python -m nicswitch_agent.sim``), with their help."""
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=_port, default=8899,
                        help="port, 0-65535 (default: %(default)s, ClusterD's; 0 picks a free one)")
    parser.add_argument("--standin", action="store_true",
                        help="also run a MindIO stand-in that answers pause/continue, for pause mode external "
                             "(default: off)")
    parser.add_argument("--standin-register-delay", type=_seconds(False), default=0.0, metavar="SECONDS",
                        help="the stand-in waits this long before registering, as TaskD does after a ClusterD "
                             "restart (default: %(default)s)")
    parser.add_argument("--crash-like-clusterd", action="store_true",
                        help="where the real ClusterD crashes, crash too: cut every stream, close the port, exit "
                             "with status 2 (default: off, log an ERROR and keep serving)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print every signal, list, reply and report (default: state changes only)")

    job = parser.add_argument_group("the job (what ClusterD reads from its PodGroup and caches)")
    job.add_argument("--job", default="job-1", metavar="JOB_ID", help="job id, MINDX_TASK_ID (default: %(default)s)")
    job.add_argument("--nodes", action="append", type=_node, metavar="NODE:DEV,DEV",
                     help="a node and its device ids, in pod-rank order; repeat per node "
                          f"(default: {' '.join(_DEFAULT_NODES)})")
    job.add_argument("--strategies", type=_strategies, default=_JOB.recover_strategies, metavar="NAMES",
                     help=f"the recover-strategy annotation, from {', '.join(P.STRATEGIES)}; exit is always "
                          f"allowed (default: {','.join(_JOB.recover_strategies)})")
    job.add_argument("--framework", choices=P.FRAMEWORKS, default=_JOB.framework,
                     help="the framework label; with mindspore a failed switch exits instead of dumping "
                          "(default: %(default)s)")
    job.add_argument("--process-recover-off", action="store_true",
                     help="process-recover-enable is off: Init answers 403 (default: on)")
    job.add_argument("--no-job-cache", action="store_true",
                     help="the job is missing from ClusterD's job cache: SwitchNicTrack answers 413 "
                          "'job:<id> not exist' (default: cached)")
    job.add_argument("--not-running", action="store_true",
                     help="the job is not running: SwitchNicTrack answers 413 (default: running)")
    job.add_argument("--superpod", action="append", type=_superpod, metavar="NODE:ID",
                     help="a node's SuperPoD id; negative makes SwitchNicTrack answer 413; repeat per node "
                          "(default: 0 for every node)")

    timing = parser.add_argument_group("timings (defaults: the real ClusterD's)")
    timing.add_argument("--report-timeout", type=_seconds(True), default=_SETTINGS.report_timeout_s,
                        metavar="SECONDS",
                        help="wait for each report, the switch reply and the O&M result (default: %(default)s)")
    timing.add_argument("--keepalive", type=_seconds(True), default=_SETTINGS.keepalive_interval_s,
                        metavar="SECONDS",
                        help="keep-alive signal period on the process-manage stream (default: %(default)s)")
    timing.add_argument("--enqueue-timeout", type=_seconds(True), default=_SETTINGS.enqueue_timeout_s,
                        metavar="SECONDS",
                        help="wait for a full one-slot queue before a 504 and a reset (default: %(default)s)")
    quick = ", ".join(f"{name[:-2].replace('_', '-')} {value}" for name, value in _QUICK_RECOVERY.items())
    for flag, name, what in (
        ("--fault-flush", "fault_flush_s", "after the stop report"),
        ("--force-release", "force_release_s", "before globalFault"),
        ("--schedule-wait", "schedule_wait_s", "for the rescheduled job, twice on the exit/dump path"),
        ("--restart-wait", "restart_wait_s", "for all processes to restart"),
    ):
        timing.add_argument(flag, type=_seconds(False), default=None, metavar="SECONDS",
                            help=f"recovery wait {what} (default: {getattr(_SETTINGS, name)}, or the "
                                 "--quick-recovery value)")
    timing.add_argument("--quick-recovery", action="store_true",
                        help=f"shrink the recovery waits after a failed switch (about 80 s) to under a second: "
                             f"{quick} (default: off)")
    timing.add_argument("--list-delay", type=_seconds(False), default=_SETTINGS.list_delay_s, metavar="SECONDS",
                        help="not ClusterD's: a pause between the pause report and the rank list "
                             "(default: %(default)s)")

    other = parser.add_argument_group("rank-list order and capacity")
    other.add_argument("--seed", type=int, default=_SETTINGS.seed,
                       help="seed for the random node order (default: none, a new order every time)")
    other.add_argument("--no-shuffle", action="store_true",
                       help="keep the request's node order (default: random, as Go map iteration)")
    other.add_argument("--max-workers", type=_workers, default=_SETTINGS.max_workers, metavar="N",
                       help="server threads, at least 8; every open stream and blocked call holds one "
                            "(default: %(default)s)")

    tls = parser.add_argument_group("TLS (the real ClusterD serves plaintext; its nginx proxy does TLS)")
    tls.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this server certificate (needs --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", help="the server certificate's unencrypted private key")
    tls.add_argument("--tls-client-ca", metavar="PEM",
                     help="require client certificates signed by this CA (mutual TLS; needs --tls-cert)")


def settings_from(args: argparse.Namespace) -> tuple[SimJob, SimSettings]:
    """The job and the settings the options describe; ValueError on an inconsistent combination."""
    nodes = parse_nodes(args.nodes or _DEFAULT_NODES)
    superpods = dict(args.superpod or ())
    job = SimJob(
        job_id=args.job,
        nodes=nodes,
        running=not args.not_running,
        superpod_ids=superpods or None,
        recover_strategies=tuple(args.strategies),
        framework=args.framework,
        process_recover_enable=not args.process_recover_off,
        in_job_cache=not args.no_job_cache,
    )
    recovery = {}
    for name in _QUICK_RECOVERY:
        given = getattr(args, name[:-2])
        if given is not None:
            recovery[name] = given
        elif args.quick_recovery:
            recovery[name] = _QUICK_RECOVERY[name]
    settings = dataclasses.replace(
        _SETTINGS,
        report_timeout_s=args.report_timeout,
        keepalive_interval_s=args.keepalive,
        enqueue_timeout_s=args.enqueue_timeout,
        list_delay_s=args.list_delay,
        shuffle_nodes=not args.no_shuffle,
        seed=args.seed,
        max_workers=args.max_workers,
        crash_like_clusterd=args.crash_like_clusterd,
        **recovery,
    )
    return job, settings


def _non_default(job: SimJob, settings: SimSettings) -> str:
    """``name=value`` for every job or timing setting that is not the real server's default."""
    changed = [
        f"{f.name}={getattr(settings, f.name)}"
        for f in dataclasses.fields(settings)
        if getattr(settings, f.name) != getattr(_SETTINGS, f.name)
    ]
    for name in ("running", "framework", "process_recover_enable", "in_job_cache", "superpod_ids"):
        if getattr(job, name) != getattr(_JOB, name):
            changed.append(f"{name}={getattr(job, name)}")
    return ", ".join(changed)


def server_tls(args: argparse.Namespace) -> ServerTls | None:
    """``--tls-cert/--tls-key/--tls-client-ca`` as :class:`ServerTls`; None: plaintext. ValueError on misuse."""
    cert, key, client_ca = (getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_client_ca"))
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    _check_server_tls_files(cert, key, client_ca)
    return ServerTls(cert_file=cert, key_file=key, client_ca_file=client_ca)


def _check_server_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """Every mistake in the files that gRPC would only report as a port it cannot bind (an outside
    check got "cannot listen on 127.0.0.1:0: Failed to bind" for a key of another certificate),
    named by flag and path, never by content. ValueError."""
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        problem = None if path is None else pem.unreadable(path)
        if problem is not None:
            raise ValueError(f"{flag} {path!r} cannot be read: {problem}")
    problem = pem.key_pair_problem(cert, key, server=True)
    if problem is not None:
        raise ValueError(f"--tls-cert {cert!r} and --tls-key {key!r} cannot be used together ({problem}): both "
                         "must be PEM, the key unencrypted and belonging to the certificate")
    problem = None if client_ca is None else pem.ca_problem(client_ca, server=True)
    if problem is not None:
        raise ValueError(f"--tls-client-ca {client_ca!r} holds no usable PEM certificate ({problem})")


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


def listen_problem(host: str, port: int) -> str | None:
    """Why the simulator cannot listen on ``host:port``, in one line naming both; None: it can.

    Asked before gRPC binds: when its bind fails, gRPC core writes its own error line to stderr
    (``add_port.cc ... Address already in use``) and raises only "Failed to bind" (older versions
    return port 0 instead). The test bind uses SO_REUSEADDR as gRPC's listener does, so a port in
    TIME_WAIT is not taken for busy; a host with several addresses is refused only when none binds
    (gRPC listens on those it can).
    """
    bare = host.strip("[]")
    where = f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {where}: unknown host ({exc.strerror or exc}); give --host an address of this machine"
    errors: list[OSError] = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and port != 0:
                    return (f"port {port} on {host} is in use (another ClusterD or simulator?): stop it, or pick "
                            "another with --port (0 picks a free one)")
                errors.append(exc)
            else:
                return None
    first = errors[0]
    why = first.strerror or str(first)
    if first.errno == errno.EADDRNOTAVAIL:
        why += f": {bare} is not an address of this machine; give --host one of its own (0.0.0.0: all of them)"
    elif first.errno == errno.EACCES:
        why += ": a port below 1024 needs privileges; pick another with --port"
    return f"cannot listen on {where}: {why}"


def run(args: argparse.Namespace, *, stop_event: threading.Event | None = None, out: TextIO | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or ``stop_event``, for embedding and tests). Returns 0; 2 on a
    usage error (a port in use, a host this machine cannot listen on, or a TLS file that cannot
    serve, too), and after a crash like the real ClusterD's (``--crash-like-clusterd``, which also
    sets ``stop_event``); 1 when it cannot listen otherwise (a port taken between the check and
    gRPC's bind).

    Prints the address, the rank table, the settings that differ from ClusterD's, then one line per
    state change (and an ERROR where the real ClusterD would crash).
    """
    out = out if out is not None else sys.stdout
    try:
        job, settings = settings_from(args)
        tls = server_tls(args)
    except ValueError as exc:
        print(f"nicswitch-agent sim: error: {exc}", file=sys.stderr)
        return 2
    problem = listen_problem(args.host, args.port)
    if problem is not None:  # a usage error: the --host or --port given cannot be used here
        print(f"nicswitch-agent sim: error: {problem}", file=sys.stderr)
        return 2

    stop = stop_event if stop_event is not None else threading.Event()
    previous: dict[signal.Signals, Any] = {}
    relay = _SignalRelay(stop) if threading.current_thread() is threading.main_thread() else None
    if relay is not None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, relay.on_signal)

    sim_logger = logging.getLogger("nicswitch_agent.sim")
    handler = _LineHandler(out)
    sim_logger.addHandler(handler)
    old_level, old_propagate = sim_logger.level, sim_logger.propagate
    sim_logger.propagate = False  # our handler prints each line; the root handler must not print it again
    wanted = logging.DEBUG if args.verbose else logging.INFO
    handler.setLevel(wanted)
    if sim_logger.getEffectiveLevel() > wanted:
        sim_logger.setLevel(wanted)
    sim = Simulator(jobs=[job], settings=settings, host=args.host, port=args.port, standin=args.standin, tls=tls,
                    standin_register_delay_s=args.standin_register_delay, on_crash=lambda reason: stop.set())
    try:
        try:
            address = sim.start()
        except (OSError, RuntimeError) as exc:
            print(f"nicswitch-agent sim: error: {exc}", file=sys.stderr)
            return 1
        out.write(f"ClusterD simulator listening on {address}{'' if tls is None else ' with ' + tls.describe()}\n")
        for server in RankTable(job.nodes).servers:
            pairs = " ".join(f"{d}->{r}" for d, r in zip(server.device_ids, server.rank_ids, strict=True))
            out.write(f"  job {job.job_id} node {server.server_name}: device->rank {pairs}\n")
        if args.standin:
            out.write("  MindIO stand-in subscribed (pause mode external)\n")
        changed = _non_default(job, settings)
        if changed:
            out.write(f"  not as the real ClusterD's defaults: {changed}\n")
        out.write("Ctrl-C to stop.\n")
        out.flush()
        stop.wait()
        crashed = sim.crashed
        if crashed is not None:
            sim.wait_crashed(10.0)
            print(f"nicswitch-agent sim: crashed as the real ClusterD would (exit status 2): {crashed}",
                  file=sys.stderr)
            return 2
        return 0
    finally:
        sim.stop()
        sim_logger.removeHandler(handler)
        sim_logger.setLevel(old_level)
        sim_logger.propagate = old_propagate
        for signum, old in previous.items():
            signal.signal(signum, old)
        if relay is not None:
            relay.close()


class _SignalRelay:
    """SIGINT/SIGTERM to ``stop``, without a lock in the handler.

    A handler runs on the main thread between any two bytecodes, so inside whatever lock that
    thread holds: ``stop.set()`` there deadlocked the simulator (a second SIGTERM landing in the
    first handler's ``set``, or one landing in ``stop.wait()``'s own hold of the Event's lock: 1 in
    12 bursts of six SIGTERMs hung it for good). The handler only writes a byte to a pipe; a
    thread of its own reads it and sets ``stop``."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe drops the byte: one is enough
        self._thread = threading.Thread(target=self._relay, name="sim-signals", daemon=True)
        self._thread.start()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            os.write(self._write, b"s")

    def _relay(self) -> None:
        if os.read(self._read, 64):  # a signal; empty: the pipe was closed, the simulator ends anyway
            self._stop.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._write)  # the reader sees the end of the pipe, if it still waits
        self._thread.join(5.0)
        with contextlib.suppress(OSError):
            os.close(self._read)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m nicswitch_agent.sim``): the same options and help."""
    parser = argparse.ArgumentParser(prog="python -m nicswitch_agent.sim")
    add_arguments(parser)
    return run(parser.parse_args(argv))
