"""FP8 training with torchao: `nn.Linear` layers become `Float8Linear` (fp8 matmuls, high-precision weights).

Float8Linear casts the input, weight and output gradient to float8 with dynamic scales
and runs the three matmuls of a linear layer (forward, grad-input, grad-weight) through
`torch._scaled_mm`; weights, optimizer state and everything outside the converted
layers stay in the training precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ultrascale.callbacks._common import ModelTransformCallback, parallel_dims_of
from ultrascale.parallel.device import float8_matmul_support

__all__ = ["FP8_RECIPES", "Float8Training", "float8_module_filter"]

FP8Recipe = Literal["tensorwise", "rowwise"]
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")


def _import_torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ImportError(
            "Float8Training needs torchao (`pip install torchao`, >= 0.10): its `convert_to_float8_training` does "
            f"the fp8 conversion. Importing it failed: {error}"
        ) from error
    return float8


def float8_module_filter(
    module: nn.Module, blocks: Sequence[nn.Module], *, skip_first_last: bool, skip_modules: Sequence[str]
) -> dict[str, bool]:
    """For every `nn.Linear` in `module`: its path -> whether to convert it to float8.

    Kept in high precision:
    - layers whose in/out features are not multiples of 16 (`torch._scaled_mm` needs them);
    - with `skip_first_last`, the first and last transformer blocks and every linear outside
      the blocks (the LM head): the model's first and last layers are the most sensitive
      to fp8 rounding (Ultra-Scale Playbook, "mixed precision training: FP8");
    - any layer whose path contains one of `skip_modules`.
    """
    edge_blocks = [blocks[0], blocks[-1]] if (skip_first_last and blocks) else []
    in_edge = {id(m) for block in edge_blocks for m in block.modules()}
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    decision: dict[str, bool] = {}
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        convert = sub.in_features % 16 == 0 and sub.out_features % 16 == 0
        if skip_first_last and (id(sub) in in_edge or id(sub) not in in_blocks):
            convert = False
        if any(pattern in path for pattern in skip_modules):
            convert = False
        decision[path] = convert
    return decision


class Float8Training(ModelTransformCallback):
    """Train the model's linear layers in float8 with torchao (`convert_to_float8_training`).

    Under ZeRO-3 (FSDP2) with the `tensorwise` recipe the weights are all-gathered in fp8
    (half the bytes of bf16) and their scales are precomputed in one all-reduce after each
    optimizer step (`precompute_float8_dynamic_scale_for_fsdp`).

    Example::

        trainer = L.Trainer(strategy="ultrascale_zero3", precision="bf16-mixed", callbacks=[Float8Training()])
    """

    _marker = "_ultrascale_float8"
    before_tensor_parallel = True
    """Converted before TP when TP is on (`parallel.transforms`): the plan then shards the `Float8Linear`s with
    torchao's float8 styles."""

    def __init__(
        self,
        recipe: FP8Recipe = "tensorwise",
        skip_first_last: bool = True,
        skip_modules: Sequence[str] = (),
        fsdp_float8_all_gather: Optional[bool] = None,
    ) -> None:
        """
        Args:
            recipe: torchao scaling recipe: `tensorwise` (one dynamic scale per tensor; fastest) or
                `rowwise` (one scale per row, power-of-2 scales; more accurate).
            skip_first_last: keep the first and last transformer blocks and the linears outside the
                blocks (LM head) in high precision.
            skip_modules: substrings of module paths to keep in high precision (e.g. `["attention.wq"]`).
            fsdp_float8_all_gather: all-gather ZeRO-3 weights in fp8 and precompute their scales after
                each optimizer step. None: on for `tensorwise` under ZeRO-3 sharding; torchao supports
                it for `tensorwise` only.
        """
        super().__init__()
        if recipe not in FP8_RECIPES:
            raise ValueError(f"Float8Training: unknown `recipe={recipe!r}`; valid recipes: {', '.join(FP8_RECIPES)}")
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(
                f"Float8Training: `fsdp_float8_all_gather=True` needs `recipe='tensorwise'` (torchao's fp8 all-gather "
                f"uses one scale per weight), got `recipe={recipe!r}`"
            )
        if isinstance(skip_modules, str):
            raise ValueError(f"Float8Training: `skip_modules` is a list of path substrings, got the string {skip_modules!r}")
        _import_torchao()  # fail at construction, not after the processes have started
        self.recipe = recipe
        self.skip_first_last = skip_first_last
        self.skip_modules = tuple(skip_modules)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.converted: list[str] = []
        """Paths of the linears converted to Float8Linear (set when the model is transformed)."""
        self._all_gather = False
        self._last_step = -1

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        dims = parallel_dims_of(trainer.strategy)
        device = trainer.strategy.root_device
        refusal, caution = float8_matmul_support(device, self.recipe)
        if refusal is not None:
            raise ValueError(f"Float8Training: {refusal}. Remove Float8Training (bf16-mixed is the fast path there)")
        if caution is not None:
            rank_zero_warn(f"Float8Training(recipe={self.recipe!r}): {caution}; if it is refused or slow, use recipe='tensorwise'")
        if device.type == "cuda" and not getattr(trainer.strategy, "compile", False):
            rank_zero_warn(
                "Float8Training without `compile=True`: torchao's casts to fp8 and their scales then run as separate "
                "kernels, which usually makes fp8 slower than bf16; set the strategy's `compile=True`"
            )
        # FSDP2 all-gathers the weights only under ZeRO-3 (stages 1/2 keep them replicated).
        zero3 = dims is not None and dims.dp_shard_cp > 1 and getattr(trainer.strategy, "zero_stage", 3) == 3
        wanted = self.fsdp_float8_all_gather
        self._all_gather = (self.recipe == "tensorwise" and zero3) if wanted is None else wanted
        super().setup(trainer, pl_module, stage)

    def _apply(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        float8 = _import_torchao()
        from torchao.float8.float8_linear import Float8Linear

        if any(isinstance(m, Float8Linear) for m in module.modules()):
            return
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self._all_gather:
            import dataclasses

            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        decision = float8_module_filter(
            module, blocks, skip_first_last=self.skip_first_last, skip_modules=self.skip_modules
        )
        if not any(decision.values()):
            raise ValueError(
                f"Float8Training: no linear layer of {type(module).__name__} qualifies for fp8 "
                f"({len(decision)} linears; skip_first_last={self.skip_first_last} keeps the first and last of "
                f"{len(blocks)} blocks and the head, and dims must be multiples of 16). "
                "Set `skip_first_last=False` or use a deeper model."
            )
        float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda m, fqn: decision.get(fqn, False))
        self.converted = [path for path, m in module.named_modules() if isinstance(m, Float8Linear)]
        rank_zero_info(
            f"Float8Training({self.recipe}): {len(self.converted)} of {len(decision)} linear layers in fp8"
            f"{', fp8 FSDP all-gather' if self._all_gather else ''}"
        )

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Before the first step too: without precomputed scales, FSDP's fp8 all-gather takes each weight's amax over
        # its data-parallel shards only, so under tensor parallel every tp rank cast with its own scale (first-step
        # gradients 7.5% off one process's fp8 at dp2 x tp2). `precompute...` takes it over the whole DTensor.
        if self._all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(pl_module)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        # After each optimizer step (not each micro-batch): the weights changed, so their fp8
        # scales amax(|W|) are recomputed for all layers in one all-reduce instead of one per layer.
        if not self._all_gather or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(pl_module)
