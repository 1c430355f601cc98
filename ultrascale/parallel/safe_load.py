"""Reading a checkpoint folder runs no code: it is data.

A checkpoint directory holds three kinds of pickles, and plain `pickle` / `torch.load(weights_only=False)`
would run whatever callable a planted file names:

- ``meta.pt`` (ultrascale's loop, scheduler, callback and hyper-parameter state): read with
  ``torch.load(weights_only=True)``; ultrascale's own config classes are allow-listed where they
  are defined, a user's own hyper-parameter classes with ``torch.serialization.add_safe_globals``;
- DCP's ``.metadata``: torch reads it with ``pickle.load``; `SafeFileSystemReader` unpickles it
  with an allow-list of DCP's metadata classes, ``torch.Size``, dtypes and paths;
- the non-tensor items inside the ``.distcp`` shards (optimizer param groups, ...): DCP's default
  planner reads them with ``torch.load(weights_only=False)``; `SafeLoadPlanner` uses
  ``weights_only=True``.

Anything else is refused with an error that names the file and the global it wanted.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# Globals DCP's `.metadata` pickles name (torch 2.13): its metadata dataclasses and enums, the
# filesystem's per-item storage info, shapes, dtypes, layouts and the checkpoint's path.
_DCP_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}
_DCP_METADATA_MODULES = {"torch.distributed.checkpoint.metadata"}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to run or build something outside the allow-list."""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_METADATA_GLOBALS or module in _DCP_METADATA_MODULES
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafeCheckpointError(
                f"{self.source}: refusing to load `{module}.{name}`: a DCP metadata file holds only DCP's metadata "
                "classes, shapes and dtypes. The file was not written by torch.distributed.checkpoint, or was tampered with."
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `.metadata` is unpickled with an allow-list instead of plain `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _AllowListUnpickler(stream, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: not DCP metadata (holds {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items are read with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(f"checkpoint item `{fqn}`: refusing to unpickle it: {_reason(error)}") from error
        # What DefaultLoadPlanner.load_bytes does with the object it loaded.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def read_dcp_metadata(path: str | Path) -> Metadata:
    """DCP's `.metadata` of checkpoint directory `path`, read without running code."""
    return SafeFileSystemReader(str(path)).read_metadata()


def load_dcp(state: dict[str, Any], path: str | Path, *, no_dist: bool = False) -> None:
    """`dcp.load(state, path)` (resharding into `state` in place) with both safe readers."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), no_dist=no_dist)


def read_torch_file(file: str | Path) -> Any:
    """`torch.load(file, weights_only=True)`, with an error that names the file and how to allow a type."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{file}: refusing to unpickle it: {_reason(error)}. Checkpoint folders are read as data. If the file is "
            "yours and holds your own hyper-parameter class, allow that class with "
            "`torch.serialization.add_safe_globals([MyClass])` before loading."
        ) from error


def _reason(error: Exception) -> str:
    # torch's message is long and suggests weights_only=False; keep only what it refused.
    import re

    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return f"it names `{found.group(1)}`, which is not allow-listed" if found else str(error).splitlines()[0]


__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "load_dcp",
    "read_dcp_metadata",
    "read_torch_file",
]
