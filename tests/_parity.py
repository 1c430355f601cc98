"""Shared pieces of the parity tests: data, a plain-torch reference loop, a recording callback.

The reference never touches ultrascale: a single process, a plain PyTorch loop over the
same global batches, so a bug in the strategy cannot hide in the reference.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from ultrascale.data import ResumableBlockSampler
from ultrascale.parallel.zero import zero_engine_for


class TokenDataset(Dataset):
    """Random token blocks with shifted labels; the same on every rank for a given seed."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        return {"input_ids": block[:-1], "labels": block[1:]}


class ParityData(L.LightningDataModule):
    """Global batch b = samples [b*G, (b+1)*G) in order; dp rank r gets its contiguous slice.

    (Lightning's automatic DistributedSampler always shuffles training data, so the
    parity tests use ultrascale's sampler without shuffling instead.)
    """

    def __init__(self, dataset: Dataset, global_batch: int) -> None:
        super().__init__()
        self.dataset, self.global_batch = dataset, global_batch

    def train_dataloader(self) -> DataLoader:
        layout = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = ResumableBlockSampler(self.dataset, self.global_batch, shuffle=False, **layout)
        return DataLoader(self.dataset, batch_size=sampler.local_batch_size, sampler=sampler, drop_last=True)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone().cpu()


class Recorder(L.Callback):
    """Per micro-batch losses, gradients before the first optimizer step, weights after it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.first_params: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning hands back the loss already divided by accumulate_grad_batches.
        self.losses.append(float(outputs["loss"].detach()) * trainer.accumulate_grad_batches)
        if self.first_grads is not None and self.first_params is None and trainer.global_step == 1:
            self.first_params = {n: full(p) for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.first_grads is None:
            engine = zero_engine_for(optimizer)
            if engine is not None:  # ZeRO-1/2: the reduced gradients are sharded slices of flat buckets
                self.first_grads = {n: g.float() for n, g in engine.full_gradients().items()}
            else:
                self.first_grads = {n: full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}

    def result(self) -> dict[str, Any]:
        return {"losses": self.losses, "grads": self.first_grads, "params": self.first_params}


def reference_run(
    module: L.LightningModule,
    dataset: Dataset,
    *,
    global_batch: int,
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
) -> dict[str, Any]:
    """The same LightningModule trained by a plain single-process loop."""
    module = copy.deepcopy(module)
    module.configure_model()
    configured = module.configure_optimizers()
    scheduler = None
    if isinstance(configured, dict):
        optimizer = configured["optimizer"]
        scheduler = configured.get("lr_scheduler", {}).get("scheduler")
    else:
        optimizer = configured
    batches = iter(DataLoader(dataset, batch_size=global_batch, shuffle=False, drop_last=True))
    losses: list[float] = []
    out: dict[str, Any] = {"grads": None, "params": None}
    for step in range(steps):
        for micro in range(accumulate):
            batch = next(batches)
            with warnings.catch_warnings():  # `self.log` without a Trainer only warns
                warnings.filterwarnings("ignore", message=".*self.log.*")
                loss = module.training_step(batch, step * accumulate + micro)
            loss = loss["loss"] if isinstance(loss, dict) else loss
            (loss / accumulate).backward()
            losses.append(float(loss.detach()))
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        if clip is not None and clip_algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if step == 0:
            out["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["losses"] = losses
    return out


def dp_mean_losses(per_rank_losses: list[list[float]]) -> list[float]:
    """Each dp rank's loss is the mean over its slice; equal slices make the dp mean the global mean."""
    return [sum(values) / len(values) for values in zip(*per_rank_losses)]


def assert_parity(result: dict[str, Any], reference: dict[str, Any], losses: list[float]) -> None:
    """fp32 parity: first-step loss and every gradient, weights after step 1, the whole loss curve."""
    from torch.testing import assert_close

    assert_close(losses[0], reference["losses"][0], rtol=1e-5, atol=1e-6)
    assert set(result["grads"]) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    for name, param in reference["params"].items():
        # Adam's first update is lr * g / (|g| + eps), whose slope lr/eps at g ~ 0 amplifies the
        # reduction-order noise of tiny gradients; the parity modules use eps = 1e-6 (lr/eps = 3e3),
        # so 1e-5 is 0.3% of one update (lr = 3e-3) while a wrong gradient moves a weight by ~lr.
        assert_close(result["params"][name], param, rtol=1e-5, atol=1e-5, msg=lambda m: f"param {name}: {m}")
    assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=0, atol=1e-4)
