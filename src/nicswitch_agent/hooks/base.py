"""Hook kinds as ABCs (for classes) and callable aliases (for plain functions)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from nicswitch_agent.orders import SwitchOrder

SwitchHook = Callable[[SwitchOrder], "bool | None"]
"""Switches the links of ``order`` on this process; returns False (or raises) on failure."""

CheckpointHook = Callable[[SwitchOrder], None]
"""Makes sure a checkpoint exists before the switch; raises to refuse the switch."""


class Switcher(abc.ABC):
    """A switch hook with an optional start-time readiness check."""

    def check(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Raise with a clear message if this switcher cannot work here (called at start)."""

    @abc.abstractmethod
    def __call__(self, order: SwitchOrder) -> bool | None:
        """Switch the links listed in ``order``; True/None = success, False = failure."""


class CheckpointGuard(abc.ABC):
    """A checkpoint guard with an optional start-time readiness check."""

    def check(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Raise with a clear message if this guard cannot work here (called at start)."""

    @abc.abstractmethod
    def __call__(self, order: SwitchOrder) -> None:
        """Ensure a checkpoint exists for the parked step; raise to refuse the switch."""


def check_hook(hook: Any) -> None:
    """Run ``hook.check()`` when the hook has one (plain functions have none)."""
    check = getattr(hook, "check", None)
    if callable(check):
        check()
