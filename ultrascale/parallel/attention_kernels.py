"""The attention kernels context parallel computes each block with: attention that also returns the log-sum-exp of
every query row, and its backward given the *merged* output and log-sum-exp (`ultrascale.parallel.context`).
One pair per device type (`attention_kernel`: torch's CPU flash kernel; on CUDA the flash kernel where it applies and
the memory-efficient one, with the stride and alignment fixes an H200 run found, elsewhere) and a written-out one for
logit soft-capping (`softcap_kernel`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ultrascale.parallel.numerics import upcast
from ultrascale.parallel.rules import not_built

# (out, lse) = forward(q, k, v, causal, bias, scale):  q (B, H, Tq, D), k/v (B, Hkv, Tk, D),
#   bias None or additive (B|1, 1, Tq, Tk) in q's dtype; out (B, H, Tq, D), lse (B, H, Tq) fp32 (fp64 for fp64 q).
# (dq, dk, dv) = backward(dout, q, k, v, out, lse, causal, bias, scale) with the *merged* out and lse.


def _cpu_forward(q, k, v, causal, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, causal, bias, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # (B, Hkv, T, D) -> (B, Hkv * groups, T, D), query head h reading kv head h // groups.
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _aligned_bias(bias: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> Optional[torch.Tensor]:
    """`bias` (B|1, 1, Tq, Tk) expanded to the heads, its rows in memory padded to a multiple of 8 elements: the
    efficient kernel reads the bias in aligned vectors (it refuses a row stride not a multiple of 8 in 16 bits, of 4 in
    fp32: measured on an H200 with Tk = 37), as torch's public SDPA pads it."""
    if bias is None:
        return None
    tk = k.shape[2]
    if tk % 8:
        bias = F.pad(bias, (0, 8 - tk % 8))[..., :tk]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], tk)


def _heads_inner(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) with the memory of (B, T, H, D), the layout of both CUDA kernels' own output. The efficient one's backward
    computes rowsum(dO * O) assuming it for `out` and `dout` (the merged (B, H, T, D)-contiguous out of the ring gave
    dQ and dK 50-75 % off in bf16/fp16 on an H200; fp32 takes another path)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq) fp32 log-sum-exp padded to the kernel's own (B, H, ceil(Tq / 32) * 32): its backward reads it with
    that head stride (37 query rows raised "LSE is not correctly aligned (strideH)" on an H200)."""
    return F.pad(lse, (0, -lse.shape[-1] % 32)).contiguous()


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: Optional[torch.Tensor]) -> bool:
    """Whether a block goes to CUDA's flash kernel: no bias (it takes none: documents and windows stay with the
    efficient kernel), a head width that is a multiple of 8 (the raw op does not pad it, SDPA does), and whatever
    torch's own rule for flash says of these tensors (16-bit, head width at most 256, the GPU's generation, grouped
    heads, strides, `torch.backends.cuda.enable_flash_sdp`). Causal blocks are the ring's own square ones, where
    flash's bottom-right causal alignment is the top-left one."""
    if bias is not None or q.shape[-1] % 8 or (causal and q.shape[2] != k.shape[2]):
        return False
    # Asked as for training (torch refuses flash's backward for some head widths on some GPUs), so that forward and
    # backward, whose own tensors do not require grad, choose alike.
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, q.shape[1] != k.shape[1])
    return torch.backends.cuda.can_use_flash_attention(params, False)


def _flash_forward(q, k, v, causal, scale):
    # Grouped heads natively: K/V are not repeated. lse comes as (B, H, Tq) fp32.
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    # No dropout: the generator state is never read; these are the shapes the forward returns (cum_seq None: no
    # variable-length batch, so max_q/max_k are not read either). dK/dV come summed onto the kv heads.
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _heads_inner(dout), q, k, v, _heads_inner(out), lse.contiguous(), None, None, q.shape[2], k.shape[2],
        0.0, causal, seed, offset, scale=scale,
    )
    return dq, dk, dv


def _efficient_forward(q, k, v, causal, bias, scale):
    # torch's memory-efficient kernel: fp32/bf16/fp16, additive bias, equal head counts.
    groups = q.shape[1] // k.shape[1]
    bias = _aligned_bias(bias, q, k)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()


def _efficient_backward(dout, q, k, v, out, lse, causal, bias, scale):
    groups = q.shape[1] // k.shape[1]
    bias = _aligned_bias(bias, q, k)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: never read
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _heads_inner(dout), q, repeat_kv(k, groups), repeat_kv(v, groups), bias, _heads_inner(out),
        _padded_lse(lse), seed, offset,
        0.0, [True, True, True, False], causal, scale=scale,
    )
    if groups > 1:  # the repeated heads' gradients sum back onto their kv head
        dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], groups)).sum(2)
    return dq, dk, dv


# The flash blocks have not met a GPU in this project's tests (the efficient kernel has, on an H200). Until they have,
# each process checks the first flash call of every kind against the efficient kernel on the same inputs. A layout
# defect is tens of percent off (the efficient kernel's own was 50-75 %); two correct 16-bit kernels differ by ~1e-3.
FLASH_CHECK_TOLERANCE = 5e-2  # relative norm error
_flash_checked: set[tuple[Any, ...]] = set()


def _checked_against_efficient(kind: tuple[Any, ...], names: tuple[str, ...], got: tuple[torch.Tensor, ...],
                               efficient: Any) -> tuple[torch.Tensor, ...]:
    if kind in _flash_checked:
        return got
    errors = {name: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
              for name, a, b in zip(names, got, efficient())}
    if max(errors.values()) > FLASH_CHECK_TOLERANCE:
        figures = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
        raise RuntimeError(
            f"context parallel: CUDA's flash kernel disagrees with the memory-efficient kernel on a {kind[0]} block "
            f"({kind[1]}, head width {kind[2]}, {kind[3]} query heads per kv head, causal={kind[4]}): relative errors "
            f"{figures}. `torch.backends.cuda.enable_flash_sdp(False)` keeps the ring on the efficient kernel; "
            "please report this with the figures."
        )
    _flash_checked.add(kind)
    return got


def _cuda_forward(q, k, v, causal, bias, scale):
    if not _flash_takes(q, k, v, causal, bias):
        return _efficient_forward(q, k, v, causal, bias, scale)
    kind = ("forward", q.dtype, q.shape[-1], q.shape[1] // k.shape[1], causal)
    return _checked_against_efficient(kind, ("out", "lse"), _flash_forward(q, k, v, causal, scale),
                                      lambda: _efficient_forward(q, k, v, causal, None, scale))


def _cuda_backward(dout, q, k, v, out, lse, causal, bias, scale):
    if not _flash_takes(q, k, v, causal, bias):
        return _efficient_backward(dout, q, k, v, out, lse, causal, bias, scale)
    kind = ("backward", q.dtype, q.shape[-1], q.shape[1] // k.shape[1], causal)
    return _checked_against_efficient(kind, ("dQ", "dK", "dV"), _flash_backward(dout, q, k, v, out, lse, causal, scale),
                                      lambda: _efficient_backward(dout, q, k, v, out, lse, causal, None, scale))


_KERNELS = {"cpu": (_cpu_forward, _cpu_backward), "cuda": (_cuda_forward, _cuda_backward)}


def _softcap_scores(q, k, causal, bias, scale, softcap):
    """(S, T): T = tanh(scale·QKᵀ / c), S = c·T masked (-inf where the bias or causality hides a key)."""
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    raw = (upcast(q) @ upcast(k).transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    tanh = torch.tanh(raw / softcap)
    scores = tanh * softcap
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return scores, tanh


def softcap_kernel(softcap: float) -> tuple[Any, Any]:
    """(forward, backward) of attention with logit soft-capping (Gemma 2: S = c·tanh(scale·QKᵀ/c)), written out in
    the kernels' (out, lse) form, since no fused kernel soft-caps. Backward, with the merged out O and lse L:
    P = exp(S - L), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), through the cap dS_raw = dS ∘ (1 - tanh²),
    dQ = scale·dS_raw K, dK = scale·dS_rawᵀ Q. Memory O(Tq·Tk) per block and head: a reference kernel."""

    def forward(q, k, v, causal, bias, scale):
        scores, _ = _softcap_scores(q, k, causal, bias, scale, softcap)
        lse = torch.logsumexp(scores, dim=-1)  # (B, H, Tq); -inf for a row that sees no key
        probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
        out = probs @ upcast(repeat_kv(v, q.shape[1] // v.shape[1]))
        return out.to(q.dtype), lse

    def backward(dout, q, k, v, out, lse, causal, bias, scale):
        groups = q.shape[1] // k.shape[1]
        scores, tanh = _softcap_scores(q, k, causal, bias, scale, softcap)
        probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))  # (B, H, Tq, Tk)
        dout, out = upcast(dout), upcast(out)
        dv = probs.transpose(-1, -2) @ dout  # (B, H, Tk, Dv)
        dprobs = dout @ upcast(repeat_kv(v, groups)).transpose(-1, -2)
        dscores = probs * (dprobs - (dout * out).sum(-1, keepdim=True))
        draw = dscores * (1 - tanh * tanh) * (scale if scale is not None else q.shape[-1] ** -0.5)
        dq = draw @ upcast(repeat_kv(k, groups))
        dk = draw.transpose(-1, -2) @ upcast(q)
        if groups > 1:  # the repeated heads' gradients sum back onto their kv head
            dk, dv = (x.unflatten(1, (k.shape[1], groups)).sum(2) for x in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    return forward, backward


def attention_kernel(device: torch.device) -> tuple[Any, Any]:
    """(forward, backward) of the attention-with-LSE kernel for `device`: the one place that chooses it."""
    if device.type not in _KERNELS:
        raise not_built("context_parallel_device", f"context parallel has no attention kernel for device type {device.type!r}")
    return _KERNELS[device.type]
