"""The verification phase: a verify hook on every rank once the switch succeeded on every rank.

Ranks are threads with one agent each on an in-process Store (test_multirank's Job), every job
test both with every rank on the job's Store and with node-local fan-out (relays forward the
verify round as an order). The verify hooks record a global sequence of calls, so a test can say
that no rank verified before every rank had switched.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import support
from test_multirank import (
    FAN_OUTS,
    FAST,
    JOB,
    NODES,
    WORLD,
    Hook,
    Job,
    Rank,
    standin_if_external,
    streams_ready,
    switch,
)
from test_multirank import Collective as Barrier

from nicswitch_agent import AgentConfig, ConfigError, SwitchAgent, SwitchOrder, TorchCheckpointGuard
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.sim import SimJob, Simulator

pytestmark = pytest.mark.timeout(90)

FINISH, FAILED = "switch nic finish", "switch nic failed, switch nic failed"


class Verify:
    """A verify hook that records (rank, thread, seq) in a log it shares with the other ranks'
    hooks and their switch hooks' calls; scripted results per call; may hang until released."""

    def __init__(self, rank: int, job_log: list[tuple[str, int, str, int]], lock: threading.Lock,
                 results: list[Any] | None = None, hang: threading.Event | None = None) -> None:
        self.rank, self.log, self.lock = rank, job_log, lock
        self.results = list(results or [])
        self.hang = hang
        self.entered = threading.Event()

    def __call__(self, order: SwitchOrder) -> Any:
        with self.lock:
            self.log.append(("verify", self.rank, threading.current_thread().name, order.seq))
        self.entered.set()
        if self.hang is not None:
            self.hang.wait(30)
        result = self.results.pop(0) if self.results else True
        if isinstance(result, BaseException):
            raise result
        return result


@pytest.fixture
def sim() -> Iterator[Simulator]:
    # recover first: after a failed switch whose rollback worked, ClusterD lets training go on
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES, recover_strategies=("recover", "dump"))],
                          settings=FAST)
    simulator.start()
    yield simulator
    simulator.stop()


class VerifiedJob(Job):
    """test_multirank's job with a verify hook on every rank (per-rank results / hangs)."""

    def __init__(self, sim: Simulator, verify: dict[int, dict[str, Any]] | None = None, **kwargs: Any) -> None:
        self.log: list[tuple[str, int, str, int]] = []
        self.log_lock = threading.Lock()
        self.verifiers = [Verify(r, self.log, self.log_lock, **(verify or {}).get(r, {})) for r in range(WORLD)]
        extra = kwargs.pop("hooks", {})
        hooks = {r: {"verify_hook": self.verifiers[r], **extra.get(r, {})} for r in range(WORLD)}
        super().__init__(sim, hooks=hooks, **kwargs)

    def verify_calls(self) -> list[tuple[str, int, str, int]]:
        with self.log_lock:
            return list(self.log)

    def switch_calls(self) -> list[tuple[Any, ...]]:
        with self.lock:
            return list(self.calls)


@pytest.fixture(params=sorted(FAN_OUTS))
def make_job(sim: Simulator, request: pytest.FixtureRequest) -> Iterator[Any]:
    jobs: list[VerifiedJob] = []

    def make(**kwargs: Any) -> VerifiedJob:
        job = VerifiedJob(sim, **FAN_OUTS[request.param], **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        for verifier in job.verifiers:
            if verifier.hang is not None:
                verifier.hang.set()
        job.close()


def test_every_rank_verifies_once_on_its_training_thread_after_every_rank_switched(
        sim: Simulator, make_job: Any) -> None:
    job = make_job()
    assert sim.wait_until(streams_ready, 10)
    for ops in ([True, False], [False, False]):
        switched_before = len(job.switch_calls())
        assert switch(sim, "node-1", ["1", "0"], ops) == FINISH
        assert sim.wait_until(streams_ready, 10)
        assert len(job.switch_calls()) == switched_before + WORLD
    calls = job.verify_calls()
    assert sorted((c[1], c[3]) for c in calls) == sorted((r, seq) for r in range(WORLD) for seq in (1, 2))
    assert all(thread == f"train-{rank}" for _, rank, thread, _ in calls), calls  # where the switch hook ran
    for rank in job.ranks:
        status = rank.agent.status()["last_verify"]
        assert status["ok"] and status["reason"] == "ok" and status["order"].endswith(".2.verify"), status
        kinds = [e.detail.get("kind") for e in rank.agent.events() if e.kind == "member_result"]
        assert kinds == ["switch", "verify"] * 2
        done = [e for e in rank.agent.events() if e.kind == "verify_done"]
        assert [(e.detail["rank"], e.detail["ok"]) for e in done] == [(rank.rank, True)] * 2
        assert rank.agent.status()["timings"].get("rank_verify_s", {}).get("count") == 2
    assert sim.job_view(JOB).replies == [True, True]
    if importlib.util.find_spec("prometheus_client") is not None:  # the same events as Prometheus metrics
        from nicswitch_agent.observability.metrics import PrometheusMetrics

        metrics = PrometheusMetrics()
        for event in job.ranks[1].agent.events():
            metrics(event)
        labels = {"job": JOB, "kind": "verify"}
        assert metrics.registry.get_sample_value("nicswitch_rank_duration_seconds_count", labels) == 2
        assert metrics.registry.get_sample_value("nicswitch_rank_results_total", {**labels, "result": "ok"}) == 2


def test_no_rank_verifies_before_every_rank_switched(sim: Simulator, make_job: Any) -> None:
    """Rank 3's switch hook holds until released: no verify hook may run meanwhile."""
    hold = threading.Event()
    job = make_job(hooks={3: {}})
    job.hooks[3].hang = hold
    assert sim.wait_until(streams_ready, 10)
    answers: list[str] = []
    operator = threading.Thread(target=lambda: answers.append(switch(sim, "node-0", ["0"], [True])))
    operator.start()
    assert job.hooks[3].entered.wait(20)
    # Every other rank has returned from its switch hook (they run at once; rank 3 holds).
    assert support.wait_until(lambda: len(job.switch_calls()) == WORLD, 20)
    early = support.wait_until(lambda: any(v.entered.is_set() for v in job.verifiers), 0.5)
    assert not early, "a rank verified while rank 3 was still switching"
    hold.set()
    operator.join(40)
    assert answers == [FINISH]
    assert sorted(c[1] for c in job.verify_calls()) == list(range(WORLD))


@pytest.mark.parametrize("without", [0, 2])
def test_a_rank_without_a_verify_hook_answers_the_round_and_the_others_verify(
        sim: Simulator, make_job: Any, without: int) -> None:
    """Rank 0 leads: without a verify hook of its own it does not expect the round (the ranks' results
    ask for it, a queue event); with one, the ranks wait on their go keys, rank 2 without a hook too."""
    job = make_job(hooks={without: {"verify_hook": None}})
    assert sim.wait_until(streams_ready, 10)
    assert switch(sim, "node-1", ["1"], [True]) == FINISH
    assert sorted(c[1] for c in job.verify_calls()) == [r for r in range(WORLD) if r != without]
    kinds = [e.detail.get("kind") for e in job.ranks[without].agent.events() if e.kind == "member_result"]
    assert kinds == ["switch", "verify"]
    assert sim.job_view(JOB).replies == [True]


def last_reason(job: VerifiedJob) -> str:
    """The leader's reason for its last reply (the operator can hear it before the leader records it)."""
    last = support.poll(lambda: job.ranks[0].agent.status()["last_switch"], 10)
    assert last is not None, "the leader never recorded the switch"
    return str(last["reason"])


@pytest.mark.parametrize("failure", ["false", "raise"])
def test_a_verification_failure_on_one_rank_fails_the_switch_rolls_back_and_training_goes_on(
        sim: Simulator, make_job: Any, failure: str, caplog: pytest.LogCaptureFixture) -> None:
    result: Any = False if failure == "false" else RuntimeError("group tp: all_reduce did not complete")
    job = make_job(verify={2: {"results": [result]}})
    assert sim.wait_until(streams_ready, 10)
    assert switch(sim, "node-1", ["0"], [True]) == FAILED
    assert sim.job_view(JOB).replies == [False]
    reason = last_reason(job)
    assert reason.startswith("verification failed: rank 2: verify hook "), reason
    if failure == "raise":
        assert "group tp: all_reduce did not complete" in reason
        assert any(r.exc_info and "verify hook raised" in r.getMessage() for r in caplog.records)  # traceback
    # The failed-switch path: rolled back on every rank (rank 2 of node-1 back to primary), then
    # ClusterD picked recover and training goes on.
    def rollbacks() -> list[int]:
        return sorted(c[0] for c in job.switch_calls() if c[3] == (False,))

    assert support.wait_until(lambda: rollbacks() == list(range(WORLD)), 20), rollbacks()
    assert support.wait_until(lambda: any(s.changeStrategy == "recover" for s in sim.job_view(JOB).signals_sent), 20)
    for rank in job.ranks:
        assert rank.wait_step(rank.step + 3), f"rank {rank.rank} did not resume"
        assert rank.error is None
    # Verified exactly once per rank, and the rollback not at all. Rank 2's failure decides the
    # round at once (the leader blocks until the first failure), but every rank took its verify
    # order from its go key the moment its switch succeeded, so none skips it as decided: a
    # probe's collective is entered by every rank, never left waiting for one that skipped it.
    calls = job.verify_calls()
    assert [c[3] for c in calls] == [1] * len(calls), "the rollback is not verified"
    assert sorted(c[1] for c in calls) == list(range(WORLD)), calls
    failed = [e for e in job.ranks[2].agent.events() if e.kind == "verify_done"]
    assert [e.detail["ok"] for e in failed] == [False]
    assert [e.seq for e in failed] == [1]  # the list it verified, as on the other member events
    assert job.ranks[2].agent.status()["last_verify"]["ok"] is False
    # Every switch hook returned True, yet the links are in doubt until the rollback: no rank takes
    # its own success for its link when the verification failed (observability/links.py).
    told = [e for r in job.ranks for e in r.agent.events() if e.kind == "switch_outcome"
            and e.detail.get("kind") == "switch"]
    assert len(told) == WORLD and not any(e.detail["moved"] for e in told), [e.detail for e in told]
    assert all(r.agent.status()["links"]["uncertain"] == 0 for r in job.ranks)  # the rollback settled them


class UnusableAfterFailure(Verify):
    """A verify hook that fails and says its communicators may be unusable (as TorchLinkProbe does
    when its op is still pending or its group is gone)."""

    def communicators_unusable(self) -> bool:
        return True


def test_a_verification_that_leaves_communicators_unusable_is_not_rolled_back_and_training_stops(
        sim: Simulator, make_job: Any) -> None:
    """Resuming into a communicator with an op still pending hangs the job for good (seen with a
    real 4-process job: rollback, retry, resume, then every rank stuck in its next all_reduce)."""
    job = make_job()
    job.verifiers[2].__class__ = UnusableAfterFailure
    job.verifiers[2].results = [RuntimeError("group default: all_reduce did not complete within 5 s")]
    assert sim.wait_until(streams_ready, 10)
    assert switch(sim, "node-1", ["0"], [True]) == FAILED
    assert sim.job_view(JOB).replies == [False]
    for rank in job.ranks:
        assert rank.done.wait(20), f"rank {rank.rank} trained on after its communicators became unusable"
    picked = [s.changeStrategy for s in sim.job_view(JOB).signals_sent if s.changeStrategy]
    assert "recover" not in picked and "retry" not in picked, picked
    assert [c for c in job.switch_calls() if c[3] == (False,)] == [], "no rollback on unusable communicators"


def test_a_hanging_verification_gives_false_within_verify_timeout(sim: Simulator, make_job: Any) -> None:
    hang = threading.Event()
    job = make_job(verify={1: {"hang": hang}}, verify_timeout_s=0.5)
    assert sim.wait_until(streams_ready, 10)
    assert switch(sim, "node-0", ["1"], [True]) == FAILED
    assert sim.job_view(JOB).replies == [False]
    reason = last_reason(job)
    assert "verification failed" in reason and "did not" in reason, reason
    assert "rank 1" in reason or "node 0" in reason, reason
    hang.set()


def test_a_dry_run_never_verifies(sim: Simulator, make_job: Any) -> None:
    job = make_job(dry_run=True)
    assert sim.wait_until(streams_ready, 10)
    assert switch(sim, "node-0", ["1"], [True]) == FINISH
    assert job.verify_calls() == []
    assert all(r.agent.status()["last_verify"] is None for r in job.ranks)


@pytest.mark.parametrize("pause", ["external"])
def test_in_pause_mode_external_the_verify_hook_runs_on_a_hook_thread(sim: Simulator, make_job: Any,
                                                                        pause: str) -> None:
    job = make_job(pause=pause)
    with standin_if_external(sim, pause):
        assert sim.wait_until(streams_ready, 10)
        assert switch(sim, "node-0", ["1"], [True]) == FINISH
    calls = job.verify_calls()
    assert sorted(c[1] for c in calls) == list(range(WORLD))
    assert all(thread.startswith("nicswitch-verify-") for _, _, thread, _ in calls), calls


def test_under_a_launchers_leader_the_members_verify(sim: Simulator) -> None:
    """The launcher's leader has no hooks of its own: the members' results ask for the verify round."""
    store = InProcessStore()
    leader = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", store=store, world_size=2,
                         leader_only=True, reconnect_initial_s=0.02, reconnect_max_s=0.1).start()
    log: list[tuple[str, int, str, int]] = []
    lock = threading.Lock()
    barrier = Barrier(2)
    ranks = []
    for r in range(2):
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=Hook(r, [], lock),
                            verify_hook=Verify(r, log, lock), store=store, rank=r, world_size=2, leader="launcher")
        ranks.append(Rank(r, agent.start(), barrier))
    for rank in ranks:
        rank.thread.start()
    try:
        assert sim.wait_until(streams_ready, 10)
        assert switch(sim, "node-0", ["0", "1"], [True, True]) == FINISH
        assert sorted((c[1], c[2]) for c in log) == [(0, "train-0"), (1, "train-1")]
    finally:
        for rank in ranks:
            rank.stop.set()
        barrier.barrier.abort()
        for rank in ranks:
            rank.agent.stop()
            rank.thread.join(10)
        leader.stop()


# -- refused at construction or at start --------------------------------------------------------


class Collective:
    """A verify hook that declares it runs collectives (as TorchLinkProbe does)."""

    runs_collectives = True
    timeout_s = 1.0

    def __call__(self, order: SwitchOrder) -> bool:
        return True


def agent(**kwargs: Any) -> SwitchAgent:
    return SwitchAgent(server="127.0.0.1:1", job_id="j", store=InProcessStore(), world_size=1, rank=0,
                       switch_hook=lambda order: True, **kwargs)


def test_a_verify_hook_that_cannot_be_called_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="verify_hook must be callable, got int 3"):
        agent(verify_hook=3)
    with pytest.raises(ConfigError, match=r"verify_hook must be callable .*got the class Collective"):
        agent(verify_hook=Collective)


@pytest.mark.parametrize("value", [0, -1.0, "soon", float("nan"), True])
def test_a_verify_timeout_that_is_not_a_positive_number_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="verify_timeout_s"):
        AgentConfig(server="127.0.0.1:1", job_id="j", verify_timeout_s=value)


@pytest.mark.parametrize("raw", ["0", "-5", "soon"])
def test_a_verify_timeout_from_the_environment_is_checked(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"verify_timeout_s|NICSWITCH_VERIFY_TIMEOUT_S"):
        AgentConfig.from_env({"NICSWITCH_VERIFY_TIMEOUT_S": raw}, server="127.0.0.1:1", job_id="j")
    assert AgentConfig.from_env({"NICSWITCH_VERIFY_TIMEOUT_S": "2.5"}, server="127.0.0.1:1",
                                job_id="j").verify_timeout_s == 2.5


def test_a_hook_that_runs_collectives_is_refused_in_pause_mode_external() -> None:
    refused = agent(pause="external", verify_hook=Collective())
    with pytest.raises(ConfigError) as info:
        refused.start()
    message = str(info.value)
    assert "verify_hook=Collective(...) runs collectives" in message and "pause mode external" in message
    assert "pause='agent'" in message
    assert refused.status()["state"] == "created"  # nothing was started
    agent(pause="external", verify_hook=Collective(), dry_run=True).start().stop()  # a dry run runs no hook


def test_a_refusal_in_pause_mode_auto_says_why_auto_chose_external(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user who never wrote 'external' must see what made it so (MindIO's TTP_PORT here)."""
    monkeypatch.setenv("TTP_PORT", "8000")
    with pytest.raises(ConfigError, match=r"external because pause='auto' and TTP_PORT is set"):
        agent(pause="auto", verify_hook=Collective()).start()


def test_a_collective_checkpoint_guard_is_refused_in_pause_mode_external(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    guard = TorchCheckpointGuard(tmp_path, state=dict, step=lambda: 1, use_dcp=True)
    with pytest.raises(ConfigError, match=r"checkpoint_hook=TorchCheckpointGuard\(\.\.\.\) runs collectives.*"
                                          r"use_dcp=False"):
        agent(pause="external", checkpoint_hook=guard).start()
    local = TorchCheckpointGuard(tmp_path, state=dict, step=lambda: 1, use_dcp=False)
    assert local.runs_collectives is False
    agent(pause="external", checkpoint_hook=local).start().stop()


def test_a_verify_hook_waiting_longer_than_verify_timeout_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"timeout_s=1\) must give up before verify_timeout_s=0.5"):
        agent(verify_hook=Collective(), verify_timeout_s=0.5).start()
    agent(verify_hook=Collective(), verify_timeout_s=2).start().stop()


def test_with_a_verify_hook_the_budget_counts_verify_timeout_twice() -> None:
    # 500 + 120 + 2 x 110 + 60 = 900: ClusterD would give up first. Without the verify phase it is 680 s.
    settings = {"guard_timeout_s": 500.0, "verify_timeout_s": 110.0}
    refused = agent(verify_hook=Collective(), **settings)
    with pytest.raises(ConfigError) as info:
        refused.start()
    message = str(info.value)
    assert message.startswith("with a verify hook, guard_timeout_s (500) + switch_timeout_s (120) + 2 x "
                              "verify_timeout_s (110) + reply_timeout_s (60) = 900 s must stay below ClusterD's 900 s "
                              "wait"), message
    assert message.endswith("lower verify_timeout_s to below 110 s, or lower the others"), message
    assert refused.status()["state"] == "created"  # nothing was started
    agent(**settings).start().stop()  # no verify hook: no verify phase
    agent(verify_hook=Collective(), **{**settings, "verify_timeout_s": 109.5}).start().stop()  # 899 s


def test_pause_auto_does_not_fall_back_to_external_with_a_hook_that_runs_collectives(
        caplog: pytest.LogCaptureFixture) -> None:
    """Next to MindIO's stand-in, pause mode auto falls back to external (test_edges_status.py),
    unless a hook runs collectives: off the training thread they would deadlock."""
    from test_edges_status import JOB as CONFLICT_JOB
    from test_edges_status import conflict_sim

    with conflict_sim() as conflict:
        fighting = SwitchAgent(server=conflict.address, job_id=CONFLICT_JOB, pause="auto", store=InProcessStore(),
                               switch_hook=lambda order: True, verify_hook=Collective()).start()
        try:
            assert support.wait_until(lambda: fighting.status().get("conflict") is not None, 20), fighting.status()
            status = fighting.status()
            assert status["pause"] == "agent" and "backing off" in status["conflict"]["action"], status
            # Logged by the agent when the process-manage client tells it, just after status shows the conflict
            assert support.wait_until(lambda: any(
                "not falling back to pause mode external: Collective run(s) collectives" in r.getMessage()
                for r in list(caplog.records) if r.levelname == "ERROR"), 20)
        finally:
            fighting.stop()
