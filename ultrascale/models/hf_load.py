"""Reading a Hugging Face safetensors folder into a (possibly sharded) model, each rank only its slices.

Checkpoint keys are mapped to the model's by transformers' own conversion mapping, as `from_pretrained` maps
them (renamings; experts stored one tensor each stacked into the fused expert tensors, one expert at a time);
a conversion this loader cannot reproduce is refused, naming it (`check_sharded_loading_supported`).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from ultrascale.parallel.rules import not_built

WEIGHT_SUFFIX = ".safetensors"


def text_model_config(config: Any) -> Any:
    """The config of the model a causal-LM fine-tune trains for a checkpoint's `config`: a multimodal checkpoint's text
    model (Gemma 3, Qwen 3.5, Llama 4: the language model beside a vision tower), built, sharded, trained and loaded
    alone, its head tied as the whole model's config says; an export writes the other parts back as they were
    (`multimodal_source`). The config itself otherwise."""
    text = getattr(config, "text_config", None)
    from transformers import AutoModelForCausalLM

    if text is None or type(text) not in AutoModelForCausalLM._model_mapping:
        return config
    text = copy.deepcopy(text)  # the whole model ties its head to the embedding as its own config says
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    text._name_or_path = config._name_or_path  # where its model came from: a merged LoRA export writes back there
    return text


def composite_names(text_model: torch.nn.Module, composite: torch.nn.Module) -> Any:
    """A text model's parameter name -> the same tensor's name in the multimodal model it was taken from: the
    composite's submodule of the text model's class (Llama 4: `language_model.`), or else of its decoder's (Gemma 3:
    `model.` -> `model.language_model.`), with the head at the composite's output embeddings."""
    paths = {id(module): name for name, module in composite.named_modules()}

    def inside(kind: type) -> list[str]:
        return [name for name, module in composite.named_modules() if type(module) is kind and name]

    if len(inside(type(text_model))) == 1:
        renames = [("", inside(type(text_model))[0] + ".")]
    else:
        decoder = text_model.get_decoder()
        found = inside(type(decoder))
        if len(found) != 1:
            raise ValueError(f"{type(composite).__name__} holds {len(found)} modules of the text model's decoder class "
                             f"{type(decoder).__name__}; expected one")
        decoder_name = next(name for name, module in text_model.named_modules() if module is decoder)
        renames = [(decoder_name + ".", found[0] + ".")]
        head, composite_head = text_model.get_output_embeddings(), composite.get_output_embeddings()
        if head is not None and composite_head is not None:
            head_name = next(name for name, module in text_model.named_modules() if module is head)
            renames.append((head_name + ".", paths[id(composite_head)] + "."))

    def rename(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old):]
        raise ValueError(f"{name} is neither in {type(text_model).__name__}'s base model nor its head")

    return rename


def check_hf_folder(path: str | Path) -> Path:
    """A Hugging Face checkpoint folder with config.json and safetensors weights, or a clear error."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint folder not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    if not list(path.glob(f"*{WEIGHT_SUFFIX}")):
        found = sorted(p.name for p in path.iterdir())
        hint = " (.bin weights are not supported: convert them with `save_pretrained(safe_serialization=True)`)" if any(
            n.endswith(".bin") for n in found
        ) else ""
        raise FileNotFoundError(f"{path} has no *.safetensors weights{hint}; files: {found}")
    safetensors_keys(path)  # reads each file's header only: a truncated or corrupt file is named now
    return path


def safetensors_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in sorted(path.glob(f"*{WEIGHT_SUFFIX}")):
        try:
            with safe_open(str(file), framework="pt") as f:
                keys.update(f.keys())
        except Exception as error:  # safetensors' own error names no file
            raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt?): {error}") from error
    return keys


def local_and_indices(tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's part of `tensor` and, per dim, the global indices it holds (in order)."""
    if not isinstance(tensor, DTensor):
        return tensor, [torch.arange(n) for n in tensor.shape]
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ultrascale.parallel.checkpoint import box_placements

    placements = list(tensor.placements)
    # A packed [gate; up] split over tp holds several blocks of its dim; every other layout here holds one
    # contiguous block per dim, whose offset torch computes (expert weights under expert parallel are FSDP
    # shards of ep shards, both on the expert dim).
    packed = {i: p for i, (p, boxed) in enumerate(zip(placements, box_placements(tuple(placements)))) if p != boxed}
    for i in packed:
        placements[i] = Replicate()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    indices = [torch.arange(start, start + size) for start, size in zip(offset, shape)]
    for i, placement in packed.items():
        ranks, rank = tensor.device_mesh.size(i), tensor.device_mesh.get_local_rank(i)
        blocks = indices[placement.dim].chunk(placement.split_factor)  # e.g. [gate rows, up rows]
        indices[placement.dim] = torch.cat([block.chunk(ranks)[rank] for block in blocks])
    return tensor.to_local(), indices


def _conversions(model_type: Optional[str]) -> tuple[list[Any], list[Any]]:
    """The renamings and converters `from_pretrained` applies to a `model_type` checkpoint's keys (transformers'
    own mapping for the architecture, then its legacy renamings), as fresh objects: ([], []) where there are none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # transformers 4: checkpoints load as stored, no conversion
        return [], []
    mapping = list(get_checkpoint_conversion_mapping(model_type) or []) if model_type else []
    if not mapping:
        return [], []
    mapping += get_checkpoint_conversion_mapping("legacy") or []
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    return [entry for entry in mapping if not isinstance(entry, WeightConverter)], converters


def _model_conversions(model: torch.nn.Module, model_type: Optional[str]) -> tuple[list[Any], list[Any]]:
    """`_conversions` as `from_pretrained` collects them for a built model: each transformers sub-model's own mapping,
    scoped to its place (a multimodal model's language model brings its expert stacking: Qwen 3.5-MoE's whole-model
    type has no mapping of its own)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # transformers without per-model collection: the type's own mapping
        return _conversions(model_type)
    mapping = list(get_model_conversion_mapping(model))
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    return [entry for entry in mapping if not isinstance(entry, WeightConverter)], converters


def _stacking(converter: Any, model_type: Optional[str]) -> Optional[int]:
    """How the sharded loader rebuilds a converter's target one expert at a time: the dim (of the stacked tensor)
    its per-expert sources are concatenated along, None for a single source stacked alone. Refuses, naming the
    architecture, the target and the operation, any conversion it cannot read that way."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    target = converter.target_patterns[0] if len(converter.target_patterns) == 1 else converter.target_patterns

    def refuse(what: str) -> NotImplementedError:
        return not_built(
            "hf_conversion_not_per_expert",
            f"model_type {model_type!r}: transformers converts this architecture's checkpoint while loading, and "
            f"ultrascale's sharded loader cannot rebuild {target!r} from {converter.source_patterns}: {what}. It reads "
            "per-expert weights stacked by MergeModulelist(dim=0), then optionally concatenated by Concatenate(dim>=1). "
            "Under Lightning's own strategies HFCausalLM loads it with `from_pretrained`."
        )

    operations = list(converter.operations)
    if len(converter.target_patterns) != 1:
        raise refuse(f"operation(s) {operations} split one checkpoint tensor into {len(converter.target_patterns)}")
    first = operations[0] if operations else None
    if not (isinstance(first, MergeModulelist) and first.dim == 0):
        if isinstance(first, Concatenate):
            raise refuse(f"operation {first!r} over sources not stacked per expert by MergeModulelist(dim=0) first")
        raise refuse(f"operation {first!r} is not supported")
    for source in converter.source_patterns:
        if "*" not in source:  # the `*` is the expert index; without it there is nothing to stack
            raise refuse(f"operation {operations[0]!r} over the source pattern {source!r}, which has no expert index `*`")
    rest = operations[1:]
    if not rest:
        if len(converter.source_patterns) > 1:
            raise refuse(f"operation {operations[0]!r} alone over {len(converter.source_patterns)} sources")
        return None
    for op in rest:
        if not isinstance(op, Concatenate) or op.dim < 1:
            raise refuse(f"operation {op!r} is not supported")
    if len(rest) > 1:
        raise refuse(f"operations {rest} after {operations[0]!r}: one Concatenate at most")
    return int(rest[0].dim)


def _splits(converter: Any) -> bool:
    """One checkpoint tensor cut along dim 0 into the converter's targets, in their order: `Chunk(dim=0)` in equal
    parts (HRM's [gate; up]) or `Split(dim=0)` at the targets' sizes (Sarvam-MoE's [q; k; v])."""
    from transformers.core_model_loading import Chunk

    try:
        from transformers.core_model_loading import Split
    except ImportError:  # an older transformers: Chunk alone
        Split = None
    operations = list(converter.operations)
    if len(converter.target_patterns) < 2 or len(converter.source_patterns) != 1 or len(operations) != 1:
        return False
    op = operations[0]
    cut = (isinstance(op, Chunk) and op.num_shards_attribute is None) or (Split is not None and isinstance(op, Split))
    return cut and op.dim == 0 and "*" not in converter.source_patterns[0]


def check_sharded_loading_supported(config: Any) -> None:
    """Sharded loading reads each rank's slices by name. An architecture whose checkpoint transformers converts while
    loading (`transformers.conversion_mapping`) is read through the same mapping: renamed keys by their names on
    disk, fused experts one expert at a time, a fused tensor cut into its parts by rows; a conversion the loader
    cannot reproduce is refused, naming it."""
    model_type = getattr(config, "model_type", None)
    for converter in _conversions(model_type)[1]:
        if not _splits(converter):
            _stacking(converter, model_type)


class _Stacked:
    """A model tensor that transformers builds from per-expert checkpoint tensors: `sources[p][e]` is the disk key
    of expert `e` for source pattern `p`, in the converter's pattern order; the experts are stacked on dim 0 and
    the sources concatenated along `concat_dim` (None: a single source)."""

    def __init__(self, converter: Any, concat_dim: Optional[int]) -> None:
        self.converter = converter
        self.concat_dim = concat_dim
        self.keys: dict[str, list[str]] = {}

    def sources(self, name: str, experts: int) -> list[list[str]]:
        found = []
        for pattern in self.converter.source_patterns:
            keys = self.keys.get(pattern, [])
            if len(keys) != experts:
                raise ValueError(
                    f"{name} stacks {experts} experts, but the checkpoint holds {len(keys)} tensor(s) for its source "
                    f"pattern {pattern!r} (e.g. {keys[:3]})"
                )
            found.append(keys)
        return found

    @torch.no_grad()
    def fill(self, name: str, tensor: torch.Tensor, get: Any) -> None:
        """Write this rank's part of `tensor`, reading one expert at a time."""
        local, (experts_held, *within) = local_and_indices(tensor)
        sources = self.sources(name, tensor.shape[0])
        for i, e in enumerate(experts_held.tolist()):
            parts = [get(keys[e]) for keys in sources]
            full = parts[0] if self.concat_dim is None else torch.cat(parts, dim=self.concat_dim - 1)
            for dim, held in enumerate(within):
                if held.numel() != full.shape[dim] or not torch.equal(held, torch.arange(full.shape[dim])):
                    full = full.index_select(dim, held)
            local[i].copy_(full)


class _Part:
    """A model tensor transformers cuts out of one checkpoint tensor along dim 0 (`_splits`): rows `offset` ..
    `offset + rows` of `disk_key`, the offset being the sizes of the targets before it."""

    def __init__(self, disk_key: str, index: int, targets: list[str]) -> None:
        self.disk_key, self.index, self.targets = disk_key, index, targets

    def sources(self, name: str, experts: int) -> list[list[str]]:
        return [[self.disk_key]]

    @torch.no_grad()
    def fill(self, name: str, tensor: torch.Tensor, read: Any, shapes: dict[str, torch.Size]) -> None:
        """Write this rank's part of `tensor`, reading only the rows it holds."""
        offset = sum(shapes[target][0] for target in self.targets[: self.index])
        total = sum(shapes[target][0] for target in self.targets)
        if read.rows(self.disk_key) != total:
            raise ValueError(f"{name}: the checkpoint's {self.disk_key} has {read.rows(self.disk_key)} rows, the model's "
                             f"parts of it {total} ({self.targets})")
        local, (rows, *within) = local_and_indices(tensor)
        if rows.numel() == 0:
            return
        first, last = int(rows.min()), int(rows.max()) + 1
        part = read.slice(self.disk_key, offset + first, offset + last).index_select(0, rows - first)
        for dim, held in enumerate(within, start=1):
            if held.numel() != part.shape[dim] or not torch.equal(held, torch.arange(part.shape[dim])):
                part = part.index_select(dim, held)
        local.copy_(part)


def _disk_layout(model: torch.nn.Module, config: Any, available: set[str], names: set[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Where each model tensor (named as in `names`) is on disk, found as `from_pretrained` finds it: every checkpoint
    key is renamed by transformers' own mapping (renamings, then at most one converter) into a model key. Returns
    {model key: disk key} for the tensors read as stored, and {model key: _Stacked or _Part} for those a converter
    builds."""
    model_type = getattr(config, "model_type", None)
    renamings, converters = _model_conversions(model, model_type)
    direct: dict[str, str] = {}
    stacked: dict[str, Any] = {}
    try:
        from transformers.core_model_loading import dot_natural_key, rename_source_key
    except ImportError:  # transformers 4: checkpoints load as stored
        return {key: key for key in available if key in names}, stacked
    # Without a mapping the base-model prefix is still added or stripped (Llama 4's text model from the composite
    # checkpoint, its keys under `language_model.`).

    splitting = {id(converter) for converter in converters if _splits(converter)}
    plans = {id(converter): _stacking(converter, model_type) for converter in converters if id(converter) not in splitting}
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    meta = dict.fromkeys(names, True)
    for disk_key in sorted(available, key=dot_natural_key):  # transformers stacks experts in this order
        name, pattern = rename_source_key(disk_key, renamings, converters, prefix, meta)
        if name not in meta and disk_key in meta:
            name, pattern = disk_key, None
        if name not in meta:
            continue  # not a weight of this model (transformers reports it as unexpected)
        if pattern is None:
            direct.setdefault(name, disk_key)
        elif id(by_pattern[pattern]) in splitting:
            # transformers names the first target; the others are the same key with their own pattern
            converter = by_pattern[pattern]
            first = converter.target_patterns[0]
            targets = [name.replace(first, target) for target in converter.target_patterns]
            for index, target in enumerate(targets):
                stacked[target] = _Part(disk_key, index, targets)  # type: ignore[assignment]
        else:
            converter = by_pattern[pattern]
            entry = stacked.setdefault(name, _Stacked(converter, plans[id(converter)]))
            entry.keys.setdefault(pattern, []).append(disk_key)
    return direct, stacked


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Fill `model`'s (possibly sharded DTensor) parameters from the safetensors of `path`.

    Each rank reads only the slices its shards cover. Checkpoint keys are mapped to the model's by transformers' own
    conversion mapping, as `from_pretrained` does (e.g. Mixtral's `block_sparse_moe` -> `mlp`); experts stored one
    tensor each are stacked into the model's fused expert tensors one expert at a time. Works with or without a
    process group.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = check_hf_folder(path)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # A PEFT-wrapped model (the transformers model inside a PeftModel): a wrapped layer keeps its weights under
    # `<layer>.base_layer.`, and the adapters (`.lora_A.` ...) are not in the checkpoint (initialised instead).
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    checkpoint_name = {key: key.replace(".base_layer.", ".") for key in state}
    layout_model, layout_config = model, config
    on_disk = _multimodal_layout(model, path)
    if on_disk is not None:  # the text model of a multimodal checkpoint: its keys are found as the whole model's
        rename, layout_model, layout_config = on_disk
        checkpoint_name = {key: rename(name) for key, name in checkpoint_name.items()}
    if layout_config is not None:
        check_sharded_loading_supported(layout_config)
    available = safetensors_keys(path)
    direct, stacked = _disk_layout(layout_model, layout_config, available, set(checkpoint_name.values()))

    wanted = {direct[checkpoint_name[key]]: value for key, value in state.items() if checkpoint_name[key] in direct}
    fused = {key: value for key, value in state.items() if checkpoint_name[key] in stacked}
    missing = sorted(
        key for key in state
        if checkpoint_name[key] not in direct and key not in fused and not (tied and key.endswith("lm_head.weight"))
    )
    if missing:
        raise ValueError(f"{path} lacks weights for {len(missing)} parameter(s) of the model, e.g. {missing[:5]}")
    for key, value in fused.items():  # every expert's source there, before anything is read
        stacked[checkpoint_name[key]].sources(key, value.shape[0])
    from ultrascale.parallel.checkpoint import dcp_storable

    with dcp_storable(wanted, read_back=True):  # a packed [gate; up] tp split is not one box: DCP reads a plain one
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    if fused:
        with contextlib.ExitStack() as files:
            handles = [files.enter_context(safe_open(str(file), framework="pt"))
                       for file in sorted(path.glob(f"*{WEIGHT_SUFFIX}"))]
            holder = {k: handle for handle in handles for k in handle.keys()}  # each file's header parsed once

            def get(key: str) -> torch.Tensor:
                return holder[key].get_tensor(key)

            read = _Rows(holder)
            shapes = {checkpoint_name[key]: value.shape for key, value in state.items()}
            for key, value in fused.items():
                entry = stacked[checkpoint_name[key]]
                if isinstance(entry, _Part):
                    entry.fill(key, value, read, shapes)
                else:
                    entry.fill(key, value, get)
    if not any(isinstance(v, DTensor) for v in wanted.values()):
        # Plain tensors: DCP may load into copies; make sure the module holds the values.
        model.load_state_dict({k: v for k, v in state.items() if k not in fused}, strict=False)


def multimodal_source(model_config: Any, path: str | Path) -> Optional[tuple[Any, type]]:
    """(the folder's config, the class of its whole model) where the checkpoint at `path` is multimodal and
    `model_config` its text model's: Gemma 3's (whose causal-LM class is the whole model), Qwen 3.5's and Llama 4's
    (whose causal-LM class is the text model, the whole one their image-text-to-text class). None otherwise."""
    import json

    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

    config_file = Path(path) / "config.json"  # (a LlamaLM export's source is a tokenizer folder)
    try:  # a type transformers knows (a remote-code model's config is not read here)
        config_class = CONFIG_MAPPING[json.loads(config_file.read_text()).get("model_type")] if config_file.is_file() else None
    except KeyError:
        return None
    if config_class is None:
        return None
    folder_config = config_class.from_pretrained(str(path), local_files_only=True)
    text = getattr(folder_config, "text_config", None)
    if text is None or type(model_config) is not type(text):
        return None
    causal, whole = AutoModelForCausalLM._model_mapping, AutoModelForImageTextToText._model_mapping
    if type(folder_config) in causal and causal[type(folder_config)] is not causal.get(type(text), None):
        return folder_config, causal[type(folder_config)]
    return (folder_config, whole[type(folder_config)]) if type(folder_config) in whole else None


def _multimodal_layout(model: torch.nn.Module, path: Path) -> Optional[tuple[Any, torch.nn.Module, Any]]:
    """(name map, the whole model on the meta device, its config) where `model` is the text model of the multimodal
    checkpoint at `path`; None otherwise."""
    source = multimodal_source(getattr(model, "config", None), path)
    if source is None:
        return None
    folder_config, whole_class = source
    with torch.device("meta"):
        composite = whole_class._from_config(folder_config)
    return composite_names(model, composite), composite, folder_config


class _Rows:
    """Row ranges of checkpoint tensors, read from the open safetensors files without the rest of the tensor."""

    def __init__(self, holder: dict[str, Any]) -> None:
        self.holder = holder

    def rows(self, key: str) -> int:
        return int(self.holder[key].get_slice(key).get_shape()[0])

    def slice(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.holder[key].get_slice(key)[start:stop]
