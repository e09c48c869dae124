"""Hook kinds as ABCs (for classes) and callable aliases (for plain functions)."""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Callable
from typing import Any

from nicswitch_agent.errors import ConfigError
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.hooks")

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


def require_callable(name: str, value: Any, takes: str) -> None:
    """Refuse ``value`` unless it is None or can be called with one argument (``takes`` names it).

    A hook that cannot be called would otherwise fail only at the first switch, when it costs the
    job a recovery; a class instead of an instance is the common slip.

    Raises:
        ConfigError: naming the argument, the type and the value.
    """
    if value is None:
        return
    if isinstance(value, type):
        raise ConfigError(f"{name} must be callable with {takes}, got the class {value.__name__}: "
                          f"pass an instance, e.g. {value.__name__}()")
    if not callable(value):
        raise ConfigError(f"{name} must be callable, got {type(value).__name__} {value!r}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # some builtins and extension types have none: trust them
        return
    try:
        signature.bind(None)
    except TypeError as exc:
        raise ConfigError(f"{name}={value!r} must be callable with {takes} ({exc})") from None


def hook_record(hook: Any) -> dict[str, Any] | None:
    """The record of the hook's last finished call, when it offers one; else None.

    A switch hook may have ``last_record()`` returning None or an object with ``to_dict()``
    (:class:`~nicswitch_agent.TorchNpuSwitcher` says per process group what moved). A record that
    cannot be read is logged and left out: it never turns a result into a failure.
    """
    get = getattr(hook, "last_record", None)
    if not callable(get):
        return None
    try:
        record = get()
        return None if record is None else dict(record.to_dict())
    except Exception:
        logger.exception("the switch hook's last_record() failed; its result goes without a record")
        return None
