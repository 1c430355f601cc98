"""The built-in `Llama` as a Hugging Face `LlamaForCausalLM`: its config, its weights and a byte-level tokenizer.

`export-hf` (`ultrascale.models.hf.export_hf_checkpoint`) writes a `LlamaLM` checkpoint of any layout with these.
Two conventions differ between the two models and are converted here:

- **Names.** ``tok_embeddings`` / ``attention.wq`` ... / ``feed_forward.w1, w2, w3`` / ``output`` are
  ``model.embed_tokens`` / ``self_attn.q_proj`` ... / ``mlp.gate_proj, down_proj, up_proj`` / ``lm_head``.
- **Rotary pairs.** `Llama` rotates channel pairs ``(2i, 2i + 1)`` of each head (Meta's interleaved layout);
  transformers' Llama rotates ``(i, i + head_dim / 2)`` ("rotate_half"). Attention scores do not depend on the
  order of a head's channels as long as q and k share it, so the rows of ``wq`` and ``wk`` are reordered per head
  (even channels first, then odd): the same model, in transformers' layout.

The MoE variant (``n_experts > 0``) has no transformers counterpart here and is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ultrascale.models.llama import LlamaConfig
from ultrascale.parallel.rules import not_built

__all__ = ["byte_tokenizer_for_hf", "hf_llama_config", "hf_llama_state"]


def _check_dense(config: LlamaConfig) -> None:
    if config.n_experts:
        raise not_built(
            "export_moe_llama",
            f"export-hf writes the dense LlamaLM as a LlamaForCausalLM; this checkpoint is its MoE variant "
            f"(n_experts={config.n_experts}), which has no transformers model to become"
        )


def hf_llama_config(config: LlamaConfig, *, bos_token_id: int | None, eos_token_id: int | None) -> Any:
    """The `transformers.LlamaConfig` of the same model (fp32 weights, as the checkpoint holds them)."""
    import transformers

    _check_dense(config)
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.resolved_ffn_hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        dtype="float32",
    )


def _rotate_half_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection reordered per head from interleaved pairs to transformers' halves:
    (heads * head_dim, dim) viewed as (heads, head_dim / 2, 2, dim) -> (heads, 2, head_dim / 2, dim)."""
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_llama_state(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """`Llama`'s state dict (its own names, whole tensors) under `LlamaForCausalLM`'s names and rotary layout.
    ValueError naming a tensor it does not know (nothing is dropped silently)."""
    _check_dense(config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
            continue
        parts = name.split(".", 2)
        if parts[0] != "layers" or len(parts) != 3 or parts[2] not in _BLOCK_NAMES:
            raise ValueError(f"hf_llama_state: `{name}` is not a weight of the built-in Llama")
        if parts[2] == "attention.wq.weight":
            tensor = _rotate_half_rows(tensor, config.n_heads)
        elif parts[2] == "attention.wk.weight":
            tensor = _rotate_half_rows(tensor, config.n_kv_heads)
        out[f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"] = tensor
    if config.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def byte_tokenizer_for_hf() -> Any:
    """`ultrascale.data.ByteTokenizer` as a transformers tokenizer: ids 0-255 the UTF-8 bytes, 256 BOS, 257 EOS,
    nothing added when encoding (as the data pipeline encodes: documents end with EOS, none begin with BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from ultrascale.data.tokenizer import ByteTokenizer

    byte_char = bytes_to_unicode()  # byte -> the printable character byte-level BPE stands it with
    vocab = {byte_char[b]: b for b in range(256)}
    vocab.update({"<bos>": ByteTokenizer.bos_id, "<eos>": ByteTokenizer.eos_id})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   add_bos_token=False, add_eos_token=False)
