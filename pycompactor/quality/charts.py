"""Small SVG charts, written as text: no browser, no JavaScript, no fonts to fetch.

`pycompactor evaluate --html` inlines them in its report, and `make docs-images` writes
them as files for the README. Inline SVG in HTML needs no namespace; a file does
(`standalone=True` adds the `xmlns` attribute and an XML-safe header). Text uses the
generic `sans-serif` family, which every viewer has.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Final

WIDTH: Final = 560
HEIGHT: Final = 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 16, 40, 56
_FONT: Final = 'font-family="sans-serif"'
#: Two colours distinguishable with the common colour-vision deficiencies.
BLUE: Final = "#2b6cb0"
ORANGE: Final = "#dd6b20"
_GRID: Final = "#d9d9d9"
_SVG_NS: Final = "http" + "://www.w3.org/2000/svg"  # only in standalone files


@dataclass(frozen=True, slots=True)
class Series:
    """One named set of bar heights, one per category."""

    name: str
    values: tuple[float, ...]
    colour: str


def _open(title: str, standalone: bool) -> list[str]:
    ns = f' xmlns="{_SVG_NS}"' if standalone else ""
    return [
        f'<svg{ns} width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}"'
        f' role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15"'
        f' font-weight="bold" {_FONT}>{escape(title)}</text>',
    ]


def _axis(value: float) -> tuple[float, int]:
    """A round step (1, 2 or 5 times a power of ten) and how many steps reach value:
    about five gridlines, each at a round number."""
    if value <= 0:
        return 1.0, 1
    raw = value / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return float(step), max(1, math.ceil(value / step - 1e-9))


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def bar_chart(title: str, categories: Sequence[str], series: Sequence[Series], *,
              x_label: str, y_label: str, counts: bool = False,
              standalone: bool = False) -> str:
    """Grouped vertical bars: one group per category, one bar per series, with a
    y axis from 0, gridlines, value labels on the bars and a legend. `counts`: the
    gridlines are whole numbers."""
    if any(len(s.values) != len(categories) for s in series):
        raise ValueError("every series needs one value per category")
    plot_w = WIDTH - _LEFT - _RIGHT
    plot_h = HEIGHT - _TOP - _BOTTOM
    highest = max((v for s in series for v in s.values), default=0.0)
    step, steps = _axis(highest)
    if counts and step < 1:
        step, steps = 1.0, max(1, math.ceil(highest))
    top = step * steps
    out = _open(title, standalone)
    for i in range(steps + 1):
        value = step * i
        y = _TOP + plot_h - plot_h * i / steps
        out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{WIDTH - _RIGHT}" y2="{y:.1f}"'
                   f' stroke="{_GRID}"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end"'
                   f' font-size="11" {_FONT}>{_fmt(round(value, 3))}</text>')
    group_w = plot_w / max(len(categories), 1)
    bar_w = group_w * 0.8 / max(len(series), 1)
    for c, category in enumerate(categories):
        x0 = _LEFT + c * group_w + group_w * 0.1
        for k, s in enumerate(series):
            value = s.values[c]
            h = plot_h * value / top
            x = x0 + k * bar_w
            y = _TOP + plot_h - h
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2:.1f}"'
                       f' height="{h:.1f}" fill="{s.colour}">'
                       f"<title>{escape(s.name)}, {escape(category)}: {value:g}</title></rect>")
            if len(categories) * len(series) <= 16:
                out.append(f'<text x="{x + (bar_w - 2) / 2:.1f}" y="{y - 3:.1f}"'
                           f' text-anchor="middle" font-size="10" {_FONT}>'
                           f"{_fmt(round(value, 1))}</text>")
        out.append(f'<text x="{x0 + group_w * 0.4:.1f}" y="{_TOP + plot_h + 16}"'
                   f' text-anchor="middle" font-size="11" {_FONT}>{escape(category)}</text>')
    out.append(f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{WIDTH - _RIGHT}"'
               f' y2="{_TOP + plot_h}" stroke="#333333"/>')
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{HEIGHT - 22}" text-anchor="middle"'
               f' font-size="12" {_FONT}>{escape(x_label)}</text>')
    out.append(f'<text transform="translate(14 {_TOP + plot_h / 2:.0f}) rotate(-90)"'
               f' text-anchor="middle" font-size="12" {_FONT}>{escape(y_label)}</text>')
    legend_x = _LEFT
    for s in series if len(series) > 1 else ():
        out.append(f'<rect x="{legend_x}" y="{HEIGHT - 14}" width="10" height="10"'
                   f' fill="{s.colour}"/>')
        out.append(f'<text x="{legend_x + 14}" y="{HEIGHT - 5}" font-size="11" {_FONT}>'
                   f"{escape(s.name)}</text>")
        legend_x += 24 + 7 * len(s.name)
    out.append("</svg>")
    return "\n".join(out)


def histogram(title: str, values: Sequence[float], edges: Sequence[float], *,
              x_label: str, colour: str = BLUE, last_label: str | None = None,
              standalone: bool = False) -> str:
    """How many values fall in each bin [edges[i], edges[i+1]); the last bin is closed
    and takes everything above it too, so no value is lost off the axis. Its label is
    `≥ edges[-2]` unless `last_label` names it."""
    if len(edges) < 2 or any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError("edges must be at least two increasing numbers")
    counts = [0] * (len(edges) - 1)
    for value in values:
        i = 0
        while i < len(counts) - 1 and value >= edges[i + 1]:
            i += 1
        counts[i] += 1
    labels = [f"{_fmt(edges[i])}–{_fmt(edges[i + 1])}" for i in range(len(counts))]
    labels[-1] = last_label if last_label is not None else f"≥{_fmt(edges[-2])}"
    return bar_chart(title, labels, [Series("ranges", tuple(map(float, counts)), colour)],
                     x_label=x_label, y_label="ranges", counts=True, standalone=standalone)


def xml_file(svg: str) -> str:
    """A standalone chart as the text of an .svg file."""
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + svg + "\n"


def text_image(lines: Sequence[str], *, title: str, standalone: bool = False) -> str:
    """Monospaced text (a terminal's table) as an SVG image, one <text> per line."""
    char_w, line_h = 7.2, 15
    width = int(24 + char_w * max((len(line) for line in lines), default=0))
    height = 24 + line_h * len(lines)
    ns = f' xmlns="{_SVG_NS}"' if standalone else ""
    out = [f'<svg{ns} width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
           f' role="img" aria-label="{escape(title)}">',
           f"<title>{escape(title)}</title>",
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    for i, line in enumerate(lines):
        out.append(f'<text x="12" y="{20 + i * line_h}" font-family="monospace"'
                   f' font-size="12" xml:space="preserve">{escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class Point:
    """One labelled point of a scatter chart; points of one series share a colour and
    are joined by a line in x order (a summarizer at several targets: its frontier)."""

    series: str
    label: str
    x: float
    y: float
    colour: str


def scatter(title: str, points: Sequence[Point], *, x_label: str, y_label: str,
            y_max: float = 1.0, standalone: bool = False) -> str:
    """Points on axes from 0 (x up to a round number past the largest x, y up to
    `y_max`), each series joined in x order, each point labelled, and a legend."""
    plot_w = WIDTH - _LEFT - _RIGHT
    plot_h = HEIGHT - _TOP - _BOTTOM
    # Headroom past the largest x, so its point and label stay inside the plot.
    step, steps = _axis(1.1 * max((p.x for p in points), default=0.0))
    right = step * steps

    def at(p: Point) -> tuple[float, float]:
        return (_LEFT + plot_w * min(p.x, right) / right,
                _TOP + plot_h - plot_h * min(max(p.y, 0.0), y_max) / y_max)

    out = _open(title, standalone)
    for i in range(6):
        y = _TOP + plot_h - plot_h * i / 5
        out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{WIDTH - _RIGHT}" y2="{y:.1f}"'
                   f' stroke="{_GRID}"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end"'
                   f' font-size="11" {_FONT}>{_fmt(round(y_max * i / 5, 3))}</text>')
    for i in range(steps + 1):
        x = _LEFT + plot_w * i / steps
        out.append(f'<line x1="{x:.1f}" y1="{_TOP}" x2="{x:.1f}" y2="{_TOP + plot_h}"'
                   f' stroke="{_GRID}"/>')
        out.append(f'<text x="{x:.1f}" y="{_TOP + plot_h + 16}" text-anchor="middle"'
                   f' font-size="11" {_FONT}>{_fmt(round(step * i, 3))}</text>')
    series = list(dict.fromkeys(p.series for p in points))
    # Points drawn at one spot (a model whose output stops growing past some target)
    # share one label.
    at_spot: dict[tuple[str, str], list[str]] = {}
    for p in points:
        x, y = at(p)
        at_spot.setdefault((f"{x:.1f}", f"{y:.1f}"), []).append(p.label)
    labelled: set[tuple[str, str]] = set()
    for name in series:
        mine = sorted((p for p in points if p.series == name), key=lambda p: p.x)
        if len(mine) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(at, mine))
            out.append(f'<polyline points="{path}" fill="none" stroke="{mine[0].colour}"'
                       ' stroke-width="1.5"/>')
        for p in mine:
            x, y = at(p)
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{p.colour}">'
                       f"<title>{escape(p.label)}: {p.x:.2f}, {p.y:.2f}</title></circle>")
            spot = (f"{x:.1f}", f"{y:.1f}")
            if spot in labelled:
                continue
            labelled.add(spot)
            # Labels right of a point in the left half, left of it in the right half.
            anchor, dx = ("start", 6) if x < _LEFT + plot_w / 2 else ("end", -6)
            out.append(f'<text x="{x + dx:.1f}" y="{y - 6:.1f}" text-anchor="{anchor}"'
                       f' font-size="10" {_FONT}>{escape(", ".join(at_spot[spot]))}</text>')
    out.append(f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{WIDTH - _RIGHT}"'
               f' y2="{_TOP + plot_h}" stroke="#333333"/>')
    out.append(f'<text x="{_LEFT + plot_w / 2:.0f}" y="{HEIGHT - 22}" text-anchor="middle"'
               f' font-size="12" {_FONT}>{escape(x_label)}</text>')
    out.append(f'<text transform="translate(14 {_TOP + plot_h / 2:.0f}) rotate(-90)"'
               f' text-anchor="middle" font-size="12" {_FONT}>{escape(y_label)}</text>')
    legend_x = _LEFT
    for name in series if len(series) > 1 else ():
        colour = next(p.colour for p in points if p.series == name)
        out.append(f'<circle cx="{legend_x + 5}" cy="{HEIGHT - 9}" r="4" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 14}" y="{HEIGHT - 5}" font-size="11" {_FONT}>'
                   f"{escape(name)}</text>")
        legend_x += 24 + 7 * len(name)
    out.append("</svg>")
    return "\n".join(out)


#: Colours for series beyond the first two (still apart under colour-vision deficiency).
PALETTE: Final = (BLUE, ORANGE, "#38a169", "#805ad5", "#4a5568", "#d53f8c")
