"""Where each thread role's CPU ran, by the kernel's sampling: ``store_scale --perf``.

Python's own profilers see Python; ``/proc/<tid>/schedstat`` sees a thread's total. Neither says
how much of a member's or a relay's CPU is the kernel switching threads (GIL hand-offs, wake-ups)
and how much is CPython running their code, which is what decides the next change
(docs/performance.md, "Where a rank's CPU goes, by the machine's own count"). Linux's ``perf``
does: ``perf record`` samples the rank processes on a timer while the measured switches run,
and every sample names its thread and the binary it landed in (the kernel, ``libpython``, libc,
an extension). Grouped by the thread roles the benchmark knows (its node processes map thread
ids to roles), that is the split per role.

Needs ``perf`` on the PATH and the right to sample the benchmark's own processes
(``kernel.perf_event_paranoid`` <= 2 for a process of one's own); without them the benchmark says
so and runs on. Sampling makes every context switch dearer: the roles' totals under ``perf`` are
larger than without it; compare the shares, and runs under ``perf`` with runs under ``perf``.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HZ = 999  # samples per second per CPU (not a round rate: not in step with the kernel's own 100-1000 Hz ticks)
PLACES = {"[kernel.kallsyms]": "kernel", "libpython": "CPython", "libc.so": "libc"}  # by what a dso's name holds


def available() -> str:
    """Why ``perf`` cannot sample here ("" if it can)."""
    perf = shutil.which("perf")
    if perf is None:
        return "perf is not installed"
    with tempfile.TemporaryDirectory() as scratch:  # a recording of its own, as store_scale's will be
        try:
            probe = subprocess.run([perf, "record", "-q", "-F", str(HZ), "-o", str(Path(scratch) / "probe.data"),
                                    "--", "true"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"perf did not run: {exc}"
    return "" if probe.returncode == 0 else f"perf cannot sample here: {probe.stderr.strip()[-300:]}"


class Recording:
    """``perf record`` of ``pids`` from :meth:`start` until :meth:`stop`. perf attaches to a process
    in its own time (a tenth of a second or more), so it starts with its events off (``-D -1``)
    and :meth:`start` returns once perf says it turned them on (``--control``: "enable", then its
    "ack"): a short run's switches are not over before the sampling begins."""

    def __init__(self, pids: Iterable[int], out: Path) -> None:
        self.pids, self.out = list(pids), out
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl = self._ack = -1

    def start(self, timeout_s: float = 30.0) -> None:
        ctl_read, self._ctl = os.pipe()
        self._ack, ack_write = os.pipe()
        try:
            self._proc = subprocess.Popen(
                ["perf", "record", "-F", str(HZ), "-D", "-1", "--control", f"fd:{ctl_read},{ack_write}",
                 "-o", str(self.out), "-p", ",".join(map(str, self.pids))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(ctl_read, ack_write))
        finally:
            os.close(ctl_read)
            os.close(ack_write)
        os.write(self._ctl, b"enable\n")
        ready, _, _ = select.select([self._ack], [], [], timeout_s)
        if not ready or not os.read(self._ack, 64).startswith(b"ack"):
            self.stop()
            raise RuntimeError(f"perf record did not start sampling within {timeout_s:.0f} s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.send_signal(signal.SIGINT)  # as Ctrl-C would: perf writes what it has and exits
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in (self._ctl, self._ack):
            if fd >= 0:
                os.close(fd)
        self._ctl = self._ack = -1


def samples(perf_data: Path) -> list[tuple[int, str]]:
    """(thread id, binary) of every sample in ``perf_data``."""
    text = subprocess.run(["perf", "script", "-i", str(perf_data), "-F", "tid,ip,dso"], capture_output=True,
                          text=True, timeout=600, check=True).stdout
    return parse(text)


SAMPLE = re.compile(r"^\s*(\d+)\s+[0-9a-f]+\s+\((.*)\)\s*$")  # "<tid> <ip> (<binary>)"


def parse(text: str) -> list[tuple[int, str]]:
    """The samples of ``perf script -F tid,ip,dso`` (recorded without call stacks: one line each)."""
    return [(int(m.group(1)), m.group(2)) for line in text.splitlines() if (m := SAMPLE.match(line))]


def place(binary: str) -> str:
    """Where a sample ran: the kernel, CPython, libc, or "other" (an extension, torch, the vdso)."""
    for mark, name in PLACES.items():
        if mark in binary:
            return name
    return "other"


def split(found: Iterable[tuple[int, str]], roles: dict[int, str]) -> dict[str, dict[str, Any]]:
    """Per role (threads not in ``roles``: "other threads"): its samples, and the share of them in
    each place (kernel, CPython, libc, other)."""
    counts: dict[str, Counter[str]] = {}
    for tid, binary in found:
        counts.setdefault(roles.get(tid, "other threads"), Counter())[place(binary)] += 1
    return {role: {"samples": sum(c.values()),
                   "shares": {p: c[p] / sum(c.values()) for p in ("kernel", "CPython", "libc", "other")}}
            for role, c in counts.items()}


def describe(by_role: dict[str, dict[str, Any]], seconds_per_sample: float, per: float) -> str:
    """One line: each role's CPU as sampled (``per``: what to divide by, e.g. ranks x switches, in
    microseconds), and where it ran."""
    parts = []
    for role, entry in sorted(by_role.items(), key=lambda kv: -kv[1]["samples"]):
        shares = entry["shares"]
        parts.append(f"{role} {entry['samples'] * seconds_per_sample / per * 1e6:,.0f} us: "
                     + " / ".join(f"{name} {shares[name] * 100:.0f} %" for name in ("kernel", "CPython", "libc")))
    return "; ".join(parts)
