"""`parallelize`: apply every enabled parallelism to a model, in the canonical order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ultrascale.parallel.context import ContextParallel
from ultrascale.parallel.dims import ParallelMesh
from ultrascale.parallel.fsdp import apply_fsdp
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
) -> nn.Module:
    """Apply the parallelisms of `mesh.dims` to `module` in place.

    Order (see ARCHITECTURE.md): pipeline split, then TP/SP, EP, CP, activation
    checkpointing and FP8, and ZeRO/FSDP last: FSDP shards whatever parameters the
    earlier steps left, so TP's DTensors on the tp axis become 2-D (dp, tp) DTensors.
    With `shard_parameters=False` (ZeRO-1/2) parameters stay whole; the optimizer state is
    sharded by `ultrascale.parallel.zero.ZeroEngine` once the optimizer exists.
    """
    dims = mesh.dims
    for name in ("pp", "ep"):
        if getattr(dims, name) != 1:
            raise NotImplementedError(f"parallelize: {name}={getattr(dims, name)} is not implemented yet")
    if dims.tp_enabled:
        if tp_plan is None:
            raise ValueError(f"tp={dims.tp} needs a tensor-parallel plan for {type(module).__name__}")
        apply_tp(module, mesh["tp"], tp_plan)
    if dims.cp_enabled:
        # CP has no parameters of its own: attention is routed through `context_parallel`, and the
        # weights (replicated over cp) are sharded over dp_shard x cp by FSDP below.
        if context_parallel is None or enable_context_parallel is None:
            raise ValueError(f"cp={dims.cp} needs a ContextParallel and the model's attention hook for {type(module).__name__}")
        enable_context_parallel(context_parallel)
    for transform in transforms:  # activation checkpointing, FP8: after TP, before sharding
        transform.transform_model(module, blocks)
    if not shard_parameters:  # ZeRO-1/2: parameters stay replicated; the optimizer is sharded later
        return module
    # HSDP: on the 2-D (replicate, shard) mesh FSDP all-reduces gradients across replicas
    # after reduce-scattering them within one; plain FSDP uses the 1-D shard mesh.
    apply_fsdp(
        module,
        mesh.fsdp,
        blocks=blocks,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
    )
    return module
