"""The head and the loss fused in chunks (`ultrascale.chunked_token_loss`, the models' `loss_chunk_tokens`): the
loss and gradients of the whole logits, without keeping them.

The reference is written here: the logits of the whole micro-batch, the token cross-entropy inline
(`tests._parity.inline_token_loss`). Labels are masked (-100) unevenly per row; chunks do not divide the sequence.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    assert_parity,
    inline_token_loss,
    make_hf,
    merge_stages,
    parity_trainer,
    reference_run,
    save_perturbed_hf,
    step_losses,
)
from ultrascale.parallel.loss import (
    chunked_cross_entropy_sum,
    chunked_token_loss,
    default_loss_chunk_tokens,
)
from ultrascale.parallel.rules import LayoutNotImplemented


def _masked_labels(rows: int, positions: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows, positions), generator=generator)
    for row in range(rows):  # an uneven prompt per row
        labels[row, : (3 * row + 2) % positions] = -100
    if rows > 2:
        labels[-1] = -100  # and a row without any target
    return labels


def _saved_numel(fn) -> int:
    """The largest tensor autograd saves for backward while `fn` runs."""
    largest = 0

    def pack(tensor):
        nonlocal largest
        largest = max(largest, tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return largest


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 10_000])
def test_chunked_sum_is_the_whole_logits_loss(chunk):
    """Loss, count and the gradients of the hidden states and the head weight equal the whole logits' (fp32
    tolerance), with a soft-cap after the head, for the head as a weight and as a module."""
    torch.manual_seed(0)
    rows, positions, dim, vocab = 3, 13, 8, 50
    hidden = torch.randn(rows, positions, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = _masked_labels(rows, positions, vocab)

    def capped(logits):
        return torch.tanh(logits / 3.0) * 3.0

    expected = inline_token_loss(capped(F.linear(hidden, weight)), labels)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    for given in (weight, head):
        out = chunked_token_loss(hidden, given, labels, chunk, logits_fn=capped)
        assert int(out["num_tokens"]) == int((labels != -100).sum())
        assert_close(out["loss"], expected, rtol=1e-6, atol=1e-6)
        grads = torch.autograd.grad(out["loss"], (hidden, weight if given is weight else head.weight))
        for got, want in zip(grads, expected_grads):
            assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # validation: no recompute, the same sum
        loss_sum, count = chunked_cross_entropy_sum(hidden, weight, labels, chunk, capped)
    assert_close(loss_sum / count, expected.detach(), rtol=1e-6, atol=1e-6)


def test_tied_head_frozen_head_and_no_rerun_in_backward():
    """The head's weight tied to the embedding gets both gradients; a frozen head still passes the hidden states'
    gradient; the head runs once per chunk in forward and never in backward (nothing recomputed), and a backward
    through a scaled loss scales every gradient."""
    torch.manual_seed(1)
    rows, positions, dim, vocab, chunk = 2, 20, 8, 40, 10
    embedding = torch.nn.Embedding(vocab, dim)
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight = embedding.weight
    tokens = torch.randint(0, vocab, (rows, positions))
    labels = _masked_labels(rows, positions, vocab)
    expected = 3.0 * inline_token_loss(F.linear(torch.tanh(embedding(tokens)), embedding.weight), labels)
    (want,) = torch.autograd.grad(expected, (embedding.weight,))
    calls = []
    head.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    loss = 3.0 * chunked_token_loss(torch.tanh(embedding(tokens)), head, labels, chunk)["loss"]
    forward_calls = len(calls)
    (got,) = torch.autograd.grad(loss, (embedding.weight,))
    assert forward_calls == positions // (chunk // rows) and len(calls) == forward_calls
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    head.weight.requires_grad_(False)
    hidden = torch.randn(rows, positions, dim, requires_grad=True)
    (want,) = torch.autograd.grad(inline_token_loss(F.linear(hidden, head.weight), labels), (hidden,))
    (got,) = torch.autograd.grad(chunked_token_loss(hidden, head, labels, chunk)["loss"], (hidden,))
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_only_one_chunk_of_logits_is_kept_for_backward():
    """Chunked, the largest tensor autograd saves is one chunk's logits (16 x V, differentiated and dropped in
    forward), not the micro-batch's (B x T x V); the whole logits' loss saves those (so this check can fail)."""
    rows, positions, dim, vocab = 2, 64, 8, 512
    hidden = torch.randn(rows, positions, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = _masked_labels(rows, positions, vocab)
    whole = _saved_numel(lambda: inline_token_loss(F.linear(hidden, weight), labels).backward())
    chunked = _saved_numel(lambda: chunked_token_loss(hidden, weight, labels, 16)["loss"].backward())
    assert whole >= rows * positions * vocab
    assert chunked <= 16 * vocab, chunked


def test_default_chunk_and_bad_values():
    assert default_loss_chunk_tokens(151_936) == 1024 and default_loss_chunk_tokens(32_000) == 2**27 // 32_000
    assert default_loss_chunk_tokens(344) == 2**27 // 344  # a tiny vocabulary: a micro-batch is one chunk
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy_sum(torch.zeros(1, 2, 4), torch.zeros(3, 4), torch.zeros(1, 2, dtype=torch.long), 0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk_tokens"):
            ultrascale.models.LlamaLM(preset="tiny", loss_chunk_tokens=bad)


def _llama(**kwargs: Any) -> Any:
    from ultrascale.models import LlamaLM

    return LlamaLM(preset="tiny", vocab_size=VOCAB, max_seq_len=SEQ, learning_rate=3e-3, warmup_steps=1,
                   max_steps=1000, min_lr_ratio=1.0, eps=1e-6, **kwargs)


VOCAB, SEQ, MICRO_BATCH, ACCUMULATE, STEPS = 128, 32, 4, 2, 10
CHUNK = 24  # 4 rows x 32 positions = 128 tokens a micro-batch: chunks of 6 positions, the last one of 2


def test_llama_module_fuses_its_head_with_the_loss():
    """`LlamaLM(loss_chunk_tokens=...)`: the step's loss and gradients are those of the whole logits; 0 and a
    micro-batch within one chunk compute the whole logits."""
    torch.manual_seed(0)
    module = _llama(loss_chunk_tokens=CHUNK)
    module.configure_model()
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ))
    labels = _masked_labels(MICRO_BATCH, SEQ, VOCAB)
    expected = inline_token_loss(module(tokens), labels)
    expected_grads = torch.autograd.grad(expected, list(module.parameters()))
    out = module.batch_loss({"input_ids": tokens, "labels": labels})
    assert_close(out["loss"], expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out["loss"], list(module.parameters())), expected_grads):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert module.loss_chunk_tokens_in_use() == CHUNK
    assert _llama(loss_chunk_tokens=0).loss_chunk_tokens_in_use() == 0
    assert _llama().loss_chunk_tokens_in_use() == default_loss_chunk_tokens(VOCAB)


def test_an_explicit_chunk_under_pipeline_parallel_is_refused_by_name():
    with pytest.raises(LayoutNotImplemented, match=r"loss_chunk_tokens=64.*pipeline parallel") as refused:
        _llama(loss_chunk_tokens=64).loss_chunk_tokens_in_use(pipeline=True)
    assert refused.value.key == "chunked_loss_pipeline"
    assert _llama().loss_chunk_tokens_in_use(pipeline=True) == 0  # the default: the whole logits there


# --------------------------------------------------------------------------- Hugging Face architectures

_HF_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=None,
                  bos_token_id=1, eos_token_id=2)
HF_EXTRA: dict[str, tuple[str, dict[str, Any]]] = {
    "Mistral": ("mistral", {"sliding_window": None}),
    "Qwen2": ("qwen2", {}),
    "Cohere": ("cohere", {"logit_scale": 0.5}),
    "Cohere2": ("cohere2", {"logit_scale": 0.5, "sliding_window": 12,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "Gemma2, soft-capped": ("gemma2", {"head_dim": 8, "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 8}),
}


def _hf_architectures() -> dict[str, tuple[str, dict[str, Any]]]:
    from tests.test_hf_matrix import ARCHITECTURES

    return {**ARCHITECTURES, **HF_EXTRA}


def _hf_checkpoint(folder, architecture: str) -> str:
    import transformers

    model_type, fields = _hf_architectures()[architecture]
    return save_perturbed_hf(transformers.CONFIG_MAPPING[model_type](**{**_HF_COMMON, **fields}), folder)


def test_every_architecture_of_head_to_logits_is_checked_here():
    """Each `HEAD_TO_LOGITS` entry has a tiny checkpoint below; the support matrix's architectures outside it are
    refused by name when asked for a chunk."""
    from ultrascale.models.head_loss import HEAD_TO_LOGITS

    types = {model_type for model_type, _ in _hf_architectures().values()}
    assert set(HEAD_TO_LOGITS) <= types, set(HEAD_TO_LOGITS) - types


@pytest.mark.parametrize("architecture", sorted(_hf_architectures()))
def test_hf_chunked_loss_is_the_models_own_logits_loss(architecture, tmp_path):
    """For an architecture of `HEAD_TO_LOGITS`: the chunked loss and every gradient equal the loss of the logits
    transformers' own forward returns (soft-capping, logit scales and MiniCPM3's hidden-state scale included); for
    one outside it, an explicit chunk is refused by name and the default computes the whole logits."""
    from ultrascale.models.head_loss import HEAD_TO_LOGITS

    path = _hf_checkpoint(tmp_path, architecture)
    module = make_hf(path, loss_chunk_tokens=CHUNK)
    module.configure_model()
    module.train()
    if module.config.model_type not in HEAD_TO_LOGITS:
        with pytest.raises(LayoutNotImplemented, match="loss_chunk_tokens=24") as refused:
            module.loss_chunk_tokens_in_use()
        assert refused.value.key == "chunked_loss_hf_architecture"
        assert make_hf(path).loss_chunk_tokens_in_use() == 0
        return
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    labels = _masked_labels(MICRO_BATCH, SEQ, VOCAB)
    params = [p for p in module.parameters() if p.requires_grad]
    torch.manual_seed(0)
    expected = inline_token_loss(module(tokens), labels)
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    torch.manual_seed(0)
    out = module.batch_loss({"input_ids": tokens, "labels": labels})
    assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out["loss"], params, allow_unused=True)
    for (name, _), got, want in zip([(n, p) for n, p in module.named_parameters() if p.requires_grad], grads,
                                    expected_grads):
        if want is None:
            assert got is None, name
            continue
        assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")


# --------------------------------------------------------------------------- layouts, against one process

LAYOUTS: dict[str, dict[str, Any]] = {
    "ZeRO-3": {"data_parallel_shard": 2},
    "TP 2, sequence and loss parallel": {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": True},
    "TP 2, loss parallel": {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": False},
    "CP 2": {"context_parallel": 2, "data_parallel_shard": 1},
    "ZeRO-3, compiled": {"data_parallel_shard": 2, "compile": True, "compile_backend": "aot_eager"},
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}  # the head itself a LoRA layer
CASES = [("llama", layout, {}) for layout in LAYOUTS] + [
    ("Gemma2, soft-capped", layout, {}) for layout in LAYOUTS if layout != "ZeRO-3, compiled"] + [
    ("Gemma2, soft-capped", "ZeRO-3", {"lora": LORA})] + [
    ("Qwen2", layout, {}) for layout in ("ZeRO-3", "TP 2, sequence and loss parallel")]


def _data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH * ACCUMULATE, SEQ, VOCAB, seed=7, masked=True, empty_rows=[5])


def _module(model_kind: str, path: str, **kwargs: Any) -> Any:
    return _llama(**kwargs) if model_kind == "llama" else make_hf(path, **kwargs)


def _train(rank, world_size, model_kind, path, strategy_kwargs, module_kwargs):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS,
                             accumulate_grad_batches=ACCUMULATE)
    module = _module(model_kind, path, loss_chunk_tokens=CHUNK, **module_kwargs)
    trainer.fit(module, ParityData(_data(), MICRO_BATCH))
    assert module.loss_chunk_tokens_in_use() == CHUNK
    return recorder.result()


@pytest.mark.parametrize("model_kind, layout, module_kwargs", CASES,
                         ids=[f"{kind}-{layout}{'-LoRA' if kwargs else ''}" for kind, layout, kwargs in CASES])
def test_layouts_train_like_one_process_with_the_chunked_loss(model_kind, layout, module_kwargs, tmp_path):
    """Masked labels, accumulation 2, several chunks per micro-batch on every rank: first-step loss and gradients,
    the weights after it and the 10-step curve of the one-process whole-logits reference, written inline."""
    path = "" if model_kind == "llama" else _hf_checkpoint(tmp_path, model_kind)
    reference = reference_run(_module(model_kind, path, **module_kwargs), _data(), global_batch=MICRO_BATCH,
                              steps=STEPS, accumulate=ACCUMULATE)
    results = run_ranks(_train, 2, model_kind, path, LAYOUTS[layout], module_kwargs)
    assert_parity(merge_stages(results), reference, step_losses(results))


# --------------------------------------------------------------------------- the planner's pricing

def test_planner_prices_one_chunk_of_logits_where_the_loss_is_chunked():
    """At a 152k vocabulary and 4,096 tokens a rank, the default chunk (1,024 tokens) prices the loss at one chunk's
    12 x V bytes a token (fp32: the log-softmax, the gradient coming in and the one going out) plus the hidden
    states' gradient the chunk stores, where the whole logits price every token's; the peak falls with it. Under
    pipeline parallel (not built) and with `loss_chunk_tokens=0` the whole logits are priced."""
    from ultrascale import planner
    from ultrascale.estimate import ModelShape
    from ultrascale.models.llama import LlamaConfig
    from ultrascale.planner.cost import activation_model, peak_memory

    vocab, dim, seq = 151_936, 128, 4096
    shape = ModelShape.from_llama_config(LlamaConfig(vocab_size=vocab, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2,
                                                     ffn_hidden_dim=256, max_seq_len=seq))

    def priced(chunk, **layout):
        lay = planner.Layout(**{"dp_shard": 2, **layout})
        work = planner.Workload(seq, 2, precision="32-true", loss_chunk_tokens=chunk)
        return activation_model(shape, lay, work).loss_bytes(), peak_memory(shape, lay, work)

    c, per_logit = 4, 12
    inputs = (4 + c) * seq * dim + c * seq * dim  # the final norm's fp32 input and output, the head's input
    assert priced(0)[0] == per_logit * seq * vocab + inputs
    assert priced(None)[0] == per_logit * 1024 * vocab + inputs + c * seq * dim
    assert priced(2048)[0] == per_logit * 2048 * vocab + inputs + c * seq * dim
    assert priced(None)[1] < priced(0)[1] / 2
    assert priced(None, dp_shard=1, pp=2) == priced(0, dp_shard=1, pp=2)
    with pytest.raises(ValueError, match="loss_chunk_tokens=-1"):
        planner.Workload(seq, 2, loss_chunk_tokens=-1)
