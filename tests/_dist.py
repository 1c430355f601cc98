"""Multi-rank test helpers (see ultrascale.parallel.local_launch)."""

from ultrascale.parallel.local_launch import free_port, init_gloo, run_ranks

__all__ = ["free_port", "init_gloo", "run_ranks"]
