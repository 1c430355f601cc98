"""Context parallel for Hugging Face models: the function registered in transformers' `AttentionInterface`, which
runs a layer's attention through the layer's `ContextParallel` (`ultrascale.parallel.context`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ultrascale.parallel.rules import not_built

CONTEXT_PARALLEL_ATTRIBUTE = "ultrascale_context_parallel"
"""Attribute of a Hugging Face attention module holding its `ContextParallel`."""

HF_ATTENTION_NAME = "ultrascale_context_parallel"
"""Name under which `hf_context_parallel_attention` is registered in transformers' `AttentionInterface`."""


def hf_context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``query`` (B, H, T, D) -> (B, T, H, Dv)), computed
    over the context-parallel sequence. Causal masking and documents come from the layout, the sliding window from
    `sliding_window` or, where the model windows through its mask alone, from its config (`window_of_the_mask`);
    the mask transformers would build is not built (the name has no mask function), and a mask the model
    builds itself is refused. `softcap` (Gemma 2's
    logit soft-capping) and `s_aux` (GPT-OSS's attention sinks) are what those models pass."""
    cp = getattr(module, CONTEXT_PARALLEL_ATTRIBUTE, None)
    if cp is None:
        raise RuntimeError(f"{type(module).__name__} runs context parallel attention but was not set up for it")
    if dropout and module.training:
        raise not_built("context_parallel_attention_dropout",
                        f"{type(module).__name__}: attention dropout is not supported under context parallel")
    if not getattr(module, "is_causal", True):
        raise not_built("context_parallel_non_causal",
                        f"{type(module).__name__}: context parallel supports causal self-attention only")
    if attention_mask is not None:
        # The name has no mask function, so transformers hands a mask only when the model built one itself.
        raise not_built("context_parallel_model_mask",
                        f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) hands its attention a mask "
                        f"of its own (shape {tuple(attention_mask.shape)}); context parallel computes the causal, "
                        "sliding-window and document masks itself and has no kernel for another: train this model "
                        "without context parallel")
    window = sliding_window if sliding_window is not None else window_of_the_mask(module)
    out = cp.attention(query, key, value, scale=scaling, window=window, softcap=softcap, sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def window_of_the_mask(module: nn.Module) -> Optional[int]:
    """The sliding window transformers' mask would give this attention layer, for a model that windows through its
    mask alone and hands its attention function no `sliding_window` (PhiMoE, Qwen2-MoE). The mask is built from the
    config: by layer under `config.layer_types` (a `sliding_attention` layer gets `config.sliding_window`), else for
    every layer whenever `config.sliding_window` is set (`create_sliding_window_causal_mask if
    config.sliding_window is not None`, as those models write it)."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[module.layer_idx] == "sliding_attention" else None
    return window


__all__ = ["CONTEXT_PARALLEL_ATTRIBUTE", "HF_ATTENTION_NAME", "hf_context_parallel_attention", "window_of_the_mask"]
