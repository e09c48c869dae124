"""nicswitch-agent: the training-side client for ClusterD's link failover and switchback.

Typical use in a training loop::

    from nicswitch_agent import SwitchAgent

    with SwitchAgent() as agent:          # server and job id from MindCluster's env
        for step, batch in enumerate(loader):
            train_step(batch)
            agent.step(step)              # a safe point; costs about an attribute write
"""

# First, before any module of ours imports grpc: makes grpc safe for forked DataLoader workers.
from nicswitch_agent import process_hooks  # noqa: F401
from nicswitch_agent.agent import SwitchAgent
from nicswitch_agent.config import AgentConfig
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.errors import (
    AgentStateError,
    ConfigError,
    InvalidOrder,
    NicSwitchError,
)
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
