"""Making every rank start from the same weights, and materialising meta-device models."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def broadcast_module_state(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy parameters and buffers of global rank `src` to all ranks.

    FSDP2 (unlike FSDP1's `sync_module_states`) slices whatever each rank holds, so
    ranks that initialised with different RNG states would silently train different
    replicas under HSDP. One broadcast per tensor before sharding rules that out.
    """
    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen or tensor.is_meta:
            continue
        seen.add(id(tensor))
        dist.broadcast(tensor.data, src=src, group=group)


@torch.no_grad()
def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Allocate meta parameters (possibly sharded DTensors) on `device` and initialise them.

    Initialisation is delegated to the model: the outermost submodules defining
    `init_weights()` (e.g. `Llama`) initialise their subtree; any other module with
    `reset_parameters()` resets its own parameters.

    Only modules holding meta tensors are re-allocated: `module.to_empty` would also hand uninitialised memory
    to tensors that hold values already, a LightningModule's torchmetrics states among them (a `MeanMetric`
    for `val_loss` then starts from garbage). `to_empty` gives each module a Parameter of its own, so a weight
    two modules share (tied embeddings) is shared again afterwards, before any initialisation.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((sub, name))
    for sub in module.modules():
        if any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))):
            sub.to_empty(device=device, recurse=False)
    for shared in (places for places in owners.values() if len(places) > 1):
        first, name = shared[0]
        for sub, attribute in shared[1:]:
            setattr(sub, attribute, getattr(first, name))
    covered: set[int] = set()
    for sub in module.modules():
        if id(sub) in covered:
            continue
        if callable(getattr(sub, "init_weights", None)):
            sub.init_weights()
            covered.update(id(m) for m in sub.modules())
        elif callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()
