"""Device-dependent choices, made in one place so the same code runs gloo on CPU and NCCL on CUDA."""

from __future__ import annotations

import functools
import importlib.util
import platform
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13 names the single-tensor collectives `*_single` and deprecates the `*_tensor` spellings.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA devices (GPU-direct collectives), gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a tensor must live to go through a collective over `group`: this process's CUDA device
    under NCCL (which only moves device tensors), the CPU otherwise. For the tensors a rank makes up
    when it holds nothing to contribute (no gradients on this stage, no buckets)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collectives_carry_float8(device: torch.device) -> bool:
    """Whether a DTensor redistribution may move float8 tensors: NCCL sends their bytes; gloo refuses the dtype
    ("Invalid scalar type"), so on CPU fp8 values are all-gathered after the cast, in the training precision."""
    return device.type == "cuda"


def symmetric_memory_available(device: torch.device) -> bool:
    """Whether async tensor parallel can run on `device`: inductor's micro-pipeline pass fuses TP's all-gathers and
    reduce-scatters into torch's symmetric-memory kernels (`symm_mem::fused_all_gather_matmul`, ...), which are CUDA
    kernels over NCCL groups."""
    return device.type == "cuda" and dist.is_nccl_available()


def enable_symmetric_memory(group: dist.ProcessGroup) -> None:
    """Symmetric memory for `group`'s ranks, which the micro-pipeline pass requires of a collective before fusing it."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group.group_name)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a Lightning precision name (`trainer.precision`) runs its matmuls in: bf16 for `bf16-*`, fp16 for
    `16-*`, fp64 for `64-true`, fp32 otherwise."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


CPU_HALF_SEQUENCE_MULTIPLE = 64
"""The default rounding of a batch's length on CPU in bf16/fp16. oneDNN, which runs torch's CPU half-precision
matmuls, builds a kernel for each new shape and caches it: measured (torch 2.13, 2-core Xeon with AMX) 4.5 ms for
the first bf16 `[344, K] @ [K, 64]` of a new K and 0.3 ms after, against 1.1 and 0.8 ms in fp32. A padding-free row
of each batch's own length is a new shape for every matmul of the step: the 140k-parameter Qwen2 of
benchmarks/peers/sft_throughput.py, bf16-mixed, one process, took 0.13 s a step at a multiple of 1, 0.08-0.11 at 64
and 0.084 at 128; in fp32 64 was slower (0.073 s against 0.060: the padding, with no kernel to save)."""


def sequence_length_multiple(device: torch.device, dtype: torch.dtype = torch.float32) -> int:
    """What a padded batch's length is rounded up to by default: 8 on CUDA (tensor cores take matmul dimensions in
    multiples of 8, as transformers' `pad_to_multiple_of=8` advice has it); on CPU `CPU_HALF_SEQUENCE_MULTIPLE` in
    half precision (`dtype`, the compute dtype: lengths that repeat reuse oneDNN's kernels), 1 in fp32."""
    if device.type == "cuda":
        return 8
    return CPU_HALF_SEQUENCE_MULTIPLE if dtype in (torch.bfloat16, torch.float16) else 1


def pins_host_memory(device: torch.device) -> bool:
    """Whether data loaders feeding `device` pin their batches: page-locked host memory copies to a GPU
    asynchronously (Lightning moves batches with non_blocking=True); pinning for the CPU only costs."""
    return device.type == "cuda"


def async_checkpoint_backend() -> str:
    """The backend of the process group asynchronous checkpoint saves run their collectives on: gloo, on
    CPU and CUDA alike. DCP's `async_save` plans and gathers in a background thread while training uses
    the default group, so the save needs a group of its own, and it requires a CPU backend (its
    collectives exchange Python objects staged in host memory)."""
    return "gloo"


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)


def tune_cpu_allocator(trim_threshold: int = 256 * 2**20, mmap_threshold: int = 64 * 2**20) -> bool:
    """Stop glibc from returning freed heap memory to the OS after every step on CPU.

    With glibc's defaults a training step's activations are freed, the heap top is trimmed
    back to the OS, and the next step faults every page in again: measured here (benchmarks/
    overhead.py) as ~2x the minor page faults and 3-8% of a tiny model's step. Keeping up to
    `trim_threshold` bytes of freed heap and serving blocks below `mmap_threshold` from the
    heap removes that; the cost is that much freed memory kept per process. Returns False
    where the C library is not glibc (nothing changed). CUDA memory is unaffected.
    """
    import ctypes
    import ctypes.util

    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the MoE experts run as one `torch._grouped_mm` per projection (else a loop over experts).

    CPU: forward and backward in fp32 and bf16 (measured, torch 2.13). CUDA: bf16 on SM80+ (torch's
    kernels are written for it; fp32 takes the loop). Where torch lacks the op: the loop.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return False


FLOAT8_MIN_CAPABILITY = (8, 9)  # torch._scaled_mm's fp8 tensor cores: Ada, Hopper, Blackwell
FLOAT8_ROWWISE_CAPABILITY = (9, 0)  # its rowwise-scaled kernels are built for Hopper and later


def float8_matmul_support(device: torch.device, recipe: str) -> tuple[Optional[str], Optional[str]]:
    """(why fp8 training cannot run on `device`, or None; a caution about `recipe` there, or None).
    CPU runs torchao's emulated fp8 (the tests' path); a CUDA GPU needs fp8 tensor cores."""
    if device.type != "cuda":
        return None, None
    capability = torch.cuda.get_device_capability(device)
    shown = f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
    if capability < FLOAT8_MIN_CAPABILITY:
        return (f"fp8 matmuls need a GPU of compute capability {'.'.join(map(str, FLOAT8_MIN_CAPABILITY))} or later "
                f"(Ada, Hopper, Blackwell); {shown}"), None
    if recipe == "rowwise" and capability < FLOAT8_ROWWISE_CAPABILITY:
        return None, (f"torch's rowwise-scaled fp8 matmul is built for compute capability "
                      f"{'.'.join(map(str, FLOAT8_ROWWISE_CAPABILITY))}+ and {shown}")
    return None, None


@functools.lru_cache(maxsize=1)
def flash_attn_installed() -> bool:
    """Whether the optional `flash-attn` package (the `gpu` extra) can be imported."""
    return importlib.util.find_spec("flash_attn") is not None


def cuda_matmul_in_tf32() -> bool:
    """Whether CUDA runs fp32 matmuls in TF32: torch's `torch.backends.cuda.matmul.fp32_precision` ("tf32"; "none"
    inherits `torch.backends.fp32_precision`), or the legacy `allow_tf32` on a torch without them. torch 2.13 raises on
    a read of `allow_tf32` once the new setting was used, so the new one is read wherever it exists."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision
    except AttributeError:  # torch < 2.9
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "ieee")
    return precision == "tf32"


def attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The attention kernel for this device and compute dtype: "flash" or "sdpa".

    "flash" (Dao's flash-attn 2) where it runs: a CUDA device of compute capability 8.0+ (Ampere
    and later), fp16/bf16 inputs, flash-attn installed. Everywhere else torch's SDPA, which on
    CUDA picks its own flash / memory-efficient kernels and on CPU its fused kernel.
    """
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not flash_attn_installed():
        return "sdpa"
    return "flash" if torch.cuda.get_device_capability(device) >= (8, 0) else "sdpa"


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                 is_causal: bool = False, scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for grouped-query heads (k, v with fewer heads than q, query head h reading
    kv head h // groups).

    On CUDA only torch's flash kernel takes `enable_gqa`, and it runs neither fp32 nor a mask: with either, SDPA
    falls back to its math kernel, O(B·H·T²) memory (32.5 GiB for one T=8192, H=32 fp32 call on an H200, against
    1.25 GiB with K/V repeated). There K and V are repeated to the query heads (O(B·H·T·D) more), which keeps the
    memory-efficient kernel. Elsewhere (CPU, or bf16 without a mask) `enable_gqa` reads them in place.

    On CPU, bf16/fp16 heads narrower than `CPU_HALF_ATTENTION_MIN_HEAD_DIM` are attended in fp32 and the result cast
    back: torch's CPU flash kernel is slower in half precision there than in fp32 (and its math kernel in between),
    and fp32 is the more exact of the two."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.device.type == "cuda" and (attn_mask is not None or q.dtype == torch.float32):
        k, v, groups = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 1
    if (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] < CPU_HALF_ATTENTION_MIN_HEAD_DIM):
        with torch.autocast("cpu", enabled=False):  # autocast would cast the fp32 inputs back to half
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                                 dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                                 enable_gqa=groups > 1)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=groups > 1)


# Forward + backward of causal SDPA on one core of a 2-core Xeon with AMX (torch 2.13, 2026-12-03), 4 heads, the
# documents of one padding-free row one call each: head size 16, 11 documents of 1,200 tokens: flash bf16 23-33 ms,
# math bf16 19 ms, flash fp32 7-10 ms; head size 64, 8 x 130 tokens: 26-39, 21, 15-18 ms; head size 128 (8 heads,
# 2 x 512): flash bf16 59-61 ms, fp32 91-120 ms. Below 128 fp32 is the faster.
CPU_HALF_ATTENTION_MIN_HEAD_DIM = 128


def hf_attention_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """`attn_implementation` for a Hugging Face model: `attention_backend` in transformers' names."""
    return "flash_attention_2" if attention_backend(device, dtype) == "flash" else "sdpa"
