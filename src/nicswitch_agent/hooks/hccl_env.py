"""What HCCL's environment says about a link switch, before any switch runs.

Three variables decide what ``torch_npu.npu._comm_switch_nic`` can do, and all three are read
once by HCCL or torch_npu when the process starts, so a wrong value can only be fixed by a
restart. The agent judges them at ``start()`` (:class:`~nicswitch_agent.TorchNpuSwitcher`) and
``nicswitch-agent doctor`` judges them from the pod's environment, with the same words:

- ``HCCL_OP_RETRY_ENABLE``: the backup link exists only with HCCL's L2 op retry on
  (``"L0:0, L1:1, L2:1"``). Without it HCCL answers a switch with success and moves nothing.
- ``P2P_HCCL_BUFFSIZE`` (MB, default 20): when it is not 0, torch_npu (7.1.0 and later) runs each
  point-to-point send/recv pair on a two-rank communicator of its own, which a switch does not
  visit; pipeline-parallel traffic then stays where it was. ``0`` puts send/recv back on the
  group's own communicator, which the switch does move.
- ``HCCL_CONNECT_TIMEOUT`` (s): each communicator's switch may block up to 2.5 times this,
  groups one after another. That can outlast the agent's ``switch_timeout_s`` (the reply is then
  false while HCCL goes on, and a parked training thread waits for it) and ClusterD's 15-minute
  wait for the reply.

Pure functions of an environment mapping: no torch import, so the doctor can use them anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from nicswitch_agent.config import CLUSTERD_REPORT_TIMEOUT_S

L2_RETRY_VALUE = "L0:0, L1:1, L2:1"
P2P_DEFAULT_MB = 20  # torch_npu's default when P2P_HCCL_BUFFSIZE is unset
CONNECT_TIMEOUT_DEFAULT_S = 300.0  # assumed when HCCL_CONNECT_TIMEOUT is unset (see docs/architecture.md)
CONNECT_TIMEOUT_MIN_S = 120.0  # the smallest value CANN documents for it
SWITCH_BLOCK_FACTOR = 2.5  # HCCL polls a communicator's switch for up to 2.5 x HCCL_CONNECT_TIMEOUT

_LEADING_INT = re.compile(r"^\s*([+-]?\d+)")


def hccl_retry_enables_l2(value: str | None) -> bool:
    """True when ``HCCL_OP_RETRY_ENABLE`` (e.g. ``"L0:0, L1:1, L2:1"``) enables level L2.

    Without L2 retry, HCCL's ``HcclCommWorkingDevNicSet`` returns success and does nothing.
    """
    if not value:
        return False
    for part in value.split(","):
        level, _, flag = part.strip().partition(":")
        if level.strip().upper() == "L2":
            return flag.strip() == "1"
    return False


def _strtol(raw: str) -> int:
    """C's ``strtol(raw, NULL, 10)``, as torch_npu and HCCL read these variables: leading digits, else 0."""
    match = _LEADING_INT.match(raw)
    return int(match.group(1)) if match else 0


@dataclass(frozen=True)
class Finding:
    """One fact about this environment: whether it is fine (``ok``) and the sentence saying so."""

    ok: bool
    text: str


def _shown(env: Mapping[str, str], name: str, unset: str = "unset") -> str:
    return f"{name} {unset}" if env.get(name) is None else f"{name}={env[name]!r}"


def retry_finding(env: Mapping[str, str]) -> Finding:
    """Is HCCL's L2 op retry on (the backup link enabled)?"""
    shown = _shown(env, "HCCL_OP_RETRY_ENABLE")
    if hccl_retry_enables_l2(env.get("HCCL_OP_RETRY_ENABLE")):
        return Finding(True, f"{shown} enables L2: the backup link exists")
    return Finding(False, f"{shown} does not enable L2: HCCL accepts link switches but does nothing "
                          f"(set HCCL_OP_RETRY_ENABLE=\"{L2_RETRY_VALUE}\" before training starts)")


def p2p_buffsize_mb(env: Mapping[str, str]) -> int:
    """``P2P_HCCL_BUFFSIZE`` as torch_npu reads it: unset is 20, a non-number is 0 (``strtol``)."""
    raw = env.get("P2P_HCCL_BUFFSIZE")
    return P2P_DEFAULT_MB if raw is None else _strtol(raw)


def p2p_finding(env: Mapping[str, str]) -> Finding:
    """Are point-to-point send/recv on communicators that a switch moves?"""
    size = p2p_buffsize_mb(env)
    shown = _shown(env, "P2P_HCCL_BUFFSIZE", f"unset ({P2P_DEFAULT_MB} MB)")
    if size < 0:
        return Finding(False, f"{shown} is negative: torch_npu refuses it at the first "
                              "send/recv; set P2P_HCCL_BUFFSIZE=0")
    if size == 0:
        return Finding(True, f"{shown}: send/recv run on each group's own communicator, "
                             "which a switch moves")
    return Finding(False, f"{shown}: send/recv (pipeline parallelism) run on two-rank "
                          "communicators a switch does not visit, so their traffic stays on the old NIC; "
                          "set P2P_HCCL_BUFFSIZE=0 before training starts to put them on the group's "
                          "communicator, which is switched")


def connect_timeout_s(env: Mapping[str, str]) -> tuple[float, str]:
    """``HCCL_CONNECT_TIMEOUT`` in seconds, and where it came from (unset or 0: the default we assume)."""
    raw = env.get("HCCL_CONNECT_TIMEOUT")
    value = _strtol(raw) if raw is not None else 0
    if value <= 0:
        return CONNECT_TIMEOUT_DEFAULT_S, "HCCL_CONNECT_TIMEOUT unset" if raw is None else (
            f"HCCL_CONNECT_TIMEOUT={raw!r}, read as 0: the default")
    return float(value), f"HCCL_CONNECT_TIMEOUT={value}"


def blocking_finding(env: Mapping[str, str], groups: int | None, switch_timeout_s: float | None) -> Finding:
    """The longest a switch can block (2.5 x HCCL_CONNECT_TIMEOUT per group) against the waits above it.

    Args:
        env: The environment HCCL reads.
        groups: Process groups with a communicator on this device; None when not knowable here
            (the doctor): the figure is then per group.
        switch_timeout_s: The agent's budget for the switch hook; None when not known.
    """
    timeout, read = connect_timeout_s(env)
    per_group = SWITCH_BLOCK_FACTOR * timeout
    count = max(groups or 0, 1)
    worst = per_group * count
    times = f"{count} group(s) x " if groups is not None else "per process group: "
    figure = f"worst case {times}{SWITCH_BLOCK_FACTOR:g} x {timeout:g} s ({read}) = {worst:g} s"
    problems = []
    if switch_timeout_s is not None and worst > switch_timeout_s:
        problems.append(f"above switch_timeout_s={switch_timeout_s:g} s (the reply is false at that point while "
                        "HCCL goes on, and a parked training thread waits until HCCL returns)")
    if worst > CLUSTERD_REPORT_TIMEOUT_S:
        problems.append(f"above ClusterD's {CLUSTERD_REPORT_TIMEOUT_S:g} s wait for the reply")
    if not problems:
        within = f"switch_timeout_s={switch_timeout_s:g} s and " if switch_timeout_s is not None else ""
        return Finding(True, f"{figure}, within {within}ClusterD's {CLUSTERD_REPORT_TIMEOUT_S:g} s")
    per = "" if groups is not None else " (times the number of process groups the agent logs at start)"
    return Finding(False, f"{figure}{per}: {'; '.join(problems)}; fix: {_fix(count, worst, switch_timeout_s)}")


def _fix(groups: int, worst: float, switch_timeout_s: float | None) -> str:
    """What brings the worst case within both waits: a shorter HCCL_CONNECT_TIMEOUT, a longer
    switch_timeout_s, or fewer groups (CANN accepts HCCL_CONNECT_TIMEOUT from 120 s)."""
    per_second = SWITCH_BLOCK_FACTOR * groups  # seconds of worst case per second of HCCL_CONNECT_TIMEOUT
    budget = f"guard_timeout_s + switch_timeout_s + reply_timeout_s must stay below {CLUSTERD_REPORT_TIMEOUT_S:g} s"
    if worst > CLUSTERD_REPORT_TIMEOUT_S:
        fitting = float(int(CLUSTERD_REPORT_TIMEOUT_S / per_second))
        if fitting < CONNECT_TIMEOUT_MIN_S:
            return (f"create fewer NPU process groups: even HCCL_CONNECT_TIMEOUT={CONNECT_TIMEOUT_MIN_S:g} "
                    f"(CANN's minimum) gives {per_second * CONNECT_TIMEOUT_MIN_S:g} s")
        fix = f"lower HCCL_CONNECT_TIMEOUT to {fitting:g} s (it also bounds connection set-up at start)"
        if switch_timeout_s is not None and per_second * fitting > switch_timeout_s:
            fix += f" and {_raise_switch_timeout(per_second * fitting, budget)}"
        return fix
    fixes = [_raise_switch_timeout(worst, budget)]
    fitting = float(int((switch_timeout_s or worst) / per_second))
    if fitting >= CONNECT_TIMEOUT_MIN_S:
        fixes.append(f"lower HCCL_CONNECT_TIMEOUT to {fitting:g} s (it also bounds connection set-up at start)")
    return ", or ".join(fixes)


def _raise_switch_timeout(needed: float, budget: str) -> str:
    if needed < CLUSTERD_REPORT_TIMEOUT_S:
        # The other two must make room: the configuration refuses the sum otherwise.
        return (f"raise switch_timeout_s to {needed:g} s with guard_timeout_s + reply_timeout_s below "
                f"{CLUSTERD_REPORT_TIMEOUT_S - needed:g} s ({budget})")
    return (f"accept that no switch_timeout_s covers {needed:g} s ({budget}): a stuck switch is answered false "
            "at switch_timeout_s while HCCL goes on")
