"""The doctor's checks of the job's ranks: how ClusterD's global ranks map to this job's processes
(torchrun's or msrun's variables, a rank table), and the file descriptors the Store's host needs for
them. Each returns ``(ok, detail)`` for :mod:`nicswitch_agent.ops.doctor` to print (ok None: a warning).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from nicswitch_agent.config.frameworks import msrun_scheduler, rank_names, world_names
from nicswitch_agent.coordination import fd_budget

# Each variable that may carry the world size, with its counterpart carrying the rank.
_PAIRS = {"NICSWITCH_WORLD_SIZE": "NICSWITCH_RANK", "WORLD_SIZE": "RANK", "MS_WORKER_NUM": "RANK_ID"}


def rank_map(env: Mapping[str, str]) -> tuple[bool | None, str]:
    """torchrun's RANK/WORLD_SIZE (msrun's RANK_ID/MS_WORKER_NUM), or a rank table, so ClusterD's
    global ranks mean something here. Every value is named by the variable it came from."""
    scheduler = msrun_scheduler(env)
    if scheduler:
        return (None, f"{scheduler}: run the doctor with a worker's environment (MS_ROLE=MS_WORKER)")
    parts: list[str] = []
    (world, world_name), (rank, rank_name) = env_named(env, *world_names(env)), env_named(env, *rank_names(env))
    for label, value in (("world size", world), ("rank", rank)):
        if isinstance(value, str):
            return (False, f"{label}: {value}")
    for names, value, name in ((world_names(env), world, world_name), (rank_names(env), rank, rank_name)):
        other = _contradicted(env, names, value, name)
        if other:  # NICSWITCH_WORLD_SIZE=3 in a job of 2: every pause would wait for a rank 2
            return (False, f"{name}={value} disagrees with {other}: the agent takes {name}, and a switch would "
                           f"wait for ranks that do not exist or leave ranks out; unset {name}")
    ranked = False
    if isinstance(world, int) and world == 1 and rank in (None, 0):
        ranked = True
        parts.append(f"a single process ({world_name}=1)")
    elif isinstance(world, int) and isinstance(rank, int):
        if not 0 <= rank < world:
            return (False, f"{rank_name}={rank} is outside {world_name}={world}")
        ranked = True
        lws = env_int(env, "LOCAL_WORLD_SIZE")
        local = f", {lws} per node: node {rank // lws}, local rank {rank % lws}" if isinstance(lws, int) and lws else ""
        parts.append(f"rank {rank} of {world}{local} (from {rank_name}, {world_name})")
    elif world is not None:
        missing = _PAIRS[world_name]
        fix = ("msrun exports it on one node or with --node_rank; else MindSpore sets it in "
               "mindspore.communication.init(): create the agent after init()" if missing == "RANK_ID"
               else "start training with torchrun, or set both")
        return (False, f"{missing} is not set while {world_name} is: {fix}")
    elif rank is not None:
        missing = next(world for world, paired in _PAIRS.items() if paired == rank_name)
        return (False, f"{missing} is not set while {rank_name} is: start training with "
                       f"{'msrun' if missing == 'MS_WORKER_NUM' else 'torchrun'}, or set both")
    table_path = env.get("RANK_TABLE_FILE", "").strip()
    if table_path:
        try:
            ranks, servers, state = read_rank_table(table_path)
        except (OSError, ValueError) as exc:
            return (False, f"RANK_TABLE_FILE={table_path}: {exc}")
        if state not in ("", "completed"):
            return (False, f"RANK_TABLE_FILE={table_path} has status {state!r}, not 'completed': "
                           "the rank table is not ready yet")
        parts.append(f"rank table with {ranks} rank(s) on {servers} server(s)")
        if isinstance(world, int) and world != ranks:
            return (None, f"{'; '.join(parts)}: {world_name}={world} differs from the rank table's "
                          f"{ranks} ranks, so ClusterD's rank ids may not be this job's ranks")
    if not parts:
        return (False, "neither torchrun's RANK/WORLD_SIZE nor RANK_TABLE_FILE is set (nor msrun's "
                       "RANK_ID/MS_WORKER_NUM with MS_ROLE=MS_WORKER): ClusterD's global rank ids cannot be "
                       "mapped to this job's processes (for a single-process job set WORLD_SIZE=1)")
    if not ranked:
        parts.append("no RANK/WORLD_SIZE: the agent runs as a single rank unless torch.distributed is initialised")
    return (True, "; ".join(parts))


def file_descriptors(env: Mapping[str, str], world_size: int | None) -> tuple[bool | None, str]:
    """The file-descriptor limit the Store's host needs for ``world_size`` ranks (None: from the env)."""
    world = world_size if world_size is not None else env_int(env, *world_names(env))
    launcher = env.get("NICSWITCH_LEADER", "").strip().lower() == "launcher" or bool(
        env.get("NICSWITCH_STORE_ADDRESS", "").strip())
    return fd_budget.assess(world if isinstance(world, int) else None, launcher=launcher)


def env_int(env: Mapping[str, str], *names: str) -> int | str | None:
    """The first set variable as an int >= 0; an error text if it is not one; None if none is set."""
    return env_named(env, *names)[0]


def _contradicted(env: Mapping[str, str], names: tuple[str, ...], value: int | str | None, taken: str) -> str:
    """``"WORLD_SIZE=2"``: a launcher's variable holding another number than ``taken``, the
    agent's own override (``NICSWITCH_*``) read first; "" when they agree, or when no override is
    set (torchrun's names winning over msrun's is a documented order, not a contradiction)."""
    if not isinstance(value, int) or not names or taken != names[0]:
        return ""
    for name in names[1:]:
        raw = env.get(name, "").strip()
        if raw.isascii() and raw.isdigit() and int(raw) != value:
            return f"{name}={int(raw)}"
    return ""


def env_named(env: Mapping[str, str], *names: str) -> tuple[int | str | None, str]:
    """(:func:`env_int`'s value, the name of the variable it came from; "" if none is set)."""
    for name in names:
        raw = env.get(name, "").strip()
        if raw:
            if not (raw.isascii() and raw.isdigit()):
                return f"{name}={raw!r} is not a non-negative integer", name
            return int(raw), name
    return None, ""


def read_rank_table(path: str) -> tuple[int, int, str]:
    """(ranks, servers, status) of an Ascend rank table (``server_list[].device[].rank_id``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    servers = data.get("server_list") if isinstance(data, dict) else None
    if not isinstance(servers, list) or not servers:
        raise ValueError("no server_list: not an Ascend rank table")
    ranks = 0
    for server in servers:
        devices = server.get("device") if isinstance(server, dict) else None
        if not isinstance(devices, list):
            raise ValueError("a server_list entry has no device list")
        ranks += sum(1 for d in devices if isinstance(d, dict) and "rank_id" in d)
    if ranks == 0:
        raise ValueError("no device has a rank_id")
    return ranks, len(servers), str(data.get("status", ""))
