"""Mixture-of-Experts: the experts' compute, expert parallelism and the router's balance terms.

Plain torch on `nn.Module` + `DeviceMesh` (no Lightning). Shared by the built-in MoE Llama
(`ultrascale.models.moe`) and Hugging Face MoE models, whose experts modules store the same
fused weights (transformers 5): ``gate_up_proj`` (E, 2I, H) = [gate; up] per expert and
``down_proj`` (E, H, I); an expert computes ``down @ (silu(gate @ x) * (up @ x))``.

Expert parallel (GShard, Lepikhin et al. 2020; the Ultra-Scale Playbook's EP section): the
experts are split over the ``ep`` ranks on their first dim (a DTensor ``Shard(0)`` on the ep
mesh, so names and checkpoints keep the global shape). Each rank routes its own tokens, then

    forward:  all-to-all the per-expert counts, all-to-all the tokens (uneven splits), run the
              local experts on what arrived, all-to-all the outputs back (the inverse splits)
    backward: the same two token all-to-alls with the splits swapped (autograd through both)

so an expert's gradient sums over every token any ep rank routed to it; the ranks holding the
same experts (``ep_shard`` = dp_shard x cp / ep, times dp_replicate) then reduce it, as FSDP does.

Balance terms are written so that the step's loss stays one sum divided once (docs/architecture.md,
"One loss per step"): for a row (sequence) of T tokens routed to k of E experts,

    f_i = E / (k T) * #{tokens of the row that picked expert i}     (1 everywhere when balanced)
    a_t = sum_i f_i p_{t,i}          p_t = softmax(router logits of token t)
    z_t = logsumexp(router logits of token t) ** 2                  (router z-loss, ST-MoE)

and each token adds ``aux_coef * a_t + z_coef * z_t`` to the step's loss sum, which the strategy
divides by the valid labels of the global batch together with the cross-entropy. With every label
valid this is DeepSeek-V3's sequence-wise balance loss ``aux_coef * sum_i f_i P_i`` averaged over
sequences; rows are never split between data ranks, so it does not depend on the layout (context
parallel sums the row's counts over its cp ranks first). The terms reach backward through
`attach_aux_loss` (an identity on the activations whose backward also seeds the terms), so they
work unchanged under pipeline parallel, where the loss is computed on another rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ultrascale.parallel.device import grouped_mm_supported
from ultrascale.parallel.tensor_styles import grad_summed_over

EXPERT_PARALLEL_ATTRIBUTE = "_ultrascale_expert_parallel"
"""Set on an experts module whose experts are split over an ep group (an `ExpertParallel`)."""

ROUTER_LOAD_ATTRIBUTE = "_ultrascale_router_load"
"""Set on a router module: its `RouterLoad` (token counts of the step, the balance terms' scale)."""

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")

LOAD_BALANCE_MODES = ("aux_loss", "aux_free", "none")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the local experts under expert parallel); a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------- expert compute


def run_experts(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu, *, grouped: Optional[bool] = None,
    transposed: bool = False, gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
    apply_gate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Gated experts on tokens grouped by expert: rows ``[c_0 + ... + c_{e-1}, ... + c_e)`` of ``x``
    (S, H) go to expert ``e``; ``counts`` (E,) sums to S; ``gate_up`` (E, 2I, H), ``down`` (E, H, I), or
    (E, H, 2I) and (E, I, H) when ``transposed`` (GPT-OSS). Per expert:

        h = x W_gu (+ b_gu[e]),   g = apply_gate(h) (S, I),   out = g W_d (+ b_d[e])

    ``apply_gate`` defaults to SwiGLU of the concatenated halves, ``act(gate) * up``; a transformers experts
    module passes its own `_apply_gate` (GPT-OSS: interleaved halves, clamped, ``(up + 1) * gate * sigmoid(α gate)``).
    Returns (S, H). ``grouped``: one grouped matmul per projection (`torch._grouped_mm`, forward and
    backward); False: a loop over the experts (one host sync for the counts); None: grouped where
    the device and dtype support it (`ultrascale.parallel.device.grouped_mm_supported`)."""
    if apply_gate is None:
        def apply_gate(hidden: torch.Tensor) -> torch.Tensor:
            gate, up = hidden.chunk(2, dim=-1)  # (S, I) each
            return act(gate) * up

    w_gate_up = gate_up if transposed else gate_up.transpose(-2, -1)  # (E, H, 2I)
    w_down = down if transposed else down.transpose(-2, -1)  # (E, I, H)
    if grouped is None:
        grouped = grouped_mm_supported(x.device, x.dtype)
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert
        hidden = torch._grouped_mm(x, w_gate_up, offs=offsets)  # (S, 2I)
        if gate_up_bias is not None:  # each row's expert's bias (no host sync: the output size is known)
            hidden = hidden + gate_up_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        out = torch._grouped_mm(apply_gate(hidden).contiguous(), w_down, offs=offsets)  # (S, H)
        if down_bias is not None:
            out = out + down_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return out
    outputs = []
    # unbind, not gate_up[e]: indexing's backward writes each expert's gradient into a zero tensor of the
    # whole (E, ...) weight and sums E of them (memory traffic ~ E^2, benchmarks/ep_dispatch.py).
    biases = (gate_up_bias.unbind(0) if gate_up_bias is not None else [None] * len(counts),
              down_bias.unbind(0) if down_bias is not None else [None] * len(counts))
    for rows, expert_gate_up, expert_down, b_gate_up, b_down in zip(
            x.split(counts.tolist()), w_gate_up.unbind(0), w_down.unbind(0), *biases):
        hidden = rows @ expert_gate_up  # (c_e, 2I)
        if b_gate_up is not None:
            hidden = hidden + b_gate_up
        out = apply_gate(hidden) @ expert_down  # (c_e, H)
        outputs.append(out + b_down if b_down is not None else out)
    return torch.cat(outputs) if outputs else x.new_zeros(0, w_down.shape[-1])


class ExpertParallel:
    """All-to-all token dispatch over the ranks of an ep mesh, each holding E / ep experts.

    With tensor parallel on the rest of the model (`tp`, the tp mesh: EP x TP, Megatron's usual MoE layout), the
    tp ranks of a layer hold the same tokens (replicated activations), route them alike, and hold the same experts
    whole. Each dispatches only its 1/tp share of the token copies (`dispatch`), so no expert computes a token
    twice; the shares' outputs are all-gathered over tp, and the experts' gradients, each tp rank's from its
    share, are summed over tp (`tp_summed`: one all-reduce of the local experts' gradients per backward)."""

    def __init__(self, mesh: DeviceMesh, tp: Optional[DeviceMesh] = None) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.tp = tp if tp is not None and tp.size() > 1 else None
        self.tp_group = self.tp.get_group() if self.tp is not None else None

    def dispatch(
        self, x: torch.Tensor, counts: torch.Tensor, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The experts' outputs (S, H) for ``x`` (S, H, sorted by expert; ``counts`` (E,)): under tp, this rank
        dispatches rows [r·c, (r+1)·c) of them (c = ceil(S / tp), DTensor's Shard(0) of the replicated rows) and the
        shares are all-gathered. In backward the shares' input gradients are all-gathered (every tp rank holds the
        whole), and each share takes its rows of the output's gradient (held alike by every tp rank)."""
        if self.tp is None:
            return self(x, counts, compute)
        rows = x.shape[0]
        share = DTensor.from_local(x, self.tp, [Replicate()], run_check=False).redistribute(self.tp, [Shard(0)]).to_local()
        start = min(rows, self.tp.get_local_rank() * math.ceil(rows / self.tp.size()))  # Shard(0): torch.chunk's pieces
        stop = start + share.shape[0]
        ends = counts.cumsum(0)  # the share's count of expert e: its rows within [start, stop) (no host sync)
        share_counts = ends.clamp(start, stop) - (ends - counts).clamp(start, stop)
        out = self(share, share_counts, compute).contiguous()  # (stop - start, H)
        shares = DTensor.from_local(out, self.tp, [Shard(0)], run_check=False, shape=(rows, out.shape[1]),
                                    stride=(out.shape[1], 1))
        return shares.redistribute(self.tp, [Replicate()]).to_local()

    def tp_summed(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``t`` (a local expert weight), whose gradient is summed over the tp ranks in backward."""
        return t if self.tp_group is None or t is None else grad_summed_over(t, self.tp_group)

    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``x`` (S, H): this rank's token copies sorted by global expert id, ``counts`` (E,) per expert.
        ``compute(tokens, local_counts)`` runs the local experts on tokens grouped by local expert.
        Returns the experts' outputs (S, H) in ``x``'s order."""
        local = counts.numel() // self.size
        # received[r, e]: tokens rank r sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, local)  # (ep, E_local)
        # The one host sync of the dispatch: all_to_all needs its split sizes on the host.
        send_splits, recv_splits = torch.stack([counts.view(self.size, local).sum(1), received.sum(1)]).tolist()
        arrived = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)  # (R, H), by (source, expert)
        # The experts want their tokens together: reorder (source rank, expert) -> (expert, source rank).
        # Segment (r, e) holds received[r, e] rows; sorting by key e * ep + r groups them by expert.
        keys = torch.arange(local, device=x.device)[None, :] * self.size + torch.arange(self.size, device=x.device)[:, None]
        key = torch.repeat_interleave(keys.reshape(-1), received.reshape(-1), output_size=sum(recv_splits))  # (R,), no sync
        order = torch.argsort(key, stable=True)  # (R,)
        out = compute(arrived[order], received.sum(0))  # (R, H) by local expert
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(out[back], send_splits, recv_splits, self.group)  # (S, H)


# Under `compile=True` the routed experts are the block's one graph break: how many tokens each expert gets
# decides the shapes (the all-to-all's split sizes and the expert loop read the counts on the host), and torch
# 2.13's meta kernel of `_grouped_mm` takes only bf16. Router, attention and norms compile around it.
@torch.compiler.disable(reason="MoE experts: data-dependent token counts per expert")
def experts_forward(
    experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    may_drop: bool = False,
) -> torch.Tensor:
    """The experts of an MoE layer on ``hidden`` (N, H): token n goes to experts ``top_k_index[n]``
    (N, k), its output is the ``top_k_weights`` (N, k)-weighted sum of theirs. With ``may_drop``, an
    index equal to the number of experts marks a dropped assignment (over capacity): it contributes
    nothing (this costs one host sync, for the number of kept copies).

    Reads ``experts.gate_up_proj``/``down_proj`` (E, ...; the local E / ep under expert parallel), the layout
    flags transformers' `use_experts_implementation` sets (``is_transposed``, ``has_bias``: then
    ``gate_up_proj_bias``/``down_proj_bias``), its ``_apply_gate`` (else ``act_fn``, else SiLU, on the
    concatenated [gate; up]); under expert parallel the tokens travel to
    the experts' ranks (`ExpertParallel`). The signature of transformers' experts forward, so it is
    also registered as a transformers experts implementation (`register_hf_experts`)."""
    n_tokens, top_k = top_k_index.shape
    ep: Optional[ExpertParallel] = getattr(experts, EXPERT_PARALLEL_ATTRIBUTE, None)
    gate_up, down = local_tensor(experts.gate_up_proj), local_tensor(experts.down_proj)
    if ep is not None:  # EP x TP: each tp rank's experts see its share of the tokens
        gate_up, down = ep.tp_summed(gate_up), ep.tp_summed(down)
    n_experts = gate_up.shape[0] * (ep.size if ep is not None else 1)
    flat = top_k_index.reshape(-1)  # (N k,)
    order = torch.argsort(flat, stable=True)  # token copies by expert, dropped ones (id E) last
    counts = count_per_expert(flat, n_experts + 1)  # (E + 1,): the last entry counts dropped copies
    kept = order[: flat.numel() - int(counts[n_experts])] if may_drop else order
    counts = counts[:n_experts]
    x = hidden[kept // top_k]  # (S, H)
    act = getattr(experts, "act_fn", F.silu)
    has_bias = bool(getattr(experts, "has_bias", False))
    gate_up_bias = local_tensor(experts.gate_up_proj_bias) if has_bias else None
    down_bias = local_tensor(experts.down_proj_bias) if has_bias else None
    if ep is not None:
        gate_up_bias, down_bias = ep.tp_summed(gate_up_bias), ep.tp_summed(down_bias)

    def compute(tokens: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        return run_experts(tokens, local_counts, gate_up, down, act, transposed=bool(getattr(experts, "is_transposed", False)),
                           gate_up_bias=gate_up_bias, down_bias=down_bias, apply_gate=getattr(experts, "_apply_gate", None))

    y = ep.dispatch(x, counts, compute) if ep is not None else compute(x, counts)  # (S, H)
    weights = top_k_weights.reshape(-1)[kept].unsqueeze(-1)  # (S, 1)
    # fp32 products and sum over k, rounded once. What backward keeps is `y` in its own dtype (bf16 times the fp32
    # weights promotes) and integer positions: gathering the copies back into token order (a dropped copy reads a zero
    # row) keeps no (S, H) fp32 tensor, where `index_copy` would keep its source (2·S·H bytes saved, not 2 x 4·S·H).
    weighted = y * weights.float()  # (S, H)
    position = torch.full((flat.numel(),), weighted.shape[0], dtype=torch.int64, device=hidden.device)
    position[kept] = torch.arange(weighted.shape[0], device=hidden.device)  # token copy -> its row of `weighted`
    rows = torch.cat([weighted, weighted.new_zeros(1, weighted.shape[-1])]).index_select(0, position)  # (N k, H)
    return rows.view(n_tokens, top_k, -1).sum(1).to(hidden.dtype)  # (N, H)


def count_per_expert(expert_ids: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64 occurrences of 0..n-1 in ``expert_ids``; unlike `torch.bincount`, no host sync on GPU."""
    ids = expert_ids.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int64))


def shard_experts(experts: nn.Module, ep: ExpertParallel) -> None:
    """Split `experts`' weights (and their per-expert biases) over the ep mesh on the expert dim (DTensor
    ``Shard(0)``, names and global shapes kept) and route its tokens through `ep`."""
    biases = [f"{name}_bias" for name in EXPERT_WEIGHTS if isinstance(getattr(experts, f"{name}_bias", None), torch.Tensor)]
    for name in (*EXPERT_WEIGHTS, *biases):
        weight = getattr(experts, name)
        if weight.shape[0] % ep.size:
            raise ValueError(f"{type(experts).__name__}.{name}: {weight.shape[0]} experts do not split over ep={ep.size}")
        # Every rank holds the same weights here (broadcast or seeded): each keeps its slice, no communication.
        sharded = distribute_tensor(weight.data, ep.mesh, [Shard(0)], src_data_rank=None)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    setattr(experts, EXPERT_PARALLEL_ATTRIBUTE, ep)


# --------------------------------------------------------------------------- routing statistics


class RouterLoad:
    """What one router saw during the current optimizer step, and how its balance terms are scaled.

    ``counts`` (E,): token copies routed to each expert in training forwards of the step (all
    micro-batches; recomputation under activation checkpointing is not counted twice). ``aux``:
    the sum of the balance terms added to the loss sum. ``grad_scale``: the factor the terms'
    gradient gets in backward: what the loss sum gets, 1 / accumulate_grad_batches (set by the
    strategy). ``sequence_group``: ranks holding other tokens of the same rows (context parallel),
    over which a row's counts are summed before its balance term is formed.
    """

    def __init__(self, n_experts: int, top_k: int, layer: int) -> None:
        self.n_experts = n_experts
        self.top_k = top_k
        self.layer = layer
        self.counts: Optional[torch.Tensor] = None
        self.aux: Optional[torch.Tensor] = None
        self.dropped: Optional[torch.Tensor] = None
        self.tokens = 0
        self.grad_scale = 1.0
        self.sequence_group: Optional[dist.ProcessGroup] = None

    def record(self, top_k_index: torch.Tensor, aux: Optional[torch.Tensor], n_tokens: int) -> None:
        """Add a training forward's routing (``top_k_index`` (N, k), dropped = E) to the step's counts."""
        if not is_step_forward():
            return
        counts = count_per_expert(top_k_index.detach(), self.n_experts + 1)
        self.counts = counts[: self.n_experts] if self.counts is None else self.counts + counts[: self.n_experts]
        dropped = counts[self.n_experts:].sum()
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        if aux is not None:
            self.aux = aux.detach().float() if self.aux is None else self.aux + aux.detach().float()
        self.tokens = n_tokens

    def reset(self) -> None:
        self.counts, self.aux, self.dropped = None, None, None


_UNCOUNTED = [0]


@contextmanager
def routing_not_counted() -> Iterator[None]:
    """Forwards inside are not the step's (a pipeline stage's shape inference): `is_step_forward` says False."""
    _UNCOUNTED[0] += 1
    try:
        yield
    finally:
        _UNCOUNTED[0] -= 1


def is_step_forward() -> bool:
    """Whether the forward running now is one of the step's: not inside `routing_not_counted` (a pipeline stage's
    shape inference), not inside backward (activation checkpointing's recomputation: already run), grad enabled.
    The MoE load counts only these; so does `ultrascale verify --explain`'s trace."""
    return not _UNCOUNTED[0] and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def balance_terms(
    logits: torch.Tensor, top_k_index: torch.Tensor, rows: int, load: RouterLoad, *, aux_coef: float, z_coef: float
) -> Optional[torch.Tensor]:
    """``sum_t aux_coef * a_t + z_coef * z_t`` over the N = rows x T tokens of ``logits`` (N, E) (see
    the module docstring); ``top_k_index`` (N, k) are the chosen experts (E = dropped, still counted
    as chosen: the balance is about the router's choice). None when both coefficients are 0."""
    if aux_coef == 0 and z_coef == 0:
        return None
    n_experts = logits.shape[-1]
    logits = logits.float()
    total = logits.new_zeros(())
    if aux_coef:
        probs = logits.softmax(-1).view(rows, -1, n_experts)  # (B, T, E)
        chosen = F.one_hot(top_k_index.clamp(max=n_experts - 1), n_experts).view(rows, -1, top_k_index.shape[-1], n_experts)
        counts = chosen.sum((1, 2)).float()  # (B, E) selections per row
        tokens = torch.full((rows, 1), float(probs.shape[1]), device=logits.device)
        if load.sequence_group is not None:  # the row's other tokens live on other cp ranks
            both = torch.cat([counts, tokens], dim=1)
            dist.all_reduce(both, group=load.sequence_group)
            counts, tokens = both[:, :-1], both[:, -1:]
        f = counts * n_experts / (top_k_index.shape[-1] * tokens)  # (B, E), no gradient
        total = total + aux_coef * (f.unsqueeze(1) * probs).sum()
    if z_coef:
        total = total + z_coef * torch.logsumexp(logits, dim=-1).pow(2).sum()
    return total


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward also seeds ``aux`` with ``load.grad_scale`` (Megatron's
    MoEAuxLossAutoScaler): the balance terms join backward wherever the loss is computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, load: RouterLoad) -> torch.Tensor:  # type: ignore[override]
        ctx.load = load
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, torch.full(ctx.aux_shape, ctx.load.grad_scale, device=grad.device, dtype=torch.float32), None


def attach_aux_loss(x: torch.Tensor, aux: Optional[torch.Tensor], load: RouterLoad) -> torch.Tensor:
    """``x``, with the balance terms ``aux`` joining its backward (scaled by ``load.grad_scale``)."""
    if aux is None or not torch.is_grad_enabled() or not aux.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, aux, load)


def capacity_mask(top_k_index: torch.Tensor, n_experts: int, capacity_factor: float) -> torch.Tensor:
    """``top_k_index`` (N, k) with assignments over capacity replaced by ``n_experts`` (dropped).
    Capacity per expert: ceil(capacity_factor * N k / E) token copies of this forward; first choices
    are served before second choices, earlier tokens before later ones (GShard)."""
    n, k = top_k_index.shape
    capacity = math.ceil(capacity_factor * n * k / n_experts)
    by_choice = top_k_index.t().reshape(-1)  # (k N,) all first choices, then all second choices
    one_hot = F.one_hot(by_choice, n_experts)  # (k N, E)
    position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)  # place of each copy in its expert's queue
    kept = torch.where(position < capacity, by_choice, torch.full_like(by_choice, n_experts))
    return kept.view(k, n).t().contiguous()


# --------------------------------------------------------------------------- the step's statistics


def router_loads(module: nn.Module) -> list[RouterLoad]:
    """Every router's `RouterLoad` in `module` (this rank's layers only under pipeline parallel)."""
    return [getattr(m, ROUTER_LOAD_ATTRIBUTE) for m in module.modules() if hasattr(m, ROUTER_LOAD_ATTRIBUTE)]


def iter_routers(module: nn.Module) -> Iterator[nn.Module]:
    return (m for m in module.modules() if hasattr(m, ROUTER_LOAD_ATTRIBUTE))


def set_aux_grad_scale(routers: list[nn.Module], scale: float) -> None:
    """The factor the balance terms' gradient gets in backward (`RouterLoad.grad_scale`)."""
    for router in routers:
        getattr(router, ROUTER_LOAD_ATTRIBUTE).grad_scale = scale


def set_sequence_group(module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    for load in router_loads(module):
        load.sequence_group = group


def step_expert_load(
    loads: list[RouterLoad], n_layers: int, n_experts: int, device: torch.device,
    group: Optional[dist.ProcessGroup] = None, copies: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's token counts per (MoE layer, expert) over all ranks of `group` (all data ranks and
    pipeline stages; one all-reduce), the summed balance terms and dropped copies; the loads reset.
    `loads` may be empty (a pipeline stage without MoE layers); the shape is the whole model's.
    `copies`: how many ranks of `group` routed each token (tensor parallel: all tp ranks do).

    Returns ``counts`` (n_layers, n_experts), ``aux`` (scalar sum), ``dropped`` (scalar)."""
    table = torch.zeros(n_layers, n_experts + 2, device=device, dtype=torch.float64)
    for load in loads:
        if load.counts is not None:
            table[load.layer, : load.n_experts] += load.counts.to(device, torch.float64)
        if load.aux is not None:
            table[load.layer, -2] += load.aux.to(device, torch.float64)
        if load.dropped is not None:
            table[load.layer, -1] += load.dropped.to(device, torch.float64)
        load.reset()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(table, group=group)
        table /= copies  # exact: float64 sums of integers (and of the same aux) each counted `copies` times
    return table[:, :n_experts], table[:, -2].sum(), table[:, -1].sum()


def balance_ratio(counts: torch.Tensor) -> torch.Tensor:
    """max / mean of the token counts over experts, per layer (1 = perfectly balanced); (L,) for (L, E)."""
    mean = counts.mean(-1).clamp(min=1e-9)
    return counts.max(-1).values / mean


@torch.no_grad()
def update_router_bias(routers: list[nn.Module], counts: torch.Tensor) -> None:
    """Aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024): after each step every expert's
    selection bias moves by ``rate`` towards balance, ``b_i += rate * sign(mean_j c_j - c_i)`` from the
    step's global counts, so every rank holding a layer applies the same update."""
    for router in routers:
        bias = getattr(router, "expert_bias", None)
        rate = getattr(router, "bias_update_rate", 0.0)
        if bias is None or not rate:
            continue
        layer_counts = counts[getattr(router, ROUTER_LOAD_ATTRIBUTE).layer].to(bias.device, torch.float32)
        bias.add_(rate * torch.sign(layer_counts.mean() - layer_counts))


def scale_balance_terms(routers: Sequence[torch.nn.Module], accumulate: int, mean_over: Optional[int] = None) -> None:
    """Give the MoE balance terms' gradient (`RouterLoad.grad_scale`) the factor the loss gets, so they join
    backward on the loss's scale. The terms are token sums; with k = `accumulate` micro-batches:

        token-normalised step:  backward(S_m / k)          ->  1 / k
        mean loss (`mean_over` = n_m valid tokens):  backward(S_m / (k n_m))  ->  1 / (k n_m)

    The one rule for both: `StepRunner` applies it under ultrascale strategies, `CausalLMModule` under
    Lightning's own (which differentiate the micro-batch mean)."""
    if mean_over is None:
        set_aux_grad_scale(list(routers), 1.0 / accumulate)
    else:
        set_aux_grad_scale(list(routers), 1.0 / (accumulate * max(1, mean_over)))


__all__ = [
    "EXPERT_PARALLEL_ATTRIBUTE",
    "LOAD_BALANCE_MODES",
    "ROUTER_LOAD_ATTRIBUTE",
    "ExpertParallel",
    "RouterLoad",
    "attach_aux_loss",
    "balance_ratio",
    "balance_terms",
    "capacity_mask",
    "count_per_expert",
    "experts_forward",
    "local_tensor",
    "router_loads",
    "is_step_forward",
    "routing_not_counted",
    "run_experts",
    "scale_balance_terms",
    "set_aux_grad_scale",
    "set_sequence_group",
    "shard_experts",
    "step_expert_load",
    "update_router_bias",
]
