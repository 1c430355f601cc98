"""A non-finite step is caught on the step it happens: the strategy checks the step's global loss and
global gradient norm. "stop" raises with the step and rank; "skip" drops the step (no update) and
the weights equal those of a run that never saw that batch; loss spikes are noted."""

import math

import pytest
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, parity_trainer
from ultrascale.models.lm import LlamaLM
from ultrascale.strategies.step import StepGuard

SEQ, BATCH, STEPS, BAD_STEP = 16, 4, 6, 3


class InfAtStep(LlamaLM):
    """The loss of one step is multiplied by inf: every gradient becomes inf/NaN."""

    def __init__(self, bad_step=BAD_STEP, **kwargs):
        super().__init__(preset="tiny", learning_rate=3e-3, warmup_steps=1, min_lr_ratio=1.0, max_steps=100, eps=1e-6, **kwargs)
        self.bad_step = bad_step

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.bad_step:
            out["loss"] = out["loss"] * float("inf")
        return out


def data(drop_batch=None):
    dataset = TokenDataset(STEPS * BATCH, SEQ, 512, seed=2, masked=True)
    if drop_batch is not None:  # the same data without the rows of that global batch
        keep = [i for i in range(len(dataset)) if not drop_batch * BATCH <= i < (drop_batch + 1) * BATCH]
        dataset.blocks, dataset.labels = dataset.blocks[keep], dataset.labels[keep]
    return dataset


STRATEGIES = {
    "zero3": (2, dict()),
    "tp2xdp2": (4, dict(tensor_parallel=2, data_parallel_shard=2)),
    "zero2": (2, dict(zero_stage=2, zero_bucket_mb=0.05)),
}


def _run(rank, world_size, layout, policy, steps, drop_batch, bad_step):
    kwargs = STRATEGIES[layout][1]
    strategy = ultrascale.UltraScaleStrategy(nonfinite=policy, **kwargs)
    recorder = Recorder()
    trainer = parity_trainer(world_size, strategy, recorder, steps, gradient_clip_val=1.0)
    module = InfAtStep(bad_step=bad_step)
    try:
        trainer.fit(module, ParityData(data(drop_batch), BATCH))
    except FloatingPointError as error:
        return {"error": str(error)}
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()}
    metrics = recorder.logger.steps
    return {"error": None, "weights": weights, "losses": recorder.losses, "metrics": metrics}


@pytest.mark.parametrize("layout", ["zero3", "tp2xdp2"])
def test_stop_names_the_step_and_rank(layout):
    world = STRATEGIES[layout][0]
    results = run_ranks(_run, world, layout, "stop", STEPS, None, BAD_STEP)
    for rank, result in enumerate(results):
        assert result["error"] is not None, "the inf step trained on"
        assert f"non-finite step {BAD_STEP} (rank {rank})" in result["error"]
        assert "global gradient norm" in result["error"] and "nonfinite='skip'" in result["error"]


@pytest.mark.parametrize("layout", ["zero3", "tp2xdp2", "zero2"])
def test_skip_equals_a_run_without_that_batch(layout):
    world = STRATEGIES[layout][0]
    skipped = run_ranks(_run, world, layout, "skip", STEPS, None, BAD_STEP)[0]
    # The reference never sees that batch and has no bad step; with a constant learning rate after
    # warm-up and AdamW's step count untouched by the skip, the weights must be the same.
    without = run_ranks(_run, world, layout, "stop", STEPS - 1, BAD_STEP, -1)[0]
    assert skipped["error"] is None and without["error"] is None
    assert not math.isfinite(skipped["losses"][BAD_STEP])  # the bad step's loss is logged as it was
    assert skipped["losses"][:BAD_STEP] + skipped["losses"][BAD_STEP + 1:] == pytest.approx(without["losses"], abs=1e-6)
    for name, value in without["weights"].items():
        assert_close(skipped["weights"][name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any(m.get("skipped_steps") == 1.0 for m in skipped["metrics"].values())


def _rollback(rank, world_size, layout, ckpt_dir, steps, drop_batches, bad_step, every, policy="rollback"):
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = ultrascale.UltraScaleStrategy(nonfinite=policy, **STRATEGIES[layout][1])
    recorder = Recorder()
    callbacks = [recorder]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=recorder.logger,
                        log_every_n_steps=1, enable_checkpointing=bool(every), enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, gradient_clip_val=1.0)
    module = InfAtStep(bad_step=bad_step)
    dataset = data()
    if drop_batches:
        keep = [i for i in range(len(dataset)) if i // BATCH not in drop_batches]
        dataset.blocks, dataset.labels = dataset.blocks[keep], dataset.labels[keep]
    try:
        trainer.fit(module, ParityData(dataset, BATCH))
    except (FloatingPointError, ValueError) as error:
        return {"error": str(error), "initialised": torch.distributed.is_initialized()}
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()}
    return {"error": None, "weights": weights, "losses": recorder.losses, "metrics": recorder.logger.steps}


@pytest.mark.parametrize("layout", ["zero3", "zero2"])
def test_rollback_restores_the_checkpoint_and_skips_the_batches_since(layout, tmp_path):
    world = STRATEGIES[layout][0]
    # Checkpoints at steps 2 and 4; the inf comes at step 3: back to step 2's weights and optimizer
    # state, and batches 2 and 3 (the one after that checkpoint and the bad one) are never trained on.
    rolled = run_ranks(_rollback, world, layout, str(tmp_path / "ckpt"), STEPS, (), BAD_STEP, 2)[0]
    # The same model trained on the data without batches 2 and 3, no bad step: 4 optimizer steps.
    without = run_ranks(_rollback, world, layout, str(tmp_path / "none"), STEPS - 2, (2, 3), -1, 0, "stop")[0]
    assert rolled["error"] is None and without["error"] is None, (rolled["error"], without["error"])
    for name, value in without["weights"].items():
        assert_close(rolled["weights"][name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any(m.get("rollbacks") == 1.0 for m in rolled["metrics"].values())
    # Steps 4 and 5 train on batches 4 and 5 from step 2's weights: the reference's steps 2 and 3.
    assert rolled["losses"][4:] == pytest.approx(without["losses"][2:], abs=1e-6)


def test_rollback_needs_checkpoints(tmp_path):
    # No ModelCheckpoint at all: refused before any process group.
    for result in run_ranks(_rollback, 2, "zero3", str(tmp_path), STEPS, (), BAD_STEP, 0):
        assert result["error"] is not None and "writes none: add a ModelCheckpoint" in result["error"]
        assert not result["initialised"]
    # Checkpoints every 5 steps, the inf at step 3: nothing to roll back to yet, so it stops there.
    for result in run_ranks(_rollback, 2, "zero3", str(tmp_path / "late"), STEPS, (), BAD_STEP, 5):
        assert result["error"] is not None and "no complete checkpoint to roll back to" in result["error"]


def test_skip_stops_after_the_limit():
    guard = StepGuard("skip", max_skips=2)
    assert guard.check(step=0, rank=0, loss=1.0, grad_norm=1.0)
    assert not guard.check(step=1, rank=0, loss=float("nan"), grad_norm=1.0)
    assert not guard.check(step=2, rank=0, loss=1.0, grad_norm=float("inf"))
    with pytest.raises(FloatingPointError, match=r"non-finite step 3 \(rank 0\).*2 step\(s\) were skipped already"):
        guard.check(step=3, rank=0, loss=float("inf"), grad_norm=1.0)
    with pytest.raises(ValueError, match="nonfinite='sometimes'"):
        StepGuard("sometimes")


def test_loss_spikes_are_noted_robustly():
    guard = StepGuard()
    losses = [3.0 + 0.01 * math.sin(i) for i in range(50)]
    assert all(guard.spike(x) is None for x in losses)  # noise is not a spike
    z = guard.spike(4.0)
    assert z is not None and z > 6 and guard.spikes == 1
    assert guard.spike(3.0) is None  # one outlier in the window does not move the median
