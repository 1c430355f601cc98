"""Tensor + sequence + loss parallel against a single-process run (fp32), alone and with ZeRO-3/HSDP."""

import pytest

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from ultrascale.models.llama import LlamaConfig
from ultrascale.models.lm import LlamaLM

SEQ, BATCH, STEPS = 32, 8, 10


def make_llama(n_kv_heads: int = 2) -> LlamaLM:
    config = LlamaConfig.from_preset("tiny", n_kv_heads=n_kv_heads)
    return LlamaLM(config=config, learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def data() -> TokenDataset:
    return TokenDataset(STEPS * BATCH, SEQ, vocab_size=512, seed=2, masked=True)


def _train(rank, world_size, strategy_kwargs, n_kv_heads, accumulate=1, clip=None):
    recorder = Recorder()
    strategy = ultrascale.UltraScaleStrategy(**strategy_kwargs)
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, accumulate_grad_batches=accumulate,
                             gradient_clip_val=clip)
    model = make_llama(n_kv_heads)
    trainer.fit(model, ParityData(data(), BATCH))
    wq = model.model.layers[0].attention.wq.weight
    norm = model.model.layers[0].attention_norm.weight
    return {
        **recorder.result(),
        "wq_placements": [str(p) for p in wq.placements],
        "wq_local_shape": tuple(wq.to_local().shape),
        # Sequence parallel keeps the norms' weights as DTensors on the tp axis (FSDP adds the dp axis).
        "norm_mesh_axes": norm.device_mesh.mesh_dim_names,
        "mesh": trainer.strategy.parallel_dims.describe(),
    }


CASES = {
    # name: (world, strategy kwargs, n_kv_heads, expected wq local rows = 64 / (tp * dp_shard_cp), SP on)
    "tp2-sp": (2, {"tensor_parallel": 2, "data_parallel_shard": 1}, 2, 32, True),
    "tp2-nosp": (2, {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": False}, 2, 32, False),
    "tp2-sp-gathered-logits": (2, {"tensor_parallel": 2, "data_parallel_shard": 1, "loss_parallel": False}, 2, 32, True),
    "tp4-sp": (4, {"tensor_parallel": 4, "data_parallel_shard": 1}, 4, 16, True),
    "dp2xtp2": (4, {"tensor_parallel": 2, "data_parallel_shard": 2}, 2, 16, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_parity(case):
    world, kwargs, kv, local_rows, sequence_parallel = CASES[case]
    reference = reference_run(make_llama(kv), data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_train, world, kwargs, kv)
    assert results[0]["wq_local_shape"] == (local_rows, 64)  # really sharded: (n_heads*hd / (tp*dp), dim)
    assert ("tp" in results[0]["norm_mesh_axes"]) == sequence_parallel
    assert_parity(results[0], reference, step_losses(results))


@pytest.mark.slow
def test_hsdp_x_tp_world8_with_accumulation_and_clipping():
    kwargs = {"data_parallel_replicate": 2, "data_parallel_shard": 2, "tensor_parallel": 2}
    reference = reference_run(make_llama(), TokenDataset(STEPS * BATCH * 2, SEQ, 512, seed=2, masked=True),
                              global_batch=BATCH, steps=STEPS, accumulate=2, clip=0.05)
    results = run_ranks(_train_accum, 8, kwargs)
    assert results[0]["mesh"] == "pp=1 x dp_replicate=2 x dp_shard=2 x cp=1 x tp=2 (world 8)"
    # (dp_replicate, dp_shard, tp): replicated, FSDP's strided shard of dim 0 on top of TP's shard of dim 0
    assert results[0]["wq_placements"] == ["R", "_S(0, 2)", "S(0)"]
    assert_parity(results[0], reference, step_losses(results))


def _train_accum(rank, world_size, kwargs):
    global data
    original = data
    data = lambda: TokenDataset(STEPS * BATCH * 2, SEQ, 512, seed=2, masked=True)  # noqa: E731
    try:
        return _train(rank, world_size, kwargs, 2, accumulate=2, clip=0.05)
    finally:
        data = original
