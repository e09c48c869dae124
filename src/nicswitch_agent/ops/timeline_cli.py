"""``nicswitch-agent timeline EVENTS...``: one page (or picture) of a job's switches from its events files.

Reads every rank's events file (as ``events_file`` with ``{rank}`` writes them; globs,
directories and the template itself are accepted), writes one self-contained HTML page (or an SVG
with ``--format svg``) and prints a text summary. Exit codes: 0 the page was written (what is
missing is said on the page and in the summary), 2 no events at all, no switch ``--switch N`` in them
(nothing is written then), or a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

from nicswitch_agent.observability.timeline import (
    TimelineError,
    build,
    read_events,
    render_html,
    render_svg,
    summary_text,
)
from nicswitch_agent.observability.timeline.model import DEFAULT_RANKS_PER_NODE

EXIT_OK, EXIT_NO_EVENTS = 0, 2


def _list_number(text: str) -> int:
    """``--switch``: the leader numbers its rank lists from 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the leader numbers its lists from 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Draw a job's switches from its events files (NICSWITCH_EVENTS_FILE of every rank): a lane per rank (per "
        "node above a few hundred ranks) with its pause, guard, switch and resume, the leader's ClusterD messages, "
        "who everyone waited for, and the phases' p50/p99/max. Clocks of different hosts are aligned on the "
        "leader's. Writes one HTML file that needs no network, and prints a summary."
    )
    parser.epilog = ("exit codes: 0 written (what is missing is said in it), 2 no events found, no switch N of "
                     "--switch N in them, or a usage error")
    parser.add_argument("events", nargs="+", metavar="EVENTS",
                        help="events files, directories or globs; an events_file template with {rank} works too")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="where to write the page (default: timeline.html, or timeline.svg with --format svg)")
    parser.add_argument("--format", choices=("html", "svg"), default="html",
                        help="html: the page with tables (default); svg: the picture alone")
    parser.add_argument("--switch", type=_list_number, metavar="N",
                        help="only the switch of the leader's list number N (exit 2, nothing written, when it is "
                             "not there)")
    parser.add_argument("--job", metavar="JOB_ID", help="the job to draw when the files hold several (default: the one "
                                                    "with the most events)")
    parser.add_argument("--ranks-per-node", type=int, default=DEFAULT_RANKS_PER_NODE, metavar="N",
                        help="ranks of a node, for the per-node lanes of large jobs (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.ranks_per_node < 1:
        print(f"nicswitch-agent timeline: error: --ranks-per-node must be at least 1, got {args.ranks_per_node}",
              file=sys.stderr)
        return EXIT_NO_EVENTS
    output = args.output or f"timeline.{args.format}"
    try:
        events = read_events(args.events, job_id=args.job)
    except TimelineError as exc:
        print(f"nicswitch-agent timeline: error: {exc}", file=sys.stderr)
        return EXIT_NO_EVENTS
    timeline = build(events, ranks_per_node=args.ranks_per_node, only_switch=args.switch)
    if args.switch is not None and not any(switch.seq == args.switch for switch in timeline.switches):
        # An empty page would overwrite a good one and exit 0 as if it had drawn something.
        missing = next((p for p in timeline.problems if p.startswith(f"switch {args.switch} ")),
                       f"switch {args.switch} is not in these events")
        print(f"nicswitch-agent timeline: error: {missing}; nothing written", file=sys.stderr)
        return EXIT_NO_EVENTS
    text = render_svg(timeline) if args.format == "svg" else render_html(timeline)
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        print(f"nicswitch-agent timeline: error: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NO_EVENTS
    try:
        sys.stdout.write(summary_text(timeline))
        print(f"{'page' if args.format == 'html' else 'picture'}: {os.path.abspath(output)}", flush=True)
    except BrokenPipeError:  # `| head`: the page is written, the rest of the summary is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
