"""Device-dependent choices, made in one place so the same code runs gloo on CPU and NCCL on CUDA."""

from __future__ import annotations

import torch


def process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA devices (GPU-direct collectives), gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
