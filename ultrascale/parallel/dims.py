"""Parallel degrees and the device mesh built from them.

One frozen dataclass holds the degree of every parallelism; `-1` ("the rest") is
resolved by `ParallelDims.resolve` so a `ParallelDims` instance is always concrete.
All meshes of a run are built in one place, `build_mesh`, so every axis name and
every flattened axis is defined here and nowhere else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost first. TP innermost: neighbouring ranks share the fastest links (NVLink),
# and TP communicates in every layer; PP outermost: it only sends activations between
# stages, so it tolerates the slowest links (between nodes).
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Expert-parallel axes (ep > 1 only), cut out of dp_shard_cp = ep_shard x ep (see build_mesh).
EXPERT_AXES: tuple[str, ...] = ("ep", "ep_shard", "expert_fsdp")

# Flattened axes derived from MESH_AXES.
#   dp          = dp_replicate x dp_shard      : ranks that see different batches
#   dp_shard_cp = dp_shard x cp                : ranks over which parameters are sharded
#                 (CP ranks hold the same weights, so ZeRO shards over them too)
#   dp_cp       = dp_replicate x dp_shard x cp : ranks that hold different tokens of a global
#                 batch: the step's loss sum and valid-token count are all-reduced over them
#   stage       = dp_replicate x dp_shard x cp x tp : the ranks of one pipeline stage (they start
#                 from the same weights of that stage: the initial broadcast runs over them)
FLAT_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "stage": ("dp_replicate", "dp_shard", "cp", "tp"),
}


def zero_ranks(dp_shard: int, cp: int) -> int:
    """The ranks ZeRO shards parameter/optimizer state over: FSDP's mesh is dp_shard x cp (the cp ranks hold the
    same weights and share their shards); dp_replicate ranks hold copies. Over one rank stages 1 and 2 coincide."""
    return dp_shard * cp


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallelism, resolved against a world size.

    Build it with `ParallelDims.resolve(world_size, ...)`, which accepts `-1` for
    one degree and checks every constraint, so an instance is always valid.
    """

    dp_replicate: int
    """Data-parallel replicas (the DDP / HSDP-replicate axis); 1 means off."""
    dp_shard: int
    """Data-parallel ranks that shard parameters, gradients and optimizer state (ZeRO); 1 means off."""
    cp: int
    """Context-parallel degree: ranks that split the sequence of every batch; 1 means off."""
    tp: int
    """Tensor-parallel degree (with sequence parallel); 1 means off."""
    pp: int
    """Pipeline-parallel degree (number of pipeline stages); 1 means off."""
    ep: int
    """Expert-parallel degree; borrows ranks from dp_shard x cp, so it is not a factor of the world size."""
    world_size: int
    """Total number of ranks = pp * dp_replicate * dp_shard * cp * tp."""

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """Check the degrees against `world_size` and replace a single `-1` by the rest."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}
        for name, value in {**degrees, "ep": ep}.items():
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
                raise ValueError(f"`{name}={value!r}` must be a positive integer, or -1 for 'the rest of the world size'")
        if ep == -1:
            raise ValueError("`ep=-1` is not allowed: expert parallelism borrows ranks from dp_shard x cp; give its degree")
        rest = [name for name, value in degrees.items() if value == -1]
        if len(rest) > 1:
            raise ValueError(f"only one degree may be -1 ('the rest'), got -1 for {', '.join(rest)}")
        if rest:
            known = math.prod(value for value in degrees.values() if value != -1)
            if world_size % known != 0:
                raise ValueError(
                    f"cannot infer `{rest[0]}`: {_product_text(degrees, world_size, missing=rest[0])}; "
                    f"the other degrees multiply to {known}, which does not divide world size {world_size}. "
                    f"Divisors of {world_size}: {_divisors(world_size)}"
                )
            degrees[rest[0]] = world_size // known
        product = math.prod(degrees.values())
        if product != world_size:
            raise ValueError(
                f"{_product_text(degrees, world_size)}: the degrees must multiply to the world size. "
                f"Set one of them to -1 to take the rest, or pick factors of {world_size}: {_divisors(world_size)}"
            )
        dp_shard_cp = zero_ranks(degrees["dp_shard"], degrees["cp"])
        if dp_shard_cp % ep != 0:
            raise ValueError(
                f"`ep={ep}` must divide dp_shard({degrees['dp_shard']}) * cp({degrees['cp']}) = {dp_shard_cp}: "
                f"expert parallelism borrows its ranks from the dp_shard x cp axes. "
                f"Valid ep: {_divisors(dp_shard_cp)}"
            )
        return cls(world_size=world_size, ep=ep, **degrees)

    @property
    def dp(self) -> int:
        """Ranks that see different batches: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """Ranks over which ZeRO shards parameter/optimizer state (`zero_ranks`)."""
        return zero_ranks(self.dp_shard, self.cp)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold different tokens of a global batch: dp_replicate * dp_shard * cp."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def stage(self) -> int:
        """Ranks of one pipeline stage: world_size / pp."""
        return self.world_size // self.pp

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def seq_len_divisor(self, *, sequence_parallel: bool, load_balance: bool = True) -> int:
        """Sequence lengths must be multiples of this (`sequence_split_problem`; by default with load-balanced
        context parallel, the strategy's default)."""
        return ((self.tp if sequence_parallel else 1)
                * (context_chunks(self.cp, load_balance=load_balance) if self.cp > 1 else 1))

    def check_seq_len(self, seq_len: int, *, sequence_parallel: bool, where: str = "the batch") -> None:
        """ValueError (before any collective sees the sequence) if `seq_len` does not split evenly."""
        problem = sequence_split_problem(seq_len, tp=self.tp if sequence_parallel else 1, cp=self.cp,
                                         load_balance=True, where=where)
        if problem is not None:
            raise ValueError(problem)

    def describe(self) -> str:
        experts = f", ep={self.ep} within dp_shard x cp" if self.ep_enabled else ""
        return " x ".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES) + f"{experts} (world {self.world_size})"


def context_chunks(cp: int, *, load_balance: bool) -> int:
    """The chunks context parallel cuts a sequence into: 2·cp load-balanced (zig-zag: rank r holds chunks r and
    2cp-1-r, so every rank does the same causal work), else cp."""
    return 2 * cp if load_balance else cp


def sequence_split_problem(seq_len: int, *, tp: int, cp: int, load_balance: bool, where: str = "the batch") -> Optional[str]:
    """The one rule of a sequence's length against the layout: a multiple of tp (sequence parallel splits it over
    the `tp` ranks; pass 1 without it) times `context_chunks(cp)`. The message says why and what fits; None if it
    splits."""
    divisor = tp * (context_chunks(cp, load_balance=load_balance) if cp > 1 else 1)
    if seq_len % divisor == 0:
        return None
    reasons = []
    if tp > 1:
        reasons.append(f"sequence parallel splits it over tp={tp} ranks")
    if cp > 1:
        reasons.append(f"context parallel cuts it into 2*cp={2 * cp} load-balanced chunks" if load_balance
                       else f"context parallel cuts it into cp={cp} chunks")
    below, above = seq_len - seq_len % divisor, seq_len - seq_len % divisor + divisor
    fitting = f"{below} or {above}" if below > 0 else f"{above}"
    return (f"sequence length {seq_len} of {where} must be a multiple of {divisor} ({'; '.join(reasons)}): "
            f"use {fitting} (any multiple of {divisor})" + ("" if cp > 1 else ", or turn off `sequence_parallel`"))


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh and the flattened meshes derived from it, kept side by side.

    torch deprecates slicing flattened axes back out of the root mesh, so the flattened
    meshes are held here; `mesh[name]` reaches both kinds by name.
    """

    dims: ParallelDims
    world: DeviceMesh
    """5-D mesh with axes MESH_AXES (size-1 axes included, so `mesh["tp"]` always exists)."""
    dp: DeviceMesh
    """1-D: dp_replicate x dp_shard, the ranks that see different batches."""
    dp_shard_cp: DeviceMesh
    """1-D: dp_shard x cp, the ranks over which ZeRO shards parameters."""
    dp_cp: DeviceMesh
    """1-D: dp_replicate x dp_shard x cp, the ranks that hold different tokens (loss normalisation)."""
    stage: DeviceMesh
    """1-D: dp_replicate x dp_shard x cp x tp, the ranks of this rank's pipeline stage."""
    fsdp: DeviceMesh
    """FSDP's mesh: `dp_shard_cp` (1-D), or 2-D (dp_replicate, dp_shard_cp) for HSDP."""
    ep: Optional[DeviceMesh] = None
    """Expert parallel (ep > 1): 1-D, the ep innermost ranks of `dp_shard_cp`, which split the experts."""
    ep_shard: Optional[DeviceMesh] = None
    """Expert parallel: 1-D, the ranks of `dp_shard_cp` that hold the same experts (dp_shard x cp / ep)."""
    expert_fsdp: Optional[DeviceMesh] = None
    """Expert parallel: FSDP's mesh for expert weights, `ep_shard` (1-D) or (dp_replicate, ep_shard) for HSDP:
    the ranks that hold the same experts, over which their gradients are reduced."""
    expert_grid: Optional[DeviceMesh] = None
    """Expert parallel: this rank's (dp_replicate,) ep_shard x ep ranks, the mesh `ep`, `ep_shard` and `expert_fsdp`
    were cut from (`build_mesh`)."""

    @functools.cached_property
    def zero_state_mesh(self) -> DeviceMesh:
        """Where ZeRO-1/2 checkpoints a tensor-parallel parameter's optimizer state: this stage's ranks as
        ((dp_replicate,) tp, dp_shard x cp), tp *outside* the dp ranks, because each tp shard is split
        over the dp ranks (placements (tp's, Shard(0)) nest in mesh order). Only DCP reads it (the
        offsets of each rank's block), so it gets no process groups of its own."""
        stage = self.world.mesh[self.world.get_coordinate()[0]]  # (dp_replicate, dp_shard, cp, tp)
        grid = stage.permute(0, 3, 1, 2).reshape(self.dims.dp_replicate, self.dims.tp, self.dims.dp_shard_cp)
        names: tuple[str, ...] = ("dp_replicate", "tp", "dp_shard_cp")
        if self.fsdp.ndim == 1:
            grid, names = grid[0], names[1:]
        return DeviceMesh(self.world.device_type, grid.contiguous(), mesh_dim_names=names, _init_backend=False)

    @functools.cached_property
    def expert_zero_state_mesh(self) -> DeviceMesh:
        """Where ZeRO-1/2 checkpoints an expert's optimizer state under expert parallel: this stage's ranks of this
        rank's tp coordinate as ((dp_replicate,) ep, ep_shard), ep *outside* the ranks holding the same experts,
        because each ep rank's experts are split over those (placements (Shard(0), Shard(0)) nest in mesh order).
        Only DCP reads it, as `zero_state_mesh`."""
        grid = self.expert_grid
        if grid is None:
            raise KeyError("the experts' state mesh exists under expert parallel only (ep > 1); this run has ep=1")
        names = tuple(name for name in ("dp_replicate", "ep", "ep_shard") if name in grid.mesh_dim_names)
        ranks = grid.mesh.permute(*(grid.mesh_dim_names.index(name) for name in names))
        return DeviceMesh(self.world.device_type, ranks.contiguous(), mesh_dim_names=names, _init_backend=False)

    def __getitem__(self, axis: str) -> DeviceMesh:
        if axis in MESH_AXES:
            return self.world[axis]
        if axis in FLAT_AXES:
            return getattr(self, axis)
        if axis in EXPERT_AXES:
            mesh = getattr(self, axis)
            if mesh is None:
                raise KeyError(f"mesh axis {axis!r} exists under expert parallel only (ep > 1); this run has ep=1")
            return mesh
        raise KeyError(f"unknown mesh axis {axis!r}; valid axes: {', '.join((*MESH_AXES, *FLAT_AXES, *EXPERT_AXES))}")


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Create every mesh of a run: the 5-axis world mesh and the flattened dp / dp_shard_cp / fsdp meshes."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised default process group (torch.distributed.init_process_group)")
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"process group world size {dist.get_world_size()} != {dims.describe()}")
    shape = tuple(getattr(dims, axis) for axis in MESH_AXES)
    world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    flat = {name: world[axes]._flatten(name) for name, axes in FLAT_AXES.items()}
    if dims.dp_replicate_enabled:
        # HSDP needs (replicate, shard) as one 2-D mesh: unflatten the three data axes
        # into replicate x (dp_shard * cp).
        fsdp = flat["dp_cp"]._unflatten(0, (dims.dp_replicate, dims.dp_shard_cp), ("dp_replicate", "dp_shard_cp"))
    else:
        fsdp = flat["dp_shard_cp"]
    experts: dict[str, DeviceMesh] = {}
    if dims.ep_enabled:
        # ep borrows the innermost ranks of dp_shard x cp (cp first, then dp_shard; torchtitan's choice):
        # neighbouring ranks, the fastest links, carry the all-to-alls.
        shard_ep = (dims.dp_shard_cp // dims.ep, dims.ep)
        if dims.dp_replicate_enabled:
            split = flat["dp_cp"]._unflatten(0, (dims.dp_replicate, *shard_ep), ("dp_replicate", "ep_shard", "ep"))
            experts["expert_fsdp"] = split[("dp_replicate", "ep_shard")]
        else:
            split = flat["dp_shard_cp"]._unflatten(0, shard_ep, ("ep_shard", "ep"))
            experts["expert_fsdp"] = split["ep_shard"]
        experts["ep"], experts["ep_shard"], experts["expert_grid"] = split["ep"], split["ep_shard"], split
    mesh = ParallelMesh(dims=dims, world=world, fsdp=fsdp, **flat, **experts)
    for axis in (*MESH_AXES, *FLAT_AXES, *(("ep",) if dims.ep_enabled else ())):
        if mesh[axis].size() != getattr(dims, axis):
            raise RuntimeError(f"mesh axis {axis!r} has size {mesh[axis].size()}, expected {getattr(dims, axis)}")
    return mesh


def _product_text(degrees: dict[str, int], world_size: int, missing: str | None = None) -> str:
    factors = " * ".join(f"{name}({'?' if name == missing else value})" for name, value in degrees.items())
    relation = "=" if missing else "!="
    return f"{factors} {relation} world size({world_size})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = ["MESH_AXES", "FLAT_AXES", "EXPERT_AXES", "ParallelDims", "ParallelMesh", "build_mesh", "context_chunks",
           "sequence_split_problem"]
