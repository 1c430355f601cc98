"""`parallelize`: apply every enabled parallelism to a model, in the canonical order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ultrascale.parallel.context import ContextParallel
from ultrascale.parallel.dims import ParallelMesh
from ultrascale.parallel.expert import ExpertParallel, set_sequence_group
from ultrascale.parallel.fsdp import apply_fsdp, apply_fsdp_to_stages
from ultrascale.parallel.pipeline import PipelineLayout, PipelineParts, PipelineStageModule, plan_for_present, split_model
from ultrascale.parallel.tensor import TPPlan, apply_tp
from ultrascale.parallel.transforms import ModelTransform


def parallelize(
    module: nn.Module,
    mesh: ParallelMesh,
    *,
    blocks: Sequence[nn.Module],
    tp_plan: Optional[TPPlan] = None,
    transforms: Sequence[ModelTransform] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    shard_parameters: bool = True,
    context_parallel: Optional[ContextParallel] = None,
    enable_context_parallel: Optional[Callable[[ContextParallel], None]] = None,
    pipeline: Optional[tuple[PipelineParts, PipelineLayout]] = None,
    enable_expert_parallel: Optional[Callable[[ExpertParallel], None]] = None,
    experts: Callable[[], Sequence[nn.Module]] = lambda: (),
) -> list[PipelineStageModule]:
    """Apply the parallelisms of `mesh.dims` to `module` in place.

    Order (see docs/architecture.md, "The order of application"): pipeline split, then TP/SP (FP8 just before it
    when both are on), EP, CP, activation checkpointing and FP8, and ZeRO/FSDP last: FSDP shards whatever parameters the
    earlier steps left, so TP's DTensors on the tp axis become 2-D (dp, tp) DTensors.
    With `shard_parameters=False` (ZeRO-1/2) parameters stay whole; the optimizer state is
    sharded by `ultrascale.parallel.zero.ZeroEngine` once the optimizer exists.

    Under pipeline parallel (`pipeline` = the model's parts and the layout) the parts other
    ranks hold become `PipelineGap`s first; every later step sees only this rank's parts, and
    the returned stage modules (one per local stage) are what the schedule runs. Without it
    the list is empty.

    Under expert parallel (ep > 1) `enable_expert_parallel` splits the experts over `mesh["ep"]`;
    `experts()` lists the experts modules, each then its own FSDP unit on `mesh.expert_fsdp` (the
    ranks holding the same experts), inside its block's unit on the dense mesh.
    """
    dims = mesh.dims
    if dims.pp_enabled:
        if pipeline is None:
            raise ValueError(f"pp={dims.pp} needs the model's pipeline parts and a layout for {type(module).__name__}")
        parts, layout = pipeline
        split_model(parts, layout, mesh["pp"].get_local_rank())
        held = {id(m) for m in module.modules()}  # blocks another pipeline rank holds are gaps now
        blocks = [b for b in blocks if id(b) in held]
    early: list[ModelTransform] = []
    if dims.tp_enabled:
        if tp_plan is None:
            raise ValueError(f"tp={dims.tp} needs a tensor-parallel plan for {type(module).__name__}")
        # FP8 converts the linears in place (same paths) before TP, whose plan then takes torchao's float8 styles
        # for them (`tensor.float8_entries`): the fp8 casts sit inside the sharded layers, as in torchtitan.
        early = [t for t in transforms if getattr(t, "before_tensor_parallel", False)]
        for transform in early:
            transform.transform_model(module, blocks)
        apply_tp(module, mesh["tp"], plan_for_present(module, tp_plan) if dims.pp_enabled else tp_plan)
    expert_units: Sequence[nn.Module] = ()
    if dims.ep_enabled:
        if enable_expert_parallel is None:
            raise ValueError(f"ep={dims.ep} needs the model's expert dispatch hook for {type(module).__name__}")
        # Under tp too (EP x TP) the experts stay whole on each tp rank, which dispatches 1/tp of the tokens.
        enable_expert_parallel(ExpertParallel(mesh["ep"], tp=mesh["tp"] if dims.tp_enabled else None))
        expert_units = list(experts())
    if dims.cp_enabled:
        # CP has no parameters of its own: attention is routed through `context_parallel`, and the
        # weights (replicated over cp) are sharded over dp_shard x cp by FSDP below.
        if context_parallel is None or enable_context_parallel is None:
            raise ValueError(f"cp={dims.cp} needs a ContextParallel and the model's attention hook for {type(module).__name__}")
        enable_context_parallel(context_parallel)
        set_sequence_group(module, mesh["cp"].get_group())  # MoE balance terms count whole rows
    for transform in transforms:  # activation checkpointing, FP8 without TP: after TP, before sharding
        if transform not in early:
            transform.transform_model(module, blocks)
    stages: list[PipelineStageModule] = []
    if dims.pp_enabled:
        pp_rank = mesh["pp"].get_local_rank()
        stages = [PipelineStageModule(parts, layout, stage, pp_rank) for stage in layout.stage_ids(pp_rank)]
    if not shard_parameters:  # ZeRO-1/2: parameters stay replicated; the optimizer is sharded later
        return stages
    if stages:
        apply_fsdp_to_stages(stages, mesh.fsdp, blocks=blocks, mp_policy=mp_policy, experts=expert_units,
                             expert_mesh=mesh.expert_fsdp)
        return stages
    # HSDP: on the 2-D (replicate, shard) mesh FSDP all-reduces gradients across replicas
    # after reduce-scattering them within one; plain FSDP uses the 1-D shard mesh.
    apply_fsdp(
        module,
        mesh.fsdp,
        blocks=blocks,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        experts=expert_units,
        expert_mesh=mesh.expert_fsdp,
    )
    return stages
