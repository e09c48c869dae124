"""Where a rank stands in the job and which Store the ranks coordinate through.

The rank and world size come from the config, else from an initialised ``torch.distributed``,
else a single rank. The Store is the one the user passed, the launcher's (``store_address``), an
in-process one for a single rank, or ``torch.distributed``'s default Store (torch imported lazily:
a member-only process that never needs it never loads it). A TCPStore is reached through
:class:`~nicswitch_agent.coordination.fd_budget.StoreClient`: its connections are made within
``store_connect_timeout_s`` and a refused one says why (most often: the Store's host is out of
file descriptors).

With node-local fan-out (relay.py) local rank 0 of each node hosts the node-local Store (the
node link, node_link.py; with ``node_transport`` ``store`` a TCPStore; an in-process one when the
job's Store is in process: ranks as threads) and publishes its address on the job's Store; the
node's other ranks wait for it at start. With groups of nodes (:class:`Layout`, fan_out.py) the
local rank 0 of each group's first node also hosts the group's Store, on all interfaces, for the
group's node relays.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nicswitch_agent.config import AUTO_GROUP_NODES, AgentConfig, job_framework
from nicswitch_agent.config.frameworks import in_msrun, rank_names, world_names
from nicswitch_agent.coordination import fd_budget, ms_store, node_link
from nicswitch_agent.coordination.kv import KV, InProcessStore
from nicswitch_agent.coordination.messages import group_store_key, key_prefix, node_store_key
from nicswitch_agent.coordination.queues import queue_name
from nicswitch_agent.errors import ConfigError

logger = logging.getLogger("nicswitch_agent.coordination")


def rank_and_world(cfg: AgentConfig, *, leader_only: bool) -> tuple[int, int]:
    """(rank, world size): configured, else torch.distributed's, else MindSpore's (after its
    ``init()``), else a single rank."""
    rank, world = cfg.rank, cfg.world_size
    if leader_only:
        if world is None:
            raise ConfigError("leader_only=True needs world_size: the number of training ranks it leads")
        return 0, world
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        # A configured value that torch.distributed contradicts is refused here: a world_size too
        # large makes every pause wait for ranks that do not exist, then ClusterD kill the job.
        for name, configured, actual in (("world_size", world, dist.get_world_size()), ("rank", rank, dist.get_rank())):
            if configured is not None and configured != actual:
                raise ConfigError(f"{_read_from(name, configured)}{name}={configured} disagrees with "
                                  f"torch.distributed's {name} {actual}: a switch would wait for ranks that do not "
                                  f"exist or leave ranks out; leave {name} unset to take torch.distributed's",
                                  settings=(name,))
        rank, world = dist.get_rank(), dist.get_world_size()
    if rank is None:
        rank = _mindspore_rank()
    world = world or 1
    if rank is None and world > 1 and in_msrun(os.environ, cfg.framework):
        # msrun on several nodes without --node_rank exports RANK_ID only from init() on: every
        # process taking rank 0 would make every node's first rank a leader.
        raise ConfigError(
            f"this process's rank is unknown (world_size={world} from msrun, RANK_ID not set): msrun exports "
            "RANK_ID only when it assigns ranks (one node, or --node_rank given). Create the agent after "
            "mindspore.communication.init(), pass rank=, or set NICSWITCH_RANK", settings=("rank",))
    rank = rank or 0
    if rank >= world:
        raise ConfigError(f"rank={rank} is outside world_size={world}")
    return rank, world


def _read_from(name: str, value: int) -> str:
    """``"NICSWITCH_WORLD_SIZE='3': "`` where this process's environment holds the value given (the
    configuration does not keep where a value came from), as configuration errors lead."""
    for variable in (world_names if name == "world_size" else rank_names)(os.environ):
        raw = os.environ.get(variable, "").strip()
        if raw == str(value):
            return f"{variable}={raw!r}: "
    return ""


def _mindspore_rank() -> int | None:
    """MindSpore's global rank once ``mindspore.communication.init()`` ran in this process; else None."""
    management = sys.modules.get("mindspore.communication.management")
    comm = getattr(management, "GlobalComm", None)
    if management is None or not getattr(comm, "INITED", False):
        return None
    try:
        return int(management.get_rank())
    except Exception:  # initialised for another backend, or torn down: not ours to decide
        return None


def coordination_kv(cfg: AgentConfig, world_size: int, *, store: Any | None, leader_only: bool) -> KV:
    """The key-value view the leader and the members share, under this job's key prefix."""
    # A launcher-hosted leader outlives training restarts, so its keys must not change with them.
    prefix = key_prefix(cfg.job_id, "launcher" if (cfg.leader == "launcher" or leader_only) else None)
    if cfg.leader == "launcher" and cfg.store_address is not None and not leader_only:
        store = None  # under `nicswitch-agent launch` every rank meets the leader on its Store, not the job's
    if store is not None and ms_store.is_mindspore_store(store):  # our own client of the job's MindSpore Store
        return KV(ms_store.MindSporeStore.of(store, cfg.store_connect_timeout_s, cfg.mindspore_poll_s), prefix)
    if store is not None:
        return KV(store, prefix)
    mindspore = job_framework(cfg.framework) == "mindspore"
    if cfg.store_address is not None and mindspore:
        host, _, port = cfg.store_address.rpartition(":")
        return KV(ms_store.MindSporeStore(host.strip("[]"), int(port), cfg.store_connect_timeout_s,
                                     poll_max_s=cfg.mindspore_poll_s), prefix)
    if cfg.store_address is not None:
        return KV(connect_tcp_store(cfg.store_address, cfg.store_connect_timeout_s, world_size), prefix)
    if world_size == 1:
        return KV(InProcessStore(), prefix)
    if mindspore:
        raise ConfigError(f"world_size={world_size} with framework mindspore needs MindSpore's TCPStore to coordinate "
                          "ranks: pass store=mindspore.mint.distributed.TCPStore(...) (the same host and port on "
                          "every rank), or store_address (NICSWITCH_STORE_ADDRESS)")
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        raise ConfigError(
            f"world_size={world_size} needs a Store to coordinate ranks: call "
            "torch.distributed.init_process_group() before start(), or pass store=..."
        )
    from torch.distributed import distributed_c10d

    default_store: Any = distributed_c10d._get_default_store()  # clone() exists on every Store since torch 2.4
    # Our clients of its TCPStore, not its clone(): a clone would retry a refused connection for the
    # process group's timeout (30 min by default).
    client = fd_budget.client_of(default_store, cfg.store_connect_timeout_s, world_size)
    return KV(default_store if client is None else client, prefix)


def connect_tcp_store(address: str, timeout_s: float, world_size: int) -> Any:
    """A client of the TCPStore at ``host:port`` (hosted by the launcher); it connects on first use."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"store_address={address!r} needs torch (python3 -m pip install '.[torch]' in the "
                          "nicswitch-agent checkout)") from exc
    host, _, port = address.rpartition(":")
    return fd_budget.StoreClient(host.strip("[]"), int(port), timeout_s, world_size)


@dataclass(frozen=True)
class Layout:
    """Who answers the leader on the job's Store: ranks (flat), nodes, or groups of nodes.

    Nodes are ``rank // ranks_per_node``; groups are ``node // nodes_per_group`` (the last group
    may have fewer nodes). Every rank and the leader compute the same layout from the same settings.
    """

    world_size: int
    ranks_per_node: int | None = None  # None: flat
    nodes_per_group: int | None = None  # None: nodes answer the leader themselves

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node if self.ranks_per_node else self.world_size

    @property
    def groups(self) -> int:
        return -(-self.nodes // self.nodes_per_group) if self.nodes_per_group else self.nodes

    @property
    def answerers(self) -> int:
        """How many answer each phase on the job's Store (the leader's ``world_size``)."""
        if self.ranks_per_node is None:
            return self.world_size
        return self.groups

    @property
    def unit(self) -> str:
        return "group" if self.nodes_per_group else "node" if self.ranks_per_node else "rank"

    def ranks_of(self, index: int) -> range:
        """The global ranks behind answerer ``index`` on the job's Store."""
        per = (self.ranks_per_node or 1) * (self.nodes_per_group or 1)
        return range(index * per, min((index + 1) * per, self.world_size))

    def answerer_of(self, rank: int) -> int:
        """The answerer (rank, node or group) that speaks for global ``rank`` on the job's Store."""
        return rank // ((self.ranks_per_node or 1) * (self.nodes_per_group or 1))

    def nodes_of(self, group: int) -> range:
        per = self.nodes_per_group or 1
        return range(group * per, min((group + 1) * per, self.nodes))


def choose_layout(cfg: AgentConfig, world_size: int) -> Layout:
    """The fan-out every rank and the leader use (torchrun gives every rank the same
    LOCAL_WORLD_SIZE; the launcher exports its choice to the training command)."""
    per_node = choose_ranks_per_node(cfg, world_size)
    if per_node is None:
        return Layout(world_size)
    nodes = world_size // per_node
    wanted = cfg.fan_out == "group" or (cfg.fan_out == "auto" and nodes > AUTO_GROUP_NODES)
    if not wanted or nodes < 2:
        return Layout(world_size, per_node)
    per_group = cfg.nodes_per_group or max(2, math.ceil(math.sqrt(nodes)))
    if per_group >= nodes:  # one group: it would only add a hop
        return Layout(world_size, per_node)
    return Layout(world_size, per_node, per_group)


def choose_ranks_per_node(cfg: AgentConfig, world_size: int) -> int | None:
    """Ranks per node for node-local fan-out, or None for flat."""
    per_node = cfg.local_world_size
    if cfg.fan_out == "flat" or world_size == 1:
        return None
    if per_node is None or world_size % per_node:
        if cfg.fan_out in ("node", "group"):
            raise ConfigError(f"fan_out={cfg.fan_out!r} needs local_world_size (LOCAL_WORLD_SIZE) dividing "
                              f"world_size={world_size}; got local_world_size={per_node!r}")
        if per_node is not None:  # a choice that cannot be followed: say so (every node has as many ranks)
            logger.warning("local_world_size=%d does not divide world_size=%d: every rank coordinates on the job's "
                           "Store (no node-local fan-out; fan_out=node makes this an error)", per_node, world_size)
        return None
    if cfg.fan_out == "auto" and (per_node == 1 or per_node == world_size):
        return None  # one rank per node, or one node: a relay would only add a hop
    return per_node


# The node (and group) Stores of jobs whose Store is in process, by that Store: weakly, so a new
# job's Store that happens to get a dead one's id() never finds the dead job's keys.
_in_process_node_stores: weakref.WeakKeyDictionary[InProcessStore, dict[tuple[str, int], InProcessStore]] = \
    weakref.WeakKeyDictionary()
_in_process_lock = threading.Lock()


def _in_process_store(job: InProcessStore, prefix: str, index: int) -> InProcessStore:
    with _in_process_lock:
        return _in_process_node_stores.setdefault(job, {}).setdefault((prefix, index), InProcessStore())


def node_kv(kv: KV, node: int, local_rank: int, timeout_s: float, ranks: int = 1, *,
            transport: str = "auto") -> tuple[KV, Any]:
    """(the node-local Store's KV, the object to keep alive with it or None).

    Local rank 0 hosts it and publishes its address on the job's Store; the node's other ranks
    wait for the address (bounded) and connect to it. With ``transport`` ``socket`` (``auto`` on
    Linux) it is a :class:`~node_link.NodeHub` the others reach over Unix sockets (node_link.py),
    else a TCPStore on 127.0.0.1. A joining rank follows the address its host published, whatever
    its own setting. Ranks as threads of one process (an in-process job Store) share an in-process
    Store; MindSpore's jobs a MindSpore TCPStore.
    """
    if local_rank == 0 and use_node_link(transport) and not isinstance(kv.store, InProcessStore) \
            and not isinstance(kv.store, ms_store.MindSporeStore):
        hub = node_link.NodeHub(local_queue=kv.prefix + queue_name(0))
        kv.set(node_store_key(node), hub.address)
        return KV(hub, kv.prefix, queues=True), hub
    return _hosted_or_joined(kv, node_store_key(node), node, hosts=local_rank == 0, listen="127.0.0.1",
                             advertise=lambda: "127.0.0.1", timeout_s=timeout_s, clients=ranks,
                             absent=f"node {node}'s relay (its local rank 0) did not publish the node-local Store",
                             queue=queue_name(local_rank))


def use_node_link(transport: str) -> bool:
    """Whether a node's host serves its node over the node link (node_link.py) rather than a TCPStore."""
    if transport == "socket" and not node_link.supported():
        raise ConfigError(f"node_transport='socket' needs Linux (abstract Unix socket names); this is "
                          f"{sys.platform}: use 'store' or 'auto'", settings=("node_transport",))
    return transport == "socket" or (transport == "auto" and node_link.supported())


def group_kv(kv: KV, group: int, nodes: int, *, hosts: bool, timeout_s: float) -> tuple[KV, Any]:
    """(the group Store's KV, the server object to keep alive or None).

    The group's first node relay hosts it (a TCPStore on all interfaces: the group's other nodes
    are other hosts) and publishes ``host:port`` on the job's Store, ``host`` being the address this
    host reaches the job's Store from; the group's other node relays wait for it (bounded).
    """
    return _hosted_or_joined(kv, group_store_key(group), -1 - group, hosts=hosts, listen="0.0.0.0",
                             advertise=lambda: advertised_host(kv.store), timeout_s=timeout_s, clients=nodes,
                             absent=f"group {group}'s relay (the local rank 0 of its first node) did not publish "
                                    f"the group Store")


def _hosted_or_joined(kv: KV, key: str, index: int, *, hosts: bool, listen: str, advertise: Callable[[], str],
                      timeout_s: float, clients: int, absent: str, queue: str | None = None) -> tuple[KV, Any]:
    """Host a Store and publish its address at ``key`` on the job's Store, or wait for that
    address (bounded) and connect to it. In process (ranks as threads) one store per ``index``."""
    # The Stores hosted here have queues (queues.py) unless they are MindSpore's: every rank of
    # the node (or group) reaches it through this function, so writer and readers agree.
    if isinstance(kv.store, InProcessStore):
        return KV(_in_process_store(kv.store, kv.prefix, index), kv.prefix, queues=True), None
    mindspore = isinstance(kv.store, ms_store.MindSporeStore)
    poll_s = kv.store.poll_max_s if isinstance(kv.store, ms_store.MindSporeStore) else ms_store.POLL_MAX_S
    if hosts and mindspore:
        client, master = ms_store.host_store(listen, max(timeout_s, 30.0), poll_s)
        kv.set(key, f"{advertise()}:{client.port}")
        return KV(client, kv.prefix), master
    if hosts:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        timeout = datetime.timedelta(seconds=max(timeout_s, 30.0))
        # torch binds a server on every interface whatever host it is given; a node's Store is
        # for the node alone, so it gets a socket bound to 127.0.0.1 (the server owns the fd).
        fd, bound = _loopback_listener() if listen == "127.0.0.1" else (None, 0)
        server: Any = TCPStore(listen, bound, None, True, timeout, wait_for_workers=False, use_libuv=True,
                               master_listen_fd=fd)
        kv.set(key, f"{advertise()}:{server.port}")
        return KV(server, kv.prefix, queues=True), server
    if kv.poll_all([key], time.monotonic() + timeout_s, interval_s=0.01, max_interval_s=0.2):
        raise ConfigError(f"{absent} within node_store_timeout_s={timeout_s:g} s")
    address = kv.get(key)
    if node_link.is_address(address) and queue is not None:  # the node's host serves it without a Store
        link = _dial(kv, key, address, kv.prefix + queue, time.monotonic() + timeout_s, timeout_s)
        return KV(link, kv.prefix, queues=True), link
    host, _, port = address.rpartition(":")
    if mindspore:
        return KV(ms_store.MindSporeStore(host.strip("[]"), int(port), max(timeout_s, 30.0),
                                          poll_max_s=poll_s), kv.prefix), None
    # Connected now, within the bound: a relay's stop() may wake it through this connection, which
    # must not be the first to dial a host that may be gone by then.
    return KV(fd_budget.StoreClient(host.strip("[]"), int(port), max(timeout_s, 30.0), clients, connect=True,
                                    libuv=True), kv.prefix, queues=True), None


def _loopback_listener() -> tuple[int, int]:
    """A listening TCP socket on 127.0.0.1 (an ephemeral port), detached for TCPStore: (fd, port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        port = int(sock.getsockname()[1])
    except OSError:
        sock.close()
        raise
    return sock.detach(), port


def _dial(kv: KV, key: str, address: str, queue: str, deadline: float, timeout_s: float) -> node_link.NodeLink:
    """A link to the node's hub at ``address``; if it refuses (the address of a hub that is gone:
    a node restarted under a launcher, whose keys outlive restarts), the address its successor
    publishes, until ``deadline``."""
    while True:
        try:
            return node_link.NodeLink(address, queue, max(1.0, deadline - time.monotonic()))
        except node_link.LinkLost as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"{exc} (within node_store_timeout_s={timeout_s:g} s)",
                                  settings=("node_store_timeout_s",)) from None
            time.sleep(0.05)  # a poll of the job's Store, bounded by the deadline
            address = kv.get(key)


def advertised_host(store: Any) -> str:
    """The address other hosts can reach this one at: the local address of the route to the job's
    Store (a UDP ``connect`` sends nothing); else the host name's address."""
    base = getattr(store, "_underlying_non_prefix_store", store)
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host.strip("[]"), port))
                address = str(probe.getsockname()[0])
                return f"[{address}]" if ":" in address else address
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
