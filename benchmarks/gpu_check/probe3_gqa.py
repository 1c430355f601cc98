"""Issue 48 item 3: GQA attention in fp32 or with a mask: does SDPA need its math kernel, and at what memory?"""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import DEV, banner, guarded, init_one_rank, load  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

banner("item 3 GQA math fallback")
llama = load("ultrascale.models.llama")
context = load("ultrascale.parallel.context")
mesh = init_one_rank()
SMALL = os.environ.get("SMALL") == "1"
H, KV, D = (8, 2, 32) if SMALL else (32, 8, 128)
GIB = 2**30


def positions_for(t, docs):
    return torch.arange(t // docs, device=DEV).repeat(docs).unsqueeze(0) if docs > 1 else torch.arange(t, device=DEV)[None]


def llama_attention(q, k, v, docs):
    mask = llama.document_causal_mask(positions_for(q.shape[2], docs)) if docs > 1 else None
    return llama.ScaledDotProductAttention()(q, k, v, mask)


def llama_attention_repeated_kv(q, k, v, docs):
    """The same call with K/V repeated to the query heads: what a non-GQA kernel would need (the expectation)."""
    g = q.shape[1] // k.shape[1]
    return llama_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), docs)


def ulysses(q, k, v, docs):
    cp = context.ContextParallel(mesh, "alltoall")
    batch = {"input_ids": torch.zeros(1, q.shape[2], dtype=torch.long, device=DEV)}
    if docs > 1:
        batch["position_ids"] = positions_for(q.shape[2], docs)
    cp.shard_batch(batch)
    return cp.attention(q, k, v)


def run(fn, t, dtype, docs, restricted):
    torch.manual_seed(0)
    q = torch.randn(1, H, t, D, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, KV, t, D, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    if DEV.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]) if restricted else contextlib.nullcontext()
    with ctx:
        out = fn(q, k, v, docs)
        out.float().sum().backward()
    peak = None
    if DEV.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
    return bool(torch.isfinite(out).all()), peak


CASES = [
    ("llama attention, packed docs mask", llama_attention, 4),
    ("llama attention, no mask (is_causal)", llama_attention, 1),
    ("Ulysses alltoall cp1, packed docs", ulysses, 4),
    ("Ulysses alltoall cp1, no docs", ulysses, 1),
    ("EXPECTATION: llama attention, docs mask, K/V repeated (no GQA)", llama_attention_repeated_kv, 4),
]
dtypes = (torch.float32, torch.bfloat16)
t_small = 256
print(f"--- restricted to sdpa_kernel([FLASH, EFFICIENT]), T={t_small}, H={H}, KV={KV}, D={D}, B=1")
for label, fn, docs in CASES:
    for dtype in dtypes:
        tag = f"item3 restricted {label} {str(dtype).split('.')[-1]} T{t_small}"
        r = guarded(tag, run, fn, t_small, dtype, docs, True)
        if r is not None:
            print(f"RESULT {tag}: runs without math (finite {r[0]})", flush=True)

t_big = 512 if SMALL or DEV.type == "cpu" else 8192
print(f"--- unrestricted (torch picks), forward+backward peak memory above inputs, T={t_big}, H={H}, KV={KV}, D={D}, B=1")
for label, fn, docs in CASES:
    for dtype in dtypes:
        for restricted in (False, True):
            tag = f"item3 memory {label} {str(dtype).split('.')[-1]} T{t_big} {'[FLASH,EFFICIENT]' if restricted else 'any backend'}"
            r = guarded(tag, run, fn, t_big, dtype, docs, restricted)
            if r is not None:
                peak = f"{r[1]:.3f} GiB" if r[1] is not None else "n/a (cpu)"
                print(f"RESULT {tag}: peak {peak} (finite {r[0]})", flush=True)
math_scores = H * t_big * t_big * 4 / GIB
print(f"note: one fp32 (B,H,T,T) score tensor at T={t_big}, H={H} is {math_scores:.2f} GiB; "
      f"q+k+v+out+grads in fp32 ~ {(2 * (2 * H + 2 * KV) * t_big * D * 4) / GIB:.3f} GiB", flush=True)
