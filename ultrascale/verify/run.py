"""One run of `ultrascale verify`: the recipe, as `ultrascale fit` parses it, trained for a few steps in fp32,
each optimizer step's exact loss and gradient norm and each rank's throughput and memory written as JSON.

The parent (`ultrascale.verify.app`) starts two of these, the layout and the reference, and compares them. A
run is described by a `RunSpec` written to a file: the subprocess launcher re-runs the command of the process
that calls `fit` once per rank (`python -m ultrascale.verify.run SPEC`), and every rank reads the same spec.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ultrascale.recipe_cli import UltraScaleCLI, known_noise_quieted


@dataclass(frozen=True)
class RunSpec:
    """What one run trains and where its results go."""

    cli_args: list[str]
    """`--config RECIPE` and LightningCLI overrides: what `ultrascale fit` would be given."""
    steps: int
    """Optimizer steps."""
    out: str
    """The JSON file rank 0 writes (`StepRecorder`)."""
    reference: Optional[dict[str, Any]] = None
    """None: the recipe's own strategy and devices (the layout run). Else the reference's `UltraScaleStrategy`
    knobs; with `one_device` also one process on one device."""
    one_device: bool = False
    fork: bool = False
    """Start the ranks with the fork launcher (CPU: the run is a forked process, not a command to re-run)."""
    depth: Optional[int] = None
    """Keep only the model's first `depth` blocks (`ultrascale.verify.depth.reduce_depth`); None: all of them."""
    precision: Optional[str] = "32-true"
    """The precision both runs train in (verify: fp32, so a layout must match to summation order); None: the
    recipe's (`ultrascale tune`)."""
    trace: Optional[str] = None
    """A folder: record the first step module by module there (`ultrascale.verify.trace.ModuleTrace`, for
    `--explain`); None: no trace."""

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self)))
        return path

    @classmethod
    def load(cls, path: str) -> "RunSpec":
        return cls(**json.loads(Path(path).read_text()))


def _number(value: Any) -> Optional[float]:
    return float(value) if value is not None else None


class StepRecorder(Callback):
    """The strategy's exact `train_loss` and global `grad_norm` of every optimizer step (with the time it ended, on
    rank 0's clock), and at the end each
    rank's `throughput/*` and `memory/*` figures (MFUMonitor, MemoryMonitor), gathered and written as JSON by
    global rank 0. Every value is global already (the strategy logs it from one all-reduce), so rank 0's are
    the run's."""

    def __init__(self, path: str, dropped: Optional[list[str]] = None) -> None:
        self.path = path
        self.dropped = dropped or []
        self.steps: list[dict[str, Any]] = []
        self._last_step = 0
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # a micro-batch of accumulation: no optimizer step yet
            return
        self._last_step = trainer.global_step
        metrics = trainer.callback_metrics
        self.steps.append({"step": trainer.global_step, "loss": _number(metrics.get("train_loss")),
                           "grad_norm": _number(metrics.get("grad_norm")), "time": time.perf_counter()})

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        figures = {name: float(value) for name, value in trainer.callback_metrics.items()
                   if name.startswith(("throughput/", "memory/"))}
        figures["device"] = str(trainer.strategy.root_device)
        ranks = [figures]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            ranks = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, figures)
        if trainer.global_rank != 0:
            return
        dims = getattr(trainer.strategy, "parallel_dims", None)
        result = {"steps": self.steps, "start_time": self._start, "ranks": ranks, "world": trainer.world_size,
                  "mesh": dims.describe() if dims is not None else type(trainer.strategy).__name__,
                  "accelerator": trainer.strategy.root_device.type, "dropped_callbacks": self.dropped}
        Path(self.path).write_text(json.dumps(result, indent=1))


def _dropped(callback: Any) -> bool:
    """Callbacks a verify run leaves out: they write checkpoints, need a logger or validation, or draw a bar."""
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, ProgressBar

    from ultrascale.callbacks import ProfilerCapture

    return isinstance(callback, (ModelCheckpoint, EarlyStopping, LearningRateMonitor, ProgressBar, ProfilerCapture))


class _RunCLI(UltraScaleCLI):
    """The recipe parsed and instantiated as `ultrascale fit --config` does; the Trainer built for a verify run."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        super().__init__(args=spec.cli_args, run=False, save_config_callback=None)  # writes nothing into the cwd

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        from lightning.pytorch.strategies import StrategyRegistry

        from ultrascale.callbacks import MemoryMonitor
        from ultrascale.strategies import UltraScaleStrategy

        spec, config = self.spec, self.config_init["trainer"]
        if spec.depth is not None:  # the model is instantiated, its network not built yet
            from ultrascale.verify.depth import reduce_depth

            reduce_depth(self.model, spec.depth)
        strategy = config.get("strategy")
        if isinstance(strategy, str) and strategy in StrategyRegistry:
            strategy = StrategyRegistry.get(strategy)
        if not isinstance(strategy, UltraScaleStrategy):
            raise ValueError(f"`trainer.strategy={config.get('strategy')!r}`: `ultrascale verify` runs ultrascale strategies "
                             "(a name such as `ultrascale_zero3`, or `class_path: ultrascale.UltraScaleStrategy` with its degrees)")
        if spec.reference is not None:
            # The reference keeps what decides the initial weights (`meta_init`: from `init_weights()` after sharding).
            strategy = UltraScaleStrategy(**{"meta_init": strategy.meta_init, **spec.reference})
        if spec.fork and strategy.process_config.launcher == "auto":
            strategy.process_config = dataclasses.replace(strategy.process_config, launcher="fork")
        callbacks = [cb for cb in config.get("callbacks") or [] if not _dropped(cb)]
        if not any(isinstance(cb, MemoryMonitor) for cb in callbacks):
            callbacks.append(MemoryMonitor())
        dropped = [type(cb).__name__ for cb in config.get("callbacks") or [] if _dropped(cb)]
        callbacks.append(StepRecorder(spec.out, dropped))
        if spec.trace is not None:  # after the recipe's callbacks: it sees the gradients they leave
            from ultrascale.verify.trace import ModuleTrace

            callbacks.append(ModuleTrace(spec.trace))
        forced: dict[str, Any] = dict(
            strategy=strategy, max_steps=spec.steps, max_epochs=-1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            num_sanity_val_steps=0, val_check_interval=None, check_val_every_n_epoch=1, callbacks=callbacks,
        )
        if spec.precision is not None:
            forced["precision"] = spec.precision
        if spec.one_device:
            forced.update(devices=1, num_nodes=1)
        return super().instantiate_trainer(**{**kwargs, **forced})


def run(spec: RunSpec) -> None:
    """Train `spec`'s run in this process (its launcher starts the other ranks, or torchrun did). A mistake of the
    user's (a bad record) is also written beside `spec.out` (`user_error_path`), where the launching command reads it
    to say it in one line."""
    from ultrascale import user_errors

    try:
        with known_noise_quieted():
            cli = _RunCLI(spec)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    except user_errors.user_error_types() as error:
        user_errors.save_error(error, user_error_path(spec))
        raise


def user_error_path(spec: RunSpec) -> Path:
    return Path(f"{spec.out}.user-error")


if __name__ == "__main__":  # the subprocess path: `python -m ultrascale.verify.run SPEC.json`, once per rank
    run(RunSpec.load(sys.argv[1]))
