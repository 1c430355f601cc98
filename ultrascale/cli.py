"""The `ultrascale` command: LightningCLI with ultrascale's strategies registered.

    ultrascale fit --config recipes/tiny_cpu.yaml
    ultrascale fit --config recipes/tiny_cpu.yaml --trainer.devices 4 --trainer.strategy ultrascale_hsdp
    ultrascale export-hf --checkpoint runs/.../last.ckpt --out my_hf_model
    ultrascale plan --preset llama3_70b --gpus 256 --gpu h100 --seq-len 8192 --global-batch-tokens 4M
    ultrascale plan --recipe recipes/llama3_70b.yaml      # check a recipe's layout on the meta device, price it
    ultrascale verify --config recipes/tiny_cpu_2d.yaml   # its layout against one device, step by step

Any LightningModule / LightningDataModule can be named with `class_path`; the recipes
use `ultrascale.models.LlamaLM` and `ultrascale.data.CausalLMDataModule`.
"""

from __future__ import annotations

import os
import sys
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
        self._check_layout_fits_the_world()
        self._restore_interrupted_last()
        self._resolve_auto_resume()
        self._verify_given_checkpoint()
        self._say_where_outputs_go()

    before_validate = before_test = before_predict = before_fit

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


def export_hf_main(args: list[str]) -> None:
    import argparse

    from ultrascale.models.hf import export_hf_checkpoint

    parser = argparse.ArgumentParser(
        prog="ultrascale export-hf",
        description="Write an HFCausalLM training checkpoint (any layout) as a Hugging Face folder: "
        "sharded safetensors, config.json, generation config and the tokenizer files.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="an ultrascale checkpoint directory (e.g. .../last.ckpt), or a run directory (runs/NAME, "
                        "runs/NAME/version_N, or its checkpoints/ folder): its newest complete checkpoint is exported")
    parser.add_argument("--out", required=True, help="folder to write (loadable with from_pretrained)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out folder (never the model's source folder)")
    options = parser.parse_args(args)
    try:
        checkpoint = resolve_checkpoint(options.checkpoint)
        if str(checkpoint) != str(options.checkpoint):
            print(f"exporting {checkpoint} (the newest complete checkpoint under {options.checkpoint})")
        out = export_hf_checkpoint(checkpoint, options.out, options.max_shard_size, overwrite=options.overwrite)
    except (FileNotFoundError, ValueError) as error:  # a wrong path or a checkpoint of another model: say so
        print(f"ultrascale export-hf: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


def resolve_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint directory, else the newest complete checkpoint of the run directory
    `path` (itself, `checkpoints/`, `version_*/checkpoints/`); errors say what exists instead."""
    from pathlib import Path

    from ultrascale.parallel.checkpoint import DCP_METADATA_FILE, latest_checkpoint

    given = Path(path)
    if (given / DCP_METADATA_FILE).is_file() or (not given.exists() and given.name.endswith(".ckpt")):
        return path  # a checkpoint (or a missing one, whose error check_checkpoint_dir words, `.old` fallback included)
    if not given.is_dir():
        parent = next((p for p in given.parents if p.is_dir()), Path("."))
        entries = sorted(e.name + ("/" if e.is_dir() else "") for e in parent.iterdir())[:20]
        raise FileNotFoundError(f"{given} does not exist; {parent}/ holds: {', '.join(entries) or '(nothing)'}")
    folders = [given, given / "checkpoints", *sorted(given.glob("version_*/checkpoints")), *sorted(given.glob("*/checkpoints"))]
    found = latest_checkpoint(folders)
    if found is None:
        entries = sorted(e.name + ("/" if e.is_dir() else "") for e in given.iterdir())[:20]
        raise ValueError(f"no complete ultrascale checkpoint in {given} or its checkpoints folders; it holds: "
                         f"{', '.join(entries) or '(nothing)'}")
    return str(found)


SUBCOMMANDS_HELP = """usage: ultrascale SUBCOMMAND [options]     (`ultrascale SUBCOMMAND --help` for its options)

train and evaluate (LightningCLI, with ultrascale's strategies registered):
  fit          train: ultrascale fit --config recipes/tiny_cpu.yaml [--ckpt_path auto|last|PATH]
  validate     run the validation loop of a model and checkpoint
  test         run the test loop
  predict      run the predict loop

ultrascale's own:
  plan         rank the layouts for a model on a cluster, explain one, or check a recipe (--recipe)
  export-hf    write an HFCausalLM training checkpoint as a Hugging Face folder (safetensors)
  checkpoint   verify checkpoints against their manifests: ultrascale checkpoint verify PATH...
  verify       train a recipe a few steps under its layout and on one device, compare loss and gradient norm
  verify-matrix  the same for every named layout at one world size: a Markdown table (parity, tokens/s, memory)
  prepare-data tokenize a corpus once (text, JSONL, Parquet, a saved dataset) into a folder every rank
               memory-maps: ultrascale prepare-data --tokenizer DIR --out DIR [--workers N] INPUT...
"""


_quieted = False


def quiet_known_noise() -> None:
    """Drop messages that say nothing about the user's run, on every rank (each runs this CLI):

    - Lightning 2.6 calls torch's deprecated pytree `LeafSpec` on every step of every rank;
    - torchao (imported by transformers and the FP8 callback) logs "Failed to load" for each of
      its CUDA-only kernels on a machine without CUDA, and torch logs that its Enum registrations
      are deprecated;
    - every rank but 0 repeats rank 0's "Seed set to N" (as "[rank: r] Seed set to N"), and
      Lightning advertises a cloud logger on every run.
    """
    global _quieted
    if _quieted:  # main() runs more than once in a process (tests): the filters are added once
        return
    _quieted = True
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    if not torch.cuda.is_available():
        logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "register_constant() on Enum subclasses is deprecated" not in record.getMessage()
    )
    logging.getLogger("lightning.fabric.utilities.seed").addFilter(
        lambda record: not record.getMessage().startswith("[rank: ")
    )
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: "litlogger" not in record.getMessage())


def prepare_data_main(args: list[str]) -> None:
    """`ultrascale prepare-data`: argument parsing around `ultrascale.data.prepared.prepare_data`."""
    import argparse

    from ultrascale.data.prepared import prepare_data

    parser = argparse.ArgumentParser(
        prog="ultrascale prepare-data",
        description="Tokenize a corpus once into a folder that CausalLMDataModule(data_path=FOLDER) memory-maps on "
                    "every rank: text files (one document each), JSONL and Parquet (a field per record), folders of "
                    "them, or a `datasets` dataset saved with save_to_disk.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("--tokenizer", required=True, help="local folder of a Hugging Face tokenizer")
    parser.add_argument("--out", required=True, help="folder to write (written beside it, renamed when complete)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument("--text-field", default="text", help="JSONL / Parquet / dataset field with the text")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--strict", action="store_true",
                        help="refuse bytes that are not UTF-8 (default: replace them with U+FFFD and count them)")
    options = parser.parse_args(args)
    try:
        out = prepare_data(options.inputs, options.tokenizer, options.out, workers=options.workers,
                           text_field=options.text_field, overwrite=options.overwrite, progress=not options.no_progress,
                           strict=options.strict)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"ultrascale prepare-data: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    import json

    metadata = json.loads((out / "metadata.json").read_text())
    print(f"wrote {out}: {metadata['num_tokens']:,} tokens ({metadata['dtype']}), {metadata['num_documents']:,} documents "
          f"in {_duration_and_rate(metadata['seconds'], metadata['num_tokens'])}, {metadata['workers']} worker(s)")
    if metadata["replaced_bytes"]:
        print(f"ultrascale prepare-data: {metadata['replaced_bytes']:,} bytes that are not UTF-8, in "
              f"{metadata['documents_with_replaced_bytes']:,} document(s), were replaced by U+FFFD (--strict refuses them)")


def _duration_and_rate(seconds: float, tokens: int) -> str:
    """"12.3 s (45,600 tokens/s)"; a run too short to time gives no rate (a rate over a few ms says nothing)."""
    if seconds < 0.5:
        return f"{seconds * 1e3:.0f} ms (too short to give a rate)"
    return f"{seconds:.1f} s ({tokens / seconds:,.0f} tokens/s)"


def main(args: list[str] | None = None) -> None:
    quiet_known_noise()
    given = args
    args = list(args if args is not None else sys.argv[1:])
    if not args or args[0] in ("-h", "--help"):
        print(SUBCOMMANDS_HELP)
        return
    if args and args[0] == "export-hf":
        export_hf_main(args[1:])
        return
    if args and args[0] == "prepare-data":
        prepare_data_main(args[1:])
        return
    if args and args[0] == "verify":
        from ultrascale.verify.app import verify_main

        verify_main(args[1:])
        return
    if args and args[0] == "verify-matrix":
        from ultrascale.verify.matrix import matrix_main

        matrix_main(args[1:])
        return
    if args and args[0] == "plan":
        from ultrascale.planner.app import plan_main

        try:
            plan_main(args[1:])
        except ValueError as error:  # an impossible layout: say why, no traceback
            print(f"ultrascale plan: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    if args and args[0] == "checkpoint":
        checkpoint_main(args[1:])
        return
    import argparse

    from ultrascale.parallel.manifest import CheckpointDamaged
    from ultrascale.parallel.rules import LayoutError, LayoutNotImplemented

    try:
        # LightningCLI reads sys.argv itself; handing it the same list as `args` makes it warn on every call.
        UltraScaleCLI(args=given)
    except argparse.ArgumentError as error:  # the recipe or the command line: a knob that does not exist, a bad value
        print(f"ultrascale {args[0]}: error: {describe_argument_error(error)}", file=sys.stderr)
        raise SystemExit(2) from None
    except (RecipeError, LayoutError, LayoutNotImplemented, CheckpointDamaged) as error:
        # A layout the rules refuse (before launch, or on every rank at setup), a wrong or damaged checkpoint,
        # a missing file: one message, no traceback (`ULTRASCALE_DEBUG=1` shows it).
        if os.environ.get("ULTRASCALE_DEBUG"):
            raise
        print(f"ultrascale {args[0]}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


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


def checkpoint_main(args: list[str]) -> None:
    """`ultrascale checkpoint verify PATH...`: each checkpoint against its manifest; exit status 1 if any is damaged."""
    import argparse

    from ultrascale.parallel.checkpoint import check_checkpoint_dir
    from ultrascale.parallel.manifest import MANIFEST_FILE, VERIFY_LEVELS, damage_message, verify_checkpoint

    parser = argparse.ArgumentParser(prog="ultrascale checkpoint", description="Operate on ultrascale checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check checkpoint directories against the manifest their save wrote")
    verify.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint directories (e.g. runs/x/checkpoints/last.ckpt)")
    verify.add_argument("--level", choices=VERIFY_LEVELS, default="checksum",
                        help="checksum (sizes and CRC-32 of every file, the default) or size (a stat per file)")
    options = parser.parse_args(args)
    damaged = 0
    for given in options.paths:
        try:
            path = check_checkpoint_dir(given)
        except (FileNotFoundError, ValueError) as error:
            print(f"{given}: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        problems = verify_checkpoint(path, options.level)
        if problems:
            damaged += 1
            print(f"{path}: DAMAGED: {damage_message(path, problems)}")
        else:
            legacy = f" (no {MANIFEST_FILE}: saved before manifests; sizes checked against DCP's index)"
            how = "" if (path / MANIFEST_FILE).is_file() else legacy
            print(f"{path}: ok{how}")
    if damaged:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
