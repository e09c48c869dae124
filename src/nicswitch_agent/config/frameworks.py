"""Which framework a job runs (torch or MindSpore), and where its launcher puts rank and world size.

torchrun exports RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; msrun exports MS_WORKER_NUM (the world
size) and RANK_ID (the global rank, when msrun assigns it: one node, or ``--node_rank`` given) to
each worker, with MS_ROLE=MS_WORKER (its scheduler process runs the same script with
MS_ROLE=MS_SCHED and RANK_ID=0, and is no rank: :func:`msrun_scheduler`). msrun exports no
per-node count: set LOCAL_WORLD_SIZE (or NICSWITCH_LOCAL_WORLD_SIZE) for node-local fan-out.
torchrun's names win when both are set.
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
    """Whether msrun's names count: an msrun worker, or a job said to be MindSpore's (never in msrun's
    scheduler process, whose RANK_ID=0 is not a rank)."""
    setting = framework if framework is not None else env.get("NICSWITCH_FRAMEWORK", "")
    role = env.get("MS_ROLE")
    return role == "MS_WORKER" or (role != "MS_SCHED" and str(setting).strip().lower() == "mindspore")


def msrun_scheduler(env: Mapping[str, str]) -> str:
    """Why this process is no rank of the job, when it is msrun's scheduler; "" for any other process.

    msrun (MindSpore 2.10, ``mindspore/parallel/cluster/process_entity/_api.py``) starts the
    scheduler before the workers, running the same command line, with MS_ROLE=MS_SCHED,
    RANK_ID=0 ("For Scheduler, 'RANK_ID' is always 0"), MS_WORKER_NUM and no DEVICE_ID. Its
    ``mindspore.communication.init()`` never returns (it serves the cluster, then the process
    exits when the workers are done: seen here with msrun on CPU), and its
    ``mint.distributed.TCPStore(...)`` returns an object with no connection ("TCPStore is not
    supported for scheduler process"). A script that starts the agent before ``init()``, or
    without it, gets there: taking RANK_ID=0 would make it a second rank 0 and a second leader.
    """
    if env.get("MS_ROLE") != "MS_SCHED":
        return ""
    return ("msrun's scheduler process (MS_ROLE=MS_SCHED): it runs the training script too but is no rank "
            "of the job (its RANK_ID=0 is not a rank), so the agent starts nothing here")


def world_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables that may carry the world size, in order."""
    return ("NICSWITCH_WORLD_SIZE", "WORLD_SIZE") + (("MS_WORKER_NUM",) if in_msrun(env) else ())


def rank_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables that may carry this process's global rank, in order."""
    return ("NICSWITCH_RANK", "RANK") + (("RANK_ID",) if in_msrun(env) else ())
