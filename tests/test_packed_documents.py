"""Packed instruction examples do not see each other: with position_ids restarting at 0 per example,
the logits of an example inside a packed block equal its logits when it is alone (built-in Llama and HF)."""

import pytest
import torch
from torch.testing import assert_close

from ultrascale.models.llama import LlamaConfig, document_causal_mask
from ultrascale.models.lm import LlamaLM


def packed_vs_alone(forward):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 100, (1, 5), generator=g), torch.randint(0, 100, (1, 7), generator=g)
    block = torch.cat([a, b], dim=1)  # (1, 12): example A then example B
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    with torch.no_grad():
        packed = forward(block, positions)
        alone_a, alone_b = forward(a, None), forward(b, None)
        leaky = forward(block, None)  # plain causal attention over the block: B sees A
    return packed, alone_a, alone_b, leaky


def test_document_mask():
    mask = document_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert document_causal_mask(torch.arange(6).unsqueeze(0)) is None  # one document: plain causal


def test_llama_packed_examples_are_isolated():
    module = LlamaLM(config=LlamaConfig.from_preset("tiny", vocab_size=128))
    module.configure_model()
    packed, alone_a, alone_b, leaky = packed_vs_alone(lambda x, p: module(x, p))
    assert_close(packed[:, :5], alone_a, rtol=1e-5, atol=1e-5)
    assert_close(packed[:, 5:], alone_b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[:, 5:], alone_b, atol=1e-3)  # without positions, B would attend to A


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_packed_examples_are_isolated(tmp_path, attn):
    import transformers

    from ultrascale.models.hf import HFCausalLM

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path), attn_implementation=attn)
    module.configure_model()  # no trainer: plain from_pretrained
    module.eval()
    packed, alone_a, alone_b, leaky = packed_vs_alone(lambda x, p: module(x, p))
    assert_close(packed[:, :5], alone_a, rtol=1e-5, atol=1e-5)
    assert_close(packed[:, 5:], alone_b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky[:, 5:], alone_b, atol=1e-3)


DOCUMENT_ROWS = [[5, 7, 4], [16], [3, 9, 1, 3]]  # per row of 16: document lengths (one of a single token)


def _document_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENT_ROWS])  # (3, 16)


def test_document_attention_equals_sdpa_under_the_block_diagonal_mask():
    """One causal call per document (grouped-query heads) against torch's SDPA with the dense mask: output and the
    gradients of q, k, v."""
    from ultrascale.parallel.device import grouped_sdpa
    from ultrascale.parallel.documents import document_attention, document_ids, document_mask, document_spans

    documents = document_ids(_document_positions())
    assert document_spans(documents) == [[(0, 5), (5, 12), (12, 16)], [(0, 16)], [(0, 3), (3, 12), (12, 13), (13, 16)]]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(3, 2, 16, 8, generator=g, requires_grad=True) for _ in range(2))
    ours = document_attention(q, k, v, documents, scale=0.3)
    dense = grouped_sdpa(q, k, v, attn_mask=document_mask(documents), scale=0.3)
    assert_close(ours, dense, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    # atol 1e-5: on an AMD EPYC (no AVX-512) torch's fp32 SDPA backward rounds elements near 0 1.5e-6 apart.
    for mine, theirs in zip(grads, torch.autograd.grad(dense.square().sum(), (q, k, v))):
        assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_narrow_half_precision_heads_are_attended_in_fp32_on_cpu(head_dim):
    """bf16 heads narrower than `CPU_HALF_ATTENTION_MIN_HEAD_DIM` give fp32 SDPA's output (and gradients) cast to bf16,
    also under autocast; wider ones bf16 SDPA's own, bit for bit."""
    import torch.nn.functional as F

    from ultrascale.parallel.device import CPU_HALF_ATTENTION_MIN_HEAD_DIM, grouped_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 24, head_dim, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 24, head_dim, generator=g).bfloat16().requires_grad_() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = grouped_sdpa(q, k, v, is_causal=True)
    assert ours.dtype == torch.bfloat16
    if head_dim < CPU_HALF_ATTENTION_MIN_HEAD_DIM:
        wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*wide, is_causal=True, enable_gqa=True)
        assert torch.equal(ours, reference.bfloat16())
        grads = torch.autograd.grad(ours.float().square().sum(), (q, k, v))
        for mine, theirs in zip(grads, torch.autograd.grad(reference.bfloat16().float().square().sum(), wide)):
            assert_close(mine.float(), theirs.bfloat16().float(), rtol=0, atol=0)
    else:
        assert torch.equal(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("arch, per_document", [("llama", True), ("qwen2", True), ("qwen3", True), ("gemma3", False)])
def test_hf_document_attention_gives_transformers_sdpa(tmp_path, arch, per_document):
    """`HFCausalLM` runs "sdpa" as `ultrascale_sdpa_documents`: packed rows give transformers' own SDPA forward's
    logits and gradients, computed per document where a layer is plain causal attention (Llama, Qwen2, Qwen3) and by
    transformers' SDPA under its mask where a layer has a sliding window (Gemma 3)."""
    import transformers

    import ultrascale.parallel.documents as documents_module
    from tests._parity import make_hf_checkpoint
    from ultrascale.models.hf import HF_DOCUMENT_ATTENTION, HFCausalLM

    path = make_hf_checkpoint(tmp_path / arch, arch, vocab_size=64, hidden_size=32)
    module = HFCausalLM(path)
    module.configure_model()
    assert module.model.config._attn_implementation == HF_DOCUMENT_ATTENTION
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    reference.train()
    ids = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    positions = _document_positions()
    calls = []
    original = documents_module.document_attention
    documents_module.document_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        ours = module(ids, positions)
    finally:
        documents_module.document_attention = original
    theirs = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    named = dict(reference.named_parameters())
    for name, parameter in module.model.named_parameters():
        assert_close(parameter.grad, named[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert bool(calls) == per_document


def _tp_packed_logits(rank, world_size, block, positions):
    import lightning as L

    import ultrascale
    from tests._parity import TokenDataset

    module = LlamaLM(config=LlamaConfig.from_preset("tiny", vocab_size=128))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        strategy=ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=1))
    trainer.validate(module, torch.utils.data.DataLoader(TokenDataset(2, 12, 128), batch_size=1), verbose=False)
    with torch.no_grad():
        logits = module(block, positions)  # tensor + sequence parallel, document mask by keyword
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def test_packed_documents_under_tensor_parallel():
    from tests._dist import run_ranks

    module = LlamaLM(config=LlamaConfig.from_preset("tiny", vocab_size=128))
    module.configure_model()
    g = torch.Generator().manual_seed(0)
    block = torch.randint(0, 128, (2, 12), generator=g)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        expected = module(block, positions)
    for logits in run_ranks(_tp_packed_logits, 2, block, positions):
        assert_close(logits, expected, rtol=1e-5, atol=1e-5)
