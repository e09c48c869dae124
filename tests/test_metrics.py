"""Event listeners for operators: JSON lines, status timings and Prometheus, after a real switch."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import socket
import sys
import threading
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
from nicswitch_agent.observability.metrics import EventStats, JsonlEventSink, PrometheusMetrics
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
    """A real agent (pause mode agent) and one failover of rank 1, with ``listeners`` attached."""
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


# -- after a real switch ------------------------------------------------------------------------------


def test_jsonl_stats_and_prometheus_after_a_real_switch(sim: Simulator, tmp_path: Path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    sink = JsonlEventSink(tmp_path / "events-{rank}.jsonl", rank=0)
    stats = EventStats()
    metrics = PrometheusMetrics(registry)
    kinds = run_one_switch(sim, sink, stats, metrics)
    sink.close()

    # JSON lines: one per event, in emit order, with job, rank, sequence and timings.
    lines = (tmp_path / "events-0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["kind"] for r in records] == kinds.kinds
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
    assert registry.get_sample_value("nicswitch_stream_up", {"job": JOB}) == 0


def test_missing_prometheus_client_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"pip install 'nicswitch-agent\[metrics\]'"):
        PrometheusMetrics()


# -- JSON lines ------------------------------------------------------------------------------------------


def test_jsonl_never_raises_and_logs_each_error_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nicswitch_agent.metrics")
    sink = JsonlEventSink(tmp_path / "no-such-dir" / "events.jsonl")
    for _ in range(3):
        sink(AgentEvent(kind="stream_lost", job_id=JOB))
    assert sink.errors == 3 and sink.lines == 0
    assert caplog.text.count("events file") == 1
    (tmp_path / "no-such-dir").mkdir()
    sink(AgentEvent(kind="stream_restored", job_id=JOB))  # the open is retried
    assert sink.lines == 1
    sink.close()
    sink(AgentEvent(kind="stream_lost", job_id=JOB))  # after close: dropped
    sink.close()
    assert len((tmp_path / "no-such-dir" / "events.jsonl").read_text().splitlines()) == 1


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
    assert [r["kind"] for r in records] == kinds.kinds
    assert records[-1]["kind"] == "agent_stopped"


def test_metrics_port_without_prometheus_client_refuses_to_start_the_leader_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    leader = SwitchAgent(server="127.0.0.1:1", job_id=JOB, metrics_port=0, dry_run=True, pause="external")
    with pytest.raises(ConfigError, match="nicswitch-agent\\[metrics\\]"):
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
