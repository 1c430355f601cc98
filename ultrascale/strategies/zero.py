"""ZeRO-1/2/3 and HSDP: the data-parallel strategies, each exposing only its own knobs."""

from __future__ import annotations

from typing import Literal, Optional, Union

from typing_extensions import Unpack, override

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import auto_degree_problems, raise_first
from ultrascale.strategies.base import ProcessKnobs, ShardingKnobs, UltraScaleStrategy, checked_knobs


class _ShardedOptimizerStrategy(UltraScaleStrategy):
    """ZeRO-1/2: replicated parameters, optimizer state (ZeRO-2: and gradients) sharded over all ranks."""

    _stage = 0

    def __init__(
        self,
        zero_bucket_mb: Optional[float] = None,
        accumulate_grads_in_fp32: Optional[bool] = None,
        **knobs: Unpack[ProcessKnobs],
    ) -> None:
        super().__init__(
            data_parallel_replicate=1,
            data_parallel_shard=-1,
            zero_stage=self._stage,
            zero_bucket_mb=zero_bucket_mb,
            accumulate_grads_in_fp32=accumulate_grads_in_fp32,
            **checked_knobs(type(self).__name__, knobs, ProcessKnobs),
        )


class ZeRO1Strategy(_ShardedOptimizerStrategy):
    """ZeRO-1: each rank keeps full parameters and gradients but only 1/N of the optimizer
    state (fp32 master weights and Adam moments): 2Ψ + 4Ψ + 12Ψ/N bytes under bf16-mixed (fp32
    gradients; 2Ψ + 2Ψ + 12Ψ/N with `accumulate_grads_in_fp32=False`).

    Registered as ``"ultrascale_zero1"``. In the step's last backward each gradient bucket is
    reduce-scattered as soon as it is complete (overlapping the rest of backward), each rank steps
    its slice, and the updated weights are all-gathered.

    Args:
        zero_bucket_mb: gradient bucket size (one collective per bucket); None: 100 MiB on GPU, 4 on CPU.
        accumulate_grads_in_fp32: with bf16 weights, accumulate and reduce gradients in fp32. None: fp32 under
            bf16-mixed, the weights' dtype under bf16-true.
    """

    strategy_name = "ultrascale_zero1"
    _stage = 1


class ZeRO2Strategy(_ShardedOptimizerStrategy):
    """ZeRO-2: full parameters, 1/N of the gradients and of the optimizer state per rank:
    2Ψ + (4 + 12)Ψ/N bytes under bf16-mixed (fp32 gradients; 2Ψ + (2 + 12)Ψ/N with
    `accumulate_grads_in_fp32=False`).

    Registered as ``"ultrascale_zero2"``. Each gradient bucket is reduce-scattered as soon as
    backward has produced all of its gradients (overlapping the rest of backward) and then
    freed, so a rank never holds more than its slice of the reduced gradients.

    Args:
        zero_bucket_mb: gradient bucket size; None: 100 MiB on GPU, 4 on CPU. Smaller buckets
            start communicating earlier, larger ones use the links better.
        accumulate_grads_in_fp32: as for ZeRO-1.
    """

    strategy_name = "ultrascale_zero2"
    _stage = 2


class ZeRO3Strategy(UltraScaleStrategy):
    """ZeRO-3 (FSDP2): parameters, gradients and optimizer state sharded over all ranks.

    Registered as ``"ultrascale_zero3"``. Model-state memory per rank is 16Ψ/N for
    Ψ parameters under Adam (Ultra-Scale Playbook): at the cost of one all-gather of the
    parameters in forward, one in backward and a reduce-scatter of the gradients.
    """

    strategy_name = "ultrascale_zero3"

    def __init__(self, **knobs: Unpack[ShardingKnobs]) -> None:
        super().__init__(data_parallel_replicate=1, data_parallel_shard=-1, zero_stage=3,
                         **checked_knobs(type(self).__name__, knobs, ShardingKnobs))


class HSDPStrategy(UltraScaleStrategy):
    """Hybrid sharding: ZeRO-3 within groups of `world / data_parallel_replicate` ranks,
    plain data-parallel replication (gradient all-reduce) across the groups.

    Registered as ``"ultrascale_hsdp"``. Shard within a node (fast links carry the
    all-gathers) and replicate across nodes (only one gradient all-reduce per step
    crosses the slow links).

    Args:
        data_parallel_replicate: number of replicas. "auto": one per node on several
            nodes; on a single node 2 replicas (so that HSDP is really exercised).
    """

    strategy_name = "ultrascale_hsdp"

    def __init__(
        self,
        data_parallel_replicate: Union[int, Literal["auto"]] = "auto",
        **knobs: Unpack[ShardingKnobs],
    ) -> None:
        raise_first(auto_degree_problems(data_parallel_replicate=data_parallel_replicate), type(self).__name__)
        super().__init__(data_parallel_replicate=1, data_parallel_shard=-1, zero_stage=3,
                         **checked_knobs(type(self).__name__, knobs, ShardingKnobs))
        self.data_parallel_replicate = data_parallel_replicate

    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        replicate = self.data_parallel_replicate
        if replicate == "auto":
            replicate = self.num_nodes if self.num_nodes > 1 else 2
        self._degrees["dp_replicate"] = replicate
        return super().resolve_dims(world_size)
