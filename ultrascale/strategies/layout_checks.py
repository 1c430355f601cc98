"""The layout checks of `UltraScaleStrategy`: its knobs in the rulebook's terms (`ultrascale.parallel.rules`)
checked against the world size, the model its module declares or built, and the data module.

A mixin so that they stay methods of the strategy (`strategy.check_model(...)`, `strategy.resolve_dims(...)`,
`strategy.layout_knobs`: tests, the launchers and `ultrascale plan` call them) while `base.py` holds the hooks.
It reads the strategy's knobs (declared below) and nothing else.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ultrascale.contract import check_module, declares_pipeline_parts, own_pipeline_parts, supports_loss_parallel
from ultrascale.models.adapters import ModelPlan, declared_facts, plan_model
from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import (
    LayoutKnobs,
    batch_problems,
    knob_problems,
    model_problems,
    raise_first,
    resolve,
    resolved_stages,
    sequence_parallel_of,
)


def trainer_of(module: Any) -> Any:
    """The Trainer `module` is attached to; None without a module or a Trainer."""
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # not attached to a Trainer
        return None


class LayoutChecks:
    """`layout_knobs`, `resolve_dims`, `check_before_launch`, `check_model` and the checks they share."""

    # The strategy's knobs and state these checks read (`UltraScaleStrategy.__init__` sets them).
    _degrees: dict[str, int]
    zero_stage: int
    context_parallel_method: Any
    context_parallel_ulysses: Optional[int]
    context_parallel_load_balance: bool
    pipeline_schedule: str
    pipeline_virtual_stages: Optional[int]
    pipeline_microbatches: Optional[int]
    pipeline_layers: Optional[list[int]]
    sequence_parallel: Optional[bool]
    loss_parallel: Optional[bool]
    tp_plan: Optional[dict[str, Any]]
    accumulate_unsharded_grads: bool
    zero_bucket_mb: Optional[float]
    auto_layout: bool
    lightning_module: Any
    parallel_dims: ParallelDims

    @property
    def layout_knobs(self) -> LayoutKnobs:
        """This strategy's layout in the rulebook's terms (`ultrascale.parallel.rules`)."""
        return LayoutKnobs(
            **self._degrees, zero_stage=self.zero_stage, context_parallel_method=self.context_parallel_method,
            context_parallel_ulysses=self.context_parallel_ulysses,
            pipeline_schedule=self.pipeline_schedule, pipeline_virtual_stages=self.pipeline_virtual_stages,
            pipeline_microbatches=self.pipeline_microbatches,
            pipeline_layers=tuple(self.pipeline_layers) if self.pipeline_layers is not None else None,
            sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel,
            tp_plan_given=self.tp_plan is not None, accumulate_unsharded_grads=self.accumulate_unsharded_grads,
            zero_bucket_mb=self.zero_bucket_mb,
        )

    def resolve_dims(self, world_size: int) -> ParallelDims:
        """The degrees of this strategy resolved for `world_size` (ValueError if they do not fit)."""
        dims, problems = resolve(self.layout_knobs, world_size)
        # The knobs again: the auto layout may have changed the degrees since the constructor checked them.
        raise_first([*knob_problems(self.layout_knobs), *problems], type(self).__name__)
        assert dims is not None
        return dims

    def check_before_launch(self) -> None:
        """The model's config against the layout in the launching process, before any rank starts, so that
        a wrong layout gives one error naming the user's class rather than one per rank (the launchers call
        it; under torchrun / SLURM every rank runs it, before its process group). The data module is not
        attached yet: what depends on it is checked on each rank in `setup_environment`."""
        module = self.lightning_module
        if module is None or self.auto_layout:  # the auto layout is chosen (and checked) on each rank
            return
        self._check_declared_model(with_data=False)

    def _check_declared_model(self, *, with_data: bool) -> None:
        """The rulebook's model checks on the model the module's config declares (built on the meta device, see
        `declared_facts`), and with `with_data` its data module's sequence length and batch, before any process
        group. The built model is checked again in `setup` (`check_model`)."""
        module = self.lightning_module
        dims, knobs, owner = self.parallel_dims, self.layout_knobs, type(self).__name__
        uses_model = dims.tp_enabled or dims.cp_enabled or dims.pp_enabled or dims.ep_enabled
        facts = None
        if module is not None and uses_model:
            check_module(module, owner)
            facts = declared_facts(module, own_pipeline_parts=declares_pipeline_parts(module))
        if facts is not None:
            raise_first(model_problems(dims, knobs, facts), owner)
        if not with_data:
            return
        # Without facts under tp, sequence parallel is decided by the built model's plan: checked in `setup`.
        if not (dims.tp_enabled and facts is None and self.sequence_parallel is None):
            self._check_data(sequence_parallel=sequence_parallel_of(knobs, facts) if facts is not None
                             else bool(self.sequence_parallel) and dims.tp_enabled)
        check_against_model = getattr(getattr(trainer_of(module), "datamodule", None), "check_model", None)
        if callable(check_against_model) and module is not None:
            check_against_model(module)  # the data's vocabulary fits the model's

    def check_model(self, module: torch.nn.Module, dims: Optional[ParallelDims] = None) -> ModelPlan:
        """The rulebook's checks on the built model (real or meta) before any weight is communicated, for `dims`
        (default: this strategy's degrees), and what follows from them: the adapter, the pipeline's stages and
        schedule, the TP plan (and so sequence and loss parallel). `ultrascale plan --recipe` runs the same on a
        meta-built model. ValueError naming the knob and the model on the first problem."""
        dims = dims or self.parallel_dims
        check_module(module, type(self).__name__)
        return plan_model(
            module, dims, self.layout_knobs, tp_plan=self.tp_plan,
            pipeline_parts=own_pipeline_parts(module) if dims.pp_enabled else None,
            loss_parallel_default=supports_loss_parallel(module), owner=type(self).__name__,
        )

    def _check_data(self, *, sequence_parallel: bool, microbatches: Optional[int] = None) -> None:
        """The data module's `seq_len` and `global_batch_size` (when it declares them) against the layout."""
        datamodule = getattr(trainer_of(self.lightning_module), "datamodule", None)
        seq_len, global_batch = getattr(datamodule, "seq_len", None), getattr(datamodule, "global_batch_size", None)
        if microbatches is None and self.parallel_dims.pp_enabled:
            microbatches = self.pipeline_microbatches or self.parallel_dims.pp * resolved_stages(
                self.pipeline_schedule, self.pipeline_virtual_stages)
        raise_first(batch_problems(
            self.parallel_dims, seq_len=seq_len if isinstance(seq_len, int) else None,
            global_batch=global_batch if isinstance(global_batch, int) else None, sequence_parallel=sequence_parallel,
            microbatches=microbatches, where=type(datamodule).__name__,
            load_balance=self.context_parallel_load_balance,
            padding_free=getattr(datamodule, "padding_free", None) is True,
        ), type(self).__name__)
