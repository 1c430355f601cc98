"""What a complete checkpoint holds, written when it is saved and checked before a resume trusts it.

`manifest.json` in a checkpoint directory lists every other file of it with its size and CRC-32:

    {"format": 1, "files": {"__0_0.distcp": {"size": 123, "crc32": "9a0b1c2d"}, ".metadata": {...}, ...}}

It is written last, before the directory is published under its final name (`_complete_save`):
every file is complete by then. The ranks share the checksums (file i is read by rank i mod
world, right after it was written, from the page cache) and rank 0 writes the manifest; the
cost is measured in benchmarks/checkpoint_async.py.

`verify_checkpoint(path, level)` compares a directory with its manifest: "size" (a stat per file:
a truncated, missing or extended file), "checksum" (also every byte: damage that keeps the size),
"off". A checkpoint written before manifests existed is checked against DCP's own `.metadata`
instead: every shard file it names must be there and long enough for every record in it (sizes
only; nothing records its bytes). `verify_distributed` spreads the reading over the ranks of a job.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

MANIFEST_FILE = "manifest.json"
DCP_METADATA_FILE = ".metadata"  # DCP's index of the shards (torch.distributed.checkpoint writes it)
VerifyLevel = Literal["checksum", "size", "off"]
VERIFY_LEVELS: tuple[str, ...] = ("checksum", "size", "off")
_CHUNK = 8 << 20


class CheckpointDamaged(ValueError):
    """A checkpoint directory that does not hold what its manifest (or DCP's metadata) says: the message
    names each file and what is wrong with it."""


def file_crc32(file: Path) -> str:
    """CRC-32 of a file's bytes, 8 hex digits (zlib's: about 2 GB/s on one core here)."""
    crc = 0
    with open(file, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checkpoint_files(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir() if entry.is_file() and entry.name != MANIFEST_FILE)


def write_manifest(directory: Path, *, rank: int = 0, world: int = 1, group: Any = None) -> None:
    """Collective when a process group is initialised (every rank calls it once every file is in `directory`):
    rank 0 lists the files, each rank checksums its share, rank 0 writes `manifest.json` (fsynced)."""
    distributed = dist.is_initialized() and world > 1
    names = _checkpoint_files(directory) if rank == 0 else None
    if distributed:
        box = [names]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        names = box[0]
    assert names is not None
    mine = {name: {"size": (directory / name).stat().st_size, "crc32": file_crc32(directory / name)}
            for i, name in enumerate(names) if i % world == rank}
    shares: list[Any] = [mine]
    if distributed:
        shares = [None] * world
        dist.all_gather_object(shares, mine, group=group)
    if rank == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        text = json.dumps({"format": 1, "files": dict(sorted(files.items()))}, indent=1)
        with open(directory / MANIFEST_FILE, "w") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())


def verify_checkpoint(path: str | Path, level: VerifyLevel = "checksum", *, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with checkpoint directory `path` at `level` (empty: nothing found). `share`: (this rank, ranks)
    when several processes split the checksums (`verify_distributed`); sizes are checked by each."""
    if level not in VERIFY_LEVELS:
        raise ValueError(f"checkpoint verification level {level!r}: choose one of {VERIFY_LEVELS}")
    directory = Path(path)
    if level == "off":
        return []
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        return _verify_without_manifest(directory)
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return [f"{MANIFEST_FILE}: unreadable ({error})"]
    problems = []
    rank, ranks = share
    for i, (name, entry) in enumerate(sorted(files.items())):
        file = directory / name
        if not file.is_file():
            problems.append(f"{name}: missing (the manifest lists {entry['size']} bytes)")
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            problems.append(f"{name}: {size} bytes, the manifest says {entry['size']} (truncated or overwritten)")
        elif level == "checksum" and i % ranks == rank and file_crc32(file) != entry["crc32"]:
            problems.append(f"{name}: its bytes changed since it was written (CRC-32 {file_crc32(file)}, the manifest "
                            f"says {entry['crc32']}; same size)")
    return problems


def _verify_without_manifest(directory: Path) -> list[str]:
    """A checkpoint saved before manifests: DCP's `.metadata` says which file holds which bytes of each record."""
    from ultrascale.parallel.safe_load import read_dcp_metadata

    if not (directory / DCP_METADATA_FILE).is_file():
        return [f"{DCP_METADATA_FILE}: missing (DCP's index of the shards)"]
    try:
        storage = read_dcp_metadata(directory).storage_data or {}
    except Exception as error:  # noqa: BLE001 - any unreadable index is the finding
        return [f"{DCP_METADATA_FILE}: unreadable ({type(error).__name__}: {error})"]
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"{name}: missing ({DCP_METADATA_FILE} names it)")
        elif file.stat().st_size < size:
            problems.append(f"{name}: {file.stat().st_size} bytes, but {DCP_METADATA_FILE} reads up to byte {size} of it "
                            "(truncated)")
    return problems


def verify_distributed(path: str | Path, level: VerifyLevel) -> list[str]:
    """`verify_checkpoint` with the reading split over every rank of the default group (each checksums 1/world
    of the files); every rank gets every finding. Collective when a process group is initialised."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return verify_checkpoint(path, level)
    found = verify_checkpoint(path, level, share=(dist.get_rank(), dist.get_world_size()))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return sorted({problem for problems in every for problem in problems})


def damage_message(path: str | Path, problems: Sequence[str]) -> str:
    return (f"checkpoint {path} is damaged: " + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". Resume from an earlier checkpoint (`--ckpt_path auto` skips damaged ones), or check it with "
            "`ultrascale checkpoint verify`")


__all__ = ["CheckpointDamaged", "MANIFEST_FILE", "VERIFY_LEVELS", "VerifyLevel", "damage_message", "file_crc32",
           "verify_checkpoint", "verify_distributed", "write_manifest"]
