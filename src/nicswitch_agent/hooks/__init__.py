"""Switch hooks and checkpoint guards: small callables the agent runs for each order.

A switch hook is any ``callable(order) -> bool | None`` (None or True = success); a checkpoint
guard is any ``callable(order) -> None`` that raises to refuse the switch. The classes here add
an optional ``check()`` that the agent calls at ``start()``, so a missing dependency is reported
when the job starts, not in the middle of a switch. A verify hook (``TorchLinkProbe``) is any
``callable(order) -> bool | None`` run on every rank once the switch succeeded on every rank.
"""

from nicswitch_agent.config import AgentConfig, job_framework
from nicswitch_agent.hooks.base import CheckpointGuard, CheckpointHook, Switcher, SwitchHook, check_hook
from nicswitch_agent.hooks.dry_run import DryRunSwitcher
from nicswitch_agent.hooks.ms_checkpoint import MindSporeCheckpointGuard
from nicswitch_agent.hooks.ms_switch import MindSporeSwitcher
from nicswitch_agent.hooks.torch_checkpoint import GuardRefused, TorchCheckpointGuard
from nicswitch_agent.hooks.torch_npu import TorchNpuSwitcher
from nicswitch_agent.hooks.torch_probe import ProbeFailed, TorchLinkProbe


def default_switch_hook(config: AgentConfig) -> Switcher:
    """The switch hook when none is passed: a dry run, MindSpore's switch for a MindSpore job
    (``framework``), else torch_npu's."""
    if config.dry_run:
        return DryRunSwitcher()
    if job_framework(config.framework) == "mindspore":
        return MindSporeSwitcher(world_size=config.world_size)
    return TorchNpuSwitcher(switch_timeout_s=config.switch_timeout_s)


__all__ = [
    "CheckpointGuard",
    "CheckpointHook",
    "DryRunSwitcher",
    "GuardRefused",
    "MindSporeCheckpointGuard",
    "MindSporeSwitcher",
    "ProbeFailed",
    "SwitchHook",
    "Switcher",
    "TorchCheckpointGuard",
    "TorchLinkProbe",
    "TorchNpuSwitcher",
    "check_hook",
    "default_switch_hook",
]
