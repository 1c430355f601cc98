"""One FLOP count (`ultrascale.estimate.model_flops`) for the built-in Llama, HF models, MFU and `plan`."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from ultrascale.estimate import model_flops
from ultrascale.models import Llama, LlamaConfig, LlamaLM
from ultrascale.planner.app import plan_main

# Hand count for one shape: hidden 64, 4 heads of 16, 2 KV heads, FFN 128, 2 layers, vocab 100, seq 32.
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB, SEQ = 64, 4, 2, 128, 2, 100, 32
PER_LAYER = (
    HIDDEN * HIDDEN              # q
    + 2 * HIDDEN * (HIDDEN // HEADS * KV_HEADS)  # k, v
    + HIDDEN * HIDDEN            # o
    + 3 * HIDDEN * FFN           # gate, up, down
)
assert PER_LAYER == 36_864
MATMUL = LAYERS * PER_LAYER + VOCAB * HIDDEN   # the LM head is a matmul, the embedding lookup is not
HAND = 6 * MATMUL + 12 * LAYERS * HIDDEN * SEQ  # 6N + 12 L h s = 480_768 + 49_152
assert HAND == 529_920


def _llama(tied: bool) -> Llama:
    config = LlamaConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                         ffn_hidden_dim=FFN, max_seq_len=SEQ, tie_embeddings=tied)
    with torch.device("meta"):
        return Llama(config)


def _hf_config(tied: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    num_key_value_heads=KV_HEADS, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_builtin_and_hf_llama_match_the_hand_count(tied):
    assert _llama(tied).flops_per_token(SEQ) == HAND
    assert model_flops(_llama(tied)).per_token(SEQ) == HAND
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(_hf_config(tied))
    assert model_flops(hf).per_token(SEQ) == HAND


def test_lightning_module_and_plan_use_the_same_count(tmp_path):
    module = LlamaLM(config=_llama(False).config)
    assert module.flops_per_token(SEQ) == HAND  # a meta copy before configure_model
    module.configure_model()
    assert model_flops(module).per_token(SEQ) == HAND  # what MFUMonitor reads, once the model is built
    _hf_config(False).save_pretrained(tmp_path)
    text = plan_main(["--hf-config", str(tmp_path), "--world", "1", "--seq-len", str(SEQ)])
    gflops = float(re.search(r"([\d.]+) GFLOPs per token", text).group(1))
    assert gflops == pytest.approx(HAND / 1e9, abs=0.05)


def test_an_attention_free_model_counts_its_matmuls_alone():
    """RWKV has no attention heads: 6N, N its matmul weights (time mixing's key, value, receptance and output, channel
    mixing's key, value and receptance, and the head), where reading `num_attention_heads` used to raise."""
    hidden, attention, ffn = 32, 32, 64
    config = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=hidden, attention_hidden_size=attention,
                                     intermediate_size=ffn, num_hidden_layers=LAYERS, context_length=SEQ)
    with torch.device("meta"):
        rwkv = transformers.AutoModelForCausalLM.from_config(config)
    per_layer = 3 * hidden * attention + attention * hidden + 2 * hidden * ffn + hidden * hidden
    assert model_flops(rwkv).per_token(SEQ) == 6 * (LAYERS * per_layer + VOCAB * hidden)
