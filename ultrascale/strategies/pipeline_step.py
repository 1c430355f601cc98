"""Gradients a pipeline schedule computes inside `training_step`, carried over to `backward`.

torch's pipeline schedules run the forward and the backward of every micro-batch in one
`schedule.step` call, which the strategy makes from `training_step` (`pipeline_loss`): the batch's
gradients exist before `training_step` returns. Lightning's automatic optimisation then calls
`optimizer.zero_grad()` between `training_step` and `backward` (on the first micro-batch of an
accumulation window), which would erase them. So they wait aside, outside the parameters, and
are put back when Lightning calls `backward` (which then runs no autograd): the parameters end the
micro-batch as an autograd backward would leave them, this batch's gradients added to whatever
they held at `backward` time.

Lightning-free: the strategy calls `run` from `pipeline_loss` and `restore` from `backward`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import TypeVar

import torch

from ultrascale.parallel.loss import NUM_TOKENS_KEY
from ultrascale.parallel.pipeline import PipelineRunner
from ultrascale.parallel.zero import ZeroEngine

T = TypeVar("T")


class PipelineGradientStash:
    """The gradients of the last pipeline step, held outside the parameters until `restore`."""

    def __init__(self) -> None:
        self._stashed: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = False
        """Whether `run` ran a training step since `start_step`: a step that bypasses the pipeline is refused."""

    def start_step(self) -> None:
        """At the start of every `training_step`."""
        self.ran = False

    def run(self, model: torch.nn.Module, engines: Sequence[ZeroEngine], schedule_step: Callable[[], T], *, train: bool) -> T:
        """`schedule_step()`, and under `train` its gradients stashed: the parameters leave holding what
        they held before (gradients of earlier micro-batches, which Lightning may still zero)."""
        earlier = _take_gradients(model) if train else []
        # ZeRO-1/2 reduce once per step under PP: each micro-batch's backward is its own autograd call,
        # and the zero-bubble schedules assign weight gradients, which no hook sees, after it.
        with ExitStack() as deferred:
            for engine in engines:
                deferred.enter_context(engine.no_sync())
            out = schedule_step()
        if train:
            for engine in engines:
                engine.absorb_assigned_grads()
            self._stashed = _take_gradients(model)
            for p, grad in earlier:
                p.grad = grad
            self.ran = True
        return out

    def restore(self) -> None:
        """What autograd would do in Lightning's backward: the stashed gradients added to whatever the
        parameters hold now (nothing, if Lightning zeroed them between the step and backward)."""
        for p, grad in self._stashed:
            if p.grad is None:
                p.grad = grad
            elif p.grad is not grad:
                p.grad += grad
        self._stashed = []


def pipeline_loss(runner: PipelineRunner, stash: PipelineGradientStash, model: torch.nn.Module, engines: Sequence[ZeroEngine],
                  batch: Mapping[str, torch.Tensor], *, train: bool, divisor: int) -> dict[str, torch.Tensor]:
    """The batch through `runner`'s schedule (forward and, under `train`, backward of each micro-batch on
    its token-loss sum / `divisor`): ``{"loss": mean over its valid tokens, "num_tokens": n}``."""
    # The gradients wait in `stash` until Lightning's backward (see `PipelineGradientStash`).
    loss_sum, num_tokens = stash.run(model, engines, lambda: runner.step(
        batch["input_ids"], batch["labels"], batch.get("position_ids"), train=train, loss_scale=1.0 / divisor
    ), train=train)
    return {"loss": (loss_sum / num_tokens.clamp(min=1)).float(), NUM_TOKENS_KEY: num_tokens}


def _take_gradients(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every parameter's gradient, which the parameter then no longer holds."""
    taken = []
    for p in model.parameters():
        if p.grad is not None:
            taken.append((p, p.grad))
            p.grad = None
    return taken
