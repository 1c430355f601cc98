"""Fork children of a process that has run a two-thread parallel region: each one ultrascale starts runs one
intra-op thread, so its parallel regions end (with two they wait forever in a GOMP barrier, shown first)."""

from __future__ import annotations

import os
import signal
import time

import lightning as L
import pytest
import torch

import ultrascale
from tests._parity import ParityData, TokenDataset
from ultrascale.launch import run_ranks
from ultrascale.models import LlamaLM


def test_a_two_thread_region_in_a_fork_child_waits_forever(two_thread_region_ran):
    """The hazard itself, so the tests below can fail: a plain fork child that keeps two threads never finishes."""
    pid = os.fork()
    if pid == 0:
        torch.cos(torch.randn(1_000_000)).sum()
        os._exit(0)
    try:
        time.sleep(3)  # the region takes milliseconds
        ended, _ = os.waitpid(pid, os.WNOHANG)
        assert ended == 0, "libgomp survived fork here: one_thread_after_fork may no longer be needed"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _parallel_region(rank: int, world_size: int) -> int:
    torch.cos(torch.randn(1_000_000)).sum()
    return torch.get_num_threads()


def test_run_ranks_ranks_run_one_thread(two_thread_region_ran):
    assert run_ranks(_parallel_region, 2, timeout=60) == [1, 1]


class _ThreadsLM(LlamaLM):
    def on_train_start(self) -> None:
        torch.cos(torch.randn(1_000_000)).sum()
        self.log("threads", float(torch.get_num_threads()), rank_zero_only=True)


@pytest.mark.timeout(120)
def test_fork_launcher_ranks_run_one_thread_whatever_omp_num_threads_says(two_thread_region_ran, monkeypatch):
    # Lightning's launchers leave OMP_NUM_THREADS set in this process; ranks once kept that many threads and hung.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    strategy = ultrascale.ZeRO3Strategy(launcher="fork")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, max_steps=2,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_ThreadsLM(preset="tiny", max_steps=2), ParityData(TokenDataset(16, 16, 512), 8))
    assert trainer.callback_metrics["threads"].item() == 1
