"""Fine-tuning Hugging Face causal LMs: safetensors in, safetensors out, under any layout.

Load: the model is built on the meta device, the strategy parallelises it (TP plan from
the model's adapter, FSDP/ZeRO), and only then is each rank's part of every weight read
from the safetensors shards (`torch.distributed.checkpoint.HuggingFaceStorageReader`
slices the files), so no rank ever holds the full model. Save: training checkpoints are
ultrascale's sharded DCP directories; `export_hf_checkpoint` turns one (from any layout)
into a Hugging Face folder (sharded safetensors + config + generation config + tokenizer).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Dict, Literal, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from ultrascale.models.lm import CausalLMModule, attached_strategy
from ultrascale.strategies.contract import stage_mesh

WEIGHT_SUFFIX = ".safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


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


def check_export_target(out_dir: str | Path, source_dir: Optional[str | Path], overwrite: bool = False) -> Path:
    """The folder an export may write, or a clear error before anything is touched: never the model's
    source folder (its weights would be replaced by the files being written), and not a non-empty
    folder unless `overwrite`."""
    out = Path(out_dir).resolve()
    if source_dir is not None and out == Path(source_dir).resolve():
        raise ValueError(
            f"refusing to export into {out}: it is the model's source folder (pretrained_path); its weights would be "
            "replaced. Choose another output folder."
        )
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export target {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        found = sorted(p.name for p in out.iterdir())
        raise FileExistsError(
            f"export target {out} is not empty ({found[:5]}{' ...' if len(found) > 5 else ''}); choose an empty or "
            "new folder, or pass overwrite (`ultrascale export-hf --overwrite`, `HFCausalLM(export_overwrite=True)`)"
        )
    return out


def _local_and_indices(tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
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


def _stacking(converter: Any, model_type: Optional[str]) -> Optional[int]:
    """How the sharded loader rebuilds a converter's target one expert at a time: the dim (of the stacked tensor)
    its per-expert sources are concatenated along, None for a single source stacked alone. Refuses, naming the
    architecture, the target and the operation, any conversion it cannot read that way."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    target = converter.target_patterns[0] if len(converter.target_patterns) == 1 else converter.target_patterns

    def refuse(what: str) -> NotImplementedError:
        return NotImplementedError(
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


def check_sharded_loading_supported(config: Any) -> None:
    """Sharded loading reads each rank's slices by name. An architecture whose checkpoint transformers converts while
    loading (`transformers.conversion_mapping`) is read through the same mapping: renamed keys by their names on
    disk, fused experts one expert at a time; a conversion the loader cannot reproduce is refused, naming it."""
    model_type = getattr(config, "model_type", None)
    for converter in _conversions(model_type)[1]:
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
        local, (experts_held, *within) = _local_and_indices(tensor)
        sources = self.sources(name, tensor.shape[0])
        for i, e in enumerate(experts_held.tolist()):
            parts = [get(keys[e]) for keys in sources]
            full = parts[0] if self.concat_dim is None else torch.cat(parts, dim=self.concat_dim - 1)
            for dim, held in enumerate(within):
                if held.numel() != full.shape[dim] or not torch.equal(held, torch.arange(full.shape[dim])):
                    full = full.index_select(dim, held)
            local[i].copy_(full)


def _disk_layout(model: torch.nn.Module, config: Any, available: set[str], names: set[str]) -> tuple[dict[str, str], dict[str, _Stacked]]:
    """Where each model tensor (named as in `names`) is on disk, found as `from_pretrained` finds it: every checkpoint
    key is renamed by transformers' own mapping (renamings, then at most one converter) into a model key. Returns
    {model key: disk key} for the tensors read as stored, and {model key: _Stacked} for those a converter builds."""
    model_type = getattr(config, "model_type", None)
    renamings, converters = _conversions(model_type)
    direct: dict[str, str] = {}
    stacked: dict[str, _Stacked] = {}
    if not renamings and not converters:
        return {key: key for key in available if key in names}, stacked
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    plans = {id(converter): _stacking(converter, model_type) for converter in converters}
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
    if config is not None:
        check_sharded_loading_supported(config)
    available = safetensors_keys(path)
    # A PEFT-wrapped model (the transformers model inside a PeftModel): a wrapped layer keeps its weights under
    # `<layer>.base_layer.`, and the adapters (`.lora_A.` ...) are not in the checkpoint (initialised instead).
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    checkpoint_name = {key: key.replace(".base_layer.", ".") for key in state}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    direct, stacked = _disk_layout(model, config, available, set(checkpoint_name.values()))

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
        handles = [safe_open(str(file), framework="pt") for file in sorted(path.glob(f"*{WEIGHT_SUFFIX}"))]
        holder = {k: handle for handle in handles for k in handle.keys()}  # each file's header parsed once

        def get(key: str) -> torch.Tensor:
            return holder[key].get_tensor(key)

        for key, value in fused.items():
            stacked[checkpoint_name[key]].fill(key, value, get)
    if not any(isinstance(v, DTensor) for v in wanted.values()):
        # Plain tensors: DCP may load into copies; make sure the module holds the values.
        model.load_state_dict({k: v for k, v in state.items() if k not in fused}, strict=False)


@torch.no_grad()
def recompute_nonpersistent_buffers(model: torch.nn.Module) -> None:
    """Rebuild buffers that are not in the checkpoint (RoPE `inv_freq`): after a meta-device
    build and `to_empty` they hold garbage. Each owning module is re-created from its config."""
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if names and not hasattr(module, "config") and hasattr(module, "scalar_embed_scale"):
            # Gemma's scaled embedding (no config): its `embed_scale` buffer is sqrt(hidden) kept as a float too.
            module.embed_scale.fill_(module.scalar_embed_scale)
            continue
        if not names or not hasattr(module, "config"):
            continue
        device = next(iter(module.buffers())).device
        with torch.device(device):
            fresh = type(module)(config=module.config)
        for name in names:
            getattr(module, name).copy_(getattr(fresh, name))


def _supported_attention(config: Any) -> set[str]:
    """The attention kernels the config's `*ForCausalLM` class declares (eager always)."""
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:  # remote code or an unregistered config: transformers decides
        return {"eager", "sdpa", "flash_attention_2"}
    flags = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}
    return {"eager", *(name for name, flag in flags.items() if getattr(model_class, flag, False))}


class HFCausalLM(CausalLMModule):
    """Fine-tune a local Hugging Face `AutoModelForCausalLM` checkpoint folder.

    Under ultrascale strategies the model is built on the meta device and each rank loads
    only its shards of the weights after parallelisation; under Lightning's own strategies
    it is loaded with `from_pretrained`. Batches are `{"input_ids", "labels"}` with labels
    already shifted and -100 ignored (`ultrascale.data` data modules).
    """

    def __init__(
        self,
        pretrained_path: str,
        dtype: Literal["float32", "bfloat16"] = "float32",
        learning_rate: float = 2e-5,
        weight_decay: float = 0.0,
        betas: Tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        attn_implementation: Optional[str] = None,
        export_dir: Optional[str] = None,
        export_overwrite: bool = False,
        trust_remote_code: bool = False,
        router_aux_loss_coef: Optional[float] = None,
        router_z_loss_coef: float = 0.0,
        lora: Optional[Dict[str, Any]] = None,
        lora_dir: Optional[str] = None,
        lora_seed: int = 0,
    ) -> None:
        """
        Args:
            pretrained_path: local Hugging Face checkpoint folder (config.json + *.safetensors).
            dtype: dtype the weights are held in; precision="bf16-mixed" still computes in bf16.
            learning_rate: peak AdamW learning rate.
            weight_decay: AdamW decoupled weight decay for matrices (norms and biases get none).
            betas: AdamW betas.
            eps: AdamW eps.
            warmup_steps: linear warm-up steps.
            max_steps: end of the cosine decay; None uses the trainer's estimated_stepping_batches.
            min_lr_ratio: final learning rate as a fraction of `learning_rate`.
            attn_implementation: Hugging Face attention kernel ("sdpa", "eager", "flash_attention_2"). None:
                "flash_attention_2" on a CUDA device (Ampere+) with flash-attn installed and 16-bit compute,
                "sdpa" elsewhere (`ultrascale.parallel.device.attention_backend`, the built-in Llama's choice too).
            export_dir: if set, the trained model is written there as a Hugging Face folder when fit ends.
                Checked when the module is built: not the source folder, and empty unless `export_overwrite`.
            export_overwrite: replace a non-empty `export_dir` (once the new folder is complete).
            trust_remote_code: let transformers import and run Python files shipped in the checkpoint
                folder (architectures transformers does not know). Off: the folder is read as data.
                Turn it on only for a folder whose code you trust.
            router_aux_loss_coef: MoE models: weight of ultrascale's balance loss (sequence-wise, exact under
                any layout: `ultrascale.parallel.expert`). None: the config's `router_aux_loss_coef` if its
                `output_router_logits` is on (transformers adds its own aux loss only then), else 0.
            router_z_loss_coef: MoE models: weight of the router z-loss; 0 = off.
            lora: LoRA fine-tuning: the fields of `peft.LoraConfig` (e.g. `{"r": 16, "lora_alpha": 32,
                "target_modules": ["q_proj", "v_proj"]}`). The base weights are frozen and only the adapters train.
                Under ultrascale strategies the base model is built on the meta device and each rank loads only
                its shards (as without LoRA). `export_dir` then receives the merged model.
            lora_dir: with `lora`, the trained adapter is written there (PEFT's format) when fit ends.
            lora_seed: seed of the adapters' initial weights (A: Kaiming-uniform as PEFT draws it, from a
                generator seeded by `lora_seed` and the parameter's name, so any layout starts equal; B: zeros).
        """
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoConfig

        if dtype not in DTYPES:
            raise ValueError(f"HFCausalLM: `dtype={dtype!r}`; choose one of {sorted(DTYPES)}")
        self.pretrained_path = str(check_hf_folder(pretrained_path))
        if export_dir is not None:  # refused now, not after the training it would have exported
            check_export_target(export_dir, self.pretrained_path, export_overwrite)
        if lora is not None:
            lora_config(lora)  # a wrong field or an unsupported init is refused now, with peft's message
            if lora_dir is not None:
                check_export_target(lora_dir, self.pretrained_path, export_overwrite)
        elif lora_dir is not None:
            raise ValueError("HFCausalLM: `lora_dir` is where the trained LoRA adapter goes; set `lora` too")
        self.config = AutoConfig.from_pretrained(
            self.pretrained_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.model: Optional[torch.nn.Module] = None

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer lives (data modules may default to it)."""
        return self.pretrained_path

    @property
    def prefers_meta_init(self) -> bool:
        """Ask ultrascale strategies to build the model on the meta device (weights are loaded after sharding).

        Tied input/output embeddings would be untied by materialising after sharding, so
        those models are built for real (then sharded, then loaded)."""
        return not bool(getattr(self.config, "tie_word_embeddings", False))

    def attention_implementation(self) -> str:
        """The `attn_implementation` the model is built with: the one given, or the device's choice
        (`hf_attention_implementation`) for the Trainer's device and compute dtype."""
        if self.hparams.attn_implementation is not None:
            return self.hparams.attn_implementation
        from ultrascale.parallel.device import hf_attention_implementation

        strategy = attached_strategy(self)
        device = getattr(strategy, "root_device", None) or torch.device("cpu")
        precision = str(getattr(getattr(strategy, "precision_plugin", None), "precision", ""))
        compute = torch.bfloat16 if "bf16" in precision or self.hparams.dtype == "bfloat16" else torch.float32
        choice = hf_attention_implementation(device, compute)
        supported = _supported_attention(self.config)
        if choice not in supported:
            # e.g. GraniteSWA (attention sinks) has no SDPA path: the architecture's own kernel, eager
            from lightning.pytorch.utilities import rank_zero_info

            fallback = next(k for k in ("sdpa", "eager") if k in supported)
            rank_zero_info(f"{type(self).__name__}: {type(self.config).__name__} does not support '{choice}' attention; "
                           f"using '{fallback}' (pass `attn_implementation=` to choose)")
            choice = fallback
        return choice

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        dtype = DTYPES[self.hparams.dtype]
        attention = self.attention_implementation()
        meta = torch.empty(()).device.type == "meta"  # the strategy's init context asked for meta
        if meta or self._sharding_strategy():
            check_sharded_loading_supported(self.config)
            self.model = AutoModelForCausalLM.from_config(
                self.config, dtype=dtype, attn_implementation=attention,
                trust_remote_code=self.hparams.trust_remote_code,
            )
            # Not meta (tied embeddings): the weights are loaded by `init_weights` after sharding too.
            self._weights_pending = True
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.pretrained_path, dtype=dtype, local_files_only=True,
                attn_implementation=attention, trust_remote_code=self.hparams.trust_remote_code,
            )
            self._weights_pending = False
        if self.hparams.get("lora") is not None:
            from ultrascale.models.peft import require_peft

            # PEFT builds the adapters beside the base layers (on the meta device when the base model is).
            self.model = require_peft().get_peft_model(self.model, lora_config(self.hparams.lora))
            if not self._weights_pending:
                init_lora_weights(self.model, self.hparams.lora_seed)
        from ultrascale.models.adapters import hf_num_experts

        if hf_num_experts(self.config):
            from ultrascale.models.moe import attach_hf_routing

            attach_hf_routing(self.model, aux_loss_coef=self.router_aux_loss_coef, z_loss_coef=self.hparams.router_z_loss_coef)

    @property
    def router_aux_loss_coef(self) -> float:
        """The balance loss weight in use (see the `router_aux_loss_coef` argument)."""
        if self.hparams.get("router_aux_loss_coef") is not None:
            return float(self.hparams.router_aux_loss_coef)
        if getattr(self.config, "output_router_logits", False):
            return float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0)
        return 0.0

    def _sharding_strategy(self) -> bool:
        return hasattr(attached_strategy(self), "parallel_mesh")

    def init_weights(self) -> None:
        """Called by ultrascale strategies after sharding: each rank reads its slices of the weights."""
        assert self.model is not None
        recompute_nonpersistent_buffers(self.model)
        load_hf_weights(hf_inner_model(self.model), self.pretrained_path)
        if self.hparams.get("lora") is not None:
            init_lora_weights(self.model, self.hparams.lora_seed)
        self._weights_pending = False

    def on_fit_start(self) -> None:
        if getattr(self, "_weights_pending", False):  # built for real (tied embeddings): load after sharding
            self.init_weights()

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, V). `position_ids` (B, T) restarting at 0 per packed example make
        transformers build a per-document causal mask (packed-sequence detection)."""
        if self.model is None:
            raise ValueError("HFCausalLM: the model is built in `configure_model()`; call it first")
        # No KV cache: training never reuses it, and transformers only detects packed
        # documents from position_ids when there is none.
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        # `export-hf` rebuilds the model from this even if the original folder has moved.
        checkpoint["hf_config"] = self.config.to_dict()

    def on_fit_end(self) -> None:
        if self.hparams.get("lora") is not None:
            from ultrascale.models.peft import export_merged_hf, save_peft_adapter

            overwrite = bool(self.hparams.export_overwrite)
            if self.hparams.lora_dir:
                save_peft_adapter(self, self.hparams.lora_dir, overwrite=overwrite)
            if self.hparams.export_dir:
                export_merged_hf(self, self.hparams.export_dir, overwrite=overwrite)
            return
        if self.hparams.export_dir:
            export_hf_from_module(self, self.hparams.export_dir)


def hf_inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: `model`, or the one a PEFT `PeftModel` wraps (its `get_base_model()`)."""
    get_base_model = getattr(model, "get_base_model", None)  # PeftModel's; transformers models have none
    return get_base_model() if callable(get_base_model) else model


def lora_config(fields: Dict[str, Any]) -> Any:
    """`peft.LoraConfig(**fields)`, for the initialisations ultrascale reproduces under any layout."""
    from ultrascale.models.peft import require_peft

    config = require_peft().LoraConfig(**fields)
    if config.init_lora_weights is not True or config.use_dora:
        raise NotImplementedError(
            f"HFCausalLM(lora=...): init_lora_weights={config.init_lora_weights!r}, use_dora={config.use_dora!r}: "
            "ultrascale initialises the adapters itself after sharding (PEFT's default: Kaiming-uniform A, zero B); "
            "data-dependent inits (PiSSA, OLoRA, ...) and DoRA are not supported"
        )
    return config


@torch.no_grad()
def init_lora_weights(model: torch.nn.Module, seed: int) -> None:
    """Every LoRA adapter's initial weights, the same under any layout: `lora_A` Kaiming-uniform
    (a = sqrt(5), PEFT's default draw) from a generator seeded by `seed` and the parameter's name (its full
    tensor is drawn, r x in_features, small, and this rank keeps its shard), `lora_B` zeros, so the model
    starts as the base model."""
    import math
    import zlib

    for name, param in model.named_parameters():
        if ".lora_A." in f".{name}":
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.nn.init.kaiming_uniform_(torch.empty(param.shape), a=math.sqrt(5), generator=generator)
            local, indices = _local_and_indices(param)
            local.copy_(full[torch.meshgrid(*indices, indexing="ij")].to(local.dtype))
        elif ".lora_B." in f".{name}":
            (param.to_local() if isinstance(param, DTensor) else param).zero_()


def _hf_state_dict_from_module(module: HFCausalLM) -> Optional[dict[str, torch.Tensor]]:
    """Full (unsharded) HF-named weights on global rank 0 (None elsewhere); every rank must call it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    assert module.model is not None
    if dist.is_initialized():
        strategy = attached_strategy(module)
        stages = stage_mesh(strategy)
        if stages is not None:
            from ultrascale.parallel.pipeline import gather_stage_states

            # Each rank holds its stages' parameters only: gathered within the stage, then sent to rank 0.
            state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))
            state = {k: v.detach().cpu() for k, v in state.items()}
            state.update(_zero_masters(module, strategy, keep=True))
            return gather_stage_states(state, stages)
        state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        masters = _zero_masters(module, strategy, keep=dist.get_rank() == 0)
        return {**state, **masters} if dist.get_rank() == 0 else None
    return {k: v.detach().cpu() for k, v in module.model.state_dict().items()}


def _zero_masters(module: HFCausalLM, strategy: Any, keep: bool) -> dict[str, torch.Tensor]:
    """Under ZeRO-1/2 with bf16-mixed the module's weights are the bf16 compute copies of the fp32 masters the
    optimizer steps: the export takes the masters (HF names, on the CPU), as ZeRO-3 exports its fp32 weights.
    Every rank calls it; {} where there are no master copies, or on a rank that does not `keep`."""
    from ultrascale.parallel.zero import zero_engine_for

    prefix = next(name for name, child in module.named_children() if child is module.model) + "."
    masters: dict[str, torch.Tensor] = {}
    for optimizer in getattr(strategy, "optimizers", None) or []:
        engine = zero_engine_for(optimizer)
        if engine is not None and engine.has_master_copies:
            gathered = engine.full_master_weights(keep=keep, cpu=True)
            masters.update({name[len(prefix):]: value for name, value in gathered.items() if name.startswith(prefix)})
    return masters


def export_hf_from_module(module: HFCausalLM, out_dir: str | Path, overwrite: Optional[bool] = None) -> None:
    state = _hf_state_dict_from_module(module)
    if overwrite is None:
        overwrite = bool(module.hparams.get("export_overwrite", False))
    if state is not None:
        write_hf_folder(state, module.config, module.pretrained_path, out_dir, overwrite=overwrite)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def write_hf_folder(state: dict[str, torch.Tensor], config: Any, source_dir: Optional[str], out_dir: str | Path,
                    max_shard_size: str = "2GB", overwrite: bool = False) -> Path:
    """Write HF-named weights as a Hugging Face folder: sharded safetensors, config, generation config, tokenizer.

    Checked first (`check_export_target`), then written into a hidden temporary folder beside
    `out_dir` and renamed into place, so a failed export leaves no half-written folder and
    `overwrite` replaces the old folder only once the new one is complete."""
    import os
    import tempfile

    final = check_export_target(out_dir, source_dir, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _write_hf_files(state, config, source_dir, out, max_shard_size)
        if final.exists():  # overwrite: move the old folder aside, publish, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(out, final)
            shutil.rmtree(old)
        else:
            os.replace(out, final)
    finally:
        if out.exists():
            shutil.rmtree(out)
    return final


def _write_hf_files(state: dict[str, torch.Tensor], config: Any, source_dir: Optional[str], out: Path,
                    max_shard_size: str) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.tie_weights()
    if source_dir and (Path(source_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source_dir, local_files_only=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    if source_dir:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, out / name)


def export_hf_checkpoint(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "2GB",
                         overwrite: bool = False) -> Path:
    """Turn an ultrascale training checkpoint of an `HFCausalLM` (any layout) into a Hugging Face folder.

    Runs in one process, without a process group: DCP reassembles every tensor from the shards.
    """
    from transformers import AutoConfig

    from ultrascale.parallel.checkpoint import check_checkpoint_dir, read_checkpoint_metadata
    from ultrascale.parallel.safe_load import load_dcp, read_dcp_metadata

    path = check_checkpoint_dir(checkpoint)
    meta = read_checkpoint_metadata(path)  # data, not code: a planted payload is refused, never run
    tensors = read_dcp_metadata(path).state_dict_metadata
    hparams = meta.get("hyper_parameters", {})
    if hparams.get("lora") is not None:
        raise NotImplementedError(
            f"{path} is a checkpoint of a LoRA run (HFCausalLM(lora=...)); `export-hf` writes plain models. Export "
            "the adapter with `lora_dir=` / the merged model with `export_dir=` when fit ends, or resume it and call "
            "`ultrascale.models.peft.save_peft_adapter` / `export_merged_hf`"
        )
    source = hparams.get("pretrained_path")
    source = source if source and Path(source).is_dir() else None
    check_export_target(out_dir, source, overwrite)  # before reading any tensor
    if "hf_config" not in meta:
        raise ValueError(f"{path} was not written by an HFCausalLM (no Hugging Face config in it); cannot export")
    config_dict = dict(meta["hf_config"])
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    prefix = "state_dict.model."
    names = [key for key in tensors if key.startswith(prefix)]
    state = {key[len("state_dict.") :]: torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype) for key in names}
    # ZeRO-1/2 under bf16-mixed saved bf16 weights and the optimizer's fp32 masters beside them (flat, or
    # parameter-shaped for a tp parameter): the masters are the weights, as ZeRO-3 saves them.
    optimizers = sorted({key.split(".")[0] for key in tensors if re.fullmatch(r"optimizer_\d+", key.split(".")[0])})
    masters: dict[str, dict[str, Any]] = {}
    for optimizer in optimizers:
        for name in state:
            key = f"{optimizer}.state.{name}.master"
            if key in tensors:
                fp32 = torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype)
                masters.setdefault(optimizer, {"state": {}})["state"][name] = {"master": fp32}
    load_dcp({"state_dict": state, **masters}, path, no_dist=True)
    for saved in masters.values():
        state.update({name: entry["master"].reshape(state[name].shape) for name, entry in saved["state"].items()})
    hf_state = {key[len("model.") :]: value for key, value in state.items()}
    return write_hf_folder(hf_state, config, source, out_dir, max_shard_size, overwrite)
