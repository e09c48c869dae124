"""Event listeners for operators: JSON lines, status timings and Prometheus, after a real switch."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import support
from support import Events, Trainer

from nicswitch_agent import SwitchAgent, SwitchOrder
from nicswitch_agent.coordination import InProcessStore
from nicswitch_agent.errors import ConfigError
from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.observability.links import LinkMap, compact_ranks, format_links
from nicswitch_agent.observability.metrics import PHASES, RANK_KINDS, EventStats, JsonlEventSink, PrometheusMetrics
from nicswitch_agent.sim import SimJob, SimSettings, Simulator

pytestmark = pytest.mark.timeout(30)

JOB = "job-metrics"
NODES = {"node-0": ["0", "1"]}
FAST = SimSettings(report_timeout_s=20.0, keepalive_interval_s=0.5, fault_flush_s=0.01, force_release_s=0.01,
                   schedule_wait_s=0.01, restart_wait_s=0.01, shuffle_nodes=False)


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=FAST)
    simulator.start()
    try:
        yield simulator
    finally:
        simulator.stop()


def switch_streams_open(sim: Simulator) -> bool:
    return sim.job_view(JOB).open_streams.get(support.NOTIFY, 0) == 1


def run_one_switch(sim: Simulator, *listeners: Any) -> Events:
    """A real agent (pause mode agent) and one failover of rank 0 (the job's only rank), with ``listeners`` attached."""
    kinds = Events()

    def hook(order: SwitchOrder) -> bool:
        return True

    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=hook, on_event=kinds,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1)
    for listener in listeners:
        agent.add_listener(listener)
    agent.start()
    try:
        with Trainer(agent):
            assert sim.wait_until(switch_streams_open, 10)
            assert support.operator_switch(sim.address, JOB, ["0"], [True]) == "switch nic finish"
            assert kinds.wait_all("reply_sent", "resumed")
    finally:
        agent.stop()
    return kinds


def test_stream_up_is_1_on_a_healthy_leader_before_any_switch_and_0_once_clusterd_is_gone(sim: Simulator) -> None:
    """Found by an outside check: the gauge had no value until a first loss, so an alert on
    ``== 0`` saw nothing and a dashboard had no data for every healthy job."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", dry_run=True,
                        on_event=PrometheusMetrics(registry), reconnect_initial_s=0.02, reconnect_max_s=0.1)
    agent.start()
    try:
        assert sim.wait_until(switch_streams_open, 10)  # the server's side; the client's open is told a moment later
        assert support.wait_until(lambda: registry.get_sample_value("nicswitch_stream_up", {"job": JOB}) == 1, 20)
        sim.stop()
        assert support.wait_until(lambda: registry.get_sample_value("nicswitch_stream_up", {"job": JOB}) == 0, 20)
    finally:
        agent.stop()


# -- after a real switch ------------------------------------------------------------------------------


def test_jsonl_stats_and_prometheus_after_a_real_switch(sim: Simulator, tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    sink = JsonlEventSink(tmp_path / "events-{rank}.jsonl", rank=0)
    stats = EventStats()
    metrics = PrometheusMetrics(registry)
    kinds = run_one_switch(sim, sink, stats, metrics)
    sink.close()

    # JSON lines: one per event, with job, rank, sequence and timings. Events of two threads at once
    # (the training thread's "resumed", the subscriber's "subscribed") reach each listener in
    # whichever order those threads run (seen on CI): compare in the events' own time order.
    lines = (tmp_path / "events-0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["kind"] for r in sorted(records, key=lambda r: r["mono"])] == \
        [e.kind for e in sorted(kinds.events, key=lambda e: e.mono)]
    assert sink.lines == len(records) and sink.errors == 0
    assert all(r["job_id"] == JOB and r["rank"] == 0 and r["time"].endswith("Z") for r in records)
    by_kind = {r["kind"]: r for r in records}
    for kind in ("list_received", "parked", "member_result", "switch_done", "reply_sent", "resumed"):
        assert kind in by_kind, kind
    assert by_kind["list_received"]["seq"] == by_kind["switch_done"]["seq"] == by_kind["reply_sent"]["seq"] == 1
    assert by_kind["switch_done"]["detail"]["ok"] is True and by_kind["switch_done"]["detail"]["duration_s"] > 0
    assert by_kind["reply_sent"]["detail"]["outcome"] == "delivered"
    assert by_kind["list_received"]["mono"] <= by_kind["reply_sent"]["mono"]

    # Timings for status().
    snap = stats.snapshot()
    assert snap["switch_s"]["count"] == 1 and snap["reply_latency_s"]["count"] == 1
    assert snap["reply_latency_s"]["last"] >= snap["switch_s"]["last"] > 0
    assert snap["pause_s"]["count"] == 1 and snap["rank_switch_s"]["count"] == 1

    # Prometheus, read from the registry.
    def value(name: str, **labels: str) -> float | None:
        result: float | None = registry.get_sample_value(name, {"job": JOB, **labels})
        return result

    assert value("nicswitch_lists_received_total") == 1
    assert value("nicswitch_lists_rejected_total") in (None, 0)
    assert value("nicswitch_switches_total", result="ok") == 1
    assert value("nicswitch_switches_total", result="failed") in (None, 0)
    assert value("nicswitch_replies_total", result="delivered") == 1
    assert value("nicswitch_rank_results_total", kind="switch", result="ok") == 1
    assert value("nicswitch_switch_duration_seconds_count") == 1
    assert value("nicswitch_reply_latency_seconds_count") == 1
    assert value("nicswitch_pause_duration_seconds_count") == 1
    assert value("nicswitch_rank_duration_seconds_count", kind="switch") == 1
    assert value("nicswitch_stream_up") == 0  # the agent has stopped
    # A PrometheusMetrics of one's own knows only this process's rank (rank 0, moved to its standby link).
    links = [s for f in registry.collect() if f.name == "nicswitch_link_standby" for s in f.samples]
    assert [(s.labels["rank"], s.value) for s in links] == [("0", 1.0)]
    decided = value("nicswitch_last_switch_timestamp_seconds")
    assert decided is not None and by_kind["list_received"]["wall"] <= decided <= by_kind["reply_sent"]["wall"]
    assert value("nicswitch_phase_duration_seconds_count", phase="switch") == 1


def test_metrics_endpoint_serves_the_registry_and_closes() -> None:
    pytest.importorskip("prometheus_client")
    metrics = PrometheusMetrics()
    metrics(AgentEvent(kind="list_received", job_id=JOB, seq=1))
    port = metrics.start_http_server(0, "127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="already running"):
            metrics.start_http_server(0, "127.0.0.1")
        assert f'nicswitch_lists_received_total{{job="{JOB}"}} 1.0' in scrape(port)
    finally:
        metrics.close()
    with pytest.raises(urllib.error.URLError):  # closed: nobody listens on the port any more
        scrape(port)
    metrics.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_a_prometheus_client_whose_server_cannot_be_stopped_is_refused_before_binding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    metrics = PrometheusMetrics()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.1")
    port = support.free_port()
    try:
        with pytest.raises(ConfigError, match=r"prometheus_client>=0.20 \(installed: 0.19.1\)"):
            metrics.start_http_server(port, "127.0.0.1")
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing was bound
    finally:
        metrics.close()


def test_two_instances_do_not_clash_by_default() -> None:
    pytest.importorskip("prometheus_client")
    PrometheusMetrics()
    PrometheusMetrics()


def test_rejected_and_failed_paths_are_counted() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    for event in (
        AgentEvent(kind="list_rejected", job_id=JOB, seq=1, mono=10.0),
        AgentEvent(kind="reply_failed", job_id=JOB, seq=1, mono=10.5, detail={"duration_s": 0.5}),
        AgentEvent(kind="switch_done", job_id=JOB, seq=2, detail={"ok": False, "duration_s": 2.0}),
        AgentEvent(kind="stream_lost", job_id=JOB),
        AgentEvent(kind="pause_failed", job_id=JOB, detail={"reason": "rank(s) 3 did not park", "duration_s": 2.0}),
        AgentEvent(kind="list_ignored", job_id=JOB),
        AgentEvent(kind="switch_done", job_id=JOB, seq=3, detail={"ok": True, "duration_s": "junk"}),
    ):
        metrics(event)
    assert registry.get_sample_value("nicswitch_lists_received_total", {"job": JOB}) == 1
    assert registry.get_sample_value("nicswitch_lists_rejected_total", {"job": JOB}) == 1
    assert registry.get_sample_value("nicswitch_lists_ignored_total", {"job": JOB}) == 1
    assert registry.get_sample_value("nicswitch_replies_total", {"job": JOB, "result": "failed"}) == 1
    assert registry.get_sample_value("nicswitch_switches_total", {"job": JOB, "result": "failed"}) == 1
    assert registry.get_sample_value("nicswitch_switches_total", {"job": JOB, "result": "ok"}) == 1
    assert registry.get_sample_value("nicswitch_switch_duration_seconds_count", {"job": JOB}) == 1  # junk skipped
    assert registry.get_sample_value("nicswitch_reply_latency_seconds_sum", {"job": JOB}) == pytest.approx(0.5)
    assert registry.get_sample_value("nicswitch_stream_losses_total", {"job": JOB}) == 1
    assert registry.get_sample_value("nicswitch_pause_failures_total", {"job": JOB}) == 1
    assert registry.get_sample_value("nicswitch_stream_up", {"job": JOB}) == 0


ZERO_AT_START = (
    'nicswitch_switches_total{job="%s",result="ok"} 0.0',
    'nicswitch_switches_total{job="%s",result="failed"} 0.0',
    'nicswitch_replies_total{job="%s",result="delivered"} 0.0',
    'nicswitch_replies_total{job="%s",result="failed"} 0.0',
    'nicswitch_lists_received_total{job="%s"} 0.0',
    'nicswitch_lists_rejected_total{job="%s"} 0.0',
    'nicswitch_lists_ignored_total{job="%s"} 0.0',
    'nicswitch_stream_losses_total{job="%s"} 0.0',
    'nicswitch_pause_failures_total{job="%s"} 0.0',
    'nicswitch_switch_duration_seconds_count{job="%s"} 0.0',
    'nicswitch_reply_latency_seconds_count{job="%s"} 0.0',
    'nicswitch_pause_duration_seconds_count{job="%s"} 0.0',
    *(f'nicswitch_rank_results_total{{job="%s",kind="{kind}",result="{result}"}} 0.0'
      for kind in RANK_KINDS for result in ("ok", "failed")),
    *(f'nicswitch_rank_duration_seconds_count{{job="%s",kind="{kind}"}} 0.0' for kind in RANK_KINDS),
    *(f'nicswitch_phase_duration_seconds_count{{job="%s",phase="{phase}"}} 0.0' for phase in PHASES),
)


def missing_zeros(registry: Any, job: str) -> list[str]:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return [line % job for line in ZERO_AT_START if line % job not in text.splitlines()]


def test_every_known_series_is_0_from_the_first_event_so_the_first_failure_is_an_increase() -> None:
    """``increase(nicswitch_switches_total{result="failed"}[1h]) > 0`` must fire on the first
    failure: a series that first appears at 1 has no increase."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    assert len(missing_zeros(registry, JOB)) == len(ZERO_AT_START)  # no job known yet
    metrics(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "leader", "rank": 0}))
    assert missing_zeros(registry, JOB) == []
    metrics(AgentEvent(kind="switch_done", job_id=JOB, seq=1, detail={"ok": False, "duration_s": 2.0}))
    assert registry.get_sample_value("nicswitch_switches_total", {"job": JOB, "result": "failed"}) == 1
    assert registry.get_sample_value("nicswitch_switches_total", {"job": JOB, "result": "ok"}) == 0
    metrics(AgentEvent(kind="agent_started", job_id=JOB))  # a job seen again keeps its counts
    assert registry.get_sample_value("nicswitch_switches_total", {"job": JOB, "result": "failed"}) == 1


def test_a_job_given_at_construction_has_its_series_at_0_before_any_event() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    PrometheusMetrics(registry, job=JOB)
    assert missing_zeros(registry, JOB) == []


def test_the_rank_kinds_made_at_0_are_the_order_kinds_ranks_run() -> None:
    from nicswitch_agent.coordination import messages

    kinds = {value for name, value in vars(messages).items() if name.startswith("KIND_")}
    assert set(RANK_KINDS) == kinds


def test_missing_prometheus_client_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"pip install '\.\[metrics\]' in the nicswitch-agent checkout"):
        PrometheusMetrics()


# -- JSON lines ------------------------------------------------------------------------------------------


def test_jsonl_never_raises_and_logs_each_error_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nicswitch_agent.metrics")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the events file's directory should be")
    sink = JsonlEventSink(blocker / "events.jsonl")
    for _ in range(3):
        sink(AgentEvent(kind="stream_lost", job_id=JOB))
    assert sink.errors == 3 and sink.lines == 0
    assert caplog.text.count("events file") == 1
    blocker.unlink()
    blocker.mkdir()
    sink(AgentEvent(kind="stream_restored", job_id=JOB))  # the open is retried
    assert sink.lines == 1
    sink.close()
    sink(AgentEvent(kind="stream_lost", job_id=JOB))  # after close: dropped
    sink.close()
    assert len((blocker / "events.jsonl").read_text().splitlines()) == 1


def test_jsonl_makes_the_events_files_directory(tmp_path: Path) -> None:
    """A fresh pod has no /var/log/nicswitch/: the events of a whole run were lost with one WARNING."""
    sink = JsonlEventSink(tmp_path / "new" / "dir" / "events-{rank}.jsonl", rank=3)
    sink(AgentEvent(kind="stream_lost", job_id=JOB))
    sink.close()
    assert sink.errors == 0
    assert len((tmp_path / "new" / "dir" / "events-3.jsonl").read_text().splitlines()) == 1


def test_jsonl_rank_is_read_at_each_event_and_lines_never_interleave(tmp_path: Path) -> None:
    rank: list[int | None] = [None]
    sink = JsonlEventSink(tmp_path / "e.jsonl", rank=lambda: rank[0])
    sink(AgentEvent(kind="agent_started", job_id=JOB))
    rank[0] = 5
    big = {"blob": "x" * 20_000}  # longer than any pipe or stdio buffer

    def emit(i: int) -> None:
        for n in range(50):
            sink(AgentEvent(kind="member_result", job_id=JOB, seq=n, detail={"thread": i, **big}))

    threads = [threading.Thread(target=emit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    records = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(records) == 1 + 8 * 50
    assert records[0]["rank"] is None and all(r["rank"] == 5 for r in records[1:])


def test_event_stats_pair_replies_with_their_lists() -> None:
    stats = EventStats()
    stats(AgentEvent(kind="list_received", job_id=JOB, seq=1, mono=100.0))
    stats(AgentEvent(kind="list_received", job_id=JOB, seq=2, mono=101.0))
    stats(AgentEvent(kind="reply_sent", job_id=JOB, seq=2, mono=101.25, detail={"duration_s": 0.01}))
    stats(AgentEvent(kind="reply_sent", job_id=JOB, seq=1, mono=102.0, detail={"duration_s": 0.02}))
    stats(AgentEvent(kind="stream_lost", job_id=JOB))
    snap = stats.snapshot()
    assert snap["reply_latency_s"] == {"count": 2, "last": 2.0, "max": 2.0, "mean": 1.125}
    assert snap["reply_rpc_s"]["count"] == 2 and snap["stream_losses"] == 1


# -- once the agent is wired -------------------------------------------------------------------------------

def test_agent_writes_its_events_file_and_timings_when_configured(sim: Simulator, tmp_path: Path) -> None:
    kinds = Events()
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=lambda order: True,
                        on_event=kinds, events_file=str(tmp_path / "{job}-{rank}.jsonl"),
                        reconnect_initial_s=0.02, reconnect_max_s=0.1)
    agent.start()
    try:
        with Trainer(agent):
            assert sim.wait_until(switch_streams_open, 10)
            assert support.operator_switch(sim.address, JOB, ["0"], [True]) == "switch nic finish"
            assert kinds.wait_all("reply_sent", "resumed")
        timings = agent.status()["timings"]
        assert timings["switch_s"]["count"] == 1 and timings["reply_latency_s"]["count"] == 1
    finally:
        agent.stop()
    records = [json.loads(line) for line in (tmp_path / f"{JOB}-0.jsonl").read_text().splitlines()]
    written = [r["kind"] for r in records]
    # Every event the listener saw, and no other. Events of different threads at the same moment
    # (a stream reopening while training parks) may reach two listeners in either order; what
    # follows from what keeps its order.
    assert sorted(written) == sorted(kinds.kinds)
    # agent_started is emitted as start() returns: the streams it opened may say "subscribed" first
    # (CI saw it under load), and nothing else.
    assert next(kind for kind in written if kind != "subscribed") == "agent_started", written
    assert written[-1] == "agent_stopped", written
    chain = ["pause_requested", "list_received", "reply_sent"]
    assert [kind for kind in written if kind in chain] == chain, written
    # The resume follows ClusterD's continue, which follows the reply reaching ClusterD; but
    # reply_sent is emitted once the reply's call returns, and the continue can come in first on
    # the other stream (CI saw resumed before reply_sent). Both follow the list.
    assert written.index("resumed") > written.index("list_received"), written


def test_metrics_port_without_prometheus_client_refuses_to_start_the_leader_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    leader = SwitchAgent(server="127.0.0.1:1", job_id=JOB, metrics_port=0, dry_run=True, pause="external")
    with pytest.raises(ConfigError, match=r"pip install '\.\[metrics\]'"):
        leader.start()
    assert leader.status()["state"] == "created"  # nothing half-started
    # A member serves no metrics: the same settings (one env for the whole job) start it.
    member = SwitchAgent(server="127.0.0.1:1", job_id=JOB, metrics_port=0, dry_run=True, pause="external",
                         rank=1, world_size=2, store=InProcessStore())
    member.start()
    try:
        assert member.status()["role"] == "member"
    finally:
        member.stop()


def test_the_leader_serves_metrics_on_its_port_until_it_stops(sim: Simulator) -> None:
    pytest.importorskip("prometheus_client")
    port = support.free_port()
    agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", dry_run=True, metrics_port=port,
                        reconnect_initial_s=0.02, reconnect_max_s=0.1)
    before = set(threading.enumerate())
    agent.start()
    try:
        body = scrape(port)  # serving once start() returns
        assert "# TYPE nicswitch_switches_total counter" in body
        assert "nicswitch-metrics-http" in {t.name for t in set(threading.enumerate()) - before}
    finally:
        agent.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    assert "nicswitch-metrics-http" not in {t.name for t in set(threading.enumerate()) - before}


def test_a_metrics_port_in_use_is_logged_and_the_leader_runs_on(sim: Simulator,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("prometheus_client")
    caplog.set_level(logging.ERROR, logger="nicswitch_agent.agent")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = SwitchAgent(server=sim.address, job_id=JOB, pause="external", dry_run=True, metrics_port=port,
                            reconnect_initial_s=0.02, reconnect_max_s=0.1)
        agent.start()
        try:
            assert agent.status()["state"] == "running"
            assert f"Prometheus metrics not served on port {port}" in caplog.text
        finally:
            agent.stop()


# -- links, phases and the last switch ---------------------------------------------------------------------


class RankHook:
    """A switch hook scripted per call (True by default). ``gate``: a call with these ops sets
    :attr:`gated` and waits for the event (a rank may skip an order another rank already failed,
    so calls are told apart by their ops, not their number)."""

    def __init__(self, results: list[bool] | None = None,
                 gate: tuple[tuple[bool, ...], threading.Event] | None = None,
                 seen: tuple[tuple[bool, ...], threading.Event] | None = None) -> None:
        self.results = list(results or [])
        self.gate = gate
        self.seen = seen  # a call with these ops sets the event
        self.calls: list[tuple[tuple[int, ...], tuple[bool, ...]]] = []
        self.gated = threading.Event()

    def __call__(self, order: SwitchOrder) -> bool:
        self.calls.append((order.ranks, order.ops))
        if self.seen is not None and self.seen[0] == order.ops:
            self.seen[1].set()
        if self.gate is not None and self.gate[0] == order.ops:
            self.gated.set()
            assert self.gate[1].wait(20)
        return self.results.pop(0) if self.results else True


class TwoRanks:
    """Ranks 0 (the leader, serving metrics on ``port``) and 1 as threads on one in-process Store,
    each with its own training loop; pause mode agent against the simulator. :attr:`events` are
    told each event after the agent's own listeners (status, metrics) have taken it."""

    def __init__(self, sim: Simulator, hooks: list[RankHook], **settings: Any) -> None:
        store = InProcessStore()
        self.port = support.free_port()
        self.events = [Events(), Events()]
        self.agents = [
            SwitchAgent(server=sim.address, job_id=JOB, pause="agent", switch_hook=hooks[r], store=store, rank=r,
                        world_size=2, local_world_size=2, reconnect_initial_s=0.02,
                        reconnect_max_s=0.1, **({"metrics_port": self.port} if r == 0 else {}), **settings)
            for r in range(2)
        ]
        self.trainers = [Trainer(agent) for agent in self.agents]
        for agent, events in zip(self.agents, self.events, strict=True):
            agent.start()
            agent.add_listener(events)
        for trainer in self.trainers:
            trainer.start()

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.stop()
        for agent in self.agents:
            agent.stop()


def scraped(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, parsed by prometheus_client: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(scrape(port)) for s in family.samples}


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted({"job": JOB, **labels}.items()))))


def standby_gauges(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """rank -> nicswitch_link_standby, checking the node and device labels on the way."""
    out = {}
    for (name, labels), value in samples.items():
        if name == "nicswitch_link_standby":
            by = dict(labels)
            assert by["node"] == str(int(by["rank"]) // 2) and by["device"] == str(int(by["rank"]) % 2), by
            out[by["rank"]] = value
    return out


def test_link_gauges_phases_and_last_switch_on_the_leaders_endpoint_after_real_switches(
        sim: Simulator, tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    job = TwoRanks(sim, [RankHook(), RankHook()], checkpoint_hook=lambda order: None,
                   status_file=str(tmp_path / "status-{rank}.json"))
    try:
        assert sim.wait_until(switch_streams_open, 10)
        before = scraped(job.port)
        assert standby_gauges(before) == {"0": 0.0, "1": 0.0}  # every rank of the job, on its primary link
        assert sample(before, "nicswitch_links_uncertain") == 0
        assert sample(before, "nicswitch_last_switch_timestamp_seconds") is None

        started = time.time()
        assert support.operator_switch(sim.address, JOB, ["1"], [True]) == "switch nic finish"
        assert job.events[0].wait_all("reply_sent", "resumed") and job.events[1].wait_all("switch_outcome")
        after = scraped(job.port)
        assert standby_gauges(after) == {"0": 0.0, "1": 1.0}
        assert started <= sample(after, "nicswitch_last_switch_timestamp_seconds") <= time.time()  # type: ignore[operator]
        for phase in ("pause", "guard", "switch", "reply"):
            assert sample(after, "nicswitch_phase_duration_seconds_count", phase=phase) == 1, phase
            assert sample(after, "nicswitch_phase_duration_seconds_bucket", phase=phase, le="+Inf") == 1, phase
        assert sample(after, "nicswitch_phase_duration_seconds_count", phase="verify") == 0  # no verify hook

        # status(): every rank on the leader, its own on a member; the status command's line.
        leader, member = (agent.status()["links"] for agent in job.agents)
        assert {k: leader[k] for k in ("ranks", "primary", "standby", "standby_ranks", "uncertain")} == {
            "ranks": 2, "primary": 1, "standby": 1, "standby_ranks": "1", "uncertain": 0}
        assert leader["last_switch"]["seq"] == 1 and leader["last_switch"]["ok"] is True
        assert leader["last_switch"]["age_s"] >= 0
        assert (member["ranks"], member["standby"], member["standby_ranks"]) == (1, 1, "1")
        assert member["last_switch"]["seq"] == 1

        assert sim.wait_until(switch_streams_open, 10)
        assert support.operator_switch(sim.address, JOB, ["1"], [False]) == "switch nic finish"
        assert job.events[0].wait("reply_sent", 2) and job.events[1].wait("switch_outcome", 2)
        back = scraped(job.port)
        assert standby_gauges(back) == {"0": 0.0, "1": 0.0}
        assert sample(back, "nicswitch_phase_duration_seconds_count", phase="switch") == 2
        assert job.agents[1].status()["links"]["standby"] == 0
    finally:
        job.close()
    out = status_command(tmp_path / "status-0.json")
    assert "links       2 primary, 0 standby; last switch #2 ok " in out, out


def status_command(path: Path) -> str:
    import argparse
    import contextlib
    import io

    from nicswitch_agent.ops import status_cli

    parser = argparse.ArgumentParser()
    status_cli.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status_cli.run(parser.parse_args(["--file", str(path)]))
    return out.getvalue()


def test_a_failed_switch_leaves_its_ranks_uncertain_until_the_rollback_puts_the_gauges_back() -> None:
    pytest.importorskip("prometheus_client")
    sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES, recover_strategies=("recover",))], settings=FAST)
    sim.start()
    rollback, switching = threading.Event(), threading.Event()
    # rank 0: ok, ok (rank 1 fails only once rank 0 is in its hook: it does not skip the order),
    # then its rollback waits for the test; rank 1: ok, fails, rolls back.
    hooks = [RankHook(gate=((False, True), rollback), seen=((True, False), switching)),
             RankHook(results=[True, False, True], gate=((True, False), switching))]
    job = TwoRanks(sim, hooks)
    try:
        assert sim.wait_until(switch_streams_open, 10)
        assert support.operator_switch(sim.address, JOB, ["1"], [True]) == "switch nic finish"
        assert job.events[0].wait("resumed", 1) and job.events[1].wait("switch_outcome", 1)
        assert standby_gauges(scraped(job.port)) == {"0": 0.0, "1": 1.0}

        assert sim.wait_until(lambda s: support.idle(s, JOB), 10)
        assert support.operator_switch(sim.address, JOB, ["0", "1"], [True, False]).startswith("switch nic failed")
        assert hooks[0].gated.wait(20), "no rollback"
        assert hooks[0].calls[-1] == ((0, 1), (False, True))  # back to where they were
        # Between the failure and the rollback: rank 0's hook returned True, so it is on standby
        # (whether the leader read its result before rank 1's failure or learns it from rank 0's
        # own outcome); rank 1, whose hook failed, is in doubt, counted on the link known before.
        assert job.events[0].wait_for(lambda: any(e.detail.get("moved") for e in job.events[0].of("switch_outcome")))
        during = scraped(job.port)
        assert standby_gauges(during) == {"0": 1.0, "1": 1.0}
        assert sample(during, "nicswitch_links_uncertain") == 1
        assert job.agents[0].status()["links"]["uncertain_ranks"] == "1"
        assert job.events[1].wait("switch_outcome", 2)
        assert job.agents[1].status()["links"]["uncertain"] == 1  # the member's own rank
        rollback.set()

        assert job.events[0].wait("resumed", 2), "training did not resume after the rollback"
        assert job.events[1].wait_for(lambda: any(e.detail.get("kind") == "rollback" for e in job.events[1].of(
            "switch_outcome")))
        after = scraped(job.port)
        assert standby_gauges(after) == {"0": 0.0, "1": 1.0}
        assert sample(after, "nicswitch_links_uncertain") == 0
        assert sample(after, "nicswitch_switches_total", result="failed") == 1
        leader, member = (agent.status()["links"] for agent in job.agents)
        assert (leader["standby_ranks"], leader["uncertain"]) == ("1", 0)
        assert leader["last_switch"]["seq"] == 2 and leader["last_switch"]["ok"] is False
        assert (member["standby"], member["uncertain"]) == (1, 0)
    finally:
        rollback.set()
        job.close()
        sim.stop()


def test_a_list_that_comes_after_training_resumed_moves_no_link_and_leaves_none_uncertain() -> None:
    """An outside check: the list came after the ranks had stopped waiting for it (max_parked_s) and
    training had resumed; every rank refused it before any hook ("no longer parked"), yet status
    called rank 1 UNCERTAIN ("a failed switch's hooks ran on them") on rank 1, whose own
    switch_outcome named a link although nothing ran there, and on the leader though rank 1's own
    refusal had decided the order."""
    sim = Simulator(jobs=[SimJob(job_id=JOB, nodes=NODES)], settings=dataclasses.replace(FAST, list_delay_s=3.0))
    sim.start()
    hooks = [RankHook(), RankHook()]
    job = TwoRanks(sim, hooks, max_parked_s=1.0)
    try:
        assert sim.wait_until(switch_streams_open, 10)
        assert support.operator_switch(sim.address, JOB, ["1"], [True]).startswith("switch nic failed")
        assert job.events[1].wait_for(lambda: any(e.detail.get("kind") == "switch"
                                                  for e in job.events[1].of("switch_outcome")), 20)
        (told,) = [e for e in job.events[1].of("switch_outcome") if e.detail.get("kind") == "switch"]
        assert told.detail["link"] is None and told.detail["moved"] is False, told.detail
        assert "no longer parked" in told.detail["reason"], told.detail
        assert hooks[0].calls == hooks[1].calls == []  # no hook ran anywhere
        leader, member = (agent.status()["links"] for agent in job.agents)
        assert (member["uncertain"], member["standby"]) == (0, 0), member
        # The leader knows what it read before the first refusal decided: rank 1's own (it stays
        # where it was), or rank 0's, and then rank 1 is unheard and in doubt.
        assert leader["standby"] == 0, leader
        assert leader["uncertain_ranks"] == ("" if told.detail["reason"].startswith("rank 1:") else "1"), leader
    finally:
        job.close()
        sim.stop()


def test_a_launchers_leader_knows_every_ranks_link_and_a_dry_run_moves_none(sim: Simulator) -> None:
    store = InProcessStore()
    leader = SwitchAgent(server=sim.address, job_id=JOB, pause="external", store=store, world_size=2,
                         leader_only=True, reconnect_initial_s=0.02, reconnect_max_s=0.1).start()
    heard = [Events(), Events()]
    members = [SwitchAgent(server=sim.address, job_id=JOB, pause="external", switch_hook=lambda order: True,
                           store=store, rank=r, world_size=2, leader="launcher").start() for r in range(2)]
    for member, events in zip(members, heard, strict=True):
        member.add_listener(events)  # after the agent's own status listener
    from nicswitch_agent.sim import MindIOStandIn

    standin = MindIOStandIn(sim.address, JOB)
    standin.start()
    try:
        assert standin.ready.wait(10) and sim.wait_until(switch_streams_open, 10)
        assert support.operator_switch(sim.address, JOB, ["0", "1"], [True, False]) == "switch nic finish"
        assert leader.status()["links"]["standby_ranks"] == "0"  # decided before the reply
        assert all(events.wait("switch_outcome") for events in heard)
        assert [m.status()["links"]["standby"] for m in members] == [1, 0]
    finally:
        standin.stop()
        for member in members:
            member.stop()
        leader.stop()

    dry = SwitchAgent(server=sim.address, job_id=JOB, pause="agent", dry_run=True, on_event=(events := Events()),
                      reconnect_initial_s=0.02, reconnect_max_s=0.1).start()
    try:
        with Trainer(dry):
            assert sim.wait_until(lambda s: support.idle(s, JOB), 10)
            assert support.operator_switch(sim.address, JOB, ["0"], [True]) == "switch nic finish"
            assert events.wait_all("reply_sent", "resumed")
        links = dry.status()["links"]
        assert (links["ranks"], links["standby"], links["last_switch"]["ok"]) == (1, 0, True)
    finally:
        dry.stop()


def test_compact_ranks_and_the_status_line() -> None:
    assert compact_ranks([]) == ""
    assert compact_ranks([23, 16, 17, 18, 19, 20, 21, 22, 40, 7, 7]) == "7,16-23,40"
    assert compact_ranks([0, 1, 2, 3, 8, 10, 11, 20], most=2) == "0-3,8,... (8 in all)"
    assert compact_ranks([0, 1, 2, 3, 8], most=2) == "0-3,8"
    links = LinkMap()
    links(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "leader", "rank": 0, "world_size": 1032}))
    order = SwitchOrder(seq=3, job_id=JOB, ranks=tuple(range(16, 24)), ops=(True,) * 8)

    class Outcome:
        ok, attempted, ok_ranks, unmoved_ranks = True, True, frozenset[int](), frozenset[int]()

    links.decided(order, "switch", Outcome())
    status = links.status()
    assert format_links(status, None) == "1,024 primary, 8 standby (ranks 16-23); last switch #3 ok"
    assert format_links({**status, "last_switch": {**status["last_switch"], "at": 1000.0}}, 1150.0).endswith(
        "last switch #3 ok 2.5 min before the write")
    many = LinkMap()
    many(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "leader", "rank": 0, "world_size": 100}))
    many.decided(SwitchOrder(seq=1, job_id=JOB, ranks=tuple(range(0, 100, 2)), ops=(True,) * 50), "switch",
                 Outcome())
    assert format_links(many.status(), None).startswith("50 primary, 50 standby (ranks 0,2,4,")

    class Failed:
        ok, attempted, ok_ranks, unmoved_ranks = False, True, frozenset[int](), frozenset[int]()

    failed = LinkMap()
    failed(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "leader", "rank": 0, "world_size": 4}))
    failed.decided(SwitchOrder(seq=1, job_id=JOB, ranks=(2, 3), ops=(True, True)), "switch", Failed())
    # The uncertain ranks are among those counted (found by an outside check: "4 primary, 0 standby; 2 UNCERTAIN")
    assert format_links(failed.status(), None) == (
        "4 primary, 0 standby; of which 2 UNCERTAIN (ranks 2-3: a failed switch's hooks ran on them, and no rollback "
        "put them back); last switch #1 failed")
    assert ",...)" in format_links(many.status(), None)
    assert format_links(None, None) == format_links({"ranks": 0}, None) == ""


def test_a_failed_orders_known_successes_are_certain_and_only_the_rest_in_doubt() -> None:
    """An outside check's case: a failed switch rolled back, the rollback failing on one rank only,
    and ``status`` called every rank of the order UNCERTAIN, though the others' rollback hooks had
    returned True. The leader's map learns the successes it read (``ok_ranks``) as a success's; a
    member learns its own (``moved``), unless the failure was the verification's."""

    @dataclasses.dataclass
    class Decided:
        ok: bool
        ok_ranks: frozenset[int]
        attempted: bool = True
        unmoved_ranks: frozenset[int] = frozenset()

    links = LinkMap()
    links(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "leader", "rank": 0, "world_size": 6}))
    everyone = tuple(range(4))
    links.decided(SwitchOrder(seq=1, job_id=JOB, ranks=everyone, ops=(True, True, True, False)), "switch",
                  Decided(False, frozenset({0, 1, 5})))  # 5 (a node's rank not in the order) is ignored
    status = links.status()
    assert (status["standby_ranks"], status["uncertain_ranks"]) == ("0-1", "2"), status  # 3 stays primary: certain
    links.decided(SwitchOrder(seq=1, job_id=JOB, ranks=everyone, ops=(False,) * 4), "rollback",
                  Decided(False, frozenset({0, 1, 3})))  # the rollback fails on rank 2 only
    status = links.status()
    assert (status["standby_ranks"], status["uncertain_ranks"]) == ("", "2"), status
    links.decided(SwitchOrder(seq=2, job_id=JOB, ranks=(2,), ops=(False,)), "rollback", Decided(True, frozenset()))
    assert links.status()["uncertain"] == 0
    # A failure whose rank said no hook ran there (not parked): that rank stays where it was, certain.
    links.decided(SwitchOrder(seq=3, job_id=JOB, ranks=(4, 5), ops=(True, True)), "switch",
                  Decided(False, frozenset(), unmoved_ranks=frozenset({5})))
    assert links.status()["uncertain_ranks"] == "4"

    def outcome(moved: bool, kind: str = "switch") -> AgentEvent:
        return AgentEvent(kind="switch_outcome", job_id=JOB, seq=7, detail={
            "rank": 3, "kind": kind, "ok": False, "link": "standby", "moved": moved})

    member = LinkMap()
    member(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "member", "rank": 3, "world_size": 6}))
    member(outcome(moved=False))
    assert (member.status()["standby"], member.status()["uncertain"]) == (0, 1)
    member(outcome(moved=True))  # its own hook returned True, and the failure was another rank's
    assert (member.status()["standby"], member.status()["uncertain"]) == (1, 0)


def test_phase_timings_from_events() -> None:
    """switch = the switch order less its guard; verify from a ``verify_*`` event or a ``phase`` detail;
    a skipped guard is no guard phase; pause from the request to parked."""
    stats = EventStats()
    for event in (
        AgentEvent(kind="pause_requested", job_id=JOB, mono=10.0, detail={"epoch": 1}),
        AgentEvent(kind="parked", job_id=JOB, mono=10.25, detail={"epoch": 1}),
        AgentEvent(kind="guard_done", job_id=JOB, detail={"skipped": False, "duration_s": 0.5}),
        AgentEvent(kind="member_result", job_id=JOB, detail={"kind": "switch", "duration_s": 0.75}),
        AgentEvent(kind="verify_done", job_id=JOB, detail={"duration_s": 0.125}),
        AgentEvent(kind="member_result", job_id=JOB, detail={"kind": "verify", "duration_s": 0.2}),
        AgentEvent(kind="guard_done", job_id=JOB, detail={"skipped": True, "duration_s": 0.0}),
        AgentEvent(kind="member_result", job_id=JOB, detail={"kind": "switch", "duration_s": 0.5}),
        AgentEvent(kind="some_later_event", job_id=JOB, detail={"phase": "verify", "duration_s": 0.375}),
        AgentEvent(kind="reply_sent", job_id=JOB, seq=1, detail={"duration_s": 0.01}),
    ):
        stats(event)
    snap = stats.snapshot()
    assert snap["phase_pause_s"]["last"] == 0.25
    assert snap["phase_guard_s"]["count"] == 1
    assert (snap["phase_switch_s"]["count"], snap["phase_switch_s"]["max"], snap["phase_switch_s"]["last"]) == (
        2, 0.5, 0.5)
    assert snap["phase_switch_s"]["mean"] == 0.375  # 0.75 - 0.5, then 0.5 with no guard
    assert (snap["phase_verify_s"]["count"], snap["phase_verify_s"]["last"]) == (2, 0.375)
    assert snap["phase_reply_s"]["last"] == 0.01


def test_metrics_of_ones_own_speak_only_for_this_processs_rank() -> None:
    """Without the agent's map, only this rank's switch_outcome reaches it: the leader's world of
    ranks must not show as all on primary."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry, ranks_per_node=8)
    metrics(AgentEvent(kind="agent_started", job_id=JOB, detail={"role": "leader", "rank": 9, "world_size": 16}))
    metrics(AgentEvent(kind="switch_outcome", job_id=JOB, seq=1, wall=1234.5,
                       detail={"rank": 9, "kind": "switch", "ok": True, "link": "standby"}))
    assert registry.get_sample_value("nicswitch_link_standby", {"job": JOB, "rank": "9", "node": "1",
                                                                "device": "1"}) == 1
    families = {f.name: f for f in registry.collect()}
    assert len(families["nicswitch_link_standby"].samples) == 1
    assert registry.get_sample_value("nicswitch_last_switch_timestamp_seconds", {"job": JOB}) == 1234.5
