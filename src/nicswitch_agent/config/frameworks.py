"""Which framework a job runs (torch or MindSpore), and where its launcher puts rank and world size.

torchrun exports RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; msrun exports MS_WORKER_NUM (the world
size) and RANK_ID (the global rank, when msrun assigns it: one node, or ``--node_rank`` given) to
each worker, with MS_ROLE=MS_WORKER (its scheduler process runs the same script with
MS_ROLE=MS_SCHED). msrun exports no per-node count: set LOCAL_WORLD_SIZE (or
NICSWITCH_LOCAL_WORLD_SIZE) for node-local fan-out. torchrun's names win when both are set.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

FRAMEWORKS = ("auto", "torch", "mindspore")
MSRUN_NAMES = (("world_size", "MS_WORKER_NUM"), ("rank", "RANK_ID"))


def job_framework(setting: str) -> str:
    """``torch`` or ``mindspore`` for the setting ``framework``; ``auto``: MindSpore when it is
    imported and torch is not."""
    if setting != "auto":
        return setting
    return "mindspore" if "mindspore" in sys.modules and "torch" not in sys.modules else "torch"


def in_msrun(env: Mapping[str, str], framework: object = None) -> bool:
    """Whether msrun's names count: an msrun worker, or a job said to be MindSpore's."""
    setting = framework if framework is not None else env.get("NICSWITCH_FRAMEWORK", "")
    return env.get("MS_ROLE") == "MS_WORKER" or str(setting).strip().lower() == "mindspore"


def world_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables that may carry the world size, in order."""
    return ("NICSWITCH_WORLD_SIZE", "WORLD_SIZE") + (("MS_WORKER_NUM",) if in_msrun(env) else ())


def rank_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables that may carry this process's global rank, in order."""
    return ("NICSWITCH_RANK", "RANK") + (("RANK_ID",) if in_msrun(env) else ())
