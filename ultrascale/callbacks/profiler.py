"""Capture a window of training steps with `torch.profiler`: per-rank Chrome traces and a top-ops table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["ProfilerCapture"]


class ProfilerCapture(Callback):
    """Profile training steps on the schedule `wait, warmup, active` (x `repeat`) and write Chrome traces.

    Each rank writes `rank<r>.<timestamp>.pt.trace.json` per active window (TensorBoard's
    profiler plugin and https://ui.perfetto.dev read them) and `rank<r>_summary_<n>.txt`, the
    table of the top ops, which rank 0 also prints.

    Example::

        trainer = L.Trainer(callbacks=[ProfilerCapture(wait=5, warmup=2, active=3, record_shapes=True)])
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        dirpath: Optional[str] = None,
        row_limit: int = 20,
        sort_by: Optional[str] = None,
    ) -> None:
        """
        Args:
            wait: steps skipped at the start of each cycle (profiler off).
            warmup: steps profiled but discarded (the profiler's own start-up cost lands here).
            active: steps recorded into each trace; >= 1.
            repeat: number of wait/warmup/active cycles; 0 repeats until training ends.
            skip_first: steps skipped once, before the first cycle (e.g. to pass compilation).
            record_shapes: record operator input shapes (group the table by shape too).
            profile_memory: record tensor allocations and frees (memory view in the trace).
            with_stack: record Python stacks (larger traces, flame graphs).
            dirpath: trace directory; None: `<trainer.log_dir>/profiler`.
            row_limit: rows of the top-ops table.
            sort_by: column the table is sorted by; None: `self_cuda_time_total` on GPU, `self_cpu_time_total` on CPU.
        """
        super().__init__()
        for name, value, minimum in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                     ("repeat", repeat, 0), ("skip_first", skip_first, 0), ("row_limit", row_limit, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"ProfilerCapture: `{name}={value!r}` must be an integer >= {minimum}")
        self.wait, self.warmup, self.active, self.repeat, self.skip_first = wait, warmup, active, repeat, skip_first
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.dirpath, self.row_limit, self.sort_by = dirpath, row_limit, sort_by
        self.traces_dir: Optional[str] = None
        """Directory the traces of this run went to (set at train start)."""
        self.summaries: list[str] = []
        """The top-ops tables of this rank, one per active window."""
        self._profiler: Optional[torch.profiler.profile] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        directory = self.dirpath or os.path.join(trainer.log_dir or trainer.default_root_dir, "profiler")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.traces_dir = directory
        cuda = trainer.strategy.root_device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        sort_by = self.sort_by or ("self_cuda_time_total" if cuda else "self_cpu_time_total")
        rank = trainer.global_rank
        write_trace = torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{rank}")

        def on_trace_ready(profiler: torch.profiler.profile) -> None:
            write_trace(profiler)
            table = profiler.key_averages(group_by_input_shape=self.record_shapes).table(
                sort_by=sort_by, row_limit=self.row_limit
            )
            self.summaries.append(table)
            Path(directory, f"rank{rank}_summary_{len(self.summaries)}.txt").write_text(table)
            rank_zero_info(f"ProfilerCapture: top ops of window {len(self.summaries)} (rank 0), traces in {directory}\n{table}")

        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat, skip_first=self.skip_first
            ),
            on_trace_ready=on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profiler.start()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._stop()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
