"""ultrascale: every parallelism of the Ultra-Scale Playbook as a Lightning strategy.

`import ultrascale` registers the strategies, so `Trainer(strategy="ultrascale_zero3")` works.
"""

from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.loss import chunked_token_loss, token_loss
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
from ultrascale.strategies.autoresume import latest_checkpoint

__version__ = "0.1.0"

# Sub-packages reachable as attributes after a bare `import ultrascale` (`ultrascale.data.CausalLMDataModule`,
# as the README writes them), imported on first use so that `import ultrascale` stays light (the
# callbacks pull in torchao, the data modules datasets).
_SUBMODULES = ("callbacks", "cli", "data", "estimate", "launch", "measure", "models", "parallel", "planner", "strategies")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"ultrascale.{name}")
    raise AttributeError(f"module 'ultrascale' has no attribute {name!r}")

__all__ = [
    "ParallelDims",
    "token_loss",
    "chunked_token_loss",
    "latest_checkpoint",
    "UltraScaleStrategy",
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "HSDPStrategy",
    "TensorParallelStrategy",
    "ContextParallelStrategy",
    "PipelineParallelStrategy",
    "ExpertParallelStrategy",
    "UltraScalePrecision",
    "__version__",
]
