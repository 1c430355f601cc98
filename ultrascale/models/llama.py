"""Reference Llama-3 decoder in plain torch (the LightningModule is `ultrascale.models.lm.LlamaLM`).

The model follows Meta's reference implementation (``llama/model.py``) closely so
that its numerics are easy to check: pre-norm RMSNorm blocks, rotary position
embeddings with Meta's *interleaved* pairing, grouped-query attention and a
SwiGLU feed-forward. Two choices are made for the parallelisms layered on top:

- Attention derives its head counts from the projected tensors, not from the
  config, so a column-sharded ``wq``/``wk``/``wv`` (tensor parallel, local
  shards of ``n_heads // tp`` heads) runs the same code.
- The causal attention kernel is its own submodule (``attention.sdpa``), so
  context parallel can swap in ring attention by module path.

``Llama`` knows nothing of Lightning: ``ultrascale.models.lm.LlamaLM`` adds the
loss, the optimizer and the schedule, and builds the model in ``configure_model``
so that sharded strategies can build it on the meta device.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ultrascale.estimate import ModelFlops, active_params, matmul_params
from ultrascale.models.moe import FeedForward, MoE
from ultrascale.parallel.device import attention_backend, grouped_sdpa
from ultrascale.parallel.documents import document_attention, document_ids, document_mask

__all__ = [
    "LLAMA_PRESETS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "ScaledDotProductAttention",
    "TransformerBlock",
    "apply_rope",
    "precompute_rope",
]


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and initialisation of a Llama-3 style decoder.

    Frozen: ``n_kv_heads=None`` is resolved to ``n_heads`` on construction; use
    ``dataclasses.replace`` (or ``from_preset(name, **overrides)``) to derive a variant.
    """

    vocab_size: int
    """Number of token ids; rows of the embedding table and columns of the output head."""

    dim: int
    """Hidden size of the residual stream (``d_model``)."""

    n_layers: int
    """Number of transformer blocks."""

    n_heads: int
    """Number of query heads; ``dim`` must be divisible by it."""

    n_kv_heads: Optional[int] = None
    """Number of key/value heads (grouped-query attention); ``None`` means ``n_heads`` (plain MHA)."""

    ffn_hidden_dim: Optional[int] = None
    """Hidden size of the SwiGLU feed-forward; ``None`` applies the Llama-3 rule (see ``resolved_ffn_hidden_dim``)."""

    multiple_of: int = 256
    """The Llama-3 rule rounds the feed-forward hidden size up to a multiple of this."""

    ffn_dim_multiplier: Optional[float] = None
    """Optional factor applied by the Llama-3 rule before rounding (1.3 for 8B/70B, 1.2 for 405B)."""

    norm_eps: float = 1e-5
    """Epsilon added to the mean square inside RMSNorm."""

    rope_theta: float = 500000.0
    """RoPE base; frequency ``i`` is ``rope_theta ** (-2i / head_dim)``."""

    max_seq_len: int = 2048
    """Longest sequence the precomputed RoPE tables cover; longer inputs raise."""

    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output head."""

    init_std: float = 0.02
    """Std of the normal init of embeddings and linear weights (residual outputs are scaled down by depth)."""

    n_experts: int = 0
    """Routed experts per block (Mixture-of-Experts, `ultrascale.models.moe.MoE`); 0 = the dense feed-forward."""

    moe_top_k: int = 2
    """Experts each token is routed to."""

    n_shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek-MoE), as one SwiGLU of that width."""

    moe_hidden_dim: Optional[int] = None
    """Hidden size of each expert's SwiGLU; None: ``resolved_ffn_hidden_dim``."""

    moe_capacity_factor: Optional[float] = None
    """None: dropless (every token reaches its k experts). A number c: each expert takes at most
    ceil(c * tokens * k / n_experts) token copies of a forward; the rest are dropped (GShard)."""

    moe_load_balance: str = "aux_loss"
    """"aux_loss" (a balance loss, `moe_aux_loss_coef`), "aux_free" (DeepSeek-V3's selection bias
    moved by `moe_bias_update_rate` after each step) or "none"."""

    moe_aux_loss_coef: float = 0.01
    """Weight of the sequence-wise balance loss (see `ultrascale.parallel.expert`)."""

    moe_bias_update_rate: float = 1e-3
    """Step of the aux-loss-free bias update, ``b_i += rate * sign(mean load - load_i)``."""

    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss ``logsumexp(logits)^2`` per token (ST-MoE); 0 = off."""

    moe_normalize_weights: bool = True
    """Renormalise the chosen experts' router probabilities to sum to 1 (Mixtral)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig: `{name}={value!r}` must be a positive integer.")
        if self.ffn_hidden_dim is not None and (not isinstance(self.ffn_hidden_dim, int) or self.ffn_hidden_dim <= 0):
            raise ValueError(
                f"LlamaConfig: `ffn_hidden_dim={self.ffn_hidden_dim!r}` must be a positive integer or None."
            )
        for name in ("norm_eps", "rope_theta", "init_std"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig: `{name}={getattr(self, name)!r}` must be positive.")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(f"LlamaConfig: `ffn_dim_multiplier={self.ffn_dim_multiplier!r}` must be positive or None.")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"LlamaConfig: `dim={self.dim}` must be divisible by `n_heads={self.n_heads}` "
                f"(head_dim = dim / n_heads)."
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: `n_heads={self.n_heads}` must be divisible by `n_kv_heads={self.n_kv_heads}` "
                f"(each key/value head serves n_heads / n_kv_heads query heads)."
            )
        if self.n_experts:
            self._check_moe()
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaConfig: head_dim = `dim={self.dim}` / `n_heads={self.n_heads}` = {self.head_dim} "
                f"must be even (RoPE rotates pairs of channels)."
            )

    def _check_moe(self) -> None:
        from ultrascale.parallel.expert import LOAD_BALANCE_MODES

        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"LlamaConfig: `n_experts={self.n_experts!r}` must be a non-negative integer (0 = dense).")
        if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= self.n_experts:
            raise ValueError(f"LlamaConfig: `moe_top_k={self.moe_top_k!r}` must be between 1 and `n_experts={self.n_experts}`.")
        if self.moe_load_balance not in LOAD_BALANCE_MODES:
            raise ValueError(f"LlamaConfig: `moe_load_balance={self.moe_load_balance!r}`; choose one of {LOAD_BALANCE_MODES}.")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ValueError(f"LlamaConfig: `moe_capacity_factor={self.moe_capacity_factor!r}` must be positive or None (dropless).")
        for name in ("n_shared_experts",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"LlamaConfig: `{name}={getattr(self, name)!r}` must be a non-negative integer.")
        for name in ("moe_aux_loss_coef", "moe_bias_update_rate", "moe_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"LlamaConfig: `{name}={getattr(self, name)!r}` must be >= 0.")
        if self.moe_hidden_dim is not None and (not isinstance(self.moe_hidden_dim, int) or self.moe_hidden_dim <= 0):
            raise ValueError(f"LlamaConfig: `moe_hidden_dim={self.moe_hidden_dim!r}` must be a positive integer or None.")

    @property
    def resolved_moe_hidden_dim(self) -> int:
        """Hidden size of each expert: ``moe_hidden_dim`` if set, else ``resolved_ffn_hidden_dim``."""
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.resolved_ffn_hidden_dim

    @property
    def head_dim(self) -> int:
        """Channels per attention head: ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def resolved_ffn_hidden_dim(self) -> int:
        """``ffn_hidden_dim`` if set, else Meta's Llama-3 rule.

        ``h = int(2 * 4 * dim / 3)``, then ``h = int(ffn_dim_multiplier * h)`` if set,
        then rounded up to a multiple of ``multiple_of``; the 2/3 keeps the three
        SwiGLU matrices at the parameter count of a 4x two-matrix MLP.
        """
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """Build the named preset from ``LLAMA_PRESETS``, with ``overrides`` replacing its fields."""
        if name not in LLAMA_PRESETS:
            raise ValueError(f"Unknown Llama preset `{name!r}`; valid presets: {', '.join(sorted(LLAMA_PRESETS))}.")
        return cls(**{**LLAMA_PRESETS[name], **overrides})


# A LlamaConfig in a checkpoint's hyper-parameters is plain data: let `torch.load(weights_only=True)`
# rebuild it (checkpoint folders are read as data, `ultrascale.parallel.safe_load`).
torch.serialization.add_safe_globals([LlamaConfig])

# Meta's published params.json values. The Llama-3 feed-forward sizes follow from the
# rule in `resolved_ffn_hidden_dim`: 8B -> 14336, 70B -> 28672, 405B -> 53248.
# 405B is a Llama-3.1 model whose long-context RoPE scaling is not implemented here,
# so all three keep the original 8192-token context.
LLAMA_PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, max_seq_len=256),
    # 8 experts, 2 per token: splits over ep = 1, 2, 4, 8.
    "tiny_moe": dict(
        vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, max_seq_len=256,
        n_experts=8, moe_top_k=2, moe_hidden_dim=64,
    ),
    "small": dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden_dim=512, max_seq_len=1024),
    "llama3_8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3_70b": dict(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3_405b": dict(
        vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
        ffn_dim_multiplier=1.2, multiple_of=4096, rope_theta=500000.0, max_seq_len=8192,
    ),
    # Mistral's published Mixtral-8x7B shape (config.json) on the built-in MoE block: every layer
    # has 8 SwiGLU experts of 14336, 2 per token, router weights renormalised over the chosen two
    # (46,702,792,704 parameters, as Mistral's checkpoint). For Mixtral's own weights use HFCausalLM.
    "mixtral_8x7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
        rope_theta=1000000.0, max_seq_len=32768, n_experts=8, moe_top_k=2, moe_aux_loss_coef=0.02,
    ),
}


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares over thousands of bf16 channels loses precision:
        # normalise in fp32, cast back, then scale (Meta's order of operations).
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: Optional[torch.device] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``(cos, sin)``, each fp32 of shape ``(max_seq_len, head_dim // 2)``.

    Entry ``[t, i]`` is the angle ``t * theta ** (-2i / head_dim)`` (Su et al. 2021),
    computed in fp32 as Meta's reference does so converted checkpoints match bit for bit.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"precompute_rope: `head_dim={head_dim}` must be even.")
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # (max_seq_len, head_dim // 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(..., T, head_dim)`` by the angles in ``cos``/``sin`` of shape ``(T, head_dim // 2)``.

    Meta's interleaved convention: channels ``(2i, 2i + 1)`` form the complex number
    ``x[2i] + 1j * x[2i + 1]``, multiplied by ``exp(1j * angle[t, i])``. Hugging Face
    Llama pairs channel ``i`` with ``i + head_dim / 2`` instead ("rotate_half"); HF
    checkpoints therefore need their ``wq``/``wk`` rows permuted on conversion.
    The rotation runs in fp32 and is cast back to ``x``'s dtype.
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (..., T, head_dim // 2, 2)
    real, imag = pairs.unbind(-1)  # each (..., T, head_dim // 2)
    cos, sin = cos.float(), sin.float()
    # (real + i*imag) * (cos + i*sin) = (real*cos - imag*sin) + i*(real*sin + imag*cos)
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)  # (..., T, head_dim // 2, 2)
    return rotated.flatten(-2).type_as(x)  # (..., T, head_dim)


def document_causal_mask(positions: torch.Tensor) -> Optional[torch.Tensor]:
    """``(B, 1, T, T)`` bool mask for packed documents: query t may attend to key s iff s <= t and
    both lie in the same document; a document starts wherever ``positions`` (B, T) is 0.
    None when no row restarts after its first token (plain causal attention suffices)."""
    documents = document_ids(positions)
    return None if documents is None else document_mask(documents)


class ScaledDotProductAttention(nn.Module):
    """Causal attention kernel with grouped-query heads; the swap point for ring attention (context parallel)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``q``: ``(B, n_heads, T, head_dim)``; ``k``, ``v``: ``(B, n_kv_heads, T, head_dim)``; returns q's shape.

        With ``enable_gqa`` query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``,
        the same as ``k.repeat_interleave(n_rep, dim=1)`` but without materialising the copies.
        ``documents`` (``(B, T)`` document number of each token, `document_ids`) confines each packed
        document's attention to itself (`parallel.documents.document_attention`: one causal call per document).
        """
        if documents is None:
            if attention_backend(q.device, q.dtype) == "flash":
                return flash_causal_attention(q, k, v)
            return grouped_sdpa(q, k, v, is_causal=True)
        return document_attention(q, k, v, documents)


def flash_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """flash-attn 2's causal kernel on SDPA's layout; GQA is native (query head h reads kv head h // n_rep)."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)  # (B, T, n_heads, head_dim)
    return out.transpose(1, 2)  # (B, n_heads, T, head_dim)


class Attention(nn.Module):
    """Multi-head causal self-attention with RoPE and grouped-query key/value heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        # Head counts come from the projections' widths, so under tensor parallel the
        # local shards (n_heads // tp query heads, n_kv_heads // tp kv heads) just work.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, n_local_heads, T, head_dim)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, n_local_kv_heads, T, head_dim)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, n_local_kv_heads, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.sdpa(q, k, v, documents)  # (B, n_local_heads, T, head_dim)
        out = out.transpose(1, 2).flatten(2)  # (B, T, n_local_heads * head_dim)
        return self.wo(out)  # (B, T, dim)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, ``out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, config: LlamaConfig) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if config.n_experts:

            self.feed_forward: nn.Module = MoE(config, layer_id)
        else:
            self.feed_forward = FeedForward(config.dim, config.resolved_ffn_hidden_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        # `documents` goes by keyword: tensor-parallel plans describe the positional inputs (x, cos, sin).
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


# --------------------------------------------------------------------------- model


class Llama(nn.Module):
    """Llama-3 decoder: ``tokens (B, T) -> logits (B, T, vocab_size)``.

    Built on the meta device it allocates nothing; after ``to_empty(device=...)``
    call ``init_weights()`` to fill parameters and the RoPE tables.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, config) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.document_masks = True
        """Build per-document causal masks from restarting ``positions``; False when the attention
        kernel derives them itself (context parallel sees only its share of the sequence)."""
        # One table for all blocks; non-persistent because it is derived from the config.
        cos, sin = precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta, self.output.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, head_dim // 2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, head_dim // 2)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables from the global torch RNG.

        Embeddings and linear weights ~ N(0, init_std); the residual-branch outputs
        (``wo``, ``w2``) use ``init_std / sqrt(2 * n_layers)`` so the residual stream's
        variance stays O(1) with depth (GPT-2, torchtitan); norms are ones.
        On the meta device only the re-tying runs: torch decomposes `normal_` on meta tensors op by op (about 6 ms
        a call, seconds for a 405B layout that the planner builds only to read its structure).
        Under pipeline parallel only the parts this rank holds are initialised (a part another stage holds is a
        placeholder without weights), so their values differ from one device's with the same seed.
        """
        config = self.config
        embedding = self.tok_embeddings if isinstance(self.tok_embeddings, nn.Embedding) else None
        head = self.output if isinstance(self.output, nn.Linear) else None
        # `to_empty` creates new Parameters per module, which silently unties a shared weight. A sharded one
        # (DTensor) is the strategy's: it keeps its ties itself, and under a V pipeline schedule with ZeRO-3 the
        # head holds a copy of the embedding's on purpose (`ultrascale.parallel.pipeline.TiedStageWeights`).
        if (config.tie_embeddings and embedding is not None and head is not None and head.weight is not embedding.weight
                and not isinstance(head.weight, DTensor)):
            head.weight = embedding.weight
        if any(p.is_meta for p in self.parameters()):
            return
        residual_std = config.init_std / math.sqrt(2 * config.n_layers)
        if embedding is not None:
            nn.init.normal_(embedding.weight, mean=0.0, std=config.init_std)
        for layer in self.layers:
            if not isinstance(layer, TransformerBlock):
                continue
            attention, ffn = layer.attention, layer.feed_forward
            dense = [ffn] if isinstance(ffn, FeedForward) else [f for f in [ffn.shared_experts] if f is not None]
            for linear in (attention.wq, attention.wk, attention.wv, *(f.w1 for f in dense), *(f.w3 for f in dense)):
                nn.init.normal_(linear.weight, mean=0.0, std=config.init_std)
            for linear in (attention.wo, *(f.w2 for f in dense)):
                nn.init.normal_(linear.weight, mean=0.0, std=residual_std)
            if not isinstance(ffn, FeedForward):  # MoE: router like an input projection, experts like w1/w3 and w2
                nn.init.normal_(ffn.router.gate.weight, mean=0.0, std=config.init_std)
                ffn.router.expert_bias.zero_()
                nn.init.normal_(ffn.experts.gate_up_proj, mean=0.0, std=config.init_std)
                nn.init.normal_(ffn.experts.down_proj, mean=0.0, std=residual_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        if isinstance(self.norm, RMSNorm):
            self.norm.reset_parameters()
        if head is not None and not config.tie_embeddings:
            nn.init.normal_(head.weight, mean=0.0, std=config.init_std)
        cos, sin = precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta, self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, head: bool = True) -> torch.Tensor:
        """``tokens``: LongTensor ``(B, T)``; returns logits ``(B, T, vocab_size)`` in the compute dtype, or with
        ``head=False`` the final norm's output ``(B, T, dim)`` (for `ultrascale.chunked_token_loss` with `output`).

        ``positions`` selects the RoPE rows: ``(T,)`` when the local sequence is not
        ``0..T-1`` (e.g. a context-parallel chunk), or ``(B, T)`` per sequence. A ``(B, T)``
        tensor that restarts at 0 marks packed documents: each then attends only to itself
        (a per-document causal mask), as if it were alone. Default ``arange(T)``.
        """
        # After the first pipeline stage the input is the hidden state (B, T, dim) and the embedding
        # is a `PipelineGap` that passes it through (`ultrascale.parallel.pipeline`).
        if tokens.dim() != 2 and not (tokens.dim() == 3 and tokens.is_floating_point()):
            raise ValueError(f"Llama expects tokens of shape (B, T), got {tuple(tokens.shape)}.")
        seq_len = tokens.shape[1]
        documents = None
        if positions is None:
            if seq_len > self.config.max_seq_len:
                raise ValueError(
                    f"Sequence length {seq_len} exceeds `max_seq_len={self.config.max_seq_len}`; "
                    f"raise `max_seq_len` in the LlamaConfig."
                )
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # (T, head_dim // 2)
        elif positions.dim() == 1:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (T, head_dim // 2)
        else:
            cos = self.rope_cos[positions].unsqueeze(1)  # (B, 1, T, head_dim // 2): broadcast over heads
            sin = self.rope_sin[positions].unsqueeze(1)
            documents = document_ids(positions) if self.document_masks else None
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin, documents=documents)
        h = self.norm(h)
        return self.output(h) if head else h  # (B, T, vocab_size) or (B, T, dim)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (a tied matrix counted once); ``exclude_embedding`` drops the input embedding table."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_facts(self) -> ModelFlops:
        """What `ultrascale.estimate.model_flops` (the one FLOP count: MFU, `ultrascale plan`) reads from this model:
        ``N`` = matmul weights (the embedding lookup excluded, the output head kept, also when it is tied: a tied
        head shares the matrix `matmul_params` skips, but it is a matmul; MoE experts at top-k of E), the layers
        and the attention width."""
        c = self.config
        n = active_params(self, experts_per_token=c.moe_top_k, num_experts=c.n_experts) if c.n_experts else matmul_params(self)
        n += self.output.weight.numel() if c.tie_embeddings else 0
        source = f"Llama config (MoE: {c.moe_top_k} of {c.n_experts} experts active)" if c.n_experts else "Llama config"
        return ModelFlops(n, c.n_layers, c.n_heads * c.head_dim, source)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, ``6 N + 12 L h s`` (`flops_facts`)."""
        return int(self.flops_facts().per_token(seq_len))


_MOVED_TO_LM = ("CausalLMModule", "LlamaLM", "adamw_warmup_cosine", "warmup_cosine")


def __getattr__(name: str) -> Any:
    # Configs written before the split name `ultrascale.models.llama.LlamaLM`; keep them loading.
    if name in _MOVED_TO_LM:
        import warnings

        from ultrascale.models import lm

        warnings.warn(
            f"`ultrascale.models.llama.{name}` moved to `ultrascale.models.lm.{name}` "
            f"(also `ultrascale.models.{name}`); update the import or the recipe's class_path",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(lm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
