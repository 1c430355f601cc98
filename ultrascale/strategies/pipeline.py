"""Pipeline parallel strategy (combined with ZeRO / HSDP over the data-parallel ranks and TP inside stages)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from typing_extensions import Unpack, override

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import auto_degree_problems, raise_first
from ultrascale.strategies.base import ShardingKnobs, UltraScaleStrategy, checked_knobs


class PipelineParallelStrategy(UltraScaleStrategy):
    """The model's layers split into `pipeline_parallel` stages on as many ranks, run by a torch
    schedule; ZeRO (stage `zero_stage`) over the data-parallel ranks of each stage.

    Registered as ``"ultrascale_pp"``. The training step becomes one call: the strategy's
    `pipeline_loss(batch)` cuts the local batch into `pipeline_microbatches` micro-batches and runs
    the forward and backward of all of them through the stages (ultrascale's `CausalLMModule`
    calls it from its steps); the loss is computed on the last stage and given to every rank.

    Args:
        pipeline_parallel: pipeline ranks; "auto" = all devices of a node (one data-parallel rank per node).
        pipeline_schedule, pipeline_microbatches, pipeline_virtual_stages, pipeline_layers: see
            `UltraScaleStrategy`.
        tensor_parallel, sequence_parallel, tp_plan: tensor parallel inside each stage; 1 means off.
        data_parallel_replicate: HSDP replicas; 1 means off.
        zero_stage: 3 (FSDP2, weights kept gathered through each step's micro-batches), 2 or 1
            (both reduce gradients once per step under PP).
    """

    strategy_name = "ultrascale_pp"

    def __init__(
        self,
        pipeline_parallel: Union[int, Literal["auto"]] = "auto",
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: Optional[int] = None,
        pipeline_virtual_stages: Optional[int] = None,
        pipeline_layers: Optional[list[int]] = None,
        tensor_parallel: int = 1,
        sequence_parallel: Optional[bool] = None,
        tp_plan: Optional[dict[str, Any]] = None,
        data_parallel_replicate: int = 1,
        zero_stage: int = 3,
        **knobs: Unpack[ShardingKnobs],
    ) -> None:
        raise_first(auto_degree_problems(pipeline_parallel=pipeline_parallel), type(self).__name__)
        super().__init__(
            data_parallel_replicate=data_parallel_replicate,
            data_parallel_shard=-1,
            pipeline_parallel=2 if pipeline_parallel == "auto" else pipeline_parallel,  # resolved in `resolve_dims`
            pipeline_schedule=pipeline_schedule,
            pipeline_microbatches=pipeline_microbatches,
            pipeline_virtual_stages=pipeline_virtual_stages,
            pipeline_layers=pipeline_layers,
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            tp_plan=tp_plan,
            zero_stage=zero_stage,
            **checked_knobs(type(self).__name__, knobs, ShardingKnobs),
        )
        self.pipeline_parallel = pipeline_parallel

    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        self._degrees["pp"] = self.num_processes // self._degrees["tp"] if self.pipeline_parallel == "auto" else self.pipeline_parallel
        return super().resolve_dims(world_size)
