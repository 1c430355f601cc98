"""A fit run in the calling process leaves it as it found it: torch's compile settings, the modules' and the
optimizer's methods, gradient hooks, warning and logging filters, and glibc's allocator settings.

Each check runs in a fresh interpreter (the calling process of its fit), so that the one-rank process group and
the thread pools a one-device fit starts stay out of the pytest worker, whose later tests fork ranks."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ultrascale
from tests._parity import ParityData, Recorder, TokenDataset, parity_trainer
from ultrascale.models.lm import LlamaLM


def _process_state() -> dict:
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    return {
        "dynamo": torch._dynamo.config.get_config_copy(),
        "functorch": torch._functorch.config.get_config_copy(),
        "logging filters": {logger.name: list(logger.filters) for logger in loggers},
        "warning filters": list(warnings.filters),
    }


class _FailsAtStep(LlamaLM):
    def __init__(self, fail_at: int | None) -> None:
        super().__init__(preset="tiny", max_steps=100)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("a failure inside the fit")
        return super().training_step(batch, batch_idx)


def _in_a_fresh_process(check: str, *args: object) -> None:
    code = f"from tests.test_process_state import {check}; {check}(*{args!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("fail_at", [None, 2], ids=["fit", "failed-fit"])
def test_a_compiled_zero1_fit_leaves_the_process_as_it_found_it(fail_at):
    _in_a_fresh_process("check_compiled_zero1_fit", fail_at)


def test_a_second_fit_of_the_same_model_compiles_its_blocks_again():
    """The first fit's teardown gives the blocks their own forward back; a second Trainer on the already
    parallelised model compiles them again instead of running eager without a word."""
    _in_a_fresh_process("check_second_fit_compiles_again")


def check_compiled_zero1_fit(fail_at: int | None) -> None:
    import ultrascale.strategies.base as strategy_module

    tuned = []
    strategy_module.tune_cpu_allocator = lambda *a, **k: tuned.append(1)
    before = _process_state()
    model = _FailsAtStep(fail_at)
    strategy = ultrascale.UltraScaleStrategy(zero_stage=1, compile=True, compile_backend="aot_eager")
    trainer = parity_trainer(1, strategy, Recorder(), 4)
    data = ParityData(TokenDataset(64, 16, 512, seed=3, masked=True), 4)
    if fail_at is None:
        trainer.fit(model, data)
    else:
        with pytest.raises(RuntimeError, match="a failure inside the fit"):
            trainer.fit(model, data)
    after = _process_state()
    for key in before:
        if key == "logging filters":  # loggers the fit's imports created start without filters and keep none
            assert {name: after[key].get(name, []) for name in before[key]} == before[key]
            assert all(not filters for name, filters in after[key].items() if name not in before[key])
        else:
            assert after[key] == before[key], key
    assert tuned == []  # glibc's allocator untouched (`tune_cpu_allocator` is off by default)
    blocks = [m for m in model.modules() if getattr(m, "ultrascale_compiled", False)]
    assert blocks and all("forward" not in vars(block) for block in blocks)  # compiled during the fit, not after
    optimizer = trainer.optimizers[0]
    assert trainer.strategy.zero_engines[0].optimizer is optimizer  # kept for the optimizer's state (a save after fit)
    step = vars(optimizer).get("step")
    assert step is None or "ZeroEngine" not in getattr(step, "__qualname__", "")
    assert not optimizer._optimizer_step_post_hooks  # the engine's step hook goes at teardown
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()
               if getattr(p, "_post_accumulate_grad_hooks", None) is not None)


class _CompiledDuringFit(Recorder):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        blocks = [m for m in pl_module.modules() if getattr(m, "ultrascale_compiled", False)]
        self.compiled = bool(blocks) and all("forward" in vars(block) for block in blocks)


def check_second_fit_compiles_again() -> None:
    model = LlamaLM(preset="tiny", max_steps=100)
    data = ParityData(TokenDataset(64, 16, 512, seed=3, masked=True), 4)
    for _ in range(2):
        watch = _CompiledDuringFit()
        strategy = ultrascale.UltraScaleStrategy(compile=True, compile_backend="aot_eager")  # ZeRO-3: FSDP units stay
        parity_trainer(1, strategy, watch, 2).fit(model, data)
        assert watch.compiled
