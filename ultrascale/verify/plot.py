"""`ultrascale verify --plot FILE.svg`: both runs' loss and gradient-norm curves and their difference per step.

Written as SVG by hand (no plotting library is a dependency): three panels side by side, the loss and the gradient
norm of the reference (solid) and the layout (dashed), and |Δ| per step of each on a log scale with the
tolerance x (1 + |reference|) drawn as the bound a step must stay under.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Optional

from ultrascale.planner.plot import plot_path_problem
from ultrascale.verify.report import Comparison

_WIDTH, _HEIGHT, _MARGIN = 300, 220, 44
_COLOURS = {"loss": "#1f77b4", "grad_norm": "#d62728"}


def _scale(values: list[float], low: Optional[float] = None) -> tuple[float, float]:
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    lo = lo if low is None else low
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi


def _panel(index: int, title: str, series: list[tuple[str, list[Optional[float]], str, str]], log: bool = False) -> list[str]:
    """One panel: `series` as (label, values per step, colour, dash pattern)."""
    x0 = index * (_WIDTH + _MARGIN) + _MARGIN
    steps = max((len(values) for _, values, _, _ in series), default=1)

    def value(v: float) -> float:
        return math.log10(max(v, 1e-30)) if log else v

    points = [value(v) for _, values, _, _ in series for v in values if v is not None]
    lo, hi = _scale(points)
    out = [f'<rect x="{x0}" y="{_MARGIN}" width="{_WIDTH}" height="{_HEIGHT}" fill="none" stroke="#888"/>',
           f'<text x="{x0 + _WIDTH / 2}" y="{_MARGIN - 12}" text-anchor="middle" font-size="13">{escape(title)}</text>',
           f'<text x="{x0 - 4}" y="{_MARGIN + 10}" text-anchor="end" font-size="10">'
           f'{("1e%.1f" % hi) if log else f"{hi:.4g}"}</text>',
           f'<text x="{x0 - 4}" y="{_MARGIN + _HEIGHT}" text-anchor="end" font-size="10">'
           f'{("1e%.1f" % lo) if log else f"{lo:.4g}"}</text>',
           f'<text x="{x0 + _WIDTH / 2}" y="{_MARGIN + _HEIGHT + 16}" text-anchor="middle" font-size="10">'
           f'optimizer step 1 to {steps}</text>']
    for row, (label, values, colour, dash) in enumerate(series):
        coords = []
        for step, v in enumerate(values):
            if v is None:
                continue
            x = x0 + (_WIDTH * step / max(steps - 1, 1) if steps > 1 else _WIDTH / 2)
            y = _MARGIN + _HEIGHT * (1 - (value(v) - lo) / (hi - lo))
            coords.append(f"{x:.1f},{y:.1f}")
        if coords:
            out.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{colour}" stroke-width="2"'
                       + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        out.append(f'<text x="{x0 + 6}" y="{_MARGIN + 14 + 13 * row}" font-size="10" fill="{colour}">{escape(label)}</text>')
    return out


def write_plot(comparison: Comparison, path: Path, *, layout_name: str, reference_name: str) -> None:
    """Write the three panels of `comparison` to `path` (SVG)."""
    panels: list[list[str]] = []
    for index, quantity in enumerate(("loss", "grad_norm")):
        reference = [step.get(quantity) for step in comparison.reference]
        layout = [step.get(quantity) for step in comparison.layout]
        panels.append(_panel(index, quantity.replace("_", " "), [
            ("reference", reference, _COLOURS[quantity], ""), ("layout", layout, "#333", "5,4")]))
    deltas: list[tuple[str, list[Optional[float]], str, str]] = []
    for quantity in comparison.compared:
        pairs = list(zip(comparison.reference, comparison.layout))
        deltas.append((f"|Δ| {quantity.replace('_', ' ')}", [
            abs(got[quantity] - ref[quantity]) if ref.get(quantity) is not None and got.get(quantity) is not None else None
            for ref, got in pairs], _COLOURS[quantity], ""))
        deltas.append((f"bound ({quantity.replace('_', ' ')})", [
            comparison.tolerance * (1 + abs(ref[quantity])) if ref.get(quantity) is not None else None
            for ref, _ in pairs], _COLOURS[quantity], "2,3"))
    panels.append(_panel(2, "difference per step (log)", deltas, log=True))
    width = 3 * (_WIDTH + _MARGIN) + _MARGIN
    height = _HEIGHT + 2 * _MARGIN + 24
    title = f"ultrascale verify: {layout_name} against {reference_name}"
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{_MARGIN}" y="14" font-size="12">{escape(title)}</text>',
            *[line for panel in panels for line in panel], "</svg>"]
    path.write_text("\n".join(body) + "\n")


__all__ = ["plot_path_problem", "write_plot"]
