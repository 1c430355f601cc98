"""Every GPU figure ultrascale uses, in one table (`GPU_TABLE`), and the planner's view of a cluster.

Dense tensor-core peaks by dtype feed `MFUMonitor` and the auto layout (`find_peak_tflops`); memory,
HBM and link bandwidths feed `ultrascale plan` (`GPU_SPECS`, `Cluster`). Standard library only, so
that `ultrascale.estimate` and the callbacks can import it without an import cycle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["COMPILE_SOURCE", "COMPILE_SPEEDUP", "Cluster", "FLOAT8_SOURCE", "FLOAT8_SPEEDUP", "GIB", "GPU_SPECS",
           "GPU_TABLE", "GpuFigures", "GpuSpec", "PEAK_TFLOPS", "TORCH_NATIVE_EFFICIENCY", "find_peak_tflops"]

GIB = 2**30

# Compiling each block (`compile=True` on a strategy: torch.compile per transformer block, as torchtitan does):
#   torchtitan's end-of-2024 H100 benchmarks, Table 1 ("1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local
#   batch size 2, global batch size 16. Selective activation checkpointing."), bf16, TPS/GPU: "FSDP | 5,762",
#   "FSDP + torch.compile | 6,667" (+15.7%), "FSDP + torch.compile + Float8 | 8,532" (Float8 is measured, and pays
#   off, only compiled: `FLOAT8_SPEEDUP` below).
#   https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/llama3_h100_202412_torchtitan.md
#   (the runs `benchmarks/planner_published.yaml` quotes; also the TorchTitan paper, arXiv 2410.06511). The ratio is of
#   whole steps, FSDP communication included; the planner divides only the compute time by it (cost.py).
COMPILE_SPEEDUP = 6667 / 5762
"""Compute time eager / compiled per block (1.157): torchtitan, Llama 3.1 8B on 8 H100, FSDP, bf16."""
COMPILE_SOURCE = "torchtitan's Llama 3.1 8B on 8 H100, FSDP bf16: 5,762 -> 6,667 tokens/s per GPU"
"""The published run `COMPILE_SPEEDUP` comes from, as `ultrascale plan --compile` prints it."""

# Float8 matmuls (`Float8Training`: torchao Float8Linear on the blocks' linears), always compiled: the same torchtitan
#   table, "FSDP + torch.compile | 6,667" -> "FSDP + torch.compile + Float8 | 8,532" (+28.0%). Also whole steps; the
#   planner divides the compute alone by COMPILE_SPEEDUP x FLOAT8_SPEEDUP (cost.py). torchtitan's own 2D/3D tables
#   measure Float8 only together with compile, so no larger runs give a separate factor.
FLOAT8_SPEEDUP = 8532 / 6667
"""Compute time compiled bf16 / compiled Float8 (1.280): torchtitan, Llama 3.1 8B on 8 H100, FSDP."""
FLOAT8_SOURCE = "torchtitan's Llama 3.1 8B on 8 H100, FSDP + compile: 6,667 -> 8,532 tokens/s per GPU with Float8"
"""The published run `FLOAT8_SPEEDUP` comes from, as `ultrascale plan --fp8` prints it."""


# The fraction of the dense bf16 peak that ultrascale's own stack reaches in the matmuls when nothing waits, per GPU
#   generation: torch-native training (FSDP2, DTensor tensor parallel, torch.distributed.pipelining, torch.compile,
#   torchao Float8), priced on torchtitan's published runs, which use that stack. `python
#   benchmarks/planner_validation.py` fits each so that the geometric mean of published / predicted tokens/s over that
#   generation's torchtitan runs is 1 (Hopper: 17 H100 runs of 2024-12, 8 to 512 GPUs, eager, compiled and Float8, and
#   one H200 run; Ampere: 2 runs on 64 A100s); tests/test_planner.py checks these figures against that fit. Megatron,
#   NeMo and llm-foundry runs are another stack and stay out of it (the validation reports their factor apart).
#   torchtitan's H100s ran at a 500 W power limit (their peak is "between SXM and NVL"), so Hopper's figure is low for
#   700 W parts; Blackwell has no torch-native published run yet and is priced with Hopper's.
TORCH_NATIVE_EFFICIENCY: dict[str, float] = {"Hopper": 0.359, "Ampere": 0.617}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind: dense bf16 peak, usable memory, and achievable NCCL bus bandwidths per GPU."""

    name: str
    peak_tflops: float
    """Dense bf16 tensor-core peak (vendor datasheet, without 2:4 sparsity)."""
    memory_gib: float
    """What the driver reports as total (nvidia-smi), before the CUDA context."""
    hbm_gbps: float
    """Memory bandwidth in GB/s (prices the memory-bound ops selective recompute re-runs)."""
    intra_node_gbps: float
    """GB/s per GPU per direction that NCCL's ring reaches inside a node (NVLink/NVSwitch)."""
    inter_node_gbps: float
    """GB/s per GPU per direction between nodes (one NIC per GPU)."""
    generation: str = "Hopper"
    """Its architecture, the key of `TORCH_NATIVE_EFFICIENCY` (Hopper's where that has no figure for it)."""

    @property
    def efficiency(self) -> float:
        """Fraction of `peak_tflops` ultrascale's matmuls reach: `TORCH_NATIVE_EFFICIENCY` of its generation."""
        return TORCH_NATIVE_EFFICIENCY.get(self.generation, TORCH_NATIVE_EFFICIENCY["Hopper"])


@dataclass(frozen=True)
class GpuFigures:
    """One device's row of `GPU_TABLE`. Peaks are dense (without 2:4 sparsity) TFLOP/s; the other
    fields mean what `GpuSpec`'s do, and are None in a peaks-only row."""

    bf16_tflops: float
    """Dense bf16 tensor-core peak; fp16 equals it on every device here."""
    fp8_tflops: Optional[float]
    """None where the device has no fp8 tensor cores (Ampere)."""
    tf32_tflops: float
    memory_gib: Optional[float] = None
    hbm_gbps: Optional[float] = None
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    fp32_tflops: Optional[float] = None
    """Plain fp32 (CUDA cores, no TF32): what a `32-true` run computes in with TF32 off, torch's default."""
    generation: str = "Hopper"
    """The key of `TORCH_NATIVE_EFFICIENCY` the planner prices this GPU with."""

    @property
    def peaks(self) -> dict[str, float]:
        """TFLOP/s by dtype ("bf16", "fp16", "fp8", "tf32", "fp32"), without the dtypes the device lacks."""
        peaks = {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops, "fp8": self.fp8_tflops, "tf32": self.tf32_tflops,
                 "fp32": self.fp32_tflops}
        return {dtype: peak for dtype, peak in peaks.items() if peak is not None}

    def spec(self, name: str) -> GpuSpec:
        """The planner's view of this row, printed as `name`."""
        memory, hbm, intra, inter = self.memory_gib, self.hbm_gbps, self.intra_node_gbps, self.inter_node_gbps
        if memory is None or hbm is None or intra is None or inter is None:
            raise ValueError(f"{name}: GPU_TABLE has only its peaks; the planner also needs its memory and bandwidths")
        return GpuSpec(name, self.bf16_tflops, memory, hbm, intra, inter, self.generation)


# Peaks: the vendors' spec sheets, whose headline bf16/fp8/tf32 figures are "with sparsity" = 2x these:
#   NVIDIA H100 SXM5 / PCIe datasheet (H200 SXM has the H100 SXM compute, more HBM), NVIDIA A100
#   datasheet (no fp8), NVIDIA DGX/HGX B200 datasheet (per GPU), NVIDIA L4 datasheet, AMD Instinct
#   MI300X datasheet. HBM bandwidth: the same datasheets. Memory: nvidia-smi totals (H100 80GB:
#   81559 MiB; H200: 143771 MiB; A100 80GB: 81920 MiB; B200: 183359 MiB). Links: NVLink 4 (H100/H200)
#   450 GB/s per direction, NCCL bus bandwidth ~80% of it; NVLink 3 (A100) 300 GB/s; NVLink 5 (B200)
#   900 GB/s. Between nodes one 400 Gb/s NIC per GPU (50 GB/s; A100 clusters: 200 Gb/s HDR, 25 GB/s),
#   ~80% reached.
# fp32 (no tensor cores): the same datasheets' "FP32" row (B200: HGX B200's 600 TFLOP/s over 8 GPUs).
GPU_TABLE: dict[str, GpuFigures] = {
    #                        bf16     fp8    tf32 memory GiB  HBM GB/s  intra  inter
    "H100 SXM": GpuFigures(989.4, 1978.9, 494.7, 79.6, 3350.0, 360.0, 40.0, fp32_tflops=66.9),
    "H200": GpuFigures(989.4, 1978.9, 494.7, 140.4, 4800.0, 360.0, 40.0, fp32_tflops=66.9),
    "A100": GpuFigures(312.0, None, 156.0, 80.0, 2039.0, 240.0, 20.0, fp32_tflops=19.5, generation="Ampere"),
    "B200": GpuFigures(2250.0, 4500.0, 1100.0, 179.1, 8000.0, 720.0, 40.0, fp32_tflops=75.0, generation="Blackwell"),
    # Peaks only (for MFU): no measured memory total or NCCL bandwidth, so `ultrascale plan` has no --gpu for them.
    "H100 PCIe": GpuFigures(756.0, 1513.0, 378.0, fp32_tflops=51.2),
    "L4": GpuFigures(121.0, 242.5, 60.0, fp32_tflops=30.3, generation="Ada"),
    "MI300X": GpuFigures(1307.4, 2614.9, 653.7, fp32_tflops=163.4, generation="CDNA3"),
}

# `ultrascale plan --gpu` kinds: rows of the table under the names the plans print.
GPU_SPECS: dict[str, GpuSpec] = {
    "h100": GPU_TABLE["H100 SXM"].spec("H100 SXM"),
    "h200": GPU_TABLE["H200"].spec("H200 SXM"),
    "a100": GPU_TABLE["A100"].spec("A100 SXM 80GB"),
    "b200": GPU_TABLE["B200"].spec("B200"),
}

PEAK_TFLOPS: dict[str, dict[str, float]] = {key: row.peaks for key, row in GPU_TABLE.items()}
"""The table's peaks by device key and dtype, as `MFUMonitor` reads them."""

# Device-name patterns -> table key, most specific first ("H100 PCIe" before any H100,
# the NVL variants have lower clocks and are left to the `peak_tflops` override).
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100(?!.*NVL)", "H100 SXM"),
    (r"H200(?!.*NVL)", "H200"),
    (r"A100", "A100"),
    (r"B200", "B200"),
    (r"\bL4\b", "L4"),
    (r"MI300X", "MI300X"),
)


def find_peak_tflops(device_name: str, dtype: str) -> Optional[tuple[str, float]]:
    """``(table key, dense TFLOP/s)`` for a device name such as "NVIDIA H100 80GB HBM3"; None if unknown."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            peak = PEAK_TFLOPS[key].get(dtype)
            return None if peak is None else (key, peak)
    return None


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is priced for: one kind, how many, how they are grouped in nodes."""

    gpu: GpuSpec
    gpus: int
    gpus_per_node: int = 8
    efficiency: Optional[float] = None
    """Fraction of the peak that the model's matmuls reach when nothing waits, one number for all layouts (None: the
    GPU's, `GpuSpec.efficiency`; `benchmarks/planner_validation.py` compares it with published runs)."""
    memory_headroom: float = 0.9
    """Fraction of `gpu.memory_gib` a layout may plan for: the rest is the CUDA context, NCCL and fragmentation."""
    latency_s: float = 10e-6
    """Fixed cost of one collective."""
    calibration: tuple[tuple[str, float], ...] = ()
    """This machine's measured / predicted tokens/s per layout family (`ultrascale.planner.calibration`: `ultrascale
    tune --calibrate`), which divide a layout's predicted times; empty: none."""

    def __post_init__(self) -> None:
        if self.efficiency is None:
            object.__setattr__(self, "efficiency", self.gpu.efficiency)

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_gib * GIB * self.memory_headroom
