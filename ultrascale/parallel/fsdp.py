"""ZeRO-3 / HSDP with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each transformer block is one FSDP unit (one all-gather in forward, one all-gather
and one reduce-scatter in backward, overlapped with the neighbouring block's
compute); the parameters left outside the blocks (embeddings, final norm, head)
form the root unit.
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
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard `module` over `dp_mesh`: 1D mesh = FSDP (ZeRO-3), 2D (replicate, shard) = HSDP.

    `blocks` are sharded one unit each; every other parameter (embeddings, final norm, head,
    wherever they live) forms the root unit on `module`, so weights tied between them (input
    embedding and head) stay one parameter. The root's forward must be the entry point of each
    step: a LightningModule whose `training_step` calls `self.model(...)` is entered through its
    own `__call__` by the strategy (Lightning's forward redirection).

    Gradients are *summed* over the data-parallel ranks, never averaged: the strategy divides
    them once per step by the valid tokens of the global batch (`ultrascale.parallel.loss`).
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    _check_no_parameter_spans_units(module, blocks)
    shard_experts_units(experts, expert_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right at the start of backward:
        # resharding them after forward would only cost one extra all-gather.
        last = index == len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward and not last)
    # The root unit (embeddings, final norm, head) is not resharded after forward: backward
    # starts with the head, so resharding would cost an all-gather of them right away.
    fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    if experts:
        prefetch_past_host_syncs(blocks, experts)
    set_gradient_sum(module)


def prefetch_past_host_syncs(blocks: Sequence[nn.Module], experts: Sequence[nn.Module]) -> None:
    """Explicit FSDP prefetch for blocks whose forward waits on the host (torchtitan does the same under EP).

    FSDP2 issues a unit's all-gather when its forward (or backward) is reached, which overlaps with the
    previous unit's compute only while the host runs ahead of the GPU. The expert dispatch reads its
    split sizes on the host (one sync per MoE layer), so the host arrives at the next block only once
    the GPU has drained, and its all-gather would run exposed. Each block therefore starts the next
    block's all-gathers (its experts' unit too) in forward, and the previous block's in backward."""
    inside = {id(block): [unit for unit in experts if any(unit is m for m in block.modules())] for block in blocks}
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following, *inside[id(following)]])
    for block, preceding in zip(blocks[1:], blocks):
        block.set_modules_to_backward_prefetch([preceding, *inside[id(preceding)]])


def apply_fsdp_to_stages(
    stages: Sequence[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    blocks: Sequence[nn.Module],
    mp_policy: MixedPrecisionPolicy | None = None,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP under pipeline parallel: each of this rank's blocks is one unit and each pipeline stage
    module the root unit of its remaining parts (embedding, or norm and head).

    Nothing is resharded after forward: a stage runs the forwards of several micro-batches before
    their backwards, and the zero-bubble schedules compute weight gradients outside autograd's
    accumulation, on the gathered parameters (FSDP's post-backward then reduce-scatters once per
    step, called by the schedule). The memory is ZeRO-2's for parameters; the Playbook's
    ZeRO-3 + PP advice.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    shard_experts_units(experts, expert_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    for stage in stages:
        stage_blocks = [b for b in blocks if any(b is m for m in stage.modules())]
        _check_no_parameter_spans_units(stage, stage_blocks)
        for block in stage_blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
        fully_shard(stage, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
        set_gradient_sum(stage)


def shard_experts_units(
    experts: Sequence[nn.Module], mesh: DeviceMesh | None, *, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool
) -> None:
    """Expert parallel: each experts module (weights already split over ep) is its own unit on `mesh`,
    the ranks that hold the same experts, so its gradients are reduced over those ranks only."""
    if experts and mesh is None:
        raise ValueError("expert FSDP units need the expert mesh (ParallelMesh.expert_fsdp)")
    for unit in experts:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)


def set_gradient_sum(module: nn.Module) -> None:
    """Reduce-scatter (and HSDP's all-reduce) with SUM: FSDP's default divides by the dp size."""
    for fsdp_module in fsdp_modules(module):
        fsdp_module.set_gradient_divide_factor(1.0)
        # With a factor of 1 and sum-only collectives FSDP issues plain SUM reductions and no
        # division kernel (NCCL's PreMulSum would otherwise multiply by 1.0).
        fsdp_module.set_force_sum_reduction_for_comms(True)


def _check_no_parameter_spans_units(module: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """A parameter shared between a block and anything outside it would be sharded twice (and
    silently untied); FSDP can only keep a tie inside one unit."""
    owner: dict[int, str] = {}
    for index, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if id(p) in owner and owner[id(p)] != f"block {index}":
                raise ValueError(
                    f"parameter {name!r} of block {index} is shared with {owner[id(p)]}: FSDP shards each block as its "
                    "own unit and would untie it. Untie the weights or use zero_stage=1/2."
                )
            owner[id(p)] = f"block {index}"
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    block_ids = {id(m) for block in blocks for m in block.modules()}
    for path, sub in module.named_modules():
        if id(sub) in block_ids:
            continue
        for name, p in sub.named_parameters(recurse=False):
            if id(p) in in_blocks:
                qualified = f"{path}.{name}" if path else name
                raise ValueError(
                    f"parameter {qualified!r} is shared with a transformer block "
                    f"({owner[id(p)]}): FSDP shards each block as its own unit and would untie it. Untie the weights "
                    "or use zero_stage=1/2."
                )


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
