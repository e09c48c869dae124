"""``nicswitch-agent demo``: a job on an embedded ClusterD simulator, ranks as threads or processes,
one failover and back (run.py), or against a ClusterD of yours (``--server``).

``run_demo`` and ``run_job`` are imported on first use (PEP 562): the command line imports
:mod:`nicswitch_agent.demo.quiet` before anything imports grpc, and run.py imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nicswitch_agent.demo.run import run_demo, run_job

__all__ = ["run_demo", "run_job"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("nicswitch_agent.demo.run"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
