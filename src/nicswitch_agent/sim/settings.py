"""What the simulator serves (:class:`SimJob`) and how fast it runs (:class:`SimSettings`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nicswitch_agent.sim import codes as P

__all__ = ["SimJob", "SimSettings"]


@dataclass(frozen=True)
class SimJob:
    """One training job as ClusterD sees it: its rank table and its PodGroup settings.

    Args:
        job_id: the job key (``MINDX_TASK_ID``; a job UID upstream).
        nodes: node name -> that node's rank-table ``device_id``s, nodes in pod-rank order. Every
            node has the same number of devices (upstream builds ``rank_id`` as
            ``podRank * podDevNum + index``, docs/clusterd.md#rank-ids-and-their-order).
        running: the job's status in ClusterD's job cache; ``False`` makes SwitchNicTrack answer
            413 ``job:%s is not running`` (docs/clusterd.md#switchnictrack-validation).
        superpod_ids: node -> SuperPoD id from the device-info cache (default 0 for every node);
            a negative id makes SwitchNicTrack answer 413 ``node:%s should operate in superPodID``.
        recover_strategies: the PodGroup annotation ``recover-strategy`` (names from ``retry``,
            ``recover``, ``dump``, ``exit``); ``exit`` is always allowed on top
            (docs/clusterd.md#failed-switch-and-fault-recovery).
        framework: the PodGroup label ``framework``, ``pytorch`` or ``mindspore``. For a MindSpore
            job ClusterD turns a ``dump`` decision into ``exit`` while a NIC switch is in progress
            (``handleDecidedStrategyAfterChoose``), so a failed switch never dumps.
        process_recover_enable: the PodGroup label ``process-recover-enable``; ``False`` makes
            ``Init`` answer 403 (ProcessRecoverEnableOff), and ``Register`` then 408.
        in_job_cache: whether ClusterD's job cache holds the job; ``False`` (a job ClusterD lost
            track of, or one its informer has not seen yet) makes ``SwitchNicTrack`` answer 413
            ``job:<id> not exist`` although Init and Register succeed.
    """

    job_id: str
    nodes: Mapping[str, Sequence[str]]
    running: bool = True
    superpod_ids: Mapping[str, int] | None = None
    recover_strategies: tuple[str, ...] = ("retry", "recover", "dump")
    framework: str = P.PYTORCH
    process_recover_enable: bool = True
    in_job_cache: bool = True

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ValueError("job_id must not be empty")
        if not self.nodes:
            raise ValueError(f"job {self.job_id}: nodes must not be empty")
        normalised: dict[str, tuple[str, ...]] = {}
        width: int | None = None
        for node, devices in self.nodes.items():
            if isinstance(devices, str):
                raise ValueError(f"job {self.job_id}: node {node}: devices must be a sequence of ids")
            devs = tuple(str(d) for d in devices)
            if not devs:
                raise ValueError(f"job {self.job_id}: node {node} has no devices")
            if len(set(devs)) != len(devs):
                raise ValueError(f"job {self.job_id}: node {node} lists a device twice: {devs}")
            if width is not None and len(devs) != width:
                raise ValueError(
                    f"job {self.job_id}: every node needs the same number of devices "
                    f"(rank_id = podRank * podDevNum + index); {node} has {len(devs)}, not {width}"
                )
            width = len(devs)
            normalised[str(node)] = devs
        object.__setattr__(self, "nodes", normalised)
        if self.superpod_ids is not None:
            unknown = set(self.superpod_ids) - set(normalised)
            if unknown:
                raise ValueError(f"job {self.job_id}: superpod_ids for unknown nodes {sorted(unknown)}")
            object.__setattr__(self, "superpod_ids", dict(self.superpod_ids))
        strategies = tuple(self.recover_strategies)
        unknown_strategies = [name for name in strategies if name not in P.STRATEGIES]
        if unknown_strategies:
            raise ValueError(
                f"job {self.job_id}: recover_strategies {unknown_strategies} unknown; "
                f"known: {', '.join(P.STRATEGIES)}"
            )
        object.__setattr__(self, "recover_strategies", strategies)
        if self.framework not in P.FRAMEWORKS:
            raise ValueError(
                f"job {self.job_id}: framework {self.framework!r} unknown; known: {', '.join(P.FRAMEWORKS)}"
            )

    def superpod_id(self, node: str) -> int:
        """The node's SuperPoD id (0 unless configured)."""
        if self.superpod_ids is None:
            return 0
        return int(self.superpod_ids.get(node, 0))

    def allowed_strategies(self) -> frozenset[str]:
        """The annotation plus ``exit``, which ClusterD always allows."""
        return frozenset(self.recover_strategies) | {"exit"}


@dataclass(frozen=True)
class SimSettings:
    """Timings of the simulated ClusterD. Defaults are the real server's.

    Tests shrink them to milliseconds. Every wait of the real server that a switch can reach
    is here, so no test has to wait for a real-world minute.

    Args:
        report_timeout_s: ``reportTimeoutMinutes`` (15 min): pause ack, switch reply, continue
            ack, stop ack, strategy report, recover status, and the O&M result stream.
        keepalive_interval_s: keep-alive signal period on the process-manage stream (5 s).
        enqueue_timeout_s: how long a signal or rank list may wait for its one-slot queue (1 s)
            before ClusterD gives up with 504 and resets the job.
        fault_flush_s: ``faultFlushSeconds`` (1 s) after the stop report.
        force_release_s: ``dealWithForceRelease`` sleep (10 s) before ``globalFault``.
        schedule_wait_s: ``SleepSecondBeforeCheckPGRunning`` (5 s): ListenScheduleResult and
            the FaultRetry check after ``dump_exit``.
        restart_wait_s: ``handleWaitRestartAllProcess`` (1 min).
        list_delay_s: not ClusterD's (it has no wait there; default 0): a pause between the pause
            report and the rank list, for tests that need training parked with no list in flight.
        shuffle_nodes: emulate Go map iteration (random node order in the rank list and in
            validation); devices keep the request's order either way.
        seed: seed for that shuffle and nothing else.
        max_workers: gRPC server threads; every open stream and every blocked call holds one.
        crash_like_clusterd: where the real ClusterD crashes (a report without ``status``; a
            second reply blocked on the one-slot result channel when the job resets), crash too:
            every stream and call ends with UNAVAILABLE, the port closes, later calls are refused,
            and the CLI exits with status 2. Off (the default), the simulator records the
            violation, logs an ERROR naming the crash, and keeps serving so a rehearsal can go on.
    """

    report_timeout_s: float = 900.0
    keepalive_interval_s: float = 5.0
    enqueue_timeout_s: float = 1.0
    fault_flush_s: float = 1.0
    force_release_s: float = 10.0
    schedule_wait_s: float = 5.0
    restart_wait_s: float = 60.0
    list_delay_s: float = 0.0
    shuffle_nodes: bool = True
    seed: int | None = None
    max_workers: int = field(default=32)
    crash_like_clusterd: bool = False

    def __post_init__(self) -> None:
        for name in (
            "report_timeout_s",
            "keepalive_interval_s",
            "enqueue_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("fault_flush_s", "force_release_s", "schedule_wait_s", "restart_wait_s", "list_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_workers < 8:
            raise ValueError("max_workers must be >= 8 (streams hold a worker each)")
