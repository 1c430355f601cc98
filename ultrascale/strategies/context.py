"""Context parallel strategy (combined with tensor parallel and ZeRO-3 over the remaining ranks)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from typing_extensions import Unpack, override

from ultrascale.parallel.context import ContextParallelMethod
from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import auto_degree_problems, raise_first
from ultrascale.strategies.base import ShardingKnobs, UltraScaleStrategy, checked_knobs


class ContextParallelStrategy(UltraScaleStrategy):
    """The sequence of every batch split over groups of `context_parallel` ranks for the whole model;
    ZeRO-3 over dp_shard x cp (cp ranks hold the same weights, so they shard them too).

    Registered as ``"ultrascale_cp"``. Every layer but attention is per token; attention of
    the local queries over the whole sequence uses ring or all-gather K/V exchange, or all-to-alls
    that trade heads for sequence (Ulysses) (`ultrascale.parallel.context`). Long-context fine-tuning: a sequence that does not fit
    one device's activations fits `context_parallel` devices.

    Args:
        context_parallel: CP degree; "auto" = devices per node (attention exchanges K/V in every layer).
        context_parallel_method, context_parallel_load_balance, context_parallel_ulysses: see `UltraScaleStrategy`.
        tensor_parallel, sequence_parallel, loss_parallel, tp_plan: tensor parallel inside each
            cp rank's share (see `UltraScaleStrategy`); 1 means off.
        data_parallel_replicate: HSDP replicas; 1 means off.
    """

    strategy_name = "ultrascale_cp"

    def __init__(
        self,
        context_parallel: Union[int, Literal["auto"]] = "auto",
        context_parallel_method: ContextParallelMethod = "ring",
        context_parallel_load_balance: bool = True,
        context_parallel_ulysses: Optional[int] = None,
        tensor_parallel: int = 1,
        sequence_parallel: Optional[bool] = None,
        loss_parallel: Optional[bool] = None,
        tp_plan: Optional[dict[str, Any]] = None,
        data_parallel_replicate: int = 1,
        **knobs: Unpack[ShardingKnobs],
    ) -> None:
        raise_first(auto_degree_problems(context_parallel=context_parallel), type(self).__name__)
        super().__init__(
            data_parallel_replicate=data_parallel_replicate,
            data_parallel_shard=-1,
            context_parallel_method=context_parallel_method,
            context_parallel_load_balance=context_parallel_load_balance,
            context_parallel_ulysses=context_parallel_ulysses,
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            tp_plan=tp_plan,
            **checked_knobs(type(self).__name__, knobs, ShardingKnobs),
        )
        self.context_parallel = context_parallel

    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        self._degrees["cp"] = self.num_processes if self.context_parallel == "auto" else self.context_parallel
        return super().resolve_dims(world_size)
