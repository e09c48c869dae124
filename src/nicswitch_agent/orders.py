"""SwitchOrder: a validated SwitchRankList, and the rules that decide whether one may run.

ClusterD sends global rank ids as decimal strings (rank-table ``rank_id`` =
podRank x devicesPerPod + index, written with Go's ``strconv.Itoa``), paired with one bool per
rank (``True`` = standby NIC, ``False`` = primary). Every rank must call the switch with the
same full list in the received order (HCCL requires identical arguments on every rank of a
communicator), so the order is kept exactly as received.

A list that fails validation never reaches a hook; the agent answers it false. A list for
another job is not ours to answer at all.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from nicswitch_agent.errors import InvalidOrder

# Go's strconv.Itoa never writes a sign, spaces, leading zeros or other scripts' digits; a rank
# id spelled any other way did not come from a rank table, so it is refused rather than guessed.
MAX_RANK_DIGITS = 9
# The same rule for a whole list at once (ids joined by commas): one regex instead of a Python
# call per entry, which matters for very large lists. A failure falls back to the per-entry
# check, which names the offending entry.
_CANONICAL_LIST = re.compile(r"(?:0|[1-9][0-9]{0,8})(?:,(?:0|[1-9][0-9]{0,8}))*")


@dataclass(frozen=True)
class SwitchOrder:
    """One list to switch: global ranks and their target links, in the received order.

    Attributes:
        seq: Sequence number of this order within the agent (1, 2, ...).
        job_id: The job the list was sent for.
        ranks: Global rank ids, in the received order.
        ops: ``ops[i]`` is the target of ``ranks[i]``: True = standby link, False = primary.
        received_at: ``time.monotonic()`` when the list was received.
        received_wall: ``time.time()`` when the list was received (for logs and events).
        local_ranks: see below.
    """

    seq: int
    job_id: str
    ranks: tuple[int, ...]
    ops: tuple[bool, ...]
    received_at: float = field(default_factory=time.monotonic, compare=False)
    received_wall: float = field(default_factory=time.time, compare=False)
    local_ranks: tuple[int, ...] | None = field(default=None, compare=False)
    """On a member: the listed ranks that live on this rank's node (see :class:`RankMap`), for
    per-device hooks and logs. The switch itself always takes the full list."""

    def __post_init__(self) -> None:
        if len(self.ranks) != len(self.ops):
            raise InvalidOrder(f"ranks ({len(self.ranks)}) and ops ({len(self.ops)}) differ in length")

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        return iter(zip(self.ranks, self.ops, strict=True))

    @property
    def empty(self) -> bool:
        return not self.ranks

    def to_standby(self) -> tuple[int, ...]:
        """Ranks moving to their standby link."""
        return tuple(r for r, op in self if op)

    def to_primary(self) -> tuple[int, ...]:
        """Ranks moving back to their primary link."""
        return tuple(r for r, op in self if not op)

    def summary(self, limit: int = 8) -> str:
        """Short human form for logs, e.g. ``#3 4 ranks: 2->standby 3->primary``."""
        parts = [f"{r}->{'standby' if op else 'primary'}" for r, op in itertools.islice(self, limit)]
        more = f" (+{len(self) - limit} more)" if len(self) > limit else ""
        return f"#{self.seq} {len(self)} rank(s): {' '.join(parts) or '(none)'}{more}"

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "job_id": self.job_id, "ranks": list(self.ranks), "ops": list(self.ops)}


def parse_rank_id(text: str, index: int) -> int:
    """Decode one rank id as ClusterD writes it: plain ASCII decimal, canonical form.

    Raises:
        InvalidOrder: naming the position and the offending value.
    """
    if not isinstance(text, str) or not text:
        raise InvalidOrder(f"rankID[{index}]={text!r} is empty")
    if len(text) > MAX_RANK_DIGITS:
        raise InvalidOrder(f"rankID[{index}]={text[:16]!r}{'...' if len(text) > 16 else ''} is too long")
    if not (text.isascii() and text.isdigit()):
        raise InvalidOrder(f"rankID[{index}]={text!r} is not a plain decimal rank id")
    if len(text) > 1 and text[0] == "0":
        raise InvalidOrder(f"rankID[{index}]={text!r} has a leading zero (ClusterD never writes one)")
    return int(text)


def build_order(
    *,
    seq: int,
    job_id: str,
    rank_ids: Sequence[str],
    ops: Sequence[bool],
    world_size: int,
    max_ranks: int,
) -> SwitchOrder:
    """Validate a received list and turn it into a :class:`SwitchOrder`.

    Checks, in order: sizes within ``max_ranks``; equal lengths; each rank id canonical decimal
    (no sign, so never negative); each rank below ``world_size``; no rank listed twice (the same
    rank twice is either a duplicate or a conflict, and HCCL's behaviour for either is undefined).

    ``world_size`` is the job's resolved size, never "unknown": a single process whose
    configuration names none is a job of one rank, and a true reply for a rank the job does not
    have would tell ClusterD that a link moved when nothing did.

    Raises:
        InvalidOrder: with a message that says exactly what is wrong.
    """
    n_ranks, n_ops = len(rank_ids), len(ops)
    if n_ranks > max_ranks or n_ops > max_ranks:
        raise InvalidOrder(f"list too large: {max(n_ranks, n_ops)} entries, limit max_ranks={max_ranks}")
    if n_ranks != n_ops:
        raise InvalidOrder(f"rankID has {n_ranks} entries but op has {n_ops}")
    joined = ",".join(rank_ids)
    if n_ranks and joined.isascii() and joined.count(",") == n_ranks - 1 and _CANONICAL_LIST.fullmatch(joined):
        ranks = tuple(map(int, rank_ids))
    else:
        ranks = tuple(parse_rank_id(text, i) for i, text in enumerate(rank_ids))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidOrder(f"world_size={world_size!r}: the job's size must be known to check the list")
    for i, rank in enumerate(ranks):
        if rank >= world_size:
            raise InvalidOrder(f"rankID[{i}]={rank} is outside the job (world_size={world_size})")
    if len(set(ranks)) != len(ranks):
        seen: set[int] = set()
        for i, rank in enumerate(ranks):
            if rank in seen:
                raise InvalidOrder(f"rankID[{i}]={rank} is listed more than once")
            seen.add(rank)
    return SwitchOrder(seq=seq, job_id=job_id, ranks=ranks, ops=tuple(bool(op) for op in ops))


@dataclass(frozen=True)
class RankMap:
    """Global rank -> node and local rank, for a job with the same number of ranks per node.

    ClusterD's rank ids are rank-table ``rank_id`` = podRank x devicesPerPod + index, which is
    torchrun's global rank when one pod runs one node's ranks in device order.
    """

    local_world_size: int
    node_rank: int

    def __post_init__(self) -> None:
        if self.local_world_size < 1 or self.node_rank < 0:
            raise InvalidOrder(f"bad RankMap: local_world_size={self.local_world_size} node_rank={self.node_rank}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, rank: int = 0) -> RankMap:
        import os

        env = dict(os.environ) if env is None else env
        lws = int(env.get("LOCAL_WORLD_SIZE", "0") or 0) or 1
        node = env.get("GROUP_RANK") or env.get("NODE_RANK")
        return cls(lws, int(node) if node else rank // lws)

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def local_rank_of(self, rank: int) -> int:
        return rank % self.local_world_size

    def local_ranks(self, order: SwitchOrder) -> tuple[int, ...]:
        """The ranks of ``order`` on this node, in the order's order."""
        first = self.node_rank * self.local_world_size  # a list comprehension: no generator step per rank
        return tuple([r for r in order.ranks if first <= r < first + self.local_world_size])
