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

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from ultrascale.parallel.device import collectives_carry_float8
from ultrascale.parallel.tensor_styles import (
    PARAMETER_STYLE_NAMES,
    STYLE_NAME_ATTRIBUTE,
    ExpertTensorParallel,
    OwnParamsParallel,
)

TPPlan = Mapping[str, ParallelStyle]


def split_parameter_entries(module: nn.Module, plan: TPPlan, *, drop_unmatched: bool = False) -> dict[str, ParallelStyle]:
    """`plan` with its entries that name bare parameters folded into their module's entry.

    An entry `<path>.<parameter>` naming no submodule but a parameter of the modules at `<path>` gives
    that parameter's layout (by its style name, `PARAMETER_STYLE_NAMES`) to the `OwnParamsParallel`
    entry at `<path>` ('moe_tp_experts', 'local_params'). Any other entry naming no submodule is a
    ValueError (a plan written for another model must fail, not leave layers replicated), unless
    `drop_unmatched`: a model's own shipped plan also covers layer kinds a given config may not build
    (Qwen2-MoE's dense MLP entries when every layer is MoE)."""
    from fnmatch import fnmatch

    modules = dict(module.named_modules())
    owned: dict[str, dict[str, Placement]] = {}
    result: dict[str, ParallelStyle] = {}
    unmatched = []
    for path, style in plan.items():
        if any(fnmatch(name, path) for name in modules):
            result[path] = style
            continue
        owner, _, attribute = path.rpartition(".")
        holders = [m for name, m in modules.items() if fnmatch(name, owner) and attribute in m._parameters]
        if not holders:
            unmatched.append(path)
            continue
        style_name = getattr(style, STYLE_NAME_ATTRIBUTE, None)
        if style_name not in PARAMETER_STYLE_NAMES:
            raise ValueError(
                f"tensor-parallel plan entry {path!r} names a bare parameter; give its layout as one of "
                f"{sorted(PARAMETER_STYLE_NAMES)} (got {style_name or type(style).__name__})"
            )
        owned.setdefault(owner, {})[attribute] = PARAMETER_STYLE_NAMES[style_name](holders[0]._parameters[attribute].dim())
    if unmatched and not drop_unmatched:
        names = list(modules)
        raise ValueError(
            f"tensor-parallel plan entries match no submodule or parameter of {type(module).__name__}: {unmatched}. "
            f"Module paths look like: {', '.join(n for n in names[1:6])}, ..."
        )
    for owner, placements in owned.items():
        style = result.get(owner)
        if getattr(style, STYLE_NAME_ATTRIBUTE, None) == "all_reduce":
            # A module computing a partial sum with bare weights of its own (Inkling's shared experts (n, I, H)):
            # run on their local shards, inputs' gradients and the output all-reduced, as an experts module.
            style = ExpertTensorParallel(placements)
        if not isinstance(style, OwnParamsParallel):
            raise ValueError(
                f"tensor-parallel plan entries {[f'{owner}.{a}' for a in placements]} lay out bare parameters, which "
                f"ultrascale splits only under a 'moe_tp_experts', 'local_params' or 'all_reduce' entry for {owner!r} (it has "
                f"{getattr(style, STYLE_NAME_ATTRIBUTE, None) or type(style).__name__ if style is not None else 'none'})"
            )
        result[owner] = style.with_placements(placements)
    return result


def leaves_output_split(style: Optional[ParallelStyle]) -> bool:
    """A column-parallel style whose output stays split over tp as plain local tensors (the heads or features of each
    rank), not gathered: what runs after it sees this rank's slice."""
    return isinstance(style, ColwiseParallel) and tuple(style.output_layouts) == (Shard(-1),) and style.use_local_output


def per_head_parameters_left_whole(module: nn.Module, plan: TPPlan, head_counts: set[int]) -> list[str]:
    """Bare parameters with one value per head (leading dim in `head_counts`) of a module whose column-parallel layers
    split its heads, where the plan leaves them whole: each rank would run its heads with every head's values (Doge's
    dynamic-mask `A` (kv heads,) beside its split q/k/v). Those the plan splits (GPT-OSS's sinks) are not listed."""
    from fnmatch import fnmatch

    plan = split_parameter_entries(module, plan, drop_unmatched=True)

    def style_of(path: str) -> Optional[ParallelStyle]:
        return next((style for key, style in plan.items() if fnmatch(path, key)), None)

    found = []
    for name, owner in module.named_modules():
        prefix = f"{name}." if name else ""
        if not any(leaves_output_split(style_of(prefix + child)) for child, _ in owner.named_children()):
            continue
        own_style = style_of(name)
        split = set(own_style.placements) if isinstance(own_style, OwnParamsParallel) else set()
        found += [prefix + attribute for attribute, param in owner.named_parameters(recurse=False)
                  if param.dim() >= 1 and param.shape[0] in head_counts and attribute not in split]
    return found


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Shard `module`'s linears/embeddings (and bare parameters of 'moe_tp_experts' / 'local_params'
    modules) over `tp_mesh` as `plan` says.

    Every key must match at least one submodule or parameter: a plan written for another model must
    fail here, not silently leave layers replicated.
    """
    plan = float8_entries(module, lora_entries(module, split_parameter_entries(module, plan)),
                          torch.device(tp_mesh.device_type))
    tied = _tied_parameters(module)
    _replace_lora_dropouts(module, plan, tp_mesh)
    parallelize_module(module, tp_mesh, dict(plan))
    _retie(module, tied)


def _is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: `base_layer` wrapped, each adapter's `lora_A` / `lora_B` beside it (peft's LoraLayer,
    recognised by its parts so that `parallel/` needs no peft import)."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in ("base_layer", "lora_A", "lora_B"))


def lora_entries(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with each entry that lands on PEFT LoRA layers (the plan names q_proj; PEFT wrapped it)
    moved to the wrapped `base_layer`, and the adapters split to match, so that LoRA's
    ``base(x) + B(A(x)) * scaling`` keeps the base layer's layout (r: the LoRA rank):

        column-parallel base (out split):  A (r, in) whole on every rank;  B (out, r) split on out
        row-parallel base (in split):      A (r, in) split on in, its (.., r) partial sums all-reduced;
                                           B (out, r) whole

    Either way the adapters' gradients come out whole (A's input gradient is all-reduced by B's
    column split; B's by A's row split) or in their split layout. LoRA dropout is replaced by
    `TensorParallelDropout` in `apply_tp` (the same mask on every tp rank). Refused: DoRA, and other
    styles on a LoRA layer."""
    from fnmatch import fnmatch

    names = dict(module.named_modules())
    result: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        matched = [m for name, m in names.items() if fnmatch(name, path)]
        lora = [m for m in matched if _is_lora_layer(m)]
        if not lora:
            result[path] = style
            continue
        where = f"tensor parallel on the LoRA layer(s) at {path!r}"
        if len(lora) != len(matched):
            raise ValueError(f"{where}: the entry also matches layers PEFT did not wrap; name them separately")
        for layer in lora:
            if any(getattr(layer, "use_dora", {}).values()):
                raise ValueError(f"{where}: DoRA is not supported under tensor parallel")
        result[f"{path}.base_layer"] = style
        if type(style) is ColwiseParallel:
            result[f"{path}.lora_B.*"] = ColwiseParallel(
                input_layouts=Replicate(), output_layouts=style.output_layouts[0], use_local_output=style.use_local_output
            )
            if style.input_layouts[0] != Replicate():
                raise ValueError(f"{where}: its base layer's input arrives as {style.input_layouts[0]} (sequence parallel); "
                                 "LoRA's A needs the whole input: train LoRA with sequence_parallel=False")
        elif type(style) is RowwiseParallel:
            if style.output_layouts[0] != Replicate():
                raise ValueError(f"{where}: its base layer's output leaves as {style.output_layouts[0]} (sequence parallel); "
                                 "train LoRA with sequence_parallel=False")
            result[f"{path}.lora_A.*"] = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Replicate())
        else:
            raise ValueError(
                f"{where}: style {getattr(style, STYLE_NAME_ATTRIBUTE, None) or type(style).__name__} on a LoRA layer is not "
                "supported (column- and row-parallel are)"
            )
    return result


def _is_tensorwise_float8_linear(module: nn.Module) -> bool:
    """torchao's `Float8Linear` (recognised by its type, so that `parallel/` imports torchao only for a model that
    has one) whose casts scale tensorwise: the only recipe torchao's float8 TP styles cast with."""
    return (type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.float8")
            and module.config.cast_config_input.scaling_granularity.name == "TENSORWISE")


def float8_entries(module: nn.Module, plan: Mapping[str, ParallelStyle], device: torch.device) -> dict[str, ParallelStyle]:
    """`plan` for a model whose linears FP8 converted first (torchtitan's order): an entry that lands on
    `Float8Linear` layers gets torchao's float8 style with the same layouts (`ColwiseParallel` ->
    `Float8ColwiseParallel`, `RowwiseParallel` -> `Float8RowwiseParallel`), and a `PrepareModuleInput` on a module
    whose every linear is fp8 becomes `PrepareFloat8ModuleInput`, so a sequence-parallel input is cast once and
    all-gathered in fp8 (where the collectives carry float8: `device.collectives_carry_float8`; on gloo the input is
    gathered first and cast by each linear, the same fp8 values). Each cast's scale is the amax over the whole
    DTensor (one all-reduce of a scalar), so the fp8 numerics are one process's. torchao's styles cast tensorwise
    only, so rowwise layers keep torch's styles (torchtitan's choice): their gathers move the training precision,
    and each row's scale is still its amax over the whole row, reduced by DTensor across the tp shards. An entry
    matching fp8 and high-precision layers (FP8 keeps the first and last blocks) is split into one entry per
    layer."""
    from fnmatch import fnmatch

    names = dict(module.named_modules())
    if not collectives_carry_float8(device) or not any(_is_tensorwise_float8_linear(m) for m in names.values()):
        return dict(plan)
    from torch.distributed.tensor.parallel import PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def in_float8(style: ParallelStyle, target: nn.Module) -> ParallelStyle:
        if type(style) is ColwiseParallel and _is_tensorwise_float8_linear(target):
            return Float8ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                         use_local_output=style.use_local_output)
        if type(style) is RowwiseParallel and _is_tensorwise_float8_linear(target):
            return Float8RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                         use_local_output=style.use_local_output)
        linears = [m for m in target.children() if isinstance(m, nn.Linear)]
        if type(style) is PrepareModuleInput and linears and all(map(_is_tensorwise_float8_linear, linears)):
            return PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                use_local_output=style.use_local_output)
        return style

    result: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        matched = {name: m for name, m in names.items() if fnmatch(name, path)}
        styles = {name: in_float8(style, m) for name, m in matched.items()}
        if all(s is style for s in styles.values()):
            result[path] = style
        elif len({type(s) for s in styles.values()}) == 1:
            result[path] = next(iter(styles.values()))
        else:
            result.update(styles)
    return result


class TensorParallelDropout(nn.Module):
    """LoRA's dropout on a tensor-parallel layer's input, the same mask on every tp rank.

    A column-parallel base layer's input is whole on every tp rank; a row-parallel one's is this
    rank's slice of the last dim. Either way the mask is drawn whole, (..., in_features), from the
    default generator, exactly as `nn.Dropout` draws it on CPU (bernoulli(1 - p), divided by 1 - p),
    and a row-parallel rank keeps its slice: one global mask. The tp ranks' default generators must
    agree (`synchronize_dropout_rng`, once per step); activation checkpointing restores that
    generator for its recomputation, so the recomputed mask is the same."""

    def __init__(self, p: float, in_features: int, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.p, self.in_features, self.tp_mesh = p, in_features, tp_mesh

    def full_mask(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - self.p).div_(1 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if isinstance(x, DTensor):
            raise ValueError("TensorParallelDropout takes the layer's local input; LoRA under tensor parallel runs "
                             "with sequence_parallel=False")
        mask = self.full_mask((*x.shape[:-1], self.in_features), x.dtype, x.device)
        features = x.shape[-1]
        if features != self.in_features:  # a row-parallel base: this rank's columns of the one mask
            mask = mask.narrow(-1, self.tp_mesh.get_local_rank() * features, features)
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}, in_features={self.in_features}"


def _replace_lora_dropouts(module: nn.Module, plan: Mapping[str, ParallelStyle], tp_mesh: DeviceMesh) -> None:
    """Each LoRA layer whose base layer the plan splits gets `TensorParallelDropout` for its dropouts."""
    from fnmatch import fnmatch

    bases = [path[: -len(".base_layer")] for path in plan if path.endswith(".base_layer")]
    for name, layer in module.named_modules():
        if not _is_lora_layer(layer) or not any(fnmatch(name, base) for base in bases):
            continue
        dropouts = getattr(layer, "lora_dropout", None)
        for adapter, dropout in list(getattr(dropouts, "items", dict)()):
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                dropouts[adapter] = TensorParallelDropout(dropout.p, layer.base_layer.in_features, tp_mesh)


def has_tensor_parallel_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, TensorParallelDropout) for m in module.modules())


@torch.no_grad()
def synchronize_dropout_rng(module: nn.Module, device: torch.device) -> None:
    """Give every tp rank tp rank 0's default random state (CPU, and the device's), so that each
    `TensorParallelDropout` of `module` draws one mask on all of them. tp rank 0 keeps its own stream, so
    a run at tp=2 draws the masks one process with the same seed would. One broadcast of a few KiB."""
    layer = next((m for m in module.modules() if isinstance(m, TensorParallelDropout)), None)
    if layer is None or layer.tp_mesh.size() == 1:
        return
    group = layer.tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    cpu = torch.get_rng_state().to(device)
    dist.broadcast(cpu, src=source, group=group)
    torch.set_rng_state(cpu.cpu())
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device).to(device)
        dist.broadcast(state, src=source, group=group)
        torch.cuda.set_rng_state(state.cpu(), device)


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
