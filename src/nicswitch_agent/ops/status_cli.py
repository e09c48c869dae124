"""``nicswitch-agent status``: read an agent's status file and say whether it is healthy.

The file's format, its writer and its reader are observability/status_file.py; this is the
command line around the reader.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Mapping

from nicswitch_agent.observability.status_file import (
    DEFAULT_MAX_DISCONNECTED_S,
    DEFAULT_MAX_PARKED_S,
    LEADER_FILE_RANK,
    STATUS_FILE_ENV,
    ExitCode,
    format_summary,
    read_status,
    template_problem,
)
from nicswitch_agent.ops.durations import seconds


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _rank(text: str) -> int | str:
    """``--rank``: a rank (a non-negative integer) or ``leader`` (the launcher's leader's file)."""
    if text == LEADER_FILE_RANK:
        return text
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (a non-negative integer) or {LEADER_FILE_RANK!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``nicswitch-agent status``."""
    parser.add_argument("--file", metavar="PATH",
                        help=f"the agent's status file (default: ${STATUS_FILE_ENV}; {{rank}} in it is "
                             "replaced by --rank)")
    parser.add_argument("--rank", type=_rank, default=None, metavar="N",
                        help="rank whose file to read when the path has {rank}, or 'leader' for the leader "
                             "that nicswitch-agent launch hosts (default: $RANK, else 0)")
    parser.add_argument("--max-age", type=seconds(), default=None, metavar="S",
                        help="call the file stale past this age, seconds "
                             "(default: 3 x the agent's interval, at least the interval + 5 s)")
    parser.add_argument("--max-disconnected", type=seconds(positive=False), default=DEFAULT_MAX_DISCONNECTED_S,
                        metavar="S",
                        help="call a running leader not connected past this many seconds (default: "
                             f"{DEFAULT_MAX_DISCONNECTED_S:g}; it is briefly not connected after every switch)")
    parser.add_argument("--max-parked", type=seconds(), default=DEFAULT_MAX_PARKED_S, metavar="S",
                        help="call an agent stuck when its training has been parked this long, seconds (default: "
                             f"{DEFAULT_MAX_PARKED_S:g}, far past any switch's budget)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    if parser.epilog is None:
        parser.epilog = ("exit codes: 0 running, 1 not running, 2 usage, 3 stale file, 4 no readable file, "
                         "5 a leader not connected to ClusterD, 6 stuck (a hook past its timeout, or training "
                         "parked past --max-parked)")


def run(args: argparse.Namespace, *, env: Mapping[str, str] | None = None) -> int:
    """``nicswitch-agent status``: print the summary; returns the exit code."""
    env = os.environ if env is None else env
    template = args.file or env.get(STATUS_FILE_ENV, "").strip()
    if not template:
        print(f"nicswitch-agent status: error: --file not given and {STATUS_FILE_ENV} is not set", file=sys.stderr)
        return int(ExitCode.USAGE)
    source = "--file" if args.file else STATUS_FILE_ENV  # every error names where the value came from
    rank = args.rank
    if rank is not None and "{rank}" not in template:  # one file for the whole job: the rank picks nothing
        print(f"nicswitch-agent status: --rank {rank} ignored: {source}={template!r} has no {{rank}}",
              file=sys.stderr)
    if rank is None:
        raw = env.get("RANK", "").strip()
        if raw and not (raw.isascii() and raw.isdigit()):
            print(f"nicswitch-agent status: error: RANK={raw!r} is not a rank (a non-negative integer); "
                  "pass --rank N", file=sys.stderr)
            return int(ExitCode.USAGE)
        rank = int(raw) if raw else 0
    try:
        path = template.replace("{pid}", "*").format(rank=rank, job=env.get("NICSWITCH_JOB_ID")
                                                     or env.get("MINDX_TASK_ID", ""))
    except (KeyError, IndexError, ValueError) as exc:
        print(f"nicswitch-agent status: error: {source}={template!r} is not a usable path: {template_problem(exc)}",
              file=sys.stderr)
        return int(ExitCode.USAGE)
    if "*" in path:  # {pid}: the newest file of that name
        matches = sorted(glob.glob(path), key=_mtime, reverse=True)
        path = matches[0] if matches else path.replace("*", "{pid}")
    report = read_status(path, max_age_s=args.max_age,
                         max_disconnected_s=getattr(args, "max_disconnected", DEFAULT_MAX_DISCONNECTED_S),
                         max_parked_s=getattr(args, "max_parked", DEFAULT_MAX_PARKED_S))
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True, default=str))
    else:
        print(format_summary(report), file=sys.stdout if report.document is not None else sys.stderr)
    return int(report.exit_code)
