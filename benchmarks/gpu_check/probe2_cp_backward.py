"""Issue 48 item 2: context-parallel attention backward (CUDA mem-efficient kernel) in fp32/bf16/fp16 vs SDPA."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import DEV, banner, fmt, guarded, init_one_rank, load, rel  # noqa: E402

banner("item 2 CP backward")
context = load("ultrascale.parallel.context")
mesh = init_one_rank()
SMALL = os.environ.get("SMALL") == "1"
B, T, D = (1, 64, 32) if SMALL else (2, 256, 64)


def reference(q, k, v, dout):
    """fp64 autograd of causal attention on the upcast inputs (GQA by repeat)."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1), is_causal=True)
    out.backward(dout.double())
    return out.detach(), qd.grad, kd.grad, vd.grad


def plain_sdpa(q, k, v, dout):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


def cp_path(method, q, k, v, dout):
    cp = context.ContextParallel(mesh, method)
    local = cp.shard_batch({"input_ids": torch.zeros(q.shape[0], q.shape[2], dtype=torch.long, device=DEV)})
    index = local["position_ids"][0]
    assert torch.equal(index.cpu(), torch.arange(q.shape[2])), index
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = cp.attention(qq, kk, vv)
    out.backward(dout)
    return out.detach(), qq.grad, kk.grad, vv.grad


def kernel_path(variant, q, k, v, dout):
    fwd, bwd = context.attention_kernel(DEV)
    scale = q.shape[-1] ** -0.5
    out, lse = fwd(q, k, v, True, None, scale)
    strides = out.stride()
    if variant == "native out":
        o = out
    elif variant == "out.contiguous() (B,H,T,D)":
        o = out.contiguous()
    elif variant == "fp32 merge then .to(dtype) (what CP does)":
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device).add_(out.float()).to(q.dtype)
    elif variant == "(B,T,H,D)-strided copy of out":
        o = out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv = bwd(dout.contiguous(), q, k, v, o, lse, True, None, scale)
    return out, dq, dk, dv, strides, o.stride()


for dtype in (torch.float32, torch.bfloat16, torch.float16):
    if DEV.type == "cpu" and dtype == torch.float16:
        continue
    for heads, kv_heads in ((8, 8), (8, 2)):
        torch.manual_seed(0)
        q = torch.randn(B, heads, T, D, device=DEV, dtype=dtype)
        k, v = (torch.randn(B, kv_heads, T, D, device=DEV, dtype=dtype) for _ in range(2))
        dout = torch.randn(B, heads, T, D, device=DEV, dtype=dtype)
        tag = f"{str(dtype).split('.')[-1]} H{heads}/KV{kv_heads} B{B} T{T} D{D}"
        ref = reference(q, k, v, dout)
        base = guarded(f"item2 {tag} plain SDPA", plain_sdpa, q, k, v, dout)
        base_err = [rel(g, r) for g, r in zip(base, ref)] if base is not None else None
        if base_err:
            print(f"RESULT item2 {tag} plain SDPA ({dtype}) vs fp64: out {fmt(base_err[0])} | dQ {fmt(base_err[1])} | "
                  f"dK {fmt(base_err[2])} | dV {fmt(base_err[3])}", flush=True)
        for method in ("allgather",):  # ring on one rank sends to itself (gloo refuses); same kernels as allgather
            got = guarded(f"item2 {tag} CP {method}", cp_path, method, q, k, v, dout)
            if got is None:
                continue
            errs = [rel(g, r) for g, r in zip(got, ref)]
            worst = max(e[0] for e in errs[1:])
            limit = max(5 * max(e[0] for e in base_err[1:]), 1e-2) if base_err else 1e-2
            verdict = "DEFECT (grad error >> plain SDPA's)" if not worst <= limit else "ok (within 5x plain SDPA's error)"
            print(f"RESULT item2 {tag} CP {method}: out {fmt(errs[0])} | dQ {fmt(errs[1])} | dK {fmt(errs[2])} | "
                  f"dV {fmt(errs[3])} -> {verdict}", flush=True)
        for variant in ("native out", "out.contiguous() (B,H,T,D)", "fp32 merge then .to(dtype) (what CP does)",
                        "(B,T,H,D)-strided copy of out"):
            got = guarded(f"item2 {tag} kernel {variant}", kernel_path, variant, q, k, v, dout)
            if got is None:
                continue
            errs = [rel(g, r) for g, r in zip(got[:4], ref)]
            print(f"RESULT item2 {tag} kernel bwd given [{variant}] (fwd out strides {got[4]}, passed {got[5]}): "
                  f"dQ {fmt(errs[1])} | dK {fmt(errs[2])} | dV {fmt(errs[3])}", flush=True)
