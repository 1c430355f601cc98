"""Calling the `ultrascale` command in-process, as a test reads it."""

from __future__ import annotations

from typing import Any


def run_main(capsys: Any, *args: str) -> tuple[int, str, str]:
    """`ultrascale ARGS...` through `ultrascale.cli.main`: (exit status, stdout, stderr)."""
    import logging
    import sys

    from ultrascale.cli import main

    capsys.readouterr()
    # Lightning's log handlers keep the stream they were made with (another test's captured stderr, closed since).
    for logger in list(logging.Logger.manager.loggerDict.values()):
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
