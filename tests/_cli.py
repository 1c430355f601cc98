"""Calling the `ultrascale` command in-process, as a test reads it."""

from __future__ import annotations

from typing import Any


def run_main(capsys: Any, *args: str) -> tuple[int, str, str]:
    """`ultrascale ARGS...` through `ultrascale.cli.main`: (exit status, stdout, stderr)."""
    from ultrascale.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
