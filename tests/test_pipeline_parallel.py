"""Pipeline parallel: every torch schedule, alone and with ZeRO / HSDP / TP, against one process.

The reference (`tests._parity.reference_run`) is a plain-torch loop over the whole global batch
with the token-mean loss written inline; the data has prompt-masked labels (different valid-token
counts per row, micro-batch and rank) and an empty row.
"""

from __future__ import annotations

import math

import pytest

import ultrascale
from tests._dist import run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    assert_parity,
    make_hf,
    make_hf_checkpoint,
    merge_stages,
    parity_trainer,
    reference_run,
    step_losses,
)
from ultrascale.models.llama import LlamaConfig
from ultrascale.models.lm import LlamaLM

SEQ, BATCH, STEPS, VOCAB = 16, 4, 10, 256


def masked_data(seed: int = 11) -> TokenDataset:
    return TokenDataset(STEPS * BATCH * 2, SEQ, VOCAB, seed=seed, masked=True, empty_rows=[5])


def make_llama(n_layers: int = 4, vocab_size: int = VOCAB, tie_embeddings: bool = False) -> LlamaLM:
    config = LlamaConfig(vocab_size=vocab_size, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64,
                         max_seq_len=SEQ, tie_embeddings=tie_embeddings)
    return LlamaLM(config=config, learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def _train(rank, world_size, strategy_kwargs, global_batch, trainer_kwargs, model_kwargs=None):
    recorder = Recorder()
    strategy = ultrascale.UltraScaleStrategy(**strategy_kwargs)
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, **trainer_kwargs)
    trainer.fit(make_llama(**(model_kwargs or {})), ParityData(masked_data(), global_batch))
    return recorder.result()


def _check(world, strategy_kwargs, *, global_batch=BATCH, trainer_kwargs=None):
    reference = reference_run(make_llama(), masked_data(), global_batch=global_batch, steps=STEPS)
    results = run_ranks(_train, world, strategy_kwargs, global_batch, trainer_kwargs or {})
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    merged = merge_stages(results)
    assert_parity(merged, reference, losses)


SCHEDULES_PP2 = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("schedule", SCHEDULES_PP2)
def test_schedule_parity_pp2(schedule):
    _check(2, {"pipeline_parallel": 2, "pipeline_schedule": schedule, "pipeline_microbatches": 4})


VIRTUAL_SCHEDULES = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _train_deep(rank, world_size, strategy_kwargs, global_batch):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    trainer.fit(make_llama(n_layers=8), ParityData(masked_data(), global_batch))
    return recorder.result()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", VIRTUAL_SCHEDULES)
def test_virtual_schedule_parity_pp4(schedule):
    """8 stages (2 per rank) over 8 layers; DualPipeV needs at least 8 micro-batches."""
    kwargs = {"pipeline_parallel": 4, "pipeline_schedule": schedule, "pipeline_microbatches": 8}
    reference = reference_run(make_llama(n_layers=8), masked_data(), global_batch=8, steps=STEPS)
    results = run_ranks(_train_deep, 4, kwargs, 8)
    merged = merge_stages(results)
    assert_parity(merged, reference, step_losses(results))


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_pp2_dp2_zero_parity(zero_stage):
    """Each dp rank holds 2 of the 4 sequences of a step; with 2 micro-batches per local batch."""
    _check(4, {"pipeline_parallel": 2, "data_parallel_shard": 2, "zero_stage": zero_stage, "pipeline_microbatches": 2})


@pytest.mark.parametrize("zero_stage, schedule", [(1, "InterleavedZeroBubble"), (2, "ZBVZeroBubble")])
def test_zero12_with_zero_bubble_schedules(zero_stage, schedule):
    """Zero-bubble schedules assign weight gradients (no autograd hook fires); the ZeRO-1/2 engine takes
    them in after the schedule."""
    _check(4, {"pipeline_parallel": 2, "data_parallel_shard": 2, "zero_stage": zero_stage, "pipeline_schedule": schedule,
               "pipeline_microbatches": 2})


def test_pp2_hsdp_parity():
    _check(4, {"pipeline_parallel": 2, "data_parallel_replicate": 2, "data_parallel_shard": 1, "pipeline_schedule": "GPipe",
               "pipeline_microbatches": 2})


@pytest.mark.slow
def test_pp2_dp2_tp2_parity():
    """World 8: TP (with sequence parallel) inside each stage, FSDP over the dp ranks."""
    _check(8, {"pipeline_parallel": 2, "data_parallel_shard": 2, "tensor_parallel": 2, "pipeline_microbatches": 2})


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage, schedule", [(1, "1F1B"), (2, "ZBVZeroBubble")])
def test_pp2_tp2_dp2_zero12_parity(zero_stage, schedule):
    """World 8, Megatron's usual layout: TP inside each stage, ZeRO-1 (the distributed optimizer) over the
    dp ranks of each tp group; the global norm sums over dp, tp and both stages. Under ZBVZeroBubble the weight
    gradients arrive assigned (tp DTensors, outside autograd's hooks) and are taken into the buckets after."""
    reference = reference_run(make_llama(), masked_data(), global_batch=BATCH, steps=STEPS, clip=0.05)
    kwargs = {"pipeline_parallel": 2, "data_parallel_shard": 2, "tensor_parallel": 2, "zero_stage": zero_stage,
              "zero_bucket_mb": 0.02, "pipeline_schedule": schedule, "pipeline_microbatches": 2}
    results = run_ranks(_train, 8, kwargs, BATCH, {"gradient_clip_val": 0.05})
    assert_parity(merge_stages(results), reference, step_losses(results))


def test_accumulation_and_clipping_parity():
    """Two Lightning micro-batches per step (gradients stashed across Lightning's zero_grad) and
    gradient-norm clipping over both stages' gradients (a clip that binds: max norm 0.05)."""
    reference = reference_run(make_llama(), masked_data(), global_batch=BATCH // 2, steps=STEPS, accumulate=2, clip=0.05)
    results = run_ranks(_train, 2, {"pipeline_parallel": 2, "pipeline_microbatches": 2}, BATCH // 2,
                        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05})
    merged = merge_stages(results)
    assert_parity(merged, reference, step_losses(results))


@pytest.mark.parametrize("schedule, nonfinite", [("1F1B", "stop"), ("Interleaved1F1B", "off")])
def test_tied_embeddings_parity(schedule, nonfinite):
    """Tied input embedding and output head: the first and the last stage each hold a copy and sum its two gradient
    halves; the clipping norm (a clip that binds) counts it once, from the strategy's check or, with the check
    off, from the clipping itself. Accumulation 2, masked labels."""
    reference = reference_run(make_llama(tie_embeddings=True), masked_data(), global_batch=BATCH // 2, steps=STEPS,
                              accumulate=2, clip=0.05)
    kwargs = {"pipeline_parallel": 2, "pipeline_microbatches": 2, "pipeline_schedule": schedule, "nonfinite": nonfinite}
    results = run_ranks(_train, 2, kwargs, BATCH // 2, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
                        {"tie_embeddings": True})
    merged = merge_stages(results)  # both ends record the tied weight: equal
    assert "tok_embeddings.weight" in " ".join(merged["grads"]) and "output.weight" not in " ".join(merged["grads"])
    assert_parity(merged, reference, step_losses(results))


@pytest.mark.parametrize("zero_stage, schedule, dp, microbatches", [
    (1, "1F1B", 2, 2), (2, "Interleaved1F1B", 2, 2), (1, "ZBVZeroBubble", 2, 2), (2, "DualPipeV", 1, 4),
    (3, "ZBVZeroBubble", 2, 2), (3, "DualPipeV", 1, 4)])
def test_tied_embeddings_zero_parity(zero_stage, schedule, dp, microbatches):
    """Tied embeddings under each ZeRO stage. ZeRO-1/2 under looped schedules: each end keeps the tied weight in a
    bucket of its own, cut alike over the same dp ranks, and the two ends sum their reduced slices of it (1/dp of
    the weight each); under V schedules one rank holds both ends, so the tie stays one weight whose two stages'
    gradients add up in its bucket. ZeRO-3 under V schedules: the two end stages are FSDP units of one rank, so the
    head holds a copy, sharded alike, whose gradient is added to the weight's; the optimizer steps the weight alone
    and the copy takes its values after each step. The clipping norm (a clip that binds) counts the weight once.
    Accumulation 2, masked labels, ZeRO-1/2 buckets small enough to split the rest."""
    reference = reference_run(make_llama(tie_embeddings=True), masked_data(), global_batch=BATCH, steps=STEPS,
                              accumulate=2, clip=0.05)
    kwargs = {"pipeline_parallel": 2, "data_parallel_shard": dp, "zero_stage": zero_stage,
              "pipeline_microbatches": microbatches, "pipeline_schedule": schedule,
              **({"zero_bucket_mb": 0.02} if zero_stage < 3 else {})}
    results = run_ranks(_train, 2 * dp, kwargs, BATCH, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
                        {"tie_embeddings": True})
    merged = merge_stages(results)
    assert "tok_embeddings.weight" in " ".join(merged["grads"]) and "output.weight" not in " ".join(merged["grads"])
    assert_parity(merged, reference, step_losses(results))


def _meta_init_fit(rank, world_size, strategy_kwargs, tied):
    import torch
    from torch.distributed.tensor import DTensor

    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(meta_init=True, **strategy_kwargs), recorder, 3)
    module = make_llama(tie_embeddings=tied)
    trainer.fit(module, ParityData(masked_data(), BATCH))
    model = module.model
    held = {name: (part.weight.full_tensor() if isinstance(part.weight, DTensor) else part.weight).detach().clone()
            for name, part, kind in (("embed", model.tok_embeddings, torch.nn.Embedding), ("head", model.output, torch.nn.Linear))
            if isinstance(part, kind)}
    wq = [(layer.attention.wq.weight.full_tensor() if isinstance(layer.attention.wq.weight, DTensor)
           else layer.attention.wq.weight).detach() for layer in model.layers if hasattr(layer, "attention")]
    return {**recorder.result(), **held, "wq_std": [float(w.std()) for w in wq]}


@pytest.mark.parametrize("kwargs, tied", [
    ({"pipeline_microbatches": 2}, False),
    ({"pipeline_microbatches": 2}, True),
    ({"pipeline_microbatches": 2, "pipeline_schedule": "ZBVZeroBubble"}, True),
], ids=["1F1B", "1F1B-tied", "ZBV-zero3-tied"])
def test_meta_init_under_pipeline_parallel(kwargs, tied):
    """`meta_init=True` under pipeline parallel (the 405B recipe's layout): each rank materialises and initialises
    the parts it holds, a part held elsewhere is a placeholder without weights. Tied embeddings: the last stage's
    copy takes the first stage's values (across ranks: a broadcast; one rank under a V schedule with ZeRO-3: the
    head's own copy). Initialised, not left empty: each block's weights have init_std and the first loss is a
    uniform guess."""
    import torch

    results = run_ranks(_meta_init_fit, 2, {"pipeline_parallel": 2, "zero_stage": 3, **kwargs}, tied)
    stds = [std for result in results for std in result["wq_std"]]
    assert len(stds) == 4 and all(0.015 < std < 0.025 for std in stds), stds  # init_std 0.02, all 4 layers
    assert abs(step_losses(results)[0] - math.log(VOCAB)) < 0.1
    embeds, heads = [r["embed"] for r in results if "embed" in r], [r["head"] for r in results if "head" in r]
    assert len(embeds) == len(heads) == 1 and torch.isfinite(heads[0]).all()
    assert torch.equal(embeds[0], heads[0]) == tied


# ----------------------------------------------------------------------------- checkpoints, validation

TOTAL, STOP = 10, 5


def _fit_data():
    from ultrascale.data import CausalLMDataModule

    return CausalLMDataModule(seq_len=SEQ, global_batch_size=8, max_tokens=30_000, val_fraction=0.1, seed=3)


def _fit(rank, world_size, pp, max_steps, ckpt_dir, resume_from, tied=False, layout=None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    recorder = Recorder()
    callbacks = [recorder]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=STOP, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**(layout or {"pipeline_parallel": pp})),
        max_steps=max_steps, logger=recorder.logger, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(ckpt_dir), limit_val_batches=0,
    )
    trainer.fit(make_llama(vocab_size=258, tie_embeddings=tied), _fit_data(), ckpt_path=resume_from)  # the byte tokenizer's vocabulary
    return {"losses": recorder.losses, "step": trainer.global_step}


@pytest.mark.slow
@pytest.mark.parametrize("resume_pp", [1, 4])
def test_checkpoint_from_pp2_resumes_at_other_degrees(tmp_path, resume_pp):
    """Parameter names do not change with the split: a pp=2 checkpoint (each stage saved its own
    parameters and optimizer state) resumes at pp=1 and pp=4 on the uninterrupted curve."""
    import torch
    from torch.testing import assert_close

    uninterrupted = step_losses(run_ranks(_fit, 2, 2, TOTAL, str(tmp_path), None))  # saves at STOP too
    results = run_ranks(_fit, resume_pp, resume_pp, TOTAL, None, str(tmp_path / f"epoch=0-step={STOP}.ckpt"))
    assert results[0]["step"] == TOTAL
    resumed = step_losses(results)
    assert len(resumed) == TOTAL - STOP
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP:]), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_tied_embeddings_checkpoints_move_between_pipeline_degrees(tmp_path):
    """The tied weight keeps the embedding's name on both pipeline ends (`TiedGap`), so its weight and optimizer
    state saved at pp=2 resume at pp=1 and those saved at pp=1 resume at pp=2, both on the uninterrupted curve."""
    import torch
    from torch.testing import assert_close

    run_ranks(_fit, 2, 2, STOP, str(tmp_path / "pp2"), None, True)
    uninterrupted = step_losses(run_ranks(_fit, 1, 1, TOTAL, str(tmp_path / "pp1"), None, True))  # saves at STOP too
    for world, saved in ((1, "pp2"), (2, "pp1")):
        results = run_ranks(_fit, world, world, TOTAL, None, str(tmp_path / saved / f"epoch=0-step={STOP}.ckpt"), True)
        assert results[0]["step"] == TOTAL
        resumed = step_losses(results)
        assert len(resumed) == TOTAL - STOP
        assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP:]), rtol=0, atol=1e-5, msg=lambda m: f"from {saved}: {m}")


@pytest.mark.slow
def test_tied_embeddings_zero1_checkpoints_resume_and_move_to_zero3(tmp_path):
    """pp2 x dp2 under ZeRO-1 with tied embeddings: both ends save the tied weight's state under the embedding's name
    (the same values: both took the same steps), and the checkpoint resumes on the uninterrupted curve at the same
    layout and at one process under ZeRO-3."""
    import torch
    from torch.testing import assert_close

    zero1 = {"pipeline_parallel": 2, "data_parallel_shard": 2, "zero_stage": 1}
    uninterrupted = step_losses(run_ranks(_fit, 4, 2, TOTAL, str(tmp_path), None, True, zero1))  # saves at STOP too
    for world, layout in ((4, zero1), (1, {"pipeline_parallel": 1, "zero_stage": 3})):
        results = run_ranks(_fit, world, 1, TOTAL, None, str(tmp_path / f"epoch=0-step={STOP}.ckpt"), True, layout)
        assert results[0]["step"] == TOTAL
        resumed = step_losses(results)
        assert len(resumed) == TOTAL - STOP
        assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP:]), rtol=0, atol=1e-5, msg=lambda m: f"{layout}: {m}")


@pytest.mark.slow
def test_tied_embeddings_zero3_v_schedule_checkpoints_move(tmp_path):
    """ZeRO-3 under ZBVZeroBubble with tied embeddings: the head's copy of the tied weight is no parameter of the
    optimizer, so the checkpoint holds the weight's state once under the embedding's name, as every other layout's.
    It resumes on the uninterrupted curve at its own layout and at one process, and one process's checkpoint
    resumes under the V schedule (the copy then takes the loaded weight)."""
    import torch
    from torch.testing import assert_close

    v_zero3 = {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble", "zero_stage": 3}
    one = {"pipeline_parallel": 1, "zero_stage": 3}
    uninterrupted = step_losses(run_ranks(_fit, 2, 2, TOTAL, str(tmp_path / "v"), None, True, v_zero3))  # saves at STOP
    run_ranks(_fit, 1, 1, STOP, str(tmp_path / "one"), None, True, one)
    for world, layout, saved in ((2, v_zero3, "v"), (1, one, "v"), (2, v_zero3, "one")):
        results = run_ranks(_fit, world, 1, TOTAL, None, str(tmp_path / saved / f"epoch=0-step={STOP}.ckpt"), True, layout)
        assert results[0]["step"] == TOTAL
        resumed = step_losses(results)
        assert len(resumed) == TOTAL - STOP
        assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP:]), rtol=0, atol=1e-5,
                     msg=lambda m: f"{layout} from {saved}: {m}")


def _val_loader():
    from torch.utils.data import DataLoader

    return DataLoader(masked_data(), batch_size=BATCH, shuffle=False, drop_last=True)


def _validate(rank, world_size, strategy_kwargs):
    import lightning as L

    strategy = ultrascale.UltraScaleStrategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    return trainer.validate(make_llama(), dataloaders=_val_loader(), verbose=False)[0]["val_loss"]


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_validation_matches_one_process(schedule):
    """val_loss through the forward-only pipeline is the token mean over the whole validation set,
    written out here in plain torch (masked rows, an empty one: a per-micro-batch mean would differ).
    ZBVZeroBubble's forward-only pass is ultrascale's (torch 2.13's `eval()` of it fails)."""
    import torch
    import torch.nn.functional as F

    module = make_llama()
    module.configure_model()
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for batch in _val_loader():
            valid = batch["labels"] != -100
            log_probs = F.log_softmax(module(batch["input_ids"]).float(), dim=-1)
            token_losses = -log_probs.gather(-1, batch["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            loss_sum += float((token_losses * valid).sum())
            count += int(valid.sum())
    got = run_ranks(_validate, 2, {"pipeline_parallel": 2, "pipeline_schedule": schedule, "pipeline_microbatches": 4})
    assert got[0] == got[1]
    assert abs(got[0] - loss_sum / count) < 1e-5, (got, loss_sum / count)


def _predict(rank, world_size, strategy_kwargs):
    import lightning as L
    import torch

    strategy = ultrascale.UltraScaleStrategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    return torch.cat(trainer.predict(make_llama(), dataloaders=_val_loader()))


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_predict_returns_one_devices_logits_on_every_rank(schedule):
    """`trainer.predict` at pp2: every rank returns the logits one device's forward gives (written out here with the
    plain module), from the last stage's rank (pp rank 1 under 1F1B, pp rank 0 under the V placement)."""
    import torch

    module = make_llama()
    module.configure_model()
    with torch.no_grad():
        expected = torch.cat([module(batch["input_ids"]) for batch in _val_loader()])
    got = run_ranks(_predict, 2, {"pipeline_parallel": 2, "pipeline_schedule": schedule, "pipeline_microbatches": 4})
    for logits in got:
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Hugging Face checkpoints

HF_VOCAB, HF_LAYERS = 128, 4


def hf_data() -> TokenDataset:
    return TokenDataset(STEPS * BATCH, SEQ, HF_VOCAB, seed=7, masked=True, empty_rows=[5])


def _train_hf(rank, world_size, path, strategy_kwargs, export_dir):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    trainer.fit(make_hf(path, export_dir), ParityData(hf_data(), BATCH))
    return recorder.result()


@pytest.mark.parametrize("arch, world, kwargs", [
    ("qwen2", 2, {"pipeline_parallel": 2, "pipeline_microbatches": 2}),
    ("llama", 2, {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble", "pipeline_microbatches": 4}),
    ("mistral", 4, {"pipeline_parallel": 2, "data_parallel_shard": 2, "pipeline_schedule": "GPipe",
                    "pipeline_microbatches": 2}),
])
def test_hf_parity_and_export(tmp_path, arch, world, kwargs):
    """The HF modelling code runs unchanged on each stage (other stages' parts are gaps); the exported
    folder, gathered from both stages, equals the one-process weights after 10 steps."""
    import transformers
    from torch.testing import assert_close

    path = make_hf_checkpoint(tmp_path / "source", arch, vocab_size=HF_VOCAB, hidden_size=32, layers=HF_LAYERS)
    reference = reference_run(make_hf(path), hf_data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_train_hf, world, path, kwargs, str(tmp_path / "exported"))
    merged = merge_stages(results)
    assert_parity(merged, reference, step_losses(results))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    final = {name[len("model."):]: value for name, value in reference["final_params"].items()}
    state = exported.state_dict()
    assert set(state) == set(final)
    for name, value in final.items():
        assert_close(state[name], value, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- clear errors


def test_choices_refused_in_the_constructor():
    with pytest.raises(ValueError, match=r"not a torch pipeline schedule; choose one of \['GPipe', '1F1B'"):
        ultrascale.UltraScaleStrategy(pipeline_parallel=2, pipeline_schedule="Zigzag")
    with pytest.raises(ValueError, match="places exactly 2 stages per rank"):
        ultrascale.UltraScaleStrategy(pipeline_parallel=2, pipeline_schedule="DualPipeV", pipeline_virtual_stages=3)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        ultrascale.UltraScaleStrategy(pipeline_parallel=2, pipeline_schedule="1F1B", pipeline_virtual_stages=2)
    with pytest.raises(ValueError, match="leave loss_parallel unset"):
        ultrascale.UltraScaleStrategy(pipeline_parallel=2, loss_parallel=True)


def test_layouts_checked_against_the_layers():
    from ultrascale.parallel.pipeline import PipelineLayout

    with pytest.raises(ValueError, match="4 stages, but the model has only 2 layers"):
        PipelineLayout.build(n_layers=2, pp=4)
    with pytest.raises(ValueError, match="6 stages do not divide the model's 8 layers"):
        PipelineLayout.build(n_layers=8, pp=2, schedule="Interleaved1F1B", virtual_stages=3, microbatches=4)
    with pytest.raises(ValueError, match=r"DualPipeV needs at least as many micro-batches as stages \(4\)"):
        PipelineLayout.build(n_layers=4, pp=2, schedule="DualPipeV", microbatches=2)
    with pytest.raises(ValueError, match="must list 2 positive layer counts"):
        PipelineLayout.build(n_layers=4, pp=2, layers_per_stage=[3, 2])
    assert PipelineLayout.build(n_layers=5, pp=2).layers_per_stage == (3, 2)
    assert PipelineLayout.build(n_layers=4, pp=2, layers_per_stage=[3, 1]).layers_of(1) == range(3, 4)
    v = PipelineLayout.build(n_layers=8, pp=2, schedule="ZBVZeroBubble")
    assert (v.stage_ids(0), v.stage_ids(1), v.microbatches) == ((0, 3), (1, 2), 4)
    loop = PipelineLayout.build(n_layers=8, pp=2, schedule="Interleaved1F1B")
    assert (loop.stage_ids(0), loop.stage_ids(1)) == ((0, 2), (1, 3))


def _refused(rank, world_size, model_kwargs, strategy_kwargs, global_batch):
    import lightning as L
    import torch.distributed as dist

    from ultrascale.data import CausalLMDataModule

    config = LlamaConfig(vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=SEQ, **model_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**strategy_kwargs),
                        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    data = CausalLMDataModule(seq_len=SEQ, global_batch_size=global_batch, max_tokens=5_000, val_fraction=0.0)
    try:
        trainer.fit(LlamaLM(config=config), data)
    except (ValueError, NotImplementedError) as error:
        return str(error), dist.is_initialized()
    return None, dist.is_initialized()


@pytest.mark.parametrize("model_kwargs, strategy_kwargs, global_batch, message", [
    ({"n_layers": 1}, {"pipeline_parallel": 2}, 4, "2 stages, but the model has only 1 layers"),
    ({"n_layers": 4}, {"pipeline_parallel": 2, "pipeline_microbatches": 3}, 4, "pipeline_microbatches=3 does not divide"),
    ({"n_layers": 4}, {"pipeline_parallel": 2, "pipeline_schedule": "DualPipeV", "pipeline_microbatches": 2}, 4,
     "DualPipeV needs at least as many micro-batches as stages"),
])
def test_bad_layouts_fail_before_any_process_group(model_kwargs, strategy_kwargs, global_batch, message):
    for error, initialised in run_ranks(_refused, 2, model_kwargs, strategy_kwargs, global_batch):
        assert error is not None and message in error, error
        assert not initialised


def test_a_model_without_pipeline_parts_is_told_what_to_supply():
    import torch

    strategy = ultrascale.UltraScaleStrategy(pipeline_parallel=2)
    with pytest.raises(ValueError, match=r"define `pipeline_parts\(self\)` on the LightningModule"):
        strategy.check_model(torch.nn.Linear(2, 2), dims=strategy.resolve_dims(2))


# ----------------------------------------------------------------------------- with other features


def _train_with(rank, world_size, strategy_kwargs, callbacks, precision="32-true"):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS,
                             callbacks=callbacks, precision=precision)
    trainer.fit(make_llama(), ParityData(masked_data(), BATCH))
    return recorder.result()


def test_activation_checkpointing_inside_stages():
    """Recomputation runs each wrapped block again in backward, after the stage swapped its parts back."""
    from ultrascale.callbacks import ActivationCheckpointing

    reference = reference_run(make_llama(), masked_data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_train_with, 2, {"pipeline_parallel": 2, "pipeline_schedule": "Interleaved1F1B",
                                         "pipeline_microbatches": 2}, [ActivationCheckpointing(mode="full")])
    # named_parameters shows the wrapper; state dicts do not
    merged = merge_stages(results, strip="_checkpoint_wrapped_module.")
    assert_parity(merged, reference, step_losses(results))


def test_bf16_mixed_trains_close_to_fp32():
    """bf16 activations cross the stage boundaries (FSDP casts each stage root's inputs)."""
    import torch
    from torch.testing import assert_close

    reference = reference_run(make_llama(), masked_data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_train_with, 2, {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble",
                                         "pipeline_microbatches": 2}, [], "bf16-mixed")
    assert_close(torch.tensor(step_losses(results)), torch.tensor(reference["losses"]), rtol=0, atol=2e-2)


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_context_parallel_inside_stages(method):
    """pp2 x cp2: each stage's attention runs over the sequence halves, by the ring or by Ulysses' all-to-alls."""
    _check(4, {"pipeline_parallel": 2, "context_parallel": 2, "data_parallel_shard": 1, "pipeline_microbatches": 2,
               "context_parallel_method": method})


class _TinyGPT(__import__("torch").nn.Module):
    """A model ultrascale has no adapter for: learned positions, LayerNorm blocks, a `blocks` list."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, n_layers: int = 4) -> None:
        import torch.nn as nn

        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True, norm_first=True) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        import torch

        h = self.wte(x) if not x.is_floating_point() else x  # after the first stage: hidden states
        mask = torch.nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True) if not isinstance(block, ultrascale.parallel.pipeline.PipelineGap) else block(h)
        return self.head(self.ln_f(h))


class _TinyGPTModule(__import__("lightning").LightningModule):
    def __init__(self) -> None:
        import torch

        super().__init__()
        torch.manual_seed(0)
        self.model = _TinyGPT()

    def forward(self, input_ids, position_ids=None):
        return self.model(input_ids)

    def pipeline_parts(self):
        from ultrascale.parallel.pipeline import PipelineParts

        return PipelineParts(root=self.model, embed="wte", layers="blocks", norm="ln_f", head="head",
                             run=lambda root, x, position_ids, is_first: root(x))

    def training_step(self, batch, batch_idx):
        if self.trainer.strategy.pipeline_active:
            return self.trainer.strategy.pipeline_loss(batch)
        return ultrascale.token_loss(self(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        import torch

        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


def _train_own(rank, world_size):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(pipeline_parallel=2, pipeline_microbatches=2),
                             recorder, STEPS)
    trainer.fit(_TinyGPTModule(), ParityData(masked_data(), BATCH))
    return recorder.result()


def test_own_module_through_pipeline_parts():
    """A module ultrascale knows nothing about opts in with `pipeline_parts()` and `pipeline_loss`."""
    reference = reference_run(_TinyGPTModule(), masked_data(), global_batch=BATCH, steps=STEPS)
    results = run_ranks(_train_own, 2)
    merged = merge_stages(results)
    assert_parity(merged, reference, step_losses(results))


def _mfu_model_flops(rank, world_size, pp):
    from ultrascale.callbacks import MFUMonitor

    monitor = MFUMonitor(peak_tflops=1.0)
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(pipeline_parallel=pp, pipeline_microbatches=2),
                             recorder, 2, callbacks=[monitor])
    trainer.fit(make_llama(), ParityData(masked_data(), BATCH))
    return monitor._model.n_matmul_params


def test_mfu_counts_the_whole_model_under_pp():
    """Each rank holds its stages only; the MFU monitor's FLOPs per token are the whole model's."""
    from ultrascale.estimate import model_flops

    module = make_llama()
    module.configure_model()
    whole = model_flops(module).n_matmul_params
    assert run_ranks(_mfu_model_flops, 2, 2) == [whole, whole]
