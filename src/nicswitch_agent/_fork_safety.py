"""Make gRPC safe for the forks a training process does (DataLoader workers), before grpc loads.

grpcio's core registers fork handlers by default while its Python layer does not (grpcio 1.85;
grpc/grpc PRs #41455, #41769 and issue #41768 track this mixed state and its reverts). A process
whose gRPC threads are busy (the leader's streams, replies and reconnects) then loses forked
children: a 2-worker ``fork`` DataLoader beside a switching leader had a worker die (SIGSEGV) within
a few epochs in every run (tests/test_fork.py; docs/operations.md has the numbers).
``GRPC_ENABLE_FORK_SUPPORT=false`` turns the handlers off; the children never use gRPC, so nothing
is lost. grpc reads the variable once, when it is
first imported, so this module runs from the package's ``__init__``, before any of our modules
imports grpc, and never overrides a value the user set.
"""

from __future__ import annotations

import logging
import os
import sys

GRPC_FORK_ENV = "GRPC_ENABLE_FORK_SUPPORT"
# What grpc core reads as false (absl's SimpleAtob, any case). Anything else, "off" included,
# leaves its default on.
_FALSE_VALUES = frozenset({"false", "f", "no", "n", "0"})

logger = logging.getLogger("nicswitch_agent")

USER_VALUE: str | None = os.environ.get(GRPC_FORK_ENV)
"""The variable as the user left it before nicswitch_agent was imported (None: unset)."""
GRPC_IMPORTED_FIRST: bool = "grpc" in sys.modules
"""grpc was loaded before nicswitch_agent: too late to choose its fork handling for it."""

if USER_VALUE is None and not GRPC_IMPORTED_FIRST:
    os.environ[GRPC_FORK_ENV] = "false"  # inherited by child processes too, which is as safe

_warned = False


def fork_safety_problem() -> str | None:
    """Why forked children of this process are at risk from gRPC's fork handlers; None: safe."""
    if USER_VALUE is not None:
        if USER_VALUE.lower() in _FALSE_VALUES:
            return None
        return (f"{GRPC_FORK_ENV}={USER_VALUE!r} was set, which leaves gRPC's fork handlers on: forked "
                f"DataLoader workers may die or hang beside the agent's streams. Set {GRPC_FORK_ENV}=false, or use "
                "multiprocessing_context='spawn' (docs/operations.md, Fork and DataLoader workers)")
    if GRPC_IMPORTED_FIRST:
        return (f"grpc was imported before nicswitch_agent with {GRPC_FORK_ENV} unset, so gRPC's fork handlers "
                "are on: forked DataLoader workers may die or hang beside the agent's streams. Set "
                f"{GRPC_FORK_ENV}=false in the environment, or import nicswitch_agent before anything that "
                "imports grpc (docs/operations.md, Fork and DataLoader workers)")
    return None


def warn_if_unsafe() -> None:
    """Log the problem, if any, as one WARNING per process (called when the leader loads gRPC)."""
    global _warned
    problem = fork_safety_problem()
    if problem is not None and not _warned:
        _warned = True
        logger.warning("%s", problem)
