"""MindSporeSwitcher: switch HCCL links with MindSpore's ``_comm_switch_nic``.

``mindspore.communication.management._comm_switch_nic(global_ranks, use_backup)`` takes the global
rank list and one bool per rank; its C++ side intersects the list with each communication group
and sets each group's working NIC (docs/clusterd.md). HCCL requires every rank of a communicator
to pass identical arguments, so every rank calls it with the full list in the order ClusterD sent.

MindSpore validates the arguments itself and raises ValueError for a non-list, a rank that is not
an int (or is a bool) or is beyond the world size, a use_backup that is not a bool, duplicate
ranks, or lists of unequal length. The switcher applies the same rules first, with the world size
the agent knows, so an order MindSpore would refuse fails with the reason in the agent's words
(the order is validated before it reaches any rank, so this is a second line). MindSpore is
imported lazily: the agent's core never imports it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.base import Switcher
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.hooks")

MODULE = "mindspore.communication.management"
FUNCTION = "_comm_switch_nic"


def validate(ranks: Sequence[Any], use_backup: Sequence[Any], world_size: int | None) -> None:
    """MindSpore's own checks of ``_comm_switch_nic``'s arguments; ValueError naming the rule broken."""
    if not isinstance(ranks, (list, tuple)) or not isinstance(use_backup, (list, tuple)):
        raise ValueError(f"global_ranks and use_backup must be lists, got {type(ranks).__name__} and "
                         f"{type(use_backup).__name__}")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0
           or (world_size is not None and r >= world_size)]
    if bad:
        raise ValueError(f"global_ranks must be ints below the world size ({world_size}): {bad} are not")
    if not all(isinstance(op, bool) for op in use_backup):
        raise ValueError(f"use_backup must hold bools: {list(use_backup)}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"global_ranks must be different from each other: {list(ranks)}")
    if len(ranks) != len(use_backup):
        raise ValueError(f"global_ranks ({len(ranks)}) and use_backup ({len(use_backup)}) must be as long")


class MindSporeSwitcher(Switcher):
    """Calls ``mindspore.communication.management._comm_switch_nic(list(order.ranks), list(order.ops))``.

    Args:
        world_size: ranks in the job, for the check MindSpore makes (None: MindSpore's own
            ``get_group_size()`` judges, at the call).
    """

    def __init__(self, *, world_size: int | None = None) -> None:
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                       or world_size < 1):
            raise ConfigError(f"MindSporeSwitcher(world_size={world_size!r}): must be a positive int or None")
        self._world_size = world_size
        self._fn: Callable[..., Any] | None = None

    def _resolve(self) -> Callable[..., Any]:
        if self._fn is None:
            try:
                module = importlib.import_module(MODULE)
            except ImportError as exc:
                raise ConfigError(
                    f"switch hook needs {MODULE} (python3 -m pip install '.[mindspore]' in the nicswitch-agent "
                    f"checkout, or MindSpore for your CANN); import failed: {exc}. Pass switch_hook=... or "
                    f"dry_run=True to run without it.") from exc
            fn = getattr(module, FUNCTION, None)
            if not callable(fn):
                raise ConfigError(f"{MODULE}.{FUNCTION} is missing: this MindSpore predates link switching "
                                  "(upgrade MindSpore), or pass switch_hook=...")
            self._fn = fn
        return self._fn

    def check(self) -> None:
        """Find ``_comm_switch_nic``.

        Raises:
            ConfigError: MindSpore or its switch function is missing.
        """
        self._resolve()
        logger.info("MindSpore link switch: %s.%s found", MODULE, FUNCTION)

    def __call__(self, order: SwitchOrder) -> bool:
        fn = self._resolve()
        ranks, ops = list(order.ranks), list(order.ops)
        validate(ranks, ops, self._world_size)
        answer = bool(fn(ranks, ops))
        logger.info("switch #%d: MindSpore's %s(%s, %s) returned %s", order.seq, FUNCTION, ranks, ops, answer)
        return answer


__all__ = ["FUNCTION", "MODULE", "MindSporeSwitcher", "validate"]
