"""benchmarks/perf_roles.py: a rank process's samples split by thread role and by where they ran.

The split is read from ``perf script`` text (pinned below, as this machine's perf prints it), so
it is tested without perf; ``store_scale --perf`` itself runs where perf can sample.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import perf_roles

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """\
 5958  ffffffff817057a2 ([kernel.kallsyms])
 5958      7ff0aa43669e (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
 5958      7ff0aa43669e (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
 5958      7f11c0e1a2b3 (/usr/lib/x86_64-linux-gnu/libc.so.6)
 6001  ffffffff81595e3c ([kernel.kallsyms])
 6001      7f00aa000000 (/work/venv/lib/python3.11/site-packages/torch/lib/libtorch_python.so)
 7777  ffffffff81595e3c ([kernel.kallsyms])
"""


def test_samples_are_split_by_role_and_by_where_they_ran() -> None:
    found = perf_roles.parse(SCRIPT)
    assert len(found) == 7
    by_role = perf_roles.split(found, {5958: "member", 6001: "node relay"})
    assert by_role["member"]["samples"] == 4
    assert by_role["member"]["shares"] == {"kernel": 0.25, "CPython": 0.5, "libc": 0.25, "other": 0.0}
    assert by_role["node relay"]["shares"]["other"] == 0.5  # an extension's (torch's) binary
    assert by_role["other threads"]["samples"] == 1  # a thread the benchmark did not name
    line = perf_roles.describe(by_role, 1 / 1000, 2.0)  # 1 ms per sample, per 2 (ranks x switches)
    assert line.startswith("member 2,000 us: kernel 25 % / CPython 50 % / libc 25 %"), line


def test_a_call_stack_recording_is_not_taken_for_samples() -> None:
    """Recorded with -g, each sample's stack follows on lines of its own (an address and a binary):
    none of those is a sample of a thread."""
    stacked = "21650 \n\t          29c05a (/usr/lib/libpython3.11.so.1.0)\n\t               0 ([unknown])\n\n"
    assert perf_roles.parse(stacked) == []


@pytest.mark.timeout(240)
def test_store_scale_reports_each_roles_cpu_by_where_it_ran(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="store_scale's ranks need the torch extra")
    why = perf_roles.available()
    if why:
        pytest.skip(why)
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.store_scale", "--ranks-per-node", "8", "--sizes", "16",
                           "--processes", "1", "--switches", "5", "--perf", str(tmp_path / "perf"), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [m for bench in json.loads(out.read_text())["benchmarks"].values() for m in bench["metrics"]
               if m["name"].endswith("sampled by perf")]
    assert len(metrics) == 1 and not math.isnan(metrics[0]["value"]), metrics
    assert "member" in metrics[0]["note"] and "node relay" in metrics[0]["note"] and "CPython" in metrics[0]["note"]
    assert list((tmp_path / "perf").glob("*.perf.data"))
