"""Event listeners for operators: a JSON-lines event file, timings for ``status()``, Prometheus.

Each class here is an event listener (``agent.add_listener(x)``, or ``on_event=x``): it is called
on agent threads with every :class:`~nicswitch_agent.observability.events.AgentEvent`, does a little
bookkeeping, and never raises into the agent. All are off by default:

- :class:`JsonlEventSink`: one JSON line per event, with job, rank, sequence number and timings,
  appended to a file (``NICSWITCH_EVENTS_FILE``);
- :class:`EventStats`: counts and timings (last, max, mean) of switches, replies and pauses, for
  ``agent.status()["timings"]``;
- :class:`PrometheusMetrics`: the same as Prometheus counters and histograms, when the optional
  ``prometheus_client`` is installed (``python3 -m pip install '.[metrics]'`` in the checkout), served on a port
  only when asked (``NICSWITCH_METRICS_PORT``).

The timings every listener derives from events (:func:`event_timings`):

- ``switch_s``: a whole switch on every rank, guard included (``switch_done``, leader);
- ``reply_latency_s``: from receiving a list to its reply being delivered or given up
  (``list_received``/``list_rejected`` to ``reply_sent``/``reply_failed``, same ``seq``, leader);
- ``reply_rpc_s``: the ReplySwitchNicResult call itself, retries included (leader);
- ``pause_s``: how long this process's training thread was parked (``resumed``);
- ``rank_<kind>_s``: one rank's checkpoint guard, switch or rollback (``member_result``);
- ``phase_<phase>_s``: the phases of a switch on this process (:data:`PHASES`):

  - ``pause``: from the pause request to the training thread parked at its step boundary
    (``pause_requested`` to ``parked``);
  - ``guard``: the checkpoint guard (``guard_done``, unless skipped);
  - ``switch``: the switch hook: a ``switch`` order on this rank (``member_result``) less its
    guard (the ``guard_done`` just before it);
  - ``verify``: this rank's verification (any ``verify_*`` event with ``duration_s``, e.g.
    ``verify_done``);
  - ``reply``: the ReplySwitchNicResult call, retries included (leader);

  and any event whose ``detail`` names a ``phase`` of :data:`PHASES` with its ``duration_s``.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from nicswitch_agent.errors import ConfigError
from nicswitch_agent.observability import events as ev
from nicswitch_agent.observability.events import AgentEvent
from nicswitch_agent.observability.links import LinkMap

logger = logging.getLogger("nicswitch_agent.metrics")

_PENDING_LIMIT = 1024  # received lists awaiting their reply, remembered for reply latency
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0, 120.0, 300.0, 900.0)
"""Seconds, from a millisecond switch to ClusterD's 15-minute limit."""

PHASES = ("pause", "guard", "switch", "verify", "reply")
"""The phases of a switch, in order, timed by :func:`event_timings` (``phase_<name>_s``)."""

RANK_KINDS = ("guard", "switch", "verify", "rollback", "checkpoint")
"""The order kinds a rank runs (coordination's ``KIND_*``; the ``kind`` of ``member_result``)."""

RankSource = int | str | Callable[[], "int | str | None"] | None  # str: "leader", the launcher's leader


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class _ReplyClock:
    """Remembers when each list was received, to time its reply. Thread-safe, bounded."""

    def __init__(self) -> None:
        self._received: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._lock = threading.Lock()  # guards every field
        self._pause_requested: float | None = None  # mono of the pause request not yet parked
        self._guard_s = 0.0  # the guard of the switch order under way on this rank

    def timings(self, event: AgentEvent) -> dict[str, float]:
        out = self._reply_and_rank_timings(event)
        with self._lock:
            self._phase_timings(event, out)
        return out

    def _phase_timings(self, event: AgentEvent, out: dict[str, float]) -> None:
        kind, detail = event.kind, event.detail
        duration = _number(detail.get("duration_s"))
        if kind == ev.PAUSE_REQUESTED:
            self._pause_requested = event.mono
        elif kind == ev.PARKED and self._pause_requested is not None:
            out["phase_pause_s"] = max(0.0, event.mono - self._pause_requested)
            self._pause_requested = None
        elif kind == ev.GUARD_DONE and not detail.get("skipped") and duration is not None:
            out["phase_guard_s"] = self._guard_s = duration
        elif kind.startswith("verify_") and duration is not None:
            out["phase_verify_s"] = duration
        elif kind == ev.MEMBER_RESULT and detail.get("kind") == "switch" and duration is not None:
            out["phase_switch_s"] = max(0.0, duration - self._guard_s)
        elif kind in (ev.REPLY_SENT, ev.REPLY_FAILED) and duration is not None:
            out["phase_reply_s"] = duration
        elif detail.get("phase") in PHASES and duration is not None:
            out[f"phase_{detail['phase']}_s"] = duration
        if kind == ev.MEMBER_RESULT:
            self._guard_s = 0.0

    def _reply_and_rank_timings(self, event: AgentEvent) -> dict[str, float]:
        kind, detail = event.kind, event.detail
        out: dict[str, float] = {}
        if kind in (ev.LIST_RECEIVED, ev.LIST_REJECTED) and event.seq is not None:
            with self._lock:
                self._received[(event.job_id, event.seq)] = event.mono
                while len(self._received) > _PENDING_LIMIT:
                    self._received.popitem(last=False)
        elif kind in (ev.REPLY_SENT, ev.REPLY_FAILED):
            received = None
            if event.seq is not None:
                with self._lock:
                    received = self._received.pop((event.job_id, event.seq), None)
            if received is not None:
                out["reply_latency_s"] = max(0.0, event.mono - received)
            rpc = _number(detail.get("duration_s"))
            if rpc is not None:
                out["reply_rpc_s"] = rpc
        elif kind == ev.SWITCH_DONE:
            value = _number(detail.get("duration_s"))
            if value is not None:
                out["switch_s"] = value
        elif kind == ev.RESUMED:
            value = _number(detail.get("parked_s"))
            if value is not None:
                out["pause_s"] = value
        elif kind == ev.MEMBER_RESULT:
            value = _number(detail.get("duration_s"))
            if value is not None:
                out[f"rank_{detail.get('kind') or 'order'}_s"] = value
        return out


def event_timings() -> Callable[[AgentEvent], dict[str, float]]:
    """A function mapping each event to the timings it completes (see the module docstring).

    It keeps state (when each list was received), so use one per agent.
    """
    return _ReplyClock().timings


# --------------------------------------------------------------------------------------------
# JSON lines
# --------------------------------------------------------------------------------------------


class JsonlEventSink:
    """Appends one JSON object per event to ``path``, one line each.

    A line holds ``kind``, ``job_id``, ``rank``, ``seq``, ``wall`` (seconds since the epoch),
    ``time`` (the same, ISO 8601 UTC), ``mono`` (monotonic seconds, for durations within one
    process), ``pid`` and ``detail`` (the event's fields, durations in seconds)::

        {"detail": {"duration_s": 0.004, "ok": true, ...}, "job_id": "job-1", "kind": "switch_done",
         "mono": 8123.4, "pid": 4242, "rank": 0, "seq": 1, "time": "2026-09-01T10:00:00.123Z", ...}

    Each line goes out in one ``write`` to a file opened for appending, so lines of several
    processes appending to one local file do not interleave; on a shared filesystem give each
    rank its own file with ``{rank}`` in the path. The file is opened at the first event (the
    rank is known by then) and stays open until :meth:`close`. The line is written on the thread
    that emitted the event (``parked``/``resumed`` come from the training thread): a switch costs a
    handful of small writes, a training step none.

    Args:
        path: The file; ``{rank}``, ``{pid}`` and ``{job}`` are replaced at the first event.
        rank: This process's global rank: an int, or a callable read at every event (e.g.
            ``lambda: agent.rank``, which is known only once the agent has started). The leader
            that ``nicswitch-agent launch`` hosts gives ``"leader"``: it is no training rank, and
            training rank 0 writes its own file (and lines) beside it.

    Never raises into the agent: a failed open or write is logged once per distinct error and
    counted in :attr:`errors`; the open is retried at the next event.
    """

    def __init__(self, path: str | os.PathLike[str], *, rank: RankSource = None) -> None:
        if not os.fspath(path):
            raise ValueError("events file path is empty")
        self._template = os.fspath(path)
        self._rank = rank
        self._file: Any = None
        self._closed = False
        self._lock = threading.Lock()  # guards _file, _closed, counters; one line at a time
        self._last_error = ""
        self.path: str | None = None
        self.lines = 0
        self.errors = 0

    def _current_rank(self) -> int | str | None:
        rank = self._rank
        if callable(rank):
            try:
                return rank()
            except Exception:
                return None
        return rank

    def __call__(self, event: AgentEvent) -> None:
        try:
            rank = self._current_rank()
            record = {
                "kind": event.kind,
                "job_id": event.job_id,
                "rank": rank,
                "seq": event.seq,
                "wall": event.wall,
                "time": _iso(event.wall),
                "mono": event.mono,
                "pid": os.getpid(),
                "detail": event.detail,
            }
            data = (json.dumps(record, sort_keys=True, default=str) + "\n").encode("utf-8")
            with self._lock:
                if self._closed:
                    return
                if self._file is None:
                    path = self._template.format(rank="unknown" if rank is None else rank, pid=os.getpid(),
                                                 job=event.job_id)
                    directory = os.path.dirname(path)
                    if directory:  # e.g. /var/log/nicswitch/ on a fresh pod: made, not a silent loss of events
                        os.makedirs(directory, exist_ok=True)
                    self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - kept open until close()
                    self.path = path
                view = memoryview(data)
                while view:  # FileIO may write less than asked (a signal, a full disk)
                    view = view[self._file.write(view):]
                self.lines += 1
                self._last_error = ""
        except Exception as exc:  # an events file must never break the agent
            with self._lock:
                self.errors += 1
                text = f"{type(exc).__name__}: {exc}"
                if text != self._last_error:
                    self._last_error = text
                    logger.warning("events file %s: %s; event %s not written", self._template, text, event.kind)

    def close(self) -> None:
        """Close the file; later events are dropped. Idempotent."""
        with self._lock:
            self._closed = True
            file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                logger.debug("closing the events file failed", exc_info=True)


def _iso(wall: float) -> str:
    moment = datetime.datetime.fromtimestamp(wall, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


# --------------------------------------------------------------------------------------------
# Timings for status()
# --------------------------------------------------------------------------------------------


class EventStats:
    """What ``agent.status()`` derives from events: timings, and the links (:attr:`links`). Thread-safe.

    :meth:`snapshot` returns, per timing name (see the module docstring), ``count``, ``last``,
    ``max`` and ``mean`` in seconds, plus ``stream_losses``. :attr:`links` is the process's
    :class:`~nicswitch_agent.observability.links.LinkMap`, fed with every event (a member's own
    link) and, on the leader, by the Coordinator with every decided order (every rank's link).
    """

    def __init__(self) -> None:
        self.links = LinkMap()
        self._timings = event_timings()
        self._lock = threading.Lock()  # guards _stats, _stream_losses
        self._stats: dict[str, list[float]] = {}  # name -> [count, last, max, total]
        self._stream_losses = 0

    def __call__(self, event: AgentEvent) -> None:
        try:
            self.links(event)
            timings = self._timings(event)
            with self._lock:
                if event.kind == ev.STREAM_LOST:
                    self._stream_losses += 1
                for name, value in timings.items():
                    entry = self._stats.setdefault(name, [0.0, 0.0, 0.0, 0.0])
                    entry[0] += 1
                    entry[1] = value
                    entry[2] = max(entry[2], value)
                    entry[3] += value
        except Exception:  # bookkeeping must never break the agent
            logger.exception("event stats failed on %s; ignored", event.kind)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                name: {"count": int(count), "last": round(last, 6), "max": round(peak, 6),
                       "mean": round(total / count, 6) if count else None}
                for name, (count, last, peak, total) in sorted(self._stats.items())
            }
            out["stream_losses"] = self._stream_losses
        return out


# --------------------------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------------------------


def _import_prometheus() -> Any:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise ConfigError(
            "Prometheus metrics need prometheus_client: python3 -m pip install '.[metrics]' in the nicswitch-agent "
            "checkout "
            f"(or unset NICSWITCH_METRICS_PORT); import failed: {exc}"
        ) from exc


SERVER_MIN_VERSION = (0, 20)
"""The first prometheus_client whose ``start_http_server`` returns the server and its thread."""


def _check_server_returned() -> None:
    """Refuse, before binding anything, a prometheus_client whose server could never be stopped."""
    try:
        version = importlib.metadata.version("prometheus_client")
    except importlib.metadata.PackageNotFoundError:  # vendored without metadata: trust it
        return
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) < SERVER_MIN_VERSION:
        raise ConfigError(
            f"the metrics endpoint needs prometheus_client>=0.20 (installed: {version}): "
            "python3 -m pip install '.[metrics]' in the nicswitch-agent checkout (or unset NICSWITCH_METRICS_PORT)"
        )


class PrometheusMetrics:
    """Counters and histograms of the agent's events, as Prometheus metrics (label ``job``).

    ===========================================  ==============================================
    ``nicswitch_lists_received_total``           lists received (rejected ones included)
    ``nicswitch_lists_rejected_total``           lists refused as invalid (answered false)
    ``nicswitch_lists_ignored_total``            lists for another job (not answered)
    ``nicswitch_switches_total{result}``         switches, ``ok`` or ``failed`` (leader)
    ``nicswitch_replies_total{result}``          replies ``delivered`` or ``failed`` (leader)
    ``nicswitch_rank_results_total{kind,result}``  this rank's guard / switch / rollback runs
    ``nicswitch_stream_losses_total``            SubscribeNotifySwitch stream lost (leader)
    ``nicswitch_stream_up``                      1 while the stream is healthy (leader)
    ``nicswitch_coordination_up``                1 from start while this rank can take part in
                                                 switches, 0 once its coordination is lost
    ``nicswitch_switch_duration_seconds``        whole switch on every rank, guard included
    ``nicswitch_reply_latency_seconds``          list received to reply delivered or given up
    ``nicswitch_pause_duration_seconds``         this process's training thread parked
    ``nicswitch_rank_duration_seconds{kind}``    this rank's guard / switch / rollback
    ``nicswitch_phase_duration_seconds{phase}``  the phases of a switch (:data:`PHASES`)
    ``nicswitch_last_switch_timestamp_seconds``  when the last switch was decided (Unix time)
    ``nicswitch_link_standby{rank,node,device}``  1 while the rank is on its standby link, else 0
    ``nicswitch_links_uncertain``                ranks that may be on either link (failed switch)
    ===========================================  ==============================================

    Every counter and histogram series whose labels are known (``result``, :data:`RANK_KINDS`,
    :data:`PHASES`) exists at 0 from the job's first event (or from construction with ``job``):
    a series that first appeared at 1 would show no ``increase()``, so the first failure would
    never fire an alert.

    The link gauges are read from a :class:`~nicswitch_agent.observability.links.LinkMap` at each
    scrape: the agent's (every rank of the job on the leader), or without one a map of its own,
    fed with this process's events (its own rank only). ``node`` and ``device``
    (``rank // ranks_per_node`` and ``rank % ranks_per_node``) are empty when ``ranks_per_node`` is
    not known.

    Args:
        registry: Where to register; default: a registry of its own (so two agents in one
            process never clash), served by :meth:`start_http_server`. Pass
            ``prometheus_client.REGISTRY`` to add the metrics to an application's own endpoint.
        namespace: Metric name prefix.
        links: The link map to expose (the agent passes its own); default: one of its own.
        ranks_per_node: Ranks per node (``local_world_size``), for the ``node`` and ``device`` labels.
        job: The job's id, when known: its series exist at 0 from now rather than from its first event.

    Raises:
        ConfigError: prometheus_client is not installed.
    """

    def __init__(self, registry: Any = None, *, namespace: str = "nicswitch", links: LinkMap | None = None,
                 ranks_per_node: int | None = None, job: str | None = None) -> None:
        prom = self._prom = _import_prometheus()
        self.registry = prom.CollectorRegistry() if registry is None else registry
        by_job = ("job",)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return prom.Counter(name, doc, by_job + labels, namespace=namespace, registry=self.registry)

        def histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return prom.Histogram(name, doc, by_job + labels, namespace=namespace, registry=self.registry,
                                  buckets=DURATION_BUCKETS)

        self.lists_received = counter("lists_received", "Rank lists received from ClusterD, rejected ones included")
        self.lists_rejected = counter("lists_rejected", "Rank lists refused as invalid (answered false, never run)")
        self.lists_ignored = counter("lists_ignored", "Rank lists for another job (not answered)")
        self.switches = counter("switches", "Switches run on every rank, by result (ok, failed)", ("result",))
        self.replies = counter("replies", "ReplySwitchNicResult, by result (delivered, failed)", ("result",))
        self.rank_results = counter("rank_results", "This rank's guard, switch and rollback runs", ("kind", "result"))
        self.stream_losses = counter("stream_losses", "SubscribeNotifySwitch stream lost")
        self.pause_failures = counter("pause_failures", "Pauses ClusterD asked for that did not complete (reported "
                                                        "499: training went on, ClusterD kills the job)")
        self.stream_up = prom.Gauge("stream_up", "1 while the SubscribeNotifySwitch stream is healthy", by_job,
                                    namespace=namespace, registry=self.registry)
        self.coordination_up = prom.Gauge("coordination_up", "1 while this rank can take part in switches, 0 once "
                                          "its coordination Store (or its relay's) is lost", by_job,
                                          namespace=namespace, registry=self.registry)
        self.switch_duration = histogram("switch_duration_seconds", "A whole switch on every rank, guard included")
        self.reply_latency = histogram("reply_latency_seconds", "From receiving a list to its reply delivered or "
                                                                "given up")
        self.pause_duration = histogram("pause_duration_seconds", "How long this process's training was parked")
        self.rank_duration = histogram("rank_duration_seconds", "This rank's guard, switch or rollback", ("kind",))
        self.phase_duration = histogram("phase_duration_seconds", "Each phase of a switch: pause (request to "
                                        "parked), guard, switch hook, verify, reply call", ("phase",))
        self.links = LinkMap(own_rank_only=True) if links is None else links
        self._feed_links = links is None  # a map of its own learns from this process's events
        self._links_collector = _LinkCollector(self.links, namespace, ranks_per_node)
        self.registry.register(self._links_collector)
        self._timings = event_timings()
        self._server: Any = None  # prometheus_client's WSGI server once serving
        self._server_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _server, _server_thread
        self._jobs: set[str] = set()  # jobs whose series exist (one per agent); no lock: labels() is idempotent
        if job is not None:
            self._zero(job)

    def _zero(self, job: str) -> None:
        """Make every series of ``job`` whose labels are known, at 0, so its first increment is an increase."""
        for counter in (self.lists_received, self.lists_rejected, self.lists_ignored, self.stream_losses,
                        self.pause_failures):
            counter.labels(job)
        for result in ("ok", "failed"):
            self.switches.labels(job, result)
        for result in ("delivered", "failed"):
            self.replies.labels(job, result)
        for kind in RANK_KINDS:
            self.rank_results.labels(job, kind, "ok")
            self.rank_results.labels(job, kind, "failed")
            self.rank_duration.labels(job, kind)
        for histogram in (self.switch_duration, self.reply_latency, self.pause_duration):
            histogram.labels(job)
        for phase in PHASES:
            self.phase_duration.labels(job, phase)
        self._jobs.add(job)

    def __call__(self, event: AgentEvent) -> None:
        try:
            self._observe(event)
        except Exception:  # metrics must never break the agent
            logger.exception("Prometheus metrics failed on %s; ignored", event.kind)

    def _observe(self, event: AgentEvent) -> None:
        kind, detail, job = event.kind, event.detail, event.job_id
        if job not in self._jobs:
            self._zero(job)
        self._links_collector.job = job
        if self._feed_links:
            self.links(event)
        if kind in (ev.LIST_RECEIVED, ev.LIST_REJECTED):
            self.lists_received.labels(job).inc()
            if kind == ev.LIST_REJECTED:
                self.lists_rejected.labels(job).inc()
        elif kind == ev.LIST_IGNORED:
            self.lists_ignored.labels(job).inc()
        elif kind == ev.SWITCH_DONE:
            self.switches.labels(job, "ok" if detail.get("ok") else "failed").inc()
        elif kind == ev.REPLY_SENT:
            self.replies.labels(job, "delivered").inc()
        elif kind == ev.REPLY_FAILED:
            self.replies.labels(job, "failed").inc()
        elif kind == ev.MEMBER_RESULT:
            self.rank_results.labels(job, str(detail.get("kind") or "order"),
                                     "ok" if detail.get("ok") else "failed").inc()
        elif kind == ev.PAUSE_FAILED:
            self.pause_failures.labels(job).inc()
        elif kind == ev.STREAM_LOST:
            self.stream_losses.labels(job).inc()
            self.stream_up.labels(job).set(0)
        elif kind == ev.STREAM_RESTORED or (kind == ev.SUBSCRIBED and detail.get("stream") == "notify"
                                            and detail.get("opens") == 1):
            # The first open at start counts as healthy (as the stream's own health does, until
            # its first error: an open but silent stream looks the same as a healthy idle one);
            # later opens (retries to a server that is down) do not: STREAM_RESTORED says when.
            self.stream_up.labels(job).set(1)
        elif kind in (ev.AGENT_STOPPED, ev.AGENT_FAILED):
            self.stream_up.labels(job).set(0)
        elif kind == ev.AGENT_STARTED:
            self.coordination_up.labels(job).set(1)
        elif kind == ev.COORDINATION_LOST:
            self.coordination_up.labels(job).set(0)
        for name, value in self._timings(event).items():
            if name == "switch_s":
                self.switch_duration.labels(job).observe(value)
            elif name == "reply_latency_s":
                self.reply_latency.labels(job).observe(value)
            elif name == "pause_s":
                self.pause_duration.labels(job).observe(value)
            elif name.startswith("rank_"):
                self.rank_duration.labels(job, name[len("rank_"):-len("_s")]).observe(value)
            elif name.startswith("phase_"):
                self.phase_duration.labels(job, name[len("phase_"):-len("_s")]).observe(value)

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` of :attr:`registry` on a daemon thread; returns the bound port.

        ``port=0`` picks a free port. Off unless called (the agent calls it when
        ``NICSWITCH_METRICS_PORT`` is set). The server is prometheus_client's own
        (``start_http_server``, which returns the server and its thread from 0.20 on, so
        :meth:`close` can stop it).

        Raises:
            ConfigError: prometheus_client is older than 0.20.
            RuntimeError: already serving.
            OSError: the port cannot be bound.
        """
        _check_server_returned()
        with self._lock:
            if self._server is not None:
                raise RuntimeError("the metrics endpoint is already running")
            server, thread = self._prom.start_http_server(port, addr, registry=self.registry)
            thread.name = "nicswitch-metrics-http"
            self._server, self._server_thread = server, thread
        bound = int(server.server_address[1])
        logger.info("Prometheus metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self, timeout: float = 1.0) -> None:
        """Stop the HTTP endpoint if it runs. Idempotent; the metrics stay registered."""
        with self._lock:
            server, thread = self._server, self._server_thread
            self._server = self._server_thread = None
        if server is not None:
            server.shutdown()  # returns once serve_forever has seen it (its poll is 0.5 s)
            server.server_close()
        if thread is not None:
            thread.join(timeout)


class _LinkCollector:
    """``link_standby`` per rank, ``links_uncertain`` and ``last_switch_timestamp_seconds``, read
    from a LinkMap at each scrape (a collector, not a Gauge per rank: nothing to keep in step, and
    no work between scrapes)."""

    def __init__(self, links: LinkMap, namespace: str, ranks_per_node: int | None) -> None:
        self._family = importlib.import_module("prometheus_client.core").GaugeMetricFamily
        self._links = links
        self._standby_name = f"{namespace}_link_standby"
        self._uncertain_name = f"{namespace}_links_uncertain"
        self._last_switch_name = f"{namespace}_last_switch_timestamp_seconds"
        self._per_node = ranks_per_node
        self.job = ""  # the job's id, from the events (set before any rank can have moved)

    def describe(self) -> list[Any]:
        return self._families(with_samples=False)

    def collect(self) -> list[Any]:
        return self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> list[Any]:
        standby = self._family(self._standby_name, "1 while the rank's traffic is on its standby NIC, 0 on its "
                               "primary", labels=("job", "rank", "node", "device"))
        uncertain = self._family(self._uncertain_name, "Ranks that may be on either link: a switch failed after "
                                 "hooks ran and no rollback made them certain", labels=("job",))
        if with_samples and self.job:
            per = self._per_node
            for rank, on_standby in self._links.links():
                node, device = ("", "") if not per else (str(rank // per), str(rank % per))
                standby.add_metric((self.job, str(rank), node, device), 1.0 if on_standby else 0.0)
            uncertain.add_metric((self.job,), float(self._links.uncertain()))
        last = self._family(self._last_switch_name, "When the last switch was decided, ok or not (Unix time)",
                            labels=("job",))
        at = self._links.last_switch_wall() if with_samples and self.job else None
        if at is not None:
            last.add_metric((self.job,), at)
        return [standby, uncertain, last]


__all__ = [
    "DURATION_BUCKETS",
    "PHASES",
    "RANK_KINDS",
    "EventStats",
    "JsonlEventSink",
    "PrometheusMetrics",
    "event_timings",
]
