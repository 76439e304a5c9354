"""A small SVG stacked-bar writer: one horizontal bar per run, split into named segments (seconds per phase).

    svg = render([("ds 2.42B", [("forward", 4.1), ("backward", 21.7)]), ...], title="...", unit="s")

Used by `benchmarks/infinity.py` for the per-phase chart in RESULTS.md; no plotting library needed.
"""

from __future__ import annotations

from html import escape

from _svg_plot import nice_ticks

COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948")
_LABEL_W, _BAR_H, _GAP, _PLOT_W, _TOP = 190, 26, 12, 520, 40


def render(bars: list[tuple[str, list[tuple[str, float]]]], *, title: str = "", unit: str = "s") -> str:
    """The SVG text: bars top to bottom in the given order, segments left to right, a shared legend."""
    names: list[str] = []
    for _, segments in bars:
        names += [n for n, _ in segments if n not in names]
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    longest = max((sum(v for _, v in segments) for _, segments in bars), default=1.0) or 1.0
    ticks = nice_ticks(0.0, longest)
    top = max(ticks[-1], longest)
    scale = _PLOT_W / top
    height = _TOP + len(bars) * (_BAR_H + _GAP) + 70
    width = _LABEL_W + _PLOT_W + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    axis_y = _TOP + len(bars) * (_BAR_H + _GAP)
    for t in ticks:
        x = _LABEL_W + t * scale
        out.append(f'<line x1="{x:.1f}" y1="{_TOP - 4}" x2="{x:.1f}" y2="{axis_y}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{_LABEL_W + _PLOT_W / 2}" y="{axis_y + 30}" text-anchor="middle">{escape(unit)}</text>')
    for i, (label, segments) in enumerate(bars):
        y = _TOP + i * (_BAR_H + _GAP)
        out.append(f'<text x="{_LABEL_W - 8}" y="{y + _BAR_H * 0.65:.1f}" text-anchor="end">{escape(label)}</text>')
        x = float(_LABEL_W)
        for name, value in segments:
            w = max(0.0, value) * scale
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_BAR_H}" fill="{color[name]}">'
                f"<title>{escape(name)}: {value:.2f} {escape(unit)}</title></rect>"
            )
            x += w
        total = sum(v for _, v in segments)
        out.append(f'<text x="{x + 4:.1f}" y="{y + _BAR_H * 0.65:.1f}">{total:.1f} {escape(unit)}</text>')
    lx = float(_LABEL_W)
    for name in names:
        out.append(f'<rect x="{lx:.1f}" y="{axis_y + 42}" width="12" height="12" fill="{color[name]}"/>')
        out.append(f'<text x="{lx + 16:.1f}" y="{axis_y + 52}">{escape(name)}</text>')
        lx += 16 + 8 * len(name) + 18
    out.append("</svg>")
    return "\n".join(out) + "\n"
