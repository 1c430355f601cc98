"""Lightning strategies; importing this module registers them by name with Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from ultrascale.contract import ModuleContract, StrategyContract
from ultrascale.strategies.base import UltraScaleStrategy
from ultrascale.strategies.context import ContextParallelStrategy
from ultrascale.strategies.expert import ExpertParallelStrategy
from ultrascale.strategies.pipeline import PipelineParallelStrategy
from ultrascale.strategies.precision import UltraScalePrecision
from ultrascale.strategies.tensor import TensorParallelStrategy
from ultrascale.strategies.zero import HSDPStrategy, ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy

_REGISTERED = {
    "ultrascale_4d": (UltraScaleStrategy, "N-D mesh strategy: pp x dp_replicate x dp_shard x cp x tp (ZeRO / HSDP / TP / CP / PP / EP); "
                      "by name, the layout is the planner's best for the world size, model and batch"),
    "ultrascale_zero1": (ZeRO1Strategy, "ZeRO-1: optimizer state sharded, parameters and gradients replicated"),
    "ultrascale_zero2": (ZeRO2Strategy, "ZeRO-2: optimizer state and gradients sharded, parameters replicated"),
    "ultrascale_zero3": (ZeRO3Strategy, "ZeRO-3: FSDP2 sharding of parameters, gradients and optimizer state"),
    "ultrascale_hsdp": (HSDPStrategy, "HSDP: ZeRO-3 within a replica group, replicated across groups"),
    "ultrascale_tp": (TensorParallelStrategy, "tensor + sequence + loss parallel, ZeRO-3 across TP groups"),
    "ultrascale_cp": (ContextParallelStrategy, "context parallel (ring / all-gather attention), ZeRO-3 over dp x cp"),
    "ultrascale_pp": (PipelineParallelStrategy, "pipeline parallel (torch schedules: GPipe ... DualPipeV), ZeRO over dp"),
    "ultrascale_ep": (ExpertParallelStrategy, "expert parallel (all-to-all token dispatch), ZeRO-3 over dp"),
}

# By name alone, `ultrascale_4d` picks its layout (`auto_layout`); the class keeps explicit defaults.
_INIT_PARAMS = {"ultrascale_4d": {"auto_layout": True}}

for _name, (_cls, _description) in _REGISTERED.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=_description, **_INIT_PARAMS.get(_name, {}))

__all__ = [
    "ModuleContract",
    "StrategyContract",
    "UltraScaleStrategy",
    "ContextParallelStrategy",
    "PipelineParallelStrategy",
    "ExpertParallelStrategy",
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "HSDPStrategy",
    "TensorParallelStrategy",
    "UltraScalePrecision",
]
