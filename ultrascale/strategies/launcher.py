"""Choosing how rank processes are started.

Lightning's default launcher (`SubprocessScriptLauncher`) re-runs `sys.argv` once per rank: right
for a script or the `ultrascale` CLI, wrong inside pytest or a notebook (it would re-run
pytest). There we fork instead; the forked workers return only their metrics, not
rank 0's weights: those are sharded DTensors that cannot be shipped to the parent, and
the parent is not where training state lives anyway (use a checkpoint).

Neither launcher leaves a rank behind when the run fails (see the classes in
`_lightning_compat`): the fork launcher ends the other ranks shortly after one fails
and whenever the parent raises, and its ranks die with the parent; the subprocess
launcher ends its child ranks when rank 0 (the launching process) raises, as Lightning
already ends everything when a child fails.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

import lightning.pytorch as pl

from ultrascale.parallel.rules import Problem, raise_first
from ultrascale.strategies._lightning_compat import ForkLauncher, SubprocessScriptLauncher

LauncherName = Literal["auto", "subprocess", "fork"]
LAUNCHERS: tuple[str, ...] = ("auto", "subprocess", "fork")


def launcher_problems(name: Any) -> list[Problem]:
    """The one check of the `launcher` knob (asked by the strategies' `ProcessConfig` and by `make_launcher`)."""
    return [] if name in LAUNCHERS else [Problem("choose 'auto', 'subprocess' or 'fork'", (f"launcher={name!r}",))]


def in_interactive_or_pytest() -> bool:
    main = sys.modules.get("__main__")
    interactive = hasattr(sys, "ps1") or not hasattr(main, "__file__")
    return interactive or "PYTEST_CURRENT_TEST" in os.environ or "pytest" in os.path.basename(sys.argv[0] or "")


def make_launcher(
    name: LauncherName, strategy: "pl.strategies.ParallelStrategy", num_processes: int, num_nodes: int
) -> SubprocessScriptLauncher | ForkLauncher:
    if name == "auto":
        on_cpu = all(device.type == "cpu" for device in (strategy.parallel_devices or []))
        # One process: the subprocess launcher starts no child and trains in this process,
        # so the caller's module and trainer hold the results.
        single = num_processes * num_nodes == 1
        name = "fork" if (on_cpu and num_nodes == 1 and not single and in_interactive_or_pytest()) else "subprocess"
    if name == "fork":
        launcher: SubprocessScriptLauncher | ForkLauncher = ForkLauncher(strategy)
    elif name == "subprocess":
        launcher = SubprocessScriptLauncher(strategy.cluster_environment, num_processes, num_nodes)
    else:
        raise_first(launcher_problems(name))
    # Checks of the model against the layout run once here, before any rank process starts.
    launcher.before_launch = getattr(strategy, "check_before_launch", None)
    return launcher
