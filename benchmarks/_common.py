"""Pieces shared by the benchmark scripts: random-token data laid out like ultrascale's sampler, a step timer."""

from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from ultrascale.data import ResumableBlockSampler
from ultrascale.launch import run_ranks

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
    """Print the results table and write it (markdown) under benchmarks/results/, the one home of the figures docs/benchmarks.md links."""
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


# ----------------------------------------------------------------------------- a shared machine


def _machine_busy_s() -> float:
    """CPU seconds all processes of the machine have spent busy (/proc/stat), since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished ranks."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


class ForeignLoad:
    """The share of the machine's cores that other processes kept busy between `start` and `stop`."""

    def start(self) -> None:
        self.t, self.busy, self.own = time.perf_counter(), _machine_busy_s(), _own_cpu_s()

    def stop(self) -> float:
        wall = time.perf_counter() - self.t
        foreign = (_machine_busy_s() - self.busy) - (_own_cpu_s() - self.own)
        return max(0.0, foreign) / (wall * cores())


def _wait_for_quiet(max_wait: float, threshold: float = 0.1, window: float = 0.3) -> float:
    """Wait until other processes use under `threshold` of the cores over `window` s (at most `max_wait` s)."""
    start, load = time.perf_counter(), ForeignLoad()
    while max_wait > 0:
        load.start()
        time.sleep(window)
        if load.stop() < threshold or time.perf_counter() - start >= max_wait:
            break
    return time.perf_counter() - start


class Undisturbed:
    """`run_ranks` on a machine other processes may share: wait (at most 10 s) for idle cores before a run,
    and redo a run during which other processes took more than `threshold` of the cores, while the
    budget of `budget` s (waiting plus redone runs) lasts."""

    def __init__(self, budget: float, threshold: float = 0.15) -> None:
        self.budget, self.threshold = budget, threshold
        self.spent, self.redone, self.loads = 0.0, 0, []

    def run(self, fn, world_size, *args):
        while True:
            self.spent += _wait_for_quiet(min(10.0, self.budget - self.spent))
            load, start = ForeignLoad(), time.perf_counter()
            load.start()
            result = run_ranks(fn, world_size, *args)
            foreign = load.stop()
            if foreign <= self.threshold or self.spent + time.perf_counter() - start > self.budget:
                self.loads.append(foreign)
                return result, foreign
            self.spent += time.perf_counter() - start
            self.redone += 1
            print(f"  (redone: other processes took {100 * foreign:.0f}% of the cores)", flush=True)
