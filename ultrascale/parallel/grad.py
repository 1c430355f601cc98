"""Gradient utilities that are correct for sharded (DTensor) gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by their global norm over all ranks; returns the (unclipped) global norm.

    Each rank holds only a shard of every gradient, so a local `clip_grad_norm_` would
    clip by the norm of its shard. For DTensor gradients the per-tensor norms come back
    as `Partial` placements; `full_tensor()` performs the one all-reduce that turns
    them into the true norm  ||g|| = (sum_ranks sum_i |g_i|^p)^(1/p).
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not grads:
        return torch.tensor(0.0)
    meshes = {g.device_mesh for g in grads if isinstance(g, DTensor)}
    if len(meshes) > 1:
        # Different meshes (e.g. pipeline stages, experts) need one reduction per mesh;
        # torch's foreach norm cannot mix them.
        norms = []
        for mesh in meshes:
            part = [g for g in grads if isinstance(g, DTensor) and g.device_mesh == mesh]
            norms.append(_full(torch.nn.utils.get_total_norm(part, norm_type, error_if_nonfinite)))
        plain = [g for g in grads if not isinstance(g, DTensor)]
        if plain:
            norms.append(torch.nn.utils.get_total_norm(plain, norm_type, error_if_nonfinite))
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    else:
        total = _full(torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite))
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _full(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
