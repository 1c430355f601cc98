"""Comparing two verify runs step by step, and the figures of the layout run beside the planner's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

GIB = 2**30
QUANTITIES = ("loss", "grad_norm")


def within(reference: float, value: float, tolerance: float) -> bool:
    """|value - reference| <= tolerance x (1 + |reference|): absolute near 0, relative for large values
    (torch.isclose with rtol = atol = tolerance). Non-finite values never are."""
    return math.isfinite(value) and math.isfinite(reference) and abs(value - reference) <= tolerance * (1 + abs(reference))


@dataclass(frozen=True)
class Mismatch:
    step: int
    quantity: str
    """"loss", "grad_norm" or "steps" (the runs logged different steps)."""
    reference: Optional[float]
    value: Optional[float]

    @property
    def delta(self) -> Optional[float]:
        return abs(self.value - self.reference) if self.value is not None and self.reference is not None else None

    def describe(self) -> str:
        if self.quantity == "steps":
            return f"the runs logged different steps (reference {self.reference:g}, layout {self.value:g} steps)"
        if self.delta is None:
            return f"step {self.step}: {self.quantity} only in one run (reference {self.reference}, layout {self.value})"
        return (f"step {self.step}: {self.quantity} {self.value:.7g} vs reference {self.reference:.7g} "
                f"(|Δ| {self.delta:.2e})")


@dataclass(frozen=True)
class Comparison:
    """Two runs' per-step losses and gradient norms, compared."""

    reference: list[dict[str, Any]]
    layout: list[dict[str, Any]]
    tolerance: float
    compared: tuple[str, ...]
    """The quantities both runs logged ("loss" is missing for a module that returns a plain loss,
    "grad_norm" under `nonfinite="off"`)."""
    mismatches: tuple[Mismatch, ...]

    @property
    def passed(self) -> bool:
        return bool(self.compared) and not self.mismatches

    def max_delta(self, quantity: Optional[str] = None) -> Optional[float]:
        deltas = [abs(got[q] - ref[q]) for ref, got in zip(self.reference, self.layout)
                  for q in (self.compared if quantity is None else (quantity,))
                  if ref.get(q) is not None and got.get(q) is not None]
        return max(deltas) if deltas else None


def compare(reference: list[dict[str, Any]], layout: list[dict[str, Any]], tolerance: float) -> Comparison:
    """Step by step: every quantity either run logged must be in both and within `tolerance`."""
    logged = [q for q in QUANTITIES if any(s.get(q) is not None for s in [*reference, *layout])]
    mismatches: list[Mismatch] = []
    if [s["step"] for s in reference] != [s["step"] for s in layout]:
        mismatches.append(Mismatch(0, "steps", float(len(reference)), float(len(layout))))
    for ref, got in zip(reference, layout):
        for q in logged:
            a, b = ref.get(q), got.get(q)
            if a is None or b is None or not within(a, b, tolerance):
                mismatches.append(Mismatch(ref["step"], q, a, b))
    return Comparison(reference, layout, tolerance, tuple(logged), tuple(mismatches))


def _cell(value: Optional[float], digits: int = 7) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _delta_cell(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or b is None else f"{abs(a - b):.1e}"


def step_table(comparison: Comparison, reference_name: str) -> list[str]:
    """The per-step table `ultrascale verify` prints."""
    header = f"{'step':>4}  {'loss ' + reference_name:>14}  {'loss layout':>14}  {'|Δ|':>8}  " \
             f"{'grad_norm ' + reference_name:>16}  {'grad_norm layout':>16}  {'|Δ|':>8}"
    lines = [header]
    for ref, got in zip(comparison.reference, comparison.layout):
        lines.append(f"{ref['step']:>4}  {_cell(ref.get('loss')):>14}  {_cell(got.get('loss')):>14}  "
                     f"{_delta_cell(ref.get('loss'), got.get('loss')):>8}  {_cell(ref.get('grad_norm')):>16}  "
                     f"{_cell(got.get('grad_norm')):>16}  {_delta_cell(ref.get('grad_norm'), got.get('grad_norm')):>8}")
    return lines


def verdict(comparison: Comparison) -> str:
    """One line: PASS or FAIL with the largest difference, and the first mismatch."""
    worst = comparison.max_delta()
    largest = f"largest |Δ| {worst:.2e}" if worst is not None else "nothing to compare"
    rule = f"tolerance {comparison.tolerance:g} x (1 + |reference|)"
    if not comparison.compared:
        return ("FAIL: neither run logged `train_loss` nor `grad_norm` (a module returning a plain loss under "
                "`nonfinite=\"off\"`): nothing to compare")
    if comparison.passed:
        return f"PASS: {largest} over {len(comparison.layout)} steps ({', '.join(comparison.compared)}; {rule})"
    first = comparison.mismatches[0]
    return f"FAIL: {largest}; first beyond the tolerance at {first.describe()} ({rule})"


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class RankFigures:
    """What one rank of a run measured (MFUMonitor, MemoryMonitor)."""

    tokens_per_s: Optional[float]
    """Tokens per second per device (the global rate / world size), averaged over the steps."""
    mfu: Optional[float]
    peak_memory_gib: Optional[float]
    """CUDA: the allocator's peak (`memory/max_allocated_gib`); CPU: the process's resident set (`memory/rss_gib`)."""
    model_state_gib: Optional[float]
    device: str

    @classmethod
    def of(cls, figures: dict[str, Any]) -> "RankFigures":
        peak = figures.get("memory/max_allocated_gib", figures.get("memory/rss_gib"))
        return cls(figures.get("throughput/tokens_per_sec_per_device"), figures.get("throughput/mfu"), peak,
                   figures.get("memory/model_state_gib"), str(figures.get("device", "?")))


@dataclass(frozen=True)
class Prediction:
    """The planner's price of the layout (fp32) on one GPU kind."""

    gpu: str
    memory_gib: float
    """Memory per GPU at the peak (the worst pipeline stage)."""
    model_state_gib: float
    """Weights, gradients and optimizer state per GPU."""
    tokens_per_s: float
    mfu: float

    @classmethod
    def of(cls, row: Any, gpu: str) -> "Prediction":
        state = row.model_state or {k: row.memory[k] for k in ("params", "grads", "optimizer") if k in row.memory}
        return cls(gpu, row.memory["total"] / GIB, sum(state.values()) / GIB, row.tokens_per_s_per_gpu, row.mfu)


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def figures_table(ranks: list[RankFigures], prediction: Optional[Prediction], why_not: Optional[str]) -> list[str]:
    """Each rank's measured tokens/s, MFU and memory, and the planner's prediction beside them."""
    on_cpu = all(r.device.startswith("cpu") for r in ranks)
    memory = "peak RSS GiB" if on_cpu else "peak alloc GiB"
    lines = [f"{'':>14}  {'tokens/s/device':>15}  {'MFU':>7}  {memory:>14}  {'model state GiB':>15}"]
    for rank, r in enumerate(ranks):
        lines.append(f"{'rank ' + str(rank):>14}  {_fmt(r.tokens_per_s, ',.0f'):>15}  {_fmt(r.mfu, '.2%'):>7}  "
                     f"{_fmt(r.peak_memory_gib, '.3f'):>14}  {_fmt(r.model_state_gib, '.4f'):>15}")
    if prediction is None:
        lines.append(f"planner: no prediction ({why_not})")
        return lines
    lines.append(f"{'planner ' + prediction.gpu:>14}  {prediction.tokens_per_s:>15,.0f}  {prediction.mfu:>7.2%}  "
                 f"{prediction.memory_gib:>14.3f}  {prediction.model_state_gib:>15.4f}")
    if on_cpu:
        lines.append(f"note: measured on CPU; the planner prices one {prediction.gpu} per rank, so its tokens/s, MFU and "
                     "peak memory are not comparable with these. The model-state bytes are (the same tensors on any device).")
    return lines
