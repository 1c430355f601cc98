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
from typing import Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

TPPlan = Mapping[str, ParallelStyle]

# String names accepted in user plans (YAML / CLI) and in Hugging Face `base_model_tp_plan`s.
STYLE_NAMES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
}


def style_from_name(name: str) -> ParallelStyle:
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
