"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), written atomically.

Layout of a checkpoint directory `path/`:
    .metadata, __<rank>_0.distcp   DCP shards of model and optimizer state (reshardable)
    meta.pt                        everything else (loop progress, schedulers, callbacks, data state)
    manifest.json                  every other file's size and CRC-32, written last (`ultrascale.parallel.manifest`)

Atomicity: all ranks write into a fresh sibling `.<name>.tmp-<nonce>/` (`nonce`: 12 hex digits);
only after every rank has finished, and the files and the directory are on disk (fsync), does
rank 0 move it to `path` (rename is atomic on POSIX) and fsync the parent directory. A save
killed at any point before that leaves the previous `path` untouched.

Replacing an existing `path` (`last.ckpt`, a re-save under the same name): on Linux, where the
filesystem supports it (ext4, xfs, btrfs, tmpfs, ...), the new directory and the old one swap
names in one step (`renameat2(RENAME_EXCHANGE)`), so `path` is never missing and the old
version, now under the temporary name, is deleted. Elsewhere (NFS, ...) `path` is first renamed
to `.<name>.old-<nonce>`, the new directory takes its place, and the old one is deleted. A kill
between those two renames leaves only `.<name>.old-<nonce>`: `check_checkpoint_dir` (every
resume) then falls back to it with a warning, and the next save of `<name>` removes it.

Leftovers of an interrupted save (`.<name>.tmp-<nonce>/`, and `.<name>.old-<nonce>/` once
`<name>` is complete again) are removed by rank 0 at the next save into the same folder and at
the next resume from it, with an info message on the `ultrascale.parallel.checkpoint` logger.
Only flat directories matching exactly those names are touched, and a temporary directory
changed within the last `LEFTOVER_GRACE_S` seconds is kept: another process may be writing it.

Asynchronous saves (`async_save_sharded_checkpoint`) write the same temporary directory from a
background thread and publish it the same way, in `PendingSave.finish()`, once every rank's write
has ended. `latest_checkpoint` picks the checkpoint a restarted job resumes from: only published
names count, so a save in flight or cut short is never chosen.
"""

from __future__ import annotations

import ctypes
import errno
import io
import logging
import os
import re
import shutil
import sys
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ultrascale.parallel.manifest import DCP_METADATA_FILE, VerifyLevel, damage_message, verify_checkpoint, write_manifest
from ultrascale.parallel.safe_load import UnsafeCheckpointError, load_dcp, read_torch_file

METADATA_FILE = "meta.pt"
# A temporary directory modified this recently may belong to a save still in progress (another
# job writing into the same folder, or the job whose checkpoint is being read): left alone.
LEFTOVER_GRACE_S = 300.0

_NONCE = r"[0-9a-f]{12}"
_TMP_NAME = re.compile(rf"^\.(?P<name>.+)\.tmp-{_NONCE}$")
_OLD_NAME = re.compile(rf"^\.(?P<name>.+)\.old-{_NONCE}$")

log = logging.getLogger(__name__)


def save_sharded_checkpoint(state: dict[str, Any], metadata: dict[str, Any], path: str | Path) -> Path:
    """Collectively save `state` (tensors / DTensors, any nesting) with DCP and `metadata` from rank 0.

    Every rank must call this with the same `path`.
    """
    path = Path(path)
    tmp, nonce = _begin_save(path)
    # DCP's FileSystemWriter (the writer `checkpoint_id=` selects) has `sync_files=True` by default:
    # it fsyncs every shard file and `.metadata` (written as `.metadata.tmp`, renamed) itself
    # (torch/distributed/checkpoint/filesystem.py, `_write_files_from_queue` and `finish`). It
    # never fsyncs the directory holding them: `_fsync_dir(tmp)` in `_complete_save` does.
    with dcp_storable(state):
        dcp.save(state, checkpoint_id=str(tmp))
    _complete_save(tmp, path, nonce, _serialized(metadata) if _rank() == 0 else b"")
    return path


class PendingSave:
    """A checkpoint whose shards DCP is writing in a background thread (`async_save_sharded_checkpoint`).

    Until `finish()` it lives under its hidden temporary name only, so nothing (a resume, `latest_checkpoint`)
    can take it for a checkpoint; `finish()` waits for the write on every rank and publishes it exactly as
    `save_sharded_checkpoint` does. Every rank calls `finish()` (it is collective), from the training thread.
    """

    def __init__(self, future: Any, tmp: Path, path: Path, nonce: str, metadata: bytes, group: Any) -> None:
        self._future, self._tmp, self.path, self._nonce, self._metadata, self._group = future, tmp, path, nonce, metadata, group

    def done(self) -> bool:
        """Whether this rank's part of the write has ended (no collective)."""
        return self._future.done()

    def done_everywhere(self, group: Any) -> bool:
        """Whether every rank's part has ended: one all-reduce of a flag over `group`, a CPU-backend group
        other than the save's own (its background collectives may still be running on that one)."""
        flag = torch.tensor([int(self.done())], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def finish(self) -> Path:
        """Wait until every rank's shards are written, then publish the checkpoint; RuntimeError on every rank
        (and nothing published, the previous version of `path` kept) if the write failed on any rank."""
        try:
            self._future.result()
            error: BaseException | None = None
        except BaseException as failure:  # noqa: BLE001 - every rank must learn of it before deciding
            error = failure
        outcomes: list[Any] = [None] * (dist.get_world_size(self._group) if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(outcomes, None if error is None else repr(error), group=self._group)
        else:
            outcomes = [None if error is None else repr(error)]
        failed = {rank: why for rank, why in enumerate(outcomes) if why is not None}
        if failed:
            raise RuntimeError(
                f"the asynchronous save of {self.path} failed on rank(s) {sorted(failed)}: "
                f"{next(iter(failed.values()))[:2000]}; it was not published (the previous checkpoint is kept)"
            ) from error
        _complete_save(self._tmp, self.path, self._nonce, self._metadata)
        return self.path


def async_save_sharded_checkpoint(
    state: dict[str, Any], metadata: dict[str, Any], path: str | Path, *, group: Any
) -> PendingSave:
    """`save_sharded_checkpoint`, with the shards written in the background (DCP `async_save`).

    Returns once this rank's tensors are copied to host memory (DCP's default stager copies them, so
    training may change the originals) and `metadata` is serialised. `group`: a process group with a CPU
    backend (gloo) that nothing else uses while the save runs: DCP runs its collectives on it from the
    background thread. Call `finish()` on the result, on every rank, before the next save.
    """
    path = Path(path)
    tmp, nonce = _begin_save(path)
    with dcp_storable(state):  # async_save has staged (copied) the tensors when it returns
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group)
    return PendingSave(future, tmp, path, nonce, _serialized(metadata) if _rank() == 0 else b"", group)


def _begin_save(path: Path) -> tuple[Path, str]:
    """The temporary directory of a new save of `path` (same on every rank), with the folder ready."""
    nonce = _broadcast_from_rank0(uuid.uuid4().hex[:12])
    tmp = path.parent / f".{path.name}.tmp-{nonce}"
    if _rank() == 0:
        _make_dirs(path.parent)
        remove_leftovers(path.parent)
    _barrier()
    return tmp, nonce


def _complete_save(tmp: Path, path: Path, nonce: str, metadata: bytes) -> None:
    """Every rank's shards are in `tmp`: add `meta.pt` and publish it as `path` (rank 0)."""
    if _rank() == 0:
        _write_synced(metadata, tmp / METADATA_FILE)
    _barrier()  # every rank's shard files are complete and fsynced
    write_manifest(tmp, rank=_rank(), world=dist.get_world_size() if dist.is_initialized() else 1)
    if _rank() == 0:
        _fsync_dir(tmp)  # the directory entries of the shards, .metadata and meta.pt
        previous = _publish(tmp, path, nonce)
        if previous is not None:
            _remove_any(previous)
        for stale in _old_versions(path):  # left by an earlier save of `path` killed between renames
            log.info("ultrascale checkpoint: removing %s, a previous version of %s left by an interrupted save", stale, path)
            _remove_any(stale)
    _barrier()


def check_checkpoint_dir(path: str | Path) -> Path:
    """Return `path` if it is a complete ultrascale checkpoint directory, else raise a clear error.

    If `path` is missing but a complete `.<name>.old-<nonce>` version of it is present (a save
    was killed between the two renames that publish a checkpoint), that version is returned
    instead, with a warning. Read-only: every rank calling this sees the same directory.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        fallback = _newest_complete(_old_versions(path))
        if fallback is None:
            raise FileNotFoundError(f"checkpoint not found: {path}")
        if _rank() == 0:
            warnings.warn(
                f"checkpoint {path} is missing, but {fallback} holds its complete previous version (a save of it "
                f"was interrupted between the two renames that publish a checkpoint): loading {fallback} instead. "
                f"The next save of {path.name} removes it.",
                stacklevel=2,
            )
        return fallback
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
    if _rank() == 0:
        remove_leftovers(path.parent)
    metadata = read_checkpoint_metadata(path)  # first: a planted payload is refused before any DCP read
    try:
        with dcp_storable(state, read_back=True):
            load_dcp(state, path)
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        if isinstance(error.__cause__, UnsafeCheckpointError) or "refusing to" in str(error):
            raise UnsafeCheckpointError(f"{path}: {error}") from error
        raise RuntimeError(f"could not read the sharded checkpoint at {path}: {error}") from error
    return metadata


@contextmanager
def dcp_storable(state: Any, *, read_back: bool = False) -> Iterator[None]:
    """Inside, each DTensor of `state` (any nesting, swapped in place) whose local shard is not one box of
    the global tensor is replaced by a copy laid out so that it is; on exit the originals are put back,
    with the values DCP read into the copies first if `read_back`.

    DCP writes each rank's shard as one (offsets, sizes) box. A packed [gate; up] weight split over tp
    (`ultrascale.parallel.tensor_styles.packed_shard`, a `_StridedShard` not nested in a plain shard of the
    same dim, as FSDP's own is) holds two boxes, which DCP refuses as overlapping. Its copy shards that
    dim plainly: the same global values, so the file reads back into any layout. The copy costs one
    more shard of each such tensor while it lives (an all-to-all over tp per tensor). Containers are
    changed in place, not rebuilt: DCP writes loaded non-tensor values (param groups) into them."""
    swapped: list[tuple[Any, Any, DTensor, DTensor]] = []

    def visit(container: Any, key: Any, value: Any) -> None:
        if isinstance(value, DTensor):
            placements = box_placements(value.placements)
            if placements != tuple(value.placements):
                with torch.no_grad():
                    boxed = value.detach().redistribute(value.device_mesh, placements)
                container[key] = boxed
                swapped.append((container, key, value, boxed))
        elif isinstance(value, dict):
            for k, item in list(value.items()):
                visit(value, k, item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                visit(value, i, item)

    visit({"": state}, "", state)
    try:
        yield
    finally:
        for container, key, original, boxed in swapped:
            if read_back:
                with torch.no_grad():
                    original.to_local().copy_(boxed.redistribute(original.device_mesh, original.placements).to_local())
            container[key] = original


def box_placements(placements: tuple[Any, ...]) -> tuple[Any, ...]:
    """`placements` with each packed split (a `_StridedShard(d)` with no plain `Shard(d)` on a later mesh
    dim, so each rank holds several blocks of dim d) made a plain `Shard(d)`: one block per rank."""
    result = list(placements)
    for i, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            nested = any(type(later) is Shard and later.dim == placement.dim for later in placements[i + 1:])
            if not nested:
                result[i] = Shard(placement.dim)
    return tuple(result)


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """`meta.pt` of checkpoint `path`, read as data (`ultrascale.parallel.safe_load`)."""
    file = Path(path) / METADATA_FILE
    try:
        return read_torch_file(file)
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise RuntimeError(f"could not read {file}: {error}") from error


def latest_checkpoint(folders: Iterable[str | Path], verify: VerifyLevel = "checksum") -> Path | None:
    """The newest complete ultrascale checkpoint directly inside any of `folders` that verifies, or None.

    Newest: the highest `global_step` in its `meta.pt` (a checkpoint without one counts as -1),
    then the later `meta.pt`, then the name; never the directory's mtime alone, which a copy or
    a restore changes. Only checkpoints under their final name are candidates, so what a save
    still in progress or an interrupted one left (`.<name>.tmp-<nonce>/`) is never chosen; a
    complete `.<name>.old-<nonce>/` whose `<name>` is missing stands for `<name>` (the path
    returned is `<name>`: loading it falls back with a warning, see `check_checkpoint_dir`).
    A candidate whose `meta.pt` cannot be read, or that does not verify at `verify`
    (`ultrascale.parallel.manifest.verify_checkpoint`), is skipped with a warning naming the
    damaged files. Read-only, no collective: every process that sees the same folders gets the
    same answer.
    """
    for name, source in checkpoint_candidates(folders):
        problems = verify_checkpoint(source, verify)
        if not problems:
            return name
        warnings.warn(f"skipping checkpoint {source} while looking for the newest one: {damage_message(source, problems)}",
                      stacklevel=2)
    return None


def checkpoint_candidates(folders: Iterable[str | Path]) -> list[tuple[Path, Path]]:
    """(name to resume from, directory holding it) of every complete checkpoint in `folders`, newest first
    (the order of `latest_checkpoint`, which verifies them in turn)."""
    found: list[tuple[tuple[int, int, str], Path, Path]] = []
    seen: set[Path] = set()
    for folder in dict.fromkeys(Path(f) for f in folders):
        try:
            entries = sorted(folder.iterdir())
        except OSError:  # not there (yet)
            continue
        names = {entry.name for entry in entries}
        for entry in entries:
            old = _OLD_NAME.match(entry.name)
            if old and old["name"] not in names:
                name, source = old["name"], _newest_complete(_old_versions(folder / old["name"]))
                if source != entry:  # the newest complete `.old` of that name stands for it, once
                    continue
            elif entry.name.startswith("."):
                continue
            else:
                name, source = entry.name, entry
            try:
                real = source.resolve()
                if real in seen or not _is_complete(real):
                    continue
                seen.add(real)
                meta_file = real / METADATA_FILE
                step = read_checkpoint_metadata(real).get("global_step", -1)
                key = (step if isinstance(step, int) else -1, meta_file.stat().st_mtime_ns, name)
            except FileNotFoundError:  # removed meanwhile
                continue
            except (RuntimeError, UnsafeCheckpointError) as error:
                warnings.warn(f"skipping checkpoint {source} while looking for the newest one: {error}", stacklevel=2)
                continue
            found.append((key, folder / name, real))
    return [(name, real) for _, name, real in sorted(found, key=lambda item: item[0], reverse=True)]


def remove_leftovers(folder: str | Path, grace_s: float | None = None) -> list[Path]:
    """Remove what interrupted ultrascale saves left in `folder`; return the removed paths.

    Removed: `.<name>.tmp-<nonce>/` not modified for `grace_s` seconds (default
    `LEFTOVER_GRACE_S`), and `.<name>.old-<nonce>/` where `<name>` is a complete checkpoint
    again. Kept: everything else, an `.old` version whose `<name>` is missing included (it is
    the only copy; resuming from `<name>` loads it). Only directories holding nothing but plain
    files (what a save writes) are considered. Call it from one process.
    """
    folder = Path(folder)
    grace_s = LEFTOVER_GRACE_S if grace_s is None else grace_s
    removed: list[Path] = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            tmp, old = _TMP_NAME.match(entry.name), _OLD_NAME.match(entry.name)
            if not (tmp or old) or not _is_flat_dir(entry):
                continue
            if tmp:
                age = now - _newest_mtime(entry)
                if age < grace_s:
                    log.info(
                        "ultrascale checkpoint: keeping %s (left by an interrupted save, or a save in progress: "
                        "modified %.0f s ago, less than %.0f s)", entry, age, grace_s,
                    )
                    continue
                log.info("ultrascale checkpoint: removing %s, left behind by an interrupted save", entry)
            else:
                final = folder / old["name"]
                if not _is_complete(final):
                    continue
                log.info("ultrascale checkpoint: removing %s, a previous version of %s left by an interrupted save", entry, final)
            _remove_any(entry)
            removed.append(entry)
        except FileNotFoundError:  # removed meanwhile
            continue
    if removed:
        _fsync_dir(folder)
    return removed


def restore_old_versions(folder: str | Path) -> list[Path]:
    """Rename each complete `.<name>.old-<nonce>/` in `folder` whose `<name>` is missing back to
    `<name>`; return the restored paths. Not needed to resume from an explicit path (see
    `check_checkpoint_dir`), but Lightning's `ckpt_path="last"` only finds `last*.ckpt` names.

    Safe to call from every rank at once: the renames that lose a race are ignored.
    """
    folder = Path(folder)
    try:
        names = {m["name"] for p in folder.iterdir() if (m := _OLD_NAME.match(p.name))}
    except OSError:
        return []
    restored = []
    for name in sorted(names):
        final = folder / name
        source = _newest_complete(_old_versions(final))
        if source is None or final.exists() or final.is_symlink():
            continue
        try:
            os.rename(source, final)
        except OSError as error:  # another rank was first
            if error.errno not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
                raise
            continue
        warnings.warn(f"restored checkpoint {final} from {source}, left by a save interrupted between two renames", stacklevel=2)
        restored.append(final)
    if restored:
        _fsync_dir(folder)
    return restored


# ------------------------------------------------------------------ publishing


def _publish(tmp: Path, path: Path, nonce: str) -> Path | None:
    """Give `tmp` the name `path` and fsync the parent; return what held `path` before, to delete."""
    parent = path.parent
    if not (path.exists() or path.is_symlink()):
        os.rename(tmp, path)
        _fsync_dir(parent)
        return None
    if _exchange(tmp, path):  # `path` is never missing; the previous version is now at `tmp`
        _fsync_dir(parent)
        return tmp
    if path.is_dir() and not path.is_symlink():
        old = parent / f".{path.name}.old-{nonce}"
        os.rename(path, old)
        os.rename(tmp, path)  # a kill before this leaves only `old`: see `check_checkpoint_dir`
        _fsync_dir(parent)
        return old
    path.unlink()  # a file or a link: no ultrascale checkpoint to fall back to
    os.rename(tmp, path)
    _fsync_dir(parent)
    return None


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names of two existing paths (Linux `renameat2(RENAME_EXCHANGE)`).

    False where the platform, the C library or the filesystem does not support it."""
    global _renameat2
    if not sys.platform.startswith("linux"):
        return False
    if _renameat2 is None:
        try:
            function = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):  # C library without the wrapper (glibc < 2.28)
            function = False
        else:
            function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            function.restype = ctypes.c_int
        _renameat2 = function
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # not supported here: the caller renames in two steps
    raise OSError(code, os.strerror(code), str(a), None, str(b))


# ------------------------------------------------------------------ files on disk


def _serialized(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_synced(data: bytes, file: Path) -> None:
    with open(file, "wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def _fsync_dir(directory: Path) -> None:
    """Persist a directory's entries (files created, renamed or removed in it)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise  # EIO & co: the data may not be on disk
    finally:
        os.close(fd)


def _make_dirs(directory: Path) -> None:
    created = []
    probe = directory
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    directory.mkdir(parents=True, exist_ok=True)
    for made in reversed(created):
        _fsync_dir(made.parent)


def _remove_any(target: Path) -> None:
    """Delete a checkpoint version (or a link / file); the completeness markers go first, so that a
    deletion cut short never leaves a directory that `check_checkpoint_dir` takes for complete."""
    if target.is_symlink() or target.is_file():
        target.unlink(missing_ok=True)
        return
    for marker in (METADATA_FILE, DCP_METADATA_FILE):
        try:
            (target / marker).unlink(missing_ok=True)
        except OSError:
            pass
    shutil.rmtree(target, ignore_errors=True)


def _old_versions(path: Path) -> list[Path]:
    """The `.<name>.old-<nonce>` siblings of `path`."""
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if (match := _OLD_NAME.match(p.name)) and match["name"] == path.name)


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in (DCP_METADATA_FILE, METADATA_FILE))


def _newest_complete(candidates: list[Path]) -> Path | None:
    """The same choice on every rank: the complete directory with the newest meta.pt, then the name."""
    best: tuple[tuple[int, str], Path] | None = None
    for candidate in candidates:
        try:
            if candidate.is_symlink() or not _is_complete(candidate):
                continue
            key = ((candidate / METADATA_FILE).stat().st_mtime_ns, candidate.name)
        except OSError:  # renamed or removed meanwhile
            continue
        if best is None or key > best[0]:
            best = (key, candidate)
    return None if best is None else best[1]


def _is_flat_dir(path: Path) -> bool:
    if path.is_symlink() or not path.is_dir():
        return False
    return all(child.is_file() and not child.is_symlink() for child in path.iterdir())


def _newest_mtime(path: Path) -> float:
    times = [path.lstat().st_mtime]
    for child in path.iterdir():
        try:
            times.append(child.lstat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


# ------------------------------------------------------------------ collectives


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
