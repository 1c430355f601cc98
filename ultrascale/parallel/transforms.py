"""Model transforms that must run inside `parallelize`, after TP and before FSDP sharding.

Activation checkpointing and FP8 conversion rewrite modules; FSDP must see the rewritten
modules (it shards the parameters they end up with), and TP plans must see the original
module paths. A Lightning callback that implements `ModelTransform` is called by the
ultrascale strategies at exactly that point. A transform with `before_tensor_parallel = True`
(FP8, which swaps each linear for a `Float8Linear` at the same path) runs before TP instead
when TP is on, so that TP shards the converted layers with torchao's float8 styles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch.nn as nn


@runtime_checkable
class ModelTransform(Protocol):
    def transform_model(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """Rewrite `module` in place; `blocks` are its transformer blocks (possibly empty)."""
