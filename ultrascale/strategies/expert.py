"""Expert parallel strategy: the experts of a Mixture-of-Experts model split over ranks, ZeRO over the rest."""

from __future__ import annotations

from typing import Literal, Union

from typing_extensions import Unpack, override

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import auto_degree_problems, raise_first
from ultrascale.strategies.base import ShardingKnobs, UltraScaleStrategy, checked_knobs


class ExpertParallelStrategy(UltraScaleStrategy):
    """Each MoE layer's experts split over `expert_parallel` ranks (tokens travel to their experts by
    all-to-all), every weight sharded by FSDP2 (or the optimizer state by ZeRO-1/2): dense weights over all data
    ranks, expert weights over the ranks holding the same experts (world / expert_parallel of them).

    Registered as ``"ultrascale_ep"``. For the built-in Llama with `n_experts` (preset "tiny_moe")
    and Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints.

    Args:
        expert_parallel: ranks that split the experts (must divide the experts per layer); "auto" = all
            devices of a node.
        context_parallel: ranks that split each sequence (ep may borrow them); 1 means off.
        data_parallel_replicate: HSDP replicas; 1 means off.
        zero_stage: 3 (FSDP2), or 1/2 (each rank holds its experts whole, their optimizer state cut over the
            ranks holding the same experts).
    """

    strategy_name = "ultrascale_ep"

    def __init__(
        self,
        expert_parallel: Union[int, Literal["auto"]] = "auto",
        context_parallel: int = 1,
        data_parallel_replicate: int = 1,
        zero_stage: int = 3,
        **knobs: Unpack[ShardingKnobs],
    ) -> None:
        raise_first(auto_degree_problems(expert_parallel=expert_parallel), type(self).__name__)
        super().__init__(
            data_parallel_replicate=data_parallel_replicate,
            data_parallel_shard=-1,
            context_parallel=context_parallel,
            expert_parallel=2 if expert_parallel == "auto" else expert_parallel,  # resolved in `resolve_dims`
            zero_stage=zero_stage,
            **checked_knobs(type(self).__name__, knobs, ShardingKnobs),
        )
        self.expert_parallel = expert_parallel

    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        if self.expert_parallel == "auto":
            self._degrees["ep"] = max(1, self.num_processes)
        return super().resolve_dims(world_size)
