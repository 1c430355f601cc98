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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ultrascale import planner
from ultrascale.estimate import ModelShape
from ultrascale.hardware import find_peak_tflops
from ultrascale.models.adapters import model_shape
from ultrascale.parallel.rules import PRECISIONS, raise_first, recompute_problems
from ultrascale.planner.recipe import checkpointing_args

__all__ = ["AutoLayout", "AutoLayoutInputs", "apply_auto_layout", "auto_layout_inputs", "choose_budget_blocks",
           "choose_layout", "device_cluster", "fixed_knobs"]

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
    """(shape, HF config or None, why not) for a LightningModule the planner can price (`model_shape`)."""
    try:
        shape = model_shape(module, name=f"Llama ({type(module).__name__})")
    except ValueError as error:
        return None, None, str(error)
    return shape, (None if shape.builtin else shape.config), ""


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
                       precision: str, compiled: bool = False,
                       calibration: Optional[str] = None) -> tuple[Optional[AutoLayoutInputs], str]:
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
    hparams = getattr(module, "hparams", None) or {}
    work = planner.Workload(seq_len, global_batch * accumulate, precision if precision in PRECISIONS
                            else "bf16-mixed", compiled=compiled, loss_chunk_tokens=hparams.get("loss_chunk_tokens"))
    cluster = device_cluster(device, world_size, ranks_per_node)
    if calibration is not None:  # this machine's measured / predicted ratios, against the GPU they were measured for
        devices = "cpu" if device.type == "cpu" else "cuda"
        cluster = planner.calibrated(cluster, planner.load_calibration(calibration, cluster.gpu.name, devices))
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
    runnable: list[planner.PlanRow] = []
    if fixed.get("pp", 1) == 1:
        # One Lightning batch is one micro-batch per data rank: whatever size the batch gives it, and only that one.
        data_parallel = {**fixed, "pp": 1, "grad_accumulation": fixed.get("grad_accumulation", accumulate)}
        runnable += planner.search(inputs.shape, inputs.cluster, inputs.work, data_parallel, inputs.hf_config,
                                   max_micro_batch=inputs.work.global_batch, top=1)
    if accumulate == 1 and fixed.get("pp") != 1:
        rows = planner.search(inputs.shape, inputs.cluster, inputs.work, fixed, inputs.hf_config)
        runnable += [row for row in rows if row.layout.pp > 1]
    runnable.sort(key=planner.rank_key)
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


def fixed_knobs(**knobs: tuple[Any, Any]) -> dict[str, Any]:
    """The knobs given as (value, default) that the user set away from their defaults: they stay fixed
    in the auto search."""
    return {key: value for key, (value, default) in knobs.items() if value != default}


@dataclasses.dataclass(frozen=True)
class AutoLayout:
    """The planner's choice, in the strategy's knobs; the strategy assigns them."""

    row: planner.PlanRow
    """The planner's row that was chosen (the strategy's `chosen_layout`)."""
    degrees: dict[str, int]
    zero_stage: int
    accumulate_unsharded_grads: bool
    pipeline_schedule: str
    pipeline_virtual_stages: Optional[int]
    pipeline_microbatches: Optional[int]
    pipeline_layers: Optional[list[int]]
    """The planner's layer split (its balanced one, say), None for the strategy's even split."""
    context_parallel_method: str
    context_parallel_ulysses: Optional[int]
    transforms: list[Any]
    """Activation checkpointing's transform when the layout recomputes and no such callback is given."""


def apply_auto_layout(module: Any, trainer: Any, *, device: torch.device, world_size: int, ranks_per_node: int,
                      precision: str, degrees: dict[str, int], fixed: dict[str, Any], pipeline_schedule: str,
                      pipeline_virtual_stages: Optional[int], pipeline_microbatches: Optional[int],
                      owner: str, compiled: bool = False, calibration: Optional[str] = None) -> Optional[AutoLayout]:
    """The planner's best layout (same inputs on every rank: same choice, no collective), logged on rank 0;
    None, after a warning, where the planner cannot price the run (the set `degrees` are then kept)."""
    inputs, why = auto_layout_inputs(module, trainer, device, world_size, ranks_per_node, precision, compiled, calibration)
    if inputs is None:
        rank_zero_warn(f"{owner}(auto_layout=True): the planner cannot price this run ({why}); keeping the set "
                       f"degrees {degrees} (ZeRO-3 over the rest). Give the layout yourself to choose another.")
        return None
    try:
        row = choose_layout(inputs, fixed)
    except ValueError as error:
        raise ValueError(f"{owner}(auto_layout=True): {error}") from None
    lay = row.layout
    if lay.pp > 1:
        pipeline_schedule = lay.schedule or pipeline_schedule
        pipeline_virtual_stages = lay.virtual_stages
        if pipeline_microbatches is None:
            pipeline_microbatches = lay.grad_accumulation
    from ultrascale.callbacks.activation_checkpointing import ActivationCheckpointing

    transforms: list[Any] = []
    if lay.recompute != "none" and not any(
            isinstance(callback, ActivationCheckpointing) for callback in (trainer.callbacks if trainer is not None else [])):
        # its transform, not registered as a callback; a budget's blocks are chosen again in `parallelize`
        transforms = [ActivationCheckpointing(**checkpointing_args(lay, inputs.cluster))]
    memory, step = row.memory, row.step_time
    rank_zero_info(
        f"ultrascale_4d auto layout for {inputs.describe()}: {lay.describe()} "
        f"(predicted {memory['total'] / 2**30:.2f} GiB per device, step {step['total']:.3g} s)"
    )
    return AutoLayout(
        row, {"dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp, "pp": lay.pp,
              "ep": lay.ep},
        lay.zero_stage, lay.accumulate_unsharded_grads, pipeline_schedule, pipeline_virtual_stages, pipeline_microbatches,
        list(lay.pipeline_layers) if lay.pp > 1 and lay.pipeline_layers is not None else None,
        lay.cp_method, lay.cp_ulysses if lay.cp_method == "usp" else None, transforms,
    )


def choose_budget_blocks(transforms: list[Any], module: Any, trainer: Any, strategy: Any, *, device: torch.device,
                         world_size: int, ranks_per_node: int, precision: str, owner: str) -> None:
    """Each block's recompute mode for the transforms with a `memory_budget_gib` (`ActivationCheckpointing`), priced
    by the planner for the strategy's own layout and the data module's batch, the same on every rank; logged on rank 0.
    Raises before any weight moves where the planner cannot price the run or nothing fits."""
    budgeted = [t for t in transforms if getattr(t, "memory_budget_gib", None) is not None]
    if not budgeted:
        return
    dims = strategy.parallel_dims
    knob = f"ActivationCheckpointing(`memory_budget_gib={budgeted[0].memory_budget_gib}`)"
    raise_first(recompute_problems("budget", dims.pp), knob)
    inputs, why = auto_layout_inputs(module, trainer, device, world_size, ranks_per_node, precision,
                                     compiled=bool(strategy.compile))
    if inputs is None:
        raise ValueError(f"{knob}: the planner cannot price this run ({why}); give `mode` instead")
    accumulate = inputs.accumulate_grad_batches
    layout = planner.layout_of_strategy(strategy, dims, micro_batch=inputs.work.global_batch // accumulate // dims.dp,
                                        grad_accumulation=accumulate, recompute="budget")
    for transform in budgeted:
        transform.choose_blocks(inputs.shape, layout, inputs.cluster, inputs.work, inputs.hf_config)
        rank_zero_info(f"{owner}: {knob.replace('`', '')} on {dims.describe()}: {transform.describe_blocks()} "
                       f"(predicted peak {transform.predicted_peak_gib:.3g} GiB a rank)")
