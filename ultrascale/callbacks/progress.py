"""A progress bar for step-based runs: optimizer steps of `max_steps`, not batches of an epoch.

Lightning's bar counts the batches of the current epoch. A language-model run is usually
bounded by `max_steps` and its data is a stream, so that bar says "Epoch 0/-2" (max_epochs is
-1 when max_steps bounds the run), resets its count every epoch, and after a resume shows the
global batch index against the remaining batches of the epoch ("330/29"). It also shows the
logger's version as a metric ("v_num: 0.000"). This bar counts optimizer steps from 0 to
`max_steps`, starts at the resumed step, and shows the logged metrics with short numbers.
"""

from __future__ import annotations

from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepProgressBar(TQDMProgressBar):
    """`TQDMProgressBar` whose training bar counts optimizer steps towards `max_steps`.

    Falls back to Lightning's epoch bar when the run has no `max_steps` (an epoch-bounded run).

    Example::

        trainer = L.Trainer(max_steps=1000, callbacks=[StepProgressBar()])
    """

    def _step_bounded(self, trainer: "pl.Trainer") -> bool:
        return trainer.max_steps is not None and trainer.max_steps > 0

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        if not self._step_bounded(trainer):
            super().on_train_epoch_start(trainer, *args)
            return
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # first epoch (later epochs keep counting on the same bar)
            bar.reset(total=trainer.max_steps)
            bar.initial = 0
            bar.n = trainer.global_step  # a resumed run starts where it stopped
            bar.refresh()
        bar.set_description("Training")

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._step_bounded(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        step = trainer.global_step
        if bar is not None and not bar.disable and (step != bar.n) and self._should_update(step, trainer.max_steps):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    @override
    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Union[int, str, float, dict[str, float]]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version is not a training metric
        # The bar's width is the terminal's: "throughput/tokens_per_sec" shows as "tok/s" so that no name is cut.
        return {_SHORT_NAMES.get(name, name.rsplit("/", 1)[-1]): _short(value) for name, value in metrics.items()}


_SHORT_NAMES = {"throughput/tokens_per_sec": "tok/s", "throughput/tokens_per_sec_per_device": "tok/s/dev"}


def _short(value: Any) -> Any:
    """4 significant digits (large counts such as tokens/s as integers): the bar stays one line wide."""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return value
