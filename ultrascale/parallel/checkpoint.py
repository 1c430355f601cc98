"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), written atomically.

Layout of a checkpoint directory `path/`:
    .metadata, __<rank>_0.distcp   DCP shards of model and optimizer state (reshardable)
    meta.pt                        everything else (loop progress, schedulers, callbacks, data state)

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
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ultrascale.parallel.safe_load import UnsafeCheckpointError, load_dcp, read_torch_file

METADATA_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
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
    nonce = _broadcast_from_rank0(uuid.uuid4().hex[:12])
    tmp = path.parent / f".{path.name}.tmp-{nonce}"
    if _rank() == 0:
        _make_dirs(path.parent)
        remove_leftovers(path.parent)
    _barrier()
    # DCP's FileSystemWriter (the writer `checkpoint_id=` selects) has `sync_files=True` by default:
    # it fsyncs every shard file and `.metadata` (written as `.metadata.tmp`, renamed) itself
    # (torch/distributed/checkpoint/filesystem.py, `_write_files_from_queue` and `finish`). It
    # never fsyncs the directory holding them: `_fsync_dir(tmp)` below does.
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        _save_synced(metadata, tmp / METADATA_FILE)
    _barrier()  # every rank's shard files are complete and fsynced
    if _rank() == 0:
        _fsync_dir(tmp)  # the directory entries of the shards, .metadata and meta.pt
        previous = _publish(tmp, path, nonce)
        if previous is not None:
            _remove_any(previous)
        for stale in _old_versions(path):  # left by an earlier save of `path` killed between renames
            log.info("ultrascale checkpoint: removing %s, a previous version of %s left by an interrupted save", stale, path)
            _remove_any(stale)
    _barrier()
    return path


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
        load_dcp(state, path)
    except UnsafeCheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        if isinstance(error.__cause__, UnsafeCheckpointError) or "refusing to" in str(error):
            raise UnsafeCheckpointError(f"{path}: {error}") from error
        raise RuntimeError(f"could not read the sharded checkpoint at {path}: {error}") from error
    return metadata


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """`meta.pt` of checkpoint `path`, read as data (`ultrascale.parallel.safe_load`)."""
    file = Path(path) / METADATA_FILE
    try:
        return read_torch_file(file)
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise RuntimeError(f"could not read {file}: {error}") from error


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
        warnings.warn(f"restored checkpoint {final} from {source}, left by a save interrupted between two renames")
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


def _save_synced(obj: Any, file: Path) -> None:
    with open(file, "wb") as stream:
        torch.save(obj, stream)
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
