"""The benchmark suite runs: ``python -m benchmarks --quick`` exits 0 and writes every benchmark
(run in three parts, side by side on the test workers).

A smoke test only. It asserts nothing about timing (numbers belong to ``python -m benchmarks``
and docs/performance.md, never to the tests), only that each benchmark ran and reported.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The suite in three parts (``--only``), so that test workers run them side by side; together they
# are every benchmark of the suite.
PARTS = {
    "idle,notify,resubscribe,scale,e2e_probe,ms_store": ("idle", "notify_to_hook", "resubscribe", "scale_list",
                                                          "e2e_probe", "ms_store"),
    "e2e,store_scale": ("e2e_switch", "scale_coordination", "pause_alignment", "store_scale"),
    "store_scale_node,store_scale_group,timeline": ("store_scale_node", "store_scale_group", "timeline"),
}

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("torch", reason="the multi-process benchmarks need the torch extra")


def test_the_parts_are_the_whole_suite() -> None:
    from benchmarks.__main__ import SUITE

    assert sorted(name for part in PARTS for name in part.split(",")) == sorted(SUITE)
    assert sorted(r for results in PARTS.values() for r in results) == sorted(r for _, rs in SUITE.values() for r in rs)


@pytest.mark.parametrize(("only", "expected"), PARTS.items(), ids=list(PARTS))
def test_quick_run_exits_0_and_writes_every_benchmark(tmp_path: Path, only: str, expected: tuple[str, ...]) -> None:
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", only, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    document = json.loads(out.read_text(encoding="utf-8"))
    assert document["mode"] == "quick"
    assert document["machine"]["nproc"] >= 1
    benchmarks = document["benchmarks"]
    assert sorted(benchmarks) == sorted(expected)
    for name in expected:
        bench = benchmarks[name]
        assert bench["error"] == "", f"{name}: {bench['error']}"
        assert bench["metrics"], f"{name} reported no metrics"
        for metric in bench["metrics"]:
            assert metric["name"] and metric["unit"] is not None
            value = metric["value"]
            assert value is None or math.isfinite(value), f"{name}/{metric['name']}: {value}"
            assert metric["met"] in (True, False, None)
    assert "benchmark" in proc.stdout and "metric" in proc.stdout  # the table was printed
    if "ms_store" in expected and importlib.util.find_spec("mindspore") is None:  # skipped, saying why
        assert benchmarks["ms_store"]["metrics"][0]["note"].startswith("skipped: mindspore ("), benchmarks["ms_store"]


def test_wake_cost_reports_every_unit() -> None:
    """``python -m benchmarks.wake_cost`` (standalone, not in the suite) measures and prints its seven units."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.wake_cost", "--n", "5"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.endswith("us of CPU")]
    assert len(lines) == 7, proc.stdout
    assert all(math.isfinite(float(line.split()[-4])) for line in lines), proc.stdout
