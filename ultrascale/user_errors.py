"""One message for a mistake of the user's, from whichever process finds it, and nothing left behind.

A mistake in the data (`ultrascale.data.errors.DataError`), a layout the rules refuse, a damaged checkpoint: the
commands print these as one line, ``ultrascale fit: error: MESSAGE``, and exit 2, without a traceback
(``ULTRASCALE_DEBUG=1`` or ``--debug`` shows it). Anything else is a bug and keeps its traceback.

What can be checked cheaply is checked in the launching process before any rank starts. What only a rank finds (a
bad line deep in a large file) reaches the user the same way:

* Under Lightning's script launcher, rank 0 is the launching process and the others are the same command re-run.
  A child rank does not print: it writes its message into the folder named by `CHILD_ERRORS_VARIABLE` (set for the
  children only, by `strategies/_lightning_compat.SubprocessScriptLauncher`) and exits 2. Rank 0's observer of the
  children finds it there, prints it, ends the other ranks and exits 2. Rank 0's own error is printed by the
  command. Whichever comes first is printed; the rest are not (`report` prints once per process).
* Under the fork launcher (tests, notebooks) a rank sends its exception to the parent, which raises it again.

Before the process exits, the folders this run created and would otherwise leave behind for a run that never
trained (the logger's folder, the checkpoint folder: `remove_on_user_error`) are removed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

__all__ = ["CHILD_ERRORS_VARIABLE", "USER_ERROR_EXIT", "command", "debugging", "first_child_error",
           "leave_for_launcher", "load_error", "remove_on_user_error", "report", "save_error", "set_command",
           "user_error_types"]

CHILD_ERRORS_VARIABLE = "ULTRASCALE_CHILD_ERRORS"
DEBUG_VARIABLE = "ULTRASCALE_DEBUG"
USER_ERROR_EXIT = 2

_lock = threading.Lock()
_reported = False
_created: list[Path] = []
_left = False
_command: Optional[str] = None


def set_command(name: Optional[str]) -> None:
    """This process runs the command `name` (``ultrascale fit``): its messages start with it, and rank 0's observer
    may end the process when a child rank fails on a user's mistake (a Python caller gets the exception instead).
    A new command starts afresh: nothing reported, nothing to remove (tests run several in one process); None
    when it has ended."""
    global _command, _reported, _left
    with _lock:
        _command, _reported, _left = name, False, False
        _created.clear()


def command() -> Optional[str]:
    return _command


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions a rank raises for a mistake of the user's (imported when asked: the CLI's start stays light)."""
    from ultrascale.data.errors import DataError
    from ultrascale.parallel.manifest import CheckpointDamaged
    from ultrascale.parallel.rules import LayoutError, LayoutNotImplemented

    return DataError, LayoutError, LayoutNotImplemented, CheckpointDamaged


def debugging() -> bool:
    return bool(os.environ.get(DEBUG_VARIABLE))


def remove_on_user_error(paths: Iterable[str | os.PathLike]) -> None:
    """Remember, of each of `paths` that does not exist yet, its outermost missing folder: this run creates it, and
    `report` removes it (a run folder with an events file for a run that never trained is noise)."""
    for given in paths:
        path = Path(given).absolute()
        if path.exists():
            continue
        while not path.parent.exists():
            path = path.parent
        if path not in _created:
            _created.append(path)


def report(message: str) -> bool:
    """Print ``COMMAND: error: MESSAGE`` to stderr and remove what `remove_on_user_error` named, once per process:
    True the first time (the caller exits 2 either way)."""
    global _reported
    with _lock:
        if _reported:
            return False
        _reported = True
        for path in _created:
            shutil.rmtree(path, ignore_errors=True)
        print(f"{_command or 'ultrascale'}: error: {message}", file=sys.stderr, flush=True)
        return True


def leave_for_launcher(error: BaseException) -> bool:
    """In a child rank of the script launcher: write `error` where rank 0 reads it (`first_child_error`; once per
    process, the first error) and return True; elsewhere False (the caller prints it)."""
    global _left
    folder = os.environ.get(CHILD_ERRORS_VARIABLE)
    if not folder or not os.path.isdir(folder):
        return False
    if _left:
        return True
    _left = True
    save_error(error, os.path.join(folder, f"rank-pid-{os.getpid()}"))
    return True


def first_child_error(folder: Optional[str | os.PathLike]) -> Optional[BaseException]:
    """The error the first child rank to fail on a user's mistake left in `folder` (of its type among
    `user_error_types`, else a ValueError with its message), or None."""
    if folder is None or not os.path.isdir(folder):
        return None
    found = sorted((entry.stat().st_mtime_ns, entry.path) for entry in os.scandir(folder)
                   if entry.name.startswith("rank-pid-"))
    if not found:
        return None
    return load_error(found[0][1])


def save_error(error: BaseException, path: str | os.PathLike) -> None:
    """Write `error` (its type's name, then its message) to `path` for another process's `load_error`; written
    whole, then renamed, so a reader never sees half a message."""
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".partial-")
    with os.fdopen(fd, "w") as out:
        out.write(f"{type(error).__name__}\n{error}")
    os.replace(partial, path)


def load_error(path: str | os.PathLike) -> BaseException:
    """The error `save_error` wrote: of its type among `user_error_types` and their subclasses (`DataNotFound`),
    else a ValueError with its message."""
    kind, _, message = Path(path).read_text().partition("\n")
    types, todo = {}, list(user_error_types())
    while todo:
        cls = todo.pop()
        types[cls.__name__] = cls
        todo += cls.__subclasses__()
    return types.get(kind, ValueError)(message)
