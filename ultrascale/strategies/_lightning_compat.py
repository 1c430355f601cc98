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
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any, Optional

import lightning
import lightning.pytorch as pl
import lightning.pytorch.cli
import torch
import torch.multiprocessing
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from ultrascale.launch import (
    STOP_GRACE_S,
    die_with_parent,
    end_processes,
    host_rendezvous,
    join_rendezvous,
    one_thread_after_fork,
)
from ultrascale.parallel.rules import not_built

RENDEZVOUS_TIMEOUT_S = 600.0
"""How long a forked rank waits for the launcher's port, and the store's own timeout (torch's default, 10 min)."""

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
    ("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver",
     "the thread that ends every rank when a child rank fails; subclassed to report a child's data error as one "
     "message (ultrascale/user_errors.py)"),
    ("lightning.fabric.utilities.distributed", "_set_num_threads_if_needed",
     "what the script launcher's `launch` does before running the function; `launch` is re-stated to start its "
     "own observer"),
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
    ("lightning.pytorch.cli:LightningCLI", "_instantiate_trainer",
     "the one LightningCLI hook that sees the recipe's callbacks: the `ultrascale` CLI adds its default "
     "MFUMonitor / StepProgressBar only where the recipe has none of their kind (ultrascale/cli.py)"),
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
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.strategies.parallel import ParallelStrategy
except ImportError as error:  # pragma: no cover - depends on the installed Lightning
    raise ImportError(
        f"ultrascale cannot import a Lightning internal it needs ({error}); lightning {lightning.__version__} is "
        f"installed, ultrascale is tested with lightning{LIGHTNING_TESTED}"
    ) from error

class SubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script re-running launcher, which also ends the child ranks when rank 0 (this
    process) fails, and reports a child rank's user error (a mistake in the data) as one message.

    Lightning ends everything when a *child* exits non-zero (its child-process observer SIGKILLs
    the children and this process), but not when rank 0 raises: the exception leaves `launch`
    and the children are left to notice by themselves, which a rank blocked in a collective
    does only at the collective timeout, and a stopped (SIGSTOP) rank never does. Here they
    are ended (SIGTERM + SIGCONT, SIGKILL after `STOP_GRACE_S`) and reaped before the
    exception goes on.

    A child rank that raises one of `user_error_types` leaves its message for this process
    (`user_errors.leave_for_launcher`); the observer (`_UserErrorObserver`) then ends the
    children and, under the `ultrascale` command, prints the message and exits 2; called from
    Python, this process raises the child's exception at its next failure (the collective that
    waits on the ended ranks) instead of whatever that failure was.
    """

    before_launch: Optional[Callable[[], None]] = None
    """Run in this process before any child starts (the strategy's checks of the model against the layout)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        from ultrascale import user_errors

        if self.before_launch is not None:
            self.before_launch()
        check_data_before_launch(args)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        observer = None
        try:
            if not self.cluster_environment.creates_processes_externally:
                errors = tempfile.mkdtemp(prefix="ultrascale-rank-errors-")
                os.environ[user_errors.CHILD_ERRORS_VARIABLE] = errors
                try:
                    self._call_children_scripts()
                finally:
                    del os.environ[user_errors.CHILD_ERRORS_VARIABLE]  # rank 0 reports; only the children leave
                observer = _UserErrorObserver(os.getpid(), self.procs, errors)
                observer.start()
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)
        except BaseException as error:
            self.end_children()
            if isinstance(error, user_errors.user_error_types()):
                user_errors.leave_for_launcher(error)  # in a child rank: rank 0 reports it
                raise
            child = user_errors.first_child_error(observer.errors if observer is not None else None)
            if child is not None:
                raise child from None
            raise
        finally:
            if observer is not None:
                observer.finish()

    def end_children(self) -> None:
        """End and reap the child ranks still running."""
        # Lightning's observer thread watches this very list and, seeing a child that exited
        # non-zero (as the ones ended here will), SIGKILLs this process too, before its error is
        # reported. Emptied, the list tells the observer that all is done; the launcher keeps a copy.
        observed = self.procs
        self.procs = list(observed)
        observed.clear()
        end_processes(self.procs)


class _UserErrorObserver(_ChildProcessObserver):
    """Lightning's observer of the child ranks (polling every second, not five), which on a child's failure first
    looks for a user error the child left (`user_errors.first_child_error`): under the `ultrascale` command it
    prints it once, ends the children and exits this process with status 2; from Python it ends the children and
    leaves this process running, so that `launch` raises the child's error where this process fails next."""

    def __init__(self, main_pid: int, children: list, errors: str) -> None:
        super().__init__(main_pid, children, sleep_period=1)
        self.errors = errors

    @override
    def _terminate_all(self) -> None:
        from ultrascale import user_errors

        error = user_errors.first_child_error(self.errors)
        if error is None:
            super()._terminate_all()
            return
        end_processes(list(self._child_processes))
        if user_errors.command() is not None:
            user_errors.report(str(error))
            shutil.rmtree(self.errors, ignore_errors=True)
            os._exit(user_errors.USER_ERROR_EXIT)

    def finish(self) -> None:
        self._finished = True
        shutil.rmtree(self.errors, ignore_errors=True)


def check_data_before_launch(args: tuple) -> None:
    """The data module's cheap checks (`check_before_launch`: the path, the first records) before any rank starts,
    for the Python API (`Trainer.fit(model, datamodule=...)`: the launcher gets fit's arguments, the module first);
    the `ultrascale` command has made them already (the module remembers)."""
    datamodules = [arg for arg in args if isinstance(arg, pl.LightningDataModule)]
    modules = [arg for arg in args if isinstance(arg, pl.LightningModule)]
    for datamodule in datamodules:
        check = getattr(datamodule, "check_before_launch", None)
        if check is not None:
            check(modules[0] if modules else None)


class ForkLauncher(_MultiProcessingLauncher):
    """Fork-based launcher that sends back metrics and trainer state, never the (sharded) weights:
    those are DTensors that cannot be shipped to the parent (use a checkpoint).

    No rank outlives a launch: when a rank fails the others get `STOP_GRACE_S` to end by
    themselves, then SIGTERM, then SIGKILL after `STOP_GRACE_S` (Lightning's launcher waits
    30 s before the SIGKILL that a stopped or collective-blocked rank needs); when this
    process raises (Ctrl-C, a timeout) the ranks are ended too, and the kernel SIGKILLs
    them if this process dies (`die_with_parent`). Each rank runs one intra-op thread
    (`one_thread_after_fork`: more hang after fork), where Lightning gives each cores/ranks.
    Lightning's `launch` is followed step for step otherwise (fork start method only).
    """

    def __init__(self, strategy: "pl.strategies.ParallelStrategy") -> None:
        super().__init__(strategy, start_method="fork")
        self._fitted_once = False

    before_launch: Optional[Callable[[], None]] = None
    """Run in this process before any rank is forked (the strategy's checks of the model against the layout)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if self.before_launch is not None:
            self.before_launch()
        check_data_before_launch(args)
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "The fork launcher cannot start processes once CUDA is initialized in this process (a `torch.cuda.*` "
                "call, a model moved to the GPU): remove those calls, or use `launcher='subprocess'`."
            )
        if self._fitted_once and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise not_built(
                "fork_launcher_second_fit",
                "Calling `trainer.fit()` twice on the same Trainer with the fork launcher is not supported: create a "
                "new Trainer and pass `fit(ckpt_path=...)`."
            )
        strategy = self._strategy
        assert strategy.cluster_environment is not None
        fork = multiprocessing.get_context("fork")
        return_queue = fork.SimpleQueue()
        user_errors = fork.SimpleQueue()  # a rank's mistake of the user's, raised again here as it was raised there
        pipes = [fork.Pipe(duplex=False) for _ in range(strategy.num_processes)]
        context = torch.multiprocessing.start_processes(
            self._run_rank,
            args=(os.getpid(), [reader for reader, _ in pipes], trainer, function, args, kwargs, return_queue,
                  user_errors),
            nprocs=strategy.num_processes,
            start_method="fork",
            join=False,
        )
        self.procs = context.processes
        store = None
        try:
            # This process hosts the rendezvous on a port the kernel picks: a port chosen first and bound later by
            # rank 0 can be taken in between by another job's socket (see `ultrascale.launch`).
            store = host_rendezvous(strategy.cluster_environment.main_address, strategy.num_processes,
                                    RENDEZVOUS_TIMEOUT_S, (writer for _, writer in pipes))
            # On a rank's failure: the others get the grace, then SIGTERM, then SIGKILL; then it raises.
            while not context.join(grace_period=STOP_GRACE_S):
                pass
        except BaseException:
            end_processes(self.procs)  # a rank failed, or this process raised (Ctrl-C, a timeout): none may outlive it
            if not user_errors.empty():
                raise user_errors.get() from None
            raise
        finally:
            for reader, writer in pipes:
                reader.close()
                writer.close()
            del store
        worker_output = return_queue.get()
        for process in self.procs:  # joined and reaped: release their sentinel pipes now, not at Trainer collection
            process.close()
        self.procs = []
        if trainer is None:
            return worker_output
        self._fitted_once |= trainer.state.fn == TrainerFn.FITTING
        callback = trainer.checkpoint_callback
        if callback and hasattr(callback, "best_model_path"):
            callback.best_model_path = str(worker_output.best_model_path)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)
        return worker_output.trainer_results

    def _run_rank(
        self,
        process_idx: int,
        parent_pid: int,
        port_readers: list[Any],
        trainer: Optional["pl.Trainer"],
        function: Callable,
        args: Any,
        kwargs: Any,
        return_queue: Any,
        user_errors: Any,
    ) -> None:
        die_with_parent(parent_pid)
        self.procs = []  # a rank starts no ranks (Lightning's `kill`, from its SIGTERM handler, reads these)
        join_rendezvous(port_readers[process_idx], RENDEZVOUS_TIMEOUT_S)
        one_thread_after_fork()
        os.environ["LOCAL_RANK"] = str(process_idx)
        from ultrascale.user_errors import user_error_types

        try:
            results = function(*args, **kwargs)
        except user_error_types() as error:
            user_errors.put(error)
            raise
        if trainer is not None:
            results = self._collect_rank_zero_results(trainer, results)
        if process_idx == 0:
            return_queue.put(move_data_to_device(results, "cpu"))

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


class DefaultCallbacksCLI(pl.cli.LightningCLI):
    """LightningCLI that adds callbacks of its own only where the recipe has none of their kind.

    LightningCLI's public `trainer_defaults["callbacks"]` are appended to the recipe's whatever they
    are (a second progress bar, a second MFU monitor); the recipe's callbacks and the Trainer's
    arguments meet only in the private `_instantiate_trainer`."""

    def default_callbacks(self, given: list[Any], trainer_config: dict[str, Any]) -> list[Any]:
        """The callbacks to add, given the recipe's (`given`) and the Trainer arguments."""
        return []

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> "pl.Trainer":
        given = [*(config.get("callbacks") or []), *callbacks]
        return super()._instantiate_trainer(config, [*callbacks, *self.default_callbacks(given, config)])
