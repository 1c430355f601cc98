"""The recipe command's base: LightningCLI with ultrascale's defaults, its one-message argument errors and the
noise filters a run installs. Below the commands that build recipes (`ultrascale.cli`, `planner.app`, `verify/`),
which all import it; it imports nothing of theirs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L

import ultrascale  # noqa: F401  (registers the strategies by name)
from ultrascale.strategies._lightning_compat import DefaultCallbacksCLI

TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "ultrascale"},
    },
    "enable_progress_bar": True,
}


class UltraScaleCLI(DefaultCallbacksCLI):
    """LightningCLI with TensorBoard logging and a progress bar by default."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        super().__init__(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={**TRAINER_DEFAULTS, **kwargs.pop("trainer_defaults", {})},
            save_config_kwargs={"overwrite": True},
            # A recipe error raises (`main` words it) instead of printing jsonargparse's raw text and exiting.
            parser_kwargs={"exit_on_error": False, **kwargs.pop("parser_kwargs", {})},
            args=args,
            run=run,
            **kwargs,
        )

    def default_callbacks(self, given: list[Any], trainer_config: dict[str, Any]) -> list[Any]:
        """Every run logs tokens/s (and MFU where the model's FLOPs are known) and counts optimizer steps in
        its progress bar, unless the recipe configures its own `MFUMonitor` / progress bar."""
        from lightning.pytorch.callbacks import ProgressBar

        from ultrascale.callbacks import MFUMonitor, StepProgressBar

        defaults: list[Any] = []
        if not any(isinstance(cb, MFUMonitor) for cb in given):
            defaults.append(MFUMonitor(mfu=None))
        if trainer_config.get("enable_progress_bar", True) is not False and not any(isinstance(cb, ProgressBar) for cb in given):
            defaults.append(StepProgressBar())
        return defaults

    def instantiate_classes(self) -> None:
        """The recipe's objects; an error of their arguments (a layout the rules refuse, a data path that is not
        there, a value out of range) becomes a `RecipeError`, which `main` prints as one message."""
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, NotImplementedError) as error:
            raise RecipeError(describe_argument_error(error)) from error

    def before_fit(self) -> None:
        self._remove_outputs_if_the_user_errs()
        self._check_layout_fits_the_world()
        self._check_data_before_launch()
        self._restore_interrupted_last()
        self._resolve_auto_resume()
        self._verify_given_checkpoint()
        self._say_where_outputs_go()

    before_validate = before_test = before_predict = before_fit

    def _remove_outputs_if_the_user_errs(self) -> None:
        """The run's log and checkpoint folders, where they do not exist yet: a run that stops on a mistake of the
        user's (a bad record found by a rank) removes them as it reports it (`user_errors.report`), so no run folder
        is left for a run that never trained."""
        from ultrascale import user_errors

        trainer = self.trainer
        folders = [trainer.log_dir] if trainer.loggers and trainer.log_dir else []
        folders += [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        user_errors.remove_on_user_error(folders)

    def _say_where_outputs_go(self) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        trainer = self.trainer
        logs = trainer.log_dir if trainer.loggers else "nowhere (no logger)"
        folders = [str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        saved = ", ".join(folders) or (f"{trainer.log_dir}/checkpoints" if trainer.checkpoint_callbacks else "none (no ModelCheckpoint)")
        rank_zero_info(f"ultrascale: logs in {logs}; checkpoints in {saved}")

    def _restore_interrupted_last(self) -> None:
        """`--ckpt_path last`: Lightning looks for `last*.ckpt` by name before any strategy runs. A save
        killed between the two renames that publish a checkpoint (possible where the filesystem has
        no atomic exchange, e.g. NFS) leaves only its complete `.old` copy: put it back first, once,
        in the launching process."""
        from ultrascale.parallel.checkpoint import restore_old_versions

        if self.config.get(self.subcommand, {}).get("ckpt_path") != "last":
            return
        for callback in self.trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None):
                for restored in restore_old_versions(callback.dirpath):
                    print(f"ultrascale: restored {restored} from the copy an interrupted save left behind")

    def _check_layout_fits_the_world(self) -> None:
        """The degrees against the Trainer's world size (devices x nodes), in the launching process: a layout
        that does not fit is told before any rank starts (`LayoutError`, exit status 2 in `main`)."""
        strategy = self.trainer.strategy
        if hasattr(strategy, "resolve_dims") and hasattr(strategy, "layout_knobs"):
            strategy.resolve_dims(self.trainer.num_nodes * self.trainer.num_devices)

    def _check_data_before_launch(self) -> None:
        """A data module's cheap checks (`check_before_launch`: the path, the first records' fields, the chat
        template on the first conversations) in the launching process, so a mistake in the data is one message
        (`RecipeError`, exit status 2 in `main`) before any rank starts."""
        from ultrascale.data.errors import check_before_launch

        check_before_launch(self.datamodule, self.model, RecipeError)

    def _verify_given_checkpoint(self) -> None:
        """`--ckpt_path PATH`: a checkpoint that is missing or damaged (its manifest, or DCP's index for one saved
        before manifests) is refused here, naming the files, before any rank process starts (`CheckpointDamaged`,
        exit status 2 in `main`). The strategy checks again when it loads (the Trainer API's path)."""
        from ultrascale.parallel.checkpoint import check_checkpoint_dir
        from ultrascale.parallel.manifest import CheckpointDamaged, damage_message, verify_checkpoint
        from ultrascale.strategies.autoresume import AUTO, verify_level

        given = self.config.get(self.subcommand, {}).get("ckpt_path")
        if given in (None, AUTO, "last", "hpc", "registry"):
            return
        import warnings

        try:
            with warnings.catch_warnings():  # a `.old` fallback is announced once, when it is loaded
                warnings.simplefilter("ignore")
                path = check_checkpoint_dir(given)
        except (FileNotFoundError, ValueError) as error:
            raise CheckpointDamaged(str(error)) from None
        problems = verify_checkpoint(path, verify_level(self.trainer))
        if problems:
            raise CheckpointDamaged(damage_message(path, problems))

    def _resolve_auto_resume(self) -> None:
        """`--ckpt_path auto`: the newest complete checkpoint where the run's ModelCheckpoint writes, or none
        (fit starts at step 0; the other subcommands need one). Every rank process runs this CLI (the
        subprocess launcher re-runs it, torchrun starts it per rank) and reads the same files, so every
        rank resumes from the same checkpoint."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        from ultrascale.strategies.autoresume import AUTO, checkpoint_folders, latest_checkpoint

        config = self.config_init.get(self.subcommand, {})
        if config.get("ckpt_path") != AUTO:
            return
        found = latest_checkpoint(self.trainer)
        if found is None and self.subcommand != "fit":
            folders = ", ".join(str(f) for f in checkpoint_folders(self.trainer)) or "(no folder yet)"
            raise ValueError(f"`{self.subcommand} --ckpt_path auto`: no complete checkpoint in {folders}")
        config["ckpt_path"] = found
        if found is None:
            folders = ", ".join(str(f) for f in checkpoint_folders(self.trainer)) or "(no folder yet)"
            rank_zero_info(f"ultrascale: --ckpt_path auto: no complete checkpoint in {folders}; starting from step 0")
        else:
            import warnings

            from ultrascale.parallel.checkpoint import check_checkpoint_dir, read_checkpoint_metadata

            with warnings.catch_warnings():  # a `.old` fallback is announced once, when it is loaded
                warnings.simplefilter("ignore")
                step = read_checkpoint_metadata(check_checkpoint_dir(found)).get("global_step")
            rank_zero_info(f"ultrascale: --ckpt_path auto: resuming from {found} (global step {step})")


def _knobs(cls: type) -> list[str]:
    """The keyword arguments `cls(...)` takes, following `**knobs` up to the base class that names them."""
    import inspect

    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())
        names += [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


class RecipeError(ValueError):
    """An argument of the recipe's objects that their constructors refuse."""


def describe_argument_error(error: Exception) -> str:
    """jsonargparse's error, with a close knob named when a strategy (or another class) is given one it lacks."""
    import difflib
    import importlib
    import re

    from lightning.pytorch.strategies import StrategyRegistry

    text = str(error)
    by_name = re.search(r"Expected a dot import path string: (\w+).*NestedArg\(key='([\w.]+)'", text, flags=re.DOTALL)
    if by_name is not None and by_name.group(1) in StrategyRegistry:
        name, option = by_name.groups()
        cls = StrategyRegistry[name]["strategy"]
        knobs = _knobs(cls)
        close = difflib.get_close_matches(option, knobs, n=1)
        hint = "" if option in knobs else (f" (did you mean `{close[0]}`?)" if close else f" (its knobs: {', '.join(knobs)})")
        return (f"`{option}`{hint}: the recipe names its strategy by its registered name `{name}`, which takes no knobs; "
                f"give it as `class_path: {cls.__module__.split('.')[0]}.{cls.__name__}` with `init_args` to set them")
    unknown = re.search(r"class_path '([\w.]+)':\s+Option '([\w.]+)' is not accepted", text)
    if unknown is None:
        choice = re.search(r'Parser key "([\w.]+)":\s+Expected a typing.Literal\[(.*?)\]\. Got value: (\S+)', text)
        if choice is not None:
            key, choices, value = choice.groups()
            return f"`{key}={value}`: choose one of {choices}"
        # A constructor's own error inside jsonargparse's list of the union's subtypes ("- Expected a <class ...>").
        refusals = [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")
                    and not line.strip().startswith(("- Expected a", "- Problem with given class_path"))]
        return refusals[0] if refusals else text.strip()
    class_path, option = unknown.groups()
    try:
        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        knobs = _knobs(cls)
    except Exception:  # noqa: BLE001 - no suggestion then
        return text.strip()
    close = difflib.get_close_matches(option, knobs, n=1)
    hint = f"did you mean `{close[0]}`?" if close else f"its knobs: {', '.join(knobs)}"
    return f"`{option}` is not a knob of {name} ({class_path}); {hint}"


@contextlib.contextmanager
def known_noise_quieted() -> Iterator[None]:
    """Drop, while the block runs, messages that say nothing about the user's run (every rank runs the command):

    - Lightning 2.6 calls torch's deprecated pytree `LeafSpec` on every step of every rank;
    - torchao (imported by transformers and the FP8 callback) logs "Failed to load" for each of
      its CUDA-only kernels on a machine without CUDA, and torch logs that its Enum registrations
      are deprecated;
    - every rank but 0 repeats rank 0's "Seed set to N" (as "[rank: r] Seed set to N"), and
      Lightning advertises a cloud logger on every run.

    The filters go when the block ends, also on an error: a command run in a process that does other work
    (`ultrascale.cli.main` called from Python, tests) leaves its warning and logging filters as it found them."""
    import logging
    import warnings

    import torch

    kept = {
        "torch.utils._pytree": lambda record: "register_constant() on Enum subclasses is deprecated" not in record.getMessage(),
        "lightning.fabric.utilities.seed": lambda record: not record.getMessage().startswith("[rank: "),
        "lightning.pytorch.utilities.rank_zero": lambda record: "litlogger" not in record.getMessage(),
    }
    if not torch.cuda.is_available():
        kept["torchao"] = lambda record: not record.getMessage().startswith("Failed to load")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
        for name, keep in kept.items():
            logging.getLogger(name).addFilter(keep)
        try:
            yield
        finally:
            for name, keep in kept.items():
                logging.getLogger(name).removeFilter(keep)
