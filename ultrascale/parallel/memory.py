"""Model-state bytes measured on the live (local, sharded) tensors of one rank."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> ModelStateBytes:
    """Bytes this rank holds for parameters, gradients and optimizer state (shared tensors counted once)."""
    params = list({id(p): p for p in module.parameters()}.values())
    param_bytes = sum(local_bytes(p) for p in params)
    grad_bytes = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    optim_bytes = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                # Adam's `step` is a 0-dim counter, not model state.
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    optim_bytes += local_bytes(value)
    return ModelStateBytes(param_bytes, grad_bytes, optim_bytes)
