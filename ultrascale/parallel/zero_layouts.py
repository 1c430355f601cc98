"""ZeRO-1/2 optimizer states in checkpoints of the other layouts: which layout a checkpoint's optimizer state was
saved in ("flat": ZeRO-1/2's per-parameter 1-D or tp-parameter-shaped DTensors; "param": ZeRO-3 / FSDP /
torch's parameter-shaped state), read targets for it, and the conversion of a flat state into FSDP's
layout. The engine's own side of the conversions is `ultrascale.parallel.zero.ZeroEngine`."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["clean_name", "flat_state_template", "param_shaped_from_flat", "relayout_like", "saved_optimizer_layout"]


def _chunk_size(numel: int, world: int, rank: int) -> int:
    chunk = math.ceil(numel / world)
    return max(0, min(chunk, numel - rank * chunk))


_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")
"""Wrappers that add a segment to parameter and module names but not to state-dict keys (what FSDP's
get_optimizer_state_dict uses): activation checkpointing, torch.compile."""


def clean_name(name: str) -> str:
    """A parameter or module name without the segments `_WRAPPER_SEGMENTS` adds: the same under every layout."""
    return _WRAPPER_SEGMENTS.sub("", name).lstrip(".")


def saved_optimizer_layout(metadata: Any, prefix: str) -> Optional[str]:
    """How the optimizer state at `prefix` of a checkpoint (its DCP `state_dict_metadata`) was saved:
    "flat" (ZeRO-1/2: per-parameter 1-D DTensors, param groups as {"hyper", "scalars", "params"}),
    "param" (ZeRO-3 / FSDP / torch's optimizer state dict: parameter-shaped), or None (no such state)."""
    groups = f"{prefix}.param_groups."
    found = False
    for key in metadata:
        if key.startswith(groups):
            found = True
            parts = key[len(groups) :].split(".")
            if len(parts) >= 3 and parts[1] in ("hyper", "scalars"):
                return "flat"
    return "param" if found else None


def _saved_state_names(metadata: Any, prefix: str) -> dict[str, str]:
    """Parameter names with state in the checkpoint (`<prefix>.state.<name>.<key>`): cleaned name -> saved name."""
    head = f"{prefix}.state."
    names = {key[len(head) :].rsplit(".", 1)[0] for key in metadata if key.startswith(head)}
    return {clean_name(name): name for name in names}


def _saved_entries(metadata: Any, head: str) -> list[tuple[str, Any]]:
    """(key, storage metadata) of the saved leaves directly under `head` (which ends with a dot)."""
    return sorted((key[len(head) :], md) for key, md in metadata.items() if key.startswith(head) and "." not in key[len(head) :])


def _saved_groups(metadata: Any, prefix: str, inner: str = "") -> list[dict[str, Any]]:
    """Read targets for the param groups' non-tensor entries (`<prefix>.param_groups.<g>.<inner><key>`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    groups: list[dict[str, Any]] = []
    g = 0
    while any(key.startswith(f"{prefix}.param_groups.{g}.") for key in metadata):
        group: dict[str, Any] = {}
        for key, md in _saved_entries(metadata, f"{prefix}.param_groups.{g}.{inner}"):
            group[key] = torch.zeros((), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) and len(md.size) == 0 else None
        groups.append(group)
        g += 1
    return groups


def _flat_read_target(numel: int, dtype: torch.dtype, like: Any) -> torch.Tensor:
    """An empty 1-D tensor of `numel` to read a flattened state into, sharded over the first mesh dim
    that shards `like` (a parameter-shaped DTensor), replicated over the others."""
    if not isinstance(like, DTensor):
        return torch.zeros(numel, dtype=dtype, device=like.device)
    mesh = like.device_mesh
    sharded = next((i for i, p in enumerate(like.placements) if p.is_shard()), None)
    placements = [Shard(0) if i == sharded else Replicate() for i in range(mesh.ndim)]
    size = numel if sharded is None else _chunk_size(numel, mesh.size(sharded), mesh.get_local_rank(sharded))
    local = torch.zeros(size, dtype=dtype, device=like.to_local().device)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def _shaped_read_target(dtype: torch.dtype, like: Any) -> torch.Tensor:
    """An empty tensor laid out like `like` (a parameter-shaped tensor / DTensor) to read a state into."""
    if not isinstance(like, DTensor):
        return torch.zeros(like.shape, dtype=dtype, device=like.device)
    local = torch.zeros(like.to_local().shape, dtype=dtype, device=like.to_local().device)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def relayout_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` (a tensor / DTensor holding `like.numel()` elements in any shape and layout), gathered,
    reshaped to `like`'s shape and dtype and laid out like it (a collective when `value` is a DTensor)."""
    full = (value.full_tensor() if isinstance(value, DTensor) else value).reshape(like.shape).to(like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.clone()


def flat_state_template(current: dict[str, Any], metadata: Any, prefix: str) -> dict[str, Any]:
    """What to give DCP to read a ZeRO-1/2 (flat) optimizer state at `prefix` into an optimizer whose
    state dict is `current` (parameter-shaped, from torch's `get_optimizer_state_dict`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved_names = _saved_state_names(metadata, prefix)
    state: dict[str, dict[str, Any]] = {}
    for fqn, entry in current["state"].items():
        saved = saved_names.get(clean_name(fqn))
        if saved is None:
            raise ValueError(
                f"the checkpoint holds no optimizer state for parameter {fqn!r} (it has state for {len(saved_names)} parameters)"
            )
        like = next((v for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if like is None:
            raise ValueError(f"cannot convert the optimizer state of {fqn!r}: it has no parameter-shaped tensor")
        out: dict[str, Any] = {}
        for key, md in _saved_entries(metadata, f"{prefix}.state.{saved}."):
            if isinstance(md, TensorStorageMetadata) and len(md.size) > 1 and tuple(md.size) == tuple(like.shape):
                out[key] = _shaped_read_target(md.properties.dtype, like)  # a tp run's parameter-shaped state
                continue
            if not isinstance(md, TensorStorageMetadata) or len(md.size) != 1 or md.size[0] != like.numel():
                shape = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "bytes"
                raise ValueError(
                    f"checkpoint entry {prefix}.state.{saved}.{key} has shape {shape}, not the flattened "
                    f"state of parameter {fqn!r} of shape {tuple(like.shape)} ({like.numel()} elements)"
                )
            out[key] = _flat_read_target(md.size[0], md.properties.dtype, like)
        state[saved] = out
    groups = [
        {**top, "hyper": hyper, "scalars": scalars}
        for top, hyper, scalars in zip(
            _saved_groups(metadata, prefix), _saved_groups(metadata, prefix, "hyper."), _saved_groups(metadata, prefix, "scalars.")
        )
    ]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def param_shaped_from_flat(loaded: dict[str, Any], current: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A ZeRO-1/2 optimizer state read with `flat_state_template`, in `current`'s (parameter-shaped)
    layout, and the saved fp32 master weights by parameter name (empty unless saved under bf16-mixed:
    then they, not the bf16 model weights, are the weights to resume from)."""
    if len(loaded["param_groups"]) != len(current["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer has {len(loaded['param_groups'])} param group(s), this one "
            f"{len(current['param_groups'])}"
        )
    saved_names = {clean_name(name): name for name in loaded["state"]}
    state: dict[str, dict[str, Any]] = {}
    masters: dict[str, torch.Tensor] = {}
    for saved_group, group in zip(loaded["param_groups"], current["param_groups"]):
        for fqn in group["params"]:
            saved = loaded["state"][saved_names[clean_name(fqn)]]
            entry = current["state"].get(fqn, {})
            like = next(v for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            new: dict[str, Any] = {}
            for key, value in saved.items():
                if key == "master":
                    masters[fqn] = value
                else:
                    new[key] = relayout_like(value, entry.get(key, like))
            for key, value in saved_group["scalars"].items():
                new[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state[fqn] = new
    groups = [{**saved_group["hyper"], "params": group["params"]}
              for saved_group, group in zip(loaded["param_groups"], current["param_groups"])]
    return {"state": state, "param_groups": groups}, masters
