"""Reading a job's events files: paths, globs and directories in; records and what was wrong out.

Nothing here raises on a bad line: a truncated or non-JSON line, or a record without a kind or
a time, is counted and named in :attr:`EventSet.problems`, and the rest is used. Only finding no
events at all is an error (:class:`TimelineError`), since there is then nothing to draw.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

EVENTS_SUFFIXES = (".jsonl", ".json", ".log")
_TEMPLATE_FIELDS = ("{rank}", "{pid}", "{job}")


class TimelineError(Exception):
    """Nothing to draw: no file matched, or no event in the files. The message says which."""


@dataclass(frozen=True, slots=True)
class Record:
    """One event line of an events file (see ``JsonlEventSink``)."""

    kind: str
    job_id: str
    rank: int | None
    seq: int | None
    wall: float
    mono: float | None
    pid: int | None
    detail: dict[str, Any]

    @property
    def source(self) -> tuple[int | None, int | None]:
        """The process that wrote it: (rank, pid). Its clock is one clock."""
        return (self.rank, self.pid)


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


def read_events(paths: Sequence[str], *, job_id: str | None = None, since: float | None = None) -> EventSet:
    """Read every event of the files named by ``paths`` (see :func:`expand_paths`); with ``since``
    (wall clock) only the later ones (the demo, appending to files that may hold earlier runs).

    Events of several jobs: those of ``job_id`` are kept, or of the job with the most events,
    and the others are counted in :attr:`EventSet.other_jobs`.

    Raises:
        TimelineError: No file matched, none could be read, or they hold no event (of ``job_id``).
    """
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


def _parse(path: str, lines: Iterable[str], out: list[Record]) -> list[str]:
    """Append the records of ``lines`` to ``out``; return what was wrong with the others."""
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
    if not isinstance(value, dict):
        return None
    kind, wall = value.get("kind"), value.get("wall")
    if not isinstance(kind, str) or not _is_number(wall):
        return None
    detail = value.get("detail")
    mono = value.get("mono")
    return Record(kind=kind, job_id=str(value.get("job_id", "")), rank=_int(value.get("rank")),
                  seq=_int(value.get("seq")), wall=float(wall), mono=float(mono) if _is_number(mono) else None,
                  pid=_int(value.get("pid")), detail=detail if isinstance(detail, dict) else {})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
