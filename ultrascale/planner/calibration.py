"""A machine's measured / predicted tokens/s per layout family: written by `ultrascale tune --calibrate FILE`, read by
`ultrascale plan --calibration FILE` and by the auto layout (`planner_calibration=FILE` on the strategies).

The planner prices one achievable fraction of peak for every layout (`hardware.TORCH_NATIVE_EFFICIENCY`); a real
machine departs from it by layout: its links, its kernels, what overlaps. `tune` measures the planner's best layouts
there, and the geometric mean of measured / predicted tokens/s over the runs of one family (the parallel dimensions
beyond data parallel a layout uses: "dp", "tp", "pp+tp", ...) is that family's ratio r. A calibrated plan divides
every predicted time of a layout of that family by r (so tokens/s and MFU are multiplied by it); a family `tune` did
not measure takes the ratio over all its runs ("all"). The file names the GPU the predictions were priced for, and a
plan for another GPU refuses it: a ratio is only meaningful against the predictions it was measured against.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ultrascale.hardware import Cluster
from ultrascale.planner.layouts import Layout

__all__ = ["ALL_FAMILIES", "Calibration", "calibrated", "family_ratio", "layout_family", "load_calibration"]

FAMILY_AXES = ("pp", "cp", "tp", "ep")
ALL_FAMILIES = "all"
"""The entry a family without measurements takes: the geometric mean over every measured run."""


def layout_family(layout: Layout) -> str:
    """The parallel dimensions beyond data parallel a layout uses ("dp" for none), e.g. "tp" or "pp+tp"."""
    return "+".join(axis for axis in FAMILY_AXES if getattr(layout, axis) > 1) or "dp"


def family_ratio(ratios: dict[str, float], layout: Layout) -> tuple[float, str]:
    """(measured / predicted, the family it is measured for) of `layout`: its family's, else `ALL_FAMILIES`'."""
    family = layout_family(layout)
    return (ratios[family], family) if family in ratios else (ratios[ALL_FAMILIES], ALL_FAMILIES)


@dataclass(frozen=True)
class Calibration:
    """Measured / predicted tokens/s per layout family on one machine, against the predictions for `gpu`."""

    gpu: str
    """`GpuSpec.name` of the predictions the ratios are relative to."""
    ratios: dict[str, float]
    """Family -> ratio, with `ALL_FAMILIES`."""
    machine: str = ""
    """What was measured (devices and world size), for the record."""
    devices: str = "cuda"
    """"cuda", or "cpu": CPU ranks priced as if on `gpu` for scale (`plan --recipe` of a CPU recipe), which only a
    CPU recipe's plan may apply."""

    def ratio(self, layout: Layout) -> tuple[float, str]:
        """(ratio, the family it comes from) for `layout`."""
        return family_ratio(self.ratios, layout)

    @classmethod
    def fit(cls, runs: Iterable[tuple[Layout, float, float]], gpu: str, machine: str = "", devices: str = "cuda"
            ) -> "Calibration":
        """From (layout, measured tokens/s, predicted tokens/s) of each successful run: geometric means per family."""
        logs: dict[str, list[float]] = {}
        for layout, measured, predicted in runs:
            if measured > 0 and predicted > 0:
                for family in (layout_family(layout), ALL_FAMILIES):
                    logs.setdefault(family, []).append(math.log(measured / predicted))
        if not logs:
            raise ValueError("a calibration needs at least one run measured with a positive throughput")
        return cls(gpu, {family: math.exp(sum(values) / len(values)) for family, values in sorted(logs.items())}, machine,
                   devices)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"gpu": self.gpu, "devices": self.devices, "machine": self.machine,
                                          "ratios": self.ratios}, indent=1))

    def describe(self) -> str:
        return ", ".join(f"{family} x{ratio:.3g}" for family, ratio in self.ratios.items())


def load_calibration(path: str | Path, gpu: str | None = None, devices: str | None = None) -> Calibration:
    """The calibration in `path` for predictions priced for `gpu` (a `GpuSpec.name`) of runs on `devices` ("cuda",
    "cpu"; None: any); ValueError naming the file and what is wrong (unreadable, not a calibration, measured against
    another GPU's predictions, or on CPU ranks priced for scale while the plan is for GPUs, or the reverse)."""
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"calibration {path}: cannot read it ({error}); write one with `ultrascale tune --calibrate "
                         f"{path}`") from None
    ratios = data.get("ratios") if isinstance(data, dict) else None
    if (not isinstance(ratios, dict) or ALL_FAMILIES not in ratios or not isinstance(data.get("gpu"), str)
            or data.get("devices", "cuda") not in ("cuda", "cpu")
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in ratios.values())):
        raise ValueError(f"calibration {path}: expected {{\"gpu\": NAME, \"ratios\": {{FAMILY: positive ratio, ..., "
                         f"\"{ALL_FAMILIES}\": ...}}}} as `ultrascale tune --calibrate` writes it")
    if gpu is not None and data["gpu"] != gpu:
        raise ValueError(f"calibration {path} was measured against predictions for {data['gpu']}; this plan prices "
                         f"{gpu} (tune with the same --gpu, or plan for {data['gpu']})")
    measured_on = data.get("devices", "cuda")
    if devices is not None and measured_on != devices:
        where = {"cpu": "CPU ranks priced as if on a GPU, for scale", "cuda": "GPUs"}
        raise ValueError(f"calibration {path} was measured on {where[measured_on]}; this plan is for {where[devices]}: "
                         "a ratio only corrects the predictions it was measured against")
    return Calibration(data["gpu"], {str(k): float(v) for k, v in ratios.items()}, str(data.get("machine", "")),
                       measured_on)


def calibrated(cluster: Cluster, calibration: Calibration | None) -> Cluster:
    """`cluster` with the calibration's ratios (what `evaluate` applies); unchanged for None."""
    if calibration is None:
        return cluster
    return replace(cluster, calibration=tuple(calibration.ratios.items()))
