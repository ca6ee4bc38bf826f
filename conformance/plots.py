"""Inline SVG line plots for the self-contained HTML reports (no JavaScript, no network)."""

from __future__ import annotations

import html
import math

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22")


def line_plot_svg(series: dict, *, x_label: str, y_label: str, log_x: bool = False, log_y: bool = False,
                  width: int = 720, height: int = 380) -> str:
    """series: name -> [(x, y), ...]. Returns an <svg> element with axes, ticks and a legend."""
    points = [(x, y) for values in series.values() for x, y in values if y is not None and (not log_x or x > 0) and (not log_y or y > 0)]
    if not points:
        return "<p>(no data to plot)</p>"
    fx = (lambda v: math.log10(v)) if log_x else float
    fy = (lambda v: math.log10(v)) if log_y else float
    xs, ys = [fx(x) for x, _ in points], [fy(y) for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    left, right, top, bottom = 70, 190, 15, 45
    pw, ph = width - left - right, height - top - bottom

    def px(v):
        return left + (fx(v) - x0) / (x1 - x0) * pw

    def py(v):
        return top + ph - (fy(v) - y0) / (y1 - y0) * ph

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">']
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    for tick in _ticks(x0, x1, log_x):
        x = left + (fx(tick) - x0) / (x1 - x0) * pw
        parts.append(f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 4}" stroke="#888"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt(tick)}</text>')
    for tick in _ticks(y0, y1, log_y):
        y = top + ph - (fy(tick) - y0) / (y1 - y0) * ph
        parts.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(tick)}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">{html.escape(x_label)}</text>')
    parts.append(f'<text x="14" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {top + ph / 2})">{html.escape(y_label)}</text>')
    for i, (name, values) in enumerate(series.items()):
        color = _PALETTE[i % len(_PALETTE)]
        dash = ' stroke-dasharray="5,3"' if i % 2 else ""
        pts = [(px(x), py(y)) for x, y in values if y is not None and (not log_x or x > 0) and (not log_y or y > 0)]
        if pts:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"{dash}/>')
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2" fill="{color}"/>' for x, y in pts]
        ly = top + 14 * i + 8
        parts.append(f'<line x1="{left + pw + 10}" y1="{ly}" x2="{left + pw + 30}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        parts.append(f'<text x="{left + pw + 34}" y="{ly + 4}">{html.escape(str(name))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    """Tick values: on a log axis (lo, hi are exponents) powers of ten, or 1-2-5 steps when
    fewer than two powers of ten fall in the range, or failing that its two ends and what of
    1-1.5-2-3-5-7 falls between them."""
    if log:
        inside = lambda v: lo - 1e-9 <= math.log10(v) <= hi + 1e-9  # noqa: E731
        decades = range(math.floor(lo), math.ceil(hi) + 1)
        ticks = []
        for mantissas in ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7)):
            ticks = [m * 10.0**e for e in decades for m in mantissas if inside(m * 10.0**e)]
            if len(ticks) >= 2:
                return ticks
        return sorted({10.0**lo, 10.0**hi, *ticks})
    # A linear axis: the 1-2-5 step that gives at most 8 ticks.
    span = (hi - lo) or 1
    step = 10 ** math.floor(math.log10(span / 8))
    for factor in (1, 2, 5, 10):
        if span / (step * factor) <= 8:
            step *= factor
            break
    start = math.ceil(lo / step - 1e-9) * step
    return [round(start + k * step, 12) for k in range(int((hi - start) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    """Three significant digits; whole numbers below a million in full (1000, not 1e+03)."""
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"
