"""Shared pieces: result records, statistics, machine facts, the table."""

from __future__ import annotations

import logging
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench-results"


@dataclass(frozen=True)
class Settings:
    """How big a run is. ``quick`` is the CI smoke run: it checks that the suite runs, nothing else."""

    quick: bool
    seed: int = 1234

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full


@dataclass
class Metric:
    """One reported number.

    ``value`` is the headline (a median unless the name says otherwise); ``lo``/``hi`` give the
    spread, of the kind named by ``spread`` (e.g. ``"p25-p75 of 300 samples"`` or ``"min-max of 7
    rounds"``). ``met`` is None when the metric has no target.
    """

    name: str
    value: float | None
    unit: str
    lo: float | None = None
    hi: float | None = None
    spread: str = ""
    target: str = ""
    met: bool | None = None
    note: str = ""


@dataclass
class BenchResult:
    """What one benchmark module returns."""

    name: str
    title: str
    metrics: list[Metric] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    limits: str = ""
    error: str = ""
    duration_s: float = 0.0

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "metrics": [asdict(m) for m in self.metrics],
            "details": self.details,
            "limits": self.limits,
            "error": self.error,
            "duration_s": round(self.duration_s, 3),
        }


# -- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def dist_metric(name: str, samples: Sequence[float], unit: str, *, q: float = 50.0, target: str = "",
                ok: Callable[[float], bool] | None = None, note: str = "") -> Metric:
    """A percentile of samples with their p25-p75 spread (p50) or p10-p99.9 band (other q)."""
    value = percentile(samples, q)
    if q == 50.0:
        lo, hi, spread = percentile(samples, 25), percentile(samples, 75), f"p25-p75 of {len(samples)} samples"
    else:
        lo, hi, spread = min(samples) if samples else math.nan, max(samples) if samples else math.nan, \
            f"min-max of {len(samples)} samples"
    met = None if ok is None or math.isnan(value) else bool(ok(value))
    return Metric(name, _r(value), unit, _r(lo), _r(hi), spread, target, met, note)


def rounds_metric(name: str, per_round: Sequence[float], unit: str, *, target: str = "",
                  ok: Callable[[float], bool] | None = None, note: str = "") -> Metric:
    """The median over independent rounds, with the min-max of the rounds as the spread."""
    value = median(per_round)
    met = None if ok is None or math.isnan(value) else bool(ok(value))
    return Metric(name, _r(value), unit, _r(min(per_round)) if per_round else None,
                  _r(max(per_round)) if per_round else None, f"min-max of {len(per_round)} rounds", target, met, note)


def single_metric(name: str, value: float, unit: str, *, target: str = "", ok: Callable[[float], bool] | None = None,
                  note: str = "") -> Metric:
    met = None if ok is None or math.isnan(value) else bool(ok(value))
    return Metric(name, _r(value), unit, target=target, met=met, note=note)


def _r(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return float(f"{value:.4g}")


def ms(seconds: float) -> float:
    return seconds * 1000.0


# -- environment -------------------------------------------------------------------------------


def quiet_logging() -> None:
    """The agent logs INFO per switch and WARNING on expected stream ends; keep the table readable."""
    for name in ("nicswitch_agent", "grpc"):
        logging.getLogger(name).setLevel(logging.ERROR)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def machine() -> dict[str, Any]:
    """What the numbers were measured on (from /proc/cpuinfo, nproc and the interpreter)."""
    model, mhz, flags = "", "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and not model:
                model = value
            elif key == "cpu MHz" and not mhz:
                mhz = value
            elif key == "flags" and not flags:
                flags = "hypervisor" if "hypervisor" in value.split() else ""
    except OSError:
        pass
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    import grpc

    info: dict[str, Any] = {
        "cpu_model": model,
        "cpu_mhz": mhz,
        "virtualised": flags == "hypervisor",
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        from google.protobuf import __version__ as pb_version

        info["protobuf"] = pb_version
    except ImportError:  # pragma: no cover
        pass
    return info


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def combine_runs(runs: Sequence[Sequence[BenchResult]]) -> list[BenchResult]:
    """One result per benchmark: each metric's median over the runs, spread = min-max of the runs.

    The verdict is re-judged on the median with the same rule the metric used in each run: met if the
    median lies on the met side of the runs' values (the median of a met and a missed run is decided
    by which side it falls on).
    """
    combined: list[BenchResult] = []
    for first in runs[0]:
        same = [r for run in runs for r in run if r.name == first.name]
        out = BenchResult(first.name, first.title, limits=first.limits,
                          error="; ".join(sorted({r.error for r in same if r.error})),
                          duration_s=sum(r.duration_s for r in same))
        out.details = {"per_run": [r.details for r in same]}
        for metric in first.metrics:
            values = [m.value for r in same for m in r.metrics if m.name == metric.name and m.value is not None]
            verdicts = [(m.value, m.met) for r in same for m in r.metrics if m.name == metric.name
                        and m.value is not None and m.met is not None]
            value = median(values) if values else None
            met = None
            if verdicts and value is not None:
                met_values = [v for v, ok in verdicts if ok]
                missed_values = [v for v, ok in verdicts if not ok]
                if not missed_values:
                    met = True
                elif not met_values:
                    met = False
                else:  # the threshold lies between the met and the missed values
                    met = abs(value - median(met_values)) <= abs(value - median(missed_values))
            out.metrics.append(Metric(metric.name, _r(value) if value is not None else None, metric.unit,
                                      _r(min(values)) if len(values) > 1 else None,
                                      _r(max(values)) if len(values) > 1 else None,
                                      f"min-max of {len(values)} runs" if len(values) > 1 else "", metric.target,
                                      met, metric.note))
        combined.append(out)
    return combined


# -- the table ---------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def render_table(results: Sequence[BenchResult]) -> str:
    """A plain-text table: benchmark, metric, value, spread, target, verdict."""
    rows: list[tuple[str, ...]] = [("benchmark", "metric", "value", "spread", "target", "")]
    for result in results:
        if result.error:
            rows.append((result.name, "ERROR", result.error.splitlines()[0][:60], "", "", "!!"))
        for i, m in enumerate(result.metrics):
            spread = "" if m.lo is None or m.hi is None else f"{_fmt(m.lo)}..{_fmt(m.hi)}"
            verdict = {True: "met", False: "MISSED", None: ""}[m.met]
            rows.append((result.name if i == 0 else "", m.name, f"{_fmt(m.value)} {m.unit}".strip(), spread,
                         m.target, verdict))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(results: Sequence[BenchResult]) -> str:
    """The same table in Markdown (for docs/performance.md)."""
    out = ["| benchmark | metric | value | spread | target | |", "|---|---|---|---|---|---|"]
    for result in results:
        for m in result.metrics:
            spread = "" if m.lo is None or m.hi is None else f"{_fmt(m.lo)} .. {_fmt(m.hi)} ({m.spread})"
            verdict = {True: "met", False: "**missed**", None: ""}[m.met]
            out.append(f"| {result.name} | {m.name} | {_fmt(m.value)} {m.unit} | {spread} | {m.target} | {verdict} |")
    return "\n".join(out)
