"""Tensor parallel (Megatron-LM column/row splits) and sequence parallel on DTensor.

A TP plan is a literal dict `{module path (fnmatch wildcards allowed): ParallelStyle}`
applied with `torch.distributed.tensor.parallel.parallelize_module`. Per block
(Shoeybi et al. 2019; Korthikanti et al. 2022 for SP):

    x (B, T/tp, D) seq-sharded          <- SP region: norms see a 1/tp slice of the sequence
      norm                              SequenceParallel
      all-gather on T -> (B, T, D)      PrepareModuleInput(Shard(1) -> Replicate)   ("g" of Megatron-SP)
      q/k/v, gate/up: column-parallel   ColwiseParallel: (B, T, D) -> (B, T, H/tp * hd)
      o, down: row-parallel             RowwiseParallel: partial sums -> reduce-scatter on T  ("g-bar")
    x (B, T/tp, D)

Without SP the all-gather/reduce-scatter pair becomes one all-reduce after the row-parallel
linear; with SP the communicated volume is the same but activations between blocks are 1/tp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

TPPlan = Mapping[str, ParallelStyle]


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module whose parameters every TP rank holds whole but runs on this rank's shard of the
    activations, along a dim it does not reduce over: Qwen3/Gemma3's per-head `q_norm`/`k_norm`
    (weight (head_dim,)) between the column-parallel q/k projections and the row-parallel o_proj
    see (B, T, n_heads // tp, head_dim). Forward needs no collective; backward does: each rank's
    weight gradient covers only its heads, and the true gradient is their sum over tp.

    The parameters become Replicate DTensors on the tp mesh (so FSDP over dp composes, as for
    sequence-parallel norms); the module runs on a local view of each whose gradient is declared
    Partial, and a same-placement `redistribute` in front turns that Partial gradient into a
    Replicate one in autograd: one all-reduce per parameter per backward, and `.grad` already
    has the parameter's layout. FSDP2 would redistribute a Partial gradient itself; summing here
    keeps the style right without FSDP too (tests/test_tensor_parallel_styles.py), and FSDP then
    finds the layout it expects and adds no second tp reduction.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                # Every rank holds the same values already (broadcast, or loaded after a meta build).
                replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(_swap_in_local_params)
        module.register_forward_hook(_swap_back_params, always_call=True)
        return module


_SWAPPED = "_ultrascale_tp_swapped_params"


def _swap_in_local_params(module: nn.Module, args: object) -> None:
    # Read the parameters at call time: under FSDP they are its unsharded (tp-only) DTensors.
    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    setattr(module, _SWAPPED, originals)
    for name, param in originals.items():
        local = param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim).to_local(
            grad_placements=[Partial()] * param.device_mesh.ndim
        )
        module._parameters[name] = local  # a plain view for the forward only (restored below)


def _swap_back_params(module: nn.Module, args: object, output: object) -> None:
    module._parameters.update(getattr(module, _SWAPPED, {}))
    setattr(module, _SWAPPED, {})


class KeepReplicated(ParallelStyle):
    """Leave the module as it is: every rank holds and computes it whole on replicated inputs, so its
    gradients are identical on every tp rank already (transformers' 'replicate')."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class _AllReduceBackward(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) of the gradient over tp in backward: `f` of Megatron-LM
    (Shoeybi et al. 2019), for an activation that feeds per-rank (sharded) consumers only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MlaKvAProjParallel(ParallelStyle):
    """DeepSeek-V2-style MLA `kv_a_proj_with_mqa` (replicated): its output (..., kv_lora_rank + rope_dim)
    splits into a latent part that feeds the column-parallel `kv_b_proj` (whose input gradient is
    all-reduced over tp by that style) and a RoPE key part shared by every head, which reaches this
    rank's heads only: its gradient is partial per rank and is all-reduced here, so the
    projection's weight gradient is whole and identical on every tp rank."""

    def __init__(self, rope_dim: Optional[int] = None) -> None:
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim
        if rope_dim is None:
            rope_dim = getattr(getattr(module, "config", None), "qk_rope_head_dim", None)
        if rope_dim is None:
            raise ValueError(
                "tensor-parallel style 'mla_kv_a_proj' needs the RoPE key width: pass "
                "`MlaKvAProjParallel(rope_dim=config.qk_rope_head_dim)` in `tp_plan=`"
            )
        group = device_mesh.get_group()

        def split_rope_grad(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
            latent, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([latent, _AllReduceBackward.apply(rope, group)], dim=-1)

        module.register_forward_hook(split_rope_grad)
        return module


# String names accepted in user plans (YAML / CLI) and in Hugging Face `base_model_tp_plan`s: every
# dense style of `transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES`, with the same maths
# (the layouts are torch's: 'sequence_parallel' is torch's SequenceParallel, whose output stays a DTensor).
STYLE_NAMES: dict[str, Callable[[], ParallelStyle]] = {
    # Linear, weight (out, in) split on out: replicated input, output sharded on the last dim.
    "colwise": ColwiseParallel,
    # Linear, weight split on in: input sharded on the last dim, partial outputs all-reduced.
    "rowwise": RowwiseParallel,
    # Column-parallel, output all-gathered: whole activations after it (Phi3's fused qkv/gate_up,
    # OLMo2's q/k/v, whose q_norm/k_norm normalise over all heads and so must see them all).
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    # Row-parallel on a replicated input (after a gathered column-parallel layer): each rank takes
    # its slice of the input locally (no communication), then the partial outputs are all-reduced.
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Vocab-parallel embedding: rows split, partial lookups all-reduced.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Embedding with the hidden dim split, slices all-gathered.
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce,
    # A module whose output is a partial sum over tp ranks: all-reduce it (identity backward).
    "all_reduce": lambda: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
    "replicate": KeepReplicated,
    "mla_kv_a_proj": MlaKvAProjParallel,
}

REFUSED_STYLE_NAMES: dict[str, str] = {
    name: "it splits the fused experts of a Mixture-of-Experts layer, and ultrascale does not implement tensor "
    "parallel of experts: split them with `expert_parallel=` instead"
    for name in ("packed_colwise", "packed_rowwise", "moe_tp_experts", "moe_identity_expert")
}
for name in ("grouped_gemm", "ep_dispatch_experts"):  # styles of transformers' `base_model_ep_plan`s
    REFUSED_STYLE_NAMES[name] = (
        "it belongs to transformers' expert-parallel plan; ultrascale splits experts with `expert_parallel=` "
        "and its own token dispatch"
    )
REFUSED_STYLE_NAMES["local_params"] = (
    "it runs a module on shards of its own bare parameters (attention sinks), which ultrascale does not implement"
)
"""transformers style names that ultrascale knows but does not run, and why (named in the error)."""


def style_from_name(name: str) -> ParallelStyle:
    if name in REFUSED_STYLE_NAMES:
        raise ValueError(f"tensor-parallel style {name!r} is not supported: {REFUSED_STYLE_NAMES[name]}")
    try:
        return STYLE_NAMES[name]()
    except KeyError:
        raise ValueError(f"unknown tensor-parallel style {name!r}; known: {', '.join(STYLE_NAMES)}") from None


def resolve_plan(plan: Mapping[str, Union[str, ParallelStyle]]) -> dict[str, ParallelStyle]:
    """Accept ParallelStyle objects or their string names (for YAML configs)."""
    return {path: style_from_name(style) if isinstance(style, str) else style for path, style in plan.items()}


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Shard `module`'s linears/embeddings over `tp_mesh` as `plan` says.

    Every key must match at least one submodule: a plan written for another model must
    fail here, not silently leave layers replicated.
    """
    names = [name for name, _ in module.named_modules()]
    from fnmatch import fnmatch

    unmatched = [path for path in plan if not any(fnmatch(name, path) for name in names)]
    if unmatched:
        raise ValueError(
            f"tensor-parallel plan entries match no submodule of {type(module).__name__}: {unmatched}. "
            f"Module paths look like: {', '.join(n for n in names[1:6])}, ..."
        )
    tied = _tied_parameters(module)
    parallelize_module(module, tp_mesh, dict(plan))
    _retie(module, tied)


def _tied_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module path, attribute) that share one Parameter (tied input/output embeddings)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for attribute, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((path, attribute))
    return [sorted(set(group)) for group in owners.values() if len(set(group)) > 1]


def _retie(module: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """`parallelize_module` gives each module its own new DTensor Parameter, which unties shared
    weights. Share the first owner's again, provided every owner wants the same layout
    (a vocab-parallel embedding and a column-parallel head both shard the (V, D) matrix on dim 0)."""
    for group in tied:
        params = [getattr(module.get_submodule(path), attribute) for path, attribute in group]
        layouts = {tuple(p.placements) if isinstance(p, DTensor) else None for p in params}
        if len(layouts) != 1:
            names = [f"{path}.{attribute}" for path, attribute in group]
            raise ValueError(
                f"tied parameters {names} get different tensor-parallel layouts {sorted(map(str, layouts))}; "
                "a tied weight needs one layout (e.g. vocab-parallel embedding + column-parallel head)"
            )
        for path, attribute in group[1:]:
            setattr(module.get_submodule(path), attribute, params[0])


@contextmanager
def maybe_loss_parallel(enabled: bool) -> Iterator[None]:
    """`loss_parallel()` makes cross-entropy work on vocab-sharded logits (Shard(-1)) without
    gathering them: each rank computes its partial log-sum-exp and the target logit it owns,
    and one all-reduce of (B*T)-sized tensors combines them. Must wrap forward *and* backward.
    """
    with loss_parallel() if enabled else nullcontext():
        yield


def check_tp_divides(tp: int, sizes: Mapping[str, int], model_name: str) -> None:
    """ValueError naming every size that `tp` does not divide and the degrees that would fit."""
    bad = {name: size for name, size in sizes.items() if size % tp != 0}
    if bad:
        common = math.gcd(*sizes.values())
        fits = [d for d in range(1, common + 1) if common % d == 0]
        details = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ValueError(
            f"`tensor_parallel={tp}` must divide {details} of {model_name} (whole heads / rows per rank). "
            f"Tensor-parallel degrees that fit: {fits}"
        )
