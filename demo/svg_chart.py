"""A line chart as plain SVG text: a few series over one time axis, no plotting library.

    svg = line_chart([Series("paged", points), Series("contiguous", other)],
                     title="KV blocks used", x_label="seconds", y_label="blocks", y_limit=192)

Each series is one `<polyline class="series" data-name="...">`, so a test (or a script) can find
the data again in the XML; a dashed line marks `y_limit` (the pool's size).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

WIDTH, HEIGHT = 720, 400
# Plot area inside the picture: room for tick labels left and below, the legend on the right.
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 40, 52
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
# About this many ticks per axis.
TICKS = 6


@dataclass(frozen=True, slots=True)
class Series:
    """One line: (x, y) points in x order."""

    name: str
    points: Sequence[tuple[float, float]]


def line_chart(series: Sequence[Series], *, title: str, x_label: str, y_label: str,
               y_limit: float) -> str:
    """The SVG document (one string) of `series` on shared axes from 0 to the largest x and
    from 0 to `y_limit`."""
    x_max = max((x for s in series for x, _ in s.points), default=1.0) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + x / x_max * plot_w

    def py(y: float) -> float:
        return TOP + plot_h - y / y_limit * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15">'
             f'{escape(title)}</text>']
    for tick in _ticks(x_max):
        parts.append(_tick(px(tick), TOP + plot_h, f"{tick:g}", vertical=True))
    for tick in _ticks(y_limit):
        parts.append(_tick(LEFT, py(tick), f"{tick:g}", vertical=False))
    parts += [
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" '
        'stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{py(y_limit):.1f}" x2="{LEFT + plot_w}" y2="{py(y_limit):.1f}" '
        'stroke="gray" stroke-dasharray="4 3"/>',
        f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 12}" text-anchor="middle">'
        f'{escape(x_label)}</text>',
        f'<text transform="translate(16 {TOP + plot_h / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text>']
    for index, (line, color) in enumerate(zip(series, COLORS, strict=False)):
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line.points)
        parts.append(f'<polyline class="series" data-name={quoteattr(line.name)} fill="none" '
                     f'stroke="{color}" stroke-width="2" points="{points}"/>')
        legend_y = TOP + 10 + 20 * index
        parts += [f'<line x1="{WIDTH - RIGHT + 14}" y1="{legend_y}" x2="{WIDTH - RIGHT + 38}" '
                  f'y2="{legend_y}" stroke="{color}" stroke-width="2"/>',
                  f'<text x="{WIDTH - RIGHT + 44}" y="{legend_y + 4}">{escape(line.name)}</text>']
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _ticks(limit: float) -> list[float]:
    """Round tick values from 0 to `limit`: steps of 1, 2 or 5 times a power of ten."""
    raw = limit / TICKS
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(limit / step + 1e-9) + 1)]


def _tick(x: float, y: float, text: str, *, vertical: bool) -> str:
    """A tick mark on an axis and its label: below the x axis, left of the y axis."""
    if vertical:
        return (f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 5}" stroke="black"/>'
                f'<text x="{x:.1f}" y="{y + 18}" text-anchor="middle">{text}</text>')
    return (f'<line x1="{x - 5}" y1="{y:.1f}" x2="{x}" y2="{y:.1f}" stroke="black"/>'
            f'<text x="{x - 8}" y="{y + 4:.1f}" text-anchor="end">{text}</text>')
