"""Pieces shared by the benchmark scripts: random-token data laid out like ultrascale's sampler, a step timer."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from ultrascale.data import ResumableBlockSampler

WARMUP_STEPS = 3


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.blocks = torch.randint(0, vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i, :-1], "labels": self.blocks[i, 1:]}


class Data(L.LightningDataModule):
    def __init__(self, n: int, seq_len: int, vocab: int, global_batch: int) -> None:
        super().__init__()
        self.dataset, self.global_batch = RandomTokens(n, seq_len, vocab), global_batch

    def train_dataloader(self) -> DataLoader:
        layout = self.trainer.strategy.distributed_sampler_kwargs
        sampler = ResumableBlockSampler(self.dataset, self.global_batch, shuffle=False, **layout)
        return DataLoader(self.dataset, batch_size=sampler.local_batch_size, sampler=sampler)


class Throughput(L.Callback):
    def __init__(self) -> None:
        self.start = self.end = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == WARMUP_STEPS:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= WARMUP_STEPS:
            self.end, self.steps = time.perf_counter(), self.steps + 1


def write_results(text: str, out: str | Path) -> None:
    """Print the results table and write it (markdown) for the README."""
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(f"written to {out}")


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine() -> str:
    """One line for a results file: CPU model, usable cores, OS."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {cores()} CPU cores available, {platform.system()} {platform.release()}"


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
