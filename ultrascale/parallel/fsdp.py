"""ZeRO-3 / HSDP with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each transformer block is one FSDP unit (one all-gather in forward, one all-gather
and one reduce-scatter in backward, overlapped with the neighbouring block's
compute); the parameters left outside the blocks (embeddings, final norm, head)
form the root unit(s).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: Sequence[nn.Module],
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    module_forward_is_called: bool = True,
) -> None:
    """Shard `module` over `dp_mesh`: 1D mesh = FSDP (ZeRO-3), 2D (replicate, shard) = HSDP.

    `blocks` are sharded one unit each. If `module_forward_is_called` is False (a
    LightningModule whose `training_step` calls `self.model(...)` rather than
    `self(...)`), FSDP's pre-forward all-gather would never fire on it, so each child
    that still owns unsharded parameters becomes its own root unit instead.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right at the start of backward:
        # resharding them after forward would only cost one extra all-gather.
        last = index == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward and not last)
    # The root units (embeddings, final norm, head) are not resharded after forward: backward
    # starts with the head, so resharding would cost an all-gather of them right away.
    if module_forward_is_called:
        fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
        return
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters directly ({', '.join(own)}), but its forward is not the entry "
            "point of training, so FSDP cannot gather them. Move them into a submodule (e.g. `self.model`)."
        )
    for child in module.children():
        if _has_unmanaged_parameters(child):
            fully_shard(child, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)


def fsdp_modules(module: nn.Module) -> Iterator[FSDPModule]:
    return (m for m in module.modules() if isinstance(m, FSDPModule))


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn FSDP's reduce-scatter after backward on or off (off on non-final micro-batches of accumulation)."""
    for fsdp_module in fsdp_modules(module):
        fsdp_module.set_requires_gradient_sync(enabled, recurse=False)


def reshard(module: nn.Module) -> None:
    """Free gathered parameters. Units that skip resharding after forward (the root, the last
    block) stay gathered after a no-grad forward (validation), since no backward reshards them."""
    for fsdp_module in fsdp_modules(module):
        fsdp_module.reshard()


def is_fsdp_sharded(module: nn.Module) -> bool:
    return any(True for _ in fsdp_modules(module))


def _has_unmanaged_parameters(module: nn.Module) -> bool:
    """Parameters not yet owned by an FSDP unit (TP's DTensors count as unmanaged: FSDP must still shard them)."""
    managed = {id(p) for unit in fsdp_modules(module) for p in unit.parameters()}
    return any(id(p) not in managed for p in module.parameters())
