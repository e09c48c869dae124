"""The job rank table ClusterD derives from the pods: node -> device_id -> global rank id.

docs/clusterd.md#rank-ids-and-their-order: ``rank_id = podRank * podDevNum + index`` (upstream ``pod_util.go``
``getServerInfo``), a decimal string, and SwitchNicTrack maps every ``(node, dev)`` of the
request through it, nodes in Go map order, devices in the request's order.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["RankTable", "Server", "go_map_order"]


@dataclass(frozen=True)
class Server:
    """One rank-table ``server_list`` entry: a node and its devices with their rank ids."""

    server_name: str
    pod_rank: int
    device_ids: tuple[str, ...]
    rank_ids: tuple[str, ...]


class RankTable:
    """Rank ids of a job, built from its nodes in pod-rank order."""

    def __init__(self, nodes: Mapping[str, Sequence[str]]) -> None:
        servers: list[Server] = []
        for pod_rank, (node, devices) in enumerate(nodes.items()):
            devs = tuple(devices)
            width = len(devs)
            ranks = tuple(str(pod_rank * width + index) for index in range(width))
            servers.append(Server(node, pod_rank, devs, ranks))
        self.servers: tuple[Server, ...] = tuple(servers)
        self._by_node = {s.server_name: s for s in servers}
        self._rank_of = {
            (s.server_name, dev): rank for s in servers for dev, rank in zip(s.device_ids, s.rank_ids, strict=True)
        }

    def has_node(self, node: str) -> bool:
        return node in self._by_node

    def device_ids(self, node: str) -> tuple[str, ...]:
        return self._by_node[node].device_ids

    def rank_of(self, node: str, device_id: str) -> str:
        """The global rank id of a device; KeyError if the node or device is not in the table."""
        return self._rank_of[(node, device_id)]

    def world_size(self) -> int:
        return len(self._rank_of)

    def global_ranks(
        self, entries: Iterable[tuple[str, Sequence[str], Sequence[bool]]]
    ) -> tuple[list[str], list[bool]]:
        """Flatten validated ``(node, devs, ops)`` entries, in the given node order.

        Upstream appends all ranks of a node, then all its ops, node after node, so
        ``rankID[i]`` pairs with ``op[i]`` (``getGlobalRankIDAndOp``).
        """
        ranks: list[str] = []
        ops: list[bool] = []
        for node, devs, node_ops in entries:
            ranks.extend(self.rank_of(node, dev) for dev in devs)
            ops.extend(bool(op) for op in node_ops)
        return ranks, ops


def go_map_order(keys: Iterable[str], rng: random.Random | None) -> list[str]:
    """Keys in Go's map iteration order: random on every range (docs/clusterd.md#rank-ids-and-their-order,
    docs/clusterd.md#large-requests).

    ``rng=None`` keeps the given order (for deterministic tests).
    """
    ordered = list(keys)
    if rng is not None:
        rng.shuffle(ordered)
    return ordered
