"""The Lightning side of the strategy's step hooks: calling a step method inside FSDP's root unit, and
logging a finished `StepResult` (`ultrascale.strategies.step` itself stays Lightning-free)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.fsdp import FSDPModule

from ultrascale.contract import user_class_name
from ultrascale.parallel.compile import CompileStats
from ultrascale.parallel.loss import NUM_TOKENS_KEY
from ultrascale.strategies._lightning_compat import logging_as_hook, step_logged
from ultrascale.strategies.step import StepGuard, StepResult


class StepCaller:
    """Runs `LightningModule.<name>` inside the module's own `__call__` when it is FSDP's root unit,
    so the root's hooks (all-gather of embeddings/norm/head, the backward's final reduction)
    fire whether the step calls `self(...)` or `self.model(...)` (Lightning's forward redirection)."""

    def __init__(self) -> None:
        self.calls_module: dict[str, bool] = {}  # per step hook: does it call `self(...)` itself?

    def __call__(self, module: "pl.LightningModule", name: str, precision: Precision,
                 call_inside_module: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`module.<name>(*args, **kwargs)` in `precision`'s context for that step; `call_inside_module`
        is the strategy's forward redirection."""
        context = {
            "training_step": precision.train_step_context,
            "validation_step": precision.val_step_context,
            "test_step": precision.test_step_context,
            "predict_step": precision.predict_step_context,
        }[name]
        with context():
            if not isinstance(module, FSDPModule) or self.calls_module.get(name, False):
                return getattr(module, name)(*args, **kwargs)
            if name in self.calls_module:  # known: the step reaches the model another way
                return call_inside_module(module, name, *args, **kwargs)
            # First call: a step that calls `self(...)` enters the root itself. Entering it around the
            # step as well would make the outer exit reshard the root (one more all-gather per step),
            # so such steps are called directly from then on.
            entries: list[int] = []
            handle = module.register_forward_pre_hook(lambda *_: entries.append(1))
            try:
                output = call_inside_module(module, name, *args, **kwargs)
            finally:
                handle.remove()
            self.calls_module[name] = len(entries) > 1
            return output


def check_step_output(module: "pl.LightningModule", output: Any, *, pipeline_active: bool, pipeline_ran: bool,
                      owner: str) -> None:
    """A `training_step` output the strategy cannot honour is refused: a step under pipeline parallel that
    did not run the pipeline, and a token count under manual optimization."""
    if pipeline_active and output is not None and not pipeline_ran:
        raise RuntimeError(
            f"{user_class_name(module)}.training_step did not run the pipeline: under pipeline parallel the model is split "
            "over ranks, so the step must get its loss from `self.trainer.strategy.pipeline_loss(batch)` (ultrascale's "
            "CausalLMModule does) instead of calling the model"
        )
    if not module.automatic_optimization and isinstance(output, Mapping) and NUM_TOKENS_KEY in output:
        raise ValueError(
            f"{owner}: `{NUM_TOKENS_KEY}` in a training_step output is understood with automatic "
            "optimization only; under manual optimization normalise the loss yourself before `manual_backward`"
        )


def guarded_optimizer_step(policy: str, closure: Callable[[], Any], finish: Callable[[], StepResult],
                           lightning_step: Callable[..., Any], discard: Callable[[], None], roll_back: Callable[[], None]) -> Any:
    """One optimizer step under the non-finite `policy`, in this order: the last micro-batch's forward and
    backward (Lightning's `closure`), `finish` (the step's gradients finished and its numbers logged), then
    `lightning_step(closure, step_grad_norm=...)` (Lightning's hooks, clipping by the norm the step computed,
    the optimizer). Under "skip" / "rollback" a non-finite step is `discard`ed instead (and rolled back)."""
    finished: list[StepResult] = []

    def closure_then_finish() -> Any:
        loss = closure()
        finished.append(finish())
        return loss

    def step(closure: Any) -> Any:
        return lightning_step(closure, step_grad_norm=lambda: finished[-1].grad_norm if finished else None)

    if policy not in ("skip", "rollback"):
        return step(closure_then_finish)
    # "skip" and "rollback" decide before the optimizer runs: the closure runs first, then the step (or none).
    loss = closure_then_finish()
    if not finished[-1].skipped:
        return step(lambda: loss)
    discard()
    if policy == "rollback":
        roll_back()
    return loss


def log_step(module: "pl.LightningModule", result: StepResult, guard: StepGuard, owner: str) -> None:
    """Warn about and log a finished step: skipped steps, loss spikes, MoE statistics, the global gradient
    norm (`grad_norm`, before clipping) and the exact `train_loss`. ValueError if the module logs a `train_loss` of
    its own beside a token-normalised loss."""
    trainer = module.trainer
    # Lightning allows per-step logging from `on_before_optimizer_step`, which runs right after this;
    # every value is already global, so no sync.
    with logging_as_hook(module, "on_before_optimizer_step"):
        if result.skipped:
            rank_zero_warn(
                f"ultrascale: skipping step {result.step}: loss {result.loss_value}, global gradient norm "
                f"{result.grad_norm_value} ({result.skipped_steps} of at most {guard.max_skips} skipped; "
                f"nonfinite='{guard.policy}')"
            )
            module.log("skipped_steps", float(result.skipped_steps), sync_dist=False)
        if result.spike is not None:
            rank_zero_warn(f"ultrascale: loss spike at step {result.step}: loss {result.loss_value:.4g}, robust "
                           f"z-score {result.spike:.1f}")
            module.log("loss_spikes", float(result.loss_spikes), sync_dist=False)
        for name, value in result.moe.items():
            module.log(name, value.float(), sync_dist=False, prog_bar=name == "moe/balance")
        if result.grad_norm is not None:  # before clipping; what `ultrascale verify` compares between layouts
            module.log("grad_norm", result.grad_norm.float(), sync_dist=False)
        if result.loss is not None:
            if step_logged(trainer, "training_step.train_loss"):
                raise ValueError(
                    f"{user_class_name(module)}.training_step logs `train_loss` and returns `{NUM_TOKENS_KEY}`: "
                    f"{owner} logs the exact `train_loss` of every optimizer step (the global token "
                    "mean) itself; remove the `self.log('train_loss', ...)` or log your value under another name"
                )
            module.log("train_loss", result.loss, prog_bar=True, sync_dist=False)


def log_compile(module: "pl.LightningModule", stats: CompileStats) -> None:
    """`compile=True`: say what the first step compiled and how long it took; afterwards log every
    recompilation (`compile/recompiles`) and warn once the layout keeps recompiling."""
    graphs, seconds = stats.step()
    if stats.steps == 1 and graphs == 0:
        rank_zero_warn("ultrascale: compile=True, but the first step compiled no graph: the blocks ran eagerly (or reused "
                       "graphs an earlier fit in this process compiled). TORCH_LOGS=graph_breaks shows where dynamo gave up")
        return
    if stats.steps == 1:
        rank_zero_info(f"ultrascale: compile: the first step compiled {graphs} graph(s) in {seconds:.1f} s "
                       "(inductor's cache: TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>)")
        return
    if graphs:
        with logging_as_hook(module, "on_before_optimizer_step"):
            module.log("compile/recompiles", float(stats.later_graphs), sync_dist=False)
        if stats.keeps_recompiling and stats.later_graphs - graphs <= stats.warn_after:
            rank_zero_warn(
                f"ultrascale: compile: {stats.later_graphs} graphs compiled after the first step (step {stats.steps}): "
                "the blocks keep seeing new shapes or guards. Bucket sequence lengths (pad to a multiple), or "
                "set compile=False; torch stops with an error at torch._dynamo.config.recompile_limit")
