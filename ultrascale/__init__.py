"""ultrascale: every parallelism of the Ultra-Scale Playbook as a Lightning strategy.

`import ultrascale` registers the strategies, so `Trainer(strategy="ultrascale_zero3")` works.
"""

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.loss import token_loss
from ultrascale.strategies import (
    ContextParallelStrategy,
    ExpertParallelStrategy,
    HSDPStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    UltraScalePrecision,
    UltraScaleStrategy,
    ZeRO1Strategy,
    ZeRO2Strategy,
    ZeRO3Strategy,
)

__version__ = "0.1.0"

__all__ = ["ParallelDims", "token_loss", "UltraScaleStrategy", "ZeRO1Strategy", "ZeRO2Strategy", "ZeRO3Strategy", "HSDPStrategy", "TensorParallelStrategy", "ContextParallelStrategy", "PipelineParallelStrategy", "ExpertParallelStrategy", "UltraScalePrecision", "__version__"]
