"""The tensor-parallel styles: torch's (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, ...) by the names
a plan may use (`STYLE_NAMES`, transformers' plan vocabulary), and ultrascale's own for what torch's do not cover:
parameters kept replicated with an all-reduced gradient, fused expert weights split over tp (`ExpertTensorParallel`),
multi-head latent attention's shared projection, a packed [gate; up] split. `ultrascale.parallel.tensor` applies
a plan made of them."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

# torch's (private) name for a shard of interleaved blocks; transformers lays out packed weights with it too.
from torch.distributed.tensor.placement_types import _StridedShard


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


def _swap_in_params(module: nn.Module, local_view: Callable[[DTensor], torch.Tensor]) -> None:
    # Read the parameters at call time: under FSDP they are its unsharded (tp-only) DTensors.
    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    setattr(module, _SWAPPED, originals)
    for name, param in originals.items():
        module._parameters[name] = local_view(param)  # a plain view for the forward only (restored below)


def _swap_in_local_params(module: nn.Module, args: object) -> None:
    # The whole parameter; its gradient from this rank's activations is one tp rank's part (Partial).
    _swap_in_params(module, lambda param: param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
                    .to_local(grad_placements=[Partial()] * param.device_mesh.ndim))


def _swap_back_params(module: nn.Module, args: object, output: object) -> None:
    module._parameters.update(getattr(module, _SWAPPED, {}))
    setattr(module, _SWAPPED, {})


class KeepReplicated(ParallelStyle):
    """Leave the module as it is: every rank holds and computes it whole on replicated inputs, so its
    gradients are identical on every tp rank already (transformers' 'replicate')."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class HiddenStatesLayout(ParallelStyle):
    """Redistribute a module's `hidden_states` input (its first positional argument or that keyword, as Hugging Face
    decoders pass it) over tp from `source` to `target` and hand the module the local tensor: Shard(1) -> Replicate
    all-gathers the sequence into a tensor-parallel branch (attention, MLP) under sequence parallel, Replicate ->
    Shard(1) takes this rank's slice of a replicated stream (the first layer's input). Backward is the opposite
    (DTensor's): the branch's input gradient, whole on every rank once its column-parallel layers reduced it, is cut
    to this rank's slice; the slices' gradients are gathered."""

    def __init__(self, source: Placement, target: Placement, output: Optional[tuple[Placement, Placement]] = None) -> None:
        super().__init__()
        self.source, self.target = source, target
        self.output = output
        """(from, to) of the module's output, e.g. (Replicate, Shard(1)): a Mixture-of-Experts block, whose output
        is whole on every rank, hands the stream this rank's slice; None: left as the module returns it."""

    def _redistribute(self, x: torch.Tensor, mesh: DeviceMesh, source: Optional[Placement] = None,
                      target: Optional[Placement] = None) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (source or self.source,), run_check=False)
        return x.redistribute(mesh, (target or self.target,)).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._redistribute(args[0], device_mesh), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise TypeError(f"{type(_module).__name__} got no hidden states to lay out for sequence parallel "
                                "(neither a positional argument nor `hidden_states=`)")
            return args, {**kwargs, "hidden_states": self._redistribute(kwargs["hidden_states"], device_mesh)}

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if self.output is not None:
            source, target = self.output

            def post_hook(_module: nn.Module, args: tuple, output: Any) -> Any:
                if isinstance(output, tuple):  # (hidden states, router logits, ...): the first is the stream's
                    return (self._redistribute(output[0], device_mesh, source, target), *output[1:])
                return self._redistribute(output, device_mesh, source, target)

            module.register_forward_hook(post_hook)
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


def grad_summed_over(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x`, whose gradient is all-reduced (summed) over `group` in backward (`_AllReduceBackward`)."""
    return _AllReduceBackward.apply(x, group)


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


class _AllReduceForward(torch.autograd.Function):
    """All-reduce (sum) over tp in forward, identity in backward: `g` of Megatron-LM, for partial sums
    whose every consumer is replicated."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def packed_shard(dim: int) -> Placement:
    """The layout of a fused [gate; up] weight split over tp on `dim` (of size 2I): rank r holds
    ``[gate[r I/tp : (r+1) I/tp]; up[r I/tp : (r+1) I/tp]]``, so its gate and up rows pair up
    locally for SwiGLU (a plain ``Shard(dim)`` would give one rank all of gate, the other all of up)."""
    return _StridedShard(dim, split_factor=2)


EXPERT_WEIGHT_PLACEMENTS: dict[str, Placement] = {"gate_up_proj": packed_shard(1), "down_proj": Shard(2)}
"""Fused SwiGLU experts as transformers 5 and the built-in MoE store them: ``gate_up_proj`` (E, 2I, H)
split on its packed 2I rows, ``down_proj`` (E, H, I) on I (Megatron's expert tensor parallel)."""


class OwnParamsParallel(ParallelStyle):
    """A module that computes with bare parameters of its own (no Linear to hook), split over tp as
    `placements` says: they become DTensors (global shapes, stable names), and the module's forward
    runs on their local shards, whose gradients keep the parameter's layout. transformers'
    'local_params' (e.g. per-head attention sinks (n_heads,) beside column-parallel q/k/v: the local
    heads and the local sinks line up). The placements come from the plan's entries that name the
    parameters (`apply_tp`)."""

    def __init__(self, placements: Optional[Mapping[str, Placement]] = None) -> None:
        self.placements = dict(placements or {})

    def with_placements(self, placements: Mapping[str, Placement]) -> "OwnParamsParallel":
        styled = copy.copy(self)
        styled.placements = {**self.placements, **placements}
        return styled

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = dict(module.named_parameters(recurse=False))
        what = f"{type(self).__name__} on {type(module).__name__}"
        if not self.placements:
            raise ValueError(f"{what}: the plan names none of its parameters ({sorted(own)}) with a layout")
        for name, placement in self.placements.items():
            param = own.get(name)
            if param is None:
                raise ValueError(f"{what}: it has no parameter {name!r} (it has {sorted(own)})")
            if not isinstance(placement, (Shard, _StridedShard)):
                # A replicated parameter seen by 1/tp of the computation would need its gradient summed.
                raise ValueError(f"{what}: {name} gets {placement}; only split (Shard) layouts are supported here")
            if isinstance(param, DTensor):
                raise ValueError(f"{what}: {name} is split already ({param.placements})")
            check_split(f"{type(module).__name__}.{name}", tuple(param.shape), placement, device_mesh.size())
            # Every rank holds the same weights here (broadcast, or a meta build): each keeps its part, no communication.
            sharded = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(_swap_in_own_shards)
        module.register_forward_hook(_swap_back_params, always_call=True)
        return module


class ExpertTensorParallel(OwnParamsParallel):
    """Tensor parallel inside an experts module: every tp rank runs every expert on every token it
    routes, with 1/tp of each expert's intermediate width (transformers' 'moe_tp_experts' with the
    'packed_colwise' / 'rowwise' weights of its plans; Megatron's expert tensor parallel). Routing is
    replicated over tp (the router sees the same tokens and weights on every tp rank), so no token
    moves; per layer

        forward:  y_r = sum_k w_k down_r(silu(gate_r x) * up_r x)     partial over the tp ranks
                  y = all-reduce(y_r)
        backward: dL/dx and dL/dw_k are partial per rank: all-reduced at the module's input

    Every parameter of the module needs a split layout (default: `EXPERT_WEIGHT_PLACEMENTS`): a
    replicated one (an expert bias) inside the partial sums would count tp times. The module's forward
    runs unchanged on local shards, whichever experts implementation it dispatches to.
    """

    def __init__(self, placements: Optional[Mapping[str, Placement]] = None) -> None:
        super().__init__(placements or EXPERT_WEIGHT_PLACEMENTS)

    def with_placements(self, placements: Mapping[str, Placement]) -> "OwnParamsParallel":
        styled = copy.copy(self)
        styled.placements = dict(placements)  # the plan's entries replace the default layout
        return styled

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        unplaced = sorted(set(dict(module.named_parameters(recurse=False))) - set(self.placements))
        if unplaced:
            raise ValueError(
                f"expert tensor parallel on {type(module).__name__}: its parameters {unplaced} have no tensor-parallel "
                f"layout (only {sorted(self.placements)} do); a replicated weight inside the experts' partial sums would "
                "count tp times. Give each a split layout, or train this model without tensor parallel."
            )
        if getattr(module, "is_concatenated", True) is False and any(
            isinstance(p, _StridedShard) for p in self.placements.values()
        ):
            raise ValueError(
                f"expert tensor parallel on {type(module).__name__}: its gate and up rows are interleaved "
                "(is_concatenated=False), so a packed [gate; up] split would pair the wrong rows"
            )
        packed_dim = 2 if getattr(module, "is_transposed", False) else 1  # the 2I dim of gate_up_proj
        placement = self.placements.get("gate_up_proj")
        if (getattr(module, "is_concatenated", True) and getattr(module, "has_gate", True)
                and type(placement) is Shard and placement.dim % 3 == packed_dim):
            # A plain split of a concatenated [gate; up] would give one rank gate rows whose up rows live on
            # another (Inkling's shipped plan says 'colwise' here): split it packed, and say so.
            warnings.warn(
                f"{type(module).__name__}.gate_up_proj holds [gate; up] concatenated, and the plan splits it plainly "
                f"({placement}), which would pair each rank's gate rows with another rank's up rows; ultrascale "
                "splits it packed ('packed_colwise') instead",
                stacklevel=2,
            )
            self.placements["gate_up_proj"] = packed_shard(packed_dim)
        group = device_mesh.get_group()
        module.register_forward_pre_hook(lambda mod, args, kwargs: _expert_inputs(args, kwargs, group), with_kwargs=True)
        super()._apply(module, device_mesh)  # its hook swaps the local shards in after the one above
        module.register_forward_hook(lambda mod, args, output: _AllReduceForward.apply(output, group))
        return module


def check_split(name: str, shape: tuple[int, ...], placement: Placement, tp: int) -> None:
    """ValueError (before any collective) if `tp` does not split `shape` as `placement` says."""
    if not isinstance(placement, (Shard, _StridedShard)):
        return
    dim = placement.dim % len(shape)
    factor = placement.split_factor if isinstance(placement, _StridedShard) else 1
    if shape[dim] % (tp * factor):
        width = shape[dim] // factor
        raise ValueError(
            f"`tensor_parallel={tp}` must divide {width}, the width {name} (shape {shape}) splits on dim {dim}"
            f"{' per packed half' if factor > 1 else ''}; degrees that fit: {[d for d in range(1, width + 1) if width % d == 0]}"
        )


def _swap_in_own_shards(module: nn.Module, args: object) -> None:
    # This rank's shard; its gradient keeps the parameter's layout (to_local's default).
    _swap_in_params(module, lambda param: param.to_local())


def _expert_inputs(args: tuple, kwargs: dict, group: dist.ProcessGroup) -> tuple[tuple, dict]:
    # The module's output is a sum over the tp ranks of local contributions, so the gradient of each of
    # its differentiable inputs (the tokens, the routing weights, Inkling's shared-expert gammas) is that
    # sum's too: all-reduced in backward. Integer inputs (the chosen experts) carry no gradient.
    def wrap(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
            return _AllReduceBackward.apply(value, group)
        return value

    return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}


class ScaledIdentityParallel(ParallelStyle):
    """An identity ('zero') expert inside a tensor-parallel experts module (LongCat-Flash): every tp rank
    adds the same ``w x`` to the partial sums that the module all-reduces, which would count it tp times,
    so its input is divided by tp first (transformers' 'moe_identity_expert'). Its input gradient, 1/tp
    per rank, is summed back to whole by the module's input all-reduce."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        module.register_forward_pre_hook(lambda mod, args: (args[0] / tp, *args[1:]))
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
    "moe_identity_expert": ScaledIdentityParallel,
}

# Mixture-of-Experts: the experts module computes with its fused weights (no Linear to hook).
STYLE_NAMES["moe_tp_experts"] = ExpertTensorParallel
# A module computing with bare parameters of its own (attention sinks): its local shards in forward.
STYLE_NAMES["local_params"] = OwnParamsParallel

PARAMETER_STYLE_NAMES: dict[str, Callable[[int], Placement]] = {
    # Entries naming a bare parameter (`<module path>.<parameter>`), e.g. an experts module's fused
    # weights or attention sinks: its tp layout, by its number of dims, as transformers shards them.
    # Their module needs an owning entry ('moe_tp_experts' / 'local_params') in the same plan.
    "colwise": lambda ndim: Shard((ndim - 2) % ndim),  # the output-features dim: (E, out, in) -> 1, (n_heads,) -> 0
    "rowwise": lambda ndim: Shard(ndim - 1),  # the input-features dim
    "packed_colwise": lambda ndim: packed_shard(ndim - 2),  # fused [gate; up] output rows
    "packed_rowwise": lambda ndim: packed_shard(ndim - 1),  # fused [gate, up] columns (Llama4's (E, H, 2I))
}
_PARAMETER_ONLY = {"packed_colwise", "packed_rowwise"}

REFUSED_STYLE_NAMES: dict[str, str] = {}
for name in ("grouped_gemm", "ep_dispatch_experts"):  # styles of transformers' `base_model_ep_plan`s
    REFUSED_STYLE_NAMES[name] = (
        "it belongs to transformers' expert-parallel plan; ultrascale splits experts with `expert_parallel=` "
        "and its own token dispatch"
    )
"""transformers style names that ultrascale knows but does not run, and why (named in the error)."""

STYLE_NAME_ATTRIBUTE = "_ultrascale_style_name"
"""Set on a style made from a name: an entry naming a bare parameter reads its layout from the name."""


class ParameterOnlyStyle(ParallelStyle):
    """A style name that only lays out a bare parameter ('packed_colwise', 'packed_rowwise')."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise ValueError(
            f"tensor-parallel style {self.name!r} lays out a fused weight parameter (`<experts path>.gate_up_proj`), "
            f"not a module ({type(module).__name__}); its module needs a 'moe_tp_experts' entry"
        )


def style_from_name(name: str) -> ParallelStyle:
    if name in REFUSED_STYLE_NAMES:
        raise ValueError(f"tensor-parallel style {name!r} is not supported: {REFUSED_STYLE_NAMES[name]}")
    if name in _PARAMETER_ONLY:
        style: ParallelStyle = ParameterOnlyStyle(name)
    elif name in STYLE_NAMES:
        style = STYLE_NAMES[name]()
    else:
        known = sorted({*STYLE_NAMES, *_PARAMETER_ONLY})
        raise ValueError(f"unknown tensor-parallel style {name!r}; known: {', '.join(known)}")
    setattr(style, STYLE_NAME_ATTRIBUTE, name)
    return style


def resolve_plan(plan: Mapping[str, Union[str, ParallelStyle]]) -> dict[str, ParallelStyle]:
    """Accept ParallelStyle objects or their string names (for YAML configs)."""
    return {path: style_from_name(style) if isinstance(style, str) else style for path, style in plan.items()}
