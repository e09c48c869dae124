"""The timeline of a job's switches, from its events files: one self-contained HTML page (or SVG)
and a text summary. ``nicswitch-agent timeline`` is its command line (ops/timeline_cli.py).

- reading.py: files, globs and directories in; one job's records and what could not be read out;
- runs.py: several runs of the job in the same files told apart (processes, runs);
- model.py: clocks aligned on the leader's, switches, lanes, bars, the critical path (pure data);
- render.py: inline SVG and the HTML page; summary.py: the text summary.
"""

from nicswitch_agent.observability.timeline.model import Timeline, build
from nicswitch_agent.observability.timeline.reading import EventSet, TimelineError, read_events
from nicswitch_agent.observability.timeline.render import render_html, render_svg
from nicswitch_agent.observability.timeline.summary import summary_text

__all__ = ["EventSet", "Timeline", "TimelineError", "build", "read_events", "render_html", "render_svg",
           "summary_text"]
