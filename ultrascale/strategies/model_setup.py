"""The model's side of `UltraScaleStrategy.setup`: shard the checked model on the mesh, build the
ZeRO-1/2 engines, collect the model transforms.

Each function takes what it needs explicitly (module, mesh, degrees, precision plugin, knobs) and
returns its result; the strategy assigns it. The rulebook's checks (`check_model`, `_check_data`)
stay with the strategy and run before `shard_model`, so no weight moves for a layout that fails.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor

from ultrascale.models.adapters import ModelPlan
from ultrascale.parallel.context import ContextParallel
from ultrascale.parallel.dims import ParallelDims, ParallelMesh
from ultrascale.parallel.expert import iter_routers, router_loads
from ultrascale.parallel.fsdp import is_fsdp_sharded, set_gradient_sync
from ultrascale.parallel.init import broadcast_module_state, has_meta_tensors, materialize_meta_module
from ultrascale.parallel.parallelize import parallelize
from ultrascale.parallel.pipeline import (
    PipelineRunner,
    TiedStageWeights,
    head_holds_tied_copy,
    split_model,
    tie_stage_weights,
    untie_stage_weights,
)
from ultrascale.parallel.transforms import ModelTransform
from ultrascale.parallel.zero import ExpertMeshes, ZeroEngine, zero12_dtypes
from ultrascale.strategies.precision import UltraScalePrecision


@dataclass(frozen=True)
class ShardedModel:
    """What `shard_model` leaves for the step: the pipeline (if any) and this rank's MoE routers."""

    pipeline: Optional[PipelineRunner]
    """Under pipeline parallel, the runner of this rank's stages; None otherwise."""
    routers: list[torch.nn.Module]
    """The MoE routers of this rank's layers (empty without MoE)."""
    tied: Optional[TiedStageWeights] = None
    """Under pipeline parallel with tied embeddings, on the first and the last pipeline rank: the weights
    whose gradients the two sum every step; None otherwise."""


def is_parallelized(module: torch.nn.Module) -> bool:
    """Whether `module` parallelised itself in `configure_model()` (FSDP units or DTensor parameters): left as it is."""
    return is_fsdp_sharded(module) or any(isinstance(p, DTensor) for p in module.parameters())


def moe_shape(module: torch.nn.Module) -> Optional[tuple[int, int]]:
    """(MoE layers, experts) of the whole model, None without MoE; read before any pipeline split,
    while this rank still holds every router."""
    loads = router_loads(module)
    return (1 + max(load.layer for load in loads), max(load.n_experts for load in loads)) if loads else None


def shard_model(
    module: torch.nn.Module,
    checked: ModelPlan,
    mesh: ParallelMesh,
    dims: ParallelDims,
    *,
    device: torch.device,
    precision: UltraScalePrecision,
    transforms: list[ModelTransform],
    context_parallel: Optional[ContextParallel],
    reshard_after_forward: bool,
    zero_stage: int,
    sync_module_states: bool,
    owner: str,
) -> ShardedModel:
    """Split (pp), move, synchronise, convert, parallelise and materialise `module` in place, in this
    order, for the plan `check_model` accepted."""
    adapter, pipeline, tp_plan = checked.adapter, checked.pipeline, checked.tp_plan
    if tp_plan is not None:
        rank_zero_info(f"tensor parallel {dims.tp} on {adapter.name}: sequence_parallel={checked.sequence_parallel}, "
                       f"loss_parallel={checked.loss_parallel}")
    if not adapter.blocks:
        rank_zero_info(
            f"{owner}: no repeated blocks (a ModuleList of identical layers) found in "
            f"{type(module).__name__}; sharding it as one FSDP unit per top-level child"
        )
    ties = pipeline[0].tied_weights() if pipeline is not None else []  # read while this rank holds both ends
    mirrored = bool(ties) and pipeline is not None and head_holds_tied_copy(zero_stage, pipeline[1].ends_on_one_rank)
    if pipeline is not None:  # before weights move: the parts other ranks hold never reach this device
        split_model(*pipeline, mesh["pp"].get_local_rank())
        if mirrored:
            untie_stage_weights(pipeline[0], ties)
    meta = has_meta_tensors(module)
    if not meta:
        # Real weights move to this rank's device first: NCCL broadcasts only device tensors,
        # and sharding then happens where the shards will live.
        module.to(device)
    if sync_module_states and not meta:
        if dims.pp_enabled:  # each stage's ranks agree on that stage's weights
            stage_group = mesh["stage"].get_group()
            broadcast_module_state(module, src=dist.get_global_rank(stage_group, 0), group=stage_group)
        else:
            broadcast_module_state(module)
    precision.convert_module(module)
    stages = parallelize(
        module,
        mesh,
        blocks=adapter.blocks,
        tp_plan=tp_plan,
        transforms=transforms,
        mp_policy=precision.mixed_precision_policy(),
        reshard_after_forward=reshard_after_forward,
        shard_parameters=zero_stage == 3,
        context_parallel=context_parallel,
        enable_context_parallel=adapter.enable_context_parallel,
        pipeline=pipeline,
        enable_expert_parallel=adapter.enable_expert_parallel,
        experts=adapter.experts,
    )
    routers = list(iter_routers(module))
    if meta:
        materialize_meta_module(module, device)
    runner, tied = None, None
    if pipeline is not None:
        runner = PipelineRunner(stages, pipeline[1], mesh["pp"].get_group(), device, loss=pipeline[0].loss)
        rank_zero_info(f"pipeline parallel: {pipeline[1].describe()}")
        if ties and (mirrored or not pipeline[1].ends_on_one_rank):
            tied = tie_stage_weights(pipeline[0], ties, mesh.world, mesh["pp"].get_local_rank(), ends_on_one_rank=mirrored)
    return ShardedModel(runner, routers, tied)


def make_zero_engine(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    mesh: ParallelMesh,
    dims: ParallelDims,
    device: torch.device,
    precision: UltraScalePrecision,
    bucket_mb: Optional[float],
    accumulate_in_fp32: Optional[bool],
    tied: Optional[TiedStageWeights] = None,
) -> ZeroEngine:
    """The ZeRO-1/2 engine of one optimizer (`zero_stage` 1 or 2)."""
    bucket_mb = bucket_mb or (100.0 if device.type == "cuda" else 4.0)
    compute_dtype, accumulate_dtype = zero12_dtypes(precision.precision, accumulate_in_fp32)
    return ZeroEngine(
        model,
        optimizer,
        stage=stage,
        dp_mesh=mesh.fsdp,
        bucket_bytes=int(bucket_mb * 2**20),
        compute_dtype=compute_dtype,
        accumulate_dtype=accumulate_dtype,
        norm_group=mesh["pp"].get_group() if dims.pp_enabled else None,
        state_mesh=mesh.zero_state_mesh if dims.tp_enabled else None,
        tied=tied,
        experts=ExpertMeshes(mesh["ep"], mesh["expert_fsdp"], mesh.expert_zero_state_mesh) if dims.ep_enabled else None,
    )


def model_transforms(trainer: Any, auto_transforms: list[ModelTransform],
                     compiler: Optional[ModelTransform] = None) -> list[ModelTransform]:
    """Callbacks that rewrite the model (activation checkpointing, FP8) run inside `parallelize`, after
    the auto layout's own transforms; `compile` last, so that it compiles the blocks as they will run."""
    callbacks = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, ModelTransform)]
    return [*auto_transforms, *callbacks, *([compiler] if compiler is not None else [])]


@contextmanager
def deferred_gradient_sync(model: Optional[torch.nn.Module], engines: Sequence[ZeroEngine], *,
                           accumulate_unsharded_grads: bool) -> Generator[None, None, None]:
    """A non-final micro-batch of gradient accumulation: ZeRO-1/2 `engines` defer their reduction; FSDP
    skips its reduce-scatter only under `accumulate_unsharded_grads`.

    FSDP2 without gradient sync accumulates each parameter's *unsharded* gradient until the
    last micro-batch, so by default FSDP keeps reducing every micro-batch into its shards:
    ZeRO-3's memory is the point of ZeRO-3."""
    fsdp = model is not None and is_fsdp_sharded(model) and accumulate_unsharded_grads
    if fsdp:
        set_gradient_sync(model, False)
    try:
        with ExitStack() as deferred:
            for engine in engines:
                deferred.enter_context(engine.no_sync())
            yield
    finally:
        if fsdp:
            set_gradient_sync(model, True)
