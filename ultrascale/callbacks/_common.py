"""What the callbacks share: the mesh degrees of a strategy, and when a model transform runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch.nn as nn
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from ultrascale.models.adapters import get_adapter
from ultrascale.parallel.dims import ParallelDims


def parallel_dims_of(strategy: Any) -> Optional[ParallelDims]:
    """The mesh degrees of an ultrascale strategy; None for Lightning's own strategies.

    Read from the strategy's public, typed `parallel_dims` property (callbacks sit below
    the strategies in the layering and do not import them).
    """
    dims = getattr(strategy, "parallel_dims", None)
    return dims if isinstance(dims, ParallelDims) else None


def data_parallel_size(trainer: "pl.Trainer") -> int:
    """Ranks that see different batches: dp = dp_replicate x dp_shard; the world size under other strategies."""
    dims = parallel_dims_of(trainer.strategy)
    return dims.dp if dims is not None else trainer.world_size


class ModelTransformCallback(Callback):
    """A callback that rewrites the model once, at the right moment for the strategy.

    Under an ultrascale strategy the strategy calls `transform_model` inside
    `parallelize` (after TP, before FSDP sharding). Under Lightning's own strategies
    (single device, DDP) the callback applies itself: in `setup` if the module already
    has its layers, else in `on_fit_start`, after `configure_model`. A marker on the root
    module makes a second application a no-op.
    """

    _marker: str = "_ultrascale_transform"
    """Attribute set on the root module once this transform has run."""

    def _apply(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        raise NotImplementedError

    def transform_model(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """Rewrite `module` in place (the `ultrascale.parallel.transforms.ModelTransform` protocol)."""
        if getattr(module, self._marker, False):
            return
        self._apply(module, blocks)
        setattr(module, self._marker, True)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or parallel_dims_of(trainer.strategy) is not None:
            return  # ultrascale strategies call `transform_model` inside `parallelize`
        if any(True for _ in pl_module.parameters()):
            self.transform_model(pl_module, get_adapter(pl_module).blocks)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if getattr(pl_module, self._marker, False):
            return
        if parallel_dims_of(trainer.strategy) is not None or any(isinstance(p, DTensor) for p in pl_module.parameters()):
            # The model was sharded without passing through `parallelize` (e.g. its own
            # configure_model applied FSDP/TP): rewriting it now would miss the sharded modules.
            raise RuntimeError(
                f"{type(self).__name__} could not rewrite {type(pl_module).__name__}: the model was parallelised "
                "before the callback ran (its `configure_model()` sharded it itself). Let the ultrascale strategy "
                "shard it, or apply the transform inside your `configure_model()` before sharding."
            )
        self.transform_model(pl_module, get_adapter(pl_module).blocks)
