"""TorchLinkProbe: unit tests on a one-rank gloo group in this process, and real 4-process jobs.

The jobs are tests/test_torch_multiprocess.py's (tests/torch_job/worker.py, gloo, the simulator
playing ClusterD) with ``NSW_VERIFY`` set: every rank's agent gets a TorchLinkProbe as its verify
hook, logged to the rank's hooks file (``warm-up`` and ``verify`` records).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_torch_multiprocess import EXIT_DONE, EXIT_STOPPED, FAILED, FINISH, JOB, Cluster, check_training

pytest.importorskip("torch")

from nicswitch_agent import ConfigError, SwitchOrder, TorchLinkProbe
from nicswitch_agent.hooks.torch_probe import ProbeFailed

EXIT_START = 5
ORDER = SwitchOrder(seq=7, job_id="j", ranks=(0,), ops=(True,))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.fixture
def one_rank_group() -> Iterator[Any]:
    """The default group of a one-rank gloo job in this process (destroyed afterwards)."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist
    finally:
        dist.destroy_process_group()


# -- one rank, in this process ----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"timeout_s": 0}, "timeout_s=0 must be a positive number"),
    ({"timeout_s": "5"}, "timeout_s='5' must be a positive number"),
    ({"groups": []}, "groups=[] must be a non-empty list"),
    ({"groups": "dp"}, "groups='dp' must be a non-empty list"),
    ({"names": ["a", "b"]}, "names=['a', 'b'] must name each of the 1 group"),
])
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TorchLinkProbe(**kwargs)


def test_check_needs_an_initialised_process_group() -> None:
    with pytest.raises(ConfigError, match=r"needs torch\.distributed initialised before agent\.start"):
        TorchLinkProbe().check()


def test_the_probe_replays_the_op_that_ran_before_the_switch_and_reports_each_group(one_rank_group: Any) -> None:
    dist = one_rank_group
    sub = dist.new_group([0])
    probe = TorchLinkProbe(groups=[None, sub], names=["default", "dp"], timeout_s=5)
    probe.check()
    assert probe.prepare(ORDER) is True  # the warm-up: the op exists before the switch
    assert probe(ORDER) is True
    report = probe.last
    assert report is not None and report.ok and report.seq == 7
    assert [(g.group, g.size, g.ok, g.detail) for g in report.groups] == [("default", 1, True, "ok"),
                                                                           ("dp", 1, True, "ok")]
    assert all(g.before_s is not None and g.after_s is not None for g in report.groups)
    assert report.as_dict()["groups"][1]["group"] == "dp"


def test_a_probe_without_a_warm_up_fails_rather_than_build_a_new_link(one_rank_group: Any) -> None:
    probe = TorchLinkProbe(timeout_s=5)
    with pytest.raises(ProbeFailed, match="never ran before the switch"):
        probe(ORDER)
    assert probe.last is not None and not probe.last.ok


def test_a_group_destroyed_on_this_rank_fails_at_once_naming_it(one_rank_group: Any) -> None:
    dist = one_rank_group
    sub = dist.new_group([0])
    probe = TorchLinkProbe(groups=[sub], names=["dp"], timeout_s=5)
    probe.prepare(ORDER)
    dist.destroy_process_group(sub)
    with pytest.raises(ProbeFailed, match="group dp: all_reduce on group dp failed after") as info:
        probe(ORDER)
    assert "object at 0x" not in str(info.value), info.value  # torch's repr of the group: named instead


def test_a_wrong_sum_fails(one_rank_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = TorchLinkProbe(timeout_s=5)
    probe.prepare(ORDER)
    import torch.distributed as dist

    real = dist.all_reduce

    def doubled(tensor: Any, **kwargs: Any) -> Any:
        work = real(tensor, **kwargs)
        tensor.mul_(2)  # a contribution that arrived twice
        return work

    monkeypatch.setattr(dist, "all_reduce", doubled)
    with pytest.raises(ProbeFailed, match="summed to 2, expected 1"):
        probe(ORDER)


# -- four real processes ------------------------------------------------------------------------

# Probe timeout below verify_timeout_s (start() refuses the opposite); short, for the failing case.
PROBE_ENV = {"NSW_VERIFY": "probe", "NSW_PROBE_TIMEOUT_S": "2", "NICSWITCH_VERIFY_TIMEOUT_S": "3"}


@pytest.mark.timeout(120)
def test_the_probe_succeeds_on_every_rank_after_each_switch(cluster: Cluster) -> None:
    job = cluster.job(4, env=PROBE_ENV)
    operator = cluster.op
    job.wait_ready()
    for ops in ([True, False], [False, False]):
        assert operator.switch("node-0", ["3", "0"], ops)[0] == FINISH
    job.wait_steps(max(job.last_step(r) for r in range(4)) + 10)
    assert job.stop() == [EXIT_DONE] * 4
    assert cluster.sim.job_view(JOB).replies == [True, True]
    for rank in range(4):
        warm = job.hooks(rank, "warm-up")
        switches, verifies = job.hooks(rank, "switch"), job.hooks(rank, "verify")
        # The op ran once, before the first switch, on the parked training thread.
        assert [(w["seq"], w["ran"], w["thread"]) for w in warm] == [(1, True, f"train-{rank}"), (2, False,
                                                                                                  f"train-{rank}")]
        assert warm[0]["t"] <= switches[0]["t"]
        assert [v["seq"] for v in verifies] == [1, 2]
        for verify, switch in zip(verifies, switches, strict=True):
            assert verify["thread"] == switch["thread"] == f"train-{rank}"  # where the switch hook ran
            assert verify["step"] == switch["step"]  # at the same parked step
            (group,) = verify["report"]["groups"]
            assert (group["group"], group["size"], group["ok"]) == ("default", 4, True)
            assert group["before_s"] > 0 and group["after_s"] > 0
        status = job.result(rank)["agent"]["last_verify"]
        assert status["ok"] and status["report"]["seq"] == 2, status
    check_training(job)


@pytest.mark.timeout(120)
def test_a_rank_whose_communicator_is_gone_after_its_switch_gives_false_within_verify_timeout(
        cluster: Cluster) -> None:
    """Rank 2's switch hook destroys the probe's group ("dp"): its probe fails at once, the other
    ranks' probes wait for rank 2 in vain and give up after timeout_s, their ops still pending. The
    reply is false; rolling the links back would not make that communicator usable again, so the
    leader offers no rollback (no retry, no recover) and ClusterD's pick stops training on every
    rank: no process resumes into a collective that hangs."""
    job = cluster.job(4, env={**PROBE_ENV, "NSW_VERIFY": "probe-subgroup", "NSW_BREAK_GROUP_RANK": "2"})
    sim, operator = cluster.sim, cluster.op
    job.wait_ready()
    message, took = operator.switch("node-0", ["1"], [True])
    assert message == FAILED
    assert took < 3 + 2 + 3, took  # verify_timeout_s, the leader's slack, margin for the reply
    assert sim.job_view(JOB).replies == [False]
    assert job.wait_exit(60) == [EXIT_STOPPED] * 4, "every rank stops (TrainingStopped), none hangs"
    picks = [s.changeStrategy for s in sim.job_view(JOB).signals_sent if s.signalType == "changeStrategy"]
    assert picks and not {"recover", "retry"} & set(picks), picks
    for rank in range(4):  # no rollback: the switch hook ran once, for the switch
        assert [(c["seq"], c["ops"]) for c in job.hooks(rank, "switch")] == [(1, [True])]
    # Rank 2 fails at once, and the leader decides at once: a rank that reads the verify event only
    # after that skips it (nobody waits for its answer); the others wait out the probe's timeout.
    reports = {r: job.hooks(r, "verify")[0]["report"]["groups"][0] for r in range(4) if job.hooks(r, "verify")}
    assert reports[2]["detail"].startswith("all_reduce on group dp failed after"), reports[2]
    assert not any(g["ok"] for g in reports.values())
    for rank in set(reports) - {2}:  # gave up waiting, or saw its peers leave as training stopped
        detail = reports[rank]["detail"]
        assert "did not complete within" in detail or "failed after" in detail, reports[rank]
        assert "group dp" in job.result(rank)["agent"]["last_verify"]["reason"]
    reason = job.result(0)["agent"]["last_switch"]["reason"]
    assert reason.startswith("verification failed: rank 2: ") and "group dp" in reason, reason


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("env", "hook"), [
    (PROBE_ENV, "verify_hook=LoggedProbe(...)"),
    # issue 18 item 2: the quickstart's collective guard against a MindIO that pauses nothing deadlocked
    ({"NSW_CHECKPOINT": "dcp"}, "checkpoint_hook=LoggedGuard(...)"),
], ids=["probe", "dcp-guard"])
def test_a_hook_that_runs_collectives_is_refused_at_start_in_pause_mode_external(
        cluster: Cluster, env: dict[str, str], hook: str) -> None:
    job = cluster.job(2, pause="external", env=env)
    codes = job.wait_exit(40)
    # Either rank may be refused first; once it is gone, the other may fail in init_process_group
    # (rank 1 without rank 0's Store; rank 0 in gloo's mesh, its peer gone: seen in CI) before it
    # reaches agent.start(). Either way one was refused for the hook and nothing runs on.
    assert None not in codes and EXIT_START in codes, codes
    reason = job.result(codes.index(EXIT_START))["reason"]
    assert reason.startswith(f"ConfigError: {hook} runs collectives"), reason
    assert "pause mode external" in reason and "pause='agent'" in reason


def test_the_probe_says_which_failures_leave_its_communicators_unusable() -> None:
    """A pending or failed op is unusable (training must not resume on it); a wrong sum or a group
    never warmed up is not (its collectives completed, or never ran)."""
    from nicswitch_agent.hooks.torch_probe import GroupProbe, ProbeReport, TorchLinkProbe

    probe = TorchLinkProbe()
    assert probe.communicators_unusable() is False  # no check yet
    cases = {
        "all_reduce on group default did not complete within 5 s; the communicator may be unusable": True,
        "all_reduce on group default failed after 0.1 ms: ValueError: Default process group has not been "
        "initialized": True,
        "all_reduce on group default summed to 3, expected 4 (one per rank)": False,
    }
    for detail, unusable in cases.items():
        probe._last = ProbeReport(1, False, (GroupProbe("default", 4, False, 0.001, None, detail),))
        assert probe.communicators_unusable() is unusable, detail
    probe._last = ProbeReport(1, False, (GroupProbe("default", 0, False, None, None, "never ran before the switch"),))
    assert probe.communicators_unusable() is False
    probe._last = ProbeReport(1, True, (GroupProbe("default", 4, True, 0.001, 0.001, "ok"),))
    assert probe.communicators_unusable() is False
