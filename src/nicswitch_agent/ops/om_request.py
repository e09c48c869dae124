"""What an operator asks ClusterD for: parse ``--node/--dev/--op``, validate, build ``SwitchNics``.

The CLI's input parsing lives with the validation that every request passes, so that the two are
tested together. Nothing here talks to ClusterD (:mod:`nicswitch_agent.ops.om` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nicswitch_agent._pb import recover_pb2 as pb

_STANDBY_WORDS = frozenset({"standby", "backup", "true"})
_PRIMARY_WORDS = frozenset({"primary", "false"})

NicOps = Mapping[str, tuple[Sequence[str], Sequence[bool]]]
"""node name -> (device ids, ops); ``True`` = standby (backup) NIC, ``False`` = primary."""


def parse_op(word: str) -> bool:
    """``standby``/``backup``/``true`` -> True, ``primary``/``false`` -> False (any case).

    Raises:
        ValueError: naming ``--op`` and the bad value.
    """
    token = word.strip().lower()
    if token in _STANDBY_WORDS:
        return True
    if token in _PRIMARY_WORDS:
        return False
    raise ValueError(f"--op: unknown value {word!r} (use standby, backup, true, primary or false)")


def _split(flag: str, text: str) -> list[str]:
    items = [part.strip() for part in text.split(",")]
    if not text.strip():
        raise ValueError(f"{flag}: empty value")
    if any(not item for item in items):
        raise ValueError(f"{flag}: empty item in {text!r}")
    bad = [item for item in items if any(ch.isspace() for ch in item)]
    if bad:
        raise ValueError(f"{flag}: {bad[0]!r} contains whitespace")
    return items


def parse_nic_ops(node: str, devs: str, ops: str) -> dict[str, tuple[list[str], list[bool]]]:
    """Parse one ``--node N --dev 0,1 --op standby,primary`` group.

    A single op applies to every device. Devices are ClusterD's rank-table ``device_id`` strings
    and are passed through as given (ClusterD checks that they exist on the node).

    Raises:
        ValueError: naming the flag and the bad value.
    """
    name = node.strip()
    if not name:
        raise ValueError("--node: empty value")
    if any(ch.isspace() for ch in name):
        raise ValueError(f"--node: {node!r} contains whitespace")
    dev_list = _split("--dev", devs)
    op_list = [parse_op(word) for word in _split("--op", ops)]
    if len(op_list) == 1:
        op_list = op_list * len(dev_list)
    elif len(op_list) != len(dev_list):
        raise ValueError(
            f"--op: {len(op_list)} values {ops!r} for {len(dev_list)} devices {devs!r} "
            "(give one op for all devices, or one per device)"
        )
    seen: set[str] = set()
    for dev in dev_list:
        if dev in seen:
            raise ValueError(f"--dev: device {dev!r} repeated for node {name!r}")
        seen.add(dev)
    return {name: (dev_list, op_list)}


def parse_nic_groups(
    groups: Iterable[tuple[str, str, str]],
) -> dict[str, tuple[list[str], list[bool]]]:
    """Parse several ``(node, devs, ops)`` groups and merge groups naming the same node.

    ``SwitchNics.nicOps`` holds one device list per node, so a node given twice is merged; a device
    given twice for the same node is an error rather than a silent override.

    Raises:
        ValueError: naming the flag and the bad value; or if there are no groups.
    """
    merged: dict[str, tuple[list[str], list[bool]]] = {}
    for node, devs, ops in groups:
        for name, (dev_list, op_list) in parse_nic_ops(node, devs, ops).items():
            have_devs, have_ops = merged.setdefault(name, ([], []))
            for dev, op in zip(dev_list, op_list, strict=True):
                if dev in have_devs:
                    raise ValueError(f"--dev: device {dev!r} repeated for node {name!r}")
                have_devs.append(dev)
                have_ops.append(op)
    if not merged:
        raise ValueError("--node: at least one --node/--dev/--op group is required")
    return merged


def validate_nic_ops(nic_ops: NicOps) -> None:
    """Reject what ClusterD would accept but mishandle, before anything is sent.

    ClusterD does not check for an empty map (the job is paused and then stalls) nor for repeated
    devices (duplicate rank ids reach the job), so we do (docs/clusterd.md#switchnictrack-validation).

    Raises:
        ValueError: with the node and the problem.
    """
    if not nic_ops:
        raise ValueError("nic_ops: no node given (ClusterD would pause the job and then stall)")
    for node, (devs, ops) in nic_ops.items():
        if not node or not node.strip():
            raise ValueError("nic_ops: empty node name")
        if not devs or not ops:
            raise ValueError(f"nic_ops[{node!r}]: dev or op is empty")
        if len(devs) != len(ops):
            raise ValueError(f"nic_ops[{node!r}]: {len(devs)} devices but {len(ops)} ops")
        if any(not isinstance(dev, str) or not dev.strip() for dev in devs):
            raise ValueError(f"nic_ops[{node!r}]: devices must be non-empty strings, got {list(devs)!r}")
        if any(not isinstance(op, bool) for op in ops):
            raise ValueError(f"nic_ops[{node!r}]: ops must be bools, got {list(ops)!r}")
        if len(set(devs)) != len(devs):
            raise ValueError(f"nic_ops[{node!r}]: repeated device in {list(devs)!r}")


def build_switch_request(job_id: str, nic_ops: NicOps) -> Any:
    """Validate and build the ``SwitchNics`` message (``jobID``, capital D, on this message)."""
    if not job_id or not job_id.strip():
        raise ValueError("job_id: empty")
    validate_nic_ops(nic_ops)
    request = pb.SwitchNics(jobID=job_id)
    for node, (devs, ops) in nic_ops.items():
        entry = request.nicOps[node]
        entry.dev.extend(devs)
        entry.op.extend(ops)
    return request


def op_name(op: bool) -> str:
    """The word an operator reads: standby (``op=true``) or primary."""
    return "standby" if op else "primary"


def describe_nic_ops(nic_ops: NicOps) -> str:
    """``node-1: dev 0 -> standby, dev 1 -> primary; node-2: ...`` for logs and the CLI."""
    parts = []
    for node, (devs, ops) in nic_ops.items():
        pairs = ", ".join(f"dev {dev} -> {op_name(op)}" for dev, op in zip(devs, ops, strict=False))
        parts.append(f"{node}: {pairs}")
    return "; ".join(parts)


__all__ = [
    "NicOps",
    "build_switch_request",
    "describe_nic_ops",
    "op_name",
    "parse_nic_groups",
    "parse_nic_ops",
    "parse_op",
    "validate_nic_ops",
]
