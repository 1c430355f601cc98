"""Where a model keeps its transformer blocks (and, as later parallelisms land, its TP/PP plans).

Model knowledge lives here only. A `ModelAdapter` is found for a module by
`get_adapter`: the built-in Llama and Hugging Face `*PreTrainedModel`s have named
adapters; any other `nn.Module` gets the generic one, which is enough for
ZeRO/HSDP (it only needs the repeated blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class ModelAdapter:
    """What the parallelisms need to know about one model."""

    name: str
    """Architecture name used in error messages ('generic' for unknown models)."""
    blocks: tuple[nn.Module, ...]
    """The repeated transformer blocks: one FSDP unit / checkpoint region / pipeline unit each."""
    block_path: str
    """Dotted path of the ModuleList holding the blocks (e.g. 'model.layers'); '' if none was found."""


def find_block_list(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of same-class children holding the most parameters, i.e. the transformer blocks."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) == 0:
            continue
        if len({type(child) for child in sub}) != 1:
            continue
        numel = sum(p.numel() for p in sub.parameters())
        if numel > 0 and (best is None or numel > best[0]):
            best = (numel, path, sub)
    return None if best is None else (best[1], best[2])


def get_adapter(module: nn.Module) -> ModelAdapter:
    found = find_block_list(module)
    name = _architecture_name(module)
    if found is None:
        return ModelAdapter(name=name, blocks=(), block_path="")
    path, blocks = found
    return ModelAdapter(name=name, blocks=tuple(blocks), block_path=path)


def _architecture_name(module: nn.Module) -> str:
    from ultrascale.models.llama import Llama

    for sub in module.modules():
        if isinstance(sub, Llama):
            return "ultrascale.Llama"
        config = getattr(sub, "config", None)
        architectures = getattr(config, "architectures", None)
        if architectures:
            return str(architectures[0])
        if type(sub).__name__.endswith("ForCausalLM"):
            return type(sub).__name__
    return "generic"
