"""Expert parallel and the MoE Llama: against an inline plain-torch reference on one process.

The reference computes every expert on every token (a dense einsum) and weights the outputs by
the router's top-k probabilities; its balance term is written from the definition
(`ultrascale.parallel.expert`): per row, f_i = E / (k T) x selections of expert i, each token adds
coef x sum_i f_i p_{t,i} to the loss sum, which is divided with the cross-entropy by the valid
labels of the global batch. None of ultrascale's routing, dispatch or loss code runs in it.
The data has prompt-masked labels (uneven valid counts per row, rank and micro-batch) and an
empty row.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils.data import DataLoader

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, grad_norm, parity_trainer, step_losses
from ultrascale.models.llama import LlamaConfig
from ultrascale.models.lm import LlamaLM

SEQ, BATCH, STEPS, VOCAB = 16, 4, 10, 256
AUX = 0.1  # large enough that a wrong scale of the balance term shows in the gradients


def masked_data(seed: int = 11) -> TokenDataset:
    return TokenDataset(STEPS * BATCH * 4, SEQ, VOCAB, seed=seed, masked=True, empty_rows=[5])


def moe_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=SEQ,
                n_experts=8, moe_top_k=2, moe_hidden_dim=32, moe_aux_loss_coef=AUX)
    return LlamaConfig(**{**base, **overrides})


def make_moe(**overrides) -> LlamaLM:
    return LlamaLM(config=moe_config(**overrides), learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0,
                   eps=1e-6)


# --------------------------------------------------------------------------- the reference


def _reference_moe_forward(moe, x, log):
    """Dense MoE from the definition: (B, T, H) -> (B, T, H); balance terms appended to `log`."""
    router, experts = moe.router, moe.experts
    n_experts, k = router.n_experts, router.top_k
    rows, seq, dim = x.shape
    flat = x.reshape(-1, dim)  # (N, H)
    logits = flat @ router.gate.weight.t()  # (N, E)
    probs = logits.float().softmax(-1)
    top = torch.topk(probs + router.expert_bias, k, dim=-1).indices  # (N, k)
    weights = probs.gather(-1, top)
    weights = weights / weights.sum(-1, keepdim=True)
    hidden = torch.einsum("nh,eih->nei", flat, experts.gate_up_proj)  # (N, E, 2I)
    gate, up = hidden.chunk(2, dim=-1)
    every = torch.einsum("nei,ehi->neh", F.silu(gate) * up, experts.down_proj)  # (N, E, H)
    mixing = torch.zeros_like(probs).scatter(1, top, weights)  # (N, E): the chosen experts' weights
    out = (every * mixing.unsqueeze(-1)).sum(1)
    picked = F.one_hot(top, n_experts).sum(1).view(rows, seq, n_experts).sum(1).float()  # (B, E)
    f = picked * n_experts / (k * seq)
    term = router.aux_loss_coef * (f.unsqueeze(1) * probs.view(rows, seq, n_experts)).sum()
    term = term + router.z_loss_coef * torch.logsumexp(logits.float(), -1).pow(2).sum()
    log["terms"].append(term)
    log["counts"].append(F.one_hot(top, n_experts).sum((0, 1)))
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x.reshape(rows, seq, dim)).reshape(-1, dim)
    return out.view(rows, seq, dim)


def reference_moe_run(module, dataset, *, global_batch, steps, clip=None):
    """One process, the whole global batch per step; loss = (CE sum + balance terms) / valid labels."""
    module = copy.deepcopy(module)
    module.configure_model()
    log = {"terms": [], "counts": []}
    for block in module.model.layers:
        block.feed_forward.forward = types.MethodType(lambda self, x: _reference_moe_forward(self, x, log), block.feed_forward)
    optimizer = module.configure_optimizers()["optimizer"]
    batches = iter(DataLoader(dataset, batch_size=global_batch, shuffle=False, drop_last=True))
    out = {"losses": [], "aux": [], "grads": None, "params": None, "grad_norms": []}
    for step in range(steps):
        batch = next(batches)
        log["terms"].clear(), log["counts"].clear()
        logits = module(batch["input_ids"])
        labels = batch["labels"]
        valid = (labels != -100).sum().clamp(min=1)
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        aux = sum(log["terms"])
        ((ce + aux) / valid).backward()
        out["losses"].append(float(ce.detach() / valid))
        out["aux"].append(float(aux.detach() / valid))
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        out["grad_norms"].append(grad_norm(module.parameters()))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # aux-loss-free balancing: the step's counts over the global batch
            for block, counts in zip(module.model.layers, log["counts"]):
                router = block.feed_forward.router
                if router.bias_update_rate:
                    router.expert_bias += router.bias_update_rate * torch.sign(counts.float().mean() - counts.float())
        if step == 0:
            out["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return out


def _train(rank, world_size, strategy_kwargs, config_overrides, global_batch, trainer_kwargs):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS, **trainer_kwargs)
    trainer.fit(make_moe(**config_overrides), ParityData(masked_data(), global_batch))
    logged = [m for _, m in sorted(recorder.logger.steps.items())]
    return {**recorder.result(), "aux": [m["moe/aux_loss"] for m in logged if "moe/aux_loss" in m],
            "grad_norms": [m["grad_norm"] for m in logged if "grad_norm" in m]}


def _check(world, strategy_kwargs, config_overrides=None, *, global_batch=BATCH, accumulate=1, clip=None):
    config_overrides = config_overrides or {}
    reference = reference_moe_run(make_moe(**config_overrides), masked_data(), global_batch=global_batch * accumulate,
                                  steps=STEPS, clip=clip)
    trainer_kwargs = {"accumulate_grad_batches": accumulate} if accumulate > 1 else {}
    if clip is not None:
        trainer_kwargs["gradient_clip_val"] = clip
    results = run_ranks(_train, world, strategy_kwargs, config_overrides, global_batch, trainer_kwargs)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    merged = {"grads": {}, "params": {}}
    for result in results:  # pipeline stages each record their own parameters
        for key in merged:
            merged[key].update(result[key])
    assert_parity(merged, reference, losses)
    assert_close(torch.tensor(results[0]["aux"]), torch.tensor(reference["aux"]), rtol=1e-5, atol=1e-6)
    if clip is not None:  # the clipped norm, every step: Adam's update hardly shows the clip's coefficient
        assert_close(torch.tensor(results[0]["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=2e-5, atol=0)
    return results


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("world, kwargs", [
    (1, {}),
    (2, {"expert_parallel": 2}),
    (4, {"expert_parallel": 4}),
    (4, {"expert_parallel": 2}),  # ep2 x ep_shard2: dp_shard 4, each expert on 2 ranks
], ids=["ep1", "ep2", "ep4", "ep2_dp4"])
def test_expert_parallel_parity(world, kwargs):
    _check(world, kwargs)


@pytest.mark.parametrize("kwargs", [
    {"zero_stage": 1, "zero_bucket_mb": 0.01},
    {"zero_stage": 2, "zero_bucket_mb": 0.01},
    pytest.param({"zero_stage": 2, "data_parallel_replicate": 2, "data_parallel_shard": 2}, marks=pytest.mark.slow),
    pytest.param({"zero_stage": 1, "pipeline_parallel": 2, "pipeline_microbatches": 2}, marks=pytest.mark.slow),
], ids=["zero1-ep2-dp4", "zero2-ep2-dp4", "zero2-ep2-hsdp2x2", "zero1-ep2-pp2"])
def test_zero12_with_expert_parallel(kwargs):
    """ZeRO-1/2 with ep2 (world 4): the experts are bucketed apart and cut over the ranks holding the same experts
    (two at dp4; one per replica under HSDP, then summed over the replicas), the rest over the dp ranks; a binding
    clip (the logged norm is compared every step), accumulation 2 without pipeline, small buckets at dp4."""
    pipeline = "pipeline_parallel" in kwargs
    _check(4, {"expert_parallel": 2, **kwargs}, {"n_shared_experts": 1}, accumulate=1 if pipeline else 2, clip=0.05)


def test_accumulation_aux_free_z_loss_shared_experts():
    """Two accumulation micro-batches per step; DeepSeek-V3's selection bias (moved from the step's global
    counts), a router z-loss and a shared expert, at ep2: the balance terms' gradient has the loss sum's scale."""
    overrides = {"moe_load_balance": "aux_free", "moe_bias_update_rate": 0.05, "moe_z_loss_coef": 1e-3,
                 "n_shared_experts": 1}
    _check(2, {"expert_parallel": 2}, overrides, accumulate=2)


def test_ep2_with_context_parallel():
    """ep borrows the cp ranks: cp=2 splits each row, so a row's expert counts are summed over cp."""
    _check(2, {"expert_parallel": 2, "context_parallel": 2, "data_parallel_shard": 1})


@pytest.mark.slow
def test_ep2_with_pipeline_parallel():
    """pp2 x ep2 (world 4): the balance terms of stage 0's layers join backward there (the loss is on stage 1)."""
    _check(4, {"expert_parallel": 2, "pipeline_parallel": 2, "pipeline_microbatches": 2})


@pytest.mark.slow
def test_ep2_with_hsdp():
    """dp_replicate 2 x dp_shard 2 with ep2: expert gradients are reduced over the replicas as well."""
    _check(4, {"expert_parallel": 2, "data_parallel_replicate": 2, "data_parallel_shard": 2})


# --------------------------------------------------------------------------- pieces, on one process


def test_grouped_mm_and_loop_match_dense_experts():
    from ultrascale.parallel.expert import run_experts

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2, 4, 1, 5, 0])  # an idle expert in the middle and at the end
    x = torch.randn(int(counts.sum()), 16, generator=g, requires_grad=True)
    gate_up, down = torch.randn(8, 24, 16, generator=g, requires_grad=True), torch.randn(8, 16, 12, generator=g, requires_grad=True)
    expert_of_row = torch.repeat_interleave(torch.arange(8), counts)
    hidden = torch.einsum("sh,sih->si", x, gate_up[expert_of_row])
    gate, up = hidden.chunk(2, -1)
    dense = torch.einsum("si,shi->sh", F.silu(gate) * up, down[expert_of_row])
    grad_out = torch.randn_like(dense)
    want = torch.autograd.grad(dense, (x, gate_up, down), grad_out)
    for grouped in (True, False):
        out = run_experts(x, counts, gate_up, down, grouped=grouped)
        assert_close(out, dense, rtol=1e-5, atol=1e-5)
        for got, ref in zip(torch.autograd.grad(out, (x, gate_up, down), grad_out), want):
            assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bf16_experts_combine_in_fp32_and_keep_no_fp32_copy_for_backward():
    """The weighted sum over a token's k experts runs in fp32 and rounds once, and what backward keeps of it is the
    experts' bf16 output, not an fp32 (S, H) copy (issue 48: 4·S·H bytes per MoE layer, now 2·S·H)."""
    from ultrascale.parallel.expert import experts_forward

    g = torch.Generator().manual_seed(0)
    n_tokens, hidden_size, top_k = 12, 16, 2
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.randn(4, 32, hidden_size, generator=g).bfloat16())
    experts.down_proj = torch.nn.Parameter(torch.randn(4, hidden_size, 16, generator=g).bfloat16())
    hidden = torch.randn(n_tokens, hidden_size, generator=g).bfloat16().requires_grad_(True)
    index = torch.randint(0, 4, (n_tokens, top_k), generator=g)
    weights = torch.rand(n_tokens, top_k, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = experts_forward(experts, hidden, index, weights)
    assert out.dtype == torch.bfloat16
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= n_tokens * hidden_size]
    per_copy = []  # written out: each token's experts one by one, the weighted sum in fp32
    for n in range(n_tokens):
        rows = []
        for j in range(top_k):
            e = index[n, j]
            gate, up = (hidden[n] @ experts.gate_up_proj[e].T).chunk(2)
            rows.append((F.silu(gate) * up) @ experts.down_proj[e].T)
        per_copy.append(sum(row.float() * weights[n, j] for j, row in enumerate(rows)))
    assert_close(out, torch.stack(per_copy).bfloat16(), rtol=2e-2, atol=2e-2)


def test_transposed_biased_clamped_experts_match_written_out():
    """GPT-OSS's experts (E, H, 2I) / (E, I, H) with per-expert biases and its own gate (interleaved halves,
    clamped, (up + 1) * gate * sigmoid(alpha gate)) through `apply_gate`: grouped and loop vs the formula."""
    from ultrascale.parallel.expert import run_experts

    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([2, 0, 4, 3, 0, 1])
    x = torch.randn(int(counts.sum()), 8, generator=g, requires_grad=True)
    gate_up = torch.randn(6, 8, 16, generator=g, requires_grad=True)  # (E, H, 2I), transposed
    down = torch.randn(6, 8, 8, generator=g, requires_grad=True)  # (E, I, H)
    b1, b2 = torch.randn(6, 16, generator=g, requires_grad=True), torch.randn(6, 8, generator=g, requires_grad=True)
    limit, alpha = 1.5, 1.702

    def gpt_oss_gate(h):
        gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    expert = torch.repeat_interleave(torch.arange(6), counts)
    hidden = torch.einsum("sh,shi->si", x, gate_up[expert]) + b1[expert]
    dense = torch.einsum("si,sih->sh", gpt_oss_gate(hidden), down[expert]) + b2[expert]
    grad_out = torch.randn_like(dense)
    inputs = (x, gate_up, down, b1, b2)
    want = torch.autograd.grad(dense, inputs, grad_out)
    for grouped in (True, False):
        out = run_experts(x, counts, gate_up, down, grouped=grouped, transposed=True, gate_up_bias=b1, down_bias=b2,
                          apply_gate=gpt_oss_gate)
        assert_close(out, dense, rtol=1e-5, atol=1e-5)
        for got, ref in zip(torch.autograd.grad(out, inputs, grad_out), want):
            assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_capacity_drops_over_capacity_copies_first_choices_first():
    from ultrascale.parallel.expert import capacity_mask

    chosen = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 1]])  # expert 0 is everyone's first choice
    kept = capacity_mask(chosen, n_experts=4, capacity_factor=1.0)  # capacity ceil(8 / 4) = 2 copies per expert
    assert kept.tolist() == [[0, 1], [0, 1], [4, 2], [4, 4]]  # 4 = dropped; first choices are served first


def test_capacity_factor_bounds_each_expert_and_zeroes_dropped_copies():
    model_config = moe_config(moe_capacity_factor=0.5)
    from ultrascale.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(model_config)
    tokens = torch.randint(0, VOCAB, (4, SEQ))
    model(tokens).sum().backward()
    load = model.layers[0].feed_forward.router._ultrascale_router_load
    capacity = math.ceil(0.5 * 4 * SEQ * 2 / 8)
    assert int(load.counts.max()) <= capacity
    assert int(load.dropped) == 4 * SEQ * 2 - int(load.counts.sum()) > 0


def _fit_nothing(rank, world_size, strategy_kwargs, module):
    import torch.distributed as dist

    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), Recorder(), 1)
    try:
        trainer.fit(module, ParityData(masked_data(), BATCH))
    except Exception as error:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(error).__name__}: {error}", "initialized": dist.is_initialized()}
    return {"error": None}


@pytest.mark.parametrize("kwargs, module, message", [
    ({"expert_parallel": 3}, lambda: make_moe(), "8 experts per layer, which ep=3 does not divide"),
    ({"expert_parallel": 2}, lambda: LlamaLM(config=moe_config(n_experts=0)), "needs a Mixture-of-Experts model"),
])
def test_bad_expert_layouts_fail_before_any_collective(kwargs, module, message):
    result = run_ranks(_fit_nothing, kwargs["expert_parallel"], kwargs, module())[0]
    assert message in result["error"]
    assert result["initialized"] is False


@pytest.mark.parametrize("kwargs", [
    {"sequence_parallel": False},
    {"sequence_parallel": True},
    {"sequence_parallel": True, "zero_stage": 1},
], ids=["tp2-ep2", "tp2-sp-ep2", "tp2-sp-ep2-zero1"])
def test_expert_parallel_with_tensor_parallel(kwargs):
    """EP x TP (world 4: tp 2 x dp_shard 2, ep 2 over the dp ranks): attention, the shared expert and the head split
    over tp, each routed expert whole on its ep rank; each tp rank dispatches half of the token copies, so without
    the gather of the outputs, the tp sum of the experts' gradients or the gather of the inputs' gradients in
    backward this fails. Accumulation 2, a binding clip (its norm compared every step), shared experts."""
    _check(4, {"expert_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 2, **kwargs}, {"n_shared_experts": 1},
           accumulate=2, clip=0.05)


def test_ep_must_divide_dp_shard_times_cp():
    with pytest.raises(ValueError, match=r"`ep=4` must divide dp_shard\(2\) \* cp\(1\) = 2"):
        ultrascale.UltraScaleStrategy(expert_parallel=4, data_parallel_shard=2, data_parallel_replicate=2).resolve_dims(4)


# --------------------------------------------------------------------------- Hugging Face MoE checkpoints


def reference_hf_moe_run(path, dataset, *, global_batch, steps, aux_coef):
    """One process: transformers' own model and MoE code (`from_pretrained`), plain AdamW as `make_hf` configures
    it; the balance terms are computed from each router's logits and choices by a hook written here."""
    import transformers

    from tests._parity import make_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    terms = []

    def router_hook(module, args, output):
        logits, _, chosen = output  # (B T, E), (B T, k) of the batch's rows in order
        n_experts, k = logits.shape[-1], chosen.shape[-1]
        probs = logits.float().softmax(-1).view(global_batch, SEQ, n_experts)
        f = F.one_hot(chosen, n_experts).sum(1).view(global_batch, SEQ, n_experts).sum(1).float() * n_experts / (k * SEQ)
        terms.append(aux_coef * (f.unsqueeze(1) * probs).sum())

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(router_hook)
    hp = make_hf(path).hparams  # the optimizer settings only; AdamW is built here
    decay = [p for p in model.parameters() if p.ndim >= 2]
    flat = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay}, {"params": flat, "weight_decay": 0.0}],
                                  lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps)
    batches = iter(DataLoader(dataset, batch_size=global_batch, shuffle=False, drop_last=True))
    out = {"losses": [], "aux": [], "grads": None, "params": None, "grad_norms": []}
    for step in range(steps):
        batch = next(batches)
        terms.clear()
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        labels = batch["labels"]
        valid = (labels != -100).sum().clamp(min=1)
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        aux = sum(terms)
        ((ce + aux) / valid).backward()
        out["losses"].append(float(ce.detach() / valid))
        out["aux"].append(float(aux.detach() / valid))
        if step == 0:
            out["grads"] = {f"model.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}
        out["grad_norms"].append(grad_norm(model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            out["params"] = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    return out, model


def expert_layouts(module) -> dict[str, tuple]:
    """Layer 0's expert weights held as DTensors: (local shape, placements, global shape) by name."""
    from torch.distributed.tensor import DTensor

    return {name: (tuple(p.to_local().shape), str(p.placements), tuple(p.shape)) for name, p in module.named_parameters()
            if "layers.0." in name and "experts" in name and isinstance(p, DTensor)}


def _train_hf(rank, world_size, path, strategy_kwargs, export_dir):
    from tests._parity import make_hf

    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    module = make_hf(path, export_dir=export_dir, router_aux_loss_coef=AUX)
    trainer.fit(module, ParityData(masked_data(), BATCH))
    aux = [m["moe/aux_loss"] for _, m in sorted(recorder.logger.steps.items()) if "moe/aux_loss" in m]
    return {**recorder.result(), "aux": aux, "layouts": expert_layouts(module)}


def check_hf_moe_parity_and_export(tmp_path, arch: str, world: int, strategy_kwargs: dict) -> list[dict]:
    """Fine-tuning an HF MoE checkpoint of `arch` under `strategy_kwargs` equals transformers' own model on one
    process (masked data, balance terms included), and the exported folder, back in the checkpoint's per-expert
    layout, holds the one-process weights. Returns the ranks' results."""
    import transformers
    from safetensors.torch import load_file

    from tests._parity import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "source", arch, vocab_size=VOCAB, hidden_size=32)
    reference, reference_model = reference_hf_moe_run(path, masked_data(), global_batch=BATCH, steps=STEPS, aux_coef=AUX)
    results = run_ranks(_train_hf, world, path, strategy_kwargs, str(tmp_path / "export"))
    losses = step_losses(results)
    # Weights after step 1 within 3e-5, as in the other HF tests: Adam's first step amplifies reduction-order noise.
    assert_parity(results[0], reference, losses)
    assert_close(torch.tensor(results[0]["aux"]), torch.tensor(reference["aux"]), rtol=1e-5, atol=1e-6)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    for (name, got), (_, want) in zip(exported.state_dict().items(), reference_model.state_dict().items()):
        assert_close(got, want, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")
    on_disk = {k for f in (tmp_path / "export").glob("*.safetensors") for k in load_file(f)}
    assert any(".experts.0." in k for k in on_disk), "the export keeps the checkpoint's per-expert layout"
    return results


@pytest.mark.parametrize("arch, world, kwargs", [
    ("mixtral", 2, {"expert_parallel": 2}),
    ("qwen3_moe", 4, {"expert_parallel": 2}),  # ep2 x ep_shard2
])
def test_hf_moe_expert_parallel_parity_and_export(tmp_path, arch, world, kwargs):
    """Under ep: each rank holds its experts whole (E / ep of them, FSDP-sharded over the ranks holding the same)."""
    results = check_hf_moe_parity_and_export(tmp_path, arch, world, kwargs)
    gate_up = next(v for k, v in results[0]["layouts"].items() if k.endswith("experts.gate_up_proj"))
    assert gate_up[0][0] * world == gate_up[2][0] and gate_up[0][1:] == gate_up[2][1:], gate_up


@pytest.mark.parametrize("arch, kwargs", [
    ("qwen3_moe", {}),
    ("mixtral", {"zero_stage": 2}),
], ids=["qwen3_moe", "mixtral-zero2"])
def test_hf_moe_expert_parallel_with_tensor_parallel(tmp_path, arch, kwargs):
    """HF MoE at tp 2 x ep 2 (world 4): transformers' TP plan without its expert entries (the experts split over
    ep instead, whole on each rank); parity and the export as above."""
    results = check_hf_moe_parity_and_export(tmp_path, arch, 4, {"expert_parallel": 2, "tensor_parallel": 2,
                                                                  "data_parallel_shard": 2, **kwargs})
    gate_up = next(v for k, v in results[0]["layouts"].items() if k.endswith("experts.gate_up_proj"))
    assert gate_up[0][0] * 2 == gate_up[2][0] and gate_up[0][1:] == gate_up[2][1:], gate_up  # E / ep, each whole


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_hf_moe_expert_parallel_under_zero12(tmp_path, zero_stage):
    """HF Qwen3-MoE at ep2 x ep_shard 2 under ZeRO-1/2: each rank holds its ep rank's experts whole (the optimizer
    state, and under ZeRO-2 the gradients, cut over the two ranks holding them); parity and the export as above."""
    results = check_hf_moe_parity_and_export(tmp_path, "qwen3_moe", 4, {"expert_parallel": 2, "zero_stage": zero_stage})
    gate_up = next(v for k, v in results[0]["layouts"].items() if k.endswith("experts.gate_up_proj"))
    assert gate_up[0][0] * 2 == gate_up[2][0] and gate_up[0][1:] == gate_up[2][1:], gate_up


# --------------------------------------------------------------------------- resume and balance


STOP, TOTAL = 4, 8


def _fit(rank, world_size, strategy_kwargs, max_steps, ckpt_dir, resume_from):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ultrascale.data import CausalLMDataModule

    recorder = Recorder()
    callbacks = [recorder]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=STOP, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**strategy_kwargs),
        max_steps=max_steps, logger=recorder.logger, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(ckpt_dir), limit_val_batches=0,
    )
    # Aux-loss-free balancing: the selection bias is a buffer the checkpoint must carry.
    module = make_moe(vocab_size=258, moe_load_balance="aux_free", moe_bias_update_rate=0.05, moe_z_loss_coef=1e-3)
    data = CausalLMDataModule(seq_len=SEQ, global_batch_size=8, max_tokens=30_000, val_fraction=0.1, seed=3)
    trainer.fit(module, data, ckpt_path=resume_from)
    bias = trainer.lightning_module.model.layers[0].feed_forward.router.expert_bias.clone()
    return {"losses": recorder.losses, "step": trainer.global_step, "bias": bias}


@pytest.mark.slow
def test_checkpoint_from_ep2_resumes_at_ep1(tmp_path):
    """Expert weights keep their global shape and names (DTensor shards of the expert dim): an ep=2 checkpoint
    resumes on one process on the uninterrupted curve, selection bias included."""
    uninterrupted = run_ranks(_fit, 2, {"expert_parallel": 2}, TOTAL, str(tmp_path), None)  # saves at STOP too
    resumed = run_ranks(_fit, 1, {}, TOTAL, None, str(tmp_path / f"epoch=0-step={STOP}.ckpt"))[0]
    _assert_resumed_on_the_curve(resumed, uninterrupted)
    # ZeRO-3's parameter-shaped optimizer state, read into ZeRO-2's expert buckets at ep2
    resumed = run_ranks(_fit, 2, {"expert_parallel": 2, "zero_stage": 2}, TOTAL, None,
                        str(tmp_path / f"epoch=0-step={STOP}.ckpt"))[0]
    _assert_resumed_on_the_curve(resumed, uninterrupted)


def _assert_resumed_on_the_curve(resumed: dict, uninterrupted: list[dict]) -> None:
    assert resumed["step"] == TOTAL
    assert_close(torch.tensor(resumed["losses"]), torch.tensor(step_losses(uninterrupted)[STOP:]), rtol=0, atol=1e-5)
    assert resumed["bias"].abs().sum() > 0
    assert_close(resumed["bias"], uninterrupted[0]["bias"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_zero1_expert_parallel_checkpoint_resumes_at_its_layout_and_under_zero3(tmp_path):
    """ZeRO-1 at ep2 x ep_shard 2: each expert's state is saved parameter-shaped on ((ep, ep_shard), Shard(0) twice).
    It resumes on the uninterrupted curve at its own layout and as ZeRO-3 at ep2 on two processes."""
    layout = {"expert_parallel": 2, "zero_stage": 1, "zero_bucket_mb": 0.01}
    uninterrupted = run_ranks(_fit, 4, layout, TOTAL, str(tmp_path), None)
    checkpoint = str(tmp_path / f"epoch=0-step={STOP}.ckpt")
    _assert_resumed_on_the_curve(run_ranks(_fit, 4, layout, TOTAL, None, checkpoint)[0], uninterrupted)
    _assert_resumed_on_the_curve(run_ranks(_fit, 2, {"expert_parallel": 2}, TOTAL, None, checkpoint)[0], uninterrupted)


def _balance_curve(rank: int, world_size: int, mode: str, steps: int = 60) -> list[float]:
    import lightning as L

    from ultrascale.data import CausalLMDataModule

    config = moe_config(vocab_size=258, max_seq_len=64, moe_load_balance=mode, moe_bias_update_rate=0.01)
    module = LlamaLM(config=config, learning_rate=1e-2, warmup_steps=1, max_steps=steps)
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ultrascale.UltraScaleStrategy(), max_steps=steps,
                        logger=recorder.logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder], limit_val_batches=0)
    trainer.fit(module, CausalLMDataModule(seq_len=64, global_batch_size=8, max_tokens=100_000, val_fraction=0.05, seed=3))
    return [metrics["moe/balance"] for _, metrics in sorted(recorder.logger.steps.items()) if "moe/balance" in metrics]


def test_load_balancing_evens_the_experts_and_its_absence_does_not():
    """`moe/balance` = max / mean tokens per expert (1 = even, 4 = two of eight experts take everything).
    On the tiny corpus the router first collapses onto a few experts; with a balance loss (coef 0.1) or
    DeepSeek-V3's selection bias the spread then shrinks, without either it stays. Measured on this
    machine: peak ~4.0 in all three; last 10 steps ~1.8 (aux loss), ~2.2 (bias), ~3.5 (none)."""
    # In a forked process: the process group a one-device fit creates must not outlive the test.
    curves = {mode: run_ranks(_balance_curve, 1, mode)[0] for mode in ("aux_loss", "aux_free", "none")}
    peak = {mode: max(curve[:10]) for mode, curve in curves.items()}
    final = {mode: sum(curve[-10:]) / 10 for mode, curve in curves.items()}
    assert final["aux_loss"] < 0.6 * peak["aux_loss"], (peak, final)
    assert final["aux_free"] < 0.75 * peak["aux_free"], (peak, final)
    assert final["none"] > 0.8 * peak["none"], (peak, final)
    assert final["aux_loss"] < final["none"] - 1.0 and final["aux_free"] < final["none"] - 0.5, final


def test_moe_llama_under_lightnings_own_strategy():
    """Outside ultrascale's strategies the step's loss is the micro-batch mean; the balance terms follow it
    (divided by the same valid tokens), so one device equals the reference too."""
    recorder = Recorder()
    trainer = parity_trainer(1, "auto", recorder, STEPS)
    trainer.fit(make_moe(), ParityData(masked_data(), BATCH))
    reference = reference_moe_run(make_moe(), masked_data(), global_batch=BATCH, steps=STEPS)
    assert_parity(recorder.result(), reference, recorder.losses)
