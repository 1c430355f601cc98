"""Context parallel: the sequence of every batch split across the `cp` ranks, for the whole model.

Everything but attention is per token, so a cp rank runs the model on its share of the
sequence and only attention has to see the other ranks' keys and values. Three ways to
bring them (`ContextParallel(method=...)`):

- ``"allgather"`` (Llama 3's choice): one all-gather of K/V over cp per layer; backward
  reduce-scatters dK/dV. Simple, one collective each way, but every rank briefly holds the
  whole sequence's K/V (2 * T * n_kv_heads * head_dim values per layer) and, in backward,
  fp32 dK/dV for all of it (measured: +9-13 MiB per rank over ring in benchmarks/cp_scaling.py).
- ``"ring"``: K/V blocks travel around the cp ring with non-blocking P2P while the block in
  hand is computed; backward sends dK/dV around the ring with them. No rank ever holds more
  than two K/V blocks, at the price of cp-1 sequential exchanges.
- ``"alltoall"`` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all trades heads for sequence,
  so each rank holds 1/cp of the heads for every token; attention runs on whole sequences with
  torch's SDPA, and a second all-to-all trades back. Per layer a rank sends and receives q, k, v
  (in one all-to-all) and out once, 2(H + Hkv)·(T/cp)·D·(cp-1)/cp values each way: a volume that does
  not grow with cp (the ring's K/V traffic does), but the heads of a rank (after tensor parallel)
  must split over cp.
- ``"usp"`` (Unified Sequence Parallel, Fang & Zhao 2024): both, on a cp = ring x ulysses grid. Each group of
  `ulysses` neighbouring cp ranks (one node's fast links) trades heads for sequence with the all-to-all, then the
  groups run the ring over their gathered tokens: the heads of a rank need only split over `ulysses`, and the
  ring's cp-1 exchanges become cp/ulysses - 1 of ulysses-times larger blocks.

The ring and the all-gather compute attention block by block with a kernel that returns the log-sum-exp of every
query row, and merge blocks exactly (online softmax, Milakov & Gimelshein 2018):

    lse = logaddexp(lse_a, lse_b),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward is written by hand (`_ContextAttention`): with the merged `out` and `lse` every
block's dQ/dK/dV come from the kernel's own backward, since P_block = exp(S_block - lse)
and D = rowsum(dO * O) are the same numbers the full attention would use.

Causal load balance ("zig-zag"): the sequence is cut into 2*cp chunks and rank r holds
chunks r and 2cp-1-r, so every rank owns as many early (cheap) as late (expensive) queries.
Blocks that causality masks completely are skipped, not computed and thrown away;
`ContextParallel.attention_work` counts the query-key pairs each rank computed.

Document masks of packed sequences (positions restarting at 0) are computed on the whole
sequence before it is split (`ContextParallel.shard_batch`), so a chunk knows which
document each of its tokens, and each token of a K/V block, belongs to.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from ultrascale.parallel.attention_kernels import attention_kernel, repeat_kv, softcap_kernel
from ultrascale.parallel.device import all_gather_single, grouped_sdpa, reduce_scatter_single
from ultrascale.parallel.dims import context_chunks, sequence_split_problem
from ultrascale.parallel.documents import document_ids
from ultrascale.parallel.numerics import accumulation_dtype, upcast
from ultrascale.parallel.rules import CONTEXT_PARALLEL_METHODS, choice_problems, raise_first, ulysses_problems

ContextParallelMethod = Literal["allgather", "ring", "alltoall", "usp"]


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ContextLayout:
    """Which tokens of a batch's sequence each cp rank holds.

    With `load_balance` the sequence is cut into 2*cp chunks and rank r holds chunks
    (r, 2cp-1-r); without, cp chunks and rank r holds chunk r. A rank's tokens are its
    chunks concatenated in ascending order.
    """

    seq_len: int
    cp: int
    load_balance: bool
    documents: Optional[torch.Tensor] = None
    """(B, seq_len) document index of every token of the whole sequence (packed sequences), or None."""
    group: int = 1
    """Ranks of this layout are groups of `group` neighbouring cp ranks holding all their tokens (USP's ring runs
    over the Ulysses groups): rank g holds the chunks of cp ranks g·group .. (g+1)·group - 1, ascending."""

    def __post_init__(self) -> None:
        problem = sequence_split_problem(self.seq_len, tp=1, cp=self.cp, load_balance=self.load_balance,
                                         where="the context-parallel batch")
        if problem is not None:
            raise ValueError(problem)

    @property
    def num_chunks(self) -> int:
        return context_chunks(self.cp, load_balance=self.load_balance)

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Global chunk ids held by `rank`, ascending."""
        members = range(rank * self.group, (rank + 1) * self.group)
        if self.load_balance:
            return tuple(sorted((*members, *(2 * self.cp - 1 - member for member in members))))
        return tuple(members)

    def token_index(self, rank: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """(seq_len / cp,) global position of each of `rank`'s tokens, in its local order."""
        c = self.chunk_len
        return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in self.chunks_of(rank)])

    def local_documents(self, rank: int) -> Optional[torch.Tensor]:
        """(B, seq_len / cp) document index of `rank`'s tokens, or None without packing."""
        if self.documents is None:
            return None
        return self.documents.index_select(1, self.token_index(rank, self.documents.device))


# --------------------------------------------------------------------------- block plan


@dataclass(frozen=True)
class _Block:
    """Local queries [q_start, q_end) against the first k_end tokens of a K/V block."""

    q_start: int
    q_end: int
    k_end: int
    causal: bool  # own block: queries and keys are the same tokens in the same (ascending) order

    def pairs(self) -> int:
        n, m = self.q_end - self.q_start, self.k_end
        return n * (n + 1) // 2 if self.causal else n * m


def _plan(layout: ContextLayout, rank: int, source: int) -> list[_Block]:
    """The blocks rank `rank`'s queries compute against `source`'s K/V; fully masked blocks are left out.

    Both hold ascending chunk lists, so the keys a query chunk may see form a prefix of the
    source's tokens: all source chunks with a smaller id (nothing of another rank is diagonal).
    """
    c = layout.chunk_len
    q_chunks, k_chunks = layout.chunks_of(rank), layout.chunks_of(source)
    if source == rank:
        return [_Block(0, len(q_chunks) * c, len(k_chunks) * c, causal=True)]
    blocks: list[_Block] = []
    for a, q_chunk in enumerate(q_chunks):
        visible = sum(1 for k_chunk in k_chunks if k_chunk < q_chunk)
        if visible == 0:
            continue
        last = blocks[-1] if blocks else None
        if last is not None and last.q_end == a * c and last.k_end == visible * c:
            blocks[-1] = _Block(last.q_start, (a + 1) * c, visible * c, causal=False)  # same keys: one call
        else:
            blocks.append(_Block(a * c, (a + 1) * c, visible * c, causal=False))
    return blocks


def _block_allowed(
    layout: ContextLayout, rank: int, source: int, block: _Block, device: torch.device, window: Optional[int]
) -> Optional[torch.Tensor]:
    """Which keys of one block each query may see, (B|1, Tq, Tk) bool; None when the kernel's own causal flag says
    it all (no packed documents, no window). A key is seen when it shares the query's document, is not later (own
    block) and, under a sliding window W, lies fewer than W tokens back: q_pos - k_pos < W (transformers'
    `sliding_window_overlay`)."""
    q_docs, k_docs = layout.local_documents(rank), layout.local_documents(source)
    if (q_docs is None or k_docs is None) and window is None:
        return None
    if q_docs is not None and k_docs is not None:
        allowed = q_docs[:, block.q_start : block.q_end, None] == k_docs[:, None, : block.k_end]  # (B, Tq, Tk)
    else:
        allowed = torch.ones((1, block.q_end - block.q_start, block.k_end), dtype=torch.bool, device=device)
    if block.causal:
        allowed = allowed & torch.ones(allowed.shape[1:], dtype=torch.bool, device=allowed.device).tril()
    if window is not None:
        q_pos = layout.token_index(rank, allowed.device)[block.q_start : block.q_end]  # global positions
        k_pos = layout.token_index(source, allowed.device)[: block.k_end]
        allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
    return allowed


def _block_bias(
    layout: ContextLayout, rank: int, source: int, block: _Block, q: torch.Tensor, window: Optional[int]
) -> Optional[torch.Tensor]:
    """`_block_allowed` as the kernels' additive (B|1, 1, Tq, Tk) mask: 0 where the query may see the key, -inf
    elsewhere."""
    allowed = _block_allowed(layout, rank, source, block, q.device, window)
    if allowed is None:
        return None
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    return bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def _hidden_blocks(layout: ContextLayout, rank: int, size: int, device: torch.device,
                   window: Optional[int]) -> frozenset[tuple[int, int]]:
    """(source, index in `_plan`) of the blocks where no query may see any key (other documents, out of the window),
    which the kernels skip. Which they are depends on the batch's documents, read on the host: once per attention
    call for all blocks (one sync), not once per block."""
    candidates, seen = [], []
    for source in range(size):
        for index, block in enumerate(_plan(layout, rank, source)):
            allowed = _block_allowed(layout, rank, source, block, device, window)
            if allowed is not None:
                candidates.append((source, index))
                seen.append(allowed.any())
    if not seen:
        return frozenset()
    return frozenset(c for c, visible in zip(candidates, torch.stack(seen).tolist()) if not visible)


# --------------------------------------------------------------------------- K/V exchange


_KV_TAG, _GRAD_TAG = 0, 1  # K/V and dK/dV exchanges may be in flight together between the same ranks


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, tag: int = _KV_TAG) -> list[Any]:
    """Start sending `send` to the next cp rank and receiving the previous one's into `recv`."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group, tag),
    ]
    return dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _sources(kv: torch.Tensor, group: dist.ProcessGroup, method: str) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (source rank, its stacked K/V (2, B, Hkv, Tl, D)) for every cp rank, own first, then
    rank-1, rank-2, ... (the same order for both methods, so they give the same numbers).
    The ring's next exchange is in flight while the caller computes on the block in hand."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if method == "allgather":
        gathered = torch.empty((size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
        all_gather_single(gathered, kv, group=group)  # gloo wants the ranks' tensors concatenated on dim 0
        gathered = gathered.unflatten(0, (size, kv.shape[0]))
        for step in range(size):
            yield (rank - step) % size, gathered[(rank - step) % size]
        return
    current = kv
    for step in range(size):
        requests: list[Any] = []
        if step < size - 1:
            incoming = torch.empty_like(current)
            requests = _ring_exchange(current, incoming, group)
        yield (rank - step) % size, current
        if requests:
            _wait(requests)
            current = incoming


# --------------------------------------------------------------------------- attention


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out, lse (fp32 or wider, in place) <- the softmax over both key sets; rows that saw no key yet keep -inf."""
    new_lse = torch.logaddexp(lse, block_lse)
    seen = torch.isfinite(new_lse)
    safe = torch.where(seen, new_lse, torch.zeros_like(new_lse))
    old_weight = torch.where(seen, torch.exp(lse - safe), torch.zeros_like(lse)).unsqueeze(-1)
    new_weight = torch.where(seen, torch.exp(block_lse - safe), torch.zeros_like(lse)).unsqueeze(-1)
    out.mul_(old_weight).add_(block_out.to(out.dtype) * new_weight)
    lse.copy_(new_lse)


def _masked_rows_to_minus_inf(lse: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # The CPU kernel returns lse = 0 (not -inf) for a row whose keys are all masked; as 0 it
    # would count as exp(0) = 1 of probability mass in the merge.
    if bias is None:
        return lse
    return lse.masked_fill(torch.isinf(bias).all(-1), float("-inf"))  # bias rows (B, 1, Tq)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: "ContextParallel", scale: Optional[float],
                window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
        layout = cp.current_layout()
        group, rank = cp.group, cp.rank
        kernel_forward, _ = softcap_kernel(softcap) if softcap is not None else attention_kernel(q.device)
        wide = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=wide, device=q.device)  # (B, H, Tl, D)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)  # (B, H, Tl)
        if sinks is not None:
            # A sink is one more logit per head whose value row is zero: the merge starts from it (out 0, lse = sink),
            # so every block's weight exp(lse_block - lse) already counts the sink's share of the softmax.
            lse.copy_(sinks.to(wide).reshape(1, -1, 1).expand_as(lse))
        kv = torch.stack([k, v]).contiguous()  # (2, B, Hkv, Tl, D): one message per exchange
        hidden = _hidden_blocks(layout, rank, cp.size, q.device, window)
        for source, kv_source in _sources(kv, group, cp.method):
            for index, block in enumerate(_plan(layout, rank, source)):
                if (source, index) in hidden:
                    continue
                bias = _block_bias(layout, rank, source, block, q, window)
                q_block = q[:, :, block.q_start : block.q_end]
                k_block, v_block = kv_source[0, :, :, : block.k_end], kv_source[1, :, :, : block.k_end]
                block_out, block_lse = kernel_forward(q_block, k_block, v_block, block.causal and bias is None, bias, scale)
                block_lse = _masked_rows_to_minus_inf(block_lse, bias)
                _merge(out[:, :, block.q_start : block.q_end], lse[:, :, block.q_start : block.q_end], block_out, block_lse)
                cp.attention_work += block.pairs()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp, ctx.layout, ctx.scale, ctx.window, ctx.softcap, ctx.hidden = cp, layout, scale, window, softcap, hidden
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cp, layout, scale, window, softcap = ctx.cp, ctx.layout, ctx.scale, ctx.window, ctx.softcap
        group, rank, size = cp.group, cp.rank, cp.size
        _, kernel_backward = softcap_kernel(softcap) if softcap is not None else attention_kernel(q.device)
        dout = dout.contiguous()
        wide = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        gathered_grads = None
        if cp.method == "allgather":  # dK/dV of every source, reduce-scattered to the owners at the end
            gathered_grads = torch.zeros((size, *kv.shape), dtype=wide, device=kv.device)
        dkv = torch.zeros(kv.shape, dtype=wide, device=kv.device)  # ring: travels with its K/V
        pending: list[Any] = []  # ring: the previous step's dK/dV exchange, in flight while this step computes
        incoming = dkv
        for source, kv_source in _sources(kv, group, cp.method):
            contributions = []  # (k_end, dK, dV) of each block against this source
            for index, block in enumerate(_plan(layout, rank, source)):
                if (source, index) in ctx.hidden:
                    continue
                bias = _block_bias(layout, rank, source, block, q, window)
                rows = slice(block.q_start, block.q_end)
                dq_block, dk_block, dv_block = kernel_backward(
                    dout[:, :, rows], q[:, :, rows], kv_source[0, :, :, : block.k_end], kv_source[1, :, :, : block.k_end],
                    out[:, :, rows], lse[:, :, rows].contiguous(), block.causal and bias is None, bias, scale,
                )
                dq[:, :, rows] += dq_block
                contributions.append((block.k_end, dk_block, dv_block))
            if gathered_grads is None:
                # The previous rank's partial dK/dV of this source arrives; add ours and pass it on with
                # its K/V (the last pass reaches the owner).
                _wait(pending)
                dkv = incoming
            grads = gathered_grads[source] if gathered_grads is not None else dkv
            for k_end, dk_block, dv_block in contributions:
                grads[0, :, :, :k_end] += dk_block
                grads[1, :, :, :k_end] += dv_block
            if gathered_grads is None:
                incoming = torch.empty_like(dkv)
                pending = _ring_exchange(dkv, incoming, group, _GRAD_TAG)
        if gathered_grads is None:
            _wait(pending)
            dkv = incoming
        if gathered_grads is not None:
            reduce_scatter_single(dkv, gathered_grads.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
        dsinks = None
        if sinks is not None:
            # d sink_h = -sum over rows of P_sink · rowsum(dO ∘ O), P_sink = exp(sink_h - lse): this rank's queries'
            # share (the cp ranks' shares add up where the sinks' gradient is reduced, as every weight's is).
            rows = (upcast(dout) * upcast(out)).sum(-1)  # (B, H, Tl)
            dsinks = -(torch.exp(upcast(sinks).reshape(1, -1, 1) - lse) * rows).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, dsinks


# --------------------------------------------------------------------------- all-to-all (Ulysses)
# The all-to-alls are torch's functional, autograd-aware ones (backward is the opposite all-to-all), so
# compile traces them and the attention between them whole.


def _heads_to_sequence(tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, n: int) -> tuple[torch.Tensor, ...]:
    """Each (B, H_i, Tl, D) of this rank's tokens -> (B, H_i/n, n·Tl, D): head group `rank` of every rank's tokens,
    rank by rank (part i of the heads goes to rank i; the part from rank j lands j-th on the sequence). q, k and v
    travel in one all-to-all: one collective's latency instead of three."""
    b, _, t, d = tensors[0].shape
    groups = [x.shape[1] // n for x in tensors]
    parts = torch.cat([x.reshape(b, n, g, t, d) for x, g in zip(tensors, groups)], dim=2).transpose(0, 1).contiguous()
    arrived = all_to_all_single_autograd(parts, None, None, group)
    return arrived.permute(1, 2, 0, 3, 4).reshape(b, sum(groups), n * t, d).split(groups, dim=1)


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`: (B, H/n, n·Tl, D) -> (B, H, Tl, D)."""
    b, hn, length, d = x.shape
    t = length // n
    parts = x.reshape(b, hn, n, t, d).permute(2, 0, 1, 3, 4).contiguous()
    arrived = all_to_all_single_autograd(parts, None, None, group)
    return arrived.transpose(0, 1).reshape(b, n * hn, t, d)


def _alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: "ContextParallel",
                        scale: Optional[float], window: Optional[int], softcap: Optional[float],
                        sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence, through 1/cp of the heads per rank.

    The tokens arrive rank by rank in each rank's local (zig-zag) order and are put back in sequence order for
    SDPA's causal kernel. Packed documents and sliding windows become a (B|1, 1, T, T) boolean mask over the whole
    sequence: B·T² bytes per rank (the ring's bias covers one block at a time). Logit soft-capping and attention
    sinks (`sinks`: one logit per query head of this rank, after tensor parallel) run the attention written out
    (`_attention_math`), as transformers' eager attention does."""
    layout, n = cp.current_layout(), cp.size
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads % n:  # repeat K/V heads to lcm(Hkv, n), which divides H: query head h still reads kv head h·Hkv/H
        repeat = n // math.gcd(kv_heads, n)
        k, v = repeat_kv(k, repeat), repeat_kv(v, repeat)
    q, k, v = _heads_to_sequence((q, k, v), cp.group, n)
    gathered = torch.cat([layout.token_index(r, q.device) for r in range(n)])  # global position of each token
    in_order = torch.argsort(gathered) if layout.load_balance else None  # zig-zag chunks back in sequence order
    if in_order is not None:
        q, k, v = (x.index_select(2, in_order) for x in (q, k, v))
    allowed = None  # (B|1, 1, T, T): causal, same document, inside the window
    if layout.documents is not None or window is not None or softcap is not None or sinks is not None:
        t = q.shape[2]
        allowed = torch.ones((t, t), dtype=torch.bool, device=q.device).tril()
        if window is not None:
            position = torch.arange(t, device=q.device)
            allowed = allowed & ((position[:, None] - position[None, :]) < window)
        allowed = allowed[None, None]
        if layout.documents is not None:
            docs = layout.documents.to(q.device)
            allowed = allowed & (docs[:, :, None] == docs[:, None, :]).unsqueeze(1)
    if softcap is not None or sinks is not None:
        if sinks is not None:  # this rank's heads are head group `rank` of the rank's (tp-local) heads
            sinks = sinks.reshape(n, heads // n)[cp.rank]
        out = _attention_math(q, k, v, allowed, scale, softcap, sinks)
    else:
        out = grouped_sdpa(q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=scale)
    if in_order is not None:
        out = out.index_select(2, gathered)
    return _sequence_to_heads(out, cp.group, n)


class _UlyssesRing:
    """What `_ContextAttention` reads of a `ContextParallel`, for USP's ring: it runs over the ring mesh (the cp ranks
    of the same Ulysses rank in every group), and its ranks hold their whole group's tokens (`ContextLayout.group`)."""

    method = "ring"

    def __init__(self, cp: "ContextParallel", layout: ContextLayout) -> None:
        self.cp, self.layout = cp, layout
        self.group, self.size, self.rank = cp.ring_group, cp.size // cp.ulysses, cp.rank // cp.ulysses

    def current_layout(self) -> ContextLayout:
        return self.layout

    @property
    def attention_work(self) -> int:
        return self.cp.attention_work

    @attention_work.setter
    def attention_work(self, pairs: int) -> None:
        self.cp.attention_work = pairs


def _usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: "ContextParallel", scale: Optional[float],
                   window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Ulysses inside each group of `cp.ulysses` neighbouring cp ranks, the ring across the groups. After the all-to-all
    a rank holds 1/ulysses of the heads for its group's tokens, put in ascending sequence order so that the ring's
    block plan (ascending chunk lists) holds; the ring then runs as for cp/ulysses ranks of ulysses-times larger
    shares, and the output goes back the same way."""
    layout, u = cp.current_layout(), cp.ulysses
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads % u:  # as `_alltoall_attention`: repeat K/V heads to lcm(Hkv, u), which divides H
        repeat = u // math.gcd(kv_heads, u)
        k, v = repeat_kv(k, repeat), repeat_kv(v, repeat)
    q, k, v = _heads_to_sequence((q, k, v), cp.ulysses_group, u)
    first = (cp.rank // u) * u
    gathered = torch.cat([layout.token_index(member, q.device) for member in range(first, first + u)])
    in_order = torch.argsort(gathered)
    q, k, v = (x.index_select(2, in_order) for x in (q, k, v))
    if sinks is not None:  # this rank's heads are head group `rank % u` of the rank's (tp-local) heads
        sinks = sinks.reshape(u, heads // u)[cp.rank % u]
    ring = _UlyssesRing(cp, dataclasses.replace(layout, group=u))
    out = _ring_attention(q, k, v, ring, scale, window, softcap, sinks)
    return _sequence_to_heads(out.index_select(2, torch.argsort(in_order)), cp.ulysses_group, u)


def _attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: Optional[float],
                    softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention written out, for what SDPA has no argument for:
    S = scale·QKᵀ, S <- c·tanh(S/c) (soft-capping), P = softmax over [S masked, sink] (a sink is one more logit per
    head whose value row is zero: it only takes probability mass), out = P[:, :, :, :T]·V."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = upcast(q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)  # (B, H, T, T)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs.to(v.dtype) @ v)  # (B, H, T, Dv)


# --------------------------------------------------------------------------- runtime


class ContextParallel:
    """Context parallel for one model: the cp mesh, the exchange method and the layout of the batch in flight.

    `shard_batch` cuts a batch into this rank's tokens and records their layout;
    `attention(q, k, v)` then computes causal attention of the local queries over the whole
    sequence. The layout stays until the next batch, so activation checkpointing's recompute
    in backward sees the same one.
    """

    def __init__(self, mesh: DeviceMesh, method: ContextParallelMethod = "ring", load_balance: bool = True,
                 ulysses: Optional[int] = None) -> None:
        raise_first(choice_problems("method", method, CONTEXT_PARALLEL_METHODS), "ContextParallel")
        if mesh.ndim != 1:
            raise ValueError(f"context parallel needs a 1-D cp mesh, got {mesh.ndim}-D")
        raise_first(ulysses_problems(mesh.size(), method, ulysses), "ContextParallel")
        self.mesh = mesh
        self.method = method
        self.load_balance = load_balance
        self.ulysses = ulysses or 1
        """USP: the Ulysses degree inside each group of neighbouring cp ranks (1 otherwise)."""
        self.ring_group: Optional[dist.ProcessGroup] = None
        self.ulysses_group: Optional[dist.ProcessGroup] = None
        if method == "usp":  # cp rank c = ring rank c // ulysses, Ulysses rank c % ulysses
            grid = mesh._unflatten(0, (mesh.size() // self.ulysses, self.ulysses), ("cp_ring", "cp_ulysses"))
            self.ring_group, self.ulysses_group = grid["cp_ring"].get_group(), grid["cp_ulysses"].get_group()
        self.layout: Optional[ContextLayout] = None
        self.attention_work = 0
        """Query-key pairs (per sequence and head) in the blocks this rank's attention computed, summed
        over calls (an own, causal block counts its lower triangle); skipped blocks count nothing. The ring
        and the all-gather only: all-to-all attention is balanced by construction (1/cp of the heads, the
        whole sequence each), and a count kept on this object would make compiled blocks recompile."""

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    def current_layout(self) -> ContextLayout:
        if self.layout is None:
            raise RuntimeError(
                "context parallel attention ran on a batch that was not split over the cp ranks; "
                "call `ContextParallel.shard_batch` (the ultrascale strategy does) before the forward"
            )
        return self.layout

    def shard_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's share of `batch` ``{"input_ids": (B, T), ...}``: every (B, T, ...) tensor is cut
        on dim 1 to the rank's tokens; ``position_ids`` (the tokens' global positions) is added if
        absent. Document boundaries are read from the whole ``position_ids`` before the cut."""
        tokens = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(
                "context parallel splits batches of the form {'input_ids': (B, T), 'labels': (B, T), ...}; "
                f"got {type(batch).__name__}" + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            )
        batch_size, seq_len = tokens.shape
        padding = batch.get("attention_mask")
        if isinstance(padding, torch.Tensor) and not bool(padding.all()):
            raise ValueError(
                "context parallel does not take padding masks (`attention_mask` with zeros): pack the sequences "
                "(labels -100 where there is no target) or pass `position_ids` restarting at 0 per document"
            )
        positions = batch.get("position_ids")
        layout = ContextLayout(seq_len, self.size, self.load_balance, document_ids(positions))
        index = layout.token_index(self.rank, tokens.device)
        local: dict[str, Any] = {}
        for key, value in batch.items():
            if key == "attention_mask":
                continue  # all ones: attention is causal over the whole sequence anyway
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch_size, seq_len):
                local[key] = value.index_select(1, index.to(value.device))
            else:
                local[key] = value
        if positions is None:
            local["position_ids"] = index.unsqueeze(0).expand(batch_size, -1)
        self.layout = layout
        return local

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, *,
                  window: Optional[int] = None, softcap: Optional[float] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention of this rank's queries over every rank's keys: ``q`` (B, H, Tl, D),
        ``k`` (B, Hkv, Tl, D), ``v`` (B, Hkv, Tl, Dv) in the local token order; returns (B, H, Tl, Dv).

        `window`: a key is seen only if it lies fewer than `window` tokens before the query (sliding-window
        attention). `softcap`: logit soft-capping c·tanh(S/c) (the ring and the all-gather then compute their
        blocks with `softcap_kernel`, written out). `sinks` (H,): one more logit per query head, with a zero
        value row (the ring and the all-gather start their merge from it)."""
        dv = v.shape[-1]
        if dv != q.shape[-1]:
            # The LSE kernels and the all-to-all take one head size: zero-pad the narrower side (multi-head latent
            # attention's V is narrower than Q/K). Zero columns of Q and K add nothing to QKᵀ; zero columns of V
            # give zero output columns, dropped. The scale stays the one of the real head size.
            scale = scale if scale is not None else q.shape[-1] ** -0.5
            width = max(dv, q.shape[-1])
            q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
        if self.method == "alltoall":  # functional all-to-alls: traced whole under compile
            out = _alltoall_attention(q, k, v, self, scale, window, softcap, sinks)
        elif self.method == "usp":
            out = _usp_attention(q, k, v, self, scale, window, softcap, sinks)
        elif self.method == "ring":
            out = _ring_attention(q, k, v, self, scale, window, softcap, sinks)
        else:  # all-gather: traced whole under compile=True
            out = _ContextAttention.apply(q, k, v, self, scale, window, softcap, sinks)
        return out[..., :dv] if out.shape[-1] != dv else out


# Under `compile=True` the ring is the block's one graph break: its isend/irecv, overlapped with the attention of
# the block in hand, cannot be traced (dynamo would give up on the whole attention function at the first one).
@torch.compiler.disable(reason="ring attention: point-to-point K/V exchange")
def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, scale: Optional[float],
                    window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]) -> torch.Tensor:
    return _ContextAttention.apply(q, k, v, cp, scale, window, softcap, sinks)


class ContextParallelAttention(nn.Module):
    """Drop-in for `ultrascale.models.llama.ScaledDotProductAttention`: the same call, attention over
    the whole context-parallel sequence. Document masks come from the layout, not from `documents`."""

    def __init__(self, context_parallel: ContextParallel) -> None:
        super().__init__()
        self.context_parallel = context_parallel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.context_parallel.attention(q, k, v)


__all__ = [
    "CONTEXT_PARALLEL_METHODS",
    "ContextLayout",
    "ContextParallel",
    "ContextParallelAttention",
    "ContextParallelMethod",
    "attention_kernel",
    "document_ids",
    "softcap_kernel",
]
