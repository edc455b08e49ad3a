"""Small inline SVG charts for the run report (no script, no network).

Every text that goes into the SVG is HTML-escaped here: labels come from
the run directory (host names, interface names), which is untrusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

#: Line colours, in order (enough to tell 8 GPUs or ranks apart).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
WIDTH, HEIGHT = 640, 180
LEFT, RIGHT, TOP, BOTTOM = 56, 130, 22, 26
#: Most points drawn per line (long runs are thinned to this).
MAX_POINTS = 600


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (seconds since start, value)


def _thin(points: Sequence[tuple[float, float]]) -> Sequence[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / MAX_POINTS
    return [points[int(i * step)] for i in range(MAX_POINTS)] + [points[-1]]


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    for m in (1, 2, 2.5, 5, 10):
        scale = 10 ** len(str(int(value))) / 10
        if value <= m * scale:
            return m * scale
    return value


def line_chart(title: str, series: Sequence[Series], *, unit: str = "", y_max: float | None = None,
               x_max: float | None = None) -> str:
    """An SVG line chart; x in seconds since the run began."""
    xs = [p[0] for s in series for p in s.points]
    ys = [p[1] for s in series for p in s.points]
    x_hi = x_max or (max(xs) if xs else 1.0) or 1.0
    y_hi = y_max or _nice_max(max(ys) if ys else 1.0)
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + pw * min(max(x / x_hi, 0.0), 1.0)

    def py(y: float) -> float:
        return TOP + ph * (1 - min(max(y / y_hi, 0.0), 1.0))

    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
           f'<text x="{LEFT}" y="14" class="title">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="frame"/>']
    for frac in (0, 0.5, 1):
        y = TOP + ph * (1 - frac)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" class="axis" text-anchor="end">'
                   f'{escape(_short(y_hi * frac))}{escape(unit)}</text>')
    for frac in (0, 0.5, 1):
        out.append(f'<text x="{LEFT + pw * frac:.1f}" y="{HEIGHT - 8}" class="axis" text-anchor="middle">'
                   f'{x_hi * frac:.0f} s</text>')
    for i, s in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in _thin(s.points))
        if pts:
            out.append(f'<polyline class="line" fill="none" stroke="{colour}" stroke-width="1.5" points="{pts}"/>')
        if i < 10:
            ly = TOP + 12 + 14 * i
            out.append(f'<rect x="{WIDTH - RIGHT + 8}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>'
                       f'<text x="{WIDTH - RIGHT + 22}" y="{ly}" class="legend">{escape(s.label[:18])}</text>')
    if not ys:
        out.append(f'<text x="{LEFT + pw / 2}" y="{TOP + ph / 2}" class="axis" text-anchor="middle">no data</text>')
    out.append("</svg>")
    return "".join(out)


def _short(v: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.3g}"


@dataclass(frozen=True)
class Lane:
    """One row of the timeline: a bar from ``start`` to ``end`` (seconds),
    with marks (seconds, kind, label) on it."""

    label: str
    start: float | None
    end: float | None
    marks: Sequence[tuple[float, str, str]] = ()
    #: (seconds, 0..1): how fast the rank went, drawn as the bar's shade.
    activity: Sequence[tuple[float, float]] = ()


MARK_COLOURS = {"first-output": "#2ca02c", "failure": "#d62728", "end": "#333333", "start": "#1f77b4"}


def timeline(lanes: Sequence[Lane], x_max: float) -> str:
    """The job's timeline: one lane per node and rank."""
    lane_h, left = 22, 150
    width = WIDTH + 120
    pw = width - left - 20
    height = TOP + lane_h * len(lanes) + BOTTOM
    x_hi = x_max or 1.0

    def px(x: float) -> float:
        return left + pw * min(max(x / x_hi, 0.0), 1.0)

    out = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="timeline">']
    for i, lane in enumerate(lanes):
        y = TOP + lane_h * i
        out.append(f'<text x="{left - 6}" y="{y + 15}" class="legend" text-anchor="end">{escape(lane.label[:24])}</text>')
        if lane.start is not None and lane.end is not None:
            out.append(f'<rect x="{px(lane.start):.1f}" y="{y + 4}" width="{max(px(lane.end) - px(lane.start), 1):.1f}" '
                       f'height="{lane_h - 8}" class="bar"/>')
        for t, level in lane.activity:
            out.append(f'<rect x="{px(t):.1f}" y="{y + 4}" width="{max(pw / x_hi, 1):.1f}" height="{lane_h - 8}" '
                       f'fill="#1f77b4" fill-opacity="{min(max(level, 0), 1):.2f}"/>')
        for t, kind, label in lane.marks:
            colour = MARK_COLOURS.get(kind, "#333333")
            out.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{y + 1}" y2="{y + lane_h - 1}" stroke="{colour}" '
                       f'stroke-width="2" class="mark mark-{escape(kind)}"><title>{escape(label)}</title></line>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        out.append(f'<text x="{left + pw * frac:.1f}" y="{height - 8}" class="axis" text-anchor="middle">'
                   f'{x_hi * frac:.0f} s</text>')
    out.append("</svg>")
    return "".join(out)
