"""The read-only snapshot of one simulated job that tests and the CLI inspect."""

from __future__ import annotations

from dataclasses import dataclass

from nicswitch_agent._pb import recover_pb2 as pb

# How every violation that would crash the real ClusterD begins (JobView.violations, the log).
FATAL_PREFIX = "real ClusterD would crash here: "


@dataclass(frozen=True)
class JobView:
    """A snapshot of one job in the simulator, for tests and the CLI.

    Attributes:
        state: the upstream state name (``INIT``, ``NotifyPauseTrainState``, ...).
        action_path: the current flow, or the last one once the job is back in INIT, as the real
            server logs it: ``State(event)`` per transition, then the state it is in, e.g.
            ``[..., "WaitContinueTrainState(switchNicRecvContinue)", "INIT"]``. A flow cut short
            by a reset ends with the state it was in.
        path_history: every flow that ended (by reaching INIT or by a reset), oldest first.
        uuid: the current event id (empty after a reset, as upstream).
        replies: every ``ReplySwitchNicResult.result`` received, in order.
        om_messages: every ``SwitchNicResponse.msg`` produced (queued for the O&M stream).
        signals_sent: process-manage signals written to a stream, keep-alives excluded
            (``keepalives_sent`` counts those).
        stream_opens: per stream method, streams ever accepted for this job.
        open_streams: per stream method, streams open in the current generation (a reset ends
            the others at once, whatever their RPC is still doing).
        lists_sent: rank lists whose send to a subscriber completed.
        violations: protocol misuse that would hurt the real server (empty for a correct client);
            what would crash it starts with :data:`FATAL_PREFIX`.
        resets: the reason of every reset, oldest first.
        queued: what waits in the current generation's channels: ``events``, the one-slot
            ``signal``, ``rank_list``, ``result``, ``stop_report``, ``strategy_report``,
            ``status_report`` (0 or 1) and ``om`` (0..10).
        list_waiters: notify subscribers of the current generation waiting for a rank list, in
            the order they will get one (a stream counts once its handler waits, which comes
            after its open: a test that orders subscribers must wait for this, not the open).
    """

    job_id: str
    state: str
    action_path: list[str]
    path_history: list[list[str]]
    uuid: str
    inited: bool
    registered: bool
    loop_running: bool
    generation: int
    replies: list[bool]
    om_messages: list[str]
    signals_sent: list[pb.ProcessManageSignal]
    keepalives_sent: int
    stream_opens: dict[str, int]
    open_streams: dict[str, int]
    lists_sent: list[pb.SwitchRankList]
    violations: list[str]
    resets: list[str]
    queued: dict[str, int]
    list_waiters: int = 0

    @property
    def action_path_text(self) -> str:
        """The path joined the way ClusterD logs it (``A(e)-->B(f)-->C``)."""
        return "-->".join(self.action_path)
