"""msrun's scheduler process runs the training script too, and is no rank of the job (issue 22).

msrun (MindSpore 2.10) starts it with MS_ROLE=MS_SCHED, RANK_ID=0 ("For Scheduler, 'RANK_ID' is
always 0"), MS_WORKER_NUM and no DEVICE_ID (config/frameworks.py, ``msrun_scheduler``). An agent
started there must not take rank 0 from it, must not lead, must not join the job's Store: its
``start()`` starts nothing and says why. These tests need no MindSpore (the env is msrun's; the
real msrun run is in tests/test_ms_multiprocess.py).
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest

from nicswitch_agent import AgentConfig, ConfigError, SwitchAgent
from nicswitch_agent.coordination import topology
from nicswitch_agent.sim import SimJob, Simulator

JOB = "job-msrun-sched"
# What msrun exports to its scheduler process (mindspore/parallel/cluster/process_entity/_api.py).
SCHEDULER_ENV = {"MS_ROLE": "MS_SCHED", "RANK_ID": "0", "MS_WORKER_NUM": "4", "RANK_SIZE": "4",
                 "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118", "MS_TOPO_TIMEOUT": "900"}


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes={"node-0": ["0", "1", "2", "3"]})])
    simulator.start()
    try:
        yield simulator
    finally:
        simulator.stop()


@pytest.mark.parametrize("framework", ["auto", "mindspore"])
def test_in_msruns_scheduler_start_starts_nothing(sim: Simulator, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture, framework: str) -> None:
    for name, value in {**SCHEDULER_ENV, "NICSWITCH_FRAMEWORK": framework}.items():
        monkeypatch.setenv(name, value)
    agent = SwitchAgent(server=sim.address, job_id=JOB, dry_run=True)
    assert agent.config.rank is None  # RANK_ID=0 is not this process's rank
    assert agent.start() is agent
    status = agent.status()
    assert (status["state"], status["role"], status["rank"]) == ("inactive", None, None)
    assert "msrun's scheduler process (MS_ROLE=MS_SCHED)" in status["reason"]
    lines = [r.getMessage() for r in caplog.records if r.name == "nicswitch_agent" and r.levelno == logging.INFO]
    assert lines == [f"nicswitch-agent inactive: {status['reason']}"]
    agent.step()  # training in the scheduler (if any) steps as ever
    view = sim.job_view(JOB)
    assert not view.inited and not view.registered and not any(view.stream_opens.values())
    agent.stop("training finished")
    assert agent.status()["state"] == "stopped"


def test_msrun_scheduler_env_gives_no_rank() -> None:
    env = {**SCHEDULER_ENV, "NICSWITCH_SERVER": "127.0.0.1:8899", "NICSWITCH_JOB_ID": JOB}
    for framework in ("auto", "mindspore"):
        cfg = AgentConfig.from_env({**env, "NICSWITCH_FRAMEWORK": framework})
        assert (cfg.rank, cfg.world_size) == (None, None)
    worker = AgentConfig.from_env({**env, "MS_ROLE": "MS_WORKER", "RANK_ID": "2"})  # a worker's are its own
    assert (worker.rank, worker.world_size) == (2, 4)


# What msrun exports to a worker on one of several nodes started without --node_rank: no RANK_ID
# until mindspore.communication.init() runs.
WORKER_ENV = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "16", "MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": "8118"}


def test_an_msrun_worker_whose_rank_is_unknown_is_refused_not_made_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every such process taking rank 0 would make the first rank of every node a leader."""
    for name in ("RANK", "RANK_ID", "NICSWITCH_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in WORKER_ENV.items():
        monkeypatch.setenv(name, value)
    agent = SwitchAgent(server="127.0.0.1:1", job_id=JOB, dry_run=True)
    with pytest.raises(ConfigError, match=r"RANK_ID not set.*mindspore\.communication\.init\(\)"):
        agent.start()
    assert agent.status()["state"] == "created"
    monkeypatch.setenv("RANK_ID", "9")
    assert topology.rank_and_world(SwitchAgent(server="127.0.0.1:1", job_id=JOB).config, leader_only=False) == (9, 16)


def test_after_mindspores_init_its_rank_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake ``mindspore.communication.management`` as init() leaves it (GlobalComm.INITED, get_rank)."""
    for name in ("RANK", "RANK_ID", "NICSWITCH_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in WORKER_ENV.items():
        monkeypatch.setenv(name, value)
    management = types.ModuleType("mindspore.communication.management")
    management.GlobalComm = types.SimpleNamespace(INITED=True)  # type: ignore[attr-defined]
    management.get_rank = lambda: 11  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mindspore.communication.management", management)
    assert topology.rank_and_world(SwitchAgent(server="127.0.0.1:1", job_id=JOB).config, leader_only=False) == (11, 16)
