"""TorchLinkProbe: the verify hook for torch jobs: proves that the switched links carry traffic.

A switch hook's True says only that the call returned: torch_npu's ``_comm_switch_nic`` returns
True when nothing moved (no communicator on the device yet, the backup link not enabled, the HCCL
symbol missing), and a switch onto a dead link is found by the next collective, which hangs until
the watchdog kills the job. This probe finds it while ClusterD still waits for the reply.

Only links that already exist are switched: an op of a new type, dtype or shape issued after the
switch builds its link on the default NIC and would prove nothing. So the probe runs its op (a
one-element float32 ``all_reduce`` of ones) once per group BEFORE the first switch
(:meth:`warm_up`, or :meth:`prepare`, which the agent calls right before the switch hook), and
after every switch replays exactly that op on each group: it must sum to the group's size within
``timeout_s``. Each group's latency before and after is kept in :attr:`last`.

Every rank's probe takes part in the same collectives, in the same order, from the parked training
thread (pause mode ``agent``): the agent refuses it in pause mode ``external``, where it would run
beside the training thread's own collectives (``runs_collectives``). Its waits are bounded: a
collective that does not complete within ``timeout_s`` makes the probe raise, and the rank's
verification fails; the op is then still pending in the backend, and the message says so (the
communicator may be unusable). ``timeout_s`` must be below the agent's ``verify_timeout_s``.

torch is imported lazily: importing this module does not import torch.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nicswitch_agent.errors import ConfigError, NicSwitchError
from nicswitch_agent.orders import SwitchOrder

logger = logging.getLogger("nicswitch_agent.hooks")

DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


class ProbeFailed(NicSwitchError):
    """A probe collective failed, gave a wrong sum, or did not complete in time."""


@dataclass(frozen=True)
class GroupProbe:
    """One group's probe around one switch."""

    group: str
    size: int
    ok: bool
    before_s: float | None  # the warm-up's latency (the op before any switch); None if it never ran
    after_s: float | None  # the replay's latency after this switch; None if it did not complete
    detail: str


@dataclass(frozen=True)
class ProbeReport:
    """What the probe found after one switch (``seq``: the order's)."""

    seq: int
    ok: bool
    groups: tuple[GroupProbe, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "ok": self.ok, "groups": [asdict(g) for g in self.groups]}


class TorchLinkProbe:
    """Verify hook: replay a small collective that already ran before the switch, on each group.

    Args:
        groups: the process groups whose links the switch moves; None: the default group. Every
            rank must pass the same groups in the same order, and be a member of each.
        names: how messages name the groups (default: ``default`` for the default group, else
            ``group <i>``).
        timeout_s: how long all of one probe's collectives may take together (> 0); keep it below
            the agent's ``verify_timeout_s`` (start() checks).
        device: where the probe tensor lives; None: from the group's backend (gloo: cpu, nccl:
            cuda, hccl: npu, the current device).

    Raises:
        ConfigError: naming the argument, when one is invalid.
    """

    runs_collectives = True

    def __init__(self, groups: Sequence[Any] | None = None, *, names: Sequence[str] | None = None,
                 timeout_s: float = 10.0, device: Any = None) -> None:
        if groups is not None and (isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence)
                                   or not groups):
            raise ConfigError(f"groups={groups!r} must be a non-empty list of process groups, or None")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self._groups: list[Any] = [None] if groups is None else list(groups)
        if names is None:
            names = ["default"] if groups is None else [f"group {i}" for i in range(len(self._groups))]
        if isinstance(names, str) or len(names) != len(self._groups):
            raise ConfigError(f"names={names!r} must name each of the {len(self._groups)} group(s)")
        self.names = list(names)
        self.timeout_s = float(timeout_s)
        self._device = device
        self._lock = threading.Lock()  # guards _sizes, _before, _last (status threads read them)
        self._sizes: dict[int, int] = {}  # group index -> its size, once warmed up
        self._before: dict[int, float] = {}  # group index -> the warm-up's latency
        self._last: ProbeReport | None = None

    # -- the agent's protocol ------------------------------------------------------------------

    @property
    def last(self) -> ProbeReport | None:
        """The report of the last verification, or None before the first."""
        with self._lock:
            return self._last

    def check(self) -> None:
        """At start: torch.distributed must be initialised (the probe's groups exist by then)."""
        try:
            dist = importlib.import_module("torch.distributed")
        except ImportError as exc:
            raise ConfigError("TorchLinkProbe needs torch (python3 -m pip install '.[torch]' in the "
                              f"nicswitch-agent checkout): {exc}") from exc
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("TorchLinkProbe needs torch.distributed initialised before agent.start() "
                              "(call init_process_group first): it probes the job's process groups")

    def warm_up(self) -> None:
        """Run the probe op once on every group that has not run it (every rank, the same point of
        the training loop, e.g. right after ``agent.start()``). Called again it does nothing.

        Raises:
            ProbeFailed: a group's op failed or did not complete within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        for index in range(len(self._groups)):
            with self._lock:
                if index in self._sizes:
                    continue
            size = self._size(index)
            latency, detail = self._run(index, size, deadline)
            if latency is None:
                raise ProbeFailed(f"warm-up before the switch: {detail}")
            with self._lock:
                self._sizes[index], self._before[index] = size, latency
            logger.info("rank %s: link probe: group %s (%d ranks) warmed up in %.2f ms", _global_rank(),
                        self.names[index], size, latency * 1000)

    def prepare(self, order: SwitchOrder) -> bool:
        """Called by the agent right before the switch hook, on the same thread: warm up the groups
        that never ran the probe op, so that it exists when the switch moves the links."""
        self.warm_up()
        return True

    def communicators_unusable(self) -> bool:
        """After a failed check: a group's op failed or is still pending, so training's next
        collective on it may hang or fail (a wrong sum or a group never warmed up is not that)."""
        report = self.last
        return report is not None and not report.ok and any(
            not g.ok and g.before_s is not None and "summed to" not in g.detail for g in report.groups)

    def __call__(self, order: SwitchOrder) -> bool:
        """Replay the probe op on each group; raise :class:`ProbeFailed` naming the first group that
        fails (all groups are still tried, each within what is left of ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        results: list[GroupProbe] = []
        failed: GroupProbe | None = None
        for index, name in enumerate(self.names):
            with self._lock:
                size, before = self._sizes.get(index), self._before.get(index)
            if size is None:
                probe = GroupProbe(name, 0, False, None, None, "the probe op never ran before the switch (no "
                                   "warm-up), so replaying it would build a new link on the default NIC")
            elif failed is not None and "did not complete" in failed.detail:
                probe = GroupProbe(name, size, False, before, None, "not tried: an earlier group's probe is "
                                   "still pending")
            else:
                latency, detail = self._run(index, size, deadline)
                probe = GroupProbe(name, size, latency is not None, before, latency, detail)
            results.append(probe)
            if not probe.ok and failed is None:
                failed = probe
        report = ProbeReport(order.seq, failed is None, tuple(results))
        with self._lock:
            self._last = report
        if failed is not None:
            raise ProbeFailed(f"group {failed.group}: {failed.detail}")
        logger.info("rank %s: link probe after switch #%d: %s", _global_rank(), order.seq, ", ".join(
            f"{g.group} {g.after_s * 1000:.2f} ms (before {g.before_s * 1000:.2f} ms)" for g in results
            if g.after_s is not None and g.before_s is not None))
        return True

    # -- one collective --------------------------------------------------------------------------

    def _size(self, index: int) -> int:
        import torch.distributed as dist

        group = self._groups[index]
        try:
            dist.get_rank(group)  # raises for a group this rank is not (or no longer) a member of
            return int(dist.get_world_size(group))
        except (ValueError, RuntimeError) as exc:
            name = self.names[index]
            raise ProbeFailed(f"group {name} is not usable on this rank: {_plain(exc, name)}") from exc

    def _run(self, index: int, size: int, deadline: float) -> tuple[float | None, str]:
        """(latency, "ok") when the op completed with the right sum; (None, why) otherwise."""
        import torch
        import torch.distributed as dist

        group, name = self._groups[index], self.names[index]
        left = deadline - time.monotonic()
        if left <= 0:
            return None, f"not tried: the probe's {self.timeout_s:g} s were used up by earlier groups"
        started = time.monotonic()
        try:
            dist.get_rank(group)  # a group destroyed on this rank since the warm-up
            tensor = torch.ones(1, dtype=torch.float32, device=self._tensor_device(group))
            work = dist.all_reduce(tensor, group=group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=left))
            total = float(tensor.item())
        except (ValueError, RuntimeError) as exc:
            took = time.monotonic() - started
            if took >= left * 0.95 or "timed out" in str(exc).lower():
                return None, (f"all_reduce on group {name} did not complete within {left:.3g} s; the communicator "
                              "may be unusable (the op is still pending: its next collective may hang or fail)")
            return None, (f"all_reduce on group {name} failed after {took * 1000:.1f} ms: {type(exc).__name__}: "
                          f"{_plain(exc, name)}")
        took = time.monotonic() - started
        if total != size:
            return None, (f"all_reduce on group {name} summed to {total:g}, expected {size} (one per rank): some "
                          "rank's contribution did not arrive intact")
        return took, "ok"

    def _tensor_device(self, group: Any) -> Any:
        if self._device is not None:
            return self._device
        import torch.distributed as dist

        kind = DEVICE_OF_BACKEND.get(str(dist.get_backend(group)).lower(), "cpu")
        if kind == "cpu":
            return "cpu"
        module = getattr(importlib.import_module("torch"), kind, None)  # torch.cuda, or torch.npu (torch_npu)
        return f"{kind}:{module.current_device()}" if module is not None else kind


def _plain(exc: BaseException, name: str) -> str:
    """torch's message with a group's object repr (``<...ProcessGroup object at 0x7f...>``) replaced
    by the group's name: an address tells an operator nothing, and differs on every rank."""
    return _OBJECT_REPR.sub(f"'{name}'", str(exc))


_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _global_rank() -> str:
    """This process's global rank for log lines (every rank logs the same words)."""
    import torch.distributed as dist

    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"


__all__ = ["GroupProbe", "ProbeFailed", "ProbeReport", "TorchLinkProbe"]
