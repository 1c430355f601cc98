"""Resuming across ZeRO families: a ZeRO-3 (FSDP2) checkpoint under ZeRO-1/2 and back.

ZeRO-3 saves the optimizer state parameter-shaped (DTensors like the parameters), ZeRO-1/2 as
flattened 1-D DTensors per parameter (and its fp32 masters under bf16-mixed); loading reads the
saved layout and converts, so the resumed run continues the uninterrupted loss curve."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import Recorder, full, step_losses
from ultrascale.data import CausalLMDataModule
from ultrascale.models.lm import LlamaLM
from ultrascale.parallel.zero import engine_for

TOTAL_STEPS, STOP_STEP, WORLD = 10, 5, 2


def _strategy(stage, tp=1):
    if stage == 3 and tp == 1:
        return "ultrascale_zero3"
    bucket = {} if stage == 3 else {"zero_bucket_mb": 0.03}  # several buckets
    return ultrascale.UltraScaleStrategy(zero_stage=stage, tensor_parallel=tp, **bucket)


class _FP32Weights(L.Callback):
    """The full-precision weights (ZeRO-1/2 under bf16-mixed: its fp32 masters) at train start and end."""

    def __init__(self):
        self.start, self.end = None, None

    def on_train_start(self, trainer, pl_module):
        self.start = self._weights(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.end = self._weights(trainer, pl_module)

    @staticmethod
    def _weights(trainer, pl_module):
        engine = engine_for(trainer.optimizers[0], trainer.strategy.zero_engines)
        if engine is None or not engine.has_master_copies:
            return {n: full(p).float() for n, p in pl_module.named_parameters()}
        return engine.full_master_weights()


def _train(rank, world_size, max_steps, ckpt_dir, resume_from, stage, precision="32-true", vocab_size=258, tp=1):
    recorder, weights = Recorder(), _FP32Weights()
    callbacks = [recorder, weights]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=STOP_STEP, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=_strategy(stage, tp), max_steps=max_steps, logger=recorder.logger,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        enable_checkpointing=bool(ckpt_dir), precision=precision,
    )
    model = LlamaLM(preset="tiny", vocab_size=vocab_size, learning_rate=3e-3, warmup_steps=8, max_steps=TOTAL_STEPS)
    data = CausalLMDataModule(seq_len=32, global_batch_size=8, max_tokens=60_000, val_fraction=0.0, seed=7)
    try:
        trainer.fit(model, data, ckpt_path=resume_from)
    except ValueError as error:
        return {"error": str(error)}
    return {"losses": recorder.losses, "step": trainer.global_step, "start": weights.start, "end": weights.end}


def _ckpt(path):
    return str(path / f"epoch=0-step={STOP_STEP}.ckpt")


@pytest.mark.parametrize("saved_stage, resume_stage", [(3, 2), (2, 3), (3, 1), (1, 3)])
def test_resume_across_zero_families(tmp_path, saved_stage, resume_stage):
    uninterrupted = step_losses(run_ranks(_train, WORLD, TOTAL_STEPS, str(tmp_path), None, saved_stage))  # saves at STOP_STEP
    results = run_ranks(_train, WORLD, TOTAL_STEPS, None, _ckpt(tmp_path), resume_stage)
    assert results[0]["step"] == TOTAL_STEPS
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    # fp32: ZeRO-2 and ZeRO-3 do the same maths (their uninterrupted curves agree bitwise here).
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("saved_stage, resume_stage", [(2, 3), (3, 2)])
def test_bf16_mixed_resume_keeps_fp32_weights(tmp_path, saved_stage, resume_stage):
    """Under bf16-mixed ZeRO-1/2 computes with bf16 weights and keeps fp32 masters, ZeRO-3 keeps fp32
    weights: across families the resumed fp32 weights are exactly the saved ones, not bf16-rounded.
    (The loss curves of the two families differ by ~1e-4 in bf16 anyway: other reduction dtypes.)"""
    saved = run_ranks(_train, WORLD, STOP_STEP, str(tmp_path), None, saved_stage, "bf16-mixed")[0]["end"]
    results = run_ranks(_train, WORLD, STOP_STEP + 1, None, _ckpt(tmp_path), resume_stage, "bf16-mixed")
    assert results[0]["step"] == STOP_STEP + 1
    loaded = results[0]["start"]
    assert loaded.keys() == saved.keys()
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name
    assert any(not torch.equal(w, w.bfloat16().float()) for w in saved.values())  # the fp32 bits mattered


@pytest.mark.parametrize("saved_stage, resume_stage", [(3, 2), (2, 3)])
def test_mismatched_model_across_families_fails_clearly(tmp_path, saved_stage, resume_stage):
    run_ranks(_train, WORLD, STOP_STEP, str(tmp_path), None, saved_stage)
    error = run_ranks(_train, WORLD, TOTAL_STEPS, None, _ckpt(tmp_path), resume_stage, "32-true", 300)[0]["error"]
    family = "ZeRO-3 / FSDP" if saved_stage == 3 else "ZeRO-1/2"
    assert f"saved with {family}" in error and f"under zero_stage={resume_stage}" in error, error
    assert "resume under any zero_stage" in error, error
    assert "parameter 'model.output.weight'" in error or "parameter 'model.tok_embeddings.weight'" in error, error


# (zero_stage, tensor_parallel) saved -> resumed, at world 4 (ZeRO-1/2 with tp keep a tp parameter's state
# parameter-shaped, split in rows over the dp ranks; without tp flattened): every direction converts.
TP_CASES = {
    "zero1-tp2->zero2-tp1": ((1, 2), (2, 1)),
    "zero2-tp1->zero1-tp2": ((2, 1), (1, 2)),
    "zero1-tp2->zero3-tp2": ((1, 2), (3, 2)),
    "zero3-tp2->zero2-tp2": ((3, 2), (2, 2)),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_resume_across_tensor_parallel_and_zero_families(tmp_path, case):
    (saved_stage, saved_tp), (resume_stage, resume_tp) = TP_CASES[case]
    # One run gives the uninterrupted curve and the checkpoint at STOP_STEP (saving does not move the curve).
    uninterrupted = step_losses(run_ranks(_train, 4, TOTAL_STEPS, str(tmp_path), None, saved_stage, "32-true", 258, saved_tp))
    from ultrascale.parallel.safe_load import read_dcp_metadata

    saved = read_dcp_metadata(_ckpt(tmp_path)).state_dict_metadata
    moment = saved["optimizer_0.state.model.layers.0.attention.wq.weight.exp_avg"].size
    assert len(moment) == (1 if (saved_stage, saved_tp) == (2, 1) else 2)  # the layout under test was written
    results = run_ranks(_train, 4, TOTAL_STEPS, None, _ckpt(tmp_path), resume_stage, "32-true", 258, resume_tp)
    assert "error" not in results[0], results[0]
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


def test_bf16_mixed_zero1_tp_resume_keeps_fp32_masters(tmp_path):
    """ZeRO-1 x tp2 under bf16-mixed saves its fp32 masters parameter-shaped; ZeRO-2 without tp reads them back exactly."""
    saved = run_ranks(_train, 4, STOP_STEP, str(tmp_path), None, 1, "bf16-mixed", 258, 2)[0]["end"]
    results = run_ranks(_train, 2, STOP_STEP + 1, None, _ckpt(tmp_path), 2, "bf16-mixed")
    loaded = results[0]["start"]
    assert loaded.keys() == saved.keys()
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name
    assert any(not torch.equal(w, w.bfloat16().float()) for w in saved.values())
