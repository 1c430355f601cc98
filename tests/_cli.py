"""Calling the `ultrascale` command in-process, as a test reads it."""

from __future__ import annotations

from typing import Any


def run_main(capsys: Any, *args: str) -> tuple[int, str, str]:
    """`ultrascale ARGS...` through `ultrascale.cli.main`: (exit status, stdout, stderr)."""
    import logging
    import sys

    from ultrascale.cli import main

    capsys.readouterr()
    # Lightning's log handlers keep the stream they were made with: another test's captured stderr, closed since or
    # still open (a suspended capture the fixture does not read). For the call they write to this test's stderr, which
    # forked ranks inherit (`capfd` reads what they write).
    rebound = []
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if type(handler) is logging.StreamHandler and handler.stream is not sys.stderr:
                rebound.append((handler, handler.stream))
                handler.stream = sys.stderr
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        for handler, stream in rebound:
            if not getattr(stream, "closed", False):
                handler.stream = stream
    captured = capsys.readouterr()
    return code, captured.out, captured.err
