"""Every private Lightning name ultrascale uses, in one place, each with why no public API serves.

Lightning has no public extension points for some of what a custom N-D strategy must do
(start processes its own way, log from the optimizer step, hand the module its device
mesh). Everything that reaches into Lightning's internals goes through this module, so a
Lightning upgrade that renames one of them breaks here, with a message that names it,
and nowhere else. `check_lightning_internals()` verifies them all against the installed
Lightning (the strategy runs it once; `tests/test_lightning_compat.py` runs it in CI).

Tested range: see `LIGHTNING_TESTED` and the `lightning` pin in pyproject.toml.
"""

from __future__ import annotations

import importlib
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import Any, Optional

import lightning
import lightning.pytorch as pl
import torch
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

LIGHTNING_TESTED = ">=2.6.4,<2.7"

# (where, name, why the public API does not serve). `where` is a module, or "module:Class"
# for a class attribute, or "module:Class()" for an attribute set on every instance.
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device",
     "moves optimizer state tensors after setup, as Lightning's own strategies do; no public helper"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher",
     "Lightning's only fork/spawn launcher; the fork launcher subclasses it"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput",
     "the record a fork worker sends back to the parent process"),
    ("lightning.pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher", "_collect_rank_zero_results",
     "the hook that decides what a worker sends back; sharded weights must not be sent"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher",
     "Lightning's script re-running launcher (scripts, the CLI)"),
    ("lightning.pytorch.strategies.strategy", "_ForwardRedirection",
     "runs a step method inside the root module's __call__ so FSDP's root hooks fire"),
    ("lightning.pytorch.strategies.strategy:Strategy", "_configure_launcher",
     "the hook through which the accelerator connector asks a strategy for its launcher"),
    ("lightning.pytorch.strategies.strategy:Strategy", "_reset_optimizers_and_schedulers",
     "clears optimizers before a second fit, as Lightning's own strategies do"),
    ("lightning.pytorch.strategies.strategy:Strategy()", "_launcher",
     "where the accelerator connector and the trainer read the strategy's launcher"),
    ("lightning.pytorch.strategies.strategy:Strategy()", "_precision_plugin",
     "read directly by the accelerator connector; the precision_plugin setter stores it"),
    ("lightning.pytorch.strategies.strategy:Strategy()", "_forward_redirection",
     "the strategy's forward-redirection instance"),
    ("lightning.pytorch.core.module:LightningModule()", "_device_mesh",
     "backs the public `LightningModule.device_mesh`, which has no setter"),
    ("lightning.pytorch.core.module:LightningModule()", "_current_fx_name",
     "`self.log` accepts only hook names Lightning knows; the exact step loss is logged as the "
     "optimizer-step hook that runs right after it"),
    ("lightning.pytorch.trainer.trainer:Trainer", "_results",
     "the running loop's logged values: refuses a user-logged `train_loss` beside the strategy's"),
)


def _resolve(where: str, name: str) -> bool:
    module_name, _, owner = where.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return False
    if not owner:
        return hasattr(target, name)
    instance = owner.endswith("()")
    target = getattr(target, owner.removesuffix("()"), None)
    if target is None:
        return False
    if not instance:
        return hasattr(target, name)
    # An attribute every instance gets: assigned (`self.<name> = ...`) in an `__init__` of the class's MRO.
    inits = (vars(cls).get("__init__") for cls in target.__mro__)
    return any(name in init.__code__.co_names for init in inits if hasattr(init, "__code__"))


def missing_lightning_internals() -> list[str]:
    """``"where.name (why)"`` for every private name the installed Lightning lacks."""
    return [f"{where}.{name} ({why})" for where, name, why in PRIVATE_NAMES if not _resolve(where, name)]


_checked = False


def check_lightning_internals() -> None:
    """RuntimeError naming each missing private Lightning name and the tested Lightning range."""
    global _checked
    if _checked:
        return
    missing = missing_lightning_internals()
    if missing:
        raise RuntimeError(
            f"ultrascale needs Lightning internals that lightning {lightning.__version__} lacks:\n  "
            + "\n  ".join(missing)
            + f"\nultrascale is tested with lightning{LIGHTNING_TESTED}: `pip install 'lightning{LIGHTNING_TESTED}'`"
        )
    _checked = True


try:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.strategies.parallel import ParallelStrategy
except ImportError as error:  # pragma: no cover - depends on the installed Lightning
    raise ImportError(
        f"ultrascale cannot import a Lightning internal it needs ({error}); lightning {lightning.__version__} is "
        f"installed, ultrascale is tested with lightning{LIGHTNING_TESTED}"
    ) from error

SubprocessScriptLauncher = _SubprocessScriptLauncher


class ForkLauncher(_MultiProcessingLauncher):
    """Fork-based launcher that sends back metrics and trainer state, never the (sharded) weights:
    those are DTensors that cannot be shipped to the parent (use a checkpoint)."""

    def __init__(self, strategy: "pl.strategies.ParallelStrategy") -> None:
        super().__init__(strategy, start_method="fork")

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        return _WorkerOutput(best_model_path, None, trainer.state, results, self.get_extra_results(trainer))


class StrategyInternals(ParallelStrategy):
    """`ParallelStrategy` with the private hooks an N-D strategy needs behind named methods."""

    def create_launcher(self) -> Any:
        """The launcher to start the processes with, or None when they exist already."""
        return None

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self.create_launcher()

    @property
    def stored_precision_plugin(self) -> Any:
        return self._precision_plugin

    @stored_precision_plugin.setter
    def stored_precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = plugin

    def reset_optimizers_and_schedulers(self) -> None:
        self._reset_optimizers_and_schedulers()

    def call_inside_module(self, module: torch.nn.Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """`module.<method_name>(...)` run inside `module.__call__` (its forward hooks fire)."""
        return self._forward_redirection(module, module, method_name, *args, **kwargs)


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    _optimizers_to_device(optimizers, device)


def attach_device_mesh(module: "pl.LightningModule", mesh: DeviceMesh) -> None:
    """Make `module.device_mesh` return `mesh` (as Lightning's ModelParallelStrategy does)."""
    module._device_mesh = mesh


def step_logged(trainer: "pl.Trainer", key: str) -> bool:
    """Whether the running loop holds a value logged under `key` (e.g. "training_step.train_loss")."""
    results = trainer._results
    return results is not None and key in results


@contextmanager
def logging_as_hook(module: "pl.LightningModule", hook_name: str) -> Generator[None, None, None]:
    """`module.log(...)` inside this block is recorded as if called from `hook_name`."""
    previous = module._current_fx_name
    module._current_fx_name = hook_name
    try:
        yield
    finally:
        module._current_fx_name = previous
