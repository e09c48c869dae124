"""``nicswitch-agent launch`` around msrun: which framework a launched job runs, and msrun's options.

A MindSpore job coordinates through MindSpore's TCPStore (coordination/ms_store.py), so the
launcher's leader hosts one of those for it instead of torch's (ops/hosted_leader.py). The job is
MindSpore's when ``NICSWITCH_FRAMEWORK`` says so, or, with ``auto`` (the default), when the wrapped
command is msrun (``msrun ...`` or ``python -m mindspore.parallel.cluster.run ...``). From msrun's
options (MindSpore 2.10's, read here without importing MindSpore; msrun's defaults where not given)
the launcher takes the world size (``--worker_num``, default 8), the ranks per node
(``--local_worker_num``, default 8), the node rank (``--node_rank``, -1: not given), and where
the other nodes find the leader's Store (``--master_addr``, and ``--master_port`` + 1; msrun's
scheduler listens on ``--master_port``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from nicswitch_agent.ops.hosted_leader import LaunchError

MSRUN_MODULE = "mindspore.parallel.cluster.run"
# msrun's other options (MindSpore 2.10, mindspore/parallel/cluster/run.py), each with one value.
OTHER_FLAGS = ("--master_addr", "--log_dir", "--join", "--cluster_time_out", "--bind_core", "--bind_numa",
               "--sim_level", "--sim_rank_id", "--rank_table_file", "--worker_log_name", "--tail_worker_log")


@dataclass(frozen=True)
class MsrunOptions:
    """msrun's options the launcher needs, with msrun's defaults."""

    worker_num: int = 8
    local_worker_num: int = 8
    master_addr: str = "127.0.0.1"
    master_port: int = 8118
    node_rank: int | None = None  # msrun's -1: not given

    @property
    def single_node(self) -> bool:
        return self.local_worker_num >= self.worker_num


def _msrun_argv(command: Sequence[str]) -> list[str] | None:
    if not command:
        return None
    if os.path.basename(command[0]) == "msrun":
        return list(command[1:])
    if not os.path.basename(command[0]).startswith("python"):
        return None
    for i, arg in enumerate(command[1:], start=1):
        if arg == "-m" and i + 1 < len(command):
            return list(command[i + 2:]) if command[i + 1] == MSRUN_MODULE else None
        if not arg.startswith("-"):
            return None
    return None


def parse_msrun(command: Sequence[str]) -> MsrunOptions | None:
    """msrun's options of ``command``, or None if it is not msrun.

    Raises:
        LaunchError: it is msrun but its options cannot be read.
    """
    argv = _msrun_argv(command)
    if argv is None:
        return None
    parser = argparse.ArgumentParser(prog="msrun", add_help=False)  # as msrun's: abbreviations too
    for flag in ("--worker_num", "--local_worker_num", "--master_port", "--node_rank"):
        parser.add_argument(flag, type=int)
    for flag in OTHER_FLAGS:  # each takes one value: read past it to the script
        parser.add_argument(flag)
    parser.add_argument("task_script")
    parser.add_argument("task_script_args", nargs=argparse.REMAINDER)

    def fail(message: str) -> NoReturn:
        raise LaunchError(f"cannot read the msrun options of the command ({message}); pass --world-size N")

    parser.error = fail  # type: ignore[method-assign]
    ns = parser.parse_args(argv)
    given = {k: getattr(ns, k) for k in ("worker_num", "local_worker_num", "master_addr", "master_port", "node_rank")
             if getattr(ns, k) is not None}
    if given.get("node_rank", -1) < 0:
        given.pop("node_rank", None)
    options = MsrunOptions(**given)
    if options.worker_num < 1 or options.local_worker_num < 1:
        raise LaunchError(f"msrun --worker_num={options.worker_num} --local_worker_num={options.local_worker_num}: "
                          "both must be at least 1")
    return options


def launch_framework(command: Sequence[str], environ: Mapping[str, str]) -> str:
    """``torch`` or ``mindspore``: NICSWITCH_FRAMEWORK, else (``auto``) MindSpore for an msrun command."""
    setting = environ.get("NICSWITCH_FRAMEWORK", "").strip().lower()
    if setting in ("torch", "mindspore"):
        return setting
    return "mindspore" if _msrun_argv(command) is not None else "torch"
