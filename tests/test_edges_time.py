"""Issue 11 §2 and §6: time bounds hold in every mode; a leader that cannot go on says so.

- pause mode agent, a hook that never returns: false within its own timeout (plus a margin), with
  no guard budget when there is no guard; the stuck rank refuses later orders and status() names it;
- a guard that overruns: false within the guard's timeout, and the switch never runs after it;
- the leader waits for a silent rank only the budget of the hooks that exist;
- Init refused (403): one ERROR naming the fix, status() failed with the reason, threads stopped,
  training undisturbed;
- a pause that times out because step() was never called says so;
- a dry run's reply says that nothing was switched.

Bounds are checked by waiting with a generous timeout (the original code took ~305 s here), never
by measuring a duration against a tight limit.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import support
from scripted import ScriptedClusterD, Send, rank_list
from support import Events
from test_edges_signals import LogLine, Trainer

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd import channel as tr
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.coordination.parking import TrainingStopped
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(90)

JOB = "job-edges-time"
NODES = {"node-0": ["0", "1"]}
FAST = SimSettings(report_timeout_s=30.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)
# The original code waited guard_timeout_s + switch_timeout_s (~303 s): any wait below is far from it
# and far above the few seconds the new bound needs, even on a loaded 2-core box.
GENEROUS_S = 30.0


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES, recover_strategies=("recover", "dump"))],
                          settings=FAST)
    simulator.start()
    yield simulator
    simulator.stop()


streams_ready = functools.partial(support.streams_ready, job=JOB)


def switch(sim: Simulator) -> None:
    channel = open_channel(ChannelSettings(target=sim.address))
    try:
        request = pb.SwitchNics(jobID=JOB)
        request.nicOps["node-0"].dev.extend(["0"])
        request.nicOps["node-0"].op.extend([True])
        assert RecoverStub(channel).SwitchNicTrack(request, timeout=5).code == 0
    finally:
        channel.close()


class Hanging:
    """A hook that does not return until ``release`` is set (or 60 s pass); records its calls."""

    def __init__(self, result: Any = True) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self.result = result

    def __call__(self, order: SwitchOrder) -> Any:
        self.calls += 1
        self.entered.set()
        self.release.wait(60)
        return self.result


class Recording:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls += 1
        return True


@pytest.fixture
def job(sim: Simulator) -> Iterator[Any]:
    made: list[tuple[SwitchAgent, Trainer, list[Hanging]]] = []

    def make(hooks: list[Hanging] | None = None, *, train: bool = True, **settings: Any) -> tuple[SwitchAgent, Trainer]:
        settings.setdefault("reconnect_initial_s", 0.02)
        settings.setdefault("reconnect_max_s", 0.1)
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", **settings)
        trainer = Trainer(agent, threading.Barrier(1, timeout=30))
        made.append((agent, trainer, hooks or []))
        agent.start()
        if train:
            trainer.thread.start()
        assert sim.wait_until(streams_ready, 10)
        return agent, trainer

    yield make
    for agent, trainer, hooks in made:
        for hook in hooks:
            hook.release.set()
        trainer.stop.set()
        agent.stop()
        if trainer.thread.is_alive():
            trainer.thread.join(10)


def test_a_switch_hook_that_never_returns_is_answered_false_within_its_own_timeout(sim: Simulator, job: Any) -> None:
    """No checkpoint hook: no guard budget. The stuck rank then refuses the rollback at once, says
    so in status(), and leaves its parking spot only when the hook returns (stopped, not resumed)."""
    hook = Hanging()
    events = Events()
    rollback = LogLine("rollback of order #1")
    logging.getLogger("nicswitch_agent.controller").addHandler(rollback)
    try:
        agent, trainer = job([hook], switch_hook=hook, switch_timeout_s=1.0, on_event=events)
        assert trainer.wait_step(2)
        switch(sim)
        assert hook.entered.wait(10)
        assert sim.wait_until(lambda s: len(s.job_view(JOB).replies) >= 1, GENEROUS_S), "no reply"
        assert sim.job_view(JOB).replies == [False]
        reason = events.wait("reply_sent", timeout=20)[0].detail["reason"]
        assert "switch hook of order #1 did not finish within 1 s" in reason, reason
        stuck = agent.status()["stuck_hook"]
        assert stuck is not None and "switch hook of order #1" in stuck and "parked" in stuck
        # ClusterD's recovery: the rollback must not run next to the stuck hook.
        assert rollback.wait(GENEROUS_S)
        assert "failed" in rollback.message and "still running" in rollback.message, rollback.message
        assert hook.calls == 1
        assert not trainer.done.is_set()  # still parked in the hook
        hook.release.set()
        assert trainer.done.wait(GENEROUS_S), "training stayed parked after the hook returned"
        assert isinstance(trainer.error, TrainingStopped)  # ClusterD chose exit: no rollback, no checkpoint
        assert agent.status()["stuck_hook"] is None
    finally:
        logging.getLogger("nicswitch_agent.controller").removeHandler(rollback)


def test_a_guard_that_overruns_is_answered_false_within_its_timeout_and_the_switch_never_runs(
        sim: Simulator, job: Any) -> None:
    guard, switch_hook, events = Hanging(), Recording(), Events()
    _agent, trainer = job([guard], switch_hook=switch_hook, checkpoint_hook=guard, guard_timeout_s=1.0,
                          on_event=events)
    assert trainer.wait_step(2)
    switch(sim)
    assert guard.entered.wait(10)
    assert sim.wait_until(lambda s: len(s.job_view(JOB).replies) >= 1, GENEROUS_S), "no reply"
    reason = events.wait("reply_sent", timeout=20)[0].detail["reason"]
    assert "checkpoint hook of order #1 did not finish within 1 s" in reason, reason
    guard.release.set()  # the guard returns late ...
    assert events.wait("guard_done", timeout=20), "the order's work never ended on the training thread"
    assert switch_hook.calls == 0  # ... and the switch it guarded does not run after the false reply


def test_the_leader_waits_for_a_silent_rank_only_the_budget_of_the_hooks_that_exist(clusterd: ScriptedClusterD) -> None:
    """Mode external, world_size 2, rank 1 never runs: false after switch_timeout_s (+2 s slack),
    not after guard_timeout_s + switch_timeout_s: this job has no checkpoint hook."""
    clusterd.script(Send(rank_list(["0"], [True], job_id="job-1")))
    agent = SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", switch_hook=Recording(),
                        store=InProcessStore(), rank=0, world_size=2, switch_timeout_s=1.0, guard_timeout_s=300.0,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1)
    events = Events()
    agent.add_listener(events)
    agent.start()
    try:
        replies = clusterd.wait_replies(1, timeout=GENEROUS_S)
        assert [r.result for r in replies] == [False]
        assert "1 rank(s) did not answer within the budget" in events.wait("reply_sent", timeout=20)[0].detail["reason"]
    finally:
        agent.stop()


# -- a leader that cannot go on ---------------------------------------------------------------------


class Refusing:
    """A ClusterD whose Init answers 403 (process recovery not enabled for the job's PodGroup)."""

    def __init__(self) -> None:
        self.inits = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="refusing"))
        self.server.add_generic_rpc_handlers((tr.generic_handler({
            "Init": self._init,
            "HealthCheck": lambda request, context: pb.Status(info="ok"),
        }),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def _init(self, request: pb.ClientInfo, context: grpc.ServicerContext) -> pb.Status:
        self.inits += 1
        return pb.Status(code=403, info="ProcessRecoverEnableOff")


AGENT_THREADS = ("nicswitch-notify", "nicswitch-executor", "nicswitch-signals", "nicswitch-process-manage",
                 "nicswitch-member")


def test_init_refused_403_fails_the_leader_with_one_error_naming_the_fix_and_training_goes_on(caplog: Any) -> None:
    caplog.set_level(logging.INFO)
    server = Refusing()
    server.server.start()
    before = set(threading.enumerate())
    agent = SwitchAgent(server=server.address, job_id="job-403", pause="agent", switch_hook=Recording(),
                        reconnect_initial_s=0.02, reconnect_max_s=0.1)
    failed = Events()
    agent.add_listener(failed)
    trainer = Trainer(agent, threading.Barrier(1, timeout=30))
    try:
        agent.start()
        trainer.thread.start()
        assert failed.wait("agent_failed", timeout=20)
        ours = [t for t in threading.enumerate() if t not in before and t.name in AGENT_THREADS]
        for thread in ours:
            thread.join(GENEROUS_S)
        assert not [t.name for t in ours if t.is_alive()], "the failed leader's threads kept running"
        status = agent.status()
        assert status["state"] == "failed"
        assert "403" in status["reason"] and "process-recover-enable=on" in status["reason"]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "process-recover-enable=on" in errors[0].getMessage()  # the fix, not only the symptom
        assert server.inits == 1  # not retried
        step = trainer.step
        assert trainer.wait_step(step + 20)  # training is not disturbed
        assert trainer.error is None and not status["parked"]
    finally:
        trainer.stop.set()
        agent.stop()
        server.server.stop(0)
    assert agent.status()["state"] == "stopped"


# -- §6: a pause nobody reaches, a dry run ------------------------------------------------------------


def test_a_pause_that_times_out_because_step_was_never_called_says_so(sim: Simulator, job: Any) -> None:
    failed = LogLine("pause failed after ")
    logging.getLogger("nicswitch_agent.controller").addHandler(failed)
    try:
        job(switch_hook=Recording(), pause_timeout_s=1.0, train=False)  # step() is never called
        switch(sim)
        assert failed.wait(GENEROUS_S)
        assert "no rank reached a step boundary: step() was never called" in failed.message, failed.message
    finally:
        logging.getLogger("nicswitch_agent.controller").removeHandler(failed)


def test_a_dry_run_reply_says_nothing_was_switched_in_mode_agent(sim: Simulator, job: Any, caplog: Any) -> None:
    caplog.set_level(logging.INFO)
    events = Events()
    agent, trainer = job(dry_run=True, on_event=events)
    assert trainer.wait_step(2)
    switch(sim)
    sent = events.wait("reply_sent", timeout=20)
    assert sent and sent[0].detail == {**sent[0].detail, "result": True, "reason": "dry run: nothing switched"}
    assert "replied true (dry run: nothing switched)" in caplog.text
    assert agent.status()["last_switch"]["reason"] == "dry run: nothing switched"


def test_a_dry_run_reply_says_nothing_was_switched_in_mode_external(clusterd: ScriptedClusterD, caplog: Any) -> None:
    caplog.set_level(logging.INFO)
    clusterd.script(Send(rank_list(["0"], [True], job_id="job-1")))
    agent = SwitchAgent(server=clusterd.address, job_id="job-1", pause="external", dry_run=True,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1).start()
    events = Events()
    agent.add_listener(events)
    try:
        assert [r.result for r in clusterd.wait_replies(1, timeout=GENEROUS_S)] == [True]
        assert events.wait("reply_sent", timeout=20)[0].detail["reason"] == "dry run: nothing switched"
    finally:
        agent.stop()
