"""ZeRO-1 and ZeRO-2: replicated parameters, optimizer state (and gradients) sharded over dp ranks.

Rajbhandari et al. 2020 / the Ultra-Scale Playbook, for Ψ parameters on N ranks under Adam
with bf16 compute and fp32 master weights (gradients in fp32, `zero12_dtypes`; the paper's 2Ψ bf16):

    ZeRO-1: 2Ψ (bf16 params) + 4Ψ (fp32 grads) + 12Ψ/N (fp32 master, m, v)
    ZeRO-2: 2Ψ (bf16 params) + 4Ψ/N (fp32 grad shard) + 12Ψ/N

Layout. The parameters of each optimizer param group are packed, in reverse registration
order (roughly the order backward produces their gradients), into contiguous buckets of
about `bucket_bytes`, each padded to a multiple of N; every parameter becomes a view into
its bucket's flat buffer. Rank r owns the r-th 1/N of every bucket: its fp32 master
weights, optimizer moments and reduced gradients for that slice. Each collective moves one
bucket-sized contiguous tensor:

    backward: reduce-scatter(bucket grads, SUM) -> added into this rank's grad slice,
              launched in a synchronised backward as soon as the bucket's last gradient is
              accumulated, overlapping the rest of backward (DDP's and Megatron's overlap);
              backward passes under `no_sync` (the non-final micro-batches) only accumulate.
              ZeRO-2 frees the full bucket after; ZeRO-1 keeps it and its reduced slice
              lives in this rank's own region of it (no extra memory)
    step:     the optimizer steps only the slices (elementwise optimizers only)
    after:    all-gather(bucket params) -> every rank has the updated weights

Gradients are summed over the dp ranks, never averaged: the caller scales the slices once per
step (by 1 / valid tokens of the global batch, `ultrascale.parallel.loss`). Any number of
backward passes may make up one step (accumulation, pipeline micro-batches).

Bytes sent per rank per step: (N-1)/N * Ψ elements for the reduce-scatter plus the same for
the all-gather, i.e. 2Ψ(N-1)/N, the same as DDP's ring all-reduce.

Checkpoints: the state is saved per parameter name, N-independent, by `ZeroCheckpointing`
(`ultrascale.parallel.zero_checkpoint`), the part of the engine that re-lays it out.

Tensor parallel (parameters that are DTensors on a 1-D tp mesh): the engine works on each rank's
local tp shard, so ZeRO-1 keeps 2Ψ/tp + 2Ψ/tp + 12Ψ/(tp·N) bytes (Megatron's distributed optimizer
inside each tp group). A gradient whose placement is not its parameter's (Partial, from a
sequence-parallel norm) is redistributed to it first (one all-reduce over tp). The reductions run
over the dp ranks only; the global norm adds the tp ranks' sums, counting the parameters every tp
rank holds whole (Replicate) once. In checkpoints a tp parameter's state is parameter-shaped: its
local shard split by dim-0 rows over the dp ranks, a DTensor on `state_mesh` ((dp_replicate,) tp,
dp_shard x cp) with placements (tp's, Shard(0)); DCP reshards it to any tp and dp degree.

Across ZeRO families: ZeRO-3 (FSDP2) saves the same keys (`state.<name>.<key>`) but
parameter-shaped, with the step per parameter rather than per group and without "master"
(its fp32 weights are the model weights). `saved_optimizer_layout` tells the two apart from
DCP's metadata; `ZeroEngine.param_shaped_template` / `load_param_shaped_state_dict` read a
ZeRO-3 optimizer state into ZeRO-1/2, and `zero_layouts.flat_state_template` / `param_shaped_from_flat` a
ZeRO-1/2 one into FSDP's layout. Each converted state tensor is gathered whole on every rank
once, one tensor at a time (transient memory of one parameter's state, not of the model).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ultrascale.parallel.device import all_gather_single, collective_device, reduce_scatter_single
from ultrascale.parallel.grad import power_sum
from ultrascale.parallel.optimizers import is_elementwise, optimizer_refusal
from ultrascale.parallel.zero_checkpoint import ShardRanks, ZeroCheckpointing, _local

_reduce_scatter = reduce_scatter_single
_all_gather = all_gather_single
_gather_for_inspection = _all_gather  # not the training path: tests count `_all_gather` calls


def zero12_dtypes(precision: str, accumulate_in_fp32: Optional[bool] = None) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    """(compute_dtype, accumulate_dtype) of a `ZeroEngine` under a Trainer precision (None: the weights' dtype).
    bf16-mixed: bf16 weights for compute (fp32 masters in the optimizer) and, unless `accumulate_in_fp32=False`, fp32
    gradients, as FSDP's `reduce_dtype` and Megatron's distributed optimizer under bf16 (`estimate.state_bytes`)."""
    if accumulate_in_fp32 is None:
        accumulate_in_fp32 = precision == "bf16-mixed"
    return (torch.bfloat16 if precision == "bf16-mixed" else None), (torch.float32 if accumulate_in_fp32 else None)


def engine_for(optimizer: Any, engines: Sequence["ZeroEngine"]) -> Optional["ZeroEngine"]:
    """Which of `engines` (a strategy's, or a loop's own) owns `optimizer`, if any. Wrappers that expose the
    wrapped optimizer as `.optimizer` (Lightning's LightningOptimizer, accelerate's AcceleratedOptimizer) are
    unwrapped."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", optimizer)
    return next((engine for engine in engines if engine.optimizer is optimizer), None)


@dataclass(frozen=True)
class ExpertMeshes:
    """Expert parallel under ZeRO-1/2: the experts (DTensors `Shard(0)` on `ep`) are bucketed apart and cut over
    `dp`, the ranks holding the same experts (`ParallelMesh.expert_fsdp`: ep_shard, or (dp_replicate, ep_shard));
    their checkpointed state lives on `state` (`ParallelMesh.expert_zero_state_mesh`)."""

    ep: DeviceMesh
    dp: DeviceMesh
    state: DeviceMesh


@dataclass
class _Bucket:
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    shard: int  # elements per rank = padded numel / N
    param_buffer: torch.Tensor  # (N * shard,) compute dtype; the parameters are views into it
    master: torch.Tensor  # (shard,) the optimizer's parameter: a view of this rank's slice, or an fp32 copy
    grad_buffer: Optional[torch.Tensor] = None  # (N * shard,) accumulated local grads
    grad_shard: Optional[torch.Tensor] = None  # (shard,) reduced grads of this rank's slice
    accumulate_dtype: Optional[torch.dtype] = None
    master_is_view: bool = True
    split_over_tp: bool = False  # tp ranks hold different parts of these parameters
    tied: bool = False  # a weight the other pipeline end holds too (tied embeddings): alone in its bucket
    reduced_in_buffer: bool = False  # ZeRO-1: the buffer's gradients are already in `grad_shard`
    ready: int = 0
    pending: Optional[tuple[Any, torch.Tensor]] = None
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    over: Optional[ShardRanks] = None  # the ranks it is cut over (the dense dp ranks, or the experts')


class ZeroEngine(ZeroCheckpointing):
    """Turns a model + elementwise optimizer into ZeRO-1 (`stage=1`) or ZeRO-2 (`stage=2`).

    The optimizer is changed in place (its param groups then hold this rank's slices), so
    LR schedulers and Lightning keep working on the same object. Gradient hooks accumulate
    into the buckets (ZeRO-2 also reduce-scatters them during a synchronised backward);
    `reduce_gradients()` finishes the step's reduction, after which `grad_shards()` are this
    rank's summed gradient slices (scale or clip them there); the optimizer's own `step` then runs
    unchanged, and torch's step hooks (registered here, removed by `detach`) reduce if that has not
    happened yet, hand the slices to it after its closure, and all-gather the updated weights.

    Args:
        module: the model whose parameters the optimizer holds (plain tensors, not DTensors).
        optimizer: a fresh (never stepped) elementwise torch optimizer over `module`'s parameters.
        stage: 1 or 2.
        dp_mesh: the data-parallel mesh: 1-D (ranks that shard the optimizer state, dp_shard x cp),
            or 2-D (replicate, shard): gradients are then also summed across the replicas, and
            each replica holds the same shards (HSDP-like).
        bucket_bytes: target bucket size; gradients of a bucket are reduced in one collective.
        compute_dtype: dtype of the model parameters during forward/backward (bf16 under bf16-mixed);
            master weights keep the parameters' current dtype.
        accumulate_dtype: dtype of the gradient buffers (fp32 to accumulate bf16 gradients in fp32).
        norm_group: ranks holding other parameters (pipeline stages) whose gradients count in the global norm.
        state_mesh: with tensor-parallel (DTensor) parameters, the ((dp_replicate,) tp, dp) mesh their
            checkpointed state lives on (`ParallelMesh.zero_state_mesh`); unused otherwise.
        tied: under pipeline parallel with tied embeddings, this rank's end of the tie (a `TiedStageWeights`:
            `params`, `group`, `counted`). Each tied weight gets a bucket of its own, cut alike on both ends (the
            same weight over the same dp ranks), so the two ends' reduced slices are the two halves of one
            gradient, element by element: `reduce_gradients` sums them over `group` (1/N of the weight, not all
            of it), both ends take the same step, and the norm counts the weight on the `counted` end only.
        experts: under expert parallel, the ep mesh the experts are split over and the meshes their buckets are
            cut over and checkpointed on (`ExpertMeshes`). Each rank's slices of its experts are disjoint from every
            other rank's of dp_shard x cp (= ep x ep_shard), so the global norm needs no collective of its own.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        dp_mesh: DeviceMesh,
        bucket_bytes: int = 100 * 2**20,
        compute_dtype: Optional[torch.dtype] = None,
        accumulate_dtype: Optional[torch.dtype] = None,
        norm_group: Optional[dist.ProcessGroup] = None,
        state_mesh: Optional[DeviceMesh] = None,
        tied: Optional[Any] = None,
        experts: Optional[ExpertMeshes] = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroEngine: `stage={stage}` must be 1 or 2 (stage 3 is FSDP)")
        if not is_elementwise(optimizer):
            raise optimizer_refusal(optimizer, f"ZeRO-{stage}", "the optimizer state and step are sharded element by "
                                    "element over the data-parallel ranks")
        if optimizer.state:
            raise ValueError("ZeroEngine needs an optimizer that has not stepped yet (its state would be lost)")
        if bucket_bytes <= 0:
            raise ValueError(f"ZeroEngine: `bucket_bytes={bucket_bytes}` must be positive")
        self.norm_group = norm_group
        """Ranks holding other parameters (pipeline stages) whose gradients count in the global norm."""
        self.tied = tied
        self._tied_ids = {id(p) for p in tied.params if p.requires_grad} if tied is not None else set()
        names = {id(p): name for name, p in module.named_parameters()}
        tp_meshes = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError("ZeroEngine: the optimizer holds a parameter that is not in the module")
                if isinstance(p, DTensor) and not (experts is not None and p.device_mesh == experts.ep):
                    tp_meshes.add(p.device_mesh)
        if len(tp_meshes) > 1 or any(m.ndim != 1 for m in tp_meshes):
            raise ValueError(
                "ZeroEngine: DTensor parameters must all live on one 1-D (tensor-parallel) mesh, experts on the ep mesh "
                "of `experts`; FSDP-sharded parameters are zero_stage=3's"
            )
        self.tp_mesh: Optional[DeviceMesh] = next(iter(tp_meshes), None)
        if self.tp_mesh is not None and state_mesh is None:
            raise ValueError("ZeroEngine: tensor-parallel parameters need `state_mesh` (ParallelMesh.zero_state_mesh)")
        self.tp_group = self.tp_mesh.get_group() if self.tp_mesh is not None and self.tp_mesh.size() > 1 else None
        self.tp_rank = self.tp_mesh.get_local_rank() if self.tp_mesh is not None else 0
        self.stage = stage
        self.dp_mesh = dp_mesh
        self.dense = ShardRanks(dp_mesh, state_mesh)
        self.experts = experts
        self.expert_ranks = ShardRanks(experts.dp, experts.state) if experts is not None else None
        self._sync = True
        self._backward_queued = False
        self._unreduced = False  # some backward since the last reduction left local gradients
        self._reduced = False  # this step's gradients are reduced; the next event must be the step
        self.optimizer = optimizer
        self.group_buckets: list[list[_Bucket]] = []
        self.buckets: list[_Bucket] = []
        self.names = names
        for group in optimizer.param_groups:
            buckets = self._build_buckets(
                [(names[id(p)], p) for p in reversed(group["params"]) if p.requires_grad],
                bucket_bytes,
                compute_dtype,
                accumulate_dtype,
            )
            self.group_buckets.append(buckets)
            self.buckets.extend(buckets)
            group["params"] = [b.master for b in buckets]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.ranks_of = {name: b.over for b in self.buckets for name in b.names}
        self._next_to_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params]
        # The optimizer's own step runs unchanged on the masters, through torch's step hooks: the pre-hook hands it
        # this rank's reduced slices as the masters' gradients once its closure has run (Lightning's closure is the
        # last forward and backward and the clipping: a pre-hook runs before it, so it wraps it), the post-hook
        # publishes the updated masters into every rank's weights.
        self._step_hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                            optimizer.register_step_post_hook(self._after_optimizer_step)]
        self._initialising = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside defer their reduction to the step's `reduce_gradients` (DDP's `no_sync`): the
        non-final micro-batches of gradient accumulation, a pipeline schedule's micro-batches."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def detach(self) -> None:
        """Take the gradient hooks off the model and the step hook off the optimizer (the end of a fit).
        The engine still answers for the optimizer's state (a checkpoint saved after the fit); a new engine over
        the same parameters may take over (their weights are views of this one's last buffers)."""
        for hook in [*self._hooks, *self._step_hooks]:
            hook.remove()
        self._hooks, self._step_hooks = [], []

    # ------------------------------------------------------------------ layout
    def _build_buckets(self, named, bucket_bytes, compute_dtype, accumulate_dtype) -> list[_Bucket]:
        # Parameters split over tp and those every tp rank holds whole go to separate buckets: the
        # global norm counts the second kind once (`grad_norm`). A tied weight is a bucket alone; experts
        # (expert parallel) are bucketed apart, cut over the ranks holding the same experts.
        tied = [[(n, p)] for n, p in named if id(p) in self._tied_ids]
        named = [(n, p) for n, p in named if id(p) not in self._tied_ids]
        experts = [(n, p) for n, p in named if self._is_expert(p)]
        named = [(n, p) for n, p in named if not self._is_expert(p)]
        kinds = [([(n, p) for n, p in named if _split_over_tp(p)], self.dense),
                 ([(n, p) for n, p in named if not _split_over_tp(p)], self.dense),
                 (experts, self.expert_ranks)]
        buckets = [(chunk, self.dense) for chunk in tied]
        for kind, over in kinds:
            current, size = [], 0
            for name, p in kind:
                current.append((name, p))
                size += _local(p).numel() * p.element_size()
                if size >= bucket_bytes:
                    buckets.append((current, over))
                    current, size = [], 0
            if current:
                buckets.append((current, over))
        return [self._make_bucket(chunk, over, compute_dtype, accumulate_dtype) for chunk, over in buckets]

    def _is_expert(self, p: torch.Tensor) -> bool:
        return self.experts is not None and isinstance(p, DTensor) and p.device_mesh == self.experts.ep

    @torch.no_grad()
    def _make_bucket(self, chunk, over: ShardRanks, compute_dtype, accumulate_dtype) -> _Bucket:
        params = [p for _, p in chunk]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + _local(p).numel())
        numel = offsets.pop()
        shard = math.ceil(numel / over.world)
        master_dtype, device = params[0].dtype, _local(params[0]).device
        dtype = compute_dtype or master_dtype
        param_buffer = torch.zeros(shard * over.world, dtype=dtype, device=device)
        full_master = torch.zeros(shard * over.world, dtype=master_dtype, device=device)
        for p, offset in zip(params, offsets):
            local = _local(p)
            full_master[offset : offset + local.numel()].copy_(local.detach().reshape(-1))
        param_buffer.copy_(full_master)
        mine = slice(over.rank * shard, (over.rank + 1) * shard)
        # Same dtype: the optimizer steps this rank's slice of the weights in place (no copy).
        master_is_view = dtype == master_dtype
        master = param_buffer[mine] if master_is_view else full_master[mine].clone()
        for p, offset in zip(params, offsets):
            local = _local(p)
            view = param_buffer[offset : offset + local.numel()].view(local.shape)
            if isinstance(p, DTensor):
                _rebind_local_tensor(p, view)
            else:
                p.data = view
            p.grad = None
        split = _split_over_tp(params[0]) and not self._is_expert(params[0])
        bucket = _Bucket([n for n, _ in chunk], params, offsets, numel, shard, param_buffer, master.requires_grad_(True),
                         over=over)
        bucket.accumulate_dtype = accumulate_dtype or dtype
        bucket.master_is_view = master_is_view
        bucket.split_over_tp = split
        bucket.tied = id(params[0]) in self._tied_ids
        return bucket

    def _grad_view(self, bucket: _Bucket, p: nn.Parameter) -> torch.Tensor:
        if bucket.grad_buffer is None:
            bucket.grad_buffer = torch.zeros(bucket.shard * bucket.over.world, dtype=bucket.accumulate_dtype,
                                             device=p.device)
            bucket.views = {}
        view = bucket.views.get(id(p))
        if view is None:
            offset = bucket.offsets[next(i for i, q in enumerate(bucket.params) if q is p)]
            local = _local(p)
            view = bucket.views[id(p)] = bucket.grad_buffer[offset : offset + local.numel()].view(local.shape)
        return view

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self._reduced:
            raise RuntimeError(
                "ZeroEngine: a backward ran after reduce_gradients() and before optimizer.step(); the step's "
                "gradients were already reduced. Run every backward of a step before reducing."
            )
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._unreduced = True
        bucket = self._bucket_of[id(p)]
        view = self._grad_view(bucket, p)
        self._detach_reduced_region(bucket)
        if p.grad is not view:
            view.add_(_local_grad(p))
            # Keep accumulating in place in the bucket (DDP's gradient_as_bucket_view),
            # unless the bucket accumulates in another dtype (or the parameter is a DTensor).
            p.grad = view if view.dtype == p.dtype and not isinstance(p, DTensor) else None
        bucket.ready += 1
        if self._sync:
            self._launch_ready_buckets()

    def _detach_reduced_region(self, bucket: _Bucket) -> None:
        """ZeRO-1, a backward after one reduced in the same step: the reduced slice moves out of its region and the
        buffer restarts from zero, so the next reduction adds only the new gradients (the reduced ones would be summed
        again). The parameters' `.grad` was let go at that reduction, so autograd wrote nothing here."""
        if bucket.reduced_in_buffer:
            if bucket.grad_shard.data_ptr() == self._region(bucket).data_ptr():
                bucket.grad_shard = bucket.grad_shard.clone()
            bucket.grad_buffer.zero_()
            bucket.reduced_in_buffer = False

    @staticmethod
    def _region(bucket: _Bucket) -> torch.Tensor:
        return bucket.grad_buffer[bucket.over.rank * bucket.shard : (bucket.over.rank + 1) * bucket.shard]

    @torch.no_grad()
    def absorb_assigned_grads(self) -> None:
        """Take in gradients that were assigned to `.grad` instead of accumulated by autograd.

        torch's zero-bubble pipeline schedules compute weight gradients with `autograd.grad` and
        assign them, so no accumulation hook fires; call this after such a backward. Their sum joins
        the local bucket gradients and is reduced with them in `reduce_gradients`."""
        for bucket in self.buckets:
            for p in bucket.params:
                view = self._grad_view(bucket, p) if p.grad is not None else None
                if view is None or p.grad is view:
                    continue
                if self._reduced:
                    raise RuntimeError("ZeroEngine: gradients were assigned after reduce_gradients() and before the step")
                self._detach_reduced_region(bucket)
                view.add_(_local_grad(p))
                p.grad = view if view.dtype == p.dtype and not isinstance(p, DTensor) else None
                self._unreduced = True

    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order, so every rank issues the collectives in the same order.
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_to_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.grad_buffer is None:  # no gradient reached this bucket on this rank: it contributes zeros
            bucket.grad_buffer = torch.zeros(
                bucket.shard * bucket.over.world, dtype=bucket.accumulate_dtype, device=bucket.param_buffer.device
            )
        out = torch.empty(bucket.shard, dtype=bucket.grad_buffer.dtype, device=bucket.grad_buffer.device)
        work = _reduce_scatter(out, bucket.grad_buffer, op=dist.ReduceOp.SUM, group=bucket.over.group, async_op=True)
        bucket.pending = (work, out)

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of every backward. With gradient sync on, the reductions its hooks launched are finished and the
        rest launched (buckets a parameter without a gradient kept from being complete): ZeRO-2 frees the full
        gradients (its memory contract). Under `no_sync` the local sums wait for the step's `reduce_gradients`."""
        self._backward_queued = False
        for bucket in self.buckets:
            bucket.ready = 0
        if self._sync:
            self._reduce_all()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce what the step's backward passes left unreduced into this rank's gradient slices.

        Call once per optimizer step, after its last backward and before the optimizer's step (a second call
        is a no-op). Any number of backward passes may precede it: ZeRO-1 sums them locally and reduces once
        here; ZeRO-2 has already reduced each synchronised backward into the slices and reduces only what
        accumulated without sync.
        """
        if self._unreduced:
            self._reduce_all()
        if self.tied is not None and not self._reduced:
            self._sum_tied()
        self._reduced = True

    def _sum_tied(self) -> None:
        """The two pipeline ends' reduced slices of each tied weight, summed (both ends call it once per step)."""
        for bucket in self.buckets:
            if bucket.tied:
                if bucket.grad_shard is None:  # no gradient reached it this step on this end
                    bucket.grad_shard = torch.zeros(bucket.shard, dtype=bucket.accumulate_dtype,
                                                    device=bucket.param_buffer.device)
                dist.all_reduce(bucket.grad_shard, group=self.tied.group)

    def _reduce_all(self) -> None:
        """Reduce-scatter (SUM) every bucket's local gradients and add them into this rank's slices."""
        while self._next_to_launch < len(self.buckets):
            self._launch(self.buckets[self._next_to_launch])
            self._next_to_launch += 1
        self._next_to_launch = 0
        for bucket in self.buckets:
            work, out = bucket.pending
            work.wait()
            bucket.pending = None
            if bucket.over.replicate_group is not None:
                dist.all_reduce(out, group=bucket.over.replicate_group)
            if self.stage == 1:
                # ZeRO-1 keeps the full gradients: this rank's reduced slice lives in its own region of the
                # gradient buffer (no extra memory), unless an earlier reduction of the step moved it out.
                if bucket.grad_shard is None:
                    bucket.grad_shard = self._region(bucket).copy_(out)
                else:
                    bucket.grad_shard.add_(out)
                bucket.reduced_in_buffer = True
                for p in bucket.params:  # the buffer no longer holds their gradients (the next backward's go beside it)
                    p.grad = None
            else:
                bucket.grad_shard = out if bucket.grad_shard is None else bucket.grad_shard.add_(out)
                bucket.grad_buffer, bucket.views = None, {}
                for p in bucket.params:
                    p.grad = None
        self._unreduced = False

    # ------------------------------------------------------------------ step
    def _before_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """torch's step pre-hook (`args` starts with the optimizer): the masters' gradients, after the closure."""
        if self._initialising:
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._expose_gradients()
            return None

        def closure_then_gradients() -> Any:
            loss = closure()
            self._expose_gradients()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_gradients}
        return (args[0], closure_then_gradients, *args[2:]), kwargs

    @torch.no_grad()
    def _expose_gradients(self) -> None:
        """This rank's reduced slices as the masters' gradients (cast to the masters' dtype), for the update."""
        self.reduce_gradients()
        for bucket in self.buckets:
            bucket.master.grad = None if bucket.grad_shard is None else bucket.grad_shard.to(bucket.master.dtype)

    def _after_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if not self._initialising:
            self._after_step()

    @torch.no_grad()
    def _publish_masters(self) -> None:
        """Every rank's slice of the (updated or loaded) masters into the weights, all-gathered: each rank's full weights."""
        for bucket in self.buckets:
            mine = bucket.param_buffer[bucket.over.rank * bucket.shard : (bucket.over.rank + 1) * bucket.shard]
            if not bucket.master_is_view:
                mine.copy_(bucket.master)
            _all_gather(bucket.param_buffer, mine, group=bucket.over.group)

    @torch.no_grad()
    def _after_step(self) -> None:
        self._publish_masters()
        self._clear_gradients()

    @torch.no_grad()
    def discard_step(self) -> None:
        """Drop this step's reduced gradients without an update (a skipped non-finite step)."""
        self.reduce_gradients()  # any pending reduction must finish before its buffers are reused
        self._clear_gradients()

    def _clear_gradients(self) -> None:
        """The step's gradients gone; ZeRO-1's parameters point their `.grad` at the zeroed bucket again, so the next
        step's backward accumulates in place (DDP's gradient_as_bucket_view)."""
        for bucket in self.buckets:
            bucket.master.grad = None
            bucket.grad_shard = None
            bucket.reduced_in_buffer = False
            if bucket.grad_buffer is not None:
                bucket.grad_buffer.zero_()
                for p in bucket.params:
                    view = bucket.views.get(id(p))
                    if view is not None and view.dtype == p.dtype and not isinstance(p, DTensor):
                        p.grad = view
        self._reduced = False

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the optimizer's state tensors without changing the weights (a zero-lr step on
        zero gradients), so that a checkpoint can be loaded into them."""
        if all(b.master in self.optimizer.state for b in self.buckets):
            return
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        try:
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0
            for bucket in self.buckets:
                bucket.master.grad = torch.zeros_like(bucket.master)
            self._initialising = True  # no all-gather after it: the weights are unchanged
            self.optimizer.step()
        finally:
            self._initialising = False
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
            for bucket in self.buckets:
                bucket.master.grad = None

    # ------------------------------------------------------------------ clipping
    def grad_shards(self) -> Iterator[torch.Tensor]:
        return (b.grad_shard for b in self.buckets if b.grad_shard is not None)

    def whole_over_tp_gradient_parts(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter of the dense buckets that every tp rank holds whole, with the part of its reduced gradient
        in this rank's slice (empty where the slice misses it): the same names on every rank, disjoint parts over
        `dense.group` (`grad.tensor_parallel_copies_that_differ(parts_over=...)`). Reduces the step's gradients."""
        self.reduce_gradients()
        parts = []
        for bucket in self.buckets:
            if bucket.split_over_tp or self._is_expert(bucket.params[0]):
                continue
            start = bucket.over.rank * bucket.shard
            shard = bucket.grad_shard if bucket.grad_shard is not None else bucket.param_buffer.new_zeros(bucket.shard)
            for name, p, offset in zip(bucket.names, bucket.params, bucket.offsets):
                low, high = max(offset, start), min(offset + _local(p).numel(), start + bucket.shard)
                parts.append((name, shard[low - start : max(high, low) - start]))
        return parts

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm: the slices are disjoint, so ||g||^p = all-reduce(sum |slice|^p)
        over the dp ranks, then the tp ranks (each adds its own shards; the parameters every tp rank
        holds whole count on tp rank 0 only), then `norm_group`'s ranks (the other pipeline stages)."""
        inf = math.isinf(norm_type)
        elsewhere = self.tied is not None and not self.tied.counted  # the other pipeline end counts the tied weight
        counted = [b.grad_shard for b in self.buckets if b.grad_shard is not None
                   and (inf or b.split_over_tp or self.tp_rank == 0) and not (b.tied and elsewhere)]
        has_shards = any(b.grad_shard is not None for b in self.buckets)
        if not counted:
            total = torch.zeros((), device=self.buckets[0].param_buffer.device if self.buckets
                                else collective_device(self.dense.group))
        elif inf:
            total = torch.stack([s.abs().max().float() for s in counted]).max()
        else:
            total = torch.stack([power_sum(s, norm_type) for s in counted]).sum()
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if has_shards:
            dist.all_reduce(total, op=op, group=self.dense.group)
            if self.tp_group is not None:
                dist.all_reduce(total, op=op, group=self.tp_group)
        if self.norm_group is not None:
            dist.all_reduce(total, op=op, group=self.norm_group)
        return total if inf else total ** (1.0 / norm_type)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, total_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Clip by the global norm (`grad_norm`, or `total_norm` if the caller already has it)."""
        shards = list(self.grad_shards())
        if not shards:
            return torch.tensor(0.0)
        total = total_norm if total_norm is not None else self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            s.mul_(coef.to(s.dtype))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        for s in self.grad_shards():
            s.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ inspection
    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """All reduced gradients, gathered and unflattened per parameter name (for tests and debugging)."""
        return self._gathered({id(b): b.grad_shard for b in self.buckets if b.grad_shard is not None})

    @torch.no_grad()
    def full_master_weights(self, keep: bool = True, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The weights the optimizer steps (fp32 masters under bf16-mixed), gathered per parameter name.

        Every rank of the engine must call it. `keep=False`: this rank takes part and returns {} (an export keeps
        them on one rank); `cpu`: each bucket's weights move to host memory as it is gathered, so the device
        holds one gathered bucket at a time."""
        return self._gathered({id(b): b.master.detach() for b in self.buckets}, keep=keep, cpu=cpu)

    def _gathered(self, slices: dict[int, torch.Tensor], keep: bool = True, cpu: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for bucket in self.buckets:
            if id(bucket) not in slices:
                continue
            mine = slices[id(bucket)]
            full = torch.empty(bucket.shard * bucket.over.world, dtype=mine.dtype, device=mine.device)
            _gather_for_inspection(full, mine.contiguous(), group=bucket.over.group)
            for name, p, offset in zip(bucket.names, bucket.params, bucket.offsets):
                local = full[offset : offset + _local(p).numel()].view(_local(p).shape)
                if isinstance(p, DTensor):
                    local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                               stride=p.stride()).full_tensor()
                if keep:
                    out[name] = local.to("cpu", copy=True) if cpu else local.clone()
        return out


def _split_over_tp(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and any(not placement.is_replicate() for placement in p.placements)


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """`p.grad` as this rank's part in `p`'s own layout: a Partial gradient (a sequence-parallel norm's,
    each tp rank's tokens only) is summed over tp first."""
    grad = p.grad
    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local()


def _rebind_local_tensor(p: nn.Parameter, local: torch.Tensor) -> None:
    """Make DTensor parameter `p` (same object: the module, the optimizer and tied modules keep it) hold
    `local` as its local shard, also in another dtype. A DTensor's `.data` cannot change its local tensor's
    dtype, so the parameter is swapped in place with a new one (its Python attributes kept)."""
    new = nn.Parameter(DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride()), requires_grad=p.requires_grad)
    attributes = {k: v for k, v in vars(p).items() if k not in vars(new)}
    torch.utils.swap_tensors(p, new)
    for key, value in attributes.items():
        setattr(p, key, value)
