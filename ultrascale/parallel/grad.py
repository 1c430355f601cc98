"""Gradient utilities that are correct for sharded (DTensor) gradients."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ultrascale.parallel.device import collective_device
from ultrascale.parallel.loss import scale_gradients


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    total_norm: torch.Tensor | None = None,
    across: dist.ProcessGroup | None = None,
    not_counted: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients by their global norm over all ranks; returns the (unclipped) global norm.

    Each rank holds only a shard of every gradient, so a local `clip_grad_norm_` would
    clip by the norm of its shard. Here  ||g||_p^p = sum over ranks of sum_i |g_i|^p,
    where a gradient replicated over some mesh axes is counted once (its local sum is
    divided by the replication factor). One all-reduce per device mesh, over all of its
    ranks at once: DTensor's own reduction of a 2-D partial norm would run one all-reduce
    per axis, in an order that can differ between ranks. `total_norm`: the global norm if the
    caller already has it (the strategy's non-finite check computed it this step). `across`: ranks
    that hold *other* parameters (pipeline stages), whose gradients count in the norm too. `not_counted`:
    gradients that another rank counts (a tied weight's copy on the last pipeline stage): clipped, not counted.
    """
    parameters = [p for p in parameters if p.grad is not None]
    if total_norm is None:
        skip = {id(g) for g in not_counted}
        total_norm = global_grad_norm([p.grad for p in parameters if id(p.grad) not in skip], norm_type, across=across)
    if not parameters:
        return total_norm
    total = total_norm
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite: {total.item()}")
    # torch's `clip_grads_with_norm_` coefficient, applied to the local shards: scaling commutes with every placement,
    # and a foreach op on DTensors pays a sharding propagation over every tensor of the list at its first call
    # (7.8 s per first step on a 3-D CPU mesh, measured; on the shards: none).
    scale_gradients((p.grad for p in parameters), torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def global_grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0, across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """||g||_p over all ranks: each DTensor mesh reduced once, then `across` (pipeline stages,
    which hold different parameters; every rank of it must call this, with or without gradients)."""
    inf = math.isinf(norm_type)
    parts = [torch.zeros(())]
    for mesh, group in _group_by_mesh(grads).items():
        local = torch.stack([_local_power(g, norm_type, inf) for g in group])
        value = local.max() if inf else local.sum()
        if mesh is not None and mesh.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=_flat_group(mesh))
        parts.append(value)
    device = parts[-1].device if len(parts) > 1 else collective_device(across)  # no gradients here: NCCL's device
    combined = torch.stack([p.to(device) for p in parts])
    total = combined.max() if inf else combined.sum()
    if across is not None and dist.get_world_size(across) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=across)
    return total if inf else total ** (1.0 / norm_type)


# Elements per chunk: bounds the temporary |t|^p at 64 MiB (fp32).
_NORM_CHUNK = 1 << 24


def power_sum(tensor: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |t_i|^p (fp32), as exact for a flat buffer of millions of elements as for one small parameter.

    torch's CPU `vector_norm` accumulates sequentially: 5.5e-6 relative off for p=1 over 32k elements and
    9e-6 for `dot` over 8M (measured), so a bucketed optimizer (ZeRO-1/2: one long buffer) and a per-parameter
    one reported different norms for the same gradients. `sum` adds pairwise (within 6e-8 at every size
    measured): the powers are summed by it, a chunk at a time, and the chunks' sums in fp64. CUDA's norm
    kernel reduces in a tree with fp32 accumulators, as exact as that, in one kernel instead of about six."""
    if tensor.is_cuda:
        return torch.linalg.vector_norm(tensor, norm_type, dtype=torch.float32).pow(norm_type)
    total = torch.zeros((), dtype=torch.float64, device=tensor.device)
    for chunk in tensor.reshape(-1).split(_NORM_CHUNK):
        values = chunk.float()
        powered = values.square() if norm_type == 2 else values.abs().pow_(norm_type)
        total += powered.sum().double()
    return total.float()


def _group_by_mesh(items: list, key=lambda t: t) -> dict[DeviceMesh | None, list]:
    groups: dict[DeviceMesh | None, list] = {}
    for item in items:
        tensor = key(item)
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(item)
    return groups


def _local_power(grad: torch.Tensor, norm_type: float, inf: bool) -> torch.Tensor:
    """|g_local|_inf, or sum |g_local|^p divided by how many ranks hold the same values."""
    if not isinstance(grad, DTensor):
        local = grad
        replication = 1
    else:
        if any(placement.is_partial() for placement in grad.placements):
            # Unreduced partial sums: the norm of the sum is not the sum of norms.
            grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
        local = grad.to_local()
        replication = math.prod(
            grad.device_mesh.size(i) for i, placement in enumerate(grad.placements) if isinstance(placement, Replicate)
        )
    if inf:
        return torch.linalg.vector_norm(local.float(), norm_type) if local.numel() else local.new_zeros((), dtype=torch.float32)
    return power_sum(local, norm_type) / replication


@lru_cache(maxsize=None)
def _flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    if mesh.ndim == 1:
        return mesh.get_group()
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return mesh._flatten("_".join(("grad_norm", *names))).get_group()


def tensor_parallel_copies_that_differ(
    named_grads: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup, tp_dim_name: str = "tp",
    rtol: float = 1e-3, parts_over: Optional[dist.ProcessGroup] = None,
) -> list[str]:
    """The names of the gradients every tp rank holds whole (not split over tp) that differ between the ranks of
    `group`: a module the plan leaves out that runs on split activations (a scale or a norm between a column- and a
    row-parallel layer) gets each rank's part of its gradient, and its copies drift apart from the first update.
    `parts_over`: each of its ranks holds a disjoint part of every gradient (ZeRO-1/2's slices), summed over it first,
    so every rank judges the whole gradients and all decide alike.
    One all-reduce: each gradient's sum and absolute sum, with their negatives, under MAX (max - min of each);
    `rtol` leaves room for kernels that sum in another order on each rank (atomics on GPUs), not for a part."""
    names, locals_ = [], []
    for name, grad in named_grads:
        if isinstance(grad, DTensor):
            dims = grad.device_mesh.mesh_dim_names or ()
            if tp_dim_name in dims and not isinstance(grad.placements[dims.index(tp_dim_name)], Replicate):
                continue  # split over tp: each rank's slice is its own
            grad = grad.to_local()
        names.append(name)
        locals_.append(grad.detach().float())
    if not names:
        return []
    sums = torch.stack([torch.stack([g.sum(), g.abs().sum()]) for g in locals_]).to(collective_device(group))  # (n, 2)
    if parts_over is not None:
        dist.all_reduce(sums, group=parts_over)
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: len(names)], -both[len(names):]
    scale = high[:, 1:]  # the largest absolute sum: a sum that cancels to ~0 is judged against it
    differ = ((high - low).abs() > rtol * scale).any(dim=1).cpu()
    return [name for name, bad in zip(names, differ.tolist()) if bad]
