"""TorchNpuSwitcher: switch HCCL links with ``torch_npu.npu._comm_switch_nic``, and say what moved.

``_comm_switch_nic(ranks, useBackup)`` takes the *global* rank list and one bool per rank, and
applies it to every NPU process group of this process (after a device synchronize). HCCL
requires every rank of a communicator to pass identical arguments, so every rank calls it with
the full list in the order ClusterD sent. torch_npu is imported lazily: the agent's core must
import without torch.

A True from torch_npu proves less than it seems: it is also the answer when a group has no
communicator yet, when HCCL lacks the switch entry point, and when HCCL accepts the call without
moving anything because the backup link is not enabled (L2 op retry off). So around the call:

- **Before**, a group whose communicator exists but never ran a collective is warmed up with one
  barrier: HCCL would refuse it (``HCCL_E_PARA``) and fail the whole switch. A group with *no*
  communicator is **not** warmed, only reported: it carries no traffic, so nothing is left on the
  old NIC; creating its communicator mid-failover would allocate HCCL's buffers on a parked step
  and build its first links over the default NIC (the failing one, when moving to the backup), and
  its real ops would later build their own links on the default NIC anyway, as every op new to a
  communicator does after a switch.
- **After**, :meth:`TorchNpuSwitcher.last_record` holds what happened per group (switched, or
  why not: no communicator, no listed rank in it, backup link not enabled, refused) and that
  point-to-point communicators were not visited. With L2 retry off the switcher answers False:
  HCCL moved nothing, and a true reply would send training onto a link that never moved.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.base import Switcher
from nicswitch_agent.hooks.hccl_env import (
    blocking_finding,
    hccl_retry_enables_l2,
    p2p_buffsize_mb,
    p2p_finding,
    retry_finding,
)
from nicswitch_agent.hooks.npu_groups import GroupsUnknown, NpuGroup, list_npu_groups, warm_up
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.hooks")

MODULE = "torch_npu.npu"
FUNCTION = "_comm_switch_nic"

# Why a group was or was not switched (GroupRecord.status).
SWITCHED = "switched"
NO_COMMUNICATOR = "no_communicator"
NOT_LISTED = "not_listed"
BACKUP_DISABLED = "backup_disabled"
REFUSED = "refused"
UNKNOWN = "unknown"

_WHY = {
    SWITCHED: "HCCL moved the links this communicator already has (it checks the ports are up; it sends no traffic)",
    NO_COMMUNICATOR: "no communicator on this device yet (no collective ran): nothing to move; its first "
                     "collective builds its links on the default NIC",
    NOT_LISTED: "no rank of the list is in this group: HCCL was not called for it",
    BACKUP_DISABLED: "HCCL accepted it and moved nothing: the backup link is not enabled (HCCL_OP_RETRY_ENABLE "
                     "without L2:1)",
    REFUSED: "torch_npu returned False: HCCL refused this group or another one (HCCL's log names it)",
    UNKNOWN: "torch_npu accepted the call; whether this group has a communicator is not knowable with this torch_npu",
}


@dataclass(frozen=True)
class GroupRecord:
    """What one switch did to one process group on this rank."""

    name: str
    ranks: tuple[int, ...] | None
    status: str  # one of SWITCHED, NO_COMMUNICATOR, NOT_LISTED, BACKUP_DISABLED, REFUSED, UNKNOWN
    warmed: bool  # a barrier ran on it first, so that HCCL would accept it
    p2p: str  # what became of its point-to-point (send/recv) communicators

    @property
    def switched(self) -> bool:
        return self.status == SWITCHED

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": None if self.ranks is None else list(self.ranks),
                "status": self.status, "switched": self.switched, "warmed": self.warmed, "p2p": self.p2p,
                "why": _WHY[self.status]}


@dataclass(frozen=True)
class SwitchRecord:
    """What one call of :class:`TorchNpuSwitcher` did on this rank.

    Attributes:
        seq: The order's sequence number.
        torch_npu_result: What ``_comm_switch_nic`` returned.
        ok: What the switcher returned (False also when HCCL certainly moved nothing).
        l2_retry: Whether ``HCCL_OP_RETRY_ENABLE`` enables L2 (the backup link).
        p2p_buffsize_mb: ``P2P_HCCL_BUFFSIZE`` as torch_npu reads it (0: send/recv are switched).
        groups: Per NPU process group, in the order torch_npu visits them; None when not knowable.
        note: Why the groups are not known, else "".
    """

    seq: int
    torch_npu_result: bool
    ok: bool
    l2_retry: bool
    p2p_buffsize_mb: int
    groups: tuple[GroupRecord, ...] | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "torch_npu_result": self.torch_npu_result, "ok": self.ok,
                "l2_retry": self.l2_retry, "p2p_buffsize_mb": self.p2p_buffsize_mb,
                "groups": None if self.groups is None else [g.to_dict() for g in self.groups], "note": self.note}

    def summary(self) -> str:
        """One line: which groups moved, which did not and why, and the P2P communicators."""
        if self.groups is None:
            moved = f"process groups unknown ({self.note})"
        elif not self.groups:
            moved = "no NPU process group in this process"
        else:
            done = [g.name + (" (warmed up first)" if g.warmed else "") for g in self.groups if g.switched]
            left = [f"{g.name} ({g.status})" for g in self.groups if not g.switched]
            moved = f"switched: {', '.join(done) or 'none'}; not switched: {', '.join(left) or 'none'}"
        p2p = ("send/recv are on the groups' communicators (P2P_HCCL_BUFFSIZE=0)" if self.p2p_buffsize_mb == 0
               else f"two-rank send/recv communicators not visited (P2P_HCCL_BUFFSIZE={self.p2p_buffsize_mb})")
        return f"torch_npu returned {self.torch_npu_result}; {moved}; {p2p}"


def _group_status(group: NpuGroup, listed: set[int], answer: bool, l2_retry: bool) -> str:
    if group.has_communicator is False:
        return NO_COMMUNICATOR
    if group.ranks is not None and not listed.intersection(group.ranks):
        return NOT_LISTED
    if not answer:
        return REFUSED
    if not l2_retry:
        return BACKUP_DISABLED
    return UNKNOWN if group.has_communicator is None else SWITCHED


def _global_rank(env: Mapping[str, str]) -> int | None:
    raw = env.get("RANK", "").strip()
    return int(raw) if raw.isascii() and raw.isdigit() else None


class TorchNpuSwitcher(Switcher):
    """Calls ``torch_npu.npu._comm_switch_nic(list(order.ranks), list(order.ops))``.

    Args:
        switch_timeout_s: The agent's budget for this hook, to judge at start whether HCCL's
            worst-case blocking time fits in it (the agent passes its own; None: not judged).

    Raises:
        ConfigError: ``switch_timeout_s`` is not a positive number.
    """

    def __init__(self, *, switch_timeout_s: float | None = None) -> None:
        if switch_timeout_s is not None and (isinstance(switch_timeout_s, bool)
                                             or not isinstance(switch_timeout_s, (int, float))
                                             or not switch_timeout_s > 0):
            raise ConfigError(f"TorchNpuSwitcher(switch_timeout_s={switch_timeout_s!r}): must be a positive number "
                              "of seconds, or None")
        self._fn: Callable[..., Any] | None = None
        self._switch_timeout_s = switch_timeout_s
        self._record: SwitchRecord | None = None  # replaced whole, never mutated: safe to read from any thread

    def _resolve(self) -> Callable[..., Any]:
        if self._fn is None:
            try:
                module = importlib.import_module(MODULE)
            except ImportError as exc:
                raise ConfigError(
                    f"switch hook needs {MODULE} (pip install torch-npu matching your torch and CANN); "
                    f"import failed: {exc}. Pass switch_hook=... or dry_run=True to run without it."
                ) from exc
            fn = getattr(module, FUNCTION, None)
            if not callable(fn):
                raise ConfigError(
                    f"{MODULE}.{FUNCTION} is missing: this torch_npu predates link switching "
                    "(upgrade torch_npu), or pass switch_hook=..."
                )
            self._fn = fn
        return self._fn

    def check(self) -> None:
        """Find ``_comm_switch_nic``; log what a switch will and will not move here.

        Raises:
            ConfigError: torch_npu or its switch function is missing.
        """
        self._resolve()
        env = os.environ
        retry = retry_finding(env)
        if not retry.ok:
            logger.warning("%s", retry.text)
        rank = _global_rank(env)
        groups: list[NpuGroup] | None = None
        if rank is None:
            logger.warning("RANK=%r is not a rank: torch_npu's %s reads this process's global rank from RANK and "
                           "fails every switch without it (start training with torchrun, or set RANK)",
                           env.get("RANK"), FUNCTION)
            known = "process groups not listed (no RANK)"
        else:
            try:
                groups = list_npu_groups(rank)
                known = ("NPU process groups now: " + ", ".join(g.describe() for g in groups) if groups else
                         "no NPU process group yet (groups made later are switched too; each switch logs what moved)")
            except GroupsUnknown as exc:
                known = f"process groups cannot be listed: {exc}"
        p2p = p2p_finding(env)
        with_comm = None if groups is None else sum(1 for g in groups if g.has_communicator is not False)
        blocking = blocking_finding(env, with_comm, self._switch_timeout_s)
        logger.info("torch_npu link switch: %s; %s; %s; %s", known, retry.text, p2p.text, blocking.text)
        for finding in (p2p, blocking):
            if not finding.ok:
                logger.warning("%s", finding.text)

    def last_record(self) -> SwitchRecord | None:
        """What the last finished call did per process group; None before it and while one runs."""
        return self._record

    def __call__(self, order: SwitchOrder) -> bool:
        fn = self._resolve()
        self._record = None
        env = os.environ
        l2_retry = hccl_retry_enables_l2(env.get("HCCL_OP_RETRY_ENABLE"))
        rank = _global_rank(env)
        groups: list[NpuGroup] | None = None
        note = ""
        if rank is None:
            note = "RANK is not set"
        else:
            try:
                groups = list_npu_groups(rank)
            except GroupsUnknown as exc:
                note = str(exc)
        warmed = set()
        for index, group in enumerate(groups or ()):
            if group.needs_warm_up:  # HCCL would refuse it (HCCL_E_PARA) and fail the whole switch
                logger.info("switch #%d: process group %s never ran a collective; one barrier first", order.seq,
                            group.name)
                warm_up(group)
                warmed.add(index)
        answer = bool(fn(list(order.ranks), list(order.ops)))
        record = self._recorded(order, answer, l2_retry, groups, warmed, note)
        self._record = record
        if record.ok == answer:
            logger.info("switch #%d: %s", order.seq, record.summary())
        else:
            logger.warning("switch #%d: answering False: HCCL moved nothing (backup link not enabled: "
                           "HCCL_OP_RETRY_ENABLE=%r); %s", order.seq, env.get("HCCL_OP_RETRY_ENABLE"),
                           record.summary())
        return record.ok

    @staticmethod
    def _recorded(order: SwitchOrder, answer: bool, l2_retry: bool, groups: list[NpuGroup] | None,
                  warmed: set[int], note: str) -> SwitchRecord:
        p2p_mb = p2p_buffsize_mb(os.environ)
        p2p = "switched with the group (P2P_HCCL_BUFFSIZE=0)" if p2p_mb == 0 else (
            f"not visited: its send/recv pairs run on two-rank communicators (P2P_HCCL_BUFFSIZE={p2p_mb})")
        listed = set(order.ranks)
        records = None if groups is None else tuple(
            GroupRecord(g.name, g.ranks, _group_status(g, listed, answer, l2_retry), i in warmed, p2p)
            for i, g in enumerate(groups))
        # With the backup link disabled HCCL moved nothing it was asked to: a True would be a lie.
        moved_nothing = answer and not l2_retry and (
            records is None or any(r.status == BACKUP_DISABLED for r in records))
        return SwitchRecord(order.seq, answer, answer and not moved_nothing, l2_retry, p2p_mb, records, note)


__all__ = ["FUNCTION", "MODULE", "GroupRecord", "SwitchRecord", "TorchNpuSwitcher", "hccl_retry_enables_l2"]
