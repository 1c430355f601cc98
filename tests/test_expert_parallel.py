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
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, step_losses
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


def reference_moe_run(module, dataset, *, global_batch, steps):
    """One process, the whole global batch per step; loss = (CE sum + balance terms) / valid labels."""
    module = copy.deepcopy(module)
    module.configure_model()
    log = {"terms": [], "counts": []}
    for block in module.model.layers:
        block.feed_forward.forward = types.MethodType(lambda self, x: _reference_moe_forward(self, x, log), block.feed_forward)
    optimizer = module.configure_optimizers()["optimizer"]
    batches = iter(DataLoader(dataset, batch_size=global_batch, shuffle=False, drop_last=True))
    out = {"losses": [], "aux": [], "grads": None, "params": None}
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
    aux = [m["moe/aux_loss"] for _, m in sorted(recorder.logger.steps.items()) if "moe/aux_loss" in m]
    return {**recorder.result(), "aux": aux}


def _check(world, strategy_kwargs, config_overrides=None, *, global_batch=BATCH, accumulate=1):
    config_overrides = config_overrides or {}
    reference = reference_moe_run(make_moe(**config_overrides), masked_data(), global_batch=global_batch * accumulate,
                                  steps=STEPS)
    trainer_kwargs = {"accumulate_grad_batches": accumulate} if accumulate > 1 else {}
    results = run_ranks(_train, world, strategy_kwargs, config_overrides, global_batch, trainer_kwargs)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    merged = {"grads": {}, "params": {}}
    for result in results:  # pipeline stages each record their own parameters
        for key in merged:
            merged[key].update(result[key])
    assert_parity(merged, reference, losses)
    assert_close(torch.tensor(results[0]["aux"]), torch.tensor(reference["aux"]), rtol=1e-5, atol=1e-6)
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
