"""Strategy front door: registry names, clear errors before any collective, launchers, meta init."""

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, parity_trainer
from ultrascale import HSDPStrategy, UltraScaleStrategy, ZeRO3Strategy
from ultrascale.models.lm import LlamaLM


def trainer(strategy, devices=4, **kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, **kwargs)


def test_registered_names():
    for name, cls in [
        ("ultrascale_4d", UltraScaleStrategy),
        ("ultrascale_zero1", ultrascale.ZeRO1Strategy),
        ("ultrascale_zero2", ultrascale.ZeRO2Strategy),
        ("ultrascale_zero3", ZeRO3Strategy),
        ("ultrascale_hsdp", HSDPStrategy),
        ("ultrascale_tp", ultrascale.TensorParallelStrategy),
    ]:
        assert name in StrategyRegistry
        assert isinstance(trainer(name).strategy, cls)


@pytest.mark.parametrize(
    "strategy, devices, match",
    [
        (UltraScaleStrategy(data_parallel_replicate=3), 4, r"cannot infer `dp_shard`.*divide world size 4"),
        (UltraScaleStrategy(data_parallel_replicate=2, data_parallel_shard=3), 4,
         r"dp_replicate\(2\) \* dp_shard\(3\) \* cp\(1\) \* tp\(1\) \* pp\(1\) != world size\(4\)"),
        (HSDPStrategy(), 3, r"cannot infer `dp_shard`.*dp_replicate\(2\)"),
        (HSDPStrategy(data_parallel_replicate=8), 4, r"divide world size 4"),
    ],
)
def test_invalid_layout_fails_at_trainer_construction(strategy, devices, match):
    with pytest.raises(ValueError, match=match):
        trainer(strategy, devices=devices)
    assert not dist.is_initialized()


def test_not_yet_built_combinations_fail_clearly():
    # accelerate's async TP is ultrascale's `async_tensor_parallel`: an inductor pass, so it needs compile.
    with pytest.raises(ValueError, match=r"`async_tensor_parallel=True` is a pass of inductor's .* `compile=True`"):
        UltraScaleStrategy.from_accelerate({"tp_size": 2, "tp_handler": {"enable_async_tp": True}})
    assert UltraScaleStrategy.from_accelerate({"tp_size": 2, "tp_handler": {"enable_async_tp": True}},
                                              compile=True).async_tensor_parallel
    UltraScaleStrategy(expert_parallel=2, tensor_parallel=2, zero_stage=1)  # EP x TP and ZeRO-1 x EP are built


def test_zero_stage():
    with pytest.raises(ValueError, match="choose 1, 2 or 3"):
        UltraScaleStrategy(zero_stage=4)
    with pytest.raises(ValueError, match="zero_bucket_mb=0"):
        UltraScaleStrategy(zero_stage=2, zero_bucket_mb=0)


def test_bad_knob_values():
    with pytest.raises(ValueError, match="launcher='spawn'"):
        UltraScaleStrategy(launcher="spawn")
    with pytest.raises(ValueError, match="data_parallel_replicate=0"):
        HSDPStrategy(data_parallel_replicate=0)


def test_unsupported_precision():
    with pytest.raises(ValueError, match=r"supports `precision` in \('32-true', 'bf16-mixed', 'bf16-true', '64-true'\).*16-true"):
        trainer("ultrascale_zero3", precision="16-true")


def test_fp16_mixed_is_refused_and_lightning_turns_it_into_bf16_on_cpu():
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ultrascale.ZeRO3Strategy()
    with pytest.raises(ValueError, match=r"supports `precision` in .*16-mixed"):
            strategy.precision_plugin = MixedPrecision("16-mixed", "cuda")  # what a GPU Trainer hands the strategy
    # On CPU Lightning's connector rewrites the flag before any strategy sees it, and says so.
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        plugin = trainer("ultrascale_zero3", precision="16-mixed").strategy.precision_plugin
    assert plugin.precision == "bf16-mixed"


def test_precision_mapping():
    for name, dtype in (("32-true", torch.float32), ("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16),
                        ("64-true", torch.float64)):  # 64-true: Lightning's DoublePrecision, translated
        plugin = trainer("ultrascale_zero3", precision=name).strategy.precision_plugin
        assert isinstance(plugin, ultrascale.UltraScalePrecision) and plugin.precision == name
        assert plugin.param_dtype == dtype, name
    policy = trainer("ultrascale_zero3", precision="bf16-mixed").strategy.precision_plugin.mixed_precision_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_fork_launcher_inside_pytest():
    """No torchrun env vars: the strategy launches its own ranks, by forking (the default under pytest)."""
    t = trainer("ultrascale_zero3", devices=2, max_steps=3, enable_checkpointing=False, enable_progress_bar=False)
    assert type(t.strategy.launcher).__name__ == "ForkLauncher"
    t.fit(LlamaLM(preset="tiny", max_steps=3), ParityData(TokenDataset(48, 16, 512), 8))
    assert torch.isfinite(t.callback_metrics["train_loss"])
    # As with Lightning's spawn launchers, metrics and the trainer state come back to the parent.
    assert t.state.finished and not dist.is_initialized()


def test_single_process_trains_in_this_process():
    t = trainer("ultrascale_zero3", devices=1, max_steps=3, enable_checkpointing=False, enable_progress_bar=False)
    assert type(t.strategy.launcher).__name__ == "SubprocessScriptLauncher"  # starts no child for one process
    model = LlamaLM(preset="tiny", max_steps=3)
    try:
        t.fit(model, ParityData(TokenDataset(48, 16, 512), 8))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # forked tests after this one must not inherit it
    assert t.global_step == 3
    assert t.strategy.parallel_dims.describe() == "pp=1 x dp_replicate=1 x dp_shard=1 x cp=1 x tp=1 (world 1)"


def _meta_init(rank, world_size):
    recorder = Recorder()
    t = parity_trainer(world_size, UltraScaleStrategy(meta_init=True), recorder, 5)
    model = LlamaLM(preset="tiny", learning_rate=3e-3, warmup_steps=1, max_steps=100)
    t.fit(model, ParityData(TokenDataset(8, 16, 512), 8))  # one global batch, seen 5 times: learnable
    embedding = model.model.tok_embeddings.weight
    local = embedding.to_local()
    return {"local_std": float(local.std()), "local_rows": local.shape[0], "device": str(local.device),
            "losses": recorder.losses, "initial_rope": float(model.model.rope_cos[1, 0])}


def test_meta_init_materialises_each_shard():
    results = run_ranks(_meta_init, 2)
    for result in results:
        assert result["local_rows"] == 256 and result["device"] == "cpu"  # 512-row embedding, sharded on dim 0
        assert 0.015 < result["local_std"] < 0.025  # init_std 0.02 (weights were initialised, not left empty)
        assert abs(result["initial_rope"] - torch.cos(torch.tensor(1.0)).item()) < 1e-5  # RoPE buffers recomputed
    losses = results[0]["losses"]
    assert abs(losses[0] - math.log(512)) < 0.05  # a freshly initialised model predicts ~uniformly
    assert losses[-1] < losses[0] - 0.5  # and it trains: 5 steps on one batch (measured 6.25 -> 4.96)


@pytest.mark.parametrize("cls, knob", [
    (ultrascale.ZeRO1Strategy, "meta_init"),
    (ultrascale.ZeRO2Strategy, "reshard_after_forward"),
    (ultrascale.ZeRO3Strategy, "zero_bucket_mb"),
    (ultrascale.HSDPStrategy, "tensor_parallel"),
    (ultrascale.TensorParallelStrategy, "accumulate_grads_in_fp32"),
])
def test_shared_knobs_are_declared_once_and_strangers_refused(cls, knob):
    """The process and FSDP knobs live in one TypedDict each; LightningCLI still sees them, typed."""
    from jsonargparse import ArgumentParser

    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got unexpected keyword argument\(s\) \['{knob}'\]"):
        cls(**{knob: 1})
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "strategy")
    parsed = parser.parse_args(["--strategy.timeout=0:00:07", "--strategy.launcher=fork", "--strategy.sync_module_states=false"])
    strategy = cls(**vars(parsed.strategy))
    assert strategy.process_config.timeout.total_seconds() == 7 and strategy.process_config.launcher == "fork"
    assert strategy.sync_module_states is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy.launcher=nonsense"])


def test_model_errors_come_once_before_any_rank_starts(tmp_path, monkeypatch):
    """Checks that need only the module's config run in the launching process: one error naming the
    user's class, no rank forked, no process group."""
    import os

    # A one-process fit earlier in this pytest process leaves Lightning's rank variables set, which would
    # make this Trainer believe an outer launcher started it (and wait for a second rank).
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)

    import lightning as L
    import torch.distributed as dist
    import transformers

    from ultrascale.models.hf import HFCausalLM
    from ultrascale.models.lm import LlamaLM

    forks = []
    real_fork = os.fork

    def counting_fork():
        forks.append(1)
        return real_fork()

    def fit(strategy, module):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        os.fork = counting_fork
        try:
            with pytest.raises(ValueError) as raised:
                trainer.fit(module)
        finally:
            os.fork = real_fork
        return str(raised.value)

    from ultrascale.models.llama import LlamaConfig

    message = fit(UltraScaleStrategy(tensor_parallel=2),
                  LlamaLM(config=LlamaConfig(vocab_size=64, dim=48, n_layers=2, n_heads=3, n_kv_heads=3, ffn_hidden_dim=64)))
    assert "`tensor_parallel=2` must divide n_heads=3, n_kv_heads=3 of LlamaLM (LlamaConfig)" in message
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    message = fit(UltraScaleStrategy(tensor_parallel=2), HFCausalLM(str(gpt2)))
    assert "tensor parallel has no plan for HFCausalLM (GPT2Config)" in message
    assert "tp_plan=" in message
    message = fit(UltraScaleStrategy(pipeline_parallel=2),
                  LlamaLM(config=LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64)))
    assert "2 stages, but the model has only 1 layers" in message
    assert not forks and not dist.is_initialized()
