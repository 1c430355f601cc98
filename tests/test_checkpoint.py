"""Sharded checkpoints: resume (same and different world size) continues the same loss curve;
saves are atomic; bad checkpoint paths fail clearly."""


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

TOTAL_STEPS, STOP_STEP = 10, 5


def make_data() -> CausalLMDataModule:
    # Shuffled stdlib blocks: resume must skip exactly the global batches already consumed.
    return CausalLMDataModule(seq_len=32, global_batch_size=8, max_tokens=60_000, val_fraction=0.0, seed=7)


def make_model() -> LlamaLM:
    # The warm-up/cosine schedule must resume too (warm-up spans the stop step).
    return LlamaLM(preset="tiny", vocab_size=258, learning_rate=3e-3, warmup_steps=8, max_steps=TOTAL_STEPS)


def trainer_for(world_size, max_steps, callbacks=(), strategy="ultrascale_zero3", logger=False, **kwargs):
    return L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps, logger=logger,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), **kwargs,
    )


def _train(rank, world_size, max_steps, ckpt_dir, resume_from, strategy="ultrascale_zero3"):
    recorder = Recorder()
    callbacks = [recorder]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=STOP_STEP, save_top_k=-1, save_last=True))
    trainer = trainer_for(world_size, max_steps, callbacks, strategy=strategy, logger=recorder.logger)
    trainer.fit(make_model(), make_data(), ckpt_path=resume_from)
    return {"losses": recorder.losses, "step": trainer.global_step}


@pytest.fixture(scope="module")
def uninterrupted():
    return step_losses(run_ranks(_train, 4, TOTAL_STEPS, None, None))


@pytest.fixture(scope="module")
def stopped_checkpoint(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    results = run_ranks(_train, 4, STOP_STEP, str(ckpt_dir), None)
    return ckpt_dir, step_losses(results)


def test_checkpoint_layout(stopped_checkpoint):
    ckpt_dir, _ = stopped_checkpoint
    step_ckpt = ckpt_dir / f"epoch=0-step={STOP_STEP}.ckpt"
    assert step_ckpt.is_dir() and (ckpt_dir / "last.ckpt").is_dir()
    assert (step_ckpt / ".metadata").is_file() and (step_ckpt / "meta.pt").is_file()
    assert len(list(step_ckpt.glob("*.distcp"))) == 4  # one shard file per rank
    assert not list(ckpt_dir.glob(".*tmp-*")), "no temporary directory may survive a completed save"


@pytest.mark.parametrize("world_size", [4, 2])
def test_resume_continues_the_same_loss_curve(uninterrupted, stopped_checkpoint, world_size):
    ckpt_dir, first_half = stopped_checkpoint
    assert_close(torch.tensor(first_half), torch.tensor(uninterrupted[:STOP_STEP]), rtol=0, atol=1e-6)
    results = run_ranks(_train, world_size, TOTAL_STEPS, None, str(ckpt_dir / f"epoch=0-step={STOP_STEP}.ckpt"))
    assert results[0]["step"] == TOTAL_STEPS
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    # Same world: identical maths. 4 -> 2 ranks: only the reduction order changes.
    tolerance = 1e-6 if world_size == 4 else 1e-5
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=tolerance)


def test_tensor_parallel_checkpoint_resumes_without_tp(tmp_path):
    """Saved with tp=2 (DTensors sharded over heads and vocab), resumed as plain ZeRO-3 (tp=1)."""
    tp2 = ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=1)
    uninterrupted = step_losses(run_ranks(_train, 2, TOTAL_STEPS, None, None, tp2))
    run_ranks(_train, 2, STOP_STEP, str(tmp_path), None, tp2)
    results = run_ranks(_train, 2, TOTAL_STEPS, None, str(tmp_path / f"epoch=0-step={STOP_STEP}.ckpt"), "ultrascale_zero3")
    resumed = step_losses(results)
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("resume_stage", [2, 1])
def test_zero2_checkpoint_resumes_on_fewer_ranks(tmp_path, resume_stage):
    """ZeRO-2 on 4 ranks -> ZeRO-2 (or ZeRO-1) on 2: the per-parameter optimizer state is re-laid out."""
    zero2 = ultrascale.ZeRO2Strategy(zero_bucket_mb=0.05)
    uninterrupted = step_losses(run_ranks(_train, 4, TOTAL_STEPS, None, None, zero2))
    run_ranks(_train, 4, STOP_STEP, str(tmp_path), None, zero2)
    resumed_strategy = ultrascale.UltraScaleStrategy(zero_stage=resume_stage, zero_bucket_mb=0.03)  # other buckets too
    results = run_ranks(_train, 2, TOTAL_STEPS, None, str(tmp_path / f"epoch=0-step={STOP_STEP}.ckpt"), resumed_strategy)
    resumed = step_losses(results)
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


def _interrupted_save(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    trainer = trainer_for(world_size, 2)
    model = make_model()
    trainer.fit(model, make_data())
    trainer.save_checkpoint(path)
    before = {n: full(p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_save = dcp.save

    def dies_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("killed during save")

    dcp.save = dies_after_writing
    try:
        trainer.save_checkpoint(path)
        raise AssertionError("the save should have been interrupted")
    except KeyboardInterrupt:
        pass
    finally:
        dcp.save = real_save
    loaded = _WeightsAtTrainStart()
    trainer = trainer_for(world_size, 3, [loaded])
    model = make_model()
    trainer.fit(model, make_data(), ckpt_path=path)  # loads the first (complete) checkpoint
    return {"before": before, "loaded": loaded.weights, "after_load_step": trainer.global_step}


class _WeightsAtTrainStart(L.Callback):
    """The weights right after the checkpoint was restored, before any step."""

    def on_train_start(self, trainer, pl_module):
        self.weights = {n: full(p) for n, p in pl_module.named_parameters()}


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "model.ckpt"
    results = run_ranks(_interrupted_save, 2, str(path))
    assert results[0]["after_load_step"] == 3  # resumed from step 2, trained one more
    # The weights loaded are the first save's, not the +1 weights of the interrupted one.
    for name, weight in results[0]["before"].items():
        assert torch.equal(results[0]["loaded"][name], weight), name
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.ckpt"]
    assert all(".tmp-" in name for name in leftovers)  # the interrupted write never took the final name
    assert (path / "meta.pt").is_file()


def _load(rank, world_size, path):
    trainer = trainer_for(world_size, 1)
    try:
        trainer.fit(make_model(), make_data(), ckpt_path=path)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "loaded"


def test_missing_checkpoint(tmp_path):
    message = run_ranks(_load, 1, str(tmp_path / "nope.ckpt"))[0]
    assert message.startswith("FileNotFoundError") and "nope.ckpt" in message


def test_incomplete_checkpoint_dir(tmp_path):
    bad = tmp_path / "partial.ckpt"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"x")
    message = run_ranks(_load, 1, str(bad))[0]
    assert message.startswith("ValueError") and "missing meta.pt" in message


def test_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "corrupt.ckpt"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"not a pickle")
    torch.save({}, bad / "meta.pt")
    message = run_ranks(_load, 1, str(bad))[0]
    assert message.startswith("RuntimeError") and "could not read the sharded checkpoint" in message


def test_file_instead_of_directory(tmp_path):
    bad = tmp_path / "single_file.ckpt"
    torch.save({"state_dict": {}}, bad)
    message = run_ranks(_load, 1, str(bad))[0]
    assert message.startswith("ValueError") and "is a file" in message


def test_context_parallel_checkpoint_resumes_without_cp(tmp_path):
    """Saved with cp=2 (weights sharded over dp_shard x cp = 2 ranks), resumed as plain ZeRO-3 over
    2 data-parallel ranks: the same global batches, the same loss curve."""
    cp2 = ultrascale.ContextParallelStrategy(context_parallel=2)
    uninterrupted = step_losses(run_ranks(_train, 2, TOTAL_STEPS, None, None, cp2))
    run_ranks(_train, 2, STOP_STEP, str(tmp_path), None, cp2)
    results = run_ranks(_train, 2, TOTAL_STEPS, None, str(tmp_path / f"epoch=0-step={STOP_STEP}.ckpt"), "ultrascale_zero3")
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)
