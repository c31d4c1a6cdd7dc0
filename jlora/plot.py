"""Dependency-free SVG charts for the docs (no matplotlib): `bar_chart_svg`, used for docs/benchmarks.svg."""

from __future__ import annotations

from xml.sax.saxutils import escape

WIDTH = 720
LABEL_W = 270  # left column: the bar labels, right-aligned against the bars
VALUE_W = 110  # right margin: the value printed after each bar
BAR_H, GAP, TOP = 26, 10, 48
RED = "#d62728"


def bar_chart_svg(title: str, labels: list[str], values: list[float], unit: str,
                  reference: float | None = None, reference_label: str = "") -> str:
    """A horizontal bar chart (one bar per label, its value at the bar's end) with an optional dashed vertical
    line at `reference`, as a self-contained SVG document that renders as an image in GitHub markdown."""
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels for {len(values)} values")
    span = WIDTH - LABEL_W - VALUE_W
    scale = span / max([*values, reference or 0.0, 1e-9])
    bottom = TOP + len(values) * (BAR_H + GAP)
    height = bottom + (30 if reference is not None else 10)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="13" fill="#222">',
        '<rect width="100%" height="100%" fill="white"/>',  # readable under GitHub's dark theme too
        f'<text x="{WIDTH // 2}" y="26" text-anchor="middle" font-size="16" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (label, v) in enumerate(zip(labels, values)):
        y = TOP + i * (BAR_H + GAP)
        w = max(v, 0.0) * scale
        base = y + BAR_H // 2 + 5  # text baseline that centres 13 px text on the bar
        out += [
            f'<text x="{LABEL_W - 8}" y="{base}" text-anchor="end">{escape(label)}</text>',
            f'<rect class="bar" x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" fill="#4c78a8"/>',
            f'<text x="{LABEL_W + w + 6:.1f}" y="{base}">{v:.1f} {escape(unit)}</text>',
        ]
    if reference is not None:
        x = LABEL_W + reference * scale
        anchor = "end" if x > LABEL_W + span / 2 else "start"  # keep the label inside the picture
        text = " = ".join(filter(None, [reference_label, f"{reference:.1f} {unit}"]))
        out += [
            f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{bottom}" stroke="{RED}" stroke-width="1.5" '
            f'stroke-dasharray="6 4"/>',
            f'<text x="{x:.1f}" y="{bottom + 18}" text-anchor="{anchor}" fill="{RED}">{escape(text)}</text>',
        ]
    return "\n".join(out + ["</svg>"]) + "\n"
