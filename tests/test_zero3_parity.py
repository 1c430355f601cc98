"""ZeRO-3 and HSDP against a single-process run of the same LlamaLM on the same prompt-masked data (fp32)."""

import lightning as L
import pytest
import torch
import torch.distributed as dist

import ultrascale  # noqa: F401
from tests._dist import counting_calls, run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from ultrascale.models.lm import LlamaLM

SEQ, MICRO_BATCH, STEPS = 32, 8, 10


def make_model() -> LlamaLM:
    # Constant-ish lr (warm-up 1 step) so every step moves the weights.
    return LlamaLM(preset="tiny", learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def dataset(accumulate: int) -> TokenDataset:
    return TokenDataset(STEPS * accumulate * MICRO_BATCH, SEQ, vocab_size=512, seed=1, masked=True)


def _train(rank, world_size, strategy, accumulate, clip):
    L.seed_everything(rank, verbose=False)  # different global RNG per rank: init must not depend on it
    recorder = Recorder()
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, accumulate_grad_batches=accumulate,
                             gradient_clip_val=clip)
    model = make_model()
    with counting_calls(dist, "reduce_scatter_single") as calls:
        trainer.fit(model, ParityData(dataset(accumulate), MICRO_BATCH))
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    mesh = trainer.strategy.device_mesh
    return {**recorder.result(), "units": units, "reduce_scatters": calls["reduce_scatter_single"],
            "mesh": (mesh["dp_replicate"].size(), mesh["dp_shard"].size())}


CASES = {
    "zero3-w2": (2, "ultrascale_zero3", 1, None, (1, 2)),
    "zero3-w4": (4, "ultrascale_zero3", 1, None, (1, 4)),
    "hsdp-2x2": (4, "ultrascale_hsdp", 1, None, (2, 2)),
    "zero3-w2-accum4-clip": (2, "ultrascale_zero3", 4, 0.05, (1, 2)),
    "hsdp-2x2-accum4-clip": (4, "ultrascale_hsdp", 4, 0.05, (2, 2)),
    "zero3-w2-accum4-unsharded": (2, ("ultrascale_zero3", {"accumulate_unsharded_grads": True}), 4, None, (1, 2)),
    "hsdp-2x2-accum4-unsharded": (4, ("ultrascale_hsdp", {"accumulate_unsharded_grads": True}), 4, 0.05, (2, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_process(case):
    world_size, strategy, accumulate, clip, mesh = CASES[case]
    reference = reference_run(
        make_model(), dataset(accumulate), global_batch=MICRO_BATCH, steps=STEPS, accumulate=accumulate, clip=clip
    )
    if clip is not None:  # the test must exercise clipping, not pass through it
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference["grads"].values()]))
        assert norm > 2 * clip
    unsharded = isinstance(strategy, tuple)
    if unsharded:
        name, knobs = strategy
        strategy = {"ultrascale_zero3": ultrascale.ZeRO3Strategy, "ultrascale_hsdp": ultrascale.HSDPStrategy}[name](**knobs)
    results = run_ranks(_train, world_size, strategy, accumulate, clip)
    assert results[0]["mesh"] == mesh
    losses = step_losses(results)
    assert_parity(results[0], reference, losses)
    # Gradient accumulation: by default every micro-batch reduce-scatters into the sharded gradients
    # (ZeRO-3's memory); with `accumulate_unsharded_grads` once per FSDP unit per optimizer step.
    per_step = 1 if unsharded else accumulate
    assert results[0]["reduce_scatters"] == results[0]["units"] * STEPS * per_step


def _strategy_object(rank, world_size):
    strategy = ultrascale.UltraScaleStrategy(data_parallel_replicate=2, data_parallel_shard=2, reshard_after_forward=False)
    return _train(rank, world_size, strategy, 1, None)


def test_4d_strategy_object_no_reshard_matches_hsdp():
    reference = reference_run(make_model(), dataset(1), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_strategy_object, 4)
    assert results[0]["mesh"] == (2, 2)
    assert_parity(results[0], reference, step_losses(results))


class AllGathersPerBatch(L.Callback):
    """The all-gathers issued during each training batch, from a running count."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts, self.starts = counts, []

    def total(self) -> int:
        return sum(self.counts.values())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(self.total())

    def per_batch(self) -> list[int]:
        return [end - start for start, end in zip(self.starts, [*self.starts[1:], self.total()])]


def _count_all_gathers(rank, world_size):
    with counting_calls(dist, "all_gather_single", "all_gather_into_tensor") as counts:
        counter = AllGathersPerBatch(counts)
        trainer = parity_trainer(world_size, "ultrascale_zero3", Recorder(), 3, callbacks=[counter])
        trainer.fit(make_model(), ParityData(dataset(1), MICRO_BATCH))
    return counter.per_batch()


def test_root_unit_is_gathered_once_per_step():
    """LlamaLM's step calls `self(...)`, entering the root unit itself: after the first step (which
    finds that out) the root (embeddings, norm, head) is gathered once per step, each block twice
    (forward, backward) except the last, which stays gathered from forward to backward."""
    per_batch = run_ranks(_count_all_gathers, 2)[0]
    blocks = 2
    assert per_batch[1:] == [1 + 2 * (blocks - 1) + 1] * 2
