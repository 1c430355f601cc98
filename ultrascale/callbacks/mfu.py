"""Throughput and model FLOPs utilisation (MFU / HFU), counted once per data-parallel group.

    MFU = (model FLOPs per token x tokens/s per device) / peak FLOP/s per device
    HFU = the same with the FLOPs recomputed by activation checkpointing added

Model FLOPs per token come from the model's config (`ultrascale.estimate.flops_per_token`,
6N + 12 L h s). Tokens: ranks that differ only in tp or pp see the same batch, and cp ranks
see chunks of one batch, so a step processes the tokens of the dp ranks' batches however large
tp, pp and cp are (Lightning's ThroughputMonitor multiplies by the world size instead), padding not counted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ultrascale.callbacks._common import parallel_dims_of
from ultrascale.estimate import ModelFlops, model_flops, recompute_flops_per_token
from ultrascale.hardware import find_peak_tflops
from ultrascale.parallel.device import collective_device, cuda_matmul_in_tf32
from ultrascale.parallel.loss import batch_token_counts

__all__ = ["MFUMonitor", "ModelFlops", "measure_matmul_tflops", "model_flops"]

PeakDtype = Literal["bf16", "fp16", "fp8", "tf32", "fp32"]


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, size: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` TFLOP/s of a `size`^3 matmul (2 size^3 FLOPs): the CPU peak that MFU is relative to."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up (allocations, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


class MFUMonitor(Callback):
    """Logs tokens/s (per device and global), TFLOP/s per device, MFU, HFU, step and data-loading time.

    Metrics (logger and progress bar): `throughput/tokens_per_sec`, `throughput/tokens_per_sec_per_device`,
    `throughput/target_tokens_per_sec`, `throughput/padding_fraction`, `throughput/tokens_seen`,
    `throughput/tflops_per_device`, `throughput/mfu`, `throughput/hfu`, `time/step`, `time/data`. Rates are averaged
    over the last `window_size` batches. Tokens are those that are not padding (`parallel.loss.batch_token_counts`,
    summed over the data-parallel ranks, whose batches may differ in length); target tokens those with a loss; MFU
    counts tokens, its attention at each document's own length; HFU every position computed (padding included) at
    the batch's length, and the recomputation.

    Example::

        trainer = L.Trainer(strategy="ultrascale_tp", callbacks=[MFUMonitor()])
    """

    def __init__(
        self,
        window_size: int = 10,
        flops_per_token: Optional[float] = None,
        peak_tflops: Optional[float] = None,
        peak_dtype: Optional[PeakDtype] = None,
        input_key: str = "input_ids",
        prog_bar: bool = True,
        mfu: Optional[bool] = True,
    ) -> None:
        """
        Args:
            window_size: measured intervals over which tokens/s, TFLOP/s and MFU are averaged (batches; on CUDA,
                the intervals between logged optimizer steps); >= 1.
            flops_per_token: training FLOPs per token, for models that are neither the built-in Llama nor a
                Hugging Face model (whose configs give it); None derives it from the model's config.
            peak_tflops: peak TFLOP/s of one device, overriding the table (GPU) or the measured matmul (CPU).
            peak_dtype: which column of the peak table MFU is relative to (`bf16`, `fp16`, `fp8`, `tf32`, `fp32`).
                None: from the trainer precision (bf16 / fp16; tf32 for 32-bit on CUDA), also under
                Float8Training, where `fp8` gives MFU against the fp8 peak instead.
            input_key: key of the token ids `(B, T)` in a dict batch (a tensor batch is used as is).
            prog_bar: also show tokens/s and MFU in the progress bar.
            mfu: True: TFLOP/s, MFU and HFU too (an error for a model whose FLOPs per token are unknown);
                None: those where the FLOPs are known, tokens/s alone (said once) where not, as the `ultrascale`
                CLI adds it to every run; False: tokens/s and times only (no peak is measured).
        """
        super().__init__()
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"MFUMonitor: `window_size={window_size!r}` must be an integer >= 1")
        if flops_per_token is not None and flops_per_token <= 0:
            raise ValueError(f"MFUMonitor: `flops_per_token={flops_per_token!r}` must be positive (or None)")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"MFUMonitor: `peak_tflops={peak_tflops!r}` must be positive (or None)")
        valid = ("bf16", "fp16", "fp8", "tf32", "fp32")
        if peak_dtype is not None and peak_dtype not in valid:
            raise ValueError(f"MFUMonitor: unknown `peak_dtype={peak_dtype!r}`; valid: {', '.join(valid)}")
        self.window_size = window_size
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.peak_dtype = peak_dtype
        self.input_key = input_key
        self.prog_bar = prog_bar
        self.mfu = mfu
        self._mfu_active = mfu is not False
        self.peak: Optional[float] = None
        """Peak TFLOP/s per device that MFU is relative to (resolved at fit start)."""
        self.peak_source = ""
        """Where `peak` came from, e.g. 'table: H100 SXM bf16 dense' or 'measured fp32 matmul'."""
        self.tokens_seen = 0
        self.impossible_mfu_steps = 0
        """Steps whose MFU came out above 1 (not logged: a wrong peak or FLOP count, warned once)."""
        self._model: Optional[ModelFlops] = None
        self._ac: Any = None
        self._window: deque[tuple[int, float, float]] = deque(maxlen=window_size)
        self._batch_start = self._prev_end = self._interval_start = 0.0
        self._data_time = 0.0
        self._interval = _Interval()
        self._last_global_step = 0

    # ------------------------------------------------------------------ resolution
    def _resolve_dtype(self, trainer: "pl.Trainer", device: torch.device) -> str:
        if self.peak_dtype is not None:
            return self.peak_dtype
        precision = str(trainer.precision)
        if "bf16" in precision:
            return "bf16"
        if precision.startswith("16"):
            return "fp16"
        if device.type == "cuda" and cuda_matmul_in_tf32():
            return "tf32"
        return "fp32"

    def _resolve_peak(self, trainer: "pl.Trainer") -> None:
        device = trainer.strategy.root_device
        dtype = self._resolve_dtype(trainer, device)
        if self.peak_tflops is not None:
            self.peak, self.peak_source = self.peak_tflops, f"`peak_tflops={self.peak_tflops}` ({dtype})"
        elif device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            found = find_peak_tflops(name, dtype)
            if found is None and self.mfu is None:  # the CLI's default monitor: tokens/s still mean something
                rank_zero_info(f"MFUMonitor: no {dtype} peak for device {name!r} in ultrascale.hardware.GPU_TABLE; "
                               "logging tokens/s only (set `peak_tflops=` for MFU)")
                self._mfu_active = False
                return
            if found is None:
                raise ValueError(
                    f"MFUMonitor: no {dtype} peak for device {name!r} in ultrascale.hardware.PEAK_TFLOPS "
                    f"(devices: {', '.join(sorted(_table_keys()))}); set `peak_tflops=` to its dense {dtype} TFLOP/s"
                )
            self.peak, self.peak_source = found[1], f"table: {found[0]} {dtype} dense"
        elif device.type == "cpu":
            torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
            if dtype == "fp8":
                raise ValueError("MFUMonitor: `peak_dtype='fp8'` has no measured CPU peak; set `peak_tflops=`")
            self.peak = measure_matmul_tflops(torch_dtype, device)
            self.peak_source = f"measured {dtype} 1024^3 matmul on this process ({torch.get_num_threads()} threads)"
            if torch_dtype != torch.float32:
                # A CPU without 16-bit matmul instructions emulates them, far below what the same
                # core does in fp32 (measured: 0.001 TFLOP/s in bf16, which gave MFU 3.3); the fp32
                # matmul is then the honest ceiling of what the run can reach.
                fp32 = measure_matmul_tflops(torch.float32, device)
                if fp32 > self.peak:
                    rank_zero_warn(
                        f"MFUMonitor: this CPU's {dtype} matmul ({self.peak:.3g} TFLOP/s) is slower than its fp32 one "
                        f"({fp32:.3g} TFLOP/s), so it has no fast {dtype} path; MFU is relative to the fp32 peak"
                    )
                    self.peak = fp32
                    self.peak_source = (f"measured fp32 1024^3 matmul on this process ({torch.get_num_threads()} threads; "
                                        f"its {dtype} matmul was slower)")
        else:
            raise ValueError(f"MFUMonitor: no peak FLOP/s for device type {device.type!r}; set `peak_tflops=`")
        from ultrascale.callbacks.float8 import Float8Training

        if any(isinstance(cb, Float8Training) for cb in trainer.callbacks):
            rank_zero_info(
                f"MFUMonitor: Float8Training is on; MFU is relative to the {dtype} peak "
                f"({self.peak:.4g} TFLOP/s per device){'' if dtype == 'fp8' else '; set peak_dtype=fp8 for the fp8 peak'}"
            )

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from ultrascale.callbacks.activation_checkpointing import ActivationCheckpointing

        if not self._mfu_active:
            return
        if self.flops_per_token is None:
            self._model = model_flops(pl_module)
            if self._model is None and self.mfu is None:
                rank_zero_info(f"MFUMonitor: FLOPs per token of {type(pl_module).__name__} are unknown; logging tokens/s "
                               "only (set `flops_per_token=` for MFU)")
                self._mfu_active = False
                return
            if self._model is None:
                raise ValueError(
                    f"MFUMonitor: cannot derive FLOPs per token for {type(pl_module).__name__} (neither the built-in "
                    "Llama nor a Hugging Face model with a config); set `flops_per_token=` (6 N + 12 L h s)"
                )
            self._model = _whole_pipeline(self._model, trainer)
        self._ac = next((cb for cb in trainer.callbacks if isinstance(cb, ActivationCheckpointing)), None)
        self._resolve_peak(trainer)
        if self._mfu_active:
            rank_zero_info(f"MFUMonitor: peak {self.peak:.4g} TFLOP/s per device ({self.peak_source})")

    # ------------------------------------------------------------------ per step
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._prev_end = self._interval_start = time.perf_counter()
        self._interval = _Interval()
        self._last_global_step = trainer.global_step

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()
        self._data_time = self._batch_start - self._prev_end  # fetching the batch + Lightning between steps

    def _measures_now(self, trainer: "pl.Trainer") -> bool:
        """Whether this batch ends a measured interval. CUDA kernels are asynchronous, so a time is only
        what the GPU did after a `synchronize`, which stalls the host and leaves the GPU idle while the
        next kernels are launched: on CUDA the monitor synchronises at the end of the optimizer steps
        Lightning writes to its loggers (every `log_every_n_steps`, or when it stops early) and at the run's last
        (`max_steps`: Lightning does not log it, and a run shorter than `log_every_n_steps`, such as each of
        `ultrascale tune`'s, would otherwise report nothing), and each interval's time covers all its batches.
        Elsewhere every batch is measured."""
        stepped = trainer.global_step != self._last_global_step
        self._last_global_step = trainer.global_step
        if trainer.strategy.root_device.type != "cuda":
            return True
        # Lightning's own test (its logger connector's `should_update_logs`), from public Trainer fields: at this
        # hook, global_step already counts the step just taken.
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        return stepped and (trainer.global_step % max(1, trainer.log_every_n_steps) == 0 or trainer.should_stop or last)

    def _tokens(self, batch: Any) -> torch.Tensor:
        ids = batch.get(self.input_key) if isinstance(batch, dict) else batch
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            raise ValueError(
                f"MFUMonitor: expected the token ids (B, T) under `input_key={self.input_key!r}` of a dict batch, "
                f"or a (B, T) tensor batch; got {type(ids).__name__}"
            )
        return ids

    def _batch_counts(self, trainer: "pl.Trainer", batch: Any) -> torch.Tensor:
        """``[positions, content, targets]`` of this rank's batch (`parallel.loss.batch_token_counts`): counted by an
        ultrascale strategy before context parallel cut it, else here."""
        if self.input_key == "input_ids":
            counts = getattr(trainer.strategy, "batch_counts", None)
            counts = counts if counts is not None else batch_token_counts(batch)
            if counts is not None:
                return counts.detach().to("cpu" if counts.device.type == "cpu" else counts.device)
        ids = self._tokens(batch)
        every = float(ids.shape[0] * ids.shape[1])
        return torch.tensor([every, every, every, every * ids.shape[1]], dtype=torch.float64)

    def _over_data_ranks(self, trainer: "pl.Trainer", counts: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks that hold different batches (dp; each cut its batches to their own lengths); tp,
        pp and cp ranks repeat or split their dp rank's batch and are not counted again."""
        import torch.distributed as dist

        strategy = trainer.strategy
        dims = parallel_dims_of(strategy)
        if dims is not None:
            group = strategy.parallel_mesh["dp"].get_group() if dims.dp > 1 else None
        else:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() and trainer.world_size > 1 else None
        if group is None:
            return counts
        counts = counts.to(collective_device(group))
        dist.all_reduce(counts, group=group)
        return counts

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        counts = self._batch_counts(trainer, batch)
        dims = parallel_dims_of(trainer.strategy)
        cp = dims.cp if dims is not None else 1
        seq_len = self._tokens(batch).shape[1] * cp  # the length computed (a cp rank holds 1/cp of it)
        self._interval.add(counts, self._data_time)
        measured = self._measures_now(trainer)
        if measured and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # time what the GPU did, not what was queued
        self._prev_end = time.perf_counter()
        if not measured:
            return
        interval, self._interval = self._interval, _Interval()
        iteration = self._prev_end - self._interval_start
        self._interval_start = self._prev_end
        positions, content, targets, attended = (float(v) for v in self._over_data_ranks(trainer, interval.counts))
        self.tokens_seen += int(content)
        # One batch: from its start to its end. Several (CUDA, between logged steps): their mean, less fetching.
        step = self._prev_end - self._batch_start if interval.batches == 1 else (iteration - interval.data) / interval.batches
        self._window.append((positions, content, targets, attended, iteration, seq_len))
        seconds = sum(w[4] for w in self._window)
        all_positions, tokens, learned, spans = (sum(w[i] for w in self._window) for i in range(4))
        # MFU's attention term at each document's own length (packed documents attend within themselves): the
        # token-weighted mean span, sum(len^2) / sum(len); HFU's at the length computed.
        attention_len = spans / tokens if tokens else seq_len
        tokens_per_sec = tokens / seconds
        per_device = tokens_per_sec / trainer.world_size
        metrics = {
            "throughput/tokens_per_sec": tokens_per_sec,
            "throughput/tokens_per_sec_per_device": per_device,
            "throughput/target_tokens_per_sec": learned / seconds,
            "throughput/padding_fraction": 1.0 - tokens / all_positions if all_positions else 0.0,
            "throughput/tokens_seen": float(self.tokens_seen),
            "time/step": step,
            "time/data": interval.data / interval.batches,
        }
        if self._mfu_active:
            given = self.flops_per_token
            model_fpt = given if given is not None else self._model.per_token(attention_len)
            tflops = model_fpt * per_device / 1e12
            metrics["throughput/tflops_per_device"] = tflops
            metrics["throughput/mfu"] = tflops / self.peak
            extra = self.recompute_flops_per_token(seq_len)
            if extra is not None:  # HFU: every position computed, padding included, and the recomputation
                computed_fpt = given if given is not None else self._model.per_token(seq_len)
                positions_per_device = all_positions / seconds / trainer.world_size
                metrics["throughput/hfu"] = (computed_fpt + extra) * positions_per_device / 1e12 / self.peak
        if self._mfu_active and metrics["throughput/mfu"] > 1.0:
            # More FLOP/s than the peak is impossible: the peak or the FLOP count is wrong. Report it
            # (once) instead of logging a figure nobody should read.
            if self.impossible_mfu_steps == 0:
                rank_zero_warn(
                    f"MFUMonitor: step {trainer.global_step} computes MFU {metrics['throughput/mfu']:.3g} > 1 "
                    f"({tflops:.4g} TFLOP/s per device against a peak of {self.peak:.4g}, {self.peak_source}); the peak "
                    "or the FLOP count is wrong, so MFU and HFU are not logged. Set `peak_tflops=` (and "
                    "`flops_per_token=` for a model of your own). Please report this if the peak is right."
                )
            self.impossible_mfu_steps += 1
            metrics.pop("throughput/mfu")
            metrics.pop("throughput/hfu", None)
        for name, value in metrics.items():
            shown = self.prog_bar and name in ("throughput/tokens_per_sec", "throughput/mfu")
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=shown, batch_size=1)

    def recompute_flops_per_token(self, seq_len: int) -> Optional[float]:
        """FLOPs per token re-run by activation checkpointing (0 without it); None if they cannot be derived."""
        summary = getattr(self._ac, "summary", None) if self._ac is not None else None
        if summary is None:
            return 0.0
        if self._model is None and summary.attention_layers:
            return None  # no hidden size for the attention term of a model given only by `flops_per_token`
        hidden = self._model.hidden if self._model is not None else 0
        return recompute_flops_per_token(summary.matmul_params, summary.attention_layers, hidden, seq_len)


@dataclass
class _Interval:
    """The batches since the monitor last measured: their [positions, content, targets] and the seconds spent
    fetching them."""

    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(4, dtype=torch.float64))
    batches: int = 0
    data: float = 0.0

    def add(self, counts: torch.Tensor, data: float) -> None:
        self.counts = self.counts.to(counts.device) + counts
        self.batches, self.data = self.batches + 1, self.data + data


def _table_keys() -> list[str]:
    from ultrascale.hardware import PEAK_TFLOPS

    return list(PEAK_TFLOPS)


def _whole_pipeline(flops: ModelFlops, trainer: "pl.Trainer") -> ModelFlops:
    """Under pipeline parallel a rank holds its stages' parameters only: the model's N is their sum
    over the pipeline ranks (the stages' parameters are disjoint)."""
    strategy = trainer.strategy
    layout = getattr(strategy, "pipeline_layout", None)
    if layout is None:
        return flops
    import torch.distributed as dist

    n = torch.tensor(float(flops.n_matmul_params), dtype=torch.float64, device=strategy.root_device)
    dist.all_reduce(n, group=strategy.parallel_mesh["pp"].get_group())
    return ModelFlops(n.item(), flops.n_layers, flops.hidden, f"{flops.source}, summed over {layout.pp} pipeline ranks")
