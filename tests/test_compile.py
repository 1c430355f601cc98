"""`compile=True`: each block compiled, against an eager single-process run (fp32, masked labels).

The reference is `tests._parity.reference_run` (plain torch, eager, the token-mean loss written inline).
Most layouts compile with `compile_backend="aot_eager"`: dynamo's capture and AOTAutograd's forward/backward
graphs, which is where compile meets DTensor, FSDP2's hooks, the pipeline stages, the ring's point-to-point
calls and the expert all-to-all, with eager kernels (a cold inductor compile costs ~30 s per distinct graph on
these 2 cores). Inductor's generated kernels run under ZeRO-3 (with accumulation) and tp2.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, merge_stages, parity_trainer, reference_run, step_losses
from ultrascale.models.llama import LlamaConfig
from ultrascale.models.lm import LlamaLM

SEQ, BATCH, STEPS, VOCAB = 16, 4, 10, 256


def make_llama() -> LlamaLM:
    config = LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=SEQ)
    return LlamaLM(config=config, learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def masked_data() -> TokenDataset:
    return TokenDataset(STEPS * BATCH * 2, SEQ, VOCAB, seed=11, masked=True, empty_rows=[5])


def _compiled_regions(module: torch.nn.Module) -> int:
    from ultrascale.parallel.compile import COMPILED_ATTRIBUTE

    return sum(1 for m in module.modules() if getattr(m, COMPILED_ATTRIBUTE, False))


class _FailsOnRecompileLimit(L.Callback):
    """Records torch's `fail_on_recompile_limit_hit` while training (the strategy sets it for the fit only)."""

    seen: bool = False

    def on_train_batch_end(self, *args) -> None:
        self.seen = torch._dynamo.config.fail_on_recompile_limit_hit


def _fit(rank, world_size, make_module, dataset, global_batch, strategy_kwargs, ac=None, accumulate=1, steps=STEPS):
    """`make_module()` trained with `compile=True` on `dataset`; what the parity checks and the counts need."""
    from ultrascale.callbacks import ActivationCheckpointing

    recorder, setting = Recorder(), _FailsOnRecompileLimit()
    strategy = ultrascale.UltraScaleStrategy(compile=True, **strategy_kwargs)
    callbacks = [setting] + ([ActivationCheckpointing(mode=ac)] if ac else [])
    trainer = parity_trainer(world_size, strategy, recorder, steps, callbacks=callbacks,
                             accumulate_grad_batches=accumulate)
    module = make_module()
    trainer.fit(module, ParityData(dataset, global_batch))
    stats = trainer.strategy._compiler.stats
    return {**recorder.result(), "compiled": _compiled_regions(module), "first_graphs": stats.first_step_graphs,
            "later_graphs": stats.later_graphs, "fail_on_recompile_limit": (
                setting.seen, torch._dynamo.config.fail_on_recompile_limit_hit)}


CASES = {
    # name: (world, strategy kwargs, activation checkpointing, accumulation)
    "zero3-inductor": (2, {"data_parallel_shard": 2}, None, 2),
    "tp2xdp2": (4, {"tensor_parallel": 2, "data_parallel_shard": 2, "compile_backend": "aot_eager"}, None, 1),
    "tp2xdp2-zero2": (4, {"tensor_parallel": 2, "data_parallel_shard": 2, "zero_stage": 2, "compile_backend": "aot_eager"},
                      None, 2),
    "tp2-nosp-inductor": (2, {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": False}, None, 1),
    "hsdp2x1": (2, {"data_parallel_replicate": 2, "data_parallel_shard": 1, "compile_backend": "aot_eager"}, None, 1),
    "zero3-ac-full": (2, {"data_parallel_shard": 2, "compile_backend": "aot_eager"}, "full", 2),
    "zero3-ac-selective": (2, {"data_parallel_shard": 2, "compile_backend": "aot_eager"}, "selective", 1),
    "zero1": (2, {"data_parallel_shard": 2, "zero_stage": 1, "compile_backend": "aot_eager"}, None, 2),
    "cp2-ring": (2, {"context_parallel": 2, "data_parallel_shard": 1, "compile_backend": "aot_eager"}, None, 1),
    "cp2-allgather": (2, {"context_parallel": 2, "data_parallel_shard": 1, "context_parallel_method": "allgather",
                          "compile_backend": "aot_eager"}, None, 1),
    "cp2-alltoall-zero1": (4, {"context_parallel": 2, "data_parallel_shard": 2, "zero_stage": 1,
                               "context_parallel_method": "alltoall", "compile_backend": "aot_eager"}, None, 1),
    "cp4-usp": (4, {"context_parallel": 4, "data_parallel_shard": 1, "context_parallel_method": "usp",
                    "context_parallel_ulysses": 2, "compile_backend": "aot_eager"}, None, 1),
    "pp2-1f1b": (2, {"pipeline_parallel": 2, "pipeline_microbatches": 4, "compile_backend": "aot_eager"}, None, 1),
    "pp2-zbv": (2, {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble", "pipeline_microbatches": 4,
                    "compile_backend": "aot_eager"}, None, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_parity(case):
    world, kwargs, ac, accumulate = CASES[case]
    reference = reference_run(make_llama(), masked_data(), global_batch=BATCH, steps=STEPS, accumulate=accumulate)
    results = run_ranks(_fit, world, make_llama, masked_data(), BATCH, kwargs, ac, accumulate)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    assert results[0]["compiled"] >= 1 and results[0]["first_graphs"] >= 1, results[0]
    # A recompile past torch's limit fails while the strategy trains; torch's setting is restored after the fit.
    assert results[0]["fail_on_recompile_limit"] == (True, False)
    merged = merge_stages(results, strip="_checkpoint_wrapped_module." if ac else "")
    assert_parity(merged, reference, losses)


def test_compiled_expert_parallel_parity():
    """ep2 x dp2 on the MoE Llama (all-to-all dispatch, grouped experts), against the expert tests' inline reference."""
    from tests.test_expert_parallel import _check

    _check(2, {"expert_parallel": 2, "data_parallel_shard": 2, "compile": True, "compile_backend": "aot_eager"})


class VariableLengthData(TokenDataset):
    """SFT-like batches: every optimizer step's rows are cut to a length of their own (6..16 tokens)."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps * BATCH, SEQ, VOCAB, seed=3, masked=True)
        self.lengths = torch.randint(6, SEQ + 1, (steps,), generator=torch.Generator().manual_seed(4)).tolist()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        length = self.lengths[i // BATCH]
        return {key: value[:length] for key, value in super().__getitem__(i).items()}


def test_variable_length_batches_compile_a_bounded_number_of_times():
    """20 steps of 10 distinct lengths: the first length compiles static, the second recompiles with the length
    dynamic, and that graph serves every later length (dynamo's automatic dynamic shapes)."""
    steps = 20
    data = VariableLengthData(steps)
    assert len(set(data.lengths)) >= 8, data.lengths
    reference = reference_run(make_llama(), data, global_batch=BATCH, steps=steps)
    results = run_ranks(_fit, 2, make_llama, data, BATCH, {"data_parallel_shard": 2, "compile_backend": "aot_eager"},
                        None, 1, steps)
    assert results[0]["first_graphs"] >= 1
    assert results[0]["later_graphs"] <= 2 * results[0]["first_graphs"], results[0]  # one dynamic recompile per graph
    torch.testing.assert_close(torch.tensor(step_losses(results)), torch.tensor(reference["losses"]), rtol=0, atol=1e-4)


def _async_tp_fit(rank, world_size, make_module, dataset, accumulate):
    """A compiled tp2 + SP fit with `async_tensor_parallel`, CUDA's symmetric memory stood in for on CPU by torch's
    own test mode (`_symmetric_memory._test_mode`): inductor's pass rewrites the graphs as on a GPU, and the fused ops
    run torch's reference implementations of them (registered for CPU here, and counted)."""
    import torch.distributed._symmetric_memory as symm_mem

    import ultrascale.strategies.base as strategy_module

    calls = {"fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0}

    def counted(name, reference):
        def call(*args, **kwargs):
            calls[name] += 1
            return reference(*args, **kwargs)

        return call

    torch.library.impl(symm_mem.lib, "fused_all_gather_matmul", "CPU")(
        counted("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback))
    torch.library.impl(symm_mem.lib, "fused_matmul_reduce_scatter", "CPU")(
        counted("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback))
    torch.distributed.is_nccl_available = lambda: True  # the pass fuses only where NCCL could run the kernels
    strategy_module.symmetric_memory_available = lambda device: True
    with symm_mem._test_mode():
        result = _fit(rank, world_size, make_module, dataset, BATCH,
                      {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": True,
                       "async_tensor_parallel": True}, accumulate=accumulate)
    return {**result, **calls}


@pytest.mark.parametrize("model", ["llama", "hf-qwen2"])
def test_async_tensor_parallel_fuses_the_sequence_parallel_collectives_and_matches_one_process(model, tmp_path):
    from tests._parity import make_hf, make_hf_checkpoint

    if model == "llama":
        make_module = make_llama
    else:  # sequence parallel on a Hugging Face decoder (ultrascale's own SP styles around transformers' plan)
        path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=VOCAB, head_dim=16)
        make_module = lambda: make_hf(path)  # noqa: E731
    reference = reference_run(make_module(), masked_data(), global_batch=BATCH, steps=STEPS, accumulate=2)
    results = run_ranks(_async_tp_fit, 2, make_module, masked_data(), 2)
    # The all-gathers before the q/k/v and gate/up matmuls and the reduce-scatters after the output and down
    # matmuls, forward and backward, ran as the fused kernels.
    assert results[0]["fused_all_gather_matmul"] > 0 and results[0]["fused_matmul_reduce_scatter"] > 0, results[0]
    assert_parity(results[0], reference, step_losses(results))


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel": 2, "async_tensor_parallel": True}, r"is a pass of inductor's .* `compile=True`"),
    ({"tensor_parallel": 2, "async_tensor_parallel": True, "compile": True, "compile_backend": "aot_eager"},
     r"is a pass of inductor's"),
])
def test_async_tensor_parallel_needs_inductor(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ultrascale.UltraScaleStrategy(**kwargs)


def _async_tp_refusal(rank, world_size, kwargs):
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(compile=True, async_tensor_parallel=True, **kwargs),
                             Recorder(), 1)
    try:
        trainer.fit(make_llama(), ParityData(masked_data(), BATCH))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel": 1, "data_parallel_shard": 2}, r"`async_tensor_parallel=True`\): needs tensor parallel"),
    ({"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": False},
     r"`async_tensor_parallel=True`\): overlaps the all-gathers .* set `sequence_parallel=True`"),
    ({"tensor_parallel": 2, "data_parallel_shard": 1}, r"CUDA over NCCL only; the devices here are 'cpu'"),
])
def test_async_tensor_parallel_is_refused_where_it_cannot_run(kwargs, message):
    import re

    for error in run_ranks(_async_tp_refusal, 2, kwargs):
        assert error is not None and re.search(message, error), error


def test_compile_stats_warn_past_the_limit():
    from ultrascale.parallel.compile import CompileStats

    counts = iter([(0, 0.0), (2, 1.5), (4, 1.6), (13, 2.0)])
    stats = CompileStats(warn_after=8)
    stats._counters = lambda: next(counts)  # dynamo's counters, as three steps would move them
    stats.start()
    assert stats.step() == (2, 1.5) and stats.first_step_graphs == 2
    assert stats.step()[0] == 2 and not stats.keeps_recompiling
    assert stats.step()[0] == 9 and stats.keeps_recompiling and stats.later_graphs == 11


def test_compile_knobs_are_checked_when_the_strategy_is_built():
    with pytest.raises(ValueError, match="compile_backend='aot_eager'` needs `compile=True`"):
        ultrascale.UltraScaleStrategy(compile_backend="aot_eager")
    with pytest.raises(ValueError, match="is not one of inductor, aot_eager, eager"):
        ultrascale.ZeRO3Strategy(compile=True, compile_backend="cudagraphs")



def test_compiled_hf_mixtral_expert_parallel_parity(tmp_path):
    """HF Mixtral (transformers' own decoder layers, fused experts) at ep2, compiled, against transformers' model
    on one process; the exported folder holds the one-process weights."""
    from tests.test_expert_parallel import check_hf_moe_parity_and_export

    check_hf_moe_parity_and_export(tmp_path, "mixtral", 2, {"expert_parallel": 2, "compile": True,
                                                             "compile_backend": "aot_eager"})


@pytest.mark.parametrize("kwargs", [
    {"data_parallel_shard": 2, "compile_backend": "aot_eager"},
    {"tensor_parallel": 2, "data_parallel_shard": 1, "compile_backend": "aot_eager"},
    {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": True, "compile_backend": "aot_eager"},
], ids=["zero3", "tp2", "tp2-sequence-parallel"])
def test_compiled_hf_qwen2_parity(tmp_path, kwargs):
    """HF Qwen2's decoder layers compiled, against transformers' eager model on one process."""
    from tests._parity import make_hf, make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", vocab_size=VOCAB, head_dim=16)
    dataset = TokenDataset(STEPS * BATCH, SEQ, VOCAB, seed=11, masked=True)
    reference = reference_run(make_hf(path), dataset, global_batch=BATCH, steps=STEPS)
    results = run_ranks(_fit, 2, lambda: make_hf(path), dataset, BATCH, kwargs)
    assert results[0]["compiled"] == 2  # both decoder layers
    assert_parity(results[0], reference, step_losses(results))


def test_compiled_generic_module_parity():
    """A user's LightningModule with blocks of its own (found generically) is compiled block by block."""
    from tests.test_generic_module import GLOBAL_BATCH, PlainTransformerLM, data

    reference = reference_run(PlainTransformerLM(), data(), global_batch=GLOBAL_BATCH, steps=STEPS)
    results = run_ranks(_fit, 2, PlainTransformerLM, data(), GLOBAL_BATCH,
                        {"data_parallel_shard": 2, "compile_backend": "aot_eager"})
    assert results[0]["compiled"] == 3
    assert_parity(results[0], reference, step_losses(results))


def _fit_bf16(rank, world_size, compiled):
    recorder = Recorder()
    kwargs = {"compile": True, "compile_backend": "aot_eager"} if compiled else {}
    strategy = ultrascale.UltraScaleStrategy(data_parallel_shard=2, **kwargs)
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, precision="bf16-mixed")
    trainer.fit(make_llama(), ParityData(masked_data(), BATCH))
    return recorder.result()


def test_compiled_bf16_mixed_tracks_eager():
    """bf16-mixed under ZeRO-3, compiled against eager: the same loss curve within the suite's bf16 tolerance."""
    eager = step_losses(run_ranks(_fit_bf16, 2, False))
    compiled = step_losses(run_ranks(_fit_bf16, 2, True))
    assert len(compiled) == STEPS and all(abs(a - b) < 5e-2 for a, b in zip(compiled, eager)), (compiled, eager)


def _fit_fp8(rank, world_size, compiled):
    from tests.test_callbacks_fp8 import Memorise, make_model
    from ultrascale.callbacks import Float8Training

    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    kwargs = {"compile": True, "compile_backend": "aot_eager"} if compiled else {}
    callback = Float8Training()
    trainer = parity_trainer(world_size, ultrascale.ZeRO3Strategy(**kwargs), recorder, 4, precision="bf16-mixed",
                             callbacks=[callback])
    model = make_model()
    trainer.fit(model, ParityData(Memorise(32), 8))
    return {**recorder.result(), "converted": len(callback.converted), "compiled": _compiled_regions(model)}


def test_compiled_float8_tracks_eager_float8():
    """torchao's Float8 linears inside compiled blocks (ZeRO-3, bf16-mixed) train as the eager Float8 run does."""
    eager = run_ranks(_fit_fp8, 2, False)
    compiled = run_ranks(_fit_fp8, 2, True)
    assert compiled[0]["converted"] == eager[0]["converted"] > 0 and compiled[0]["compiled"] == 4
    torch.testing.assert_close(torch.tensor(step_losses(compiled)), torch.tensor(step_losses(eager)), rtol=0.02, atol=0)


def test_compiled_float8_under_tensor_parallel_tracks_eager():
    """FP8 at tp2 with sequence parallel (fp8 converted before TP, the plan's styles on the fp8 layers) inside
    compiled blocks trains as the eager run does, which equals one process's fp8 (tests/test_callbacks_fp8.py)."""
    from tests.test_callbacks_fp8 import CONFIG, _fp8_tp_fit

    CONFIG_BLOCKS = CONFIG.n_layers
    eager = step_losses(run_ranks(_fp8_tp_fit, 2, True))
    compiled = run_ranks(_fp8_tp_fit, 2, True, "aot_eager")
    assert compiled[0]["fp8"] and compiled[0]["compiled"] == CONFIG_BLOCKS
    torch.testing.assert_close(torch.tensor(step_losses(compiled)), torch.tensor(eager), rtol=1e-5, atol=0)


class EncoderLayersLM(torch.nn.Module):
    """A user's model whose blocks are torch.nn's own `TransformerEncoderLayer`s (a class in torch.nn's files)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True) for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def _encoder_module():
    class EncoderModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = EncoderLayersLM()

        def forward(self, tokens):
            return self.model(tokens)

        def training_step(self, batch, batch_idx):
            return ultrascale.token_loss(self(batch["input_ids"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)

    return EncoderModule()


def test_compiled_torch_nn_blocks_parity():
    """Blocks that are torch.nn classes really compile (dynamo skips a top frame in torch.nn's files: compiling
    their whole call compiled nothing) and train as eager."""
    reference = reference_run(_encoder_module(), masked_data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_fit, 2, _encoder_module, masked_data(), BATCH,
                        {"data_parallel_shard": 2, "compile_backend": "aot_eager"})
    assert results[0]["compiled"] == 2 and results[0]["first_graphs"] >= 1, results[0]
    assert_parity(results[0], reference, step_losses(results))
