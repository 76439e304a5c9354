"""A small SVG line-plot writer (axes, ticks, legend), so the benchmarks need no plotting library.

    svg = render([Panel("loss", "step", "loss", [Series("DDP", xs, ys), ...])], title="Loss curves")
    Path("plot.svg").write_text(svg)

Panels sit side by side and share one legend below them; a panel may use a log10 y axis (values
<= 0 are clamped to the panel's floor there, and the floor is said in the axis label).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

COLORS = ("#222222", "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
DASHES = ("", "8 4", "2 3", "10 3 2 3", "4 4", "1 2", "12 6", "6 2 2 2")
PANEL_W, PANEL_H = 460, 320
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 64, 16, 36, 44
FONT = 'font-family="sans-serif" font-size="12"'
TITLE_FONT = 'font-family="sans-serif" font-size="14" font-weight="bold"'


@dataclass(frozen=True)
class Series:
    """One line: `label` in the legend, points (xs[i], ys[i]); series keep their style across panels."""

    label: str
    xs: list[float]
    ys: list[float]


@dataclass(frozen=True)
class Panel:
    """One set of axes with its lines; `log_y` plots log10(y), clamping y <= 0 to `log_floor`."""

    title: str
    x_label: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    log_y: bool = False
    log_floor: float = 1e-9


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values (steps of 1, 2 or 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, value = [], first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < hi:
        ticks.append(round(value, 12))
    return ticks


def _fmt(value: float) -> str:
    return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.0e}"


def _panel(panel: Panel, x0: float, styles: dict[str, tuple[str, str, float]]) -> list[str]:
    """SVG elements of one panel whose left edge is at x0."""
    ys_all = [y for s in panel.series for y in s.ys]
    xs_all = [x for s in panel.series for x in s.xs]
    if not xs_all:
        return []

    def ty(y: float) -> float:
        return math.log10(max(y, panel.log_floor)) if panel.log_y else y

    tys = [ty(y) for y in ys_all]
    if panel.log_y:
        y_ticks = list(range(math.floor(min(tys)), math.ceil(max(tys)) + 1))
        if len(y_ticks) < 2:
            y_ticks.append(y_ticks[0] + 1)
    else:
        y_ticks = nice_ticks(min(tys), max(tys))
    x_ticks = nice_ticks(min(xs_all), max(xs_all))
    (xlo, xhi), (ylo, yhi) = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])
    left, right = x0 + MARGIN_L, x0 + PANEL_W - MARGIN_R
    top, bottom = MARGIN_T, PANEL_H - MARGIN_B

    def px(x: float) -> float:
        return left + (x - xlo) / ((xhi - xlo) or 1) * (right - left)

    def py(y: float) -> float:
        return bottom - (y - ylo) / ((yhi - ylo) or 1) * (bottom - top)

    out = [
        f'<text x="{(left + right) / 2:.1f}" y="20" text-anchor="middle" {FONT} font-weight="bold">'
        f"{escape(panel.title)}</text>",
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#888"/>',
    ]
    for t in x_ticks:
        out.append(f'<line x1="{px(t):.1f}" y1="{top}" x2="{px(t):.1f}" y2="{bottom}" stroke="#eee"/>')
        out.append(f'<text x="{px(t):.1f}" y="{bottom + 16}" text-anchor="middle" {FONT}>{_fmt(t)}</text>')
    for t in y_ticks:
        label = f"1e{t}" if panel.log_y else _fmt(t)
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{right}" y2="{py(t):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end" {FONT}>{label}</text>')
    out.append(
        f'<text x="{(left + right) / 2:.1f}" y="{PANEL_H - 8}" text-anchor="middle" {FONT}>'
        f"{escape(panel.x_label)}</text>"
    )
    y_label = panel.y_label + (f" (log; 0 shown at {panel.log_floor:g})" if panel.log_y else "")
    out.append(
        f'<text transform="translate({x0 + 16},{(top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle" '
        f"{FONT}>{escape(y_label)}</text>"
    )
    for s in panel.series:
        color, dash, width = styles[s.label]
        points = " ".join(f"{px(x):.1f},{py(ty(y)):.1f}" for x, y in zip(s.xs, s.ys, strict=True))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="{width}"{dash_attr}/>')
    return out


def render(panels: list[Panel], *, title: str = "") -> str:
    """An SVG document with the panels side by side and one legend of every series label below them."""
    labels = list(dict.fromkeys(s.label for p in panels for s in p.series))
    # The first series is drawn widest, the rest thinner with dashes, so identical curves stay visible.
    styles = {
        label: (COLORS[i % len(COLORS)], DASHES[i % len(DASHES)], 4.0 if i == 0 else 1.6)
        for i, label in enumerate(labels)
    }
    top = 24 if title else 0
    legend_rows = math.ceil(len(labels) / 4)
    width, height = PANEL_W * max(1, len(panels)), top + PANEL_H + 20 * legend_rows + 12
    body = [f'<rect width="{width}" height="{height}" fill="white"/>']
    if title:
        body.append(f'<text x="{width / 2}" y="18" text-anchor="middle" {TITLE_FONT}>{escape(title)}</text>')
    body.append(f'<g transform="translate(0,{top})">')
    for i, panel in enumerate(panels):
        body += _panel(panel, i * PANEL_W, styles)
    body.append("</g>")
    column = width / 4
    for i, label in enumerate(labels):
        color, dash, stroke = styles[label]
        x, y = 20 + (i % 4) * column, top + PANEL_H + 14 + 20 * (i // 4)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        body.append(
            f'<line x1="{x:.1f}" y1="{y}" x2="{x + 36:.1f}" y2="{y}" stroke="{color}" '
            f'stroke-width="{stroke}"{dash_attr}/>'
        )
        body.append(f'<text x="{x + 42:.1f}" y="{y + 4}" {FONT}>{escape(label)}</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n' + "\n".join(body) + "\n</svg>\n"
    )
