"""Reading a job's events files: paths, globs and directories in; records and what was wrong out.

Nothing here raises on a bad line: a truncated or non-JSON line, or a record without a kind or
a time, is counted and named in :attr:`EventSet.problems`, and the rest is used. Only finding no
events at all is an error (:class:`TimelineError`), since there is then nothing to draw.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

EVENTS_SUFFIXES = (".jsonl", ".json", ".log")
_TEMPLATE_FIELDS = ("{rank}", "{pid}", "{job}")


class TimelineError(Exception):
    """Nothing to draw: no file matched, or no event in the files. The message says which."""


class Record(NamedTuple):
    """One event line of an events file (see ``JsonlEventSink``). A tuple: a 16,384-rank job has
    hundreds of thousands of them."""

    kind: str
    job_id: str
    rank: int | None  # None: not known yet, or the launcher's leader ("leader": no training rank)
    seq: int | None
    wall: float
    mono: float | None
    pid: int | None
    detail: dict[str, Any]


@dataclass
class EventSet:
    """The records of one job, the files they came from, and what could not be used."""

    job_id: str
    records: list[Record]
    files: list[str]
    problems: list[str] = field(default_factory=list)
    other_jobs: dict[str, int] = field(default_factory=dict)  # job id -> events left out


def expand_paths(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """The files named by ``paths`` (files, directories, globs, ``events_file`` templates with
    ``{rank}``), sorted and without duplicates; and a problem line per path that matched nothing."""
    files: list[str] = []
    problems: list[str] = []
    for path in paths:
        pattern = path
        for placeholder in _TEMPLATE_FIELDS:
            pattern = pattern.replace(placeholder, "*")
        if os.path.isdir(pattern):
            found = [os.path.join(dirpath, name) for dirpath, _, names in os.walk(pattern) for name in names
                     if name.endswith(EVENTS_SUFFIXES)]
        elif any(ch in pattern for ch in "*?["):
            found = [p for p in glob.glob(pattern) if os.path.isfile(p)]
        else:
            found = [pattern] if os.path.isfile(pattern) else []
        if not found:
            problems.append(f"{path}: no such events file")
        files.extend(found)
    return sorted(set(files)), problems


@contextlib.contextmanager
def collecting_later() -> Iterator[None]:
    """No cyclic garbage collection while hundreds of thousands of small objects are made (none of
    them in a cycle): at 16,384 ranks the collector's passes cost a third of the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_events(paths: Sequence[str], *, job_id: str | None = None, since: float | None = None) -> EventSet:
    """Read every event of the files named by ``paths`` (see :func:`expand_paths`); with ``since``
    (wall clock) only the later ones (the demo, appending to files that may hold earlier runs).

    Events of several jobs: those of ``job_id`` are kept, or of the job with the most events,
    and the others are counted in :attr:`EventSet.other_jobs`.

    Raises:
        TimelineError: No file matched, none could be read, or they hold no event (of ``job_id``).
    """
    with collecting_later():
        return _read_events(paths, job_id, since)


def _read_events(paths: Sequence[str], job_id: str | None, since: float | None) -> EventSet:
    files, problems = expand_paths(paths)
    if not files:
        raise TimelineError("no events file found: " + "; ".join(problems or [f"{p}: nothing" for p in paths]))
    records: list[Record] = []
    read: list[str] = []
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            problems.append(f"{path}: cannot be read ({exc.strerror or exc})")
            continue
        read.append(path)
        problems.extend(_parse(path, data.decode("utf-8", errors="replace").splitlines(), records))
    if since is not None:
        records = [r for r in records if r.wall >= since]
    if not records:
        raise TimelineError(f"no events in {_files_text(read or files)}" + (f" ({'; '.join(problems[:3])})"
                                                                            if problems else ""))
    jobs = Counter(r.job_id for r in records)
    if job_id is None:
        job_id = jobs.most_common(1)[0][0]
    elif job_id not in jobs:
        raise TimelineError(f"no events of job {job_id!r} in {_files_text(read)} (jobs found: "
                            f"{', '.join(sorted(jobs))})")
    others = {job: n for job, n in sorted(jobs.items()) if job != job_id}
    if others:
        problems.append(f"events of {len(jobs)} jobs in these files: job {job_id!r} shown; left out "
                        + ", ".join(f"{job!r} ({n} events)" for job, n in others.items())
                        + " (choose one with --job)")
        records = [r for r in records if r.job_id == job_id]
    return EventSet(job_id=job_id, records=records, files=read, problems=problems, other_jobs=others)


def _files_text(files: Sequence[str]) -> str:
    if len(files) <= 3:
        return ", ".join(files)
    return f"{len(files)} files ({files[0]}, ...)"


def _parse(path: str, lines: list[str], out: list[Record]) -> list[str]:
    """Append the records of ``lines`` to ``out``; return what was wrong with the others."""
    try:  # the whole file in one call when every line is sound: several times faster than line by line
        values = json.loads("[" + ",".join(line for line in lines if line.strip()) + "]")
    except ValueError:
        return _parse_lines(path, lines, out)
    unusable = [number for number, value in enumerate(values, 1) if not _append(value, out)]
    if unusable:  # numbers among non-blank lines: blank lines are rare, so close enough to say
        return [f"{path}: {len(unusable)} line(s) without a kind and a time, skipped (line {_numbers(unusable)})"]
    return []


def _append(value: Any, out: list[Record]) -> bool:
    record = _record(value)
    if record is None:
        return False
    out.append(record)
    return True


def _parse_lines(path: str, lines: Iterable[str], out: list[Record]) -> list[str]:
    """Line by line, when some lines are not JSON."""
    bad: list[int] = []
    unusable: list[int] = []
    count = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        count = number
        try:
            value = json.loads(line)
        except ValueError:
            bad.append(number)
            continue
        record = _record(value)
        if record is None:
            unusable.append(number)
        else:
            out.append(record)
    problems = []
    if bad:
        last = " (the last line: cut short?)" if bad[-1] == count else ""
        problems.append(f"{path}: {len(bad)} line(s) not JSON, skipped (line {_numbers(bad)}){last}")
    if unusable:
        problems.append(f"{path}: {len(unusable)} line(s) without a kind and a time, skipped (line "
                        f"{_numbers(unusable)})")
    return problems


def _numbers(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:5])
    return shown + (", ..." if len(numbers) > 5 else "")


def _record(value: Any) -> Record | None:
    if type(value) is not dict:
        return None
    get = value.get
    kind, wall, detail, job = get("kind"), _float(get("wall")), get("detail"), get("job_id", "")
    if type(kind) is not str or wall is None:
        return None
    return Record(kind, job if type(job) is str else str(job), _int(get("rank")), _int(get("seq")), wall,
                  _float(get("mono")), _int(get("pid")), detail if type(detail) is dict else {})


def _float(value: Any) -> float | None:
    """A number as a float; None for anything else (a bool, NaN, text)."""
    if (type(value) is float and value == value) or type(value) is int:
        return float(value)
    return None


def _int(value: Any) -> int | None:
    if type(value) is int or value is None:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
