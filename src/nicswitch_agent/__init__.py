"""nicswitch-agent: the training-side client for ClusterD's link failover and switchback.

Typical use in a training loop::

    from nicswitch_agent import SwitchAgent

    with SwitchAgent() as agent:          # server and job id from MindCluster's env
        for step, batch in enumerate(loader):
            train_step(batch)
            agent.step(step)              # a safe point; costs about an attribute write
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First, before any module of ours imports grpc: makes grpc safe for forked DataLoader workers.
from nicswitch_agent import process_hooks  # noqa: F401

if TYPE_CHECKING:
    from nicswitch_agent.agent import SwitchAgent
    from nicswitch_agent.config import AgentConfig
    from nicswitch_agent.coordination.parking import TrainingStopped
    from nicswitch_agent.errors import AgentStateError, ConfigError, InvalidOrder, NicSwitchError
    from nicswitch_agent.hooks import (
        CheckpointGuard,
        DryRunSwitcher,
        Switcher,
        TorchCheckpointGuard,
        TorchLinkProbe,
        TorchNpuSwitcher,
    )
    from nicswitch_agent.observability.events import AgentEvent
    from nicswitch_agent.orders import SwitchOrder

# The public names, imported on first use (PEP 562): ``import nicswitch_agent.ops.cli`` (the
# ``nicswitch-agent`` command) then costs milliseconds, not the whole agent, so the command is
# inside its own Ctrl-C handling almost at once (ops/cli.py: main).
_HOME = {
    "SwitchAgent": "nicswitch_agent.agent",
    "AgentConfig": "nicswitch_agent.config",
    "TrainingStopped": "nicswitch_agent.coordination.parking",
    "AgentStateError": "nicswitch_agent.errors",
    "ConfigError": "nicswitch_agent.errors",
    "InvalidOrder": "nicswitch_agent.errors",
    "NicSwitchError": "nicswitch_agent.errors",
    "CheckpointGuard": "nicswitch_agent.hooks",
    "DryRunSwitcher": "nicswitch_agent.hooks",
    "Switcher": "nicswitch_agent.hooks",
    "TorchCheckpointGuard": "nicswitch_agent.hooks",
    "TorchLinkProbe": "nicswitch_agent.hooks",
    "TorchNpuSwitcher": "nicswitch_agent.hooks",
    "AgentEvent": "nicswitch_agent.observability.events",
    "SwitchOrder": "nicswitch_agent.orders",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"  # the only place: pyproject.toml reads it (dynamic version)

__all__ = [
    "AgentConfig",
    "AgentEvent",
    "AgentStateError",
    "CheckpointGuard",
    "ConfigError",
    "DryRunSwitcher",
    "InvalidOrder",
    "NicSwitchError",
    "SwitchAgent",
    "SwitchOrder",
    "Switcher",
    "TorchCheckpointGuard",
    "TorchLinkProbe",
    "TorchNpuSwitcher",
    "TrainingStopped",
    "__version__",
]
