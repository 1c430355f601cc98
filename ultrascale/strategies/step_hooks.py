"""The strategy's step on one screen (`StepHooks`, the Lightning hooks in the order they run) and the Lightning side
of them: calling a step method inside FSDP's root unit, the guarded optimizer step, logging a finished `StepResult`
(`ultrascale.strategies.step` itself stays Lightning-free)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from ultrascale.contract import user_class_name
from ultrascale.parallel.compile import BlockCompiler, CompileStats
from ultrascale.parallel.context import ContextParallel
from ultrascale.parallel.loss import NUM_TOKENS_KEY, batch_token_counts
from ultrascale.parallel.pipeline import PipelineLayout, PipelineRunner, TiedStageWeights
from ultrascale.parallel.rules import batch_problems, raise_first
from ultrascale.parallel.tensor import maybe_loss_parallel, synchronize_dropout_rng
from ultrascale.parallel.zero import ZeroEngine, engine_for
from ultrascale.strategies import model_setup
from ultrascale.strategies._lightning_compat import logging_as_hook, step_logged
from ultrascale.strategies.autoresume import roll_back
from ultrascale.strategies.pipeline_step import PipelineGradientStash, pipeline_loss
from ultrascale.strategies.step import StepGroups, StepGuard, StepResult, StepRunner


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
                           lightning_step: Callable[[Callable[[], Any]], Any], discard: Callable[[], None],
                           roll_back: Callable[[], None]) -> Any:
    """One optimizer step under the non-finite `policy`, in this order: the last micro-batch's forward and
    backward (Lightning's `closure`), `finish` (the step's gradients finished and its numbers logged), then
    `lightning_step(closure)` (Lightning's hooks, clipping by the norm `finish` computed, the optimizer). Under
    "skip" / "rollback" a non-finite step is `discard`ed instead (and rolled back)."""
    finished: list[StepResult] = []

    def closure_then_finish() -> Any:
        loss = closure()
        finished.append(finish())
        return loss

    if policy not in ("skip", "rollback"):
        return lightning_step(closure_then_finish)
    # "skip" and "rollback" decide before the optimizer runs: the closure runs first, then the step (or none).
    loss = closure_then_finish()
    if not finished[-1].skipped:
        return lightning_step(lambda: loss)
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


class StepHooks:
    """The strategy's step, in the order Lightning calls it for one optimizer step of one rank:

    `batch_to_device` (the layout's sequence check, this rank's context-parallel slice), then per micro-batch
    `training_step` (the module's step inside FSDP's root unit; under pipeline parallel it calls `pipeline_loss`,
    which runs the whole schedule) and `backward` (the token-sum loss; non-final micro-batches inside
    `block_backward_sync`), then `optimizer_step`: the last micro-batch's closure, `_finish_step` (gradients
    reduced and normalised once, the global norm, the non-finite guard, MoE loads, logged), clipping by that norm,
    the optimizer. A mixin of `UltraScaleStrategy`, whose `__init__` and `setup` create what it reads below."""

    _pipeline: Optional[PipelineRunner]
    _pipeline_layout: Optional[PipelineLayout]
    _pipeline_grads: PipelineGradientStash
    _zero_engines: list[ZeroEngine]
    _tensor_parallel_checked: set[int]  # the optimizers whose first step of this fit had `check_tensor_parallel_copies`
    _tied_weights: Optional[TiedStageWeights]
    _step: StepRunner
    _step_groups: Optional[StepGroups]
    _step_caller: StepCaller
    _compiler: Optional[BlockCompiler]
    _context_parallel: Optional[ContextParallel]
    _sequence_parallel_active: Optional[bool]
    _loss_parallel_active: bool
    _tensor_parallel_dropout: bool
    _rollbacks: int
    accumulate_unsharded_grads: bool
    context_parallel_load_balance: bool

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, check its sequence length against the layout and, under context parallel,
        cut it to this rank's tokens: every step and callback (MFU, ...) then sees the local batch."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        tokens = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            raise_first(batch_problems(self.parallel_dims, seq_len=tokens.shape[1],
                                       sequence_parallel=bool(self._sequence_parallel_active),
                                       load_balance=self.context_parallel_load_balance))
        # Counted whole, before context parallel cuts it: what MFUMonitor reports as this rank's tokens.
        self.batch_counts = batch_token_counts(batch)
        if self._context_parallel is not None:
            batch = self._context_parallel.shard_batch(batch)
        return batch

    # Loss parallel must be active around the loss (inside the step) and around backward.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        self._pipeline_grads.start_step()
        self._step.start_micro_batch(module.trainer.accumulate_grad_batches)
        if self._tensor_parallel_dropout:
            synchronize_dropout_rng(self.model, self.root_device)
        with maybe_loss_parallel(self._loss_parallel_active):
            output = self._call_step("training_step", *args, **kwargs)
        check_step_output(module, output, pipeline_active=self._pipeline is not None, pipeline_ran=self._pipeline_grads.ran,
                          owner=type(self).__name__)
        self._step.observe(output)
        return output

    @property
    def pipeline_active(self) -> bool:
        """Whether the model runs as a pipeline: steps then get their loss from `pipeline_loss`."""
        return self._pipeline is not None

    @property
    def pipeline_layout(self) -> Optional[PipelineLayout]:
        """Under pipeline parallel, the stages' layers, the schedule and its micro-batches; None otherwise."""
        return self._pipeline_layout if self._pipeline is not None else None

    def pipeline_loss(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the batch ``{"input_ids", "labels"[, "position_ids"]}`` through the pipeline and return
        ``{"loss": mean over its valid tokens, "num_tokens": n}``, the same on every pipeline rank.

        In training (module in train mode, gradients enabled) this is the whole forward and backward
        of the batch: torch's schedule runs every micro-batch, the backward of each on its token-loss
        sum / accumulate_grad_batches; the returned loss carries no graph, and the gradients wait
        for Lightning's backward call (which then runs no autograd). Elsewhere it is forward only.
        """
        if self._pipeline is None:
            raise RuntimeError(f"{type(self).__name__}.pipeline_loss: pipeline parallel is not active (pipeline_parallel=1)")
        module = self.lightning_module
        assert module is not None and self.model is not None
        train = module.training and torch.is_grad_enabled()
        divisor = module.trainer.accumulate_grad_batches if train else 1
        return pipeline_loss(self._pipeline, self._pipeline_grads, self.model, self._zero_engines, batch, train=train, divisor=divisor)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline is not None:
            # The schedule ran forward and backward inside `pipeline_loss`; the module's backward hooks still run.
            module = self.lightning_module
            assert module is not None
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._pipeline_grads.restore()
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss
        closure_loss = self._step.backward_loss(closure_loss, self.lightning_module.trainer.accumulate_grad_batches)
        with maybe_loss_parallel(self._loss_parallel_active):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation (`deferred_gradient_sync`; Lightning's own
        implementation only knows DDP's `no_sync`)."""
        with model_setup.deferred_gradient_sync(self.model, self._zero_engines, accumulate_unsharded_grads=self.accumulate_unsharded_grads):
            yield

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any,
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        """One step, in this order: the last micro-batch's forward and backward (Lightning's closure),
        the step's gradient reduction finished (ZeRO-1/2) and normalised once (`StepRunner.finish`),
        then Lightning's `on_before_optimizer_step` hooks and clipping (by the norm the step computed),
        then the optimizer (`guarded_optimizer_step`)."""
        lightning_step = super().optimizer_step
        result = guarded_optimizer_step(
            self._step.guard.policy, closure, lambda: self._finish_step(optimizer),
            lambda closure: lightning_step(optimizer, closure, model, **kwargs),
            lambda: self._step.discard(optimizer, engine_for(optimizer, self._zero_engines)), self._roll_back,
        )
        if self._tied_weights is not None:
            self._tied_weights.copy_to_mirrors()
        return result

    # The head's copy of a tied weight (ZeRO-3 under a V schedule: `TiedStageWeights.mirrors`) takes the weight's
    # values once all that writes weights has run: a Hugging Face model's load after sharding (its `on_fit_start`), a
    # restored checkpoint. Validation before training (the sanity check) runs before `on_train_start`.
    @override
    def on_train_start(self) -> None:
        if self._tied_weights is not None:
            self._tied_weights.copy_to_mirrors()

    on_validation_start = on_test_start = on_predict_start = on_train_start

    def _finish_step(self, optimizer: torch.optim.Optimizer) -> StepResult:
        """The step's gradients finished (`StepRunner.finish`) and its numbers logged (`log_step`)."""
        module = self.lightning_module
        assert module is not None and self._step_groups is not None
        trainer = module.trainer
        if self._step_groups.tensor is not None and id(optimizer) not in self._tensor_parallel_checked:
            check_tensor_parallel_copies(module, self._step_groups.tensor, engine_for(optimizer, self._zero_engines))
            self._tensor_parallel_checked.add(id(optimizer))
        result = self._step.finish(
            optimizer, engine_for(optimizer, self._zero_engines), self._step_groups, step=trainer.global_step,
            rank=self.global_rank,
            loss_divisor=trainer.accumulate_grad_batches if module.automatic_optimization else 1,
        )
        log_step(module, result, self._step.guard, type(self).__name__)
        if self._compiler is not None:
            log_compile(module, self._compiler.stats)
        return result

    def _roll_back(self) -> None:
        """`nonfinite="rollback"`: weights and optimizer state back to the newest complete checkpoint (`roll_back`)."""
        module = self.lightning_module
        assert module is not None
        roll_back(module, rollbacks=self._rollbacks + 1, guard=self._step.guard, rank=self.global_rank,
                  broadcast=self.broadcast, load=self.load_checkpoint)
        self._rollbacks += 1

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with maybe_loss_parallel(self._loss_parallel_active):
            return self._call_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with maybe_loss_parallel(self._loss_parallel_active):
            return self._call_step("test_step", *args, **kwargs)

    def pipeline_logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's output for ``{"input_ids"[, "position_ids"]}`` under pipeline parallel (forward only, every
        micro-batch), on every pipeline rank: what one device's forward returns (`CausalLMModule.predict_step`)."""
        if self._pipeline is None:
            raise RuntimeError(f"{type(self).__name__}.pipeline_logits: pipeline parallel is not active (pipeline_parallel=1)")
        return self._pipeline.logits(batch["input_ids"], batch.get("position_ids"))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        # Under pipeline parallel the module's step gets its output from `pipeline_logits` (CausalLMModule's does).
        return self._call_step("predict_step", *args, **kwargs)

    def _call_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """`LightningModule.<name>` inside FSDP's root unit (see `StepCaller`)."""
        module = self.lightning_module
        assert module is not None
        return self._step_caller(module, name, self.precision_plugin, self.call_inside_module, *args, **kwargs)


def check_tensor_parallel_copies(module: Any, group: Any, engine: Optional[ZeroEngine] = None) -> None:
    """The first step's gradients of what every tp rank holds whole agree between them, or a clear error before
    the optimizer steps on them (`tensor_parallel_copies_that_differ`). Under ZeRO-1/2 the engine's reduced slices
    hold them (the parameters' `.grad` is let go once a bucket is reduced)."""
    from ultrascale.parallel.grad import tensor_parallel_copies_that_differ

    if engine is not None:
        differ = tensor_parallel_copies_that_differ(engine.whole_over_tp_gradient_parts(), group,
                                                    parts_over=engine.dense.group)
    else:
        differ = tensor_parallel_copies_that_differ(
            [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None], group)
    if differ:
        raise ValueError(
            f"tensor parallel: the gradients of {differ[:5]}{' ...' if len(differ) > 5 else ''} differ between the tp "
            "ranks, which all hold these parameters whole: the plan leaves out a module that runs on split activations "
            "(between a column- and a row-parallel layer), so each rank got its part of the gradient. Give it a plan "
            "entry: 'replicated_with_grad_allreduce' where its parameters act on each feature or head alike"
        )
