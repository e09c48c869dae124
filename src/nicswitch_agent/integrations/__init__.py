"""Framework integrations: thin adapters that create, start, step and stop a SwitchAgent.

- :mod:`~nicswitch_agent.integrations.loop`: ``enumerate_steps(agent, loader)`` for a plain loop
  (no framework needed);
- :mod:`~nicswitch_agent.integrations.lightning`: ``NicSwitchCallback``, a PyTorch Lightning
  ``Callback``, and ``LightningCheckpointGuard`` (``python3 -m pip install '.[lightning]'`` in the checkout);
- :mod:`~nicswitch_agent.integrations.huggingface`: ``NicSwitchTrainerCallback``, a Hugging Face
  ``TrainerCallback``, and ``HFCheckpointGuard`` (``python3 -m pip install '.[hf]'`` in the checkout);
- :mod:`~nicswitch_agent.integrations.mindspore`: ``NicSwitchMindSporeCallback``, a MindSpore
  ``mindspore.train.Callback`` (``python3 -m pip install '.[mindspore]'`` in the checkout).

All logic stays in :class:`~nicswitch_agent.SwitchAgent`: the adapters only forward step
boundaries and offer a checkpoint guard that saves through the framework. Importing this package
imports no framework; each name below imports its framework on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from nicswitch_agent.integrations.loop import enumerate_steps

_LAZY = {
    "NicSwitchCallback": "nicswitch_agent.integrations.lightning",
    "LightningCheckpointGuard": "nicswitch_agent.integrations.lightning",
    "NicSwitchTrainerCallback": "nicswitch_agent.integrations.huggingface",
    "HFCheckpointGuard": "nicswitch_agent.integrations.huggingface",
    "NicSwitchMindSporeCallback": "nicswitch_agent.integrations.mindspore",
}

# The framework names are left out of __all__, so that ``import *`` never imports a framework.
__all__ = ["enumerate_steps"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
