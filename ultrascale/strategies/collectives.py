"""The strategy's `barrier` / `broadcast` / `reduce`: Lightning's semantics on torch.distributed, with gloo
and NCCL alike. Each is a no-op (returns its input) before the process group exists."""

from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

T = TypeVar("T")


def barrier(device: torch.device) -> None:
    """All ranks meet; NCCL's barrier is told this rank's device."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """`src`'s `obj` (any picklable object) on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce(tensor: Union[torch.Tensor, Any], group: Optional[Any] = None,
           reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> torch.Tensor:
    """In place over `group` (default: all ranks), as Lightning's strategies do; "mean"/"avg" is a sum
    divided by the group size (gloo has no AVG)."""
    if isinstance(tensor, DTensor):  # e.g. a loss computed under loss parallel
        tensor = tensor.full_tensor()
    if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
        return tensor
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if reduce_op is None or mean:
        op = dist.ReduceOp.SUM
    else:
        op = getattr(dist.ReduceOp, reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
