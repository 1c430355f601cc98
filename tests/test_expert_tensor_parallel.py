"""Tensor parallel on Mixture-of-Experts models (expert tensor parallel): every tp rank runs every expert
with 1/tp of its intermediate width (transformers' 'moe_tp_experts' / 'packed_colwise' / 'rowwise').

The built-in MoE Llama against the inline dense reference of `tests/test_expert_parallel.py` (every expert
on every token, balance terms from their definition); Hugging Face MoE checkpoints against transformers'
own model on one process. Masked data (prompt-masked rows, an empty row) throughout.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, assert_parity, parity_trainer, step_losses
from tests.test_expert_parallel import (
    BATCH,
    STEPS,
    STOP,
    TOTAL,
    _fit,
    check_hf_moe_parity_and_export,
    expert_layouts,
    make_moe,
    masked_data,
    reference_moe_run,
)


def _train(rank, world_size, strategy_kwargs, overrides, accumulate):
    recorder = Recorder()
    trainer_kwargs = {"accumulate_grad_batches": accumulate} if accumulate > 1 else {}
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS, **trainer_kwargs)
    module = make_moe(**overrides)
    trainer.fit(module, ParityData(masked_data(), BATCH))
    aux = [m["moe/aux_loss"] for _, m in sorted(recorder.logger.steps.items()) if "moe/aux_loss" in m]
    tokens = [m["moe/expert_tokens/0"] for _, m in sorted(recorder.logger.steps.items()) if "moe/expert_tokens/0" in m]
    return {**recorder.result(), "aux": aux, "tokens": tokens, "layouts": expert_layouts(module)}


@pytest.mark.parametrize("world, kwargs, overrides, accumulate", [
    (2, {"tensor_parallel": 2}, {}, 1),  # sequence + loss parallel (the built-in Llama's defaults)
    (2, {"tensor_parallel": 2, "sequence_parallel": False}, {"n_shared_experts": 1}, 1),
    # tp2 x dp_shard2 (FSDP over the expert shards), two accumulation micro-batches, DeepSeek-V3's selection
    # bias, a router z-loss and a shared expert
    (4, {"tensor_parallel": 2, "data_parallel_shard": 2},
     {"moe_load_balance": "aux_free", "moe_bias_update_rate": 0.05, "moe_z_loss_coef": 1e-3, "n_shared_experts": 1}, 2),
    # with the other dimensions: the row's expert counts summed over cp, experts FSDP-sharded over dp_shard x cp
    (4, {"tensor_parallel": 2, "context_parallel": 2, "data_parallel_shard": 1}, {}, 1),
    pytest.param(4, {"tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_microbatches": 2}, {}, 1, marks=pytest.mark.slow),
    pytest.param(4, {"tensor_parallel": 2, "data_parallel_replicate": 2, "data_parallel_shard": 1}, {}, 1,
                 marks=pytest.mark.slow),
], ids=["tp2-sp", "tp2-shared", "tp2xdp2-accumulate", "tp2xcp2", "pp2xtp2", "hsdp2xtp2"])
def test_moe_llama_expert_tensor_parallel_parity(world, kwargs, overrides, accumulate):
    reference = reference_moe_run(make_moe(**overrides), masked_data(), global_batch=BATCH * accumulate, steps=STEPS)
    results = run_ranks(_train, world, kwargs, overrides, accumulate)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    merged = {"grads": {}, "params": {}, "layouts": {}}
    for result in results:  # pipeline stages each record their own parameters
        for key in merged:
            merged[key].update(result[key])
    assert_parity(merged, reference, losses)
    # The balance terms and token counts are logged once, not once per tp rank.
    assert_close(torch.tensor(results[0]["aux"]), torch.tensor(reference["aux"]), rtol=1e-5, atol=1e-6)
    layouts = merged["layouts"]
    gate_up = next(v for k, v in layouts.items() if k.endswith("experts.gate_up_proj"))
    down = next(v for k, v in layouts.items() if k.endswith("experts.down_proj"))
    # 8 experts, I = 32: each tp rank holds [gate; up] rows 2 * 32 / 2 = 32 and down's I / 2 = 16 columns
    # (and 8 / dp_shard experts under FSDP).
    experts = 8 // (kwargs.get("data_parallel_shard", 1) * kwargs.get("context_parallel", 1))
    assert gate_up[0] == (experts, 32, 32) and "_StridedShard(dim=1, sf=2)" in gate_up[1], gate_up
    assert down[0] == (experts, 32, 16), down


@pytest.mark.slow
def test_tp2_checkpoint_resumes_at_tp2_and_on_one_process(tmp_path):
    """A packed [gate; up] split is two boxes of the global tensor per rank, which DCP cannot write: the
    checkpoint lays it out plainly (`dcp_storable`). It resumes on the uninterrupted curve at tp2 (read
    back into the packed split) and on one process (another layout), weights, Adam state and the aux-loss-free
    selection bias."""
    tp2 = {"tensor_parallel": 2}
    uninterrupted = step_losses(run_ranks(_fit, 2, tp2, TOTAL, str(tmp_path), None))  # saves at STOP too
    checkpoint = str(tmp_path / f"epoch=0-step={STOP}.ckpt")
    again = step_losses(run_ranks(_fit, 2, tp2, TOTAL, None, checkpoint))
    alone = run_ranks(_fit, 1, {}, TOTAL, None, checkpoint)[0]
    assert alone["step"] == TOTAL
    assert_close(torch.tensor(again), torch.tensor(uninterrupted[STOP:]), rtol=0, atol=1e-5)
    assert_close(torch.tensor(alone["losses"]), torch.tensor(uninterrupted[STOP:]), rtol=0, atol=1e-5)
    assert alone["bias"].abs().sum() > 0


# --------------------------------------------------------------------------- Hugging Face MoE checkpoints


@pytest.mark.parametrize("arch, world, kwargs", [
    ("mixtral", 2, {"tensor_parallel": 2}),
    ("qwen2_moe", 4, {"tensor_parallel": 2, "data_parallel_shard": 2}),  # a gated shared expert beside the routed ones
    ("qwen3_moe", 2, {"tensor_parallel": 2}),  # per-head q/k norms ('replicated_with_grad_allreduce') beside the experts
])
def test_hf_moe_tensor_parallel_parity_and_export(tmp_path, arch, world, kwargs):
    """The plan the checkpoint's config ships ('moe_tp_experts' with 'packed_colwise' / 'rowwise' expert weights)
    equals transformers' own model on one process, and the exported folder holds the one-process weights."""
    results = check_hf_moe_parity_and_export(tmp_path, arch, world, kwargs)
    gate_up = next(v for k, v in results[0]["layouts"].items() if k.endswith("experts.gate_up_proj"))
    # (E / dp_shard, 2I / tp, H): each rank holds half of gate and half of up.
    assert gate_up[0][1] * 2 == gate_up[2][1] and "_StridedShard(dim=1, sf=2)" in gate_up[1], gate_up


def _train_recomputed(rank, world_size):
    from ultrascale.callbacks import ActivationCheckpointing

    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(tensor_parallel=2), recorder, STEPS,
                             callbacks=[ActivationCheckpointing()])
    trainer.fit(make_moe(), ParityData(masked_data(), BATCH))
    return recorder.result()


def test_expert_tensor_parallel_under_activation_checkpointing():
    """The recomputed forward runs the experts' hooks again (local shards, the input all-reduce in backward):
    still one all-reduce per gradient, the same numbers as one process."""
    reference = reference_moe_run(make_moe(), masked_data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_train_recomputed, 2)
    # named_parameters shows the checkpoint wrapper; the reference has none
    unwrapped = {key: {name.replace("_checkpoint_wrapped_module.", ""): value for name, value in results[0][key].items()}
                 for key in ("grads", "params")}
    assert_parity(unwrapped, reference, step_losses(results))
