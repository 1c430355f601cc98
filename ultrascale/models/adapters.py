"""Where a model keeps its transformer blocks (and, as later parallelisms land, its TP/PP plans).

Model knowledge lives here only. A `ModelAdapter` is found for a module by
`get_adapter`: the built-in Llama and Hugging Face `*PreTrainedModel`s have named
adapters; any other `nn.Module` gets the generic one, which is enough for
ZeRO/HSDP (it only needs the repeated blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from typing import Any, Optional

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from ultrascale.estimate import ModelShape, hf_head_dim
from ultrascale.models.head_loss import fuses_head_and_loss
from ultrascale.models.hf_sequence_parallel import hf_sequence_parallel_problem, hf_sequence_parallel_styles
from ultrascale.models.tp_plans import hf_base_tp_plan
from ultrascale.parallel.rules import ModelFacts, experts_over_tp


@dataclass(frozen=True)
class ModelAdapter:
    """What the parallelisms need to know about one model."""

    name: str
    """Architecture name used in error messages ('generic' for unknown models)."""
    blocks: tuple[nn.Module, ...]
    """The repeated transformer blocks: one FSDP unit / checkpoint region / pipeline unit each."""
    tp_sizes: Mapping[str, int] = field(default_factory=dict)
    """Sizes that a tensor-parallel degree must divide (heads, kv heads, MLP hidden, vocab)."""
    attention_heads: Optional[int] = None
    """Query heads per layer (what Ulysses context parallel splits over cp); None where unknown."""
    tp_plan: Optional[Callable[..., dict[str, ParallelStyle]]] = None
    """`tp_plan(sequence_parallel=..., loss_parallel=..., stage_layers=...)` -> plan keyed by module path; None: no TP
    support. `stage_layers`: under pipeline parallel, each stage's layers in model order."""
    supports_sequence_parallel: bool = False
    """Whether `tp_plan(sequence_parallel=True)` is implemented for this architecture."""
    sequence_parallel_default: bool = True
    """Whether sequence parallel runs when `sequence_parallel` is left unset (Hugging Face models: only when asked)."""
    sequence_parallel_refusal: Optional[str] = None
    """Without `supports_sequence_parallel`: the piece the model lacks."""
    tp_refusal: Optional[str] = None
    """Why this architecture's own TP plan cannot run (a style ultrascale refuses, or an entry naming a bare
    parameter); None: it can. A user's `tp_plan=` replaces the model's plan and this check."""
    enable_context_parallel: Optional[Callable[[Any], None]] = None
    """`enable_context_parallel(cp)` routes the model's attention through `cp.attention`
    (`ultrascale.parallel.context.ContextParallel`); None: no context-parallel support."""
    context_parallel_refusal: Optional[str] = None
    """Without `enable_context_parallel`: the piece the model lacks, naming the layer."""
    pipeline_parts: Optional[Callable[[], Any]] = None
    """`pipeline_parts()` -> `ultrascale.parallel.pipeline.PipelineParts` (where the embedding,
    layers, norm and head are, and how to run the model on hidden states); None: no PP support."""
    pipeline_refusal: Optional[str] = None
    """Without `pipeline_parts`: the piece the model lacks for a stage split."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    enable_expert_parallel: Optional[Callable[[Any], None]] = None
    """`enable_expert_parallel(ep)` splits the experts over the ep ranks and routes tokens through
    `ep` (`ultrascale.parallel.expert.ExpertParallel`); None: no expert-parallel support."""
    expert_parallel_refusal: Optional[str] = None
    """Of an MoE model without `enable_expert_parallel`: the piece its experts or routers lack."""
    experts: Callable[[], list[nn.Module]] = lambda: []
    """The experts modules (fused expert weights): each is its own FSDP unit, on the expert mesh, under ep > 1."""

    def facts(self, *, pipeline_parts: Any = None) -> ModelFacts:
        """What the rulebook (`ultrascale.parallel.rules`) needs to know of this model. `pipeline_parts`: the
        LightningModule's own stage split, which replaces the adapter's."""
        parts = pipeline_parts if pipeline_parts is not None else (
            self.pipeline_parts() if self.pipeline_parts is not None else None)
        refusal = parts.problem(self.name) if parts is not None else self.pipeline_refusal
        return ModelFacts(
            name=self.name,
            n_layers=len(parts.layer_list()) if parts is not None and refusal is None else None,
            tp_sizes=dict(self.tp_sizes),
            tp_head_sizes={name: size for name, size in self.tp_sizes.items() if "heads" in name},
            attention_heads=self.attention_heads,
            tp_plan=self.tp_plan is not None,
            tp_refusal=self.tp_refusal,
            sequence_parallel=self.supports_sequence_parallel,
            sequence_parallel_default=self.sequence_parallel_default,
            sequence_parallel_refusal=self.sequence_parallel_refusal,
            context_parallel=self.enable_context_parallel is not None,
            context_parallel_refusal=self.context_parallel_refusal,
            pipeline=parts is not None,
            pipeline_refusal=refusal,
            n_experts=self.num_experts,
            expert_parallel=self.enable_expert_parallel is not None,
            expert_parallel_refusal=self.expert_parallel_refusal,
        )


def find_block_list(module: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of same-class children holding the most parameters, i.e. the transformer blocks."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) == 0:
            continue
        # A checkpoint-wrapped block (activation checkpointing every k-th block) counts as its inner type.
        if len({type(getattr(child, "_checkpoint_wrapped_module", child)) for child in sub}) != 1:
            continue
        numel = sum(p.numel() for p in sub.parameters())
        if numel > 0 and (best is None or numel > best[0]):
            best = (numel, path, sub)
    return None if best is None else (best[1], best[2])


def get_adapter(module: nn.Module) -> ModelAdapter:
    found = find_block_list(module)
    blocks = found[1] if found is not None else ()
    name = _architecture_name(module)
    common: dict[str, Any] = {"name": name, "blocks": tuple(blocks)}
    llama = _find_instance(module, "ultrascale.models.llama", "Llama")
    if llama is not None:
        return _llama_adapter(llama, common)
    hf = _find_hf_causal_lm(module)
    if hf is not None:
        return _hf_adapter(hf, common)
    return ModelAdapter(**common)


def _find_instance(module: nn.Module, module_name: str, class_name: str) -> Optional[tuple[str, nn.Module]]:
    for path, sub in module.named_modules():
        if type(sub).__module__ == module_name and type(sub).__name__ == class_name:
            return path, sub
    return None


def _prefix(path: str) -> str:
    return f"{path}." if path else ""


def _llama_adapter(found: tuple[str, nn.Module], common: dict[str, Any]) -> ModelAdapter:
    from ultrascale.models.tp_plans import llama_tp_plan

    path, llama = found
    config = llama.config
    return ModelAdapter(
        **common,
        attention_heads=config.n_heads,
        tp_sizes={
            "n_heads": config.n_heads,
            "n_kv_heads": config.n_kv_heads,
            # The feed-forward's width: each expert's under MoE (shared experts are multiples of it).
            **({"moe_hidden_dim": config.resolved_moe_hidden_dim} if config.n_experts
               else {"ffn_hidden_dim": config.resolved_ffn_hidden_dim}),
            "vocab_size": config.vocab_size,
        },
        tp_plan=lambda *, sequence_parallel, loss_parallel, stage_layers=(): llama_tp_plan(  # the stream crosses stages sliced
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, prefix=_prefix(path),
            experts=bool(config.n_experts), shared_experts=bool(config.n_experts and config.n_shared_experts),
        ),
        supports_sequence_parallel=True,
        enable_context_parallel=lambda cp: _llama_context_parallel(llama, cp),
        pipeline_parts=lambda: _llama_pipeline_parts(llama),
        num_experts=config.n_experts,
        enable_expert_parallel=lambda ep: _llama_expert_parallel(llama, ep),
        experts=lambda: _llama_experts(llama),
    )


def _llama_experts(llama: nn.Module) -> list[nn.Module]:
    from ultrascale.models.moe import GroupedExperts

    return [m for m in llama.modules() if isinstance(m, GroupedExperts)]


def _llama_expert_parallel(llama: nn.Module, ep: Any) -> None:
    from ultrascale.parallel.expert import shard_experts

    for experts in _llama_experts(llama):  # the layers this pipeline rank holds
        shard_experts(experts, ep)


def _llama_pipeline_parts(llama: nn.Module) -> Any:
    from ultrascale.parallel.pipeline import PipelineParts

    # `Llama.forward` takes hidden states (B, T, dim) in place of tokens when its embedding is a gap.
    return PipelineParts(
        root=llama, embed="tok_embeddings", layers="layers", norm="norm", head="output",
        run=lambda root, x, position_ids, is_first: root(x, position_ids),
    )


def _llama_context_parallel(llama: nn.Module, cp: Any) -> None:
    from ultrascale.parallel.context import ContextParallelAttention

    for block in llama.layers:
        if hasattr(block, "attention"):  # not a pipeline gap (a layer another stage holds)
            block.attention.sdpa = ContextParallelAttention(cp)
    llama.document_masks = False  # the kernel reads documents from the whole-sequence layout


def _find_hf_causal_lm(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    for path, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(sub, "base_model_prefix") and type(sub).__name__.endswith("ForCausalLM"):
            return path, sub
    return None


def _hf_adapter(found: tuple[str, nn.Module], common: dict[str, Any]) -> ModelAdapter:
    path, hf = found
    config = hf.config
    base_plan = hf_base_tp_plan(config)
    prefix = _prefix(path)
    base = _prefix(prefix + hf.base_model_prefix)

    def plan(*, sequence_parallel: bool, loss_parallel: bool, stage_layers: Sequence[range] = ()) -> dict[str, ParallelStyle]:
        styles = hf_tp_plan(hf, base_plan, base=base, prefix=prefix, loss_parallel=loss_parallel)
        if sequence_parallel:
            styles = hf_sequence_parallel_styles(hf, styles, base_plan, base=base, prefix=prefix,
                                                 loss_parallel=loss_parallel, stage_layers=stage_layers)
        return styles

    heads = getattr(config, "num_attention_heads", None)  # none in an attention-free model (RWKV, Mamba)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": config.vocab_size,
    }
    for experts in _hf_experts(hf)[:1]:  # fused experts (E, ...): tp splits each expert's intermediate width
        down = experts.down_proj
        sizes["the experts' intermediate width"] = down.shape[1] if getattr(experts, "is_transposed", False) else down.shape[-1]
    name = common["name"]
    context_refusal = _hf_context_parallel_problems(hf, name)
    pipeline_refusal = _hf_pipeline_problem(hf, name)
    n_experts = hf_num_experts(config)
    sequence_refusal = hf_sequence_parallel_problem(hf, base_plan, name) if base_plan else None
    expert_refusal = _hf_expert_parallel_problem(hf, name) if n_experts else None
    return ModelAdapter(
        **common,
        attention_heads=heads,
        tp_sizes={name: size for name, size in sizes.items() if size},
        tp_plan=plan if base_plan else None,
        tp_refusal=_hf_tp_refusal(hf, base_plan, name) if base_plan else None,
        supports_sequence_parallel=bool(base_plan) and sequence_refusal is None,
        sequence_parallel_default=False,
        sequence_parallel_refusal=sequence_refusal,
        enable_context_parallel=(lambda cp: _hf_context_parallel(hf, cp)) if context_refusal is None else None,
        context_parallel_refusal=context_refusal,
        pipeline_parts=(lambda: _hf_pipeline_parts(hf)) if pipeline_refusal is None else None,
        pipeline_refusal=pipeline_refusal,
        num_experts=n_experts,
        enable_expert_parallel=(lambda ep: _hf_expert_parallel(hf, ep)) if n_experts and expert_refusal is None else None,
        expert_parallel_refusal=expert_refusal,
        experts=lambda: _hf_experts(hf),
    )


# --------------------------------------------------------------------------- Hugging Face: capabilities by structure
# What a Hugging Face model can run is read from what it has (transformers 5 publishes it on every model), never
# from a list of model types: a model released next month runs as soon as its structure fits, and otherwise the
# refusal names the piece and the layer that do not.

SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` entries whose layers run softmax attention through the AttentionInterface (a sliding window
is a mask; every other type, e.g. linear attention or chunked attention, has no context-parallel kernel)."""


def hf_attention_modules(hf: nn.Module) -> list[nn.Module]:
    """The self-attention module of each decoder layer (transformers names them `*Attention`, with `layer_idx`)."""
    return [m for m in hf.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def _hf_context_parallel_problems(hf: nn.Module, name: str) -> Optional[str]:
    """Why context parallel cannot route this model's attention, naming the layer, or None. What the attention
    function receives per layer (sliding window, scaling, soft-capping, sinks, head sizes) every method computes."""
    config = hf.config
    for layer, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if kind not in SOFTMAX_LAYER_TYPES:
            return (f"context parallel: layer {layer} of {name} is {kind!r} (config.layer_types); only softmax "
                    f"attention layers {SOFTMAX_LAYER_TYPES} have a context-parallel kernel")
    if not getattr(type(hf), "_supports_attention_backend", False):
        return (f"context parallel: {name}'s attention does not run through transformers' AttentionInterface "
                f"(`{type(hf).__name__}._supports_attention_backend` is not set), so ultrascale cannot route it "
                "through ring / all-gather / all-to-all attention")
    modules = hf_attention_modules(hf)
    without = sorted(set(range(getattr(config, "num_hidden_layers", 0) or 0)) - {m.layer_idx for m in modules})
    if without:
        return (f"context parallel: layer(s) {without} of {name} have no attention module (a `*Attention` with "
                "`layer_idx`) for ultrascale to route")
    for module in modules:
        if not getattr(module, "is_causal", True):
            return (f"context parallel: layer {module.layer_idx} of {name} ({type(module).__name__}) is not causal "
                    "self-attention")
    return None


def _hf_pipeline_problem(hf: nn.Module, name: str) -> Optional[str]:
    """Why this model has no stage split, or None: its config's `base_model_pp_plan` names the embedding, the layers
    and the final norm."""
    plan = getattr(hf.config, "base_model_pp_plan", None) or {}
    if not plan:
        return f"pipeline parallel has no stage split for {name}: its config ships no `base_model_pp_plan`"
    missing = [part for part in ("embed_tokens", "layers", "norm") if part not in plan]
    if missing:
        return (f"pipeline parallel has no stage split for {name}: its `base_model_pp_plan` lacks {missing} "
                f"(it names {sorted(plan)})")
    return None


def _hf_expert_parallel_problem(hf: nn.Module, name: str) -> Optional[str]:
    """Why ultrascale's dispatch cannot run this MoE model's experts, or None: fused SwiGLU experts behind
    transformers' ExpertsInterface (`[gate; up]` concatenated, not transposed, no biases) and, beside each, a
    top-k router returning (logits, weights, indices)."""
    from ultrascale.models.moe import hf_experts_problem, hf_routers

    experts = _hf_experts(hf)
    if not experts:
        return (f"expert parallel has no expert dispatch for {name}: it has no fused experts module (`gate_up_proj` "
                "(E, 2I, H) and `down_proj`), which transformers' ExpertsInterface dispatches")
    problem = hf_experts_problem(hf)
    if problem is not None:
        return f"expert parallel on {name}: {problem}"
    if len(hf_routers(hf)) != len(experts):
        return (f"expert parallel on {name}: {len(experts)} experts modules but {len(hf_routers(hf))} routers of the "
                "known form (a `gate` beside `experts`, with `top_k` and a `weight` (E, H), returning logits, weights "
                "and indices)")
    return None


def _hf_tp_refusal(hf: nn.Module, base_plan: Mapping[str, str], name: str) -> Optional[str]:
    """Why `base_plan` cannot run on `hf` (checked on every rank before any collective), or None."""
    from ultrascale.parallel.tensor import lora_entries, per_head_parameters_left_whole, split_parameter_entries
    from ultrascale.parallel.tensor_styles import style_from_name

    base = _prefix(hf.base_model_prefix)
    styles = {}
    for key, style in base_plan.items():
        try:
            styles[base + key] = style_from_name(style)
        except ValueError as error:
            return (
                f"tensor parallel on {name}: its plan (config.base_model_tp_plan) entry {key!r}: {error}. "
                "Pass your own plan with `UltraScaleStrategy(tp_plan=...)` to run tensor parallel without it."
            )
    try:
        # Entries naming a bare parameter (fused expert weights, attention sinks) need their module's entry;
        # one naming neither a module nor such a parameter would leave a weight silently whole.
        lora_entries(hf, split_parameter_entries(hf, styles, drop_unmatched=True))  # PEFT-wrapped layers, if any
    except ValueError as error:
        return (
            f"tensor parallel on {name}: its plan (config.base_model_tp_plan): {error}. Pass your own plan with "
            "`UltraScaleStrategy(tp_plan=...)`."
        )
    heads = {getattr(hf.config, key, None) for key in ("num_attention_heads", "num_key_value_heads")} - {None}
    whole = per_head_parameters_left_whole(hf, styles, heads)
    if whole:
        return (f"tensor parallel on {name}: {whole[0]} holds one value per attention head, and its plan "
                "(config.base_model_tp_plan) splits the heads beside it but leaves it whole, so each rank would run its "
                "heads with every head's values. Pass your own plan with `UltraScaleStrategy(tp_plan=...)`.")
    return None


def hf_tp_plan(
    hf: nn.Module, base_plan: Mapping[str, str], *, base: str, prefix: str, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """The model's own `base_model_tp_plan` as ParallelStyles, plus the embedding and head it leaves out.

    The input embedding is vocab-parallel (partial lookups all-reduced) unless the plan places it; the
    head is column-parallel over the vocabulary, its logits vocab-sharded into the loss under loss
    parallel and gathered otherwise.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ultrascale.parallel.tensor_styles import MlaKvAProjParallel, style_from_name

    def style(name: str) -> ParallelStyle:
        if name == "mla_kv_a_proj":  # the RoPE key width is in the config, not on the Linear
            return MlaKvAProjParallel(rope_dim=getattr(hf.config, "qk_rope_head_dim", None))
        return style_from_name(name)

    from ultrascale.parallel.tensor import split_parameter_entries

    # Entries for layer kinds this config does not build (dense MLPs of an all-MoE Qwen2-MoE) are dropped;
    # those naming bare parameters are folded into their module's entry.
    inner = base[len(prefix):]  # the base model's path inside `hf`
    styles = split_parameter_entries(hf, {inner + key: style(value) for key, value in base_plan.items()}, drop_unmatched=True)
    styles = {prefix + key: value for key, value in styles.items()}
    paths = {id(module): name for name, module in hf.named_modules()}
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    embed_path = prefix + paths[id(embedding)] if embedding is not None and id(embedding) in paths else None
    # Vocab-parallel unless placed, or more than a lookup (Inkling's normed embedding: it then runs whole on every rank).
    if embed_path and not any(fnmatch(embed_path, k) for k in styles) and len(list(embedding.parameters())) == 1:
        styles[embed_path] = RowwiseParallel(input_layouts=Replicate())
    if head is not None and id(head) in paths:
        styles[prefix + paths[id(head)]] = ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel
        )
    styles.update(_modules_on_split_activations(hf, styles, prefix))
    return styles


def _modules_on_split_activations(hf: nn.Module, styles: Mapping[str, ParallelStyle], prefix: str) -> dict:
    """Entries for the modules a plan leaves out that sit beside a column-parallel layer with a split output and a
    row-parallel layer with a split input of one parent, and whose parameters the split dim does not index: scalars
    (Apertus's xIELU activation, alpha_p and alpha_n, between up_proj and down_proj) and per-head vectors of the head
    width (GLM-4-MoE's and Sarvam-MoE's q_norm / k_norm with `use_qk_norm`, between q/k_proj and o_proj). Such a
    module runs on this rank's slice of the features or heads, so each rank's gradient is its part of the sum over them,
    d/dw = sum over heads (or features) of its per-slice terms; left out, the tp ranks' copies would drift apart."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from ultrascale.parallel.tensor import leaves_output_split
    from ultrascale.parallel.tensor_styles import ReplicatedWithGradAllReduce

    # The layers' own head widths (Gemma 4's differ by layer type, and its config refuses one global `head_dim`).
    head_dims = {m.head_dim for m in hf.modules() if isinstance(getattr(m, "head_dim", None), int)} or {hf_head_dim(hf.config)}

    def unindexed(param: nn.Parameter) -> bool:
        return param.numel() == 1 or (param.dim() == 1 and param.shape[0] in head_dims)

    def split(style: ParallelStyle) -> Optional[str]:
        if leaves_output_split(style):
            return "column"
        if isinstance(style, RowwiseParallel) and style.input_layouts == (Shard(-1),):
            return "row"
        return None

    named = {prefix + name: module for name, module in hf.named_modules()}
    planned = {name for name in named if any(fnmatch(name, key) for key in styles)}
    sides: dict[str, set[str]] = {}
    for name in planned:
        kind = next((split(style) for key, style in styles.items() if fnmatch(name, key)), None)
        if kind is not None:
            sides.setdefault(name.rpartition(".")[0], set()).add(kind)
    entries = {}
    for parent, kinds in sides.items():
        if kinds != {"column", "row"}:
            continue
        for child, module in named[parent].named_children() if parent in named else ():
            path = f"{parent}.{child}"
            params = list(module.parameters())
            if (params and all(unindexed(p) for p in params) and path not in planned
                    and not any(name.startswith(path + ".") for name in planned)):
                entries[path] = ReplicatedWithGradAllReduce()
    return entries


def hf_num_experts(config: Any) -> int:
    """Routed experts per layer of a Hugging Face MoE config (`num_local_experts` / `num_experts` with
    `num_experts_per_tok`); 0 for a dense one."""
    value = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    return int(value) if getattr(config, "num_experts_per_tok", None) else 0


def _hf_experts(hf: nn.Module) -> list[nn.Module]:
    from ultrascale.models.moe import hf_experts_modules

    return hf_experts_modules(hf)


def _hf_expert_parallel(hf: nn.Module, ep: Any) -> None:
    from ultrascale.models.moe import HF_EXPERTS_IMPLEMENTATION, register_hf_experts
    from ultrascale.parallel.expert import shard_experts

    register_hf_experts()
    for experts in _hf_experts(hf):
        shard_experts(experts, ep)
    # transformers' experts forward now dispatches to `ultrascale.parallel.expert.experts_forward`.
    hf.set_experts_implementation(HF_EXPERTS_IMPLEMENTATION)


def _hf_pipeline_parts(hf: nn.Module) -> Any:
    from ultrascale.parallel.pipeline import PipelineGap, PipelineParts

    base = hf.base_model_prefix
    paths = {id(module): name for name, module in hf.named_modules()}
    head = paths.get(id(hf.get_output_embeddings()), "lm_head")

    first_layer = f"{base}.layers.0"
    layer_outputs_checked = False

    def run(root: nn.Module, x: Any, position_ids: Any, is_first: bool) -> Any:
        nonlocal layer_outputs_checked
        # Each stage runs the model's own forward (its rotary embeddings, per-layer masks), the parts other
        # stages hold being gaps. No KV cache: training never reuses it, and packed documents are detected only
        # without one.
        kwargs = dict(position_ids=position_ids, use_cache=False)
        kwargs.update({"input_ids": x} if is_first else {"inputs_embeds": x})
        hooks = []
        if not is_first:
            # A later stage's input is the hidden state the previous stage handed on: whatever the forward does to
            # `inputs_embeds` before its first layer (Granite's embedding multiplier, added position embeddings)
            # was done on the first stage, so the first layer's place receives exactly `x`.
            def stage_input(module: nn.Module, args: tuple, layer_kwargs: dict) -> tuple:
                if args:
                    return (x, *args[1:]), layer_kwargs
                return args, {**layer_kwargs, "hidden_states": x}

            hooks.append(root.get_submodule(first_layer).register_forward_pre_hook(stage_input, with_kwargs=True))
        held = [layer for layer in root.get_submodule(f"{base}.layers") if not isinstance(layer, PipelineGap)]
        if not layer_outputs_checked:  # the stage's first forward: what its layers return does not change
            hooks.extend(layer.register_forward_hook(_hands_on_the_hidden_states_alone) for layer in held)
            layer_outputs_checked = True
        reached: dict[str, Any] = {}
        if isinstance(root.get_submodule(f"{base}.norm"), PipelineGap):
            # A stage before the last: its output is its last layer's. What the forward does after the layers is
            # the last stage's: the final norm, what comes between it and the head (MiniCPM3 divides by
            # `logits_scaling`) and after it (Gemma 2's final soft-capping, Granite's logit scaling).
            hooks.append(held[-1].register_forward_hook(lambda module, args, output: reached.update(output=output)))
        try:
            logits = root(**kwargs).logits
        finally:
            for hook in hooks:
                hook.remove()
        return reached["output"] if "output" in reached else logits

    return PipelineParts(
        root=hf, embed=f"{base}.embed_tokens", layers=f"{base}.layers", norm=f"{base}.norm", head=head, run=run
    )


def _hands_on_the_hidden_states_alone(layer: nn.Module, args: Any, output: Any) -> None:
    """A decoder layer whose output carries more than the hidden states (GLM-MoE-DSA's hand their top-k indices to
    the next layer) cannot be cut into stages: a boundary hands on the hidden states only, and a gap in a layer's
    place returns them alone where the forward unpacks a tuple."""
    if isinstance(output, (tuple, list)):
        from ultrascale.parallel.rules import not_built

        raise not_built("pipeline_layer_state", f"pipeline parallel: {type(layer).__name__.removeprefix('FSDP')} returns {len(output)} "
                        "values, the hidden states and state for the next layer, which a stage boundary would drop: "
                        "train this model without pipeline parallel")


def _hf_context_parallel(hf: nn.Module, cp: Any) -> None:
    from transformers import AttentionInterface

    from ultrascale.parallel.context_hf import CONTEXT_PARALLEL_ATTRIBUTE, HF_ATTENTION_NAME, hf_context_parallel_attention

    AttentionInterface.register(HF_ATTENTION_NAME, hf_context_parallel_attention)
    attention_modules = hf_attention_modules(hf)
    if not attention_modules:
        raise ValueError(f"context parallel: found no attention modules in {type(hf).__name__}")
    for module in attention_modules:
        setattr(module, CONTEXT_PARALLEL_ATTRIBUTE, cp)
    # A name without a mask function: transformers builds no (T, T) mask; the layout replaces it.
    hf.set_attn_implementation(HF_ATTENTION_NAME)


def _architecture_name(module: nn.Module) -> str:
    from ultrascale.models.llama import Llama

    for sub in module.modules():
        if isinstance(sub, Llama):
            return "ultrascale.Llama"
        config = getattr(sub, "config", None)
        architectures = getattr(config, "architectures", None)
        if architectures:
            return str(architectures[0])
        if type(sub).__name__.endswith("ForCausalLM") or (config is not None and hasattr(sub, "base_model_prefix")):
            return type(sub).__name__  # a Hugging Face model built from a config (no `architectures` yet)
    return "generic"


def model_facts(module: nn.Module, *, pipeline_parts: Any = None) -> ModelFacts:
    """The rulebook's facts of a built (real or meta) model, through its adapter."""
    return replace(get_adapter(module).facts(pipeline_parts=pipeline_parts), chunked_loss=fuses_head_and_loss(module))


_FACTS_CACHE: dict[str, ModelFacts] = {}


def config_facts(config: Any) -> ModelFacts:
    """The rulebook's facts of the model a config describes (a built-in `LlamaConfig` or a Hugging Face config),
    from that model built on the meta device (no memory, about a second for a 70B layout), so that the planner,
    which has only the config, judges exactly what the strategy judges on the built model. Cached per config."""
    import torch

    config = getattr(config, "text_config", None) or config
    from ultrascale.models.llama import Llama, LlamaConfig

    if isinstance(config, LlamaConfig):
        key = f"llama:{config!r}"
    else:
        key = f"hf:{type(config).__name__}:{config.to_json_string()}:{getattr(config, 'base_model_tp_plan', None)!r}"
    if key not in _FACTS_CACHE:
        with torch.device("meta"):
            if isinstance(config, LlamaConfig):
                model: nn.Module = Llama(config)
            else:
                import transformers

                model = transformers.AutoModelForCausalLM.from_config(config)
        _FACTS_CACHE[key] = model_facts(model)
    return _FACTS_CACHE[key]


@dataclass(frozen=True)
class ModelPlan:
    """What a layout means for one built model, once the rulebook accepted it: the adapter, the pipeline split
    (parts and layout) under pp, the tensor-parallel plan and whether the loss takes vocab-sharded logits."""

    adapter: ModelAdapter
    pipeline: Optional[tuple[Any, Any]]
    """(`PipelineParts`, `PipelineLayout`) under pp; None otherwise."""
    tp_plan: Optional[dict[str, Any]]
    loss_parallel: bool = False

    @property
    def sequence_parallel(self) -> bool:
        """Whether the TP plan shards the sequence between blocks."""
        from torch.distributed.tensor.parallel import SequenceParallel

        return self.tp_plan is not None and any(isinstance(style, SequenceParallel) for style in self.tp_plan.values())


def plan_model(module: nn.Module, dims: Any, knobs: Any, *, tp_plan: Optional[dict[str, Any]] = None,
               pipeline_parts: Any = None, loss_parallel_default: bool = False, owner: str = "") -> ModelPlan:
    """The rulebook's model checks for `dims` and `knobs` (`ultrascale.parallel.rules.model_problems`: raise the first,
    before any weight is communicated), then the pieces `ultrascale.parallel.parallelize` takes. The strategy's
    `check_model` and `measure_layout` both run this, so what is measured is what trains.

    `tp_plan`: the user's plan (replaces the model's); `pipeline_parts`: the module's own stage split;
    `loss_parallel_default`: loss parallel when `knobs.loss_parallel` is None (the module's loss takes DTensor
    logits), never under pp, whose last stage returns plain logits."""
    from ultrascale.parallel.pipeline import PipelineLayout
    from ultrascale.parallel.rules import model_problems, raise_first, sequence_parallel_of

    adapter = get_adapter(module)
    facts = adapter.facts(pipeline_parts=pipeline_parts)
    raise_first(model_problems(dims, knobs, facts), owner)
    pipeline = None
    if dims.pp_enabled:
        parts = pipeline_parts if pipeline_parts is not None else adapter.pipeline_parts()
        layout = PipelineLayout.build(n_layers=len(parts.layer_list()), pp=dims.pp, schedule=knobs.pipeline_schedule,
                                      virtual_stages=knobs.pipeline_virtual_stages, microbatches=knobs.pipeline_microbatches,
                                      layers_per_stage=knobs.pipeline_layers)
        pipeline = (parts, layout)
    plan, loss_parallel = None, False
    if dims.tp_enabled:
        if tp_plan is not None:
            plan, loss_parallel = tp_plan, bool(knobs.loss_parallel)
        else:
            loss_parallel = knobs.loss_parallel if knobs.loss_parallel is not None else (
                loss_parallel_default and not dims.pp_enabled)
            assert adapter.tp_plan is not None  # model_problems refused a model without one
            stage_layers = [pipeline[1].layers_of(stage) for stage in range(pipeline[1].num_stages)] if pipeline else []
            plan = adapter.tp_plan(sequence_parallel=sequence_parallel_of(knobs, facts), loss_parallel=loss_parallel,
                                   stage_layers=stage_layers)
            if not experts_over_tp(dims.ep):  # EP x TP: the experts split over ep (`ExpertParallel.dispatch`)
                from ultrascale.parallel.tensor_styles import ExpertTensorParallel

                plan = {path: style for path, style in plan.items() if not isinstance(style, ExpertTensorParallel)}
    return ModelPlan(adapter, pipeline, plan, loss_parallel)


def declared_facts(module: nn.Module, *, own_pipeline_parts: bool = False) -> Optional[ModelFacts]:
    """The rulebook's facts of the model a LightningModule declares in its `config` before building it (the built-in
    `LlamaConfig` of `LlamaLM`, the Hugging Face config of `HFCausalLM`), so a layout is checked before any process
    starts; None for a module without such a config (its built model is checked in `setup`)."""
    config = getattr(module, "config", None)
    from ultrascale.models.llama import LlamaConfig

    is_hf = hasattr(config, "model_type") and hasattr(config, "to_json_string")
    if not isinstance(config, LlamaConfig) and not is_hf:
        return None
    # Named as the user wrote it (`LlamaLM (LlamaConfig)`; asked before sharding, so not `FSDPLlamaLM`): the
    # launcher's one error points at their class.
    facts = replace(config_facts(config), name=f"{type(module).__name__} ({type(config).__name__})")
    if own_pipeline_parts:  # the module's own stage split (`ModuleContract.pipeline_parts`) replaces the adapter's
        layers = getattr(config, "n_layers", None) or getattr(config, "num_hidden_layers", None)
        facts = replace(facts, pipeline=True, n_layers=facts.n_layers or layers)
    return facts


def model_shape(model: Any, name: Optional[str] = None) -> ModelShape:
    """The one way to read a model's shape, whatever the source: a built-in Llama preset name, a Hugging Face
    folder (only config.json is read), a `LlamaConfig`, a Hugging Face config (its `text_config` for a multimodal
    one), or a module holding either as `config` (`LlamaLM`, `HFCausalLM`). ValueError saying why for anything
    else. `name`: the name shown for a built-in config (default "Llama")."""
    from ultrascale.models.llama import LLAMA_PRESETS, LlamaConfig

    if isinstance(model, str) and model in LLAMA_PRESETS:
        return ModelShape.from_llama_config(LlamaConfig.from_preset(model), name=name or f"Llama {model}")
    if isinstance(model, str):
        import os

        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model!r} is neither a built-in Llama preset ({', '.join(LLAMA_PRESETS)}) nor a folder "
                             "with a Hugging Face config.json")
        import transformers

        model = transformers.AutoConfig.from_pretrained(model, local_files_only=True)
    config = model if (isinstance(model, LlamaConfig) or hasattr(model, "model_type")) else getattr(model, "config", None)
    if isinstance(config, LlamaConfig):
        return ModelShape.from_llama_config(config, name=name or "Llama")
    if config is not None and hasattr(config, "model_type") and hasattr(config, "to_json_string"):
        return ModelShape.from_hf_config(getattr(config, "text_config", None) or config)
    raise ValueError(f"{type(model).__name__} has no `config` the planner reads (a built-in `LlamaConfig` or a "
                     "Hugging Face config)")
