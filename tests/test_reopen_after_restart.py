"""The agent reopens its streams within 2 s of a restarted ClusterD answering again (issue 18 item 8).

The soak's rare "did not reopen its streams on the restarted simulator within 60 s" was the
process-manage client's conflict backoff: three clean stream ends with no signal read as another
process-manage client fighting for the job's stream, and the agent then waits 15-30 s (doubling)
before subscribing again. The simulator's stop produced them (fixed: it ends streams with
UNAVAILABLE, as the real server does); the agent now also lets go of such evidence when ClusterD
goes away or forgets the job, because a restarted ClusterD has nobody fighting for the stream.

The time bound itself is the backoff schedule's: a pure-function check below. The other tests
use a real simulator, restarted on the same port, and count what the agent did.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from typing import Any

import pytest
import support

from nicswitch_agent import SwitchAgent
from nicswitch_agent._pb import recover_pb2 as pb
from nicswitch_agent.clusterd.channel import ChannelSettings, RecoverStub, open_channel
from nicswitch_agent.clusterd.rpc_policy import backoff_delays
from nicswitch_agent.config import AgentConfig
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(60)

JOB = "job-reopen"
NODES = {"node-0": ["0", "1"]}
SETTINGS = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, shuffle_nodes=False)
REOPEN_BOUND_S = 2.0  # docs/protocol.md#reconnecting-after-an-error-jittered-capped-backoff
GRPC_RECONNECT_JITTER = 0.2  # gRPC spreads each channel reconnect backoff by +-20 %
PROCESS_MANAGE = "SubscribeProcessManageSignal"

streams_ready = functools.partial(support.streams_ready, job=JOB)


# -- the bound: what the schedule would be after any number of failures ----------------------------


def test_with_the_defaults_no_wait_between_two_attempts_exceeds_the_reopen_bound() -> None:
    """Two waits sit between ClusterD answering again and the agent's next attempt, whichever
    comes last: the agent's own backoff after a failed subscribe ("not registed", UNAVAILABLE) and
    the channel's reconnect backoff while nothing answers. Both are capped by reconnect_max_s."""
    config = AgentConfig(server="127.0.0.1:8899", job_id=JOB)
    for seed in range(20):
        delays = list(itertools.islice(
            backoff_delays(config.reconnect_initial_s, config.reconnect_max_s, rng=random.Random(seed)), 200))
        assert max(delays) <= config.reconnect_max_s < REOPEN_BOUND_S, (seed, max(delays))
        assert delays[0] <= config.reconnect_initial_s  # a restarted ClusterD is ready in ~65 ms: retry soon
    options = dict(ChannelSettings(target="127.0.0.1:1", reconnect_initial_s=config.reconnect_initial_s,
                                   reconnect_max_s=config.reconnect_max_s).options())
    assert options["grpc.max_reconnect_backoff_ms"] / 1000 * (1 + GRPC_RECONNECT_JITTER) < REOPEN_BOUND_S


# -- a real simulator, restarted ---------------------------------------------------------------------


class Restartable:
    """Simulators one after the other on one port (a ClusterD restart)."""

    def __init__(self) -> None:
        self.sims: list[Simulator] = []
        self.port = 0

    def start(self, *, standin: bool = False, register_delay_s: float = 0.0) -> Simulator:
        sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=SETTINGS, port=self.port, standin=standin,
                        standin_register_delay_s=register_delay_s)
        sim.start()
        self.port = int(sim.address.rsplit(":", 1)[1])
        self.sims.append(sim)
        return sim

    def restart(self, **kwargs: Any) -> Simulator:
        self.sims[-1].stop()
        return self.start(**kwargs)

    def close(self) -> None:
        for sim in self.sims:
            sim.stop()


@pytest.fixture
def clusterd() -> Iterator[Restartable]:
    restartable = Restartable()
    yield restartable
    restartable.close()


@pytest.fixture
def agents() -> Iterator[list[SwitchAgent]]:
    started: list[SwitchAgent] = []
    yield started
    for agent in started:
        agent.stop("test done")


def leader(sim: Simulator, agents: list[SwitchAgent], **kwargs: Any) -> SwitchAgent:
    """Pause mode agent, a conflict backoff far longer than any test waits."""
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1, conflict_backoff_s=300.0,
                        conflict_backoff_max_s=300.0, **kwargs)
    agents.append(agent.start())
    return agent


def test_a_conflict_backoff_ends_when_clusterd_restarts(clusterd: Restartable, agents: list[SwitchAgent]) -> None:
    """The agent next to a stand-in (a second process-manage client) detects the fight and backs
    off for 150-300 s. ClusterD restarts, without the stand-in: the agent registers with the new
    one and holds both streams, without waiting out its backoff."""
    first = clusterd.start(standin=True)
    agent = leader(first, agents)
    assert support.wait_until(lambda: agent.status()["conflict"] is not None, 20), agent.status()
    second = clusterd.restart()
    assert second.wait_until(streams_ready, 20), (agent.status(), second.job_view(JOB).open_streams)
    view = second.job_view(JOB)
    assert view.registered and view.stream_opens[PROCESS_MANAGE] == 1 and view.violations == []
    assert agent.status()["conflict"] is None


def test_quiet_ends_before_a_restart_do_not_count_after_it(clusterd: Restartable, agents: list[SwitchAgent]) -> None:
    """Two foreign subscribes end the agent's stream twice with no signal; ClusterD restarts;
    one more foreign subscribe on the new one. Three quiet ends within the window, but a restart
    between them: no conflict, the agent holds its stream."""
    sim = clusterd.start()
    agent = leader(sim, agents)
    assert sim.wait_until(streams_ready, 20)
    foreign(sim, times=2)
    sim = clusterd.restart()
    assert sim.wait_until(streams_ready, 20)
    foreign(sim, times=1)
    assert sim.wait_until(streams_ready, 20), (agent.status(), sim.job_view(JOB).open_streams)
    status = agent.status()
    assert status["process_manage"]["quiet_resets"] == 3
    assert status["conflict"] is None, status["conflict"]


def test_pause_external_not_registered_until_mindio_registers_again(clusterd: Restartable,
                                                                   agents: list[SwitchAgent]) -> None:
    """Pause mode external: ClusterD restarts and answers "not registed" until MindIO (the
    stand-in) registers the job again, 1 s later. The agent keeps asking, paced by its backoff,
    and is subscribed once the job is known: one loss, one restore, as events."""
    sim = clusterd.start(standin=True)
    events = support.Events()
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=lambda order: True,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1, on_event=events)
    agents.append(agent.start())
    assert sim.wait_until(notify_open, 20)
    sim = clusterd.restart(standin=True, register_delay_s=1.0)
    assert sim.wait_until(lambda s: s.job_view(JOB).registered and notify_open(s), 20), agent.status()
    subscriber = agent._session.subscriber if agent._session is not None else None
    assert subscriber is not None and subscriber.job_unknown >= 1  # it asked while the job was unknown
    assert events.wait_for(lambda: len(events.of("stream_restored")) == 1, 10), events.kinds
    assert len(events.of("stream_lost")) == 1  # one event per loss, not per attempt
    assert sim.job_view(JOB).violations == []


def notify_open(sim: Simulator) -> bool:
    return sim.job_view(JOB).open_streams["SubscribeNotifySwitch"] == 1


def foreign(sim: Simulator, *, times: int) -> None:
    """Another process-manage client subscribes ``times`` times, each after the agent took the
    stream back (every subscribe resets the job and ends the other client's stream, cleanly)."""
    channel = open_channel(ChannelSettings(target=sim.address))
    try:
        for _ in range(times):
            opens = sim.job_view(JOB).stream_opens[PROCESS_MANAGE]
            call = RecoverStub(channel).SubscribeProcessManageSignal(pb.ClientInfo(jobId=JOB, role="other"),
                                                                     timeout=20)
            for _signal in call:  # keep-alives, until the agent's next subscribe ends this stream
                pass
            assert sim.job_view(JOB).stream_opens[PROCESS_MANAGE] >= opens + 2
    finally:
        channel.close()
