"""Model-state bytes measured on the live (local, sharded) tensors of one rank."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (),
                      engines: Sequence[Any] = ()) -> ModelStateBytes:
    """Bytes of memory this rank holds for parameters, gradients and optimizer state.

    Counted per storage, so views into one flat buffer (ZeRO-1/2 buckets, FSDP shards)
    count once, padding included, and a tensor already counted in an earlier category
    (a ZeRO master slice that is a view of the weights) is not counted again.
    Optimizer state includes optimizer parameters that are not model parameters (fp32
    master weights) and ZeRO-2's reduced gradient slices (of the optimizers' `ZeroEngine`s, `engines`) count as
    gradients.
    """
    from ultrascale.parallel.zero import engine_for

    optimizers = list(optimizers)
    seen: set[int] = set()
    module_params = list({id(p): p for p in module.parameters()}.values())
    module_ids = {id(p) for p in module_params}
    optimizer_params = [p for o in optimizers for g in o.param_groups for p in g["params"] if id(p) not in module_ids]
    params = _storage_bytes(module_params, seen)
    grads = [p.grad for p in (*module_params, *optimizer_params) if p.grad is not None]
    for optimizer in optimizers:
        engine = engine_for(optimizer, engines)
        if engine is not None:
            grads.extend(engine.grad_shards())
    grad_bytes = _storage_bytes(grads, seen)
    # Adam's `step` is a 0-dim counter, not model state.
    states = [v for o in optimizers for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    optim_bytes = _storage_bytes([*optimizer_params, *states], seen)
    return ModelStateBytes(params, grad_bytes, optim_bytes)


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
