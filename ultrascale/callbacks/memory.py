"""Memory per step: allocator peaks on GPU, RSS on CPU, measured and estimated model-state bytes.

On CUDA it can also record the caching allocator's history and dump a snapshot per rank
(on an out-of-memory error, or after a chosen step) for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ultrascale.callbacks._common import parallel_dims_of
from ultrascale.estimate import ModelStateEstimate, estimate_model_state_bytes
from ultrascale.parallel.memory import model_state_bytes

__all__ = ["MemoryMonitor", "optimizer_states_per_param"]

GiB = 2**30

# Optimizer-state tensors per parameter, each the parameter's dtype (torch's implementations).
_STATES_PER_PARAM: dict[type, int] = {
    torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.Adamax: 2, torch.optim.NAdam: 2,
    torch.optim.RAdam: 2, torch.optim.Adagrad: 1, torch.optim.Adadelta: 2,
}  # fmt: skip


def optimizer_states_per_param(optimizer: torch.optim.Optimizer) -> Optional[int]:
    """Tensors of optimizer state per parameter (Adam: 2 moments); None for an optimizer not in the table."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0
    if isinstance(optimizer, torch.optim.RMSprop):
        group = optimizer.param_groups[0]
        return 1 + (group.get("momentum", 0) > 0) + bool(group.get("centered", False))
    for cls, states in _STATES_PER_PARAM.items():
        if isinstance(optimizer, cls):
            return states
    return None


class MemoryMonitor(Callback):
    """Logs memory after every training batch, and dumps CUDA memory snapshots on demand or on OOM.

    Metrics: `memory/model_state_gib` (parameters + gradients + optimizer state held by this
    rank, measured on the live, sharded tensors just before the optimizer step, where it peaks) and `memory/model_state_estimate_gib` (ZeRO
    formula, see `ultrascale.estimate.estimate_model_state_bytes`); on CUDA
    `memory/max_allocated_gib`, `memory/max_reserved_gib`, `memory/max_allocated_pct`,
    `memory/max_reserved_pct` (of the device's memory), `memory/alloc_retries`, `memory/ooms`;
    on CPU `memory/rss_gib` (resident set size of this process).

    Example::

        trainer = L.Trainer(callbacks=[MemoryMonitor(snapshot_at_step=5)])  # CUDA snapshot after step 5
    """

    def __init__(
        self,
        snapshot_at_step: Optional[int] = None,
        snapshot_on_oom: bool = True,
        snapshot_dir: Optional[str] = None,
        max_snapshot_entries: int = 100_000,
        prog_bar: bool = False,
    ) -> None:
        """
        Args:
            snapshot_at_step: CUDA only: dump a memory snapshot per rank after this optimizer step.
            snapshot_on_oom: CUDA only: dump a snapshot per rank when training raises `torch.OutOfMemoryError`.
            snapshot_dir: where snapshots go; None: `<trainer.log_dir>/memory_snapshots`.
            max_snapshot_entries: allocation events the allocator history keeps (`_record_memory_history`).
            prog_bar: show the peak memory (GPU) or RSS (CPU) in the progress bar.
        """
        super().__init__()
        if snapshot_at_step is not None and (not isinstance(snapshot_at_step, int) or snapshot_at_step < 1):
            raise ValueError(f"MemoryMonitor: `snapshot_at_step={snapshot_at_step!r}` must be an integer >= 1 (or None)")
        if max_snapshot_entries < 1:
            raise ValueError(f"MemoryMonitor: `max_snapshot_entries={max_snapshot_entries!r}` must be >= 1")
        self.snapshot_at_step = snapshot_at_step
        self.snapshot_on_oom = snapshot_on_oom
        self.snapshot_dir = snapshot_dir
        self.max_snapshot_entries = max_snapshot_entries
        self.prog_bar = prog_bar
        self.snapshots: list[str] = []
        """Paths of the snapshots this rank wrote."""
        self._recording = False
        self._warned_estimate = False
        self._measured: Optional[int] = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        cuda = trainer.strategy.root_device.type == "cuda"
        if self.snapshot_at_step is not None and not cuda:
            raise ValueError(
                f"MemoryMonitor(`snapshot_at_step={self.snapshot_at_step}`): memory snapshots record the CUDA caching "
                f"allocator, and this run is on {trainer.strategy.root_device.type}; leave `snapshot_at_step=None`"
            )
        if cuda and (self.snapshot_at_step is not None or self.snapshot_on_oom):
            # Python frames only: unwinding C++ stacks at every allocation is what makes recording slow.
            torch.cuda.memory._record_memory_history(max_entries=self.max_snapshot_entries, stacks="python")
            self._recording = True

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    # ------------------------------------------------------------------ estimate
    def estimate(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[ModelStateEstimate]:
        """The analytic model-state bytes of this rank, or None if the optimizer is not in the table."""
        params = list({id(p): p for p in pl_module.parameters()}.values())
        if not params:
            return None
        states = [optimizer_states_per_param(o) for o in trainer.optimizers]
        if any(s is None for s in states):
            if not self._warned_estimate:
                names = ", ".join(type(o).__name__ for o in trainer.optimizers)
                rank_zero_warn(f"MemoryMonitor: no state-size rule for optimizer {names}; the estimate is not logged")
                self._warned_estimate = True
            return None
        dims = parallel_dims_of(trainer.strategy)
        if dims is None:  # Lightning's own strategies: every rank holds everything
            zero_stage, shard, model_parallel = 0, 1, 1
        else:
            zero_stage = getattr(trainer.strategy, "zero_stage", 3)
            shard, model_parallel = dims.dp_shard_cp, dims.tp * dims.pp
        element = params[0].element_size()  # DTensor/shards report the dtype of their local data
        engines = _engines(trainer)  # ZeRO-1/2 may hold gradients in another dtype than the weights (fp32)
        grad_element = engines[0].buckets[0].accumulate_dtype.itemsize if engines and engines[0].buckets else element
        # The optimizer's own parameters decide the state dtype: ZeRO-1/2 under bf16-mixed step
        # fp32 master copies of bf16 weights (+4 bytes per parameter, the Playbook's 12 = 4 + 8).
        optimizer_params = [p for o in trainer.optimizers for g in o.param_groups for p in g["params"]]
        state_element = optimizer_params[0].element_size() if optimizer_params else element
        master_bytes = state_element if state_element != element else 0
        return estimate_model_state_bytes(
            sum(p.numel() for p in params),  # a DTensor's numel is the global size
            zero_stage=zero_stage,
            shard_degree=shard,
            model_parallel_degree=model_parallel,
            param_bytes=element,
            grad_bytes=grad_element,
            optimizer_bytes=state_element * sum(s for s in states if s is not None) + master_bytes,
        )

    # ------------------------------------------------------------------ per step
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        # Model state peaks here: the gradients exist (ZeRO-2 frees its slices after the step) and
        # the optimizer state exists from the step before (from the second step on).
        self._measured = model_state_bytes(pl_module, trainer.optimizers, _engines(trainer)).total

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        measured = (self._measured if self._measured is not None
                    else model_state_bytes(pl_module, trainer.optimizers, _engines(trainer)).total)
        self._measured = None
        metrics = {"memory/model_state_gib": measured / GiB}
        estimate = self.estimate(trainer, pl_module)
        if estimate is not None:
            metrics["memory/model_state_estimate_gib"] = estimate.total / GiB
        device = trainer.strategy.root_device
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            total = torch.cuda.get_device_properties(device).total_memory
            allocated = stats.get("allocated_bytes.all.peak", 0)
            reserved = stats.get("reserved_bytes.all.peak", 0)
            metrics.update({
                "memory/max_allocated_gib": allocated / GiB,
                "memory/max_reserved_gib": reserved / GiB,
                "memory/max_allocated_pct": 100 * allocated / total,
                "memory/max_reserved_pct": 100 * reserved / total,
                # Retries: the allocator freed its cache and retried a cudaMalloc (fragmentation pressure).
                "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "memory/ooms": float(stats.get("num_ooms", 0)),
            })  # fmt: skip
            shown = "memory/max_allocated_gib"
        else:
            import psutil

            metrics["memory/rss_gib"] = psutil.Process(os.getpid()).memory_info().rss / GiB
            shown = "memory/rss_gib"
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=self.prog_bar and name == shown, batch_size=1)
        if self._recording and self.snapshot_at_step is not None and trainer.global_step == self.snapshot_at_step:
            self.dump_snapshot(trainer, f"step{trainer.global_step}")

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self._recording and self.snapshot_on_oom and isinstance(exception, torch.OutOfMemoryError):
            self.dump_snapshot(trainer, f"oom_step{trainer.global_step}")

    def dump_snapshot(self, trainer: "pl.Trainer", tag: str) -> str:
        """Write `torch.cuda.memory._snapshot()` of this rank as a pickle and say where."""
        directory = Path(self.snapshot_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "memory_snapshots"))
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{trainer.global_rank}_{tag}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        self.snapshots.append(str(path))
        print(f"MemoryMonitor: rank {trainer.global_rank} wrote a CUDA memory snapshot to {path} "
              "(open it at https://pytorch.org/memory_viz)", flush=True)
        return str(path)


def _engines(trainer: "pl.Trainer") -> tuple:
    """The strategy's ZeRO-1/2 engines (its public `zero_engines`), whose gradient slices count as gradients."""
    return tuple(getattr(trainer.strategy, "zero_engines", ()))
