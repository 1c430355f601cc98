"""A ZeRO-1/2 engine's optimizer state in checkpoints (`ZeroCheckpointing`, a part of `ultrascale.parallel.zero.ZeroEngine`).

The bucket layout depends on the dp size N, so the state is saved per parameter (by its name) as 1-D DTensors
sharded over the dp ranks like DTensor Shard(0), which makes a ZeRO-1/2 checkpoint loadable at any world size.
A rank's bucket slice and its checkpoint chunks share contiguous runs of elements (at most (params + 1) x N per
bucket, derived alike on every rank), so the re-layout on save and on load sends runs, not per-element indices:
one all-to-all per (state, bucket), whose buffers hold what changes rank. Extra memory per rank: the state in the
checkpoint's layout (one copy, what DCP writes from or reads into) plus one bucket slice sent and received
(measured: benchmarks/zero_checkpoint_memory.py). A tp parameter's state is parameter-shaped: its local shard
split by dim-0 rows over the dp ranks, on the dense ranks' `state_mesh`; an expert's (expert parallel) likewise:
its ep rank's experts split by rows over the ranks holding the same experts, on the experts' state mesh
((dp_replicate,) ep, ep_shard). ZeRO-3's parameter-shaped states are read in as well (`param_shaped_template`,
`load_param_shaped_state_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ultrascale.parallel.zero_layouts import _chunk_size, _saved_entries, _saved_groups, _saved_state_names, clean_name


class ShardRanks:
    """The data-parallel ranks a bucket is cut over: its `mesh`, 1-D (shard) or 2-D (replicate, shard), whose
    last dim's ranks each hold one slice; `state_mesh`: where the checkpointed state of a DTensor parameter of
    the bucket lives (parameter-shaped: its own placements, then dim-0 rows over the shard ranks).

    The dense parameters are cut over the stage's dp_shard x cp ranks; under expert parallel the experts, of
    which each ep rank holds its own, over the ranks holding the same experts (ep_shard)."""

    def __init__(self, mesh: DeviceMesh, state_mesh: Optional[DeviceMesh] = None) -> None:
        if mesh.ndim not in (1, 2):
            raise ValueError(f"ZeroEngine: a dp mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D")
        self.mesh = mesh
        self.state_mesh = state_mesh
        self.group = mesh.get_group(mesh.ndim - 1)
        self.world = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None


@dataclass(frozen=True)
class _Run:
    """Elements that rank `slice_rank` holds at `slice_at` of its slice of bucket `bucket`, and rank
    `chunk_rank` at `chunk_at` of its checkpoint chunk of parameter `name`."""

    bucket: int
    slice_rank: int
    slice_at: int
    name: str
    chunk_rank: int
    chunk_at: int
    length: int



class ZeroCheckpointing:
    """The checkpoint methods of `ZeroEngine`, which provides what is declared here."""

    buckets: list[Any]
    group_buckets: list[list[Any]]
    optimizer: torch.optim.Optimizer
    dp_mesh: DeviceMesh
    dense: ShardRanks
    """The ranks the dense (non-expert) buckets are cut over."""

    names: dict[int, str]
    """Parameter id -> name."""
    ranks_of: dict[str, ShardRanks]
    """Parameter name -> the ranks its bucket is cut over."""

    def _publish_masters(self) -> None:
        raise NotImplementedError

    def _row_numels(self) -> dict[str, int]:
        return {name: _row_numel(p) for b in self.buckets for name, p in zip(b.names, b.params)}

    def _chunk_numel(self, name: str, p: torch.Tensor, rank: int) -> int:
        """Elements of rank `rank`'s chunk of `p`'s state in the checkpoint: the flattened parameter (a tp
        parameter: its local shard) split like DTensor Shard(0), in whole dim-0 rows for a tp parameter."""
        row = _row_numel(p)
        return _chunk_size(_local(p).numel() // row, self.ranks_of[name].world, rank) * row

    def _runs(self) -> list[list[_Run]]:
        """Per bucket, the contiguous runs of elements that one rank's bucket slice and one rank's checkpoint
        chunk share, in one order every rank derives alike (so a receiver knows what each sender sends, and
        in which order, without being told). At most (params + 1) x N runs per bucket."""
        rows = self._row_numels()
        per_bucket = []
        for index, bucket in enumerate(self.buckets):
            runs = []
            for name, p, offset in zip(bucket.names, bucket.params, bucket.offsets):
                numel = _local(p).numel()
                chunk = math.ceil(numel / rows[name] / bucket.over.world) * rows[name]
                for chunk_rank in range(math.ceil(numel / chunk) if chunk else 0):
                    start, end = offset + chunk_rank * chunk, offset + min((chunk_rank + 1) * chunk, numel)
                    while start < end:  # the chunk may straddle the slices of several ranks
                        slice_rank = start // bucket.shard
                        stop = min(end, (slice_rank + 1) * bucket.shard)
                        runs.append(_Run(index, slice_rank, start - slice_rank * bucket.shard, name, chunk_rank,
                                         start - offset - chunk_rank * chunk, stop - start))
                        start = stop
            per_bucket.append(runs)
        return per_bucket

    def _move(self, over: ShardRanks, runs: list[_Run], to_chunks: bool, read: Any, write: Any, dtype: torch.dtype) -> None:
        """Move every run of one bucket (cut over `over`) from the rank holding it on one side (bucket slices, or
        checkpoint chunks when not `to_chunks`) to the rank holding it on the other: `write(run, values)` on the
        receiver gets what `read(run)` gave on the sender. One all-to-all whose buffers hold only what changes
        rank; runs that stay are copied. Every rank of `over` calls it with the same `runs`."""
        def source(run: _Run) -> int:
            return run.slice_rank if to_chunks else run.chunk_rank

        def target(run: _Run) -> int:
            return run.chunk_rank if to_chunks else run.slice_rank

        outgoing: list[list[_Run]] = [[] for _ in range(over.world)]
        incoming: list[list[_Run]] = [[] for _ in range(over.world)]
        for run in runs:
            if source(run) == over.rank and target(run) == over.rank:
                write(run, read(run))
            elif source(run) == over.rank:
                outgoing[target(run)].append(run)
            elif target(run) == over.rank:
                incoming[source(run)].append(run)
        if all(source(run) == target(run) for run in runs):  # the same answer on every rank: all skip the collective
            return
        device = self.buckets[0].param_buffer.device  # NCCL only moves device tensors
        pieces = [read(run).to(device=device, dtype=dtype) for group in outgoing for run in group]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        del pieces
        send_sizes = [sum(run.length for run in group) for group in outgoing]
        recv_sizes = [sum(run.length for run in group) for group in incoming]
        received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=over.group)
        del send
        at = 0
        for group in incoming:
            for run in group:
                write(run, received[at : at + run.length])
                at += run.length

    def _to_dtensor(self, local: torch.Tensor, numel: int) -> DTensor:
        placements = [Shard(0)] if self.dp_mesh.ndim == 1 else [Replicate(), Shard(0)]
        return DTensor.from_local(local, self.dp_mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))

    def _state_dtensor(self, p: torch.Tensor, chunk: torch.Tensor) -> DTensor:
        """This rank's chunk of a state of parameter `p` as the checkpoint holds it: 1-D over the dp ranks,
        or, for a tp or expert parameter, parameter-shaped on its ranks' `state_mesh` (its own placement, then dp rows)."""
        if not isinstance(p, DTensor):
            return self._to_dtensor(chunk, p.numel())
        state_mesh = self.ranks_of[self.names[id(p)]].state_mesh
        assert state_mesh is not None
        local = chunk.view(-1, *_local(p).shape[1:])
        placements = [*([Replicate()] * (state_mesh.ndim - 2)), *p.placements, Shard(0)]
        return DTensor.from_local(local, state_mesh, placements, run_check=False, shape=p.shape,
                                  stride=_contiguous_stride(p.shape))

    def _in_saved_layout(self, p: torch.Tensor, value: Any) -> bool:
        """Whether `value` (read from a checkpoint) is already in this engine's layout for `p`'s state."""
        if not isinstance(value, DTensor):
            return False
        if isinstance(p, DTensor):
            return value.device_mesh is self.ranks_of[self.names[id(p)]].state_mesh and value.shape == p.shape
        return value.device_mesh is self.dp_mesh and value.dim() == 1

    def _params_by_name(self) -> dict[str, torch.Tensor]:
        return {name: p for b in self.buckets for name, p in zip(b.names, b.params)}


    def _state_keys(self) -> dict[str, torch.dtype]:
        """The elementwise optimizer states (and "master" when the masters are copies), with their dtypes."""
        keys = {k: v.dtype for b in self.buckets for k, v in self.optimizer.state.get(b.master, {}).items()
                if _elementwise(v, b)}
        if self.has_master_copies:
            keys["master"] = self.buckets[0].master.dtype
        return dict(sorted(keys.items()))

    def _bucket_state(self, bucket: Any, key: str) -> torch.Tensor:
        return bucket.master.detach() if key == "master" else self.optimizer.state[bucket.master][key]

    def _groups_state(self) -> list[dict[str, Any]]:
        groups = []
        for group, buckets in zip(self.optimizer.param_groups, self.group_buckets):
            first = self.optimizer.state.get(buckets[0].master, {}) if buckets else {}
            scalars = {k: v for k, v in first.items() if not _elementwise(v, buckets[0])}
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"hyper": hyper, "scalars": scalars, "params": [n for b in buckets for n in b.names]})
        return groups

    def _empty_state_dict(self) -> dict[str, Any]:
        """`sharded_state_dict`'s layout, zero-filled (what DCP reads a checkpoint into)."""
        device = self.buckets[0].param_buffer.device if self.buckets else None
        state = {name: {key: self._state_dtensor(p, torch.zeros(self._chunk_numel(name, p, self.ranks_of[name].rank), dtype=dtype,
                                                                device=device))
                        for key, dtype in self._state_keys().items()}
                 for name, p in self._params_by_name().items()}
        return {"state": state, "param_groups": self._groups_state()}

    @torch.no_grad()
    def sharded_state_dict(self) -> dict[str, Any]:
        """Optimizer state per parameter name, as 1-D DTensors sharded over the dp ranks (N-independent).

        The slices are re-laid out one (state, bucket) at a time, in contiguous runs: beyond the returned
        state (one copy of this rank's), the working memory is one bucket slice's worth sent and received."""
        saved = self._empty_state_dict()
        runs = self._runs()
        for key, dtype in self._state_keys().items():
            chunks = {name: entry[key].to_local().view(-1) for name, entry in saved["state"].items()}

            def read(run: _Run, key: str = key) -> torch.Tensor:
                return self._bucket_state(self.buckets[run.bucket], key)[run.slice_at : run.slice_at + run.length]

            def write(run: _Run, values: torch.Tensor, chunks: dict[str, torch.Tensor] = chunks) -> None:
                chunks[run.name][run.chunk_at : run.chunk_at + run.length].copy_(values)

            for bucket, bucket_runs in zip(self.buckets, runs):
                self._move(bucket.over, bucket_runs, True, read, write, dtype)
        return saved

    @torch.no_grad()
    def load_sharded_state_dict(self, saved: dict[str, Any]) -> None:
        """Inverse of `sharded_state_dict`; the DTensors may have been written at any world size. The states
        are written into the optimizer's own tensors where they exist (as after `init_state`)."""
        keys = sorted({k for entry in saved["state"].values() for k in entry})
        by_name = self._params_by_name()
        runs = self._runs()
        for key in keys:
            for bucket, bucket_runs in zip(self.buckets, runs):
                if key == "master":
                    target = bucket.master.detach()
                else:
                    state = self.optimizer.state.setdefault(bucket.master, {})
                    target = state.get(key)
                    if not (isinstance(target, torch.Tensor) and _elementwise(target, bucket)
                            and target.dtype == bucket.master.dtype):
                        target = state[key] = torch.zeros_like(bucket.master, requires_grad=False)
                    target.zero_()  # the padding past the last parameter
                chunks = {name: self._own_layout(by_name[name], saved["state"][name][key]).to_local().reshape(-1)
                          for name in bucket.names}

                def read(run: _Run, chunks: dict[str, torch.Tensor] = chunks) -> torch.Tensor:
                    return chunks[run.name][run.chunk_at : run.chunk_at + run.length]

                def write(run: _Run, values: torch.Tensor, target: torch.Tensor = target) -> None:
                    target[run.slice_at : run.slice_at + run.length].copy_(values)

                self._move(bucket.over, bucket_runs, False, read, write, target.dtype)
                del chunks
        for group, buckets, saved_group in zip(self.optimizer.param_groups, self.group_buckets, saved["param_groups"]):
            group.update(saved_group["hyper"])
            for bucket in buckets:
                for k, v in saved_group["scalars"].items():
                    self.optimizer.state.setdefault(bucket.master, {})[k] = v.clone() if isinstance(v, torch.Tensor) else v
        if "master" in keys:  # the weights follow the (fp32) masters
            self._publish_masters()

    # ------------------------------------------------------------------ checkpoints of other layouts
    @property
    def has_master_copies(self) -> bool:
        """The optimizer steps fp32 copies of the weights (bf16-mixed): a checkpoint must provide them."""
        return bool(self.buckets) and not self.buckets[0].master_is_view

    def _own_layout(self, p: torch.Tensor, value: Any, dtype: Optional[torch.dtype] = None) -> DTensor:
        """`value` (a state of parameter `p` in any shape and layout) in this engine's checkpoint layout: as it
        is where it already is, else gathered whole (one parameter's state at a time) and this rank's chunk cut out."""
        if self._in_saved_layout(p, value) and (dtype is None or value.dtype == dtype):
            return value
        full = (value.full_tensor() if isinstance(value, DTensor) else value)
        if isinstance(p, DTensor):  # this tp (or ep) rank's shard, then its dp rows
            full = distribute_tensor(full.reshape(p.shape), p.device_mesh, p.placements, src_data_rank=None).to_local()
        flat = full.reshape(-1)
        row = _row_numel(p)
        over = self.ranks_of[self.names[id(p)]]
        start = min(flat.numel(), over.rank * math.ceil(flat.numel() / row / over.world) * row)
        local = flat[start : start + _chunk_size(flat.numel() // row, over.world, over.rank) * row]
        return self._state_dtensor(p, local.to(dtype or local.dtype).clone())

    def _param_shaped_dtensor(self, shape: torch.Size, dtype: torch.dtype) -> DTensor:
        """An empty DTensor of `shape`, dim 0 sharded over the dp ranks (a DCP read target)."""
        rows = _chunk_size(shape[0], self.dense.world, self.dense.rank)
        local = torch.zeros((rows, *shape[1:]), dtype=dtype, device=self.buckets[0].param_buffer.device)
        placements = [Shard(0)] if self.dp_mesh.ndim == 1 else [Replicate(), Shard(0)]
        return DTensor.from_local(local, self.dp_mesh, placements, run_check=False, shape=shape, stride=_contiguous_stride(shape))

    def flat_template(self, metadata: Any, prefix: str) -> dict[str, Any]:
        """What to give DCP to read a ZeRO-1/2 optimizer state at `prefix`: this engine's own state dict,
        except entries saved in the other shape (1-D where a tp run keeps tp parameters' states parameter-
        shaped, or the reverse), which are read as saved and converted by `load_sharded_state_dict`."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        own = self._empty_state_dict()
        by_name = self._params_by_name()
        for name, entry in own["state"].items():
            p = by_name[name]
            for key, value in entry.items():
                md = metadata.get(f"{prefix}.state.{name}.{key}")
                if not isinstance(md, TensorStorageMetadata) or tuple(md.size) == tuple(value.shape):
                    continue
                if tuple(md.size) == (p.numel(),):
                    numel = p.numel()
                    chunk = torch.zeros(_chunk_size(numel, self.dense.world, self.dense.rank), dtype=md.properties.dtype,
                                        device=self.buckets[0].param_buffer.device)
                    entry[key] = self._to_dtensor(chunk, numel)
                elif tuple(md.size) == tuple(p.shape):
                    entry[key] = self._param_shaped_dtensor(md.size, md.properties.dtype)
                else:
                    raise ValueError(f"checkpoint entry {prefix}.state.{name}.{key} has shape {tuple(md.size)}, "
                                     f"parameter {name!r} has {tuple(p.shape)}")
        return own

    def param_shaped_template(self, metadata: Any, prefix: str) -> dict[str, Any]:
        """What to give DCP to read an optimizer state saved parameter-shaped (ZeRO-3 / FSDP) at `prefix`.

        `metadata` is the checkpoint's DCP `state_dict_metadata`; the template holds exactly the
        saved entries of this engine's parameters (tensors dim-0 sharded over the dp ranks)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved_names = _saved_state_names(metadata, prefix)
        state: dict[str, dict[str, Any]] = {}
        for bucket in self.buckets:
            for name, p in zip(bucket.names, bucket.params):
                saved = saved_names.get(clean_name(name))
                if saved is None:
                    raise ValueError(
                        f"the checkpoint holds no optimizer state for parameter {clean_name(name)!r} "
                        f"(it has state for {len(saved_names)} parameters)"
                    )
                entry: dict[str, Any] = {}
                for key, md in _saved_entries(metadata, f"{prefix}.state.{saved}."):
                    if not isinstance(md, TensorStorageMetadata):
                        entry[key] = None
                    elif len(md.size) == 0:
                        entry[key] = torch.zeros((), dtype=md.properties.dtype)
                    elif md.size.numel() != p.numel():
                        raise ValueError(
                            f"checkpoint entry {prefix}.state.{saved}.{key} has shape {tuple(md.size)}, "
                            f"parameter {name!r} has {tuple(p.shape)}"
                        )
                    else:
                        entry[key] = self._param_shaped_dtensor(md.size, md.properties.dtype)
                state[saved] = entry
        return {"state": state, "param_groups": _saved_groups(metadata, prefix)}

    @torch.no_grad()
    def load_param_shaped_state_dict(self, loaded: dict[str, Any], weights: Optional[dict[str, Any]] = None) -> None:
        """Load a parameter-shaped (ZeRO-3 / FSDP) optimizer state read with `param_shaped_template`.

        `weights` (name -> full weight, the checkpoint's model weights at full precision) become
        the master copies when the engine keeps them (ZeRO-3 has no separate masters)."""
        if len(loaded["param_groups"]) != len(self.group_buckets):
            raise ValueError(
                f"the checkpoint's optimizer has {len(loaded['param_groups'])} param group(s), this one "
                f"{len(self.group_buckets)}"
            )
        weights = {clean_name(k): v for k, v in (weights or {}).items()}
        by_name = self._params_by_name()
        state: dict[str, dict[str, Any]] = {}
        groups = []
        for saved_group, buckets in zip(loaded["param_groups"], self.group_buckets):
            scalars: dict[str, Any] = {}
            for bucket in buckets:
                for name in bucket.names:
                    entry = state[name] = {}
                    for key, value in loaded["state"][clean_name(name)].items():
                        if isinstance(value, torch.Tensor) and value.dim() > 0:
                            entry[key] = self._own_layout(by_name[name], value, bucket.master.dtype)
                        else:  # the step: one per parameter in ZeRO-3, one per group here
                            scalars.setdefault(key, value)
                    if self.has_master_copies:
                        if clean_name(name) not in weights:
                            raise ValueError(f"the checkpoint holds no weights for {clean_name(name)!r}")
                        entry["master"] = self._own_layout(by_name[name], weights[clean_name(name)], bucket.master.dtype)
            hyper = {k: v for k, v in saved_group.items() if k != "params"}
            groups.append({"hyper": hyper, "scalars": scalars, "params": [n for b in buckets for n in b.names]})
        self.load_sharded_state_dict({"state": state, "param_groups": groups})


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a tp DTensor's local shard, a plain tensor itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def _row_numel(p: torch.Tensor) -> int:
    """The unit a parameter's state is split over the dp ranks in: one element, or for a tp parameter
    one dim-0 row of its local shard (so each rank's chunk is a parameter-shaped block DCP can place)."""
    local = _local(p)
    if not isinstance(p, DTensor) or local.dim() == 0 or local.shape[0] == 0:
        return 1
    return local.numel() // local.shape[0]


def _elementwise(value: Any, bucket: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == bucket.master.shape and value.dim() > 0


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))
