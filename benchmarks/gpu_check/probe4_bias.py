"""Issue 48 item 4: a CP block with a document bias: key length not a multiple of 8, fully masked rows."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import DEV, banner, fmt, guarded, init_one_rank, load, rel  # noqa: E402

banner("item 4 CP document bias")
context = load("ultrascale.parallel.context")
mesh = init_one_rank()
B, H, KV, D = 2, 8, 2, 64
PART = os.environ.get("PART", "all")  # aligned: key lengths % 8 == 0 only; odd: the others (a CUDA error stays in one process)
DTYPES = (torch.float32, torch.bfloat16) + ((torch.float16,) if DEV.type == "cuda" else ())


def name(dtype):
    return str(dtype).split(".")[-1]


def make_bias(tq, tk, dtype, masked_rows):
    """(B, 1, Tq, Tk) additive bias: documents of 13 tokens (every query row sees >= 1 key), except that the rows in
    `masked_rows` see no key of this block at all (their document lies on another rank)."""
    k_docs = torch.arange(tk, device=DEV) // 13
    q_docs = (torch.arange(tq, device=DEV) // 13).clamp(max=int(k_docs.max()))
    allowed = (q_docs[:, None] == k_docs[None, :]).expand(B, tq, tk).clone()
    allowed[:, masked_rows] = False
    bias = torch.zeros(allowed.shape, dtype=dtype, device=DEV).masked_fill_(~allowed, float("-inf")).unsqueeze(1)
    return bias, allowed


def reference(q, k, v, allowed, dout):
    """fp64 attention with the boolean mask (B, Tq, Tk)."""
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    scores = (qd @ kd.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))
    out = probs @ vd.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def block(tq, tk, dtype, masked_rows):
    """One biased block (Tq x Tk), merged with a second, unbiased block of 16 keys that every query sees (as when
    another rank's earlier chunk holds the rows' documents), forward and backward as _ContextAttention does them;
    compared with fp64 attention over both key sets."""
    torch.manual_seed(0)
    q = torch.randn(B, H, tq, D, device=DEV, dtype=dtype)
    k, v = (torch.randn(B, KV, tk, D, device=DEV, dtype=dtype) for _ in range(2))
    k2, v2 = (torch.randn(B, KV, 16, D, device=DEV, dtype=dtype) for _ in range(2))
    dout = torch.randn(B, H, tq, D, device=DEV, dtype=dtype)
    bias, allowed = make_bias(tq, tk, dtype, masked_rows)
    fwd, bwd = context.attention_kernel(DEV)
    scale = D**-0.5
    out1, lse1 = fwd(q, k, v, False, bias, scale)
    raw_nan_out, raw_nan_lse = (~torch.isfinite(out1)).sum().item(), torch.isnan(lse1).sum().item()
    lse_masked = sorted({round(x, 3) for x in lse1[:, :, masked_rows].flatten().tolist()})[:4] if masked_rows else []
    out_masked = out1[:, :, masked_rows].float().abs().max().item() if masked_rows else 0.0
    lse1 = context._masked_rows_to_minus_inf(lse1, bias)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=DEV)
    acc_lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=DEV)
    context._merge(acc, acc_lse, out1, lse1)
    nan_after_block = (~torch.isfinite(acc)).sum().item()
    out2, lse2 = fwd(q, k2, v2, False, None, scale)
    context._merge(acc, acc_lse, out2, lse2)
    merged = acc.to(dtype)
    nan_merged = (~torch.isfinite(merged)).sum().item()
    dq1, dk1, dv1 = bwd(dout, q, k, v, merged, acc_lse.contiguous(), False, bias, scale)
    dq2, _, _ = bwd(dout, q, k2, v2, merged, acc_lse.contiguous(), False, None, scale)
    grad_nan = sum((~torch.isfinite(g)).sum().item() for g in (dq1, dk1, dv1, dq2))
    both = torch.cat([allowed, torch.ones(B, tq, 16, dtype=torch.bool, device=DEV)], -1)
    ref = reference(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2), both, dout)
    errs = [rel(merged, ref[0]), rel(dq1.float() + dq2.float(), ref[2]), rel(dk1, ref[3][:, :, :tk]), rel(dv1, ref[4][:, :, :tk])]
    return (f"raw block out non-finite {raw_nan_out} (max |out| on masked rows {out_masked:.3g}), lse NaN {raw_nan_lse}, "
            f"lse on masked rows {lse_masked}; merged out non-finite after block {nan_after_block}, after 2nd block {nan_merged}; "
            f"bwd non-finite {grad_nan}; vs fp64: out {fmt(errs[0])} | dQ {fmt(errs[1])} | dK {fmt(errs[2])} | dV {fmt(errs[3])}")


for dtype in DTYPES:
    for tq, tk, masked in ((40, 37, []), (40, 40, []), (40, 37, [0, 5, 39]), (40, 40, [0, 5, 39]), (24, 61, [3]),
                           (64, 64, [1, 2])):
        if (PART == "aligned" and tk % 8) or (PART == "odd" and not tk % 8):
            continue
        tag = f"item4 block {name(dtype)} Tq{tq} Tk{tk} (Tk%8={tk % 8}) fully-masked rows {masked}"
        r = guarded(tag, block, tq, tk, dtype, masked)
        if r is not None:
            print(f"RESULT {tag}: {r}", flush=True)


def cp_documents(t, dtype, method):
    """ContextParallel on one rank with packed documents: one own block (T x T) with a bias, T % 8 != 0."""
    torch.manual_seed(0)
    q = torch.randn(1, H, t, D, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, KV, t, D, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    positions = torch.cat([torch.arange(n, device=DEV) for n in (11, 29, t - 40)])[None]
    cp = context.ContextParallel(mesh, method)
    cp.shard_batch({"input_ids": torch.zeros(1, t, dtype=torch.long, device=DEV), "position_ids": positions})
    out = cp.attention(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    docs = (positions == 0).cumsum(-1)
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(t, t, dtype=torch.bool, device=DEV).tril()
    ref = reference(q, k, v, allowed, dout)
    errs = [rel(g, r) for g, r in zip((out, q.grad, k.grad, v.grad), (ref[0], ref[2], ref[3], ref[4]))]
    nonfinite = sum((~torch.isfinite(x)).sum().item() for x in (out, q.grad, k.grad, v.grad))
    return f"non-finite {nonfinite}; out {fmt(errs[0])} | dQ {fmt(errs[1])} | dK {fmt(errs[2])} | dV {fmt(errs[3])}"


for dtype in DTYPES:
    for t in (74, 80):
        if (PART == "aligned" and t % 8) or (PART == "odd" and not t % 8):
            continue
        tag = f"item4 ContextParallel allgather cp1 packed docs {name(dtype)} T{t} (T%8={t % 8})"
        r = guarded(tag, cp_documents, t, dtype, "allgather")
        if r is not None:
            print(f"RESULT {tag}: {r}", flush=True)

# what torch's public SDPA does with the same odd-length additive bias (it pads the mask itself)
for dtype in DTYPES if PART != "aligned" else ():
    def public(dtype=dtype):
        q = torch.randn(B, H, 40, D, device=DEV, dtype=dtype)
        k, v = (torch.randn(B, H, 37, D, device=DEV, dtype=dtype) for _ in range(2))
        bias, _ = make_bias(40, 37, dtype, [0, 5])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return (f"non-finite {(~torch.isfinite(out)).sum().item()} of {out.numel()} "
                f"(masked rows: NaN {torch.isnan(out[:, :, [0, 5]]).sum().item()} of {out[:, :, [0, 5]].numel()})")
    r = guarded(f"item4 public F.sdpa {name(dtype)} Tk37 masked rows", public)
    if r is not None:
        print(f"RESULT item4 public F.sdpa {name(dtype)} Tk37 with fully-masked rows: {r}", flush=True)
