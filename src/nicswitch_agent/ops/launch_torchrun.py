"""``nicswitch-agent launch`` around torchrun: the options of the wrapped torchrun command.

The launcher needs how many ranks the command starts (``--nproc-per-node`` x ``--nnodes``, as
torchrun computes them), which node this is (``--node-rank``), and where the other nodes find the
leader's Store (``--master-addr``, ``--master-port``, ``--rdzv-endpoint``). They are read with
torchrun's own parser, its ``PET_*`` environment defaults included; torch is imported only here,
and only for a command that runs torchrun (``torchrun ...``, ``python -m torch.distributed.run``
or ``.launch``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nicswitch_agent.ops.hosted_leader import LaunchError

__all__ = ["TorchrunOptions", "non_negative_int", "parse_torchrun"]


@dataclass(frozen=True)
class TorchrunOptions:
    """The torchrun options of a wrapped command that the launcher needs (None: not given)."""

    nproc_per_node: str
    nnodes: str
    standalone: bool
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    rdzv_endpoint: str

    def node_range(self) -> tuple[int, int]:
        """(min, max) nodes, as torchrun reads ``--nnodes``."""
        from torch.distributed.run import parse_min_max_nnodes

        try:
            low, high = parse_min_max_nnodes(self.nnodes)
        except (ValueError, RuntimeError) as exc:
            raise LaunchError(f"torchrun --nnodes={self.nnodes!r} is not N or MIN:MAX") from exc
        return int(low), int(high)

    def single_node(self) -> bool:
        return self.standalone or self.node_range()[1] == 1

    def local_world_size(self) -> int | None:
        """nproc_per_node as torchrun resolves it (the LOCAL_WORLD_SIZE of its workers); None if unknown."""
        from torch.distributed.run import determine_local_world_size

        try:
            return int(determine_local_world_size(self.nproc_per_node))
        except ValueError:
            return None

    def world_size(self) -> int:
        """nproc_per_node x nnodes, exactly as torchrun computes them; LaunchError if not fixed."""
        from torch.distributed.run import determine_local_world_size

        low, high = self.node_range()
        if low != high:
            raise LaunchError(
                f"torchrun --nnodes={self.nnodes} is elastic, so the number of training ranks is not fixed; "
                "pass --world-size N (the ranks the leader waits for)"
            )
        try:
            per_node = int(determine_local_world_size(self.nproc_per_node))
        except ValueError as exc:
            raise LaunchError(
                f"cannot tell how many processes torchrun --nproc-per-node={self.nproc_per_node} starts "
                f"({exc}); pass --world-size N"
            ) from exc
        return per_node * high

    def rdzv_host_port(self) -> tuple[str | None, int | None]:
        host, sep, port = self.rdzv_endpoint.rpartition(":")
        if not sep:
            return (self.rdzv_endpoint or None), None
        return (host.strip("[]") or None), (int(port) if port.isdigit() else None)


def _torchrun_argv(command: Sequence[str]) -> tuple[list[str], bool] | None:
    """(the torchrun options and script, is torch.distributed.launch) when ``command`` runs torchrun."""
    if not command:
        return None
    if os.path.basename(command[0]) == "torchrun":
        return list(command[1:]), False
    if not os.path.basename(command[0]).startswith("python"):
        return None
    for i, arg in enumerate(command[1:], start=1):
        module = None
        if arg == "-m" and i + 1 < len(command):
            module, rest = command[i + 1], command[i + 2:]
        elif arg.startswith("-m") and len(arg) > 2:
            module, rest = arg[2:], command[i + 1:]
        if module in ("torch.distributed.run", "torch.distributed.launch"):
            return list(rest), module == "torch.distributed.launch"
        if module is not None or not arg.startswith("-"):
            return None  # another module, or a script: not torchrun
    return None


def parse_torchrun(command: Sequence[str], environ: Mapping[str, str]) -> TorchrunOptions | None:
    """The torchrun options of ``command`` (read with torchrun's own parser), or None if it is not torchrun.

    Raises:
        LaunchError: it is torchrun but its options cannot be read.
    """
    found = _torchrun_argv(command)
    if found is None:
        return None
    argv, is_launch = found
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    if is_launch:  # torch.distributed.launch = torchrun's options + --use-env
        parser.add_argument("--use-env", "--use_env", action="store_true")

    def fail(message: str) -> Any:
        raise LaunchError(f"cannot read the torchrun options of the command ({message}); pass --world-size N")

    parser.error = fail  # type: ignore[method-assign]
    # torchrun defaults these from PET_* env; read them from `environ` and tell "not given" apart.
    parser.set_defaults(
        nnodes=environ.get("PET_NNODES", "1:1"),
        nproc_per_node=environ.get("PET_NPROC_PER_NODE", "1"),
        node_rank=environ.get("PET_NODE_RANK"),
        master_addr=environ.get("PET_MASTER_ADDR"),
        master_port=environ.get("PET_MASTER_PORT"),
        rdzv_endpoint=environ.get("PET_RDZV_ENDPOINT", ""),
        standalone=environ.get("PET_STANDALONE", "").strip().lower() in ("1", "true"),
    )
    ns = parser.parse_args(argv)
    return TorchrunOptions(
        nproc_per_node=str(ns.nproc_per_node),
        nnodes=str(ns.nnodes),
        standalone=bool(ns.standalone),
        node_rank=None if ns.node_rank is None else non_negative_int("torchrun --node-rank", ns.node_rank),
        master_addr=ns.master_addr or None,
        master_port=None if ns.master_port is None else non_negative_int("torchrun --master-port", ns.master_port),
        rdzv_endpoint=str(ns.rdzv_endpoint or ""),
    )


def non_negative_int(what: str, value: object) -> int:
    """``value`` (a flag's or a variable's, named by ``what``) as an int >= 0, else LaunchError."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise LaunchError(f"{what}={value!r} is not an integer") from None
    if number < 0:
        raise LaunchError(f"{what}={value!r} must not be negative")
    return number
