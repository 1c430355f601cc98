"""The reduced-depth copy of `ultrascale verify`: both runs keep only the model's first blocks.

A model too big for one device cannot be the one-device reference. Both runs then train the same model with
its first `depth` transformer blocks (the embedding, the head and every block's shape unchanged), so the
layout's every collective and split still runs, on fewer blocks. The built-in Llama (`LlamaLM`) is cut in its
config; a Hugging Face model (`HFCausalLM`) in its config too, with its per-layer lists (`layer_types`)
cut alike, and loads the first blocks' weights from its checkpoint (the rest of the file is not read).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["depth_of", "one_device_depth", "reduce_depth"]


def depth_of(module: Any) -> Optional[int]:
    """The module's number of transformer blocks, None for a module `reduce_depth` cannot cut."""
    from ultrascale.models.hf import HFCausalLM
    from ultrascale.models.lm import LlamaLM

    if isinstance(module, LlamaLM):
        return module.config.n_layers
    if isinstance(module, HFCausalLM):
        return int(module.config.num_hidden_layers)
    return None


def reduce_depth(module: Any, depth: int) -> str:
    """Keep the first `depth` blocks of `module` (before its network is built); what was done, for the output.
    ValueError for a module kind it cannot cut, or a depth that is not below the model's."""
    from ultrascale.models.hf import HFCausalLM
    from ultrascale.models.lm import LlamaLM

    layers = depth_of(module)
    if layers is None:
        raise ValueError(f"--depth: {type(module).__name__} is neither ultrascale's LlamaLM nor HFCausalLM; give the model "
                         "fewer blocks in the recipe instead")
    if not 1 <= depth < layers:
        raise ValueError(f"--depth {depth}: the model has {layers} blocks; give 1 to {layers - 1}")
    if getattr(module, "model", None) is not None:
        raise ValueError(f"--depth: {type(module).__name__}'s network is built already; its depth can no longer change")
    if isinstance(module, LlamaLM):
        module.config = dataclasses.replace(module.config, n_layers=depth)
    elif isinstance(module, HFCausalLM):
        config = module.config
        for key, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == layers:  # per-layer settings (`layer_types`)
                setattr(config, key, value[:depth])
        config.num_hidden_layers = depth
    return f"both runs keep the first {depth} of the model's {layers} blocks"


def one_device_depth(plan: Any, device_bytes: float, stages: int) -> Optional[int]:
    """The depth for a one-device reference of the recipe `plan` (`ultrascale.planner.recipe_check.RecipePlan`): None when
    the planner's fp32 peak for the whole model on one device fits `device_bytes`, else the most blocks whose
    peak fits, at least `stages` (the layout's pipeline stages need a block each) and below the model's."""
    from ultrascale import planner

    shape, work = plan.shape, dataclasses.replace(plan.work, precision="32-true", compiled=False, float8=False)
    cluster = dataclasses.replace(plan.cluster, gpus=1, gpus_per_node=1)
    single = planner.Layout(dp_shard=1, zero_stage=3, micro_batch=work.global_batch, grad_accumulation=1)

    def peak(layers: int) -> float:
        cut = dataclasses.replace(shape, n_layers=layers, moe_layers=min(shape.moe_layers, layers))
        return planner.evaluate(cut, single, cluster, work).memory["total"]

    if peak(shape.n_layers) <= device_bytes:
        return None
    fitting = [n for n in range(max(stages, 1), shape.n_layers) if peak(n) <= device_bytes]
    return fitting[-1] if fitting else max(stages, 1)
