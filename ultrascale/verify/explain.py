"""`ultrascale verify --explain`: where the layout's first step departs from the reference's.

Both runs' traces (`ultrascale.verify.trace.ModuleTrace`) are read here, one gradient at a time:

- **forward**: each module's output and first input over all tokens of the global batch, as each feature's mean and
  the root mean square. One differs when max(max_f |Δmean_f|, |Δrms|) > tolerance x the reference's rms. The first
  module in forward order whose output or input differs is named: an input that differs while every module before
  matches says the departure is in the code between modules (the parent's own forward), or in the batch;
- **gradients**: every parameter's full gradient after the step's normalisation. One differs when
  |g_layout - g_ref| > 10 x tolerance x max(|g_ref|, 1e-6 |G_ref|) (G: the whole model's gradient). Its norm ratio
  |g_layout| / |g_ref| and the cosine of the two say what kind of difference: a cosine of 1 with a ratio of a size
  of the layout (the micro-batches, dp, tp, cp, pp) is a scaling error, named with its likely cause;
- **groups**: the differing parameters per block (the name up to its first module-list index), per pipeline stage
  and, for stacked experts (a parameter of 3 or more dims, experts first), per expert.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

GRADIENT_TOLERANCE_FACTOR = 10.0
"""A gradient is compared at this many times verify's tolerance: each parameter's gradient sums fewer terms than
the loss, so its relative reordering noise in fp32 is larger (1e-6 to 1e-5 on CPU)."""

_CAUSES = {
    ("micro-batches", 1): "summed over the {n} micro-batches without dividing by their number (a schedule's or the "
                          "accumulation's loss scaling applied twice, or not at all)",
    ("micro-batches", -1): "divided by the {n} micro-batches once more than the loss",
    ("dp", 1): "summed over the {n} data-parallel ranks where one normalisation by the global token count was meant "
               "(or each rank normalised its own loss)",
    ("dp", -1): "not reduced over the {n} data-parallel ranks, or divided by them twice",
    ("cp", 1): "summed over the {n} context-parallel ranks twice",
    ("cp", -1): "not reduced over the {n} context-parallel ranks",
    ("tp", 1): "reduced over the {n} tensor-parallel ranks twice (a replicated weight's gradient summed again)",
    ("tp", -1): "not reduced over the {n} tensor-parallel ranks: each rank kept its own part (a weight every tp rank "
                "holds whole, such as a sequence-parallel norm, without its all-reduce)",
    ("pp", 1): "counted on each of the {n} pipeline stages",
    ("pp", -1): "divided by the {n} pipeline stages",
}


@dataclass(frozen=True)
class ModuleDifference:
    name: str
    error: float
    """max(|Δmean|, |Δrms|) of the output over the reference's rms."""
    input_error: Optional[float]
    """The same for its first input (None: no tensor input recorded)."""
    input_differs: bool


@dataclass(frozen=True)
class GradientDifference:
    name: str
    relative: float
    """|g_layout - g_ref| / |g_ref|."""
    ratio: float
    """|g_layout| / |g_ref|."""
    cosine: float
    stage: Optional[int]
    scaling: Optional[str] = None
    """The layout size the ratio equals ("x 4 = micro-batches"), when the two point the same way."""
    cause: Optional[str] = None


@dataclass
class Explanation:
    """What `explain` found; `lines()` for the terminal, `to_json()` for `--json`."""

    modules_compared: int
    parameters_compared: int
    first_module: Optional[ModuleDifference]
    gradients: list[GradientDifference]
    groups: list[str] = field(default_factory=list)
    only_in_one_run: list[str] = field(default_factory=list)
    tolerance: float = 0.0

    @property
    def found(self) -> bool:
        return self.first_module is not None or bool(self.gradients)

    def lines(self, worst: int = 10) -> list[str]:
        lines = [f"explain    first step, module by module: {self.modules_compared} module outputs and "
                 f"{self.parameters_compared} parameter gradients compared"]
        if not self.found:
            lines.append("explain    no module output and no gradient differs beyond the tolerance")
        first = self.first_module
        if first is not None:
            parent = first.name.rsplit(".", 1)[0] if "." in first.name else "the LightningModule"
            if first.input_differs:
                lines.append(f"forward    first module that differs: {first.name}, its input already (input |Δ| "
                             f"{first.input_error:.2e}, output |Δ| {first.error:.2e} of their rms) while every module "
                             f"before it matches: the departure is in the code that prepared that input ({parent}'s own "
                             "forward, between its children) or in the batch")
            else:
                lines.append(f"forward    first module whose output differs: {first.name} (|Δ| {first.error:.2e} of its "
                             "rms); its input matches: the difference starts in this module")
        elif self.gradients:
            lines.append("forward    every module's output matches: the difference is in backward or in the reduction")
        if self.gradients:
            lines.append(f"gradients  {len(self.gradients)} of {self.parameters_compared} parameters differ, worst first:")
            for diff in self.gradients[:worst]:
                if diff.scaling:
                    kind = f"scaled {diff.scaling}"
                elif abs(diff.ratio - 1) > 0.5 * diff.relative:
                    kind = "the same direction, another size"
                else:
                    kind = f"another direction (cosine {diff.cosine:.6f})"
                stage = f" [stage {diff.stage}]" if diff.stage is not None else ""
                lines.append(f"  {diff.name}{stage}: relative error {diff.relative:.2e}, norm ratio {diff.ratio:.4f}; {kind}")
            if len(self.gradients) > worst:
                lines.append(f"  ... and {len(self.gradients) - worst} more (--json lists them all)")
            causes = {diff.scaling: diff.cause for diff in self.gradients if diff.scaling}
            lines += [f"cause      {scaling}: {cause}" for scaling, cause in causes.items()]
            if len(self.gradients) == self.parameters_compared and first is None:
                lines.append("cause      every parameter differs and the forward matches: look at what all gradients go "
                             "through (their reduction over the ranks, the loss normalisation), not at one module")
        lines += [f"groups     {line}" for line in self.groups]
        if self.only_in_one_run:
            lines.append(f"note       in one run only (not compared): {', '.join(self.only_in_one_run[:8])}"
                         + (" ..." if len(self.only_in_one_run) > 8 else ""))
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"modules_compared": self.modules_compared, "parameters_compared": self.parameters_compared,
                "first_module": self.first_module.__dict__ if self.first_module is not None else None,
                "gradients": [diff.__dict__ for diff in self.gradients], "groups": self.groups,
                "only_in_one_run": self.only_in_one_run, "tolerance": self.tolerance}


def _mean_rms(entries: Optional[list[dict[str, Any]]], width: int) -> Optional[tuple[torch.Tensor, float]]:
    """Each feature's mean over all tokens and the rms of all elements, from a trace's per-tp-coordinate sums
    (`trace._by_tp`) for an output `width` features wide: coordinates of the full width hold tokens (summed),
    coordinates of 1/tp of it hold features (side by side, in coordinate order). None if neither fits."""
    if not entries:
        return None
    sums = [torch.tensor(entry["sum"], dtype=torch.float64) for entry in entries]
    if all(s.numel() == width for s in sums):
        tokens = sum(entry["tokens"] for entry in entries)
        mean = sum(sums) / tokens
        return mean, math.sqrt(sum(entry["squares"] for entry in entries) / (tokens * width))
    if sum(s.numel() for s in sums) == width:
        mean = torch.cat([s / entry["tokens"] for s, entry in zip(sums, entries)])
        elements = sum(entry["tokens"] * s.numel() for s, entry in zip(sums, entries))
        return mean, math.sqrt(sum(entry["squares"] for entry in entries) / elements)
    return None


def _module_error(ref: Optional[list[dict[str, Any]]], lay: Optional[list[dict[str, Any]]]) -> Optional[float]:
    """max(|Δ per-feature mean|, |Δ rms|) over the reference's rms; None when the two cannot be compared."""
    if not ref or not lay:
        return None
    reference = _mean_rms(ref, len(ref[0]["sum"]))
    layout = _mean_rms(lay, len(ref[0]["sum"]))
    if reference is None or layout is None:
        return None
    (mean_r, rms_r), (mean_l, rms_l) = reference, layout
    return max(float((mean_l - mean_r).abs().max()), abs(rms_l - rms_r)) / max(rms_r, 1e-30)


def first_differing_module(reference: dict[str, Any], layout: dict[str, Any], tolerance: float
                           ) -> tuple[Optional[ModuleDifference], int]:
    """The first module, in the reference's forward order, whose output differs; and how many were compared."""
    errors = [(name, error) for name, ref in reference["modules"].items() if name in layout["modules"]
              and (error := _module_error(ref["output"], layout["modules"][name]["output"])) is not None]
    for name, error in errors:
        input_error = _module_error(reference["modules"][name]["input"], layout["modules"][name]["input"])
        input_differs = input_error is not None and input_error > tolerance
        if error > tolerance or input_differs:
            return ModuleDifference(name, error, input_error, input_differs), len(errors)
    return None, len(errors)


def _scaling(ratio: float, sizes: dict[str, int]) -> tuple[Optional[str], Optional[str]]:
    """The layout size `ratio` equals (within 1%), and the likely cause; sizes before the generic factor 2."""
    candidates = [(name, n, sign) for name, n in sizes.items() if n > 1 for sign in (1, -1)]
    for name, n, sign in candidates:
        if abs(ratio / (n ** sign) - 1) < 0.01:
            return f"{'x' if sign > 0 else '/'} {n} = the {name}", _CAUSES[(name, sign)].format(n=n)
    for factor in (2.0, 0.5):
        if abs(ratio / factor - 1) < 0.01:
            return f"{'x 2' if factor > 1 else '/ 2'}", "a gradient counted twice (or half of it)"
    return None, None


def _load_gradients(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, key) over the rank files of a trace (each name in one file)."""
    from safetensors import safe_open

    where = {}
    for path in sorted(folder.glob("grads-rank*/*.safetensors"), key=lambda f: (f.parent.name, int(f.stem))):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                where.setdefault(key, (path, key))
    return where


def _read(location: tuple[Path, str]) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(location[0]), framework="pt") as handle:
        return handle.get_tensor(location[1]).double()


def explain(reference_folder: Path, layout_folder: Path, tolerance: float) -> Explanation:
    """Compare the two runs' traces (see the module)."""
    reference = json.loads((reference_folder / "trace.json").read_text())
    layout = json.loads((layout_folder / "trace.json").read_text())
    first, modules_compared = first_differing_module(reference, layout, tolerance)
    ref_grads, lay_grads = _load_gradients(reference_folder), _load_gradients(layout_folder)
    common = [name for name in ref_grads if name in lay_grads]
    only = sorted(set(ref_grads) ^ set(lay_grads))
    total = math.sqrt(sum(float(_read(ref_grads[name]).square().sum()) for name in common))
    sizes = {k: int(v) for k, v in layout.get("sizes", {}).items()}
    stages = layout.get("stages", {})
    gradient_tolerance = GRADIENT_TOLERANCE_FACTOR * tolerance
    differences: list[GradientDifference] = []
    expert_lines: list[str] = []
    for name in common:
        ref, lay = _read(ref_grads[name]), _read(lay_grads[name])
        if ref.shape != lay.shape:
            only.append(f"{name} (shape {tuple(lay.shape)} vs {tuple(ref.shape)})")
            continue
        ref_norm, lay_norm, delta = float(ref.norm()), float(lay.norm()), float((lay - ref).norm())
        if delta <= gradient_tolerance * max(ref_norm, 1e-6 * total):
            continue
        ratio = lay_norm / ref_norm if ref_norm > 0 else math.inf
        cosine = float((lay * ref).sum()) / (lay_norm * ref_norm) if lay_norm > 0 and ref_norm > 0 else 0.0
        scaling, cause = _scaling(ratio, sizes) if cosine > 0.9999 else (None, None)
        differences.append(GradientDifference(name, delta / ref_norm if ref_norm > 0 else math.inf, ratio, cosine,
                                              stages.get(name), scaling, cause))
        if ref.dim() >= 3:  # stacked experts (E, ...): which of them
            per_expert = [(e, float((lay[e] - ref[e]).norm()) / max(float(ref[e].norm()), 1e-30)) for e in range(ref.shape[0])]
            off = [e for e, error in per_expert if error > gradient_tolerance]
            if off and len(off) < ref.shape[0]:
                expert_lines.append(f"{name}: experts (its first dim) {off} of {ref.shape[0]} differ, the others match")
    differences.sort(key=lambda d: -d.relative)
    return Explanation(modules_compared, len(common), first, differences,
                       _groups(differences, common, stages) + expert_lines, only, tolerance)


def _groups(differences: list[GradientDifference], names: list[str], stages: dict[str, Any]) -> list[str]:
    """One line per block and per pipeline stage with a differing parameter: how many, and a common scaling."""
    lines = []
    # A block: the name up to its first index in a module list (`model.layers.3`, `transformer.h.3`).
    for label, key in (("block", lambda n: (m.group(1) if (m := re.match(r"(.*?\.\d+)\.", n)) else None)),
                       ("stage", lambda n: stages.get(n))):
        totals: dict[Any, int] = {}
        for name in names:
            group = key(name)
            if group is not None:
                totals[group] = totals.get(group, 0) + 1
        if len(totals) < 2:
            continue
        found: dict[Any, list[GradientDifference]] = {}
        for diff in differences:
            group = key(diff.name)
            if group is not None:
                found.setdefault(group, []).append(diff)
        for group in sorted(found, key=str):
            diffs = found[group]
            scalings = {d.scaling for d in diffs}
            common = f", all scaled {scalings.pop()}" if len(scalings) == 1 and None not in scalings else ""
            lines.append(f"{label} {group}: {len(diffs)} of {totals[group]} parameters differ{common}")
        if found:
            clean = sorted((g for g in totals if g not in found), key=str)
            if clean:
                lines.append(f"{label}s that match: {', '.join(str(g) for g in clean)}")
    return lines


__all__ = ["Explanation", "GradientDifference", "ModuleDifference", "explain", "first_differing_module"]
