"""Tensor + sequence parallel strategy (combined with ZeRO-3 over the remaining ranks)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from typing_extensions import Unpack, override

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import auto_degree_problems, raise_first
from ultrascale.strategies.base import ShardingKnobs, UltraScaleStrategy, checked_knobs


class TensorParallelStrategy(UltraScaleStrategy):
    """Tensor parallel (+ sequence parallel, + loss parallel) inside groups of `tensor_parallel`
    ranks, ZeRO-3 across the groups (2-D: dp_shard x tp).

    Registered as ``"ultrascale_tp"``. TP communicates inside every layer, so keep its
    group within a node: "auto" uses every device of a node for TP.

    Args:
        tensor_parallel: TP degree; "auto" = devices per node.
        sequence_parallel, loss_parallel, tp_plan, async_tensor_parallel: see `UltraScaleStrategy`.
        data_parallel_replicate: HSDP replicas of the (dp_shard x tp) model; 1 means off.
    """

    strategy_name = "ultrascale_tp"

    def __init__(
        self,
        tensor_parallel: Union[int, Literal["auto"]] = "auto",
        sequence_parallel: Optional[bool] = None,
        loss_parallel: Optional[bool] = None,
        tp_plan: Optional[dict[str, Any]] = None,
        data_parallel_replicate: int = 1,
        async_tensor_parallel: bool = False,
        **knobs: Unpack[ShardingKnobs],
    ) -> None:
        raise_first(auto_degree_problems(tensor_parallel=tensor_parallel), type(self).__name__)
        super().__init__(
            data_parallel_replicate=data_parallel_replicate,
            data_parallel_shard=-1,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            tp_plan=tp_plan,
            async_tensor_parallel=async_tensor_parallel,
            **checked_knobs(type(self).__name__, knobs, ShardingKnobs),
        )
        self.tensor_parallel = tensor_parallel

    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        self._degrees["tp"] = self.num_processes if self.tensor_parallel == "auto" else self.tensor_parallel
        return super().resolve_dims(world_size)
