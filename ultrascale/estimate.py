"""Analytic model of training cost: model-state bytes, FLOPs per token, peak device FLOP/s.

Plain arithmetic (no Lightning, no process group), so the callbacks, `ultrascale plan`
and the tests all read the same formulas. Symbols, as in the Ultra-Scale Playbook:
Ψ (or N) = parameter count, L = transformer layers, h = hidden size, s = sequence length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

__all__ = [
    "ModelFlops",
    "ModelStateEstimate",
    "STATE_BYTES",
    "activation_bytes_per_layer",
    "PEAK_TFLOPS",
    "active_params",
    "estimate_model_state_bytes",
    "find_peak_tflops",
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


# (weight, gradient, optimizer) bytes per parameter under Adam, by precision and ZeRO family,
# as ultrascale holds them: FSDP2 (ZeRO-3) keeps fp32 sharded weights and casts gathered
# copies to bf16; ZeRO-1/2 keep bf16 weights and fp32 masters inside the optimizer state.
STATE_BYTES: dict[tuple[str, str], tuple[int, int, int]] = {
    ("32-true", "fsdp"): (4, 4, 8),
    ("32-true", "zero12"): (4, 4, 8),
    ("bf16-mixed", "fsdp"): (4, 4, 8),
    ("bf16-mixed", "zero12"): (2, 2, 12),
    ("bf16-true", "fsdp"): (2, 2, 4),
    ("bf16-true", "zero12"): (2, 2, 4),
}


def activation_bytes_per_layer(
    seq_len: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1, sequence_parallel: bool = True,
    full_recompute: bool = False, attention_scores_saved: bool = False,
) -> float:
    """Activation bytes one rank keeps per transformer layer in 16-bit (Korthikanti et al. 2022, Table 2).

    No recompute:  s·b·h·(34 + 5·a·s/h) / tp  with sequence parallel,
                   s·b·h·(10 + 24/tp + 5·a·s/(h·tp))  without it.
    Full recompute: only the layer input, 2·s·b·h (/tp with sequence parallel).
    The 5·a·s/h term is the s x s attention scores and softmax, which fused kernels (flash,
    SDPA's memory-efficient path) do not keep: counted only with `attention_scores_saved`.
    A GPT-style estimate: a SwiGLU MLP saves somewhat more.
    """
    sbh = seq_len * micro_batch * hidden
    if full_recompute:
        return 2 * sbh / (tp if sequence_parallel else 1)
    attention_scores = 5 * heads * seq_len / hidden if attention_scores_saved else 0.0
    if sequence_parallel:
        return sbh * (34 + attention_scores) / tp
    return sbh * (10 + 24 / tp + attention_scores / tp)


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
    from ultrascale.models.llama import Llama

    for sub in module.modules():
        if isinstance(sub, Llama):
            c = sub.config
            # A tied head shares the embedding matrix that `matmul_params` skips, but it is a matmul.
            n = active_params(sub, experts_per_token=c.moe_top_k, num_experts=c.n_experts) if c.n_experts else matmul_params(sub)
            n += sub.output.weight.numel() if c.tie_embeddings else 0
            source = f"Llama config (MoE: {c.moe_top_k} of {c.n_experts} experts active)" if c.n_experts else "Llama config"
            return ModelFlops(n, c.n_layers, c.n_heads * c.head_dim, source)
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is a dependency, but the formula must not need it
        return None
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if not isinstance(config, PretrainedConfig) or not hasattr(config, "num_hidden_layers"):
            continue
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
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
        return ModelFlops(n, config.num_hidden_layers, heads * head_dim, source)
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
    """Parameters that enter a matmul: all of them except embedding tables and 1-D tensors (norms, biases).

    DTensor parameters (TP) report their global size, so the count is the whole model's.
    A tied embedding/head matrix is counted once here; callers add it back for the head.
    """
    skip = {id(p) for m in exclude for p in m.parameters()}
    skip |= {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) in seen or id(p) in skip or p.dim() < 2:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


_EXPERT_PATH = re.compile(r"(^|\.)experts(\.|$)")


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


# Dense (no 2:4 sparsity) tensor-core peaks in TFLOP/s per device, from the vendors' spec
# sheets, whose headline figures for bf16/fp8/tf32 are "with sparsity" = 2x these:
#   NVIDIA H100 SXM5 / PCIe datasheet (H200 SXM has the H100 SXM compute, more HBM),
#   NVIDIA A100 datasheet (no fp8), NVIDIA DGX/HGX B200 datasheet (per GPU),
#   NVIDIA L4 datasheet, AMD Instinct MI300X datasheet.
# fp16 equals bf16 on all of them. Keys are matched against torch.cuda.get_device_name().
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "tf32": 60.0},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7},
}

# Device-name patterns -> table key, most specific first ("H100 PCIe" before any H100,
# the NVL variants have lower clocks and are left to the `peak_tflops` override).
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100(?!.*NVL)", "H100 SXM"),
    (r"H200(?!.*NVL)", "H200"),
    (r"A100", "A100"),
    (r"B200", "B200"),
    (r"\bL4\b", "L4"),
    (r"MI300X", "MI300X"),
)


def find_peak_tflops(device_name: str, dtype: str) -> Optional[tuple[str, float]]:
    """``(table key, dense TFLOP/s)`` for a device name such as "NVIDIA H100 80GB HBM3"; None if unknown."""
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            peak = PEAK_TFLOPS[key].get(dtype)
            return None if peak is None else (key, peak)
    return None

