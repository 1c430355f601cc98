"""The one exception type for mistakes in the user's data.

A path that does not exist or holds nothing readable, a line that is not JSON or not UTF-8, a missing field, a
value of the wrong type, a malformed conversation, a data set with no token to learn at this `seq_len`: each is a
`DataError` whose message says where (``FILE:LINE``, ``FILE row N`` for Parquet and saved datasets) and which
field. ultrascale's commands print it as one line and exit 2 (`ultrascale.user_errors`), from whichever rank
found it; anything else keeps its traceback, since it is a bug of ours. It subclasses ValueError, so code that
caught the readers' ValueError before still catches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DataError", "DataNotFound", "check_before_launch"]


class DataError(ValueError):
    """A mistake in the user's data; the message names the file and line (or row) and the field at fault."""


class DataNotFound(DataError, FileNotFoundError):
    """A data path that does not exist (also a FileNotFoundError, as it was before the type existed)."""


def check_before_launch(datamodule: Any, module: Any, knob_error: Callable[[str], Exception]) -> None:
    """`datamodule.check_before_launch(module)` where it has one (the path, the first records' fields, the chat
    template on the first conversations), in the launching process: a DataError as raised; a ValueError for the
    module's knobs against the data (a template that does not render) as `knob_error(message)`, the caller's own
    one-line type."""
    check = getattr(datamodule, "check_before_launch", None)
    if check is None:
        return
    try:
        check(module)
    except DataError:
        raise
    except (ValueError, FileNotFoundError) as error:
        raise knob_error(str(error)) from None
