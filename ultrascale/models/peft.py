"""PEFT (LoRA and the other `peft` adapters) under ultrascale strategies: save the adapter, export a merged model.

`PeftModel.save_pretrained` reads the parameters as they are on the calling rank. Under ZeRO-3 / HSDP (FSDP2)
and TP those are DTensor shards: called on rank 0 it fails (`invalid python storage`), and anything that got past
that would write one rank's shard. Here every rank takes part in un-sharding the tensors, then rank 0 alone
hands the full, CPU copies to PEFT itself:

- `save_peft_adapter(trainer_or_module, out_dir)`: the adapter folder `PeftModel.save_pretrained` writes
  (`adapter_config.json`, `adapter_model.safetensors`, PEFT's key names; PEFT picks the tensors and writes
  the files through `save_pretrained(state_dict=...)`). Only the adapter's tensors are gathered.
- `export_merged_hf(trainer_or_module, out_dir)`: a plain Hugging Face folder with the adapter merged into the
  base weights by PEFT's `merge_and_unload()`, loadable with `AutoModelForCausalLM.from_pretrained` (no peft
  needed). Gathers the whole model to rank 0's CPU memory.
- `PeftAdapterExport(adapter_dir, merged_dir=None)`: a callback that does both when `fit` ends.

Both functions are collectives: under a process group EVERY rank must call them (rank 0 writes, the others
only take part in the gathers); a rank that skips the call leaves the others waiting. Errors (no PEFT model,
a non-empty target without `overwrite=True`, a failed write) are raised on every rank. Folders are written
beside the target and renamed into place when complete, so a failed save leaves no half-written folder.

Works the same with no process group (one process), under ZeRO-1/2 (replicated plain tensors) and ZeRO-3 /
HSDP (FSDP2 DTensor shards) and tensor parallel (LoRA adapters split to follow their base layer's split,
`ultrascale.parallel.tensor.lora_entries`); any DTensor is gathered with `full_tensor`, whatever its
placements. Under pipeline parallel each rank holds only its stages' parameters: they are gathered within
the stage, then the first rank of every stage sends them to rank 0 (`ultrascale.parallel.pipeline.gather_stage_states`),
so rank 0 writes the whole model's adapter (or merged model) under any schedule.
Requires `pip install "ultrascale[peft]"`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, Union

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from ultrascale.parallel.rules import not_built

__all__ = ["PeftAdapterExport", "export_merged_hf", "find_peft_model", "save_peft_adapter"]

PEFT_INSTALL_HINT = 'pip install "ultrascale[peft]"'


def require_peft() -> Any:
    """The `peft` module, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as error:
        raise ImportError(f"ultrascale.models.peft needs the `peft` package: {PEFT_INSTALL_HINT}") from error
    return peft


def find_peft_model(target: Any) -> Any:
    """The `peft.PeftModel` of `target`: a Trainer (its LightningModule), a LightningModule or any `nn.Module`
    holding one (the outermost), or a `PeftModel` itself. A ValueError that names the class if there is none."""
    peft = require_peft()
    module = target.lightning_module if isinstance(target, L.Trainer) else target
    if module is None or not isinstance(module, torch.nn.Module):
        raise ValueError(f"expected a Trainer, a LightningModule or an nn.Module holding a peft.PeftModel; got "
                         f"{type(target).__name__}")
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, peft.PeftModel)]
    outermost = [(name, m) for name, m in found if not any(name.startswith(f"{other}.") for other, _ in found if other)]
    if not outermost:
        raise ValueError(
            f"{type(module).__name__} holds no peft.PeftModel: wrap the model in `configure_model()` with "
            "`peft.get_peft_model(model, LoraConfig(...))` (the Trainer must have built the model: call this after "
            "`fit` has set it up, or use the `PeftAdapterExport` callback)"
        )
    if len(outermost) > 1:
        names = [name or "<root>" for name, _ in outermost]
        raise ValueError(f"{type(module).__name__} holds {len(outermost)} PeftModels ({names}); pass the one to save")
    return outermost[0][1]


# ------------------------------------------------------------------ collectives


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_rank0() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0; its result, or its exception raised on EVERY rank (no rank is left waiting)."""
    outcome: list[Any] = [None]
    if _is_rank0():
        try:
            outcome[0] = (True, fn())
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            outcome[0] = (False, error)
    if _distributed():
        dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _stage_mesh(target: Any) -> Any:
    """`contract.stage_mesh` of the strategy `target` (a Trainer or a LightningModule) runs under."""
    from ultrascale.contract import attached_strategy, stage_mesh

    module = target.lightning_module if isinstance(target, L.Trainer) else target
    return stage_mesh(attached_strategy(module) if isinstance(module, L.LightningModule) else None)


def _gather_full(local: dict[str, torch.Tensor], keys: Iterable[str],
                 stage_mesh: Any = None) -> Optional[dict[str, torch.Tensor]]:
    """Full (un-sharded) CPU copies of `local[key]` on rank 0, None elsewhere. Every rank must call it with the
    same keys in the same order within its stage: a DTensor's `full_tensor()` is a collective over its mesh (FSDP2
    shards, TP). Under pipeline parallel (`stage_mesh`) each stage's keys then travel to rank 0."""
    keep = _is_rank0() or stage_mesh is not None
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        value = local[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[key] = value.detach().to("cpu", copy=True)
    if stage_mesh is not None:
        from ultrascale.parallel.pipeline import gather_stage_states

        return gather_stage_states(out, stage_mesh)
    return out if _is_rank0() else None


def _adapter_keys(peft_model: Any, local: dict[str, torch.Tensor], adapters: Sequence[str],
                  save_embedding_layers: Union[bool, Literal["auto"]]) -> list[str]:
    """The model state_dict keys PEFT saves for `adapters`, asked of PEFT itself (`get_peft_model_state_dict`
    on the local, still sharded state dict: it selects entries, it does not compute them)."""
    from peft import get_peft_model_state_dict

    by_identity = {id(value): key for key, value in local.items()}
    wanted: set[str] = set()
    for adapter in adapters:
        selected = get_peft_model_state_dict(peft_model, state_dict=local, adapter_name=adapter,
                                             save_embedding_layers=save_embedding_layers)
        for value in selected.values():
            key = by_identity.get(id(value))
            if key is None:  # a tensor PEFT built itself: give it the whole model to choose from
                return list(local)
            wanted.add(key)
    return [key for key in local if key in wanted]


def _resolve_adapters(peft_model: Any, adapters: Optional[Sequence[str]], default: Sequence[str]) -> list[str]:
    names = list(default) if adapters is None else list(adapters)
    unknown = [name for name in names if name not in peft_model.peft_config]
    if unknown:
        raise ValueError(f"unknown adapter(s) {unknown}; the model has {sorted(peft_model.peft_config)}")
    return names


def _check_target(out_dir: str | Path, peft_model: Any, overwrite: bool) -> Path:
    from ultrascale.models.hf_folder import check_export_target

    source = _base_model_dir(peft_model)
    return check_export_target(out_dir, source, overwrite)


def _base_model_dir(peft_model: Any) -> Optional[str]:
    """The local folder the base model was loaded from (`from_pretrained`), if it still exists."""
    base = peft_model.get_base_model()
    path = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    return str(path) if path and Path(path).is_dir() else None


def _publish(final: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """`write(tmp)`, then published as `final` (`hf_folder.publish_folder`; replacing `final` only under `overwrite`)."""
    from ultrascale.models.hf_folder import check_export_target, publish_folder

    return publish_folder(check_export_target(final, None, overwrite), write)


def _refuse_unsupported(peft_model: Any, local: dict[str, torch.Tensor]) -> None:
    if any(isinstance(v, DTensor) for v in local.values()) and any(
        getattr(peft_model.peft_config[name], "is_prompt_learning", False) for name in peft_model.peft_config
    ):
        raise not_built("prompt_learning_sharded_save",
                        "prompt-learning adapters (prompt/prefix/p-tuning) read their weights from the model, not from "
                        "a state dict: saving them from sharded (DTensor) parameters is not supported; use ZeRO-1/2")


# ------------------------------------------------------------------ public API


def save_peft_adapter(
    target: Any,
    out_dir: str | Path,
    *,
    adapters: Optional[Sequence[str]] = None,
    overwrite: bool = False,
    save_embedding_layers: Union[bool, Literal["auto"]] = "auto",
) -> Path:
    """Write the PEFT adapter of `target` to `out_dir` exactly as `PeftModel.save_pretrained` does, from any
    layout. A COLLECTIVE: under a process group every rank must call it.

    Args:
        target: a Trainer, a LightningModule or nn.Module holding a `peft.PeftModel`, or the PeftModel.
        out_dir: the adapter folder (`adapter_config.json`, `adapter_model.safetensors`, PEFT's README);
            adapters other than "default" go to `out_dir/<name>/`, as with `save_pretrained`. Reload with
            `PeftModel.from_pretrained(base_model, out_dir)`.
        adapters: which adapters to save; None: all of them (`save_pretrained`'s `selected_adapters`).
        overwrite: replace a non-empty `out_dir` (once the new folder is complete); refused otherwise.
        save_embedding_layers: passed to PEFT (`"auto"`: embeddings too when targeted or resized).

    Returns the folder (on every rank). Errors are raised on every rank.
    """
    peft_model = find_peft_model(target)
    names = _resolve_adapters(peft_model, adapters, list(peft_model.peft_config))
    final = _on_rank0(lambda: _check_target(out_dir, peft_model, overwrite))  # before any gather
    local = peft_model.state_dict()  # this rank's view: DTensor shards under FSDP2 / TP
    _refuse_unsupported(peft_model, local)
    stage_mesh = _stage_mesh(target)
    state = _gather_full(local, _adapter_keys(peft_model, local, names, save_embedding_layers), stage_mesh)

    def write(folder: Path) -> None:
        # PEFT selects, renames and writes: its own format, from the full tensors gathered above. It selects among
        # the modules the model holds, so under pipeline parallel it is asked on a whole (meta) copy of the model.
        writer = _meta_copy(peft_model) if stage_mesh is not None else peft_model
        writer.save_pretrained(str(folder), state_dict=state, selected_adapters=names, safe_serialization=True,
                               save_embedding_layers=save_embedding_layers, is_main_process=True)

    return _on_rank0(lambda: _publish(final, overwrite, write))


def export_merged_hf(
    target: Any,
    out_dir: str | Path,
    *,
    adapters: Optional[Sequence[str]] = None,
    overwrite: bool = False,
    max_shard_size: str = "2GB",
) -> Path:
    """Write a plain Hugging Face folder of the base model with the adapter merged in (PEFT's
    `merge_and_unload`), from any layout. A COLLECTIVE: under a process group every rank must call it.

    The full model is gathered to rank 0's CPU memory; there a CPU copy of the PEFT model is built on the meta
    device, given the gathered weights, merged by PEFT and written as sharded safetensors with the config, the
    generation config and the tokenizer files of the base model's folder (`ultrascale.models.hf_folder.write_hf_folder`).
    The trained model itself is left as it was. Loads with `AutoModelForCausalLM.from_pretrained(out_dir)`.

    Args:
        target: a Trainer, a LightningModule or nn.Module holding a `peft.PeftModel`, or the PeftModel.
        out_dir: the folder to write: not the base model's folder, and empty unless `overwrite`.
        adapters: the adapters to merge; None: the active ones.
        overwrite: replace a non-empty `out_dir` (once the new folder is complete).
        max_shard_size: size of each safetensors shard.
    """
    peft_model = find_peft_model(target)
    names = _resolve_adapters(peft_model, adapters, list(peft_model.active_adapters))
    base = peft_model.get_base_model()
    if getattr(base, "config", None) is None or not hasattr(type(base), "_from_config"):
        raise ValueError(f"export_merged_hf needs a Hugging Face base model; {type(base).__name__} is not one "
                         "(save the adapter with `save_peft_adapter` instead)")
    final = _on_rank0(lambda: _check_target(out_dir, peft_model, overwrite))
    local = peft_model.state_dict()
    state = _gather_full(local, list(local), _stage_mesh(target))

    def merge_and_write() -> Path:
        from ultrascale.models.hf_folder import write_hf_folder

        merged = _merged_state_dict(peft_model, state, names)  # type: ignore[arg-type]
        return write_hf_folder(merged, base.config, _base_model_dir(peft_model), final, max_shard_size, overwrite)

    return _on_rank0(merge_and_write)


def _original_class(module: torch.nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps in a subclass `FSDP<Class>`."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def _meta_copy(peft_model: Any) -> Any:
    """The PEFT model rebuilt whole on the meta device from the base model's config, with every adapter: the trained
    model's structure and keys, also where this rank's model holds only its pipeline stages (the others are gaps)."""
    from peft import get_peft_model

    base = peft_model.get_base_model()
    configs = {name: copy.deepcopy(config) for name, config in peft_model.peft_config.items()}
    for config in configs.values():
        if hasattr(config, "init_lora_weights"):  # the weights are assigned afterwards: skip PiSSA/LoftQ-style init
            config.init_lora_weights = True
        config.inference_mode = False
    with torch.device("meta"):
        fresh = _original_class(base)._from_config(copy.deepcopy(base.config))
        first, *rest = configs
        copy_model = get_peft_model(fresh, configs[first], adapter_name=first)
        for name in rest:
            copy_model.add_adapter(name, configs[name])
    return copy_model


@torch.no_grad()
def _merged_state_dict(peft_model: Any, state: dict[str, torch.Tensor],
                       adapters: Sequence[str]) -> dict[str, torch.Tensor]:
    """HF-named weights of the base model with `adapters` merged, computed by PEFT on a CPU copy."""
    copy_model = _meta_copy(peft_model)  # every adapter, so the keys match; only `adapters` are merged
    expected = copy_model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"the gathered state lacks {len(missing)} tensor(s) of the PEFT model, e.g. {missing[:5]}")
    copy_model.load_state_dict({key: state[key] for key in expected}, strict=True, assign=True)
    merged = copy_model.merge_and_unload(adapter_names=list(adapters))
    return {key: value for key, value in merged.state_dict().items()}


class PeftAdapterExport(Callback):
    """Save the PEFT adapter (and optionally a merged Hugging Face folder) when `fit` ends, from any layout.

    Example::

        trainer = L.Trainer(strategy=ultrascale.ZeRO3Strategy(),
                            callbacks=[PeftAdapterExport("adapter", merged_dir="merged")])

    The targets are checked when fit starts (empty unless `overwrite`, not the base model's folder), not after
    the training they would have saved. Every rank runs the callback, as the gathers need (see `save_peft_adapter`).
    """

    def __init__(self, adapter_dir: Optional[str | Path], merged_dir: Optional[str | Path] = None, *,
                 overwrite: bool = False, adapters: Optional[Sequence[str]] = None,
                 max_shard_size: str = "2GB") -> None:
        """
        Args:
            adapter_dir: folder for the adapter (`save_peft_adapter`); None: no adapter folder.
            merged_dir: folder for the merged Hugging Face model (`export_merged_hf`); None: none.
            overwrite: replace non-empty folders (once the new ones are complete).
            adapters: adapters to save / merge; None: all (adapter folder) and the active ones (merged folder).
            max_shard_size: safetensors shard size of the merged folder.
        """
        if adapter_dir is None and merged_dir is None:
            raise ValueError("PeftAdapterExport: give `adapter_dir`, `merged_dir` or both")
        both = adapter_dir is not None and merged_dir is not None
        if both and Path(adapter_dir).resolve() == Path(merged_dir).resolve():  # type: ignore[arg-type]
            raise ValueError(f"PeftAdapterExport: `adapter_dir` and `merged_dir` are the same folder ({adapter_dir})")
        self.adapter_dir, self.merged_dir = adapter_dir, merged_dir
        self.overwrite, self.adapters, self.max_shard_size = overwrite, adapters, max_shard_size

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peft_model = find_peft_model(pl_module)
        for folder in (self.adapter_dir, self.merged_dir):
            if folder is not None:
                _on_rank0(lambda folder=folder: _check_target(folder, peft_model, self.overwrite))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.adapter_dir is not None:
            save_peft_adapter(pl_module, self.adapter_dir, adapters=self.adapters, overwrite=self.overwrite)
        if self.merged_dir is not None:
            export_merged_hf(pl_module, self.merged_dir, adapters=self.adapters, overwrite=self.overwrite,
                             max_shard_size=self.max_shard_size)
