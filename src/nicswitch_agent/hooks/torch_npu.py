"""TorchNpuSwitcher: switch HCCL links with ``torch_npu.npu._comm_switch_nic``.

``_comm_switch_nic(ranks, useBackup)`` takes the *global* rank list and one bool per rank, and
applies it to every NPU process group of this process (after a device synchronize). HCCL
requires every rank of a communicator to pass identical arguments, so every rank calls it with
the full list in the order ClusterD sent. torch_npu is imported lazily: the agent's core must
import without torch.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from nicswitch_agent.errors import ConfigError
from nicswitch_agent.hooks.base import Switcher
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.hooks")

MODULE = "torch_npu.npu"
FUNCTION = "_comm_switch_nic"


def hccl_retry_enables_l2(value: str | None) -> bool:
    """True when ``HCCL_OP_RETRY_ENABLE`` (e.g. ``"L0:0, L1:1, L2:1"``) enables level L2.

    Without L2 retry, HCCL's ``HcclCommWorkingDevNicSet`` returns success and does nothing.
    """
    if not value:
        return False
    for part in value.split(","):
        level, _, flag = part.strip().partition(":")
        if level.strip().upper() == "L2":
            return flag.strip() == "1"
    return False


class TorchNpuSwitcher(Switcher):
    """Calls ``torch_npu.npu._comm_switch_nic(list(order.ranks), list(order.ops))``."""

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None

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
        self._resolve()
        if not hccl_retry_enables_l2(os.environ.get("HCCL_OP_RETRY_ENABLE")):
            logger.warning(
                "HCCL_OP_RETRY_ENABLE=%r does not enable L2: HCCL accepts link switches but does "
                "nothing (set HCCL_OP_RETRY_ENABLE=\"L0:0, L1:1, L2:1\")",
                os.environ.get("HCCL_OP_RETRY_ENABLE"),
            )

    def __call__(self, order: SwitchOrder) -> bool:
        fn = self._resolve()
        return bool(fn(list(order.ranks), list(order.ops)))
