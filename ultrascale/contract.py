"""The contract between a LightningModule and ultrascale's strategies, in one place.

Any LightningModule trains under the strategies unchanged. A module may declare more, and each
member of `ModuleContract` it declares changes what the strategy does; every member is optional
(absent or None: not declared). The strategy reads them only through the helpers below, and
`check_module` checks what a module declares at setup, before any collective, so that a wrong
declaration is one clear error rather than a hang or a silent fallback.

In the other direction, `StrategyContract` lists what a module may read from the strategy it runs
under; the helpers answer for any strategy (Lightning's own ones included: then as "off").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ultrascale.parallel.dims import ParallelMesh
    from ultrascale.parallel.pipeline import PipelineParts


class ModuleContract(Protocol):
    """What a LightningModule may declare for ultrascale's strategies (each member optional)."""

    prefers_meta_init: bool
    """True: the model is built on the meta device in `configure_model()` (the strategy's init
    context), whatever `meta_init` says, and materialised shard by shard after sharding: for a module
    that loads its weights itself then (`HFCausalLM`). The weights then come from `init_weights()`."""

    supports_loss_parallel: bool
    """True: the module's loss accepts vocab-sharded DTensor logits, so under tensor parallel
    `loss_parallel=None` keeps them sharded into the cross-entropy (no all-gather of the (B, T, V)
    logits). False or absent: the logits are all-gathered first."""

    attends_within_documents: bool
    """True: the model reads ``position_ids`` (B, T) restarting at 0 as the starts of documents, each attending to
    itself alone (`CausalLMModule`: the built-in Llama and `HFCausalLM`), so a data module may lay a batch's
    sequences end to end in one row (`InstructionDataModule(padding_free=None)`). False or absent: padding-free
    batches only when the data module is told to (`padding_free=True`); a model that ignored the positions would
    let one example attend to another."""

    config: Any
    """The model's config (`LlamaConfig`, a Hugging Face `PretrainedConfig`): its sizes (layers, heads,
    experts, tied embeddings) let the layout be checked before any rank starts, and `auto_layout`
    price the run. Absent: the checks wait for the built model."""

    def pipeline_parts(self) -> "PipelineParts":
        """Where the embedding, layers, norm and head of the model live and how a stage runs them, so
        that pipeline parallel can split a model that has no built-in adapter. The steps then get their
        loss from `trainer.strategy.pipeline_loss(batch)`."""
        ...

    def init_weights(self) -> None:
        """Fill the weights of a model that was built on the meta device, after it was sharded and
        materialised on this rank's device (`meta_init`, `prefers_meta_init`): the only place the
        weights come from then (initialised from a seed, or loaded)."""
        ...


class StrategyContract(Protocol):
    """What a LightningModule may read from an ultrascale strategy (`trainer.strategy`)."""

    normalizes_token_loss: bool
    """A `training_step` output ``{"loss": mean, "num_tokens": n}`` becomes the exact global token mean
    (gradient and the logged ``train_loss``, which the module then does not log itself)."""

    pipeline_active: bool
    """The model is split into pipeline stages: the steps get their loss from `pipeline_loss`."""

    parallel_mesh: "ParallelMesh"
    """All meshes of the run by axis name, once the processes have started."""

    sequence_parallel_mesh: Optional[Any]
    """Under sequence parallel, the tp `DeviceMesh` whose ranks hold slices (dim 1) of the residual stream; None
    otherwise."""

    def pipeline_loss(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the batch through the pipeline: ``{"loss": token mean, "num_tokens": n}``."""
        ...


_BOOLEANS = ("prefers_meta_init", "supports_loss_parallel", "attends_within_documents")
_METHODS = ("pipeline_parts", "init_weights")


def check_module(module: Any, owner: str) -> None:
    """TypeError naming the member of `ModuleContract` that `module` declares with the wrong type."""
    name = user_class_name(module)
    for member in _BOOLEANS:
        value = _declared(module, member)
        if value is not None and not isinstance(value, bool):
            raise TypeError(
                f"{owner}: {name}.{member} is {value!r} ({type(value).__name__}); it must be True or False "
                f"(see `ultrascale.contract.ModuleContract.{member}`)"
            )
    for member in _METHODS:
        value = _declared(module, member)
        if value is not None and not callable(value):
            raise TypeError(
                f"{owner}: {name}.{member} is {value!r} ({type(value).__name__}), not a method; define "
                f"`def {member}(self)` on the LightningModule (see `ultrascale.contract.ModuleContract.{member}`)"
            )


def prefers_meta_init(module: Any) -> bool:
    """`ModuleContract.prefers_meta_init`, False where not declared."""
    return bool(_declared(module, "prefers_meta_init"))


def supports_loss_parallel(module: Any) -> bool:
    """`ModuleContract.supports_loss_parallel`, False where not declared."""
    return bool(_declared(module, "supports_loss_parallel"))


def attends_within_documents(module: Any) -> bool:
    """`ModuleContract.attends_within_documents`, False where not declared."""
    return bool(_declared(module, "attends_within_documents"))


def own_pipeline_parts(module: Any) -> Optional["PipelineParts"]:
    """`ModuleContract.pipeline_parts()`, None where not declared."""
    method = _declared(module, "pipeline_parts")
    return method() if callable(method) else None


def attached_strategy(module: "pl.LightningModule") -> Optional[Any]:
    """The strategy of the Trainer `module` is attached to, or None."""
    try:
        return module.trainer.strategy
    except RuntimeError:  # not attached to a Trainer
        return None


def stage_mesh(strategy: Any) -> Optional[Any]:
    """Under pipeline parallel, the mesh of the ranks that hold this rank's stages (`parallel_mesh["stage"]`);
    None without a pipeline or for a strategy that has no `parallel_mesh` (Lightning's own)."""
    mesh = getattr(strategy, "parallel_mesh", None)
    return mesh["stage"] if mesh is not None and mesh.dims.pp_enabled else None


def sequence_parallel_mesh(strategy: Any) -> Optional[Any]:
    """`UltraScaleStrategy.sequence_parallel_mesh` of any strategy: the tp mesh whose ranks hold slices of the
    sequence under sequence parallel; None otherwise and for Lightning's strategies."""
    return getattr(strategy, "sequence_parallel_mesh", None)


def normalizes_token_loss(strategy: Any) -> bool:
    """`StrategyContract.normalizes_token_loss` of any strategy (False for Lightning's own)."""
    return bool(getattr(strategy, "normalizes_token_loss", False))


def pipeline_active(strategy: Any) -> bool:
    """`StrategyContract.pipeline_active` of any strategy (False for Lightning's own)."""
    return bool(getattr(strategy, "pipeline_active", False))


def _declared(module: Any, member: str) -> Any:
    return getattr(module, member, None)


def user_class_name(module: Any) -> str:
    """The user's class name, also after `fully_shard` turned `LlamaLM` into `FSDPLlamaLM`."""
    name = type(module).__name__
    return name[len("FSDP"):] if isinstance(module, FSDPModule) and name.startswith("FSDP") else name


__all__ = [
    "ModuleContract",
    "StrategyContract",
    "attached_strategy",
    "attends_within_documents",
    "check_module",
    "normalizes_token_loss",
    "own_pipeline_parts",
    "pipeline_active",
    "prefers_meta_init",
    "sequence_parallel_mesh",
    "supports_loss_parallel",
]


def declares_pipeline_parts(module: Any) -> bool:
    """Whether `module` declares its own `ModuleContract.pipeline_parts()` (known before the model is built)."""
    return callable(_declared(module, "pipeline_parts"))
