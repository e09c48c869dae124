"""The agent's exception family: one base class, so callers can catch everything we raise."""

from __future__ import annotations


class NicSwitchError(Exception):
    """Base of every error nicswitch-agent raises."""


class HookRefused(NicSwitchError):
    """A hook declined on purpose (a checkpoint guard that finds too little free space): the
    switch is refused and the reply is false, as for any failure of the hook, but it is no error
    in the hook's code, so no traceback is logged for it."""


class ConfigError(NicSwitchError, ValueError):
    """A setting is missing or invalid; the message names the setting and the value.

    ``settings`` are the :class:`~nicswitch_agent.config.AgentConfig` fields the error is about,
    so that a value read from the environment can be named by its variable as well.
    """

    def __init__(self, message: str, *, settings: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.settings = settings


class InvalidOrder(NicSwitchError, ValueError):
    """A SwitchRankList that must not be executed; the reply for it is false."""


class AgentStateError(NicSwitchError, RuntimeError):
    """The agent was used out of order (e.g. started twice, or used after stop())."""
