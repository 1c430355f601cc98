"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), written atomically.

Layout of a checkpoint directory `path/`:
    .metadata, __<rank>_0.distcp   DCP shards of model and optimizer state (reshardable)
    meta.pt                        everything else (loop progress, schedulers, callbacks, data state)

Atomicity: all ranks write into a fresh sibling `.<name>.tmp-<nonce>/`; only after every
rank has finished does rank 0 move it to `path` (rename is atomic on POSIX). A save killed
at any point before that leaves the previous `path` untouched; if `path` already existed
it is first renamed to `.<name>.old-<nonce>` and deleted after the swap, so even a kill
between the two renames leaves a complete checkpoint on disk.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

METADATA_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"


def save_sharded_checkpoint(state: dict[str, Any], metadata: dict[str, Any], path: str | Path) -> Path:
    """Collectively save `state` (tensors / DTensors, any nesting) with DCP and `metadata` from rank 0.

    Every rank must call this with the same `path`.
    """
    path = Path(path)
    nonce = _broadcast_from_rank0(uuid.uuid4().hex[:12])
    tmp = path.parent / f".{path.name}.tmp-{nonce}"
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        torch.save(metadata, tmp / METADATA_FILE)
    _barrier()
    if _rank() == 0:
        old = path.parent / f".{path.name}.old-{nonce}"
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def check_checkpoint_dir(path: str | Path) -> Path:
    """Raise a clear error unless `path` is a complete ultrascale checkpoint directory."""
    path = Path(path)
    if not path.exists():
        leftovers = sorted(p.name for p in path.parent.glob(f".{path.name}.old-*")) if path.parent.exists() else []
        hint = f" A complete previous version is at {path.parent / leftovers[-1]}." if leftovers else ""
        raise FileNotFoundError(f"checkpoint not found: {path}.{hint}")
    if not path.is_dir():
        raise ValueError(
            f"{path} is a file, not an ultrascale sharded checkpoint directory "
            f"(expected a directory with {DCP_METADATA_FILE} and {METADATA_FILE})"
        )
    missing = [name for name in (DCP_METADATA_FILE, METADATA_FILE) if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"{path} is not a complete ultrascale checkpoint: missing {', '.join(missing)} "
            "(an interrupted save never leaves such a directory under the final name; was it copied partially?)"
        )
    return path


def load_sharded_checkpoint(path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Load DCP tensors into `state` in place (resharding as needed) and return the metadata dict."""
    path = check_checkpoint_dir(path)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        raise RuntimeError(f"could not read the sharded checkpoint at {path}: {error}") from error
    try:
        return torch.load(path / METADATA_FILE, map_location="cpu", weights_only=False)
    except Exception as error:
        raise RuntimeError(f"could not read {path / METADATA_FILE}: {error}") from error


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
