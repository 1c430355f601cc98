"""ultrascale's modules under Lightning's own strategies (`strategy="auto"` on one device, DDP) train what ultrascale's
strategies train: the Hugging Face model in train mode (dropout on), and the exact token mean over accumulated
micro-batches of uneven valid-token counts, against the inline one-process reference."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import ultrascale
from tests._dist import run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    full,
    make_hf,
    make_hf_checkpoint,
    parity_trainer,
    reference_run,
)

VOCAB, SEQ, MICRO_BATCH, ACCUMULATE, STEPS = 128, 16, 4, 2, 6


def data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH * ACCUMULATE, SEQ, VOCAB, seed=21, masked=True)


def test_hf_model_trains_in_train_mode_under_the_default_strategy(tmp_path) -> None:
    """`from_pretrained` returns an eval-mode model; at the first batch every module is in train mode and the
    attention dropout changes the loss."""
    path = make_hf_checkpoint(tmp_path / "llama", "llama", vocab_size=VOCAB, hidden_size=32, attention_dropout=0.5)
    seen = {}

    class Modes(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:
                seen["eval"] = [name for name, m in module.named_modules() if not m.training]
                with torch.no_grad():
                    seen["train_loss"] = float(module.batch_loss(batch)["loss"])
                    module.eval()
                    seen["eval_loss"] = float(module.batch_loss(batch)["loss"])
                    module.train()

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Modes()])
    trainer.fit(make_hf(path), ParityData(data(), MICRO_BATCH))
    assert seen["eval"] == []
    assert abs(seen["train_loss"] - seen["eval_loss"]) > 1e-4, seen


def _losses(rank, world_size, path, strategy):
    recorder = Recorder()
    strategy = ultrascale.ZeRO3Strategy() if strategy == "ultrascale_zero3" else strategy
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, accumulate_grad_batches=ACCUMULATE)
    module = make_hf(path)
    trainer.fit(module, ParityData(data(), MICRO_BATCH))
    return {"losses": recorder.losses, "params": {n: full(p) for n, p in module.named_parameters()}}


@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_accumulation_gives_the_exact_token_mean_under_lightnings_strategies(strategy, tmp_path) -> None:
    """Accumulation 2 on uneven masked micro-batches: `strategy="auto"` on one device (and DDP over 2, each rank half
    of every micro-batch) logs the losses of `ultrascale_zero3` on one device within 1e-6, and both the inline
    reference's; the mean of the micro-batch means (what Lightning's strategies gave) is measurably another curve."""
    path = make_hf_checkpoint(tmp_path / "llama", "llama", vocab_size=VOCAB, hidden_size=32)
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    (ours,) = run_ranks(_losses, 1, path, "ultrascale_zero3")
    world = 2 if strategy == "ddp" else 1
    theirs = run_ranks(_losses, world, path, strategy)
    for result in theirs:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ours["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    for name, param in theirs[0]["params"].items():
        torch.testing.assert_close(param, ours["params"][name], rtol=1e-5, atol=5e-5)
    rows = data()
    first = [rows[i]["labels"] for i in range(MICRO_BATCH * ACCUMULATE)]
    counts = [int((torch.stack(first[m * MICRO_BATCH:(m + 1) * MICRO_BATCH]) != -100).sum()) for m in range(ACCUMULATE)]
    assert counts[0] != counts[1]  # uneven: the mean of means is not the token mean
