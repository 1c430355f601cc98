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
from pathlib import Path
from typing import Any, Dict, Literal, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from ultrascale.contract import sequence_parallel_mesh, stage_mesh
from ultrascale.models.head_loss import HEAD_TO_LOGITS, fused_head_loss_sum, hf_inner_model
from ultrascale.models.hf_folder import check_export_target, trained_chat_template, write_hf_folder
from ultrascale.models.hf_load import (
    check_hf_folder,
    check_sharded_loading_supported,
    load_hf_weights,
    local_and_indices,
    text_model_config,
)
from ultrascale.models.lm import CausalLMModule, attached_strategy, check_loss_chunk_tokens
from ultrascale.parallel.loss import token_loss, token_mean
from ultrascale.parallel.rules import not_built

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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


HF_DOCUMENT_ATTENTION = "ultrascale_sdpa_documents"
"""The name `hf_document_attention` is registered under in transformers' `AttentionInterface` (with SDPA's mask
function): what `HFCausalLM` runs where transformers would run "sdpa"."""


def hf_document_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' "sdpa" attention, packed documents one at a time: where the layer's `position_ids` restart
    (a padding-free or packed batch) and the layer is plain causal attention (no sliding window, soft-capping, sinks
    or cache), each document attends to itself through `parallel.documents.document_attention`, and the (T, T)
    block-diagonal mask transformers built is not read; everything else is transformers' own `sdpa_attention_forward`
    with that mask. Both compute the same attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ultrascale.parallel.documents import document_attention, document_ids

    documents = document_ids(kwargs.get("position_ids"))
    plain = (kwargs.get("sliding_window") is None and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
             and getattr(module, "is_causal", True) and kwargs.get("is_causal") is not False
             and query.shape[2] == key.shape[2])
    if documents is None or not plain or documents.shape[-1] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = document_attention(query, key, value, documents, scale=scaling, dropout_p=dropout)  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def use_document_attention(model: torch.nn.Module) -> None:
    """Run `model`'s "sdpa" attention as `hf_document_attention` (registered once, with SDPA's mask function)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(HF_DOCUMENT_ATTENTION, hf_document_attention)
    AttentionMaskInterface.register(HF_DOCUMENT_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(HF_DOCUMENT_ATTENTION)


MASKS_WITHOUT_POSITIONS = frozenset({"gpt_oss"})
"""`config.model_type`s whose forward builds its attention masks without `position_ids` (transformers 5.24's
GptOssModel), so documents packed in one row see each other (0.15 off a document's logits alone on a tiny
checkpoint, tests/test_hf_matrix.py): the one exception to reading capabilities from structure, since the masks are
built inside the model's forward."""


def hf_attends_within_documents(config: Any) -> bool:
    """Whether a Hugging Face model keeps documents that `position_ids` restart apart (`ModuleContract.
    attends_within_documents`)."""
    return getattr(config, "model_type", None) not in MASKS_WITHOUT_POSITIONS


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
        loss_chunk_tokens: Optional[int] = None,
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
            loss_chunk_tokens: the head and the loss fused over chunks of this many tokens, so the logits of no
                more than one chunk exist at once (`ultrascale.chunked_token_loss`); 0: the whole micro-batch's
                logits; None: `default_loss_chunk_tokens` of the vocabulary where it is built (the architectures
                of `HEAD_TO_LOGITS`, not under pipeline parallel), off elsewhere.
        """
        check_loss_chunk_tokens(loss_chunk_tokens, "HFCausalLM")
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
        folder_config = AutoConfig.from_pretrained(
            self.pretrained_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        # The model trained: a multimodal checkpoint's text model; the export writes the rest back from `pretrained_path`.
        self.config = text_model_config(folder_config)
        self.text_of_multimodal = self.config is not folder_config
        self.model: Optional[torch.nn.Module] = None

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer lives (data modules may default to it)."""
        return self.pretrained_path

    @property
    def prefers_meta_init(self) -> bool:
        """Ask ultrascale strategies to build the model on the meta device (weights are loaded after sharding),
        so no rank ever holds the whole model. Tied input/output embeddings included: materialising re-shares
        the tie within a rank (`parallel.init.materialize_meta_module`), and under pipeline parallel each end
        holds its copy; tests/test_hf_matrix.py holds a tied model to parity under every layout."""
        return True

    @property
    def attends_within_documents(self) -> bool:
        """`ModuleContract.attends_within_documents`: False for a model whose forward builds masks without
        `position_ids` (`MASKS_WITHOUT_POSITIONS`), whose padding-free rows would let examples attend to each other."""
        return hf_attends_within_documents(self.config)

    def attention_implementation(self) -> str:
        """The `attn_implementation` the model is built with: the one given, or the device's choice
        (`hf_attention_implementation`) for the Trainer's device and compute dtype."""
        if self.hparams.attn_implementation is not None:
            return self.hparams.attn_implementation
        from ultrascale.parallel.device import compute_dtype, hf_attention_implementation

        strategy = attached_strategy(self)
        device = getattr(strategy, "root_device", None) or torch.device("cpu")
        precision = str(getattr(getattr(strategy, "precision_plugin", None), "precision", ""))
        compute = torch.bfloat16 if self.hparams.dtype == "bfloat16" else compute_dtype(precision)
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
        if torch.empty(()).device.type == "meta":  # the strategy's init context (`prefers_meta_init`)
            check_sharded_loading_supported(self.config)
            self.model = AutoModelForCausalLM.from_config(
                self.config, dtype=dtype, attn_implementation=attention,
                trust_remote_code=self.hparams.trust_remote_code,
            )
            self._weights_pending = True  # loaded by `init_weights` after sharding
        elif self.text_of_multimodal:  # transformers loads no text model alone from some (Gemma 3's): the loader does
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=dtype, attn_implementation=attention)
            load_hf_weights(self.model, self.pretrained_path)
            self._weights_pending = False
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.pretrained_path, dtype=dtype, local_files_only=True,
                attn_implementation=attention, trust_remote_code=self.hparams.trust_remote_code,
            )
            self._weights_pending = False
        if attention == "sdpa":
            use_document_attention(self.model)
        # `from_pretrained` returns the model in eval mode and Lightning keeps a submodule's mode: without this its
        # dropout stayed off under Lightning's own strategies.
        self.model.train()
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

    def init_weights(self) -> None:
        """Called by ultrascale strategies after sharding: each rank reads its slices of the weights."""
        assert self.model is not None
        recompute_nonpersistent_buffers(self.model)
        load_hf_weights(hf_inner_model(self.model), self.pretrained_path)
        if self.hparams.get("lora") is not None:
            init_lora_weights(self.model, self.hparams.lora_seed)
        self._weights_pending = False

    def on_fit_start(self) -> None:
        if getattr(self, "_weights_pending", False):  # built, not loaded yet: load after sharding
            self.init_weights()

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> Any:
        """Logits (B, T, V). `position_ids` (B, T) restarting at 0 per packed example make
        transformers build a per-document causal mask (packed-sequence detection). With `labels`:
        ``{"loss", "num_tokens"}`` from the decoder's hidden states and the head fused in chunks
        (`ultrascale.chunked_token_loss`, with what the architecture does around its head: `HEAD_TO_LOGITS`)."""
        if self.model is None:
            raise ValueError("HFCausalLM: the model is built in `configure_model()`; call it first")
        # No KV cache: training never reuses it, and transformers only detects packed
        # documents from position_ids when there is none.
        chunk = self.loss_chunk_tokens_in_use() if labels is not None else 0
        if not chunk:
            logits = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            return logits if labels is None else token_loss(logits, labels)
        return token_mean(*fused_head_loss_sum(self.model, input_ids, position_ids, labels, chunk,
                                               sequence_parallel_mesh(attached_strategy(self))))

    fuses_head_and_loss = True

    def chunked_loss_refusal(self) -> Optional[Tuple[str, str]]:
        if self.config.model_type in HEAD_TO_LOGITS:
            return None
        return ("chunked_loss_hf_architecture", f"{type(self.config).__name__} (`{self.config.model_type}`) is not among "
                "the architectures whose logits the chunked loss is checked against (`models.head_loss.HEAD_TO_LOGITS`)")

    def vocab_size_of_head(self) -> int:
        return int(self.config.vocab_size)

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        # `export-hf` rebuilds the model from this even if the original folder has moved.
        checkpoint["hf_config"] = self.config.to_dict()
        checkpoint["hf_text_of_multimodal"] = self.text_of_multimodal

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


def lora_config(fields: Dict[str, Any]) -> Any:
    """`peft.LoraConfig(**fields)`, for the initialisations ultrascale reproduces under any layout."""
    from ultrascale.models.peft import require_peft

    config = require_peft().LoraConfig(**fields)
    if config.init_lora_weights is not True or config.use_dora:
        raise not_built("lora_data_dependent_init",
                        f"HFCausalLM(lora=...): init_lora_weights={config.init_lora_weights!r}, "
                        f"use_dora={config.use_dora!r}: ultrascale initialises the adapters itself after sharding "
                        "(PEFT's default: Kaiming-uniform A, zero B); data-dependent inits (PiSSA, OLoRA, ...) and DoRA "
                        "are not supported")
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
            local, indices = local_and_indices(param)
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
    prefix = next(name for name, child in module.named_children() if child is module.model) + "."
    masters: dict[str, torch.Tensor] = {}
    for engine in getattr(strategy, "zero_engines", ()):
        if engine.has_master_copies:
            gathered = engine.full_master_weights(keep=keep, cpu=True)
            masters.update({name[len(prefix):]: value for name, value in gathered.items() if name.startswith(prefix)})
    return masters


def export_hf_from_module(module: HFCausalLM, out_dir: str | Path, overwrite: Optional[bool] = None) -> None:
    state = _hf_state_dict_from_module(module)
    if overwrite is None:
        overwrite = bool(module.hparams.get("export_overwrite", False))
    if state is not None:
        try:
            datamodule = module.trainer.datamodule
        except RuntimeError:  # not attached to a Trainer (an export of a module built by hand)
            datamodule = None
        write_hf_folder(state, module.config, module.pretrained_path, out_dir, overwrite=overwrite,
                        chat_template=trained_chat_template(getattr(datamodule, "hparams", None)))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def export_hf_checkpoint(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "2GB",
                         overwrite: bool = False, tokenizer: Optional[str] = None) -> Path:
    """Turn an ultrascale training checkpoint of an `HFCausalLM` or a `LlamaLM` (any layout) into a Hugging Face folder.

    Runs in one process, without a process group: DCP reassembles every tensor from the shards. An `HFCausalLM`
    becomes the model it was loaded from (its folder's tokenizer and generation config copied); a dense `LlamaLM`
    a `LlamaForCausalLM` (`ultrascale.models.llama_hf`) with the tokenizer its data used: `tokenizer` (a tokenizer
    folder, or "bytes" for `ByteTokenizer`) or else the one the checkpoint's data module names.
    """
    from transformers import AutoConfig

    from ultrascale.parallel.checkpoint import check_checkpoint_dir, read_checkpoint_metadata
    from ultrascale.parallel.manifest import CheckpointDamaged, damage_message, verify_checkpoint

    path = check_checkpoint_dir(checkpoint)
    problems = verify_checkpoint(path, "checksum")
    if problems:
        raise CheckpointDamaged(damage_message(path, problems))
    meta = read_checkpoint_metadata(path)  # data, not code: a planted payload is refused, never run
    hparams = meta.get("hyper_parameters", {})
    if hparams.get("lora") is not None:
        raise not_built(
            "export_lora_checkpoint",
            f"{path} is a checkpoint of a LoRA run (HFCausalLM(lora=...)); `export-hf` writes plain models. Export "
            "the adapter with `lora_dir=` / the merged model with `export_dir=` when fit ends, or resume it and call "
            "`ultrascale.models.peft.save_peft_adapter` / `export_merged_hf`"
        )
    if "llama_config" in meta or _llama_preset_hparams(hparams):
        return _export_llama(path, meta, out_dir, max_shard_size, overwrite, tokenizer)
    if "hf_config" not in meta:
        raise ValueError(f"{path} was not written by an HFCausalLM or a LlamaLM (neither's config is in it); cannot export")
    if tokenizer is not None:
        raise ValueError("--tokenizer is for LlamaLM checkpoints: an HFCausalLM export copies its model folder's tokenizer")
    source = hparams.get("pretrained_path")
    source = source if source and Path(source).is_dir() else None
    if meta.get("hf_text_of_multimodal") and source is None:
        raise FileNotFoundError(
            f"{path} trained the text model of the multimodal checkpoint {hparams.get('pretrained_path')}, whose other "
            "weights (the vision tower) the export writes back from that folder, and it is gone: restore it there"
        )
    check_export_target(out_dir, source, overwrite)  # before reading any tensor
    config_dict = dict(meta["hf_config"])
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    hf_state = {key[len("model."):]: value for key, value in _model_state(path).items()}
    return write_hf_folder(hf_state, config, source, out_dir, max_shard_size, overwrite,
                           chat_template=trained_chat_template(meta.get("datamodule_hyper_parameters")))


def _model_state(path: Path) -> dict[str, torch.Tensor]:
    """The module's `model.*` weights of a checkpoint, whole (fp32 where the run kept fp32 masters)."""
    from ultrascale.parallel.safe_load import load_dcp, read_dcp_metadata

    tensors = read_dcp_metadata(path).state_dict_metadata
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
    return state


def _export_llama(path: Path, meta: dict[str, Any], out_dir: str | Path, max_shard_size: str, overwrite: bool,
                  tokenizer: Optional[str]) -> Path:
    from ultrascale.models.llama import LlamaConfig
    from ultrascale.models.llama_hf import byte_tokenizer_for_hf, hf_llama_config, hf_llama_state

    if "llama_config" in meta:
        config = LlamaConfig(**meta["llama_config"])
    else:  # written before LlamaLM saved its config: its preset and overrides rebuild it
        hparams = meta["hyper_parameters"]
        overrides = {key: hparams[key] for key in ("vocab_size", "max_seq_len") if hparams.get(key) is not None}
        config = LlamaConfig.from_preset(hparams["preset"], **overrides)
    source = tokenizer if tokenizer is not None else _data_tokenizer(path, meta)
    if source == "bytes":
        hf_tokenizer = byte_tokenizer_for_hf()
        source_dir = None
    else:
        from transformers import AutoTokenizer

        if not Path(source).is_dir():
            raise FileNotFoundError(f"--tokenizer {source}: no such folder (a Hugging Face tokenizer folder, or `bytes`)")
        hf_tokenizer, source_dir = None, source
    check_export_target(out_dir, source_dir, overwrite)  # before reading any tensor
    ids = hf_tokenizer if hf_tokenizer is not None else AutoTokenizer.from_pretrained(source, local_files_only=True)
    if len(ids) > config.vocab_size:
        raise ValueError(f"the tokenizer {source} has {len(ids)} ids, the model's vocabulary {config.vocab_size}: "
                         "not the tokenizer this model was trained with")
    hf_config = hf_llama_config(config, bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id)
    state = hf_llama_state({key[len("model."):]: value for key, value in _model_state(path).items()}, config)
    return write_hf_folder(state, hf_config, source_dir, out_dir, max_shard_size, overwrite, tokenizer=hf_tokenizer)


def _llama_preset_hparams(hparams: dict[str, Any]) -> bool:
    """A `LlamaLM` built from a preset (its signature's hyper-parameters, no explicit config)."""
    return {"preset", "init_seed", "min_lr_ratio"} <= set(hparams) and hparams.get("config") is None


def _data_tokenizer(path: Path, meta: dict[str, Any]) -> str:
    """The tokenizer the checkpoint's `CausalLMDataModule` encoded with: its `tokenizer_path`, the folder its prepared
    data was tokenized with, or "bytes"; ValueError (asking for --tokenizer) where the checkpoint does not say."""
    data = meta.get("datamodule_hyper_parameters") or {}
    if data.get("tokenizer_path"):
        return str(data["tokenizer_path"])
    if "data_path" not in data and "dataset_path" not in data:
        raise ValueError(f"{path} does not say which tokenizer its data used (not a CausalLMDataModule's run): pass "
                         "--tokenizer DIR (a Hugging Face tokenizer folder) or --tokenizer bytes")
    from ultrascale.data.prepared import PreparedTokens

    sources = data.get("data_path")
    first = sources[0].get("path") if isinstance(sources, list) and sources else sources
    try:
        prepared = PreparedTokens.open(first) if isinstance(first, str) else None
    except (OSError, ValueError):
        prepared = None
    if prepared is None:
        return "bytes"  # raw text without a tokenizer_path: ByteTokenizer
    name = str(prepared.metadata["tokenizer"]["name"])
    if not Path(name).is_dir():
        raise ValueError(f"{path}'s data {first} was tokenized with {name!r}, which is not a folder here: pass "
                         "--tokenizer DIR (that tokenizer's folder)")
    return name
