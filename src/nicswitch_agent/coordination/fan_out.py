"""One rank's part of the fan-out: which Store its member uses, and the relays it runs.

With node-local fan-out local rank 0 of every node hosts its node's Store and runs the node's
relay (relay.py). With groups of nodes, each node relay answers on its group's Store instead of
the job's, and the first node relay of each group also hosts that Store and runs the group's
relay, which answers on the job's Store for the whole group: the same relay class, one level up.
"""

from __future__ import annotations

from typing import Any

from nicswitch_agent.coordination import node_link, topology
from nicswitch_agent.coordination.kv import KV, InProcessStore
from nicswitch_agent.coordination.relay import NodeRelay
from nicswitch_agent.coordination.topology import Layout


class RankFanOut:
    """The Stores and relays of one rank under a :class:`~topology.Layout` (see the module doc).

    ``member_kv`` is where the rank's member answers, ``slot`` its index there (None: flat, the
    member answers on the job's Store by global rank). ``stop()`` stops the relays, the node's
    first (the release it relayed last still reaches the node's ranks), then the group's, then
    closes the node link it hosts.
    """

    def __init__(self, kv: KV, layout: Layout, rank: int, *, node_store_timeout_s: float,
                 stop_timeout_s: float, node_transport: str = "auto") -> None:
        self.layout, self.rank = layout, rank
        self.member_kv, self.slot = kv, None
        self.node_relay: NodeRelay | None = None
        self.group_relay: NodeRelay | None = None
        self._servers: list[Any] = []  # Store servers this rank hosts: kept alive with it
        per_node = layout.ranks_per_node
        if per_node is None:
            return
        node, self.slot = divmod(rank, per_node)
        upstream, index = kv, node  # where the node relay answers, and as which index
        try:
            if layout.nodes_per_group and self.slot == 0:
                group, index = divmod(node, layout.nodes_per_group)
                nodes = layout.nodes_of(group)
                upstream, server = topology.group_kv(kv, group, len(nodes), hosts=index == 0,
                                                     timeout_s=node_store_timeout_s)
                if server is not None:
                    self._servers.append(server)
                if index == 0:  # the group's first node relay hosts its Store and runs its relay
                    self.group_relay = NodeRelay(
                        kv.clone(), kv, upstream.clone(), group, [n * per_node for n in nodes],
                        stop_timeout_s=stop_timeout_s, label=f"group {group}", local_wake=upstream,
                        names=[f"{n} (ranks {n * per_node}-{(n + 1) * per_node - 1})" for n in nodes])
            self.member_kv, server = topology.node_kv(kv, node, self.slot, node_store_timeout_s, per_node,
                                                      transport=node_transport)
            if server is not None:
                self._servers.append(server)
            if self.slot == 0:
                first = node * per_node
                self.node_relay = NodeRelay(upstream.clone(), upstream, self.member_kv.clone(), index,
                                            list(range(first, first + per_node)), stop_timeout_s=stop_timeout_s,
                                            label=f"node {node}", local_wake=self.member_kv)
        except BaseException:
            self._servers.clear()
            raise

    def start(self) -> None:
        for relay in (self.group_relay, self.node_relay):
            if relay is not None:
                relay.start()

    def stop(self, reason: str = "") -> None:
        """Stop the relays, then close the node link this rank hosts, telling the node's ranks why
        (they lose coordination now, and know it is a stop rather than a failure)."""
        for relay in (self.node_relay, self.group_relay):
            if relay is not None:
                relay.stop()
        for server in self._servers:
            if isinstance(server, node_link.NodeHub):
                server.close(f"local rank 0's agent stopped ({reason})" if reason else "local rank 0's agent stopped")

    def describe(self) -> str:
        """For the start line: "" when flat."""
        layout = self.layout
        if layout.ranks_per_node is None:
            return ""
        node, local = divmod(self.rank, layout.ranks_per_node)
        role = "relays for its node" if local == 0 else f"local rank {local}"
        if self.group_relay is not None:
            role += " and its group"
        text = f"; node-local fan-out: node {node} of {layout.nodes}, {role}"
        if layout.nodes_per_group:
            text += f"; group {node // layout.nodes_per_group} of {layout.groups}"
        store = self.member_kv.store
        if isinstance(store, node_link.NodeHub | node_link.NodeLink):
            text += "; over the node link"
        elif not isinstance(store, InProcessStore):
            text += "; over a TCPStore"
        return text


def describe_for_leader(layout: Layout) -> str:
    """For a leader-only process's start line."""
    if layout.ranks_per_node is None:
        return ""
    text = f"; node-local fan-out: {layout.nodes} node(s) of {layout.ranks_per_node}"
    if layout.nodes_per_group:
        text += f" in {layout.groups} group(s) of up to {layout.nodes_per_group}"
    return text


__all__ = ["RankFanOut", "describe_for_leader"]
