"""Analytic model of training cost: model-state bytes, FLOPs per token (device peaks: `ultrascale.hardware`).

Plain arithmetic (no Lightning, no process group), so the callbacks, `ultrascale plan`
and the tests all read the same formulas. Symbols, as in the Ultra-Scale Playbook:
Ψ (or N) = parameter count, L = transformer layers, h = hidden size, s = sequence length.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

__all__ = [
    "ActivationModel",
    "ModelFlops",
    "ModelShape",
    "ModelStateEstimate",
    "ADAMW_KERNEL",
    "STATE_BYTES",
    "ZERO12_BYTES",
    "state_bytes",
    "active_params",
    "estimate_model_state_bytes",
    "flops_per_token",
    "matmul_params",
    "model_flops",
    "recompute_flops_per_token",
]


# --------------------------------------------------------------------------- model state


@dataclass(frozen=True)
class ModelStateEstimate:
    """Bytes one rank is expected to hold for parameters, gradients and optimizer state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def estimate_model_state_bytes(
    num_params: int,
    *,
    zero_stage: int,
    shard_degree: int,
    model_parallel_degree: int = 1,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> ModelStateEstimate:
    """ZeRO model-state memory per rank (Rajbhandari et al. 2020; Playbook "ZeRO" section).

    Each of Ψ parameters costs `param_bytes` (weights), `grad_bytes` (gradient) and
    `optimizer_bytes` (Adam: two fp32 moments = 8; mixed precision adds a 4-byte fp32
    master copy, i.e. 12, when the weights themselves are 2-byte). Over `shard_degree`
    ranks ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the
    weights; stage 0 is plain data parallel. TP/PP split Ψ first (`model_parallel_degree`
    = tp * pp), ignoring the small replicated norms.

        ZeRO-3, fp32 Adam:  (4 + 4 + 8) Ψ / (tp * pp * N_shard)
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"estimate_model_state_bytes: `zero_stage={zero_stage!r}` must be 0, 1, 2 or 3")
    if shard_degree < 1 or model_parallel_degree < 1:
        raise ValueError(
            f"estimate_model_state_bytes: `shard_degree={shard_degree}` and "
            f"`model_parallel_degree={model_parallel_degree}` must be >= 1"
        )
    psi = num_params / model_parallel_degree
    optim_div = shard_degree if zero_stage >= 1 else 1
    grad_div = shard_degree if zero_stage >= 2 else 1
    param_div = shard_degree if zero_stage >= 3 else 1
    return ModelStateEstimate(
        params=psi * param_bytes / param_div,
        grads=psi * grad_bytes / grad_div,
        optimizer=psi * optimizer_bytes / optim_div,
    )


ADAMW_KERNEL: dict[str, bool] = {"fused": True}
"""How the built-in modules' AdamW runs (`models.lm.adamw_warmup_cosine`; `measure` builds the same): torch's fused
kernel, one launch per parameter group, as torchtitan runs it. foreach's step holds a temporary the size of the
parameters it updates (4 bytes each, measured), and on DTensor parameters its seven foreach ops each pay a sharding
propagation at the first step: 2.5 s of a 9.5 s 10-step ZeRO-3 fit of the tiny Llama on CPU, fused 0.2 s."""

STATE_BYTES: dict[str, tuple[int, int, int]] = {"32-true": (4, 4, 8), "bf16-mixed": (4, 4, 8), "bf16-true": (2, 2, 4)}
"""(weight, gradient, optimizer) bytes per parameter under Adam of FSDP2 (ZeRO-3), by precision: fp32 sharded weights
cast to bf16 when gathered under bf16-mixed."""
ZERO12_BYTES: dict[str, tuple[int, int]] = {"32-true": (4, 8), "bf16-mixed": (2, 12), "bf16-true": (2, 4)}
"""(weight, optimizer) bytes per parameter under Adam of ZeRO-1/2, by precision: bf16 weights under bf16-mixed, with
the fp32 masters inside the optimizer state (4 + 8); their gradients' bytes follow `parallel.zero.zero12_dtypes`."""


def state_bytes(precision: str, zero_stage: int, accumulate_grads_in_fp32: Optional[bool] = None) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter of a layout: ZeRO-3's (`STATE_BYTES`), or ZeRO-1/2's with
    the gradients the strategy's `accumulate_grads_in_fp32` makes (`parallel.zero.zero12_dtypes`: None is fp32 under
    bf16-mixed: 2 + 4 + 12)."""
    if zero_stage == 3:
        return STATE_BYTES[precision]
    from ultrascale.parallel.zero import zero12_dtypes

    weight, optimizer = ZERO12_BYTES[precision]
    accumulate_dtype = zero12_dtypes(precision, accumulate_grads_in_fp32)[1]
    return weight, (accumulate_dtype.itemsize if accumulate_dtype is not None else weight), optimizer


# --------------------------------------------------------------------------- FLOPs


def flops_per_token(n_matmul_params: float, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L h s`` (PaLM appendix B; Playbook "MFU").

    ``6 N``: every matmul weight costs 2 FLOPs per token forward and 4 backward (grad of
    input and of weight). ``12 L h s``: the attention scores ``QK^T`` and ``AV``, each
    ``2 s h`` FLOPs per token forward, x3 for forward + backward, over L layers; the full
    ``s x s`` square is counted although a causal kernel skips half of it (the convention
    of PaLM, Megatron and torchtitan). For MoE, ``N`` is the *active* parameters.
    """
    return 6 * n_matmul_params + 12 * n_layers * hidden * seq_len


class ModelFlops:
    """FLOPs per token of one model as a function of the sequence length (`flops_per_token`)."""

    def __init__(self, n_matmul_params: float, n_layers: int, hidden: int, source: str) -> None:
        self.n_matmul_params, self.n_layers, self.hidden, self.source = n_matmul_params, n_layers, hidden, source

    def per_token(self, seq_len: int) -> float:
        return flops_per_token(self.n_matmul_params, self.n_layers, self.hidden, seq_len)

    def __repr__(self) -> str:
        return f"ModelFlops(N={self.n_matmul_params}, layers={self.n_layers}, attention width={self.hidden}, {self.source})"


def model_flops(module: nn.Module) -> Optional[ModelFlops]:
    """FLOPs model of the built-in Llama or a Hugging Face model found inside `module`; None if neither.

    The one FLOP count of ultrascale: the MFU callback, `ultrascale plan` and
    `Llama.flops_per_token` all use it. ``N`` = matmul parameters (embedding lookups
    excluded, the LM head included also when tied; MoE experts at top-k/E), the attention
    width is ``heads x head_dim`` (the width of ``QK^T``, which differs from the hidden size
    in some HF models). Meta-device modules work: only shapes are read.
    """
    for sub in module.modules():
        facts = getattr(sub, "flops_facts", None)  # the built-in Llama counts itself (`Llama.flops_facts`)
        if callable(facts):
            return facts()
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is a dependency, but the formula must not need it
        return None
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if not isinstance(config, PretrainedConfig) or not hasattr(config, "num_hidden_layers"):
            continue
        heads = getattr(config, "num_attention_heads", None)  # none in an attention-free model (RWKV): 6N alone
        width = heads * hf_head_dim(config) if heads else 0
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if experts and top_k:
            n = active_params(sub, experts_per_token=top_k, num_experts=experts)
            source = f"{type(config).__name__} (MoE: {top_k} of {experts} experts active)"
        else:
            n, source = matmul_params(sub), type(config).__name__
        # A tied LM head shares the embedding matrix that `matmul_params` skips, but it is a matmul.
        if getattr(config, "tie_word_embeddings", False) and hasattr(sub, "get_output_embeddings"):
            head = sub.get_output_embeddings()
            n += head.weight.numel() if head is not None else 0
        return ModelFlops(n, config.num_hidden_layers, width, source if heads else f"{source} (no attention)")
    return None


def recompute_flops_per_token(
    recomputed_matmul_params: float, recomputed_attention_layers: int, hidden: int, seq_len: int
) -> float:
    """Extra FLOPs per token spent re-running forward regions under activation checkpointing.

    A recomputed region costs its forward once more: ``2 P`` for its matmul weights
    plus ``4 h s`` for each attention core it contains (``QK^T`` and ``AV`` forward).
    Full AC on every block gives ``2 N_blocks + 4 L h s``, i.e. HFU FLOPs ~= 8N + 16 L h s.
    Selective AC keeps every matmul/attention output, so it recomputes no matmul: 0.
    """
    return 2 * recomputed_matmul_params + 4 * recomputed_attention_layers * hidden * seq_len


def matmul_params(module: nn.Module, *, exclude: Iterable[nn.Module] = ()) -> int:
    """Parameters that enter a matmul: all of them except embedding tables, 1-D tensors (norms, biases) and
    vectors shaped to broadcast, (1, 1, h) (RWKV's time-mixing coefficients).

    DTensor parameters (TP) report their global size, so the count is the whole model's.
    A tied embedding/head matrix is counted once here; callers add it back for the head.
    """
    skip = {id(p) for m in exclude for p in m.parameters()}
    skip |= {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen or id(p) in skip or p.dim() < 2 or (p.dim() > 2 and all(n == 1 for n in p.shape[:-1])):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


_EXPERT_PATH = re.compile(r"(^|\.)experts(\.|$)")


def hf_head_dim(config: Any) -> Optional[int]:
    """The width of one attention head of a Hugging Face config: its `head_dim`, else hidden / heads; None for a
    model without attention heads (RWKV)."""
    heads = getattr(config, "num_attention_heads", None)
    return (getattr(config, "head_dim", None) or config.hidden_size // heads) if heads else None


def active_params(module: nn.Module, *, experts_per_token: int, num_experts: int) -> int:
    """Matmul parameters a token actually uses in an MoE model (Switch / Mixtral convention).

    Expert weights (any parameter under a submodule named ``experts``) count
    ``experts_per_token / num_experts`` of their size; everything else (attention,
    router, dense layers, head) counts fully.
    """
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(
            f"active_params: `experts_per_token={experts_per_token}` must be between 1 and `num_experts={num_experts}`"
        )
    expert = sum(p.numel() for name, p in module.named_parameters() if p.dim() >= 2 and _EXPERT_PATH.search(name))
    return matmul_params(module) - expert + expert * experts_per_token // num_experts


# --------------------------------------------------------------------------- peak FLOP/s


# --------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """The sizes the cost model needs, read from a built-in `LlamaConfig` or a Hugging Face config.

    Covers Llama-style decoders: GQA attention (optional q/k/v bias, q/k norms), a gated
    (SwiGLU/GeGLU) or plain MLP, MoE layers with routed and shared experts, tied or untied
    head. `param_counts` gives the parameters per component, which the tests hold equal to
    the real modules' `numel()`.
    """

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    qkv_bias: bool = False
    qk_norm_params: int = 0
    """Per-layer parameters of q/k norms (Qwen3, Gemma3: 2·head_dim; OLMo2: (heads + kv_heads)·head_dim)."""
    norms_per_layer: int = 2
    n_experts: int = 0
    top_k: int = 0
    expert_hidden: int = 0
    shared_expert_hidden: int = 0
    shared_expert_gate: bool = False
    moe_layers: int = 0
    """Layers whose MLP is a MoE (the others are dense with `ffn_hidden`)."""
    builtin: bool = True
    """The built-in Llama (sequence parallel and loss parallel under TP) or a Hugging Face model (neither)."""
    model_type: str = "llama"
    config: Any = field(default=None, compare=False, repr=False)
    """The config this shape was read from (a `LlamaConfig` or a Hugging Face config): the rulebook judges the
    model it describes (`ultrascale.models.adapters.config_facts`)."""

    # -- parameters per component -----------------------------------------------------------

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Per layer: wq, wk, wv, wo (+ q/k/v biases, q/k norms)."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        return h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0) + self.qk_norm_params

    @property
    def dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    @property
    def expert_params(self) -> int:
        """Per MoE layer: every routed expert's gate, up and down matrices."""
        return self.n_experts * 3 * self.hidden * self.expert_hidden

    @property
    def router_params(self) -> int:
        """Per MoE layer: the router, the shared experts and their gate (all replicated across ep)."""
        return self.hidden * self.n_experts + 3 * self.hidden * self.shared_expert_hidden + (self.hidden if self.shared_expert_gate else 0)

    @property
    def norm_params(self) -> int:
        return self.norms_per_layer * self.hidden

    def param_counts(self) -> dict[str, int]:
        """Parameters of the whole model per component (embedding, head, and each per-layer kind x layers)."""
        counts = self.__dict__.get("_param_counts")  # a planner search asks hundreds of thousands of times
        if counts is None:
            counts = self._count_params()
            object.__setattr__(self, "_param_counts", counts)
        return dict(counts)

    def _count_params(self) -> dict[str, int]:
        dense_layers = self.n_layers - self.moe_layers
        return {
            "embedding": self.vocab * self.hidden,
            "head": 0 if self.tied_embeddings else self.vocab * self.hidden,
            "final_norm": self.hidden,
            "attention": self.n_layers * self.attention_params,
            "norms": self.n_layers * self.norm_params,
            "mlp": dense_layers * self.dense_mlp_params,
            "experts": self.moe_layers * self.expert_params,
            "router": self.moe_layers * self.router_params,
        }

    @property
    def num_params(self) -> int:
        return sum(self.param_counts().values())

    def active_matmul_params(self) -> float:
        """``N`` of the FLOP count: matmul weights a token uses (see `model_flops`), experts at top_k/E.

        Norms, biases and the embedding lookup are not matmuls; a tied head is (counted once here)."""
        h = self.hidden
        attention = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        experts = self.expert_params * self.top_k // self.n_experts if self.n_experts else 0
        per_moe = experts + self.router_params  # the router, shared experts and their gate are dense matmuls
        return (
            self.n_layers * attention
            + (self.n_layers - self.moe_layers) * self.dense_mlp_params
            + self.moe_layers * per_moe
            + self.vocab * h
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, the same formula as the MFU callback (`flops_per_token`)."""
        return flops_per_token(self.active_matmul_params(), self.n_layers, self.q_width, seq_len)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_llama_config(cls, config: object, name: str = "Llama") -> "ModelShape":
        c = config
        moe = bool(getattr(c, "n_experts", 0))
        return cls(
            name=name, n_layers=c.n_layers, hidden=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim, ffn_hidden=c.resolved_ffn_hidden_dim, vocab=c.vocab_size,
            tied_embeddings=c.tie_embeddings,
            n_experts=c.n_experts if moe else 0, top_k=c.moe_top_k if moe else 0,
            expert_hidden=c.resolved_moe_hidden_dim if moe else 0,
            shared_expert_hidden=c.resolved_moe_hidden_dim * c.n_shared_experts if moe else 0,
            moe_layers=c.n_layers if moe else 0, builtin=True, config=config,
        )

    @classmethod
    def from_hf_config(cls, config: object) -> "ModelShape":
        """A Hugging Face decoder's shape, read from the model itself built on the meta device (no memory): its
        layers' norms, q/k norms and projection biases, which layers are MoE, the experts' and shared experts'
        widths. Sizes the config states (heads, head size, hidden, vocabulary) come from the config.

        The shape's parameter count is then held to the model's own (within 1%): ValueError, saying what differs,
        for a decoder whose layers this cost model does not describe (multi-head latent attention, learned
        positions), so the planner never prices a model it misreads. Cached per config."""
        c = config
        per_layer = getattr(c, "per_layer_config", None)  # transformers' heterogeneous configs (Gemma 4)
        if per_layer is not None and len({getattr(layer, "head_dim", None) for layer in per_layer}) > 1:
            widths = sorted({getattr(layer, "head_dim", None) for layer in per_layer})
            raise ValueError(f"ModelShape: {type(c).__name__} gives its layers different head widths ({widths}); the cost "
                             "model prices layers of one shape")
        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [key for key in needed if not hasattr(c, key)]
        if missing:
            raise ValueError(f"ModelShape: the Hugging Face config {type(c).__name__} has no {missing}")
        key = f"{type(c).__name__}:{c.to_json_string()}"
        if key not in _HF_SHAPE_CACHE:
            _HF_SHAPE_CACHE[key] = _read_hf_shape(cls, c)
        shape = _HF_SHAPE_CACHE[key]
        return shape if shape.config is config else dataclasses.replace(shape, config=config)


_HF_SHAPE_CACHE: dict[str, "ModelShape"] = {}


def _read_hf_shape(cls: type, c: Any) -> "ModelShape":
    import torch
    import transformers

    model_type = getattr(c, "model_type", "?")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(c)
    layers = _decoder_layers(model)
    if layers is None:
        raise ValueError(f"ModelShape: {type(model).__name__} has no list of decoder layers the cost model reads")
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = hf_head_dim(c)
    layer = layers[0]
    attention = next((m for name, m in layer.named_children() if "attn" in name or "attention" in name), None)
    projections = dict(attention.named_children()) if attention is not None else {}
    if not ({"q_proj", "k_proj", "v_proj"} <= set(projections) or "qkv_proj" in projections):
        raise ValueError(
            f"ModelShape: {type(model).__name__}'s attention ({type(attention).__name__}) has no q/k/v projections "
            f"({sorted(projections)}: multi-head latent or linear attention): the cost model prices grouped-query attention only")
    qkv_bias = any(getattr(projections.get(name), "bias", None) is not None for name in ("q_proj", "k_proj", "qkv_proj"))
    qk_norm_params = sum(p.numel() for name, m in projections.items() if "norm" in name for p in m.parameters())
    norms = sum(1 for name, m in layer.named_children() if "norm" in type(m).__name__.lower() or "norm" in name)
    moe = [_experts_of(block) for block in layers]
    moe_layers = sum(1 for experts in moe if experts is not None)
    n_experts = expert_hidden = shared_hidden = 0
    shared_gate = False
    if moe_layers:
        block = layers[next(i for i, experts in enumerate(moe) if experts is not None)]
        experts = moe[moe.index(next(e for e in moe if e is not None))]
        n_experts = experts.gate_up_proj.shape[0]
        expert_hidden = experts.gate_up_proj[0].numel() // (2 * c.hidden_size)
        for name, sub in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("shared_expert", "shared_experts") and hasattr(sub, "down_proj"):
                shared_hidden += sub.down_proj.in_features
            shared_gate |= leaf == "shared_expert_gate"
    dense = next((block for block, experts in zip(layers, moe) if experts is None), None)
    down = getattr(getattr(dense, "mlp", None), "down_proj", None)
    ffn_hidden = down.in_features if isinstance(down, nn.Linear) else (getattr(c, "intermediate_size", None) or 0)
    shape = cls(
        name=model_type, n_layers=c.num_hidden_layers, hidden=c.hidden_size, n_heads=heads, n_kv_heads=kv_heads,
        head_dim=head_dim, ffn_hidden=ffn_hidden, vocab=c.vocab_size,
        tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)), qkv_bias=qkv_bias, qk_norm_params=qk_norm_params,
        norms_per_layer=norms, n_experts=n_experts, top_k=getattr(c, "num_experts_per_tok", 0) if n_experts else 0,
        expert_hidden=expert_hidden, shared_expert_hidden=shared_hidden, shared_expert_gate=shared_gate,
        moe_layers=moe_layers, builtin=False, model_type=model_type, config=c,
    )
    actual = sum(p.numel() for p in model.parameters())
    if abs(shape.num_params - actual) > 0.01 * actual:
        raise ValueError(
            f"ModelShape: the cost model counts {shape.num_params:,} parameters for {type(model).__name__}, the model "
            f"has {actual:,} ({shape.param_counts()}): its layers hold what the cost model does not describe")
    return shape


def _decoder_layers(model: nn.Module) -> Optional[nn.ModuleList]:
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def _experts_of(block: nn.Module) -> Optional[nn.Module]:
    """The fused experts module of a decoder layer (``gate_up_proj`` (E, ...)), or None for a dense layer."""
    for sub in block.modules():
        weight = getattr(sub, "gate_up_proj", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 3:
            return sub
    return None


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationModel:
    """Bytes of the tensors autograd keeps for backward on one rank, per micro-batch, term by term.

    Counted from what ultrascale's Llama block saves (checked against saved-tensor
    measurement on CPU, tests/test_planner.py), with s = this rank's sequence (s/cp),
    b = micro-batch, c = bytes of the compute dtype, t = tp, r = t under sequence parallel
    else 1 (the divisor of sequence-sharded tensors):

    - each RMSNorm: its fp32 input (4·sbh/r) and normalised output (c·sbh/r), and the matmul
      input it feeds (c·sbh; all-gathered to the full sequence under SP);
    - attention: q, k, v after RoPE and the output + its contiguous copy for wo:
      c·sb(3q + 2kv)/t (q = heads·head_dim, kv = kv_heads·head_dim);
    - SwiGLU: w1 out, silu out, w3 out, their product: 4c·sbf/t; a MoE layer's experts the same
      over the s·b·k routed copies plus their gathered inputs and outputs: c·sbk(2h + 4f_e);
    - the loss, at the start of the backward: the saved fp32 log-softmax, the gradient coming in
      and the one going out (3 x 4 bytes) and the logits' gradient in the compute dtype,
      (c + 12)·sbV (12·sbV in fp32, where that gradient is the fp32 one: measured with VmHWM,
      benchmarks/results/memory_at_scale.md); with loss parallel (c + 20)·sbV/t, since DTensor's vocabulary-parallel
      cross-entropy keeps two more fp32 tensors of the sharded logits (measured under
      `FakeTensorMode` on the 8B preset at tp=2). With the head and the loss fused in chunks
      (`loss_chunk_tokens`, each chunk differentiated in forward) the same of one chunk, min(sb, chunk)
      tokens instead of sb, and the hidden states' gradient it stores (c·sbh).

    Full recompute keeps only each block's input (c·sbh/r) and re-runs one block at a time.
    Selective recompute keeps matmul and attention outputs and re-runs norms and activations.
    A budget (`recompute="budget"`) mixes them per block: `recompute_blocks` = how many of the rank's blocks run
    full, selective and none (`ActivationCheckpointing(memory_budget_gib=)`).
    """

    shape: ModelShape
    seq_len: int
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    compute_bytes: int = 2
    recompute: str = "none"
    attention_scores_saved: bool = False
    """Eager attention (no fused kernel) also keeps the s x s scores and their softmax: 2c·b·a·s²/t per layer."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the fused head and loss (`parallel.loss.loss_chunk_tokens_of`); 0: the whole logits."""
    recompute_blocks: Optional[tuple[int, int, int]] = None
    """Under `recompute="budget"`: the rank's blocks run (full, selective, none); None there: none chosen yet, priced
    as nothing recomputed (the lower bound of a search)."""

    def _sizes(self) -> tuple[float, int, int, float]:
        sb = self.seq_len * self.micro_batch
        r = self.tp if self.sequence_parallel else 1
        return sb, self.tp, r, self.compute_bytes

    def layer_bytes(self, moe: bool = False) -> float:
        """One layer with nothing recomputed."""
        sh, (sb, t, r, c) = self.shape, self._sizes()
        h, q, kv = sh.hidden, sh.q_width, sh.kv_width
        norms = 2 * ((4 + c) * sb * h / r + c * sb * h)
        attention = c * sb * (3 * q + 2 * kv) / t + 4 * sb * sh.n_heads / t  # + the fp32 log-sum-exp
        if self.attention_scores_saved:
            attention += 2 * c * sb * self.seq_len * sh.n_heads / t
        if moe:
            k = sh.top_k
            # token copies (replicated over tp), each expert's intermediate split over tp (expert tensor parallel)
            mlp = c * sb * k * (2 * h + 4 * sh.expert_hidden / t) + 4 * sb * sh.n_experts
            mlp += 4 * c * sb * sh.shared_expert_hidden / t
        else:
            mlp = (4 if sh.gated_mlp else 2) * c * sb * sh.ffn_hidden / t
        return norms + attention + mlp

    def kept_layer_bytes(self, moe: bool = False, mode: Optional[str] = None) -> float:
        """What one layer keeps between its forward and backward under `mode` (default `recompute`; one of
        none, selective, full)."""
        sh, (sb, t, r, c) = self.shape, self._sizes()
        mode = self.recompute if mode is None else mode
        block_input = c * sb * sh.hidden / r
        if mode == "full":
            return block_input
        if mode == "selective":
            h, q, kv = sh.hidden, sh.q_width, sh.kv_width
            matmuls = c * sb * (2 * q + 2 * kv) / t + 4 * sb * sh.n_heads / t + 2 * c * sb * h
            if moe:
                matmuls += c * sb * sh.top_k * (h + 2 * sh.expert_hidden) + 2 * c * sb * sh.shared_expert_hidden
            else:
                matmuls += (2 if sh.gated_mlp else 1) * c * sb * sh.ffn_hidden / t
            return block_input + matmuls
        return self.layer_bytes(moe)

    def recompute_peak_bytes(self, moe: bool = False) -> float:
        """Extra bytes while one block's forward is re-run in backward (none without recompute):
        its full set of activations and the residual stream's incoming and outgoing gradient."""
        if self.recompute == "none" or (self.recompute == "budget" and not any((self.recompute_blocks or (0, 0))[:2])):
            return 0.0
        sb, t, r, c = self._sizes()
        return self.layer_bytes(moe) + 2 * c * sb * self.shape.hidden / r

    def blocks_by_mode(self, layers: int) -> dict[str, int]:
        """How many of a rank's `layers` blocks run each recompute mode."""
        if self.recompute != "budget":
            return {self.recompute: layers}
        if self.recompute_blocks is None:
            return {"none": layers}
        if sum(self.recompute_blocks) != layers:
            raise ValueError(f"ActivationModel: recompute_blocks={self.recompute_blocks} are not the rank's {layers} blocks")
        return dict(zip(("full", "selective", "none"), self.recompute_blocks))

    def peak_bytes(self, layers: int, *, in_flight: float = 1.0, with_loss: bool = True, moe_fraction: float = 0.0) -> float:
        """Activation peak of a rank running `layers` blocks with `in_flight` micro-batches alive.

        Either at the end of the forward (every kept layer plus the loss's tensors) or while the
        backward re-runs one block (every kept layer plus that block's full set), whichever is larger."""
        kept = sum(n * (moe_fraction * self.kept_layer_bytes(True, mode) + (1 - moe_fraction) * self.kept_layer_bytes(False, mode))
                   for mode, n in self.blocks_by_mode(layers).items())
        rerun = self.recompute_peak_bytes(moe_fraction > 0) if layers else 0.0
        return in_flight * kept + max(self.loss_bytes() if with_loss else 0.0, rerun)

    def loss_bytes(self) -> float:
        """The final norm, the head's input and the logits (c + 12 bytes per element at the loss's backward)."""
        sh, (sb, t, r, c) = self.shape, self._sizes()
        chunked = 0 < self.loss_chunk_tokens < sb
        tokens = self.loss_chunk_tokens if chunked else sb
        cast = c if c < 4 else 0  # the logits' gradient cast back to a 16-bit compute dtype; none in fp32
        logits = (cast + 20) * tokens * sh.vocab / t if self.loss_parallel and t > 1 else (cast + 12) * tokens * sh.vocab
        return (4 + c) * sb * sh.hidden / r + (2 if chunked else 1) * c * sb * sh.hidden + logits
