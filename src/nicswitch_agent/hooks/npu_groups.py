"""The NPU process groups of this process, as torch_npu's link switch sees them.

``torch_npu.npu._comm_switch_nic`` walks the same registry read here: every process group in
torch.distributed's ``_pg_map`` that has an NPU backend (torch_npu reaches it as
``torch_npu.distributed.distributed_c10d.dist_c10d``), and for each the communicator stored under
this device. What can be known from Python without touching NPU internals:

- whether the group has a communicator on this device: ``backend.get_hccl_comm_name(rank,
  init_comm=False)`` answers ``""`` when there is none, and never creates one (communicators are
  created lazily, by the group's first collective);
- whether a collective ever ran on it: ``backend._get_sequence_number_for_group()`` counts the
  group's collectives (point-to-point ops do not count);
- its member ranks (``get_process_group_ranks``).

What cannot: the two-rank point-to-point communicators (kept under other keys, not reachable
from Python), whether the CANN in use has ``HcclCommWorkingDevNicSet`` (torch_npu logs "Skip it."
to HCCL's log when it has not), and what HCCL did per group (the call returns one bool for all).

Every probe is guarded: an attribute this torch_npu lacks makes the answer unknown (None),
never an exception in the switch.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("nicswitch_agent.hooks")

C10D_MODULE = "torch_npu.distributed.distributed_c10d"
DEVICE_TYPE = "npu"  # torch_npu renames torch's PrivateUse1 device to this


class GroupsUnknown(Exception):
    """The process-group registry cannot be read here (the message says why)."""


@dataclass(frozen=True)
class NpuGroup:
    """One NPU process group of this process, as found just now.

    Attributes:
        name: The group's name (torch's, e.g. ``"0"`` for the default group).
        ranks: Its global ranks, or None when unknown.
        has_communicator: Whether it has a communicator on this device; None when unknown.
        collectives: How many collectives ran on it (torch_npu's sequence number); None when unknown.
    """

    name: str
    ranks: tuple[int, ...] | None
    has_communicator: bool | None
    collectives: int | None
    backend: Any = field(default=None, compare=False, repr=False)

    @property
    def needs_warm_up(self) -> bool:
        """A communicator that never ran a collective: HCCL refuses to switch it (HCCL_E_PARA)."""
        return self.has_communicator is True and self.collectives == 0

    def describe(self) -> str:
        size = f"{len(self.ranks)} ranks" if self.ranks is not None else "ranks unknown"
        if self.has_communicator is None:
            comm = "communicator unknown"
        elif not self.has_communicator:
            comm = "no communicator yet"
        elif self.collectives is None:
            comm = "communicator"
        else:
            comm = f"communicator, {self.collectives} collective(s) run"
        return f"{self.name} ({size}, {comm})"


def _registry() -> Any:
    try:
        module = importlib.import_module(C10D_MODULE)
    except Exception as exc:  # torch_npu raises more than ImportError when CANN is broken
        raise GroupsUnknown(f"cannot import {C10D_MODULE} ({type(exc).__name__}: {exc})") from exc
    registry = getattr(module, "dist_c10d", None)
    if registry is None or not hasattr(registry, "_pg_map"):
        raise GroupsUnknown(f"{C10D_MODULE} has no dist_c10d._pg_map: this torch_npu keeps its groups elsewhere")
    return registry


def _probe(what: str, ask: Callable[[], Any]) -> Any:
    """``ask()``, or None when this torch_npu cannot answer it (an attribute missing, a call failing)."""
    try:
        return ask()
    except Exception as exc:
        logger.debug("process group probe %s failed: %s", what, exc)
        return None


def list_npu_groups(rank: int) -> list[NpuGroup]:
    """This process's NPU groups, in the order ``_comm_switch_nic`` visits them (creation order).

    Args:
        rank: This process's global rank (torch_npu passes ``RANK``).

    Raises:
        GroupsUnknown: the registry cannot be read with this torch_npu.
    """
    registry = _registry()
    groups = []
    try:
        for pg in list(registry._pg_map):
            npu = [d for d in getattr(pg, "_device_types", ()) if getattr(d, "type", None) == DEVICE_TYPE]
            if npu:  # else a gloo-only group, which _comm_switch_nic skips too
                groups.append(_group(registry, pg, pg._get_backend(npu[0]), rank))
    except Exception as exc:  # a registry shaped otherwise: say so, never fail the switch for it
        raise GroupsUnknown(f"reading the process groups failed ({type(exc).__name__}: {exc})") from exc
    return groups


def _group(registry: Any, pg: Any, backend: Any, rank: int) -> NpuGroup:
    name = getattr(registry, "_pg_names", {}).get(pg) or getattr(pg, "group_name", None) or "?"
    ranks = _probe("ranks", lambda: registry.get_process_group_ranks(pg))
    comm = _probe("communicator", lambda: backend.get_hccl_comm_name(rank, init_comm=False))
    seq = _probe("collectives", lambda: backend._get_sequence_number_for_group())
    return NpuGroup(
        name=str(name),
        ranks=None if ranks is None else tuple(int(r) for r in ranks),
        has_communicator=None if comm is None else bool(comm),
        collectives=None if seq is None else int(seq),
        backend=backend,
    )


def warm_up(group: NpuGroup) -> None:
    """Run one collective on ``group`` so that HCCL will switch its communicator.

    ``barrier`` on the NPU backend is an all-reduce of one float on this device: it builds the
    communicator's links (on the default NIC) and bumps the group's collective count. Every member
    of the group reaches the same decision (a group's collective count is the same on all of its
    members) and in the same order, so the barrier meets on every member.
    """
    work = group.backend.barrier()
    work.wait()
