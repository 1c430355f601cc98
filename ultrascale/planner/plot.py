"""`ultrascale plan --plot FILE.svg`: the chosen layout's memory per GPU by component and, with a pipeline, its
schedule as a timeline per rank, as the Ultra-Scale Playbook draws them.

Written as SVG by hand (no plotting library is a dependency). The memory bar stacks `PlanRow.memory`'s components
(the worst pipeline stage's, at its peak) against the GPU's memory and the part the planner plans for; the timeline
draws each pipeline rank's actions as the planner plays torch's schedule (`planner.cost.pipeline_timeline`): F
(forward), B (whole backward), I (input gradient) and W (weight gradient) per micro-batch, idle time blank.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any, Optional

from ultrascale.hardware import GIB

_KINDS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#72b7b2"}
_PALETTE = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d")


def plot_path_problem(path: Path) -> Optional[str]:
    """Why the plot cannot be written to `path`, or None (asked before any pricing)."""
    if path.suffix.lower() != ".svg":
        return (f"--plot {path}: the plot is written as SVG (name the file *.svg); PNG would need a plotting library "
                "ultrascale does not depend on")
    if not path.parent.exists():
        return f"--plot {path}: the folder {path.parent} does not exist"
    return None


def _memory_bar(row: Any, memory_gib: float, planned_gib: float, x0: float, y0: float, height: float) -> list[str]:
    parts = [(key, value / GIB) for key, value in row.memory.items() if key != "total" and value > 0]
    top = max(memory_gib, sum(v for _, v in parts)) or 1.0
    scale = height / top
    out = [f'<text x="{x0}" y="{y0 - 12}" font-size="13">memory per GPU (GiB)</text>',
           f'<rect x="{x0}" y="{y0}" width="60" height="{height}" fill="none" stroke="#888"/>']
    bottom = y0 + height
    for index, (key, value) in enumerate(parts):
        h = value * scale
        bottom -= h
        colour = _PALETTE[index % len(_PALETTE)]
        out.append(f'<rect x="{x0}" y="{bottom:.1f}" width="60" height="{h:.1f}" fill="{colour}"/>')
        out.append(f'<text x="{x0 + 70}" y="{y0 + 14 + 14 * index}" font-size="11" fill="{colour}">'
                   f'{escape(key)} {value:.2f}</text>')
    for label, value, dash in (("GPU", memory_gib, ""), ("planned for", planned_gib, "4,3")):
        y = y0 + height - value * scale
        out.append(f'<line x1="{x0 - 6}" y1="{y:.1f}" x2="{x0 + 66}" y2="{y:.1f}" stroke="#333"'
                   + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
        out.append(f'<text x="{x0 - 8}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{label} {value:.1f}</text>')
    out.append(f'<text x="{x0 + 70}" y="{y0 + 14 + 14 * len(parts) + 6}" font-size="11">total {row.memory["total"] / GIB:.2f}</text>')
    return out


def _timeline(pipe: Any, actions: dict[int, list[tuple[int, str, int, float, float]]], x0: float, y0: float,
              width: float) -> list[str]:
    end = max((a[4] for rank in actions.values() for a in rank), default=1.0) or 1.0
    lane = 28
    out = [f'<text x="{x0}" y="{y0 - 12}" font-size="13">{escape(pipe.describe())}: one step as played '
           f'({end * 1e3:.1f} ms of compute and idle)</text>']
    for rank in sorted(actions):
        y = y0 + rank * lane
        out.append(f'<text x="{x0 - 6}" y="{y + 18}" font-size="11" text-anchor="end">rank {rank}</text>')
        for stage, kind, mb, start, stop in actions[rank]:
            x, w = x0 + width * start / end, max(width * (stop - start) / end, 0.5)
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane - 4}" fill="{_KINDS[kind]}" '
                       f'stroke="white" stroke-width="0.5"><title>stage {stage} {kind} micro-batch {mb}</title></rect>')
            if w > 14:
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + 16}" font-size="9" text-anchor="middle" fill="white">'
                           f'{kind}{mb}</text>')
    legend_y = y0 + len(actions) * lane + 14
    for index, (kind, name) in enumerate((("F", "forward"), ("B", "backward"), ("I", "input grad"), ("W", "weight grad"))):
        out.append(f'<rect x="{x0 + 110 * index}" y="{legend_y}" width="12" height="12" fill="{_KINDS[kind]}"/>'
                   f'<text x="{x0 + 110 * index + 16}" y="{legend_y + 10}" font-size="11">{name}</text>')
    return out


def write_plan_plot(path: Path, row: Any, cluster: Any, pipe: Any,
                    actions: dict[int, list[tuple[int, str, int, float, float]]]) -> None:
    """The memory bar of `row` on `cluster`'s GPU and, with `pipe`, the timeline of `actions` (see the module)."""
    height = 260
    body = _memory_bar(row, cluster.gpu.memory_gib, cluster.usable_bytes / GIB, 110, 50, height)
    width = 320
    if pipe is not None and actions:
        body += _timeline(pipe, actions, 420, 50, 640)
        width = 1100
        height = max(height, 28 * len(actions) + 40)
    title = f"ultrascale plan: {row.layout.describe()}"
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 90}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height + 90}" fill="white"/>',
           f'<text x="10" y="16" font-size="12">{escape(title)}</text>', *body, "</svg>"]
    path.write_text("\n".join(svg) + "\n")


__all__ = ["plot_path_problem", "write_plan_plot"]
