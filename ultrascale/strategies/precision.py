"""Precision for ultrascale strategies: FSDP2 mixed precision instead of autocast."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Optional

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from ultrascale.parallel.grad import clip_grad_norm_
from ultrascale.parallel.rules import CHECKING_PRECISION, STRATEGY_PRECISIONS, choice_problems, raise_first
from ultrascale.parallel.zero import ZeroEngine

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "64-true"]
SUPPORTED_PRECISION: tuple[str, ...] = STRATEGY_PRECISIONS  # the rulebook's list, under the name the strategies' messages use


class UltraScalePrecision(Precision):
    """`32-true`: fp32 everywhere.
    `bf16-mixed`: fp32 master weights, gradients reduced in fp32; FSDP casts the gathered
    parameters to bf16 for compute (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`),
    so no autocast is needed; ZeRO-1/2 keep bf16 weights and fp32 gradients (`parallel.zero.zero12_dtypes`).
    `bf16-true`: weights, gradients and optimizer state in bf16.
    `64-true`: fp64 everywhere, to check a layout against one process to ~1e-12 (`rules.CHECKING_PRECISION`).
    """

    def __init__(self, precision: PrecisionName = "32-true") -> None:
        raise_first(choice_problems("precision", precision, SUPPORTED_PRECISION), "UltraScalePrecision")
        self.precision = precision
        self._norm_group: Optional[torch.distributed.ProcessGroup] = None
        self._not_counted: Callable[[], Sequence[torch.Tensor]] = lambda: ()
        self._step_norm: Callable[[], Optional[torch.Tensor]] = lambda: None
        self._engine_of: Callable[[Any], Optional[ZeroEngine]] = lambda optimizer: None

    def clip_across(self, stages: Optional[torch.distributed.ProcessGroup],
                    not_counted: Callable[[], Sequence[torch.Tensor]] = lambda: (),
                    step_norm: Callable[[], Optional[torch.Tensor]] = lambda: None,
                    engine_of: Callable[[Any], Optional[ZeroEngine]] = lambda optimizer: None) -> None:
        """What clipping by norm needs from the strategy (it calls this in `setup`). `stages`: under pipeline
        parallel, the ranks holding the other stages, whose gradients count in the norm (None: this rank's
        gradients are the model's). `not_counted()`: this step's gradients that another stage counts
        (`TiedStageWeights.not_counted`). `step_norm()`: the global norm the step already reduced for its
        non-finite check, once (`StepRunner.take_grad_norm`), so clipping needs no second reduction.
        `engine_of(optimizer)`: its ZeRO-1/2 engine (whose slices hold the reduced gradients), or None."""
        self._norm_group = stages
        self._not_counted = not_counted
        self._step_norm = step_norm
        self._engine_of = engine_of

    @property
    def param_dtype(self) -> torch.dtype:
        if self.precision == CHECKING_PRECISION:
            return torch.float64
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.param_dtype)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return _default_dtype(self.param_dtype)

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return nullcontext()

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        total = self._step_norm()
        engine = self._engine_of(optimizer)
        if engine is not None:  # ZeRO-1/2: the reduced gradients are the engine's slices
            engine.clip_grad_norm_(clip_val, total_norm=total)
        else:
            clip_grad_norm_(self.main_params(optimizer), clip_val, total_norm=total, across=self._norm_group,
                            not_counted=self._not_counted())

    @override
    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        engine = self._engine_of(optimizer)
        if engine is not None:
            engine.clip_grad_value_(clip_val)
        else:
            super().clip_grad_by_value(optimizer, clip_val)

    def state_dict(self) -> dict[str, Any]:
        return {}


def translate_precision_plugin(plugin: Optional[Precision], owner: str) -> Optional[UltraScalePrecision]:
    """The plugin a strategy stores for the `precision_plugin` Lightning gives it: ours (or None) as it is,
    Lightning's generic `Precision` / `MixedPrecision` / `HalfPrecision` / `DoublePrecision` as the
    `UltraScalePrecision` of the same name. ValueError naming `owner` for anything else."""
    if plugin is None or isinstance(plugin, UltraScalePrecision):
        return plugin
    name = getattr(plugin, "precision", None)
    # Only Lightning's generic plugins are translated; a specialised one (bitsandbytes,
    # transformer-engine, a user's own) is rejected, not silently replaced.
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision) or name not in SUPPORTED_PRECISION:
        raise ValueError(
            f"{owner} supports `precision` in {SUPPORTED_PRECISION} (FSDP2 mixed precision), "
            f"got {type(plugin).__name__}(precision={name!r})"
        )
    return UltraScalePrecision(name)


class _default_dtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *args: Any) -> None:
        torch.set_default_dtype(self.previous)
