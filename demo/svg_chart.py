"""Line charts as plain SVG text: panels stacked over one time axis, no plotting library.

    svg = line_charts([Panel("KV blocks used", "blocks", 192, [Series("paged", points),
                                                              Series("contiguous", other)]),
                       Panel("running sequences", "sequences", 40, [...])],
                      title="same workload", x_label="seconds")

Each series is one `<polyline class="series" data-panel="..." data-name="..." data-values="x,y
...">`: its points in pixels, and in `data-values` as given, so a test (or a script) finds the
data again in the XML. A dashed line marks each panel's `y_limit` (the pool's size, say). A
series has the same colour in every panel, and one legend names them.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

WIDTH = 720
# One panel's height, and the room above the first for the title.
PANEL_HEIGHT, TITLE_HEIGHT = 230, 30
# Plot area inside a panel: room for its title and tick labels, the legend on the right.
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 28, 42
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
# About this many ticks per axis.
TICKS = 6


@dataclass(frozen=True, slots=True)
class Series:
    """One line: (x, y) points in x order."""

    name: str
    points: Sequence[tuple[float, float]]


@dataclass(frozen=True, slots=True)
class Panel:
    """One plot: its series on axes from 0 to the chart's largest x and from 0 to `y_limit`."""

    title: str
    y_label: str
    y_limit: float
    series: Sequence[Series]


def line_charts(panels: Sequence[Panel], *, title: str, x_label: str) -> str:
    """The SVG document (one string) of `panels`, one below the other, sharing the x axis."""
    x_max = max((x for panel in panels for s in panel.series for x, _ in s.points),
                default=1.0) or 1.0
    names = list(dict.fromkeys(s.name for panel in panels for s in panel.series))
    colors = {name: COLORS[index % len(COLORS)] for index, name in enumerate(names)}
    height = TITLE_HEIGHT + PANEL_HEIGHT * len(panels)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
             f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15">'
             f'{escape(title)}</text>']
    for index, panel in enumerate(panels):
        parts += _panel(panel, TITLE_HEIGHT + index * PANEL_HEIGHT, x_max, x_label, colors)
    for index, (name, color) in enumerate(colors.items()):
        legend_y = TITLE_HEIGHT + TOP + 10 + 20 * index
        parts += [f'<line x1="{WIDTH - RIGHT + 14}" y1="{legend_y}" x2="{WIDTH - RIGHT + 38}" '
                  f'y2="{legend_y}" stroke="{color}" stroke-width="2"/>',
                  f'<text x="{WIDTH - RIGHT + 44}" y="{legend_y + 4}">{escape(name)}</text>']
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(panel: Panel, top: float, x_max: float, x_label: str,
           colors: dict[str, str]) -> list[str]:
    """One panel's elements, its box starting `top` pixels down the picture."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, PANEL_HEIGHT - TOP - BOTTOM
    bottom = top + TOP + plot_h

    def px(x: float) -> float:
        return LEFT + x / x_max * plot_w

    def py(y: float) -> float:
        return bottom - y / panel.y_limit * plot_h

    parts = [f'<text x="{LEFT + plot_w / 2:.0f}" y="{top + TOP - 8}" text-anchor="middle" '
             f'font-size="13">{escape(panel.title)}</text>']
    parts += [_tick(px(tick), bottom, f"{tick:g}", vertical=True) for tick in _ticks(x_max)]
    parts += [_tick(LEFT, py(tick), f"{tick:g}", vertical=False)
              for tick in _ticks(panel.y_limit)]
    parts += [
        f'<line x1="{LEFT}" y1="{bottom}" x2="{LEFT + plot_w}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{top + TOP}" x2="{LEFT}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{py(panel.y_limit):.1f}" x2="{LEFT + plot_w}" '
        f'y2="{py(panel.y_limit):.1f}" stroke="gray" stroke-dasharray="4 3"/>',
        f'<text x="{LEFT + plot_w / 2:.0f}" y="{bottom + 34}" text-anchor="middle">'
        f'{escape(x_label)}</text>',
        f'<text transform="translate(16 {top + TOP + plot_h / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle">{escape(panel.y_label)}</text>']
    for line in panel.series:
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line.points)
        values = " ".join(f"{x:.3f},{y:g}" for x, y in line.points)
        parts.append(f'<polyline class="series" data-panel={quoteattr(panel.title)} '
                     f'data-name={quoteattr(line.name)} data-values="{values}" fill="none" '
                     f'stroke="{colors[line.name]}" stroke-width="2" points="{points}"/>')
    return parts


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
