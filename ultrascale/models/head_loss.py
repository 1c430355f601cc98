"""What a causal LM does between its last hidden state and the loss, for the head and the loss fused in chunks.

`HEAD_TO_LOGITS` is what each transformers architecture does around its output projection; `fused_head_loss_sum`
runs the built-in Llama's or a transformers model's head and loss through `parallel.loss.chunked_cross_entropy_sum`.
Here, not in `models.hf`, so that the planner and `measure_layout` read it without importing Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch.nn as nn


def _softcapped(cap: float) -> Callable[[Any], Any]:
    return lambda logits: (logits / cap).tanh() * cap


HEAD_TO_LOGITS: dict[str, Callable[[Any], tuple[Optional[Callable], Optional[Callable]]]] = {
    **{model_type: (lambda model: (None, None)) for model_type in (
        "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "olmo3", "smollm3", "mixtral", "qwen3_moe", "gpt_oss",
        "deepseek_v3", "glm4_moe", "olmoe", "phimoe")},
    # Gemma 2/3: `final_logit_softcapping`, cap * tanh(logits / cap), in the logits' dtype as transformers does.
    **{model_type: (lambda model: (None, _softcapped(model.config.final_logit_softcapping)
                                   if model.config.final_logit_softcapping is not None else None))
       for model_type in ("gemma2", "gemma3_text")},
    "granite": lambda model: (None, lambda logits: logits / model.config.logits_scaling),
    **{model_type: (lambda model: (None, lambda logits: logits * model.logit_scale)) for model_type in ("cohere", "cohere2")},
    # MiniCPM3 divides the hidden states (not the logits) by its `logits_scaling` before the head.
    "minicpm3": lambda model: (lambda hidden: hidden / model.config.logits_scaling, None),
}
"""What a transformers causal LM does between its decoder's last hidden state and its logits, by `model_type`: (a
function of the hidden states before the head or None, a function of the head's output or None), read from
each architecture's `ForCausalLM.forward` in transformers 5.24. The chunked loss runs on these architectures alone
(tests/test_chunked_loss.py holds each to the model's own logits); a `model_type` not here computes the whole
logits, and `loss_chunk_tokens` set on it is refused."""


def head_to_logits(model: nn.Module) -> tuple[Optional[Callable], Optional[Callable]]:
    """`HEAD_TO_LOGITS` of the transformers model `model` (KeyError for an architecture not there)."""
    return HEAD_TO_LOGITS[model.config.model_type](model)


def fused_head_loss_sum(model: nn.Module, input_ids: Any, position_ids: Any, labels: Any, chunk_tokens: int,
                        sequence_mesh: Any = None) -> tuple[Any, Any]:
    """``(loss sum, valid tokens)`` of the built-in `Llama` or a transformers causal LM (a PEFT wrapper's base) with
    its head and loss fused in chunks of `chunk_tokens` (`parallel.loss.chunked_cross_entropy_sum`): the final
    norm's output, then the head as the architecture applies it (`HEAD_TO_LOGITS`). `sequence_mesh`: under
    sequence parallel, the tp mesh whose ranks hold slices of the final norm's output as plain tensors (a
    transformers plan hands them so): named Shard(1) there, the chunks are cut from the whole sequence."""
    from torch.distributed.tensor import DTensor, Shard

    from ultrascale.models.llama import Llama
    from ultrascale.parallel.loss import chunked_cross_entropy_sum

    if isinstance(model, Llama):
        return chunked_cross_entropy_sum(model(input_ids, position_ids, head=False), model.output, labels, chunk_tokens)
    inner = hf_inner_model(model)
    before, after = head_to_logits(inner)
    hidden = inner.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    if sequence_mesh is not None and not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, sequence_mesh, [Shard(1)], run_check=False)
    if before is not None:
        hidden = before(hidden)
    return chunked_cross_entropy_sum(hidden, inner.get_output_embeddings(), labels, chunk_tokens, after)


def fuses_head_and_loss(model: nn.Module) -> bool:
    """Whether `LlamaLM` / `HFCausalLM` run this model's head and loss fused in chunks: the built-in Llama, and the
    transformers architectures of `HEAD_TO_LOGITS`."""
    from ultrascale.models.llama import Llama

    config = getattr(model, "config", None)
    return isinstance(model, Llama) or getattr(config, "model_type", None) in HEAD_TO_LOGITS



def hf_inner_model(model: nn.Module) -> nn.Module:
    """The transformers model itself: `model`, or the one a PEFT `PeftModel` wraps (its `get_base_model()`)."""
    get_base_model = getattr(model, "get_base_model", None)  # PeftModel's; transformers models have none
    return get_base_model() if callable(get_base_model) else model


__all__ = ["HEAD_TO_LOGITS", "fused_head_loss_sum", "fuses_head_and_loss", "head_to_logits", "hf_inner_model"]
