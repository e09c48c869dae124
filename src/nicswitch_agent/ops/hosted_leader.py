"""The first node's leader under ``nicswitch-agent launch``: the job's Store and a leader-only agent.

The agent is built before the training command starts (so a bad setting stops the launch with exit
code 2) and started, which makes it known to ClusterD, once every training rank has joined: see
"Joining" in ops/launcher.py.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import threading
import time
from typing import Any

logger = logging.getLogger("nicswitch_agent.launcher")


class LaunchError(Exception):
    """A usage problem found before anything started (exit code 2); the message says what to pass."""


JOIN_POLL_S = 0.1  # how often the leader looks again for the ranks not yet joined (a Store check each)


class HostedLeader:
    """The Store server and the leader-only SwitchAgent of the first node.

    The agent is built (its settings checked) before the training command starts, but started (Init,
    Register, the ClusterD streams) only once every rank has joined, or ``join_timeout_s`` passed:
    see "Joining" in the module docstring.
    """

    def __init__(self, store: Any, agent: Any, port: int, world_size: int, join_timeout_s: float) -> None:
        self.store = store
        self.master: Any = None  # a MindSpore Store's master, when the client is not the server itself
        self.agent = agent
        self.port = port
        self.world_size = world_size
        self.join_timeout_s = join_timeout_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = False
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, args: argparse.Namespace, *, world_size: int, local_world_size: int | None, store_port: int,
              join_timeout_s: float | None, framework: str = "torch") -> HostedLeader:
        """Host the Store and build the leader on it (started later by :meth:`start_when_joined`).

        ``framework`` ``mindspore``: the Store is MindSpore's TCPStore (ops/launch_msrun.py).

        Raises:
            LaunchError: the port is taken, or torch (MindSpore) is missing.
            ConfigError: the agent's settings are incomplete (server, job id, ...), or the file-descriptor
                limit cannot be raised to what ``world_size`` ranks need.
        """
        from nicswitch_agent.agent import SwitchAgent
        from nicswitch_agent.config import AgentConfig
        from nicswitch_agent.coordination import fd_budget, topology

        # rank=0: a leader-only agent has no rank of its own; never read RANK from the launcher's env.
        # handle_signals=False: the launcher forwards signals to the child and stops its leader
        # itself once the child has exited (the training ranks may still need it until then).
        config = AgentConfig.from_env(server=args.server, job_id=args.job_id, pause=args.pause,
                                      world_size=world_size, rank=0, handle_signals=False,
                                      local_world_size=local_world_size, framework=framework)
        topology.choose_layout(config, world_size)  # what start() would refuse, refused now
        if framework == "mindspore":
            return cls._start_mindspore(config, world_size, store_port, join_timeout_s)
        try:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]
        except ImportError as exc:
            raise LaunchError("hosting the leader needs torch (python3 -m pip install '.[torch]' in the "
                              "nicswitch-agent checkout)") from exc
        # Every member holds sockets here: past the soft file-descriptor limit the Store drops new
        # connections, so raise it now (the training command inherits it: torchrun's agent, which
        # hosts the job's own Store, needs room too), or refuse to start if the hard limit is too low.
        fd_budget.prepare_store_host(world_size)
        timeout = datetime.timedelta(seconds=max(config.rpc_timeout_s, 30.0))
        try:
            store = TCPStore("0.0.0.0", store_port, None, True, timeout, wait_for_workers=False)
        except RuntimeError as exc:
            raise LaunchError(f"cannot host the Store on port {store_port}: {exc}; pass another --store-port")\
                from exc
        agent = SwitchAgent(config=config, store=store, leader_only=True)
        return cls(store, agent, int(store.port), world_size,
                   config.join_timeout_s if join_timeout_s is None else join_timeout_s)

    @classmethod
    def _start_mindspore(cls, config: Any, world_size: int, store_port: int,
                         join_timeout_s: float | None) -> HostedLeader:
        from nicswitch_agent.agent import SwitchAgent
        from nicswitch_agent.coordination import fd_budget, ms_store
        from nicswitch_agent.errors import ConfigError

        try:
            ms_store.mindspore_store_class()
        except ConfigError as exc:
            raise LaunchError(f"this is a MindSpore job (msrun, or NICSWITCH_FRAMEWORK=mindspore): the leader hosts "
                              f"MindSpore's TCPStore, so the launcher needs MindSpore: python3 -m pip install "
                              f"'.[mindspore]' in the nicswitch-agent checkout, in the launcher's environment "
                              f"({exc.__cause__})") from exc
        fd_budget.prepare_store_host(world_size)
        timeout_s = max(config.rpc_timeout_s, 30.0)
        try:
            client, master = ms_store.host_store("0.0.0.0", timeout_s, config.mindspore_poll_s, port=store_port)
        except ConfigError as exc:
            raise LaunchError(f"cannot host the MindSpore Store on port {store_port}: {exc}; pass another "
                              "--store-port") from exc
        leader = cls(client, SwitchAgent(config=config, store=client, leader_only=True), client.port, world_size,
                     config.join_timeout_s if join_timeout_s is None else join_timeout_s)
        leader.master = master  # kept with the leader (ms_store.py keeps every master until exit anyway)
        return leader

    def start_when_joined(self) -> None:
        """Start the leader on a thread of its own once every rank has joined (or the bound passed)."""
        self._thread = threading.Thread(target=self._join_then_start, name="nicswitch-launcher-join", daemon=True)
        self._thread.start()

    def missing(self, among: list[int] | None = None) -> list[int]:
        """The ranks (of ``among``, by default all) that have not said they joined (a member writes
        its ``joined_key`` when it starts, agent.py): one check per rank asked about."""
        from nicswitch_agent.coordination.kv import KV
        from nicswitch_agent.coordination.messages import joined_key, key_prefix

        kv = KV(self.store, key_prefix(self.agent.config.job_id, "launcher"))
        ranks = range(self.world_size) if among is None else among
        return [rank for rank in ranks if not kv.check([joined_key(rank)])]

    def _join_then_start(self) -> None:
        began = time.monotonic()
        deadline = began + self.join_timeout_s
        try:
            missing = self.missing()
            while missing and not self._stopping.wait(JOIN_POLL_S) and time.monotonic() < deadline:
                missing = self.missing(missing)  # a rank that joined stays joined: ask only about the rest
        except Exception:  # our own Store server: should not fail; if it does, start anyway
            logger.exception("could not tell which ranks joined; starting the leader now")
            missing = []
        with self._lock:
            if self._stopping.is_set():
                return
            if missing:
                from nicswitch_agent.observability.links import compact_ranks

                logger.warning("rank(s) %s had not joined after %.0f s (--join-timeout): the leader registers with "
                               "ClusterD anyway; a pause or a list those ranks miss is answered false once its "
                               "budget runs out", compact_ranks(missing), self.join_timeout_s)
            else:
                logger.info("all %d rank(s) joined in %.1f s: the leader makes itself known to ClusterD",
                            self.world_size, time.monotonic() - began)
            try:
                self.agent.start()
                self._started = True
            except Exception:
                logger.exception("the leader could not start; training goes on without switches")

    def stop(self, reason: str) -> None:
        """Stop the leader (bounded), then the Store server: no member is left waiting on a leader."""
        self._stopping.set()
        with self._lock:  # a start under way finishes first: then it is stopped like any other
            started = self._started
        try:
            if started:
                self.agent.stop(reason)
            else:
                logger.info("the leader never made itself known to ClusterD (%s)", reason)
        except Exception:
            logger.exception("stopping the leader failed")
        if self._thread is not None:
            self._thread.join(5.0)
        self.store = None  # the server closes when its last reference goes
