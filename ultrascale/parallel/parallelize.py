"""`parallelize`: apply every enabled parallelism to a model, in the canonical order."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ultrascale.parallel.dims import ParallelMesh
from ultrascale.parallel.fsdp import apply_fsdp


def parallelize(
    module: nn.Module,
    mesh: ParallelMesh,
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
    dims = mesh.dims
    for name in ("pp", "tp", "cp", "ep"):
        if getattr(dims, name) != 1:
            raise NotImplementedError(f"parallelize: {name}={getattr(dims, name)} is not implemented yet")
    # HSDP: on the 2-D (replicate, shard) mesh FSDP all-reduces gradients across replicas
    # after reduce-scattering them within one; plain FSDP uses the 1-D shard mesh.
    apply_fsdp(
        module,
        mesh.fsdp,
        blocks=blocks,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        module_forward_is_called=module_forward_is_called,
    )
    return module
