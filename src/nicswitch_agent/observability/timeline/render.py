"""Drawing a :class:`~.model.Timeline`: inline SVG, and one self-contained HTML page around it.

No script, no font, no image is fetched: the page opens from a file:// URL on an air-gapped
cluster. Hovering a lane shows its numbers (SVG ``<title>``, no script needed).
"""

from __future__ import annotations

import datetime
import html
import math
from collections.abc import Iterable

from nicswitch_agent.observability.timeline.model import Lane, Mark, Switch, Timeline

WIDTH = 1100
LABEL_W = 210
RIGHT_W = 180  # room for "parked last" notes right of the plot
PLOT_W = WIDTH - LABEL_W - RIGHT_W
AXIS_H = 24
LEADER_H = 30
COLOURS = {"pause": "#9ecae1", "parked": "#e3e3e3", "guard": "#fdae6b", "switch": "#41ab5d", "verify": "#8c6bb1"}
GENERIC = "#bdbdbd"
FAILED = "#d62728"
RESUMED = "#2171b5"
CRITICAL = "#fff3b0"
PHASE_TEXT = {"pause": "reaching the step boundary (pause requested to parked)",
              "parked": "parked (training waits)", "guard": "checkpoint guard", "switch": "switch hook",
              "verify": "verification"}
FONTS = "system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:20px 28px;color:#222;
background:#fff;max-width:1160px}
h1{font-size:21px;margin:0 0 4px}h2{font-size:17px;margin:26px 0 6px;padding-top:10px;border-top:1px solid #ddd}
.ok{color:#1a7f37}.bad{color:#d62728;font-weight:600}.unknown{color:#8a6d00;font-weight:600}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #d0d0d0;padding:3px 8px;text-align:right}th{background:#f4f4f4}
td.l,th.l{text-align:left}.meta{color:#555;margin:2px 0}
.problems{background:#fff4f4;border:1px solid #f1b5b5;padding:6px 12px;margin:10px 0}
.problems li,.missing li{margin:2px 0}.legend span{display:inline-block;margin-right:14px;font-size:13px}
.legend i{display:inline-block;width:14px;height:10px;margin-right:4px;vertical-align:middle;border:1px solid #999}
svg{display:block;margin:6px 0}svg text{font-family:FONTS}
""".replace("FONTS", FONTS)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _ms(seconds: float) -> str:
    value = seconds * 1000
    if abs(value) >= 100:
        return f"{value:.0f} ms"
    if abs(value) >= 10:
        return f"{value:.1f} ms"
    return f"{value:.2f} ms"


def _wall(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


def _lane_height(lanes: int) -> int:
    if lanes <= 16:
        return 22
    if lanes <= 48:
        return 18
    if lanes <= 160:
        return 9
    if lanes <= 600:
        return 5
    return 3


def _tick_step(span: float) -> float:
    """A 1-2-5 step giving 5 to 10 ticks over ``span`` seconds."""
    if span <= 0:
        return 0.001
    raw = span / 8
    power = 10.0 ** math.floor(math.log10(raw))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= raw))


def switch_svg(switch: Switch, *, standalone: bool = False) -> str:
    """One switch as an SVG: the time axis, the leader's lane, a lane per rank (or per node)."""
    lane_h = _lane_height(len(switch.lanes))
    top = AXIS_H + LEADER_H + 6
    height = top + lane_h * len(switch.lanes) + 8
    span = switch.duration if switch.duration > 0 else 0.001
    scale = PLOT_W / span

    def x(t: float) -> float:
        return LABEL_W + max(0.0, min(span, t)) * scale

    out: list[str] = []
    ns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    # crispEdges: a bar a pixel wide keeps its colour instead of blending into the background
    out.append(f'<svg{ns} width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
               f'shape-rendering="crispEdges" aria-label="switch {switch.seq} timeline">')
    out.append(f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#fff"/>')
    step = _tick_step(span)
    tick = 0.0
    while tick <= span + 1e-12:
        px = x(tick)
        out.append(f'<line x1="{px:.1f}" y1="{AXIS_H - 4}" x2="{px:.1f}" y2="{height - 6}" stroke="#eee"/>')
        out.append(f'<text x="{px:.1f}" y="{AXIS_H - 8}" font-size="11" text-anchor="middle" fill="#555">'
                   f'{_e(_ms(tick))}</text>')
        tick += step
    out.extend(_leader_lane(switch.leader, AXIS_H, x))
    labels_every = 1 if lane_h >= 9 else max(1, math.ceil(len(switch.lanes) / 40))
    for index, lane in enumerate(switch.lanes):
        y = top + index * lane_h
        out.append(_lane(lane, y, lane_h, x, show_label=index % labels_every == 0 or bool(lane.critical)))
    out.append("</svg>")
    return "".join(out)


def _leader_lane(marks: list[Mark], y: int, x: object) -> Iterable[str]:
    assert callable(x)
    yield (f'<rect x="{LABEL_W}" y="{y}" width="{PLOT_W}" height="{LEADER_H - 4}" fill="#f5f8fc" '
           'stroke="#d8e2ef"/>')
    yield f'<text x="{LABEL_W - 8}" y="{y + 17}" font-size="12" text-anchor="end" font-weight="600">leader</text>'
    for number, mark in enumerate(marks, 1):
        px = x(mark.at)
        colour = "#1f4e79" if mark.ok else FAILED
        yield (f'<g><title>{_e(f"{number}. +{_ms(mark.at)} {mark.label}")}</title>'
               f'<line x1="{px:.1f}" y1="{y + 2}" x2="{px:.1f}" y2="{y + LEADER_H - 6}" stroke="{colour}" '
               f'stroke-width="2"/><text x="{px + 2:.1f}" y="{y + 11 + (number % 2) * 10}" font-size="10" '
               f'fill="{colour}">{number}</text></g>')


def _lane(lane: Lane, y: int, h: int, x: object, *, show_label: bool) -> str:
    assert callable(x)
    parts = [f"<g><title>{_e(_lane_title(lane))}</title>"]
    if lane.critical:
        parts.append(f'<rect x="0" y="{y}" width="{WIDTH}" height="{h}" fill="{CRITICAL}"/>')
    inner = max(1.0, h * 0.62)
    for bar in sorted(lane.bars, key=lambda b: b.phase != "parked"):  # the parked background first
        x0, x1 = x(bar.start), x(bar.end)
        failed = not bar.ok and bar.phase != "parked"
        colour = FAILED if failed else COLOURS.get(bar.phase, GENERIC)
        if bar.phase == "parked":
            by, bh = y + 1.0, max(1.0, h - 2.0)
        else:
            by, bh = y + (h - inner) / 2, inner
        stroke = f' stroke="{FAILED}"' if bar.phase == "parked" and not bar.ok else ""
        parts.append(f'<rect x="{x0:.1f}" y="{by:.1f}" width="{max(1.0, x1 - x0):.1f}" height="{bh:.1f}" '
                     f'fill="{colour}"{stroke}/>')
    if lane.spread is not None:
        a, b = x(lane.spread[0]), x(lane.spread[1])
        mid = y + h / 2
        parts.append(f'<line x1="{a:.1f}" y1="{mid:.1f}" x2="{max(b, a + 1):.1f}" y2="{mid:.1f}" stroke="#111" '
                     'stroke-width="1"/>')
    for mark in lane.marks:
        px = x(mark.at)
        parts.append(f'<rect x="{px - 1:.1f}" y="{y}" width="2" height="{h}" '
                     f'fill="{RESUMED if mark.ok else FAILED}"/>')
    if show_label and h >= 3:
        size = min(12, max(8, h - 4))
        weight = ' font-weight="700"' if lane.critical else ""
        colour = FAILED if lane.failed else "#222"
        label = lane.label + (f" ({lane.failed} failed)" if lane.failed and lane.ranks > 1 else "")
        parts.append(f'<text x="{LABEL_W - 8}" y="{y + h / 2 + size * 0.35:.1f}" font-size="{size}" '
                     f'text-anchor="end" fill="{colour}"{weight}>{_e(label)}</text>')
    if lane.critical and h >= 8:
        parts.append(f'<text x="{WIDTH - RIGHT_W + 6}" y="{y + h / 2 + 4:.1f}" font-size="10.5" fill="#7a5b00" '
                     f'font-weight="600">&#9664; {_e(_short_critical(lane.critical))}</text>')
    parts.append("</g>")
    return "".join(parts)


def _short_critical(text: str) -> str:
    """``parked last`` from ``parked last (+17.1 ms); answered last (...)``: the right margin is narrow."""
    words = [part.split(" (")[0] for part in text.split("; ")]
    return (", ".join(words) if len(words) < 3 else f"{words[0]} and {len(words) - 1} more")[:30]


def _lane_title(lane: Lane) -> str:
    lines = [lane.label + (f": slowest rank {lane.rank} shown" if lane.ranks > 1 else "")]
    for bar in lane.bars:
        state = "" if bar.ok else " FAILED"
        note = f" ({bar.note})" if bar.note else ""
        lines.append(f"{bar.phase}: +{_ms(bar.start)} to +{_ms(bar.end)}, {_ms(bar.end - bar.start)}{state}{note}")
    for mark in lane.marks:
        lines.append(f"{mark.label} at +{_ms(mark.at)}")
    if lane.spread is not None:
        lines.append(f"answers of its {lane.ranks} ranks: +{_ms(lane.spread[0])} to +{_ms(lane.spread[1])}")
    if lane.critical:
        lines.append(f"everyone waited: {lane.critical}")
    if lane.unfinished:
        lines.append("no result in these events")
    return "\n".join(lines)


def render_svg(timeline: Timeline) -> str:
    """Every switch of ``timeline`` stacked in one standalone SVG (``--format svg``)."""
    pieces: list[str] = []
    y = 0
    several = len(timeline.runs) > 1
    for switch in timeline.switches:
        body = switch_svg(switch)
        height = int(body.split('height="', 1)[1].split('"', 1)[0])
        pieces.append(f'<text x="8" y="{y + 18}" font-size="14" font-weight="700">'
                      f'{_e(_switch_heading(switch, several))}</text>')
        pieces.append(body.replace("<svg ", f'<svg x="0" y="{y + 26}" ', 1))
        y += height + 34
    if not pieces:
        pieces.append(f'<text x="8" y="20" font-size="14">no switch in the events of job {_e(timeline.job_id)}</text>')
        y = 30
    else:
        legend, height = _svg_legend(y)
        pieces.append(legend)
        y += height
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" viewBox="0 0 {WIDTH} {y}" '
            f'font-family="{FONTS}">'
            f'<rect width="{WIDTH}" height="{y}" fill="#fff"/>{"".join(pieces)}</svg>\n')


def switch_name(switch: Switch, several_runs: bool) -> str:
    """``Switch 3``, or with several runs in the files ``Switch 3 (run 2, list 1)``: the leader's list 1."""
    return f"Switch {switch.seq}" + (f" (run {switch.run}, list {switch.list_seq})" if several_runs else "")


def _switch_heading(switch: Switch, several_runs: bool) -> str:
    verdict = _verdict_word(switch.ok)
    step = f", parked at step {switch.step}" if switch.step is not None else ""
    return (f"{switch_name(switch, several_runs)}: {verdict} ({switch.reason}); {switch.ranks_seen} of "
            f"{switch.ranks_expected} ranks{step}; {span_text(switch)}")


def span_text(switch: Switch) -> str:
    """What a switch's duration measures: its own events only (a later stream loss is not part of it)."""
    return f"{_ms(switch.duration)} from its first event to its last"


def _verdict_word(ok: bool | None) -> str:
    return {True: "switched", False: "FAILED", None: "outcome unknown"}[ok]


def _verdict_class(ok: bool | None) -> str:
    return {True: "ok", False: "bad", None: "unknown"}[ok]


def render_html(timeline: Timeline) -> str:
    """The whole page: what was read and how clocks were aligned, an overview table, then each switch."""
    out = ['<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
           f"<title>nicswitch-agent timeline: job {_e(timeline.job_id)}</title>",
           f"<style>{CSS}</style></head><body>",
           f"<h1>Link switches of job {_e(timeline.job_id)}</h1>",
           f'<p class="meta">{timeline.files} events file(s); {timeline.ranks_seen} of {timeline.ranks_expected} '
           f"rank(s) have events; {len(timeline.switches)} switch(es). Times are in ms from each switch's first "
           "event, on the leader's clock.</p>",
           f'<p class="meta">{_e(alignment_text(timeline))}</p>']
    if timeline.problems or any(s.missing for s in timeline.switches):
        out.append('<div class="problems"><b>Missing or unreadable (the page shows what is known):</b><ul>')
        out.extend(f"<li>{_e(p)}</li>" for p in timeline.problems)
        out.extend(f"<li>{_e(m)}</li>" for s in timeline.switches for m in s.missing)
        out.append("</ul></div>")
    out.append(_runs(timeline))
    out.append(_overview(timeline))
    out.append(_legend())
    for switch in timeline.switches:
        out.append(_switch_section(switch, len(timeline.runs) > 1))
    out.append("</body></html>\n")
    return "".join(out)


def alignment_text(timeline: Timeline) -> str:
    a = timeline.alignment
    text = f"Clocks: {a.method}."
    largest = a.largest()
    if largest is not None:
        rank, offset = largest
        text += (f" {len(a.offsets)} rank(s) aligned; the largest shift was {_ms(offset)} (rank {rank}, over "
                 f"{a.messages.get(rank, 0)} message(s)).")
    if a.unaligned:
        text += f" Raw wall clock (no leader timestamps in their events): {len(a.unaligned)} rank(s)."
    return text


def _legend_items() -> list[tuple[str, str]]:
    """(colour, meaning) of everything the picture colours, for the page's legend and the SVG's."""
    items = [(COLOURS[p], PHASE_TEXT[p]) for p in ("pause", "parked", "guard", "switch", "verify")]
    return [*items, (GENERIC, "another phase (named in the hover text)"), (FAILED, "failed"),
            (RESUMED, "resumed (a tick)"), (CRITICAL, "everyone waited for this lane")]


def _legend() -> str:
    spans = "".join(f'<span><i style="background:{c}"></i>{_e(t)}</span>' for c, t in _legend_items())
    return (f'<p class="legend">{spans}<span>&#8212; node lanes: the line spans its ranks\' answers</span></p>')


LEGEND_COLUMNS = 3
LEGEND_ROW_H = 18


def _svg_legend(y: int) -> tuple[str, int]:
    """The legend drawn in SVG (``--format svg`` has no page around it): swatches in rows of
    three; the leader's ticks and node lanes last. Returns the SVG and its height."""
    items = [(f'<rect width="14" height="10" y="-9" fill="{c}" stroke="#999"/>', t) for c, t in _legend_items()]
    items.append(('<line x1="0" y1="-4" x2="14" y2="-4" stroke="#111"/>', "node lanes: first to last answer"))
    items.append(('<line x1="7" y1="-11" x2="7" y2="1" stroke="#1f4e79" stroke-width="2"/>',
                  "leader: a numbered message (hover it)"))
    column_w = (WIDTH - 16) // LEGEND_COLUMNS
    out = [f'<g class="legend"><text x="8" y="{y + 14}" font-size="12" font-weight="700">Legend</text>']
    for index, (swatch, text) in enumerate(items):
        row, column = divmod(index, LEGEND_COLUMNS)
        tx, ty = 8 + column * column_w, y + 34 + row * LEGEND_ROW_H
        out.append(f'<g transform="translate({tx},{ty})">{swatch}<text x="20" y="0" font-size="11" '
                   f'fill="#333">{_e(text)}</text></g>')
    out.append("</g>")
    rows = math.ceil(len(items) / LEGEND_COLUMNS)
    return "".join(out), 24 + rows * LEGEND_ROW_H + 6


def runs_text(timeline: Timeline) -> list[str]:
    """With several runs in the files: what that means, then a line per run; else nothing."""
    if len(timeline.runs) < 2:
        return []
    lines = [f"These files hold {len(timeline.runs)} runs of job {timeline.job_id} (the job or its processes were "
             "restarted, or the same events files were written again): each run's switches are drawn separately, "
             "numbered on in order; \"list N\" is the leader's number for it, from 1 in every run (--switch takes "
             "the switch's number)."]
    for run in timeline.runs:
        switches = ("no switch" if run.first_switch is None else f"switch {run.first_switch}"
                    if run.first_switch == run.last_switch else f"switches {run.first_switch}-{run.last_switch}")
        leader = f", leader pid {', '.join(map(str, run.leader_pids))}" if run.leader_pids else ""
        ranks = {p.source[0] for p in run.processes if p.source[0] is not None}
        again = len([p for p in run.processes if p.source[0] is not None]) - len(ranks)
        restarted = f" ({again} restart(s) of a rank's agent)" if again > 0 else ""
        lines.append(f"run {run.number}: started {_wall(run.start)}, {len(ranks)} rank(s){restarted}{leader}; "
                     f"{switches}")
    return lines


def _runs(timeline: Timeline) -> str:
    lines = runs_text(timeline)
    if not lines:
        return ""
    return (f'<div class="runs"><p><b>Several runs.</b> {_e(lines[0])}</p><ul>'
            + "".join(f"<li>{_e(line)}</li>" for line in lines[1:]) + "</ul></div>")


def _overview(timeline: Timeline) -> str:
    several = len(timeline.runs) > 1
    run_th = "<th>run</th>" if several else ""
    rows = [f'<table><tr><th class="l">switch</th>{run_th}<th class="l">result</th><th>ranks</th><th>step</th>'
            '<th>duration</th><th class="l">slowest phase (max)</th><th class="l">waited for</th></tr>']
    for s in timeline.switches:
        run_td = f"<td>{s.run} (list {s.list_seq})</td>" if several else ""
        worst = max((st for st in s.stats if st.phase != "parked"), key=lambda st: st.max, default=None)
        slow = f"{worst.phase} {_ms(worst.max)} (rank {worst.max_rank})" if worst else ""
        verdict = {True: "switched", False: "FAILED", None: "unknown"}[s.ok]
        rows.append(f'<tr><td class="l"><a href="#switch-{s.seq}">{s.seq}</a></td>{run_td}'
                    f'<td class="l {_verdict_class(s.ok)}">{verdict}</td>'
                    f"<td>{s.ranks_seen}/{s.ranks_expected}</td><td>{'' if s.step is None else s.step}</td>"
                    f'<td>{_ms(s.duration)}</td><td class="l">{_e(slow)}</td>'
                    f'<td class="l">{_e("; ".join(c.split(":")[0] for c in s.critical))}</td></tr>')
    rows.append("</table>")
    return "".join(rows)


def _switch_section(switch: Switch, several_runs: bool) -> str:
    out = [f'<h2 id="switch-{switch.seq}">{_e(switch_name(switch, several_runs))}: '
           f'<span class="{_verdict_class(switch.ok)}">'
           f"{_verdict_word(switch.ok)}</span> &#8212; "
           f"{_e(switch.reason)}</h2>",
           f'<p class="meta">Started {_e(_wall(switch.start_wall))} (leader\'s clock); {switch.ranks_seen} of '
           f"{switch.ranks_expected} ranks"
           + (f", parked at step {switch.step}" if switch.step is not None else "")
           + f"; {_e(span_text(switch))}."
           + (f" One lane per node of {switch.ranks_per_node} ranks: its slowest rank's bars." if switch.by_node
              else "") + "</p>"]
    if switch.missing:
        out.append('<ul class="missing bad">' + "".join(f"<li>{_e(m)}</li>" for m in switch.missing) + "</ul>")
    out.append(switch_svg(switch))
    if switch.critical:
        out.append("<p><b>Critical path:</b> " + "; ".join(_e(c) for c in switch.critical) + ".</p>")
    out.append(_leader_table(switch))
    out.append(_stats_table(switch))
    return "".join(out)


def _leader_table(switch: Switch) -> str:
    if not switch.leader and not switch.after:
        return ""
    rows = ['<table><tr><th>#</th><th>at</th><th class="l">the leader (ClusterD messages, orders to the ranks)'
            "</th></tr>"]
    for number, mark in enumerate(switch.leader, 1):
        css = "l" if mark.ok else "l bad"
        rows.append(f'<tr><td>{number}</td><td>+{_ms(mark.at)}</td><td class="{css}">{_e(mark.label)}</td></tr>')
    for mark in switch.after:  # not drawn: the picture ends where the switch did
        css = "l" if mark.ok else "l bad"
        rows.append(f'<tr><td></td><td>+{_ms(mark.at)}</td><td class="{css}">after the switch ended: '
                    f"{_e(mark.label)}</td></tr>")
    rows.append("</table>")
    return "".join(rows)


def _stats_table(switch: Switch) -> str:
    if not switch.stats:
        return ""
    rows = ['<table><tr><th class="l">phase</th><th>ranks</th><th>p50</th><th>p99</th><th>max</th>'
            '<th class="l">slowest rank</th></tr>']
    for st in switch.stats:
        rows.append(f'<tr><td class="l">{_e(st.phase)}</td><td>{st.count}</td><td>{_ms(st.p50)}</td>'
                    f'<td>{_ms(st.p99)}</td><td>{_ms(st.max)}</td><td class="l">rank {st.max_rank}</td></tr>')
    rows.append("</table>")
    if switch.slowest:
        rows.append("<p><b>Last to answer:</b> " + ", ".join(
            f"rank {rank} ({what} at +{_ms(at)})" for rank, at, what in switch.slowest) + "</p>")
    return "".join(rows)
