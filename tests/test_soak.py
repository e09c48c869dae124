"""The fault soak, short (the long one is ``python tests/soak.py``, see its docstring).

About 40 switches in both pause modes, 2 ranks as threads, every fault kind at least once (the
notify stream dropped before/after a send, replies failing with UNAVAILABLE or "qps exceeded",
hooks failing, raising or overrunning on rank 0 and on a member, the in-process simulator
restarted, and the simulator as a process SIGKILLed and restarted). Invariants are checked after
every switch by the soak itself; this test asserts that none broke. It never asserts timings.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from soak import FAULTS, SIM_KILL, SoakSettings, run_soak

from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.coordination import KV, Coordinator, InProcessStore, Member, MemberHooks
from nicswitch_agent.coordination.parking import ParkingLot
from nicswitch_agent.orders import SwitchOrder
from nicswitch_agent.sim import SimJob, SimSettings, Simulator
from nicswitch_agent.sim import faults as F


@pytest.mark.timeout(180)
def test_fault_soak_keeps_every_invariant() -> None:
    report = run_soak(SoakSettings(switches=40, seed=11, ranks=2, kills=1, mid_switch_restarts=True))
    print(report.text())
    assert report.violations == []
    assert report.problems == []
    assert report.switches == 40 and report.per_mode == {"agent": 20, "external": 20}
    # One reply per list ClusterD delivered and still waited for; none after it restarted mid-switch.
    assert report.replies == report.lists_delivered - report.outcomes["restarted before the reply"]
    assert report.replies_lost >= 1 and report.reply_retries >= 1
    missing = [kind for kind in FAULTS if report.faults[kind] == 0]
    assert missing == [], f"fault kinds that never fired: {missing}"
    assert sum(1 for r in report.recoveries if r.kind == SIM_KILL) >= 2


def test_simulator_faults_fire_once_each_and_are_counted() -> None:
    faults = F.SimFaults()
    faults.arm(F.REPLY_QPS_EXCEEDED)
    assert faults.take(F.REPLY_QPS_EXCEEDED)
    assert not faults.take(F.REPLY_QPS_EXCEEDED)
    assert not faults.take(F.NOTIFY_DROP_AFTER_SEND)
    faults.arm(F.NOTIFY_DROP_AFTER_SEND, 2)
    faults.disarm()
    assert not faults.take(F.NOTIFY_DROP_AFTER_SEND)
    assert faults.fired == {F.REPLY_QPS_EXCEEDED: 1}
    with pytest.raises(ValueError, match="unknown simulator fault"):
        faults.arm("reply_maybe")


@pytest.fixture
def two_members() -> Iterator[tuple[Coordinator, threading.Event]]:
    """Rank 0's switch hook blocks (past its 1 s timeout) on its first order; rank 1's fails orders
    1 to 3 at once and succeeds from order 4 on."""
    store = InProcessStore()
    kv = KV(store, "soak-regression")
    release = threading.Event()
    first = threading.Event()

    def hook0(order: SwitchOrder) -> bool:
        if not first.is_set():
            first.set()
            release.wait(10)
        return True

    members = []
    for rank, hook in ((0, hook0), (1, lambda order: order.seq >= 4)):
        hooks = MemberHooks(switch_hook=hook, checkpoint_hook=None, guard_timeout_s=1.0, switch_timeout_s=1.0,
                            dry_run=False)
        member = Member(kv.clone(), rank, ParkingLot(), hooks, lambda: 0, stop_timeout_s=0.5)
        member.start()
        members.append(member)
    try:
        yield Coordinator(kv.clone(), 2), release
    finally:
        release.set()
        for member in members:
            member.stop()


@pytest.mark.timeout(30)
def test_a_member_busy_past_its_hook_timeout_still_answers_later_orders(
    two_members: tuple[Coordinator, threading.Event],
) -> None:
    """Pause mode external: rank 0 sits in a hook until its timeout while rank 1 fails three orders
    at once (the leader decides on the first failure). Rank 0 must still answer the next order."""
    coordinator, _release = two_members
    for seq in (1, 2, 3):  # rank 1 fails each at once; rank 0 is still in order 1's hook
        outcome = coordinator.run(SwitchOrder(seq=seq, job_id="j", ranks=(0,), ops=(True,)), kind="switch",
                                  budget_s=1.0)
        assert not outcome.ok and outcome.reason.startswith("rank 1:"), outcome
    # Rank 1 succeeds now, so rank 0's answer decides (a refusal while its hook still runs is fine).
    outcome = coordinator.run(SwitchOrder(seq=4, job_id="j", ranks=(0,), ops=(True,)), kind="switch", budget_s=1.0)
    assert "did not answer" not in outcome.reason, outcome


@pytest.mark.timeout(60)
def test_no_reply_reaches_a_restarted_clusterd_for_a_list_it_never_sent() -> None:
    """Pause mode agent: the list is delivered, the simulator restarts while the hook runs, the hook
    then succeeds. The process-manage stream's end told the agent that ClusterD reset the job: the
    new ClusterD must get no reply (docs/clusterd.md#reply-timing-and-the-crash: a reply while INIT is the next
    switch's result)."""
    job = SimJob(job_id="job-mid", nodes={"node-0": ["0"]}, recover_strategies=("recover",))
    settings = SimSettings(report_timeout_s=10, keepalive_interval_s=0.5, shuffle_nodes=False)
    in_hook, release = threading.Event(), threading.Event()

    def hook(order: SwitchOrder) -> bool:
        in_hook.set()
        return release.wait(20)

    def ready(sim: Simulator) -> bool:
        view = sim.job_view("job-mid")
        return view.state == "INIT" and view.open_streams["SubscribeProcessManageSignal"] == 1 and (
            view.open_streams["SubscribeNotifySwitch"] == 1)

    first = Simulator(jobs=[job], settings=settings)
    first.start()
    port = int(first.address.rsplit(":", 1)[1])
    agent = SwitchAgent(server=first.address, job_id="job-mid", pause="agent", switch_hook=hook,
                        reconnect_initial_s=0.02, reconnect_max_s=0.2).start()
    stop = threading.Event()

    def train() -> None:
        step = 0
        while not stop.wait(0.002):
            step += 1
            agent.step(step)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    second: Simulator | None = None
    try:
        assert first.wait_until(ready, 10)
        channel = open_channel(ChannelSettings(target=first.address))
        try:
            request = pb.SwitchNics(jobID="job-mid")
            request.nicOps["node-0"].dev.append("0")
            request.nicOps["node-0"].op.append(True)
            assert RecoverStub(channel).SwitchNicTrack(request, timeout=5).code == 0
        finally:
            channel.close()
        assert in_hook.wait(10)
        first.stop()
        second = Simulator(jobs=[job], settings=settings, port=port)
        second.start()
        assert second.wait_until(ready, 20)
        release.set()
        # The order is over once the agent is back to "running" (its reply, if any, was sent by then);
        # the simulator's keep-alives re-check this every 0.5 s.
        assert second.wait_until(lambda s: agent.status()["state"] == "running"
                                 and agent.status()["counters"]["lists_received"] == 1, 20)
        view = second.job_view("job-mid")
        assert view.replies == [] and view.violations == [], view.violations
    finally:
        release.set()
        stop.set()
        agent.stop()
        trainer.join(5)
        if second is not None:
            second.stop()
        first.stop()
