"""The one rule for the dtype a sum is taken in: fp32 at least, the input's own where it is wider.

bf16 and fp32 inputs accumulate in fp32 (a bf16 log-softmax over a large vocabulary, or a bf16 merge of
attention blocks, is lossy); fp64 inputs (`precision="64-true"`, `rules.CHECKING_PRECISION`) stay fp64, so a
check of a layout in fp64 is not rounded to fp32 on the way (which would put fp32's 1e-7 back into it).
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or `dtype` where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in `accumulation_dtype` (itself when it already is)."""
    return tensor.to(accumulation_dtype(tensor.dtype))


__all__ = ["accumulation_dtype", "upcast"]
