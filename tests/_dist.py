"""Multi-rank test helpers (see ultrascale.launch)."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ultrascale.launch import init_gloo, run_ranks


@contextmanager
def counting_calls(owner: Any, *names: str) -> Iterator[dict[str, int]]:
    """Count the calls of `owner.<name>` (e.g. `torch.distributed` collectives) while the block runs.
    Names `owner` lacks (collectives of another torch version) count 0."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(owner, name) for name in names if hasattr(owner, name)}

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(owner, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(owner, name, fn)


__all__ = ["counting_calls", "init_gloo", "run_ranks"]
