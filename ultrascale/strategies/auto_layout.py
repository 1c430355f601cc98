"""`strategy="ultrascale_4d"` alone: the planner's best layout for this world size, model and batch.

Every rank runs the same deterministic search (`ultrascale.planner.search`, plain arithmetic,
well under a second) on the same inputs, so all ranks choose the same layout without a
collective, before the mesh exists. The inputs:

- the model: a built-in `LlamaLM` (its `LlamaConfig`) or an `HFCausalLM` (its HF config);
  the planner prices and the strategy checks the same architecture rules;
- the batch: the data module's `seq_len` and `global_batch_size` (sequences of one Lightning
  batch over all data-parallel ranks) times the Trainer's `accumulate_grad_batches`;
- the devices: on CUDA the GPU named by the driver with its real memory (the planner's table
  for its peak and links, or `ultrascale.estimate`'s peak table); on CPU a nominal spec with
  this node's memory split over its ranks (the ranking then mostly reflects communication).

Knobs the user set away from their defaults are kept fixed; the rest is searched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import psutil
import torch

from ultrascale import planner
from ultrascale.estimate import ModelShape, find_peak_tflops

__all__ = ["AutoLayoutInputs", "auto_layout_inputs", "choose_layout", "device_cluster"]

# Peak and bandwidths of "a CPU rank" only order layouts against each other: compute is
# cheap next to gloo's collectives, as on the machines where CPU runs happen.
_CPU_SPEC = planner.GpuSpec("CPU", peak_tflops=0.2, memory_gib=16.0, hbm_gbps=20.0, intra_node_gbps=2.0,
                            inter_node_gbps=1.0)


@dataclasses.dataclass(frozen=True)
class AutoLayoutInputs:
    """What the search sees; `describe()` is logged with the chosen layout."""

    shape: ModelShape
    hf_config: Any
    work: planner.Workload
    cluster: planner.Cluster
    accumulate_grad_batches: int

    def describe(self) -> str:
        return (f"{self.shape.name} ({self.shape.num_params / 1e6:,.1f}M parameters), {self.cluster.gpus} x "
                f"{self.cluster.gpu.name} ({self.cluster.gpus_per_node} per node, {self.cluster.gpu.memory_gib:.1f} GiB "
                f"each), {self.work.global_batch} sequences x {self.work.seq_len} tokens per optimizer step, "
                f"{self.work.precision}")


def model_shape_of(module: Any) -> tuple[Optional[ModelShape], Any, str]:
    """(shape, HF config or None, why not) for a LightningModule the planner can price."""
    from ultrascale.models.llama import LlamaConfig

    config = getattr(module, "config", None)
    if isinstance(config, LlamaConfig):
        return ModelShape.from_llama_config(config, name=f"Llama ({type(module).__name__})"), None, ""
    try:
        import transformers
    except ImportError:  # pragma: no cover - a dependency
        transformers = None
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        text_config = getattr(config, "text_config", None) or config
        try:
            return ModelShape.from_hf_config(text_config), text_config, ""
        except ValueError as error:
            return None, None, str(error)
    return None, None, (f"{type(module).__name__} has no `config` the planner reads (a built-in `LlamaConfig` or a "
                        "Hugging Face config)")


def device_cluster(device: torch.device, world_size: int, ranks_per_node: int) -> planner.Cluster:
    """The planner's view of the ranks: one GPU kind (from the driver) or the CPU spec."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        memory_gib = properties.total_memory / planner.GIB
        name = properties.name
        spec = next((s for key, s in planner.GPU_SPECS.items() if key in name.lower()), None)
        if spec is not None:
            spec = dataclasses.replace(spec, name=name, memory_gib=memory_gib)
        else:
            peak = find_peak_tflops(name, "bf16")
            spec = dataclasses.replace(planner.GPU_SPECS["h100"], name=name, memory_gib=memory_gib,
                                       peak_tflops=peak[1] if peak else planner.GPU_SPECS["h100"].peak_tflops)
    else:
        memory_gib = psutil.virtual_memory().total / planner.GIB / max(ranks_per_node, 1)
        spec = dataclasses.replace(_CPU_SPEC, memory_gib=memory_gib)
    return planner.Cluster(spec, world_size, gpus_per_node=max(1, min(ranks_per_node, world_size)))


def auto_layout_inputs(module: Any, trainer: Any, device: torch.device, world_size: int, ranks_per_node: int,
                       precision: str) -> tuple[Optional[AutoLayoutInputs], str]:
    """The search's inputs, or (None, why the planner cannot price this run)."""
    shape, hf_config, why = model_shape_of(module)
    if shape is None:
        return None, why
    datamodule = getattr(trainer, "datamodule", None)
    seq_len = getattr(datamodule, "seq_len", None)
    global_batch = getattr(datamodule, "global_batch_size", None)
    if not isinstance(seq_len, int) or not isinstance(global_batch, int):
        return None, (f"the data module ({type(datamodule).__name__}) declares no integer `seq_len` and "
                      "`global_batch_size` (ultrascale.data's data modules do)")
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    work = planner.Workload(seq_len, global_batch * accumulate, precision if precision in
                            ("32-true", "bf16-mixed", "bf16-true") else "bf16-mixed")
    cluster = device_cluster(device, world_size, ranks_per_node)
    return AutoLayoutInputs(shape, hf_config, work, cluster, accumulate), ""


def choose_layout(inputs: AutoLayoutInputs, fixed: dict[str, Any]) -> planner.PlanRow:
    """The best fitting layout that runs the user's batch as given.

    Without pipeline parallel one Lightning batch is one micro-batch per data rank and the
    accumulation is the Trainer's; with it the local batch is cut into the schedule's
    micro-batches (and Lightning does not accumulate). ValueError if nothing fits, with the
    planner's reasons."""
    accumulate = inputs.accumulate_grad_batches
    fixed = dict(fixed)
    if accumulate > 1:
        fixed.setdefault("pp", 1)  # accumulation over Lightning batches: the planner prices it without a pipeline
    rows = planner.search(inputs.shape, inputs.cluster, inputs.work, fixed, inputs.hf_config)
    runnable = [row for row in rows if (row.layout.pp == 1 and row.layout.grad_accumulation == accumulate)
                or (row.layout.pp > 1 and accumulate == 1)]
    fitting = [row for row in runnable if row.fits]
    if fitting:
        return fitting[0]
    reasons = planner.why_not(inputs.shape, inputs.cluster, inputs.work, fixed, inputs.hf_config)
    closest = min(runnable, key=lambda row: row.memory["total"]) if runnable else None
    detail = (f"; the least memory is {closest.memory['total'] / planner.GIB:.1f} GiB per device "
              f"({closest.layout.describe()}) of {inputs.cluster.usable_bytes / planner.GIB:.1f} GiB usable"
              if closest is not None else "")
    raise ValueError(
        f"no layout of {inputs.describe()} fits{detail}. Reasons: {'; '.join(reasons[:4]) or 'none given'}. "
        "Use more devices, a smaller batch or sequence, or give the degrees yourself (`ultrascale plan` explains)."
    )
