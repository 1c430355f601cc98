"""Single-process tests of the reference Llama and LlamaLM (CPU, tiny shapes)."""

import dataclasses
import math

import lightning
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ultrascale.models.llama import LLAMA_PRESETS, Attention, Llama, LlamaConfig, apply_rope, precompute_rope
from ultrascale.models.lm import LlamaLM, warmup_cosine

TINY = LlamaConfig.from_preset("tiny")


def _tokens(batch: int = 2, seq_len: int = 16, vocab: int = TINY.vocab_size, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "name, ffn, params",
    [("llama3_8b", 14336, 8.03e9), ("llama3_70b", 28672, 70.6e9), ("llama3_405b", 53248, 405.9e9)],
)
def test_presets_match_meta(name, ffn, params):
    config = LlamaConfig.from_preset(name)
    assert config.resolved_ffn_hidden_dim == ffn
    with torch.device("meta"):
        model = Llama(config)
    assert model.num_params() == pytest.approx(params, rel=0.01)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="n_heads"):
        LlamaConfig(vocab_size=8, dim=10, n_layers=1, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(vocab_size=8, dim=16, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        LlamaConfig(vocab_size=8, dim=16, n_layers=0, n_heads=4)
    with pytest.raises(ValueError, match="tiny"):
        LlamaConfig.from_preset("nope")
    assert LlamaConfig(vocab_size=8, dim=16, n_layers=1, n_heads=4).n_kv_heads == 4
    assert set(LLAMA_PRESETS) >= {"tiny", "small", "llama3_8b", "llama3_70b", "llama3_405b"}


def test_flops_per_token_formula():
    model = Llama(TINY)
    norms = (2 * TINY.n_layers + 1) * TINY.dim  # 1-D gains: no matmul
    expected = 6 * (model.num_params() - TINY.vocab_size * TINY.dim - norms) + 12 * TINY.n_layers * TINY.dim * 128
    assert model.flops_per_token(128) == expected
    assert LlamaLM().flops_per_token(128) == expected  # meta copy before configure_model


# --------------------------------------------------------------------------- model maths


def test_causality():
    torch.manual_seed(0)
    model = Llama(TINY).eval()
    tokens = _tokens()
    t = 7
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, TINY.vocab_size)
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions=torch.arange(16)), a, rtol=0, atol=0)


def test_sequence_longer_than_max_seq_len_raises():
    model = Llama(dataclasses.replace(TINY, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(seq_len=9))


def test_gqa_equals_mha_with_duplicated_kv_heads():
    torch.manual_seed(0)
    gqa_config = dataclasses.replace(TINY, n_heads=4, n_kv_heads=2)
    mha_config = dataclasses.replace(TINY, n_heads=4, n_kv_heads=4)
    gqa, mha = Attention(gqa_config), Attention(mha_config)
    n_rep, head_dim = 2, gqa_config.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            # Query head h reads kv head h // n_rep: duplicate each kv head's rows n_rep times.
            w = getattr(gqa, name).weight.unflatten(0, (-1, head_dim))  # (n_kv_heads, head_dim, dim)
            getattr(mha, name).weight.copy_(w.repeat_interleave(n_rep, dim=0).flatten(0, 1))
    x = torch.randn(2, 10, gqa_config.dim, requires_grad=True)
    cos, sin = precompute_rope(head_dim, 10, gqa_config.rope_theta)
    out_gqa = gqa(x, cos, sin)
    torch.testing.assert_close(out_gqa, mha(x, cos, sin))
    out_gqa.sum().backward()  # enable_gqa backward runs on CPU
    assert gqa.wk.weight.grad is not None and torch.isfinite(gqa.wk.weight.grad).all()


def test_rope_matches_meta_complex_reference():
    head_dim, seq_len, theta = 8, 12, 10000.0
    cos, sin = precompute_rope(head_dim, seq_len, theta)
    assert cos.shape == (seq_len, head_dim // 2)
    x = torch.randn(2, 3, seq_len, head_dim)
    # Meta llama/model.py: freqs_cis = polar(1, outer(t, freqs)); x viewed as complex pairs.
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    freqs_cis = torch.polar(torch.ones(seq_len, head_dim // 2), torch.outer(torch.arange(seq_len).float(), freqs))
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, seq_len, -1, 2)) * freqs_cis).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)


def test_rope_dot_product_depends_only_on_offset():
    head_dim, seq_len = 16, 32
    cos, sin = precompute_rope(head_dim, seq_len, 10000.0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    q_rot = apply_rope(q.expand(seq_len, head_dim), cos, sin)  # q placed at every position
    k_rot = apply_rope(k.expand(seq_len, head_dim), cos, sin)
    scores = q_rot @ k_rot.T  # scores[m, n] = <R_m q, R_n k>
    for offset in (0, 3, -5):
        diagonal = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 3)[0])


# --------------------------------------------------------------------------- init


def test_tied_embeddings_share_storage():
    model = Llama(dataclasses.replace(TINY, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = Llama(TINY)
    assert model.num_params() == untied.num_params() - TINY.vocab_size * TINY.dim


def test_init_seed_is_deterministic_and_independent_of_global_rng():
    def build(seed: int, global_seed: int) -> LlamaLM:
        torch.manual_seed(global_seed)
        module = LlamaLM(init_seed=seed)
        module.configure_model()
        return module

    a, b, c = build(0, global_seed=1), build(0, global_seed=2), build(1, global_seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    model = a.model
    a.configure_model()  # idempotent
    assert a.model is model
    # fork_rng: building leaves the caller's RNG where it was.
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_rng_free = LlamaLM()
    build_rng_free.configure_model()
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_to_empty_and_init_weights(tie):
    config = dataclasses.replace(TINY, tie_embeddings=tie)
    module = LlamaLM(config=config)
    with torch.device("meta"):
        module.configure_model()
    assert module.model.rope_cos.is_meta
    module.model.to_empty(device="cpu")
    module.init_weights()
    assert (module.model.output.weight is module.model.tok_embeddings.weight) == tie
    logits = module(_tokens())
    assert torch.isfinite(logits).all()
    # Same weights as a module built straight on CPU with the same init_seed.
    reference = LlamaLM(config=config)
    reference.configure_model()
    torch.testing.assert_close(logits, reference(_tokens()), rtol=0, atol=0)


def test_residual_outputs_are_depth_scaled():
    config = dataclasses.replace(TINY, dim=256, n_heads=4, n_kv_heads=4, ffn_hidden_dim=512, n_layers=8)
    torch.manual_seed(0)
    model = Llama(config)
    block = model.layers[0]
    torch.testing.assert_close(block.attention.wq.weight.std().item(), 0.02, rtol=0.05, atol=0)
    torch.testing.assert_close(block.attention.wo.weight.std().item(), 0.02 / math.sqrt(16), rtol=0.05, atol=0)
    torch.testing.assert_close(block.feed_forward.w2.weight.std().item(), 0.02 / math.sqrt(16), rtol=0.05, atol=0)
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))


# --------------------------------------------------------------------------- training


def test_warmup_cosine():
    kwargs = dict(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert warmup_cosine(0, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(9, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(10, **kwargs) == pytest.approx(1.0)
    assert warmup_cosine(60, **kwargs) == pytest.approx(0.55)  # half-way: min + (1 - min) / 2
    assert warmup_cosine(110, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(500, **kwargs) == pytest.approx(0.1)
    assert warmup_cosine(0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        warmup_cosine(0, warmup_steps=1, max_steps=10, min_lr_ratio=2.0)


class _LossRecorder(lightning.Callback):
    def __init__(self) -> None:
        self.losses = []
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])  # the lr this batch's step will use

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _collate(rows):
    input_ids = torch.stack([row[0] for row in rows])  # (B, T + 1)
    return {"input_ids": input_ids[:, :-1], "labels": input_ids[:, 1:]}


def test_tiny_llama_lm_overfits_one_batch():
    batch = _tokens(batch=4, seq_len=33, seed=1)
    # The same 4 sequences every step: 20 steps of one repeated batch.
    dataset = TensorDataset(batch.repeat(20, 1))
    loader = DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=_collate)
    module = LlamaLM(preset="tiny", learning_rate=1e-2, weight_decay=0.1, warmup_steps=2)
    recorder = _LossRecorder()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(module, loader, val_dataloaders=loader)
    assert len(recorder.losses) == 20
    assert recorder.losses[0] == pytest.approx(math.log(TINY.vocab_size), rel=0.05)
    assert recorder.losses[-1] < recorder.losses[0] / 3, recorder.losses  # ~6.3 -> ~1.1
    assert "val_loss" in trainer.callback_metrics
    # Step 0 runs at lr * warmup_cosine(0) = lr / 2; the cosine ends at min_lr_ratio * lr.
    assert recorder.lrs[0] == pytest.approx(1e-2 * 0.5)
    assert recorder.lrs[-1] == pytest.approx(1e-2 * warmup_cosine(19, 2, 20, 0.1))
    groups = trainer.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.ndim == 1 for p in groups[1]["params"])


def test_old_llama_module_path_still_loads_with_a_warning():
    """Recipes written before the model/training split name `ultrascale.models.llama.LlamaLM`."""
    import ultrascale.models.llama as llama_module
    from ultrascale.models import LlamaLM as canonical

    with pytest.warns(FutureWarning, match=r"moved to `ultrascale\.models\.lm\.LlamaLM`"):
        assert llama_module.LlamaLM is canonical
    with pytest.raises(AttributeError):
        llama_module.NoSuchName  # noqa: B018
