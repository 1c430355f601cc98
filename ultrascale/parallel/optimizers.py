"""Which optimizers the layouts that shard weights may step: an update that is elementwise gives the same on a
slice as the slice of the whole update; one that is not (Muon's Newton-Schulz, LAMB's trust ratio) is refused
there by name before its first step (`NOT_BUILT["optimizer_on_slices"]`)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ultrascale.parallel.rules import not_built

# Optimizers whose update of element i reads only element i of the parameter, gradient and state: stepping a slice
# equals slicing the full step. (LAMB/LARS-style trust ratios, Adafactor, Muon and L-BFGS are not.)
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
)

DECLARED_ELEMENTWISE: set[type[torch.optim.Optimizer]] = set()
"""Optimizer classes the user declared elementwise (`declare_elementwise_optimizer`), beside torch's."""


def declare_elementwise_optimizer(cls: type[torch.optim.Optimizer]) -> None:
    """Declare an optimizer class (and its subclasses) elementwise: its update of element i reads only element i of
    the parameter, gradient and state, so the layouts that step slices (ZeRO-1/2/3, HSDP, TP, EP) may run it.
    For a user's own optimizer or a library's (bitsandbytes', apex's fused Adam); the declaration is the user's."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare_elementwise_optimizer: {cls!r} is not a torch.optim.Optimizer class")
    DECLARED_ELEMENTWISE.add(cls)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping slices of the parameters equals slicing the step (`ELEMENTWISE_OPTIMIZERS`, or declared)."""
    return isinstance(optimizer, (*ELEMENTWISE_OPTIMIZERS, *DECLARED_ELEMENTWISE))


def sliced_parameters(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The parameters of `optimizer` that this rank holds a slice of: DTensors sharded over a mesh dimension of
    more than one rank (ZeRO-3 / HSDP's FSDP2, tensor parallel, expert parallel), by name (`names`: id -> name)."""
    sliced = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, DTensor) and any(
                    placement.is_shard() and param.device_mesh.size(dim) > 1
                    for dim, placement in enumerate(param.placements)):
                sliced.append(f"{names.get(id(param), '?')} {tuple(param.shape)} as {tuple(param.placements)}")
    return sliced


def check_optimizer_on_slices(optimizer: torch.optim.Optimizer, names: dict[int, str], layout: str) -> None:
    """Refuse, before its first step, an optimizer that is not elementwise over parameters this rank holds slices
    of: it would update each slice as a matrix of its own (Newton-Schulz of a slice is not of the matrix), silently
    off the one-process run. No collective: every rank holds the same kind of slices and raises alike."""
    if is_elementwise(optimizer):
        return
    sliced = sliced_parameters(optimizer, names)
    if sliced:
        raise optimizer_refusal(optimizer, layout, f"this rank holds slices of {len(sliced)} of its parameters "
                                f"(the first: {sliced[0]})")


def optimizer_refusal(optimizer: torch.optim.Optimizer, layout: str, where: str) -> Exception:
    """`NOT_BUILT["optimizer_on_slices"]` for `optimizer` under `layout`."""
    names = ", ".join(cls.__name__ for cls in (*ELEMENTWISE_OPTIMIZERS, *DECLARED_ELEMENTWISE))
    return not_built("optimizer_on_slices", (
        f"{type(optimizer).__name__} under {layout}: {where}, and its update is not elementwise, so it would step each "
        f"slice as a tensor of its own, not the whole (not built yet). Use an elementwise optimizer ({names}), or a "
        "layout that keeps the weights whole (replicated data parallel: `data_parallel_replicate=N, data_parallel_shard=1`; "
        "pipeline parallel alone); an elementwise optimizer of your own: "
        "`ultrascale.parallel.optimizers.declare_elementwise_optimizer(cls)`"))


__all__ = ["DECLARED_ELEMENTWISE", "ELEMENTWISE_OPTIMIZERS", "check_optimizer_on_slices", "declare_elementwise_optimizer",
           "is_elementwise", "optimizer_refusal", "sliced_parameters"]
