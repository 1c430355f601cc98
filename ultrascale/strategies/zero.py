"""ZeRO-3 and HSDP: the data-parallel strategies, each exposing only its own knobs."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, Optional, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from ultrascale.parallel.dims import ParallelDims
from ultrascale.strategies.base import UltraScaleStrategy
from ultrascale.strategies.launcher import LauncherName


class ZeRO3Strategy(UltraScaleStrategy):
    """ZeRO-3 (FSDP2): parameters, gradients and optimizer state sharded over all ranks.

    Registered as ``"ultrascale_zero3"``. Model-state memory per rank is 16Ψ/N for
    Ψ parameters under Adam (Ultra-Scale Playbook): at the cost of one all-gather of the
    parameters in forward, one in backward and a reduce-scatter of the gradients.
    """

    strategy_name = "ultrascale_zero3"

    def __init__(
        self,
        reshard_after_forward: bool = True,
        meta_init: bool = False,
        sync_module_states: bool = True,
        launcher: LauncherName = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_replicate=1,
            data_parallel_shard=-1,
            zero_stage=3,
            reshard_after_forward=reshard_after_forward,
            meta_init=meta_init,
            sync_module_states=sync_module_states,
            launcher=launcher,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )


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
        reshard_after_forward: bool = True,
        meta_init: bool = False,
        sync_module_states: bool = True,
        launcher: LauncherName = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        if data_parallel_replicate != "auto" and (
            not isinstance(data_parallel_replicate, int) or data_parallel_replicate < 1
        ):
            raise ValueError(
                f"HSDPStrategy(`data_parallel_replicate={data_parallel_replicate!r}`): give a positive int or 'auto'"
            )
        super().__init__(
            data_parallel_replicate=1,
            data_parallel_shard=-1,
            zero_stage=3,
            reshard_after_forward=reshard_after_forward,
            meta_init=meta_init,
            sync_module_states=sync_module_states,
            launcher=launcher,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.data_parallel_replicate = data_parallel_replicate

    @override
    def resolve_dims(self, world_size: int) -> ParallelDims:
        replicate = self.data_parallel_replicate
        if replicate == "auto":
            replicate = self.num_nodes if self.num_nodes > 1 else 2
        self._degrees["dp_replicate"] = replicate
        return super().resolve_dims(world_size)
