"""``nicswitch-agent launch [options] -- <training command ...>``: the job's leader outside training.

Why a launcher: ClusterD wants exactly one client per job, and that client should not die with
the training processes. torchrun restarts its workers after a failure; a leader inside rank 0
would lose ClusterD's streams (and, in pause mode agent, reset ClusterD's job controller) at
every restart. The launcher wraps the training command (typically ``torchrun``) and, on the job's
**first node**, hosts the leader itself (ClusterD streams + a ``torch.distributed.TCPStore``
server the members coordinate through); every training rank, rank 0 included, is then a member
only. On the **other nodes** it hosts nothing and only exports where the leader's Store is.
Around msrun (a MindSpore job) the Store is MindSpore's TCPStore and msrun's options give the
world size, node rank and port (ops/launch_msrun.py); the rules below name torchrun's.

What the child gets (on top of the launcher's own environment, which passes through untouched,
``NICSWITCH_*`` and ``MINDX_*`` included)::

    NICSWITCH_LEADER=launcher              every in-process SwitchAgent becomes a member
    NICSWITCH_STORE_ADDRESS=<host>:<port>  the leader's Store (first node: 127.0.0.1 unless
                                           --store-host; other nodes: the first node's address),
                                           checked as the ranks' agent reads it (exit 2 if not)
    NICSWITCH_SERVER, NICSWITCH_JOB_ID     first node: as the leader resolved them (members must
                                           use the leader's job id: it names the Store keys);
                                           other nodes: only when given as flags
    NICSWITCH_WORLD_SIZE                   first node: the N the leader leads (an exported one it
                                           overrode must not reach the ranks); other nodes: only
                                           when --world-size is given
    NICSWITCH_PAUSE                        first node: the leader's effective mode; other nodes:
                                           only when --pause is given
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   every node, unless the launcher's environment sets it
                                           (to anything, "0" included: then it is passed as is)

Why the last one. By default torchrun shares its rendezvous TCPStore server with the workers
(torch 2.13.0, read in its source): the server is created once, in the torchrun agent, and every
restart of the workers (``--max-restarts``) reuses it with every key of the failed attempt still
in it (``DynamicRendezvousHandler.next_rendezvous``, ``_shared_tcp_store_server``). The default
process group's keys (``default_pg/0/...``) are the same in every attempt, so a restarted gloo
rank can read a dead rank's address before the new one is written, and ``init_process_group``
fails ("Gloo connectFullMesh failed ... Connection refused"; torchrun then uses up its restarts).
With torch 2.13.0, 2 ranks on CPU and a worker killed mid-training, the restart failed in 7 of 9
runs with the default and in 0 of 8 with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which makes
rank 0 of each attempt host a fresh store on a fresh port (``TORCHELASTIC_USE_AGENT_STORE=False``).
A training restart is what the launcher exists to survive, and the members of its leader
coordinate through the launcher's own Store, never torchrun's, so the opt-out costs the agent
nothing. Only torchrun reads it, and nodes that disagree on it still work (only the node of
global rank 0 decides who hosts the store; every other rank is a client either way).

Rules (each one is also in ``--help``):

- **Node role.** ``--leader-only`` hosts the leader here whatever the node rank. Otherwise the
  node rank comes from ``--node-rank``, else the wrapped torchrun's ``--node-rank`` (or
  ``PET_NODE_RANK``), else env ``GROUP_RANK``, else ``NODE_RANK``; unset means 0. Rank 0 hosts the
  leader, any other rank passes through. Exactly one launcher per job may host the leader (ClusterD
  has one queue per job: a second subscriber steals rank lists).
- **World size N** (how many members the leader waits for; lists naming ranks >= N are refused):
  ``--world-size``, else env ``NICSWITCH_WORLD_SIZE`` (which must agree with the wrapped command's
  count where it gives one: else exit 2), else, without ``--leader-only``, from the
  wrapped torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``) as torchrun
  computes it: ``--nproc-per-node`` (``auto``/``cpu``/``gpu`` resolved like torchrun) times
  ``--nnodes`` (a fixed count, or ``MIN:MAX`` with MIN == MAX). Anything else is an error (exit 2)
  that asks for ``--world-size``: an elastic node range or an unknown command has no fixed N.
- **Store port**: ``--store-port``; else 0 (a free port) for a single-node torchrun
  (``--standalone`` or ``--nnodes 1``); else ``MASTER_PORT`` + 1, else the torchrun command's
  ``--master-port`` + 1, else its ``--rdzv-endpoint`` port + 1; else 0 on the first node (fine
  when all ranks run on it) and an error on the others. A multi-node job needs a fixed port that
  the other nodes can reach.
- **Store host exported to the other nodes**: ``--store-host``, else ``MASTER_ADDR``, else the
  torchrun command's ``--master-addr``, else its ``--rdzv-endpoint`` host.

The child runs in its own process group. SIGINT, SIGTERM and SIGHUP sent to the launcher are
forwarded to that group (as a terminal would deliver Ctrl-C to its foreground job), exactly once
per signal; the launcher itself waits for the child and exits with its exit code (128 + N when
the child died of signal N; 127/126 when it could not be started). The leader never stops the
child: if the leader fails, it logs why and training goes on without switches. After the child
exits the leader stops cleanly (a false reply for any list still owed one, streams closed).
Usage and configuration errors are found before the child starts and exit with 2 (any other
failure to start the leader: 1), so a job never trains with switches that cannot work.

Joining. A rank that starts after a pause was published never sees it (it begins with the next
event), so a pause asked for before every rank has joined could not be answered. The leader is
therefore built (settings checked) before the child starts, but makes itself known to ClusterD
(Init, Register, the streams) only once every one of the N ranks has joined: each member writes
``joined/<rank>`` (coordination/messages.py: ``joined_key``) on the leader's Store when it starts.
Until then, in pause mode agent, ClusterD answers a switch at once with ``job:<id> is not
registered`` (nothing is paused, nothing is owed); in pause mode external, a list ClusterD
queued waits for the notify stream and is run once every rank is there. If some rank has not
joined after ``--join-timeout`` seconds (env ``NICSWITCH_JOIN_TIMEOUT_S``, default 600), the
leader starts anyway and says which ranks are missing; a pause those ranks miss then fails within
``pause_timeout_s`` (ClusterD hears it). A torchrun restart does not close the gate again: the
leader keeps its registration (see above).

Limits: SIGKILL on the launcher cannot be forwarded (the child then runs on without a leader);
the child is not the terminal's foreground group, so it cannot read from the terminal (pdb).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from nicswitch_agent.ops.durations import MAX_DURATION_S, MAX_DURATION_TEXT, seconds
from nicswitch_agent.ops.hosted_leader import HostedLeader, LaunchError
from nicswitch_agent.ops.launch_msrun import MsrunOptions, launch_framework, parse_msrun
from nicswitch_agent.ops.launch_torchrun import TorchrunOptions, non_negative_int, parse_torchrun

logger = logging.getLogger("nicswitch_agent.launcher")

EXIT_USAGE = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOOPBACK = "127.0.0.1"
FRESH_RDZV_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # see the module docstring


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What this launcher does, decided before anything starts (pure: no process, no socket)."""

    command: list[str]
    hosts_leader: bool
    node_rank: int
    why: str  # one line for the log: why this node leads or passes through
    world_size: int | None  # first node only
    local_world_size: int | None  # ranks per node (torchrun's nproc-per-node), None if unknown
    store_port: int  # 0: a free port (first node only)
    store_host: str  # the Store host exported to the child
    store_host_source: str = "--store-host"  # where store_host came from, named when it is unusable
    env: dict[str, str] = field(default_factory=dict)  # exported on top of the launcher's environment
    join_timeout_s: float | None = None  # --join-timeout (None: the agent's join_timeout_s)
    framework: str = "torch"  # whose Store the leader hosts: torch's, or MindSpore's (ops/launch_msrun.py)


def make_plan(args: argparse.Namespace, environ: Mapping[str, str]) -> Plan:
    """Decide the node role, N, the Store port and host, and the child's env (see the module docstring).

    Raises:
        LaunchError: no command, or something needed cannot be derived.
    """
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no training command: nicswitch-agent launch [options] -- <command ...>")
    leader_only = bool(args.leader_only)
    framework = launch_framework(command, environ)
    msrun = None if leader_only else parse_msrun(command)
    torchrun = None if leader_only or msrun is not None else parse_torchrun(command, environ)

    if args.node_rank is not None:
        node_rank, source = non_negative_int("--node-rank", args.node_rank), "--node-rank"
    elif torchrun is not None and torchrun.node_rank is not None:
        node_rank, source = torchrun.node_rank, "the torchrun --node-rank"
    elif msrun is not None and msrun.node_rank is not None:
        node_rank, source = msrun.node_rank, "the msrun --node_rank"
    else:
        node_rank, source = 0, "no node rank set"
        for name in ("GROUP_RANK", "NODE_RANK"):
            if environ.get(name, "").strip():
                node_rank, source = non_negative_int(name, environ[name]), name
                break
    hosts_leader = leader_only or node_rank == 0
    why = "--leader-only" if leader_only else f"node rank {node_rank} ({source})"

    env: dict[str, str] = {"NICSWITCH_LEADER": "launcher"}
    if framework == "mindspore" and "NICSWITCH_FRAMEWORK" not in environ:  # the ranks dial a MindSpore Store
        env["NICSWITCH_FRAMEWORK"] = "mindspore"
    if FRESH_RDZV_STORE not in environ and msrun is None:  # the user's choice, if any, wins; torchrun's only
        env[FRESH_RDZV_STORE] = "1"
    for flag, name in (("server", "NICSWITCH_SERVER"), ("job_id", "NICSWITCH_JOB_ID"), ("pause", "NICSWITCH_PAUSE")):
        value = getattr(args, flag, None)
        if value is not None and flag == "server":
            from nicswitch_agent.config import parse_server
            from nicswitch_agent.errors import ConfigError

            try:  # in the agent's one grammar, named as the user typed it
                value = parse_server(str(value), "--server")
            except ConfigError as exc:
                raise LaunchError(str(exc)) from None
        if value is not None:
            env[name] = str(value)

    port = _store_port(args, environ, torchrun, hosts_leader, msrun)
    world_size: int | None = None
    host_source = "--store-host"
    if hosts_leader:
        world_size = _world_size(args, environ, torchrun, leader_only, msrun)
        # The ranks check the N the leader leads against torch's, not an NICSWITCH_WORLD_SIZE it overrode.
        env["NICSWITCH_WORLD_SIZE"] = str(world_size)
        host = args.store_host or LOOPBACK  # our own children: loopback always reaches the server
    elif msrun is not None:
        host, host_source = (args.store_host, "--store-host") if args.store_host else (msrun.master_addr,
                                                                                       "msrun --master_addr")
    else:
        host, host_source = _store_host(args, environ, torchrun)
    if not hosts_leader:  # the first node exports it once its Store listens (the port may be picked then)
        env["NICSWITCH_STORE_ADDRESS"] = store_address(host, port, host_source)
        if args.world_size is not None:  # as --server and --job: the flag only, the first node checks N
            env["NICSWITCH_WORLD_SIZE"] = str(non_negative_int("--world-size", args.world_size))
    # The leader and every rank must agree on node-local fan-out (docs/configuration.md, fan_out):
    # the ranks per node the leader is told are the ones the training ranks are told.
    per_node = torchrun.local_world_size() if torchrun is not None else msrun.local_worker_num if msrun else None
    chosen = environ.get("NICSWITCH_LOCAL_WORLD_SIZE")
    if chosen is not None:  # the user's (a rehearsal of fan-out on one machine): the leader's and every rank's
        if not chosen.strip().isdigit() or int(chosen) < 1:
            raise LaunchError(f"NICSWITCH_LOCAL_WORLD_SIZE={chosen!r} is not a number of ranks (1 or more)")
        per_node = int(chosen)
    if per_node is not None:
        env["NICSWITCH_LOCAL_WORLD_SIZE"] = str(per_node)
    elif "NICSWITCH_FAN_OUT" not in environ:
        env["NICSWITCH_FAN_OUT"] = "flat"  # the leader cannot tell the nodes apart: nor may the ranks
    return Plan(command=command, hosts_leader=hosts_leader, node_rank=node_rank, why=why, world_size=world_size,
                local_world_size=per_node, store_port=port, store_host=host, store_host_source=host_source, env=env,
                join_timeout_s=_join_timeout(args), framework=framework)


def _join_timeout(args: argparse.Namespace) -> float | None:
    value = getattr(args, "join_timeout", None)
    if value is not None and not 0 < value <= MAX_DURATION_S:  # the parser's check, for arguments built by hand
        raise LaunchError(f"--join-timeout={value!r} must be a positive number of seconds, at most {MAX_DURATION_TEXT}")
    return None if value is None else float(value)


def _world_size(args: argparse.Namespace, environ: Mapping[str, str], torchrun: TorchrunOptions | None,
                leader_only: bool, msrun: MsrunOptions | None = None) -> int:
    if args.world_size is not None:
        value = non_negative_int("--world-size", args.world_size)
    elif environ.get("NICSWITCH_WORLD_SIZE", "").strip():
        value = non_negative_int("NICSWITCH_WORLD_SIZE", environ["NICSWITCH_WORLD_SIZE"])
        counted = _command_world_size(torchrun, msrun)
        if counted is not None and counted != value:  # every rank would refuse it against torch's, once started
            raise LaunchError(f"NICSWITCH_WORLD_SIZE={value} disagrees with the {counted} rank(s) the command "
                              "starts; unset it (the leader leads what the command starts), or pass "
                              "--world-size N to lead another number on purpose")
    elif torchrun is not None:
        value = torchrun.world_size()
    elif msrun is not None:
        value = msrun.worker_num
    elif leader_only:
        raise LaunchError("--leader-only does not read the wrapped command: pass --world-size N "
                          "(the number of training ranks the leader waits for)")
    else:
        raise LaunchError("cannot tell how many training ranks the leader leads: the command is not torchrun "
                          "(torchrun ... or python -m torch.distributed.run ...) nor msrun; pass --world-size N")
    if value < 1:
        raise LaunchError(f"the world size must be at least 1, got {value}")
    return value


def _ranks_settings_refused(child_env: Mapping[str, str]) -> str:
    """On a node that only passes through: the ranks' NICSWITCH_* settings as their agents will check
    them ("" if fine), so that a bad one stops the launch here, before training, as on the first node.
    Only NICSWITCH_*: the pod's own RANK or WORLD_SIZE are torchrun's to replace per worker."""
    from nicswitch_agent.config import AgentConfig
    from nicswitch_agent.errors import ConfigError

    ours = {k: v for k, v in child_env.items() if k.startswith("NICSWITCH_")}
    stand_ins = {"server": None if ours.get("NICSWITCH_SERVER", "").strip() else "127.0.0.1:1",  # its own check
                 "job_id": None if ours.get("NICSWITCH_JOB_ID", "").strip() else "job"}
    try:
        AgentConfig.from_env(ours, **stand_ins)
    except ConfigError as exc:
        return f"the training ranks' settings: {exc}"
    return ""


def _command_world_size(torchrun: TorchrunOptions | None, msrun: MsrunOptions | None) -> int | None:
    """The ranks the wrapped command starts, where it says (None: elastic, or not torchrun nor msrun)."""
    if torchrun is not None:
        try:
            return torchrun.world_size()
        except LaunchError:
            return None
    return msrun.worker_num if msrun is not None else None


def _store_port(args: argparse.Namespace, environ: Mapping[str, str], torchrun: TorchrunOptions | None,
                hosts_leader: bool, msrun: MsrunOptions | None = None) -> int:
    if args.store_port is not None:
        port = non_negative_int("--store-port", args.store_port)
        if port > 65535 or (port == 0 and not hosts_leader):
            raise LaunchError(f"--store-port={port} must be a port number between 1 and 65535")
        return port
    if hosts_leader and ((torchrun is not None and torchrun.single_node()) or (msrun and msrun.single_node)):
        return 0  # only this node's children need it
    candidates: list[tuple[str, int | None]] = []
    if environ.get("MASTER_PORT", "").strip():
        candidates.append(("MASTER_PORT", non_negative_int("MASTER_PORT", environ["MASTER_PORT"])))
    if torchrun is not None:
        candidates += [("torchrun --master-port", torchrun.master_port),
                       ("torchrun --rdzv-endpoint", torchrun.rdzv_host_port()[1])]
    if msrun is not None:  # msrun's scheduler listens on --master_port (8118 unless given)
        candidates.append(("msrun --master_port", msrun.master_port))
    for name, base in candidates:
        if base is not None:
            if not 0 < base < 65535:
                raise LaunchError(f"{name}={base} leaves no room for the Store on the next port; pass --store-port")
            return base + 1
    if hosts_leader:
        if torchrun is not None and torchrun.node_range()[1] > 1:
            raise LaunchError(f"this job may span {torchrun.node_range()[1]} nodes: the other nodes need a fixed "
                              "Store port; pass --store-port P (or set MASTER_PORT: the Store then uses "
                              "MASTER_PORT + 1)")
        return 0
    raise LaunchError("this node passes through to the leader on the first node, but nothing says on which "
                      "port its Store listens: pass --store-port P (as on the first node), or set MASTER_PORT")


def _store_host(args: argparse.Namespace, environ: Mapping[str, str],
                torchrun: TorchrunOptions | None) -> tuple[str, str]:
    """The first node's address as this node reaches it, and where it came from."""
    if args.store_host:
        return str(args.store_host), "--store-host"
    if environ.get("MASTER_ADDR", "").strip():
        return environ["MASTER_ADDR"].strip(), "MASTER_ADDR"
    if torchrun is not None:
        if torchrun.master_addr:
            return torchrun.master_addr, "torchrun --master-addr"
        host = torchrun.rdzv_host_port()[0]
        if host:
            return host, "torchrun --rdzv-endpoint"
    raise LaunchError("this node passes through to the leader on the first node, but nothing says where that "
                      "is: pass --store-host HOST (or set MASTER_ADDR)")


def store_address(host: str, port: int, source: str) -> str:
    """``NICSWITCH_STORE_ADDRESS`` for the training ranks, checked by the parser their agent reads it
    with: a host they cannot use stops the launch (exit 2), not every rank once training started.

    Raises:
        LaunchError: the agent's own message, and where the host came from (``source``).
    """
    from nicswitch_agent.config import parse_server
    from nicswitch_agent.errors import ConfigError

    address = f"[{host}]:{port}" if _is_ipv6(host) else f"{host}:{port}"
    try:
        return parse_server(address, "NICSWITCH_STORE_ADDRESS", default_port=None)
    except ConfigError as exc:
        raise LaunchError(f"{exc} (the training ranks' Store address, its host from {source}={host!r})") from None


def _is_ipv6(host: str) -> bool:
    """A bare IPv6 address (``fd00::1``), which the address needs in brackets; anything else is left
    as given (``http://x`` stays itself, and the parser names its problem)."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


# -- the child --------------------------------------------------------------------------------


class SignalForwarder:
    """Forwards SIGINT/SIGTERM/SIGHUP to the child's process group, once each, from the moment it exists."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}
        self.forwarded: list[int] = []

    def __enter__(self) -> SignalForwarder:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: signals sent to the launcher are not forwarded")
            return self
        for sig in FORWARDED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def attach(self, child: subprocess.Popen[bytes]) -> None:
        self._child = child
        pending, self._pending = self._pending, []
        for sig in pending:
            self._forward(sig)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._child is None:
            self._pending.append(signum)  # arrived before the child: delivered right after it starts
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        child = self._child
        assert child is not None
        if child.returncode is not None:
            return  # already reaped: its process group id may belong to someone else by now
        self.forwarded.append(signum)
        logger.info("forwarding %s to the training command (process group %d)", signal.Signals(signum).name,
                    child.pid)
        with contextlib.suppress(ProcessLookupError):  # it already exited; wait() collects it
            os.killpg(child.pid, signum)


def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the child in its own process group, so only the launcher decides what reaches it."""
    if sys.version_info >= (3, 11):
        return subprocess.Popen(command, env=env, process_group=0)
    return subprocess.Popen(command, env=env, start_new_session=True)  # 3.10: no process_group


def _wait(child: subprocess.Popen[bytes]) -> int:
    """Wait for the child without ever blocking the main thread in one long system call.

    The kernel may deliver a signal to any thread of this process (gRPC's, the Store's, the
    agent's). Python then only flags it, and its handler runs when the main thread next executes
    bytecode: a main thread parked in a plain ``waitpid`` would forward nothing until the child
    exits by itself. ``wait(timeout)`` polls in steps of at most 50 ms, so a forwarded signal is
    at most that late. (Seen in tests: SIGTERM to the launcher not forwarded for over a minute.)
    """
    while True:
        try:
            return child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            continue


def exit_code(returncode: int) -> int:
    """A shell's view of the child's status: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


# -- the command ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``launch`` subcommand's options (the lead's cli.py calls this)."""
    from nicswitch_agent.ops.om_cli import JOB_HELP, SERVER_HELP  # the same words as switch's and doctor's

    parser.description = (
        "Run a training command (typically torchrun). On the job's first node, host the job's leader "
        "(the only ClusterD client, and the Store its members coordinate through) in this process, so it "
        "survives training restarts; on other nodes only export where that Store is. Signals are forwarded "
        "to the command; the exit code is the command's."
    )
    parser.epilog = (
        "The child gets NICSWITCH_LEADER=launcher and NICSWITCH_STORE_ADDRESS=host:port (plus, on the first "
        "node, NICSWITCH_SERVER/JOB_ID/PAUSE/WORLD_SIZE as the leader resolved them), and "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless it is set (torchrun's shared rendezvous store keeps a "
        "failed attempt's keys, and a restarted gloo group can read them and fail). Other settings: NICSWITCH_* "
        "and MindCluster env, passed through. Example: nicswitch-agent launch -- torchrun --nproc-per-node 8 "
        "--nnodes 2 --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500 train.py"
    )
    parser.add_argument("--leader-only", action="store_true",
                        help="host the job's leader on this node whatever its node rank, and run the command "
                             "without reading it (so --world-size is needed). Use on exactly one launcher of "
                             "the job; the others must pass through (a non-zero --node-rank)")
    parser.add_argument("--node-rank", type=int, metavar="R",
                        help="this node's rank: 0 hosts the leader, others pass through (default: the torchrun "
                             "command's --node-rank, else env GROUP_RANK, else NODE_RANK, else 0)")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="training ranks the leader leads, exported to them as NICSWITCH_WORLD_SIZE (default: "
                             "env NICSWITCH_WORLD_SIZE if it agrees with the command's count, else torchrun's "
                             "--nproc-per-node x --nnodes; an elastic "
                             "--nnodes MIN:MAX needs this flag)")
    parser.add_argument("--store-port", type=int, metavar="P",
                        help="port of the leader's Store (default: a free port for a single-node torchrun, else "
                             "MASTER_PORT+1, else torchrun's --master-port+1 or --rdzv-endpoint port+1, else a free "
                             "port; a multi-node job needs a fixed port reachable from the other nodes)")
    parser.add_argument("--store-host", metavar="HOST",
                        help="the first node's address as the other nodes reach it (default: MASTER_ADDR, else "
                             "torchrun's --master-addr or --rdzv-endpoint host); the first node exports "
                             "127.0.0.1 to its own children unless this is given")
    parser.add_argument("--server", metavar="HOST:PORT", help=SERVER_HELP)
    parser.add_argument("--job", dest="job_id", metavar="JOB_ID", help=JOB_HELP)
    # --job as in every other command; --job-id, its first name, still works for existing scripts.
    parser.add_argument("--job-id", dest="job_id", help=argparse.SUPPRESS)
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="log only warnings and errors (default: INFO, the leader's state changes: "
                             "'registered job', 'switch #N ... received', 'replied true', ...)")
    parser.add_argument("--join-timeout", type=seconds(), metavar="S",
                        help="first node: seconds to wait for every rank to join before the leader registers "
                             "with ClusterD anyway (default: env NICSWITCH_JOIN_TIMEOUT_S, else 600); until "
                             "then ClusterD refuses a switch ('job ... is not registered') instead of pausing "
                             "ranks that cannot answer yet")
    parser.add_argument("--pause", choices=("auto", "agent", "external"), type=str.lower,
                        help="pause mode of the leader (default: NICSWITCH_PAUSE, else auto)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the training command and its arguments")


def run(args: argparse.Namespace) -> int:
    """Run the launcher; returns the exit code (the child's, or 2 for a usage error)."""
    if logger.level == logging.NOTSET and not getattr(args, "quiet", False):
        logger.setLevel(logging.INFO)  # the role line and the child's fate are worth a line each
    environ = dict(os.environ)  # the child's base env: snapshot before anything here touches os.environ
    # Before torch is imported (reading torchrun's options imports it): no C++ Store warnings here, and
    # none of their reverse-DNS stalls (docs/torch-store.md#waits-timeouts-and-the-reverse-dns-stall). The child keeps
    # the user's setting.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        plan = make_plan(args, environ)
    except LaunchError as exc:
        print(f"nicswitch-agent launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    leader: HostedLeader | None = None
    env = dict(plan.env)
    if plan.hosts_leader:
        from nicswitch_agent.errors import ConfigError

        try:
            assert plan.world_size is not None
            leader = HostedLeader.start(args, world_size=plan.world_size, local_world_size=plan.local_world_size,
                                        store_port=plan.store_port, join_timeout_s=plan.join_timeout_s,
                                        framework=plan.framework)
            address = store_address(plan.store_host, leader.port, plan.store_host_source)  # the port is known now
        except (LaunchError, ConfigError) as exc:
            if leader is not None:
                leader.stop("the launch was refused")
            print(f"nicswitch-agent launch: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except Exception:  # before the child: better no training than a job whose switches cannot work
            logger.exception("the leader could not start; the training command was not run")
            return 1
        cfg = leader.agent.config
        env.update({"NICSWITCH_STORE_ADDRESS": address,
                    "NICSWITCH_SERVER": cfg.server, "NICSWITCH_JOB_ID": cfg.job_id,
                    "NICSWITCH_PAUSE": leader.agent.pause_mode})
        logger.info("hosting the job's leader (%s): %d rank(s), job %s, ClusterD %s, pause %s, %s Store on port %d",
                    plan.why, plan.world_size, cfg.job_id, cfg.server, leader.agent.pause_mode,
                    "a MindSpore" if plan.framework == "mindspore" else "a torch", leader.port)
    else:
        refused = _ranks_settings_refused({**environ, **env})
        if refused:
            print(f"nicswitch-agent launch: error: {refused}", file=sys.stderr)
            return EXIT_USAGE
        logger.info("passing through (%s): the leader's Store is %s", plan.why, env["NICSWITCH_STORE_ADDRESS"])
    if FRESH_RDZV_STORE in env:
        logger.info("%s=1 for the training command: every torchrun restart gets a fresh store (set it in the "
                    "environment to choose otherwise)", FRESH_RDZV_STORE)
    child_env = {**environ, **env}
    code = EXIT_NOT_FOUND
    try:
        with SignalForwarder() as forwarder:
            try:
                child = _popen(plan.command, child_env)
            except OSError as exc:
                code = EXIT_NOT_EXECUTABLE if isinstance(exc, PermissionError) else EXIT_NOT_FOUND
                print(f"nicswitch-agent launch: cannot run {plan.command[0]!r}: {exc}", file=sys.stderr)
                return code
            forwarder.attach(child)
            logger.info("started the training command: pid %d, own process group", child.pid)
            if leader is not None:
                leader.start_when_joined()
            code = exit_code(_wait(child))
        logger.info("the training command exited with %d", code)
        return code
    finally:
        if leader is not None:
            leader.stop(f"the training command exited with {code}")
            logger.info("leader stopped")


def configure_logging(*, verbose: bool = False, quiet: bool = False) -> None:
    """The launcher's logging: the agent's INFO lines by default, DEBUG with -v, warnings only with -q.

    The leader runs in this process, and its INFO lines ("registered job ...", "switch #N ...
    received", "switch #N: replied true ...") are what docs/operations.md tells operators to look
    for. Other libraries (grpc, torch) stay at WARNING unless -v.
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("nicswitch_agent").setLevel(logging.WARNING if quiet else logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nicswitch_agent.ops.launcher [options] -- <command ...>`` (same as ``nicswitch-agent launch``)."""
    parser = argparse.ArgumentParser(prog="nicswitch-agent launch")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(verbose=args.verbose, quiet=args.quiet)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
