"""`parallelize`: apply every enabled parallelism to a model, in the canonical order."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.fsdp import apply_fsdp


def parallelize(
    module: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    blocks: Sequence[nn.Module],
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    module_forward_is_called: bool = True,
) -> nn.Module:
    """Apply the parallelisms of `dims` to `module` in place.

    Order (see ARCHITECTURE.md): pipeline split, then TP/SP, EP, CP, activation
    checkpointing and FP8, and ZeRO/FSDP last, because FSDP shards whatever parameters
    the earlier steps left (DTensors on the tp axis become 2D-sharded). Only ZeRO-3 /
    HSDP exist so far; the strategies reject the other degrees before we get here.
    """
    for name in ("pp", "tp", "cp", "ep"):
        if getattr(dims, name) != 1:
            raise NotImplementedError(f"parallelize: {name}={getattr(dims, name)} is not implemented yet")
    # HSDP: a 2D (replicate, shard) mesh makes FSDP all-reduce gradients across replicas
    # after reduce-scattering them within one; plain FSDP uses the 1D shard axis.
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate_enabled else mesh["dp_shard_cp"]
    apply_fsdp(
        module,
        dp_mesh,
        blocks=blocks,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        module_forward_is_called=module_forward_is_called,
    )
    return module
