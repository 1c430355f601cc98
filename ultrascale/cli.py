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
from collections.abc import Callable

from ultrascale.recipe_cli import RecipeError, UltraScaleCLI, describe_argument_error, known_noise_quieted

__all__ = ["RecipeError", "UltraScaleCLI", "describe_argument_error", "main"]

def export_hf_main(args: list[str]) -> None:
    import argparse

    from ultrascale.models.hf import export_hf_checkpoint

    parser = argparse.ArgumentParser(
        prog="ultrascale export-hf",
        description="Write an HFCausalLM or LlamaLM training checkpoint (any layout) as a Hugging Face folder: "
        "sharded safetensors, config.json, generation config and the tokenizer files (a LlamaLM becomes a "
        "LlamaForCausalLM).",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="an ultrascale checkpoint directory (e.g. .../last.ckpt), or a run directory (runs/NAME, "
                        "runs/NAME/version_N, or its checkpoints/ folder): its newest complete checkpoint is exported")
    parser.add_argument("--out", required=True, help="folder to write (loadable with from_pretrained)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    parser.add_argument("--tokenizer", default=None,
                        help="LlamaLM only: the tokenizer to write, a Hugging Face tokenizer folder or `bytes` "
                        "(ByteTokenizer); default: the one the checkpoint's data module names")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out folder (never the model's source folder)")
    options = parser.parse_args(args)
    try:
        checkpoint = resolve_checkpoint(options.checkpoint)
        if str(checkpoint) != str(options.checkpoint):
            print(f"exporting {checkpoint} (the newest complete checkpoint under {options.checkpoint})")
        out = export_hf_checkpoint(checkpoint, options.out, options.max_shard_size, overwrite=options.overwrite,
                                   tokenizer=options.tokenizer)
    except (FileNotFoundError, ValueError, NotImplementedError) as error:  # a wrong path or a checkpoint of another model: say so
        print(f"ultrascale export-hf: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


def resolve_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint directory, else the newest complete checkpoint of the run directory
    `path` (itself, `checkpoints/`, `version_*/checkpoints/`); errors say what exists instead."""
    from pathlib import Path

    from ultrascale.parallel.checkpoint import latest_checkpoint
    from ultrascale.parallel.manifest import DCP_METADATA_FILE

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


LIGHTNING_SUBCOMMANDS: dict[str, str] = {
    "fit": "train: ultrascale fit --config recipes/tiny_cpu.yaml [--ckpt_path auto|last|PATH]",
    "validate": "run the validation loop of a model and checkpoint",
    "test": "run the test loop",
    "predict": "run the predict loop",
}
"""LightningCLI's subcommands (ultrascale's strategies registered): name -> what `--help` says."""

OWN_SUBCOMMANDS: dict[str, str] = {
    "plan": "rank the layouts for a model on a cluster, explain one, or check a recipe (--recipe)",
    "export-hf": "write an HFCausalLM or LlamaLM training checkpoint as a Hugging Face folder (safetensors)",
    "checkpoint": "verify checkpoints against their manifests: ultrascale checkpoint verify PATH...",
    "verify": "train a recipe a few steps under its layout and on one device, compare loss and gradient norm",
    "verify-matrix": "the same for every named layout at one world size: a Markdown table (parity, tokens/s, memory)",
    "tune": "run the planner's best layouts for a recipe a few steps each: predicted and measured tokens/s, MFU, memory",
    "prepare-data": "tokenize a corpus once (text, JSONL, Parquet, a saved dataset) into a folder every rank "
                    "memory-maps: ultrascale prepare-data --tokenizer DIR --out DIR [--workers N] INPUT...",
}
"""ultrascale's own subcommands: name -> what `--help` says. `_main` dispatches exactly these (`_own_command`)."""


def _subcommands_help() -> str:
    width = max(map(len, [*LIGHTNING_SUBCOMMANDS, *OWN_SUBCOMMANDS])) + 2
    lines = ["usage: ultrascale SUBCOMMAND [options]     (`ultrascale SUBCOMMAND --help` for its options)", "",
             "train and evaluate (LightningCLI, with ultrascale's strategies registered):"]
    lines += [f"  {name:<{width}}{what}" for name, what in LIGHTNING_SUBCOMMANDS.items()]
    lines += ["", "ultrascale's own:"]
    lines += [f"  {name:<{width}}{what}" for name, what in OWN_SUBCOMMANDS.items()]
    lines += ["", "--debug (any subcommand; or ULTRASCALE_DEBUG=1): a traceback for the one-line errors too"]
    return "\n".join(lines) + "\n"


def prepare_data_main(args: list[str]) -> None:
    """`ultrascale prepare-data`: argument parsing around `ultrascale.data.prepared.prepare_data`."""
    import argparse

    from ultrascale.data.prepared import prepare_chat_data, prepare_data

    parser = argparse.ArgumentParser(
        prog="ultrascale prepare-data",
        description="Tokenize a corpus once into a folder that CausalLMDataModule(data_path=FOLDER) memory-maps on "
                    "every rank: text files (one document each), JSONL and Parquet (a field per record), folders of "
                    "them, or a `datasets` dataset saved with save_to_disk. With --chat: conversations rendered with "
                    "the chat template, their assistant turns marked, for InstructionDataModule(data_path=FOLDER).")
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("--tokenizer", required=True, help="local folder of a Hugging Face tokenizer")
    parser.add_argument("--out", required=True, help="folder to write (written beside it, renamed when complete)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument("--text-field", default="text", help="JSONL / Parquet / dataset field with the text")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--strict", action="store_true",
                        help="refuse bytes that are not UTF-8 (default: replace them with U+FFFD and count them)")
    parser.add_argument("--chat", action="store_true",
                        help="the records are conversations (`messages`, or prompt/completion message lists)")
    parser.add_argument("--messages-field", default="messages", help="with --chat: the field holding the messages")
    parser.add_argument("--chat-template", default=None,
                        help="with --chat: the Jinja template (text or file); default: the tokenizer's own")
    parser.add_argument("--end-of-turn", default=None, help="with --chat: the end-of-turn token; default: the EOS")
    options = parser.parse_args(args)
    try:
        if options.chat:
            out = prepare_chat_data(options.inputs, options.tokenizer, options.out, chat_template=options.chat_template,
                                    messages_field=options.messages_field, end_of_turn=options.end_of_turn,
                                    workers=options.workers, overwrite=options.overwrite,
                                    progress=not options.no_progress)
        else:
            out = prepare_data(options.inputs, options.tokenizer, options.out, workers=options.workers,
                               text_field=options.text_field, overwrite=options.overwrite,
                               progress=not options.no_progress, strict=options.strict)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"ultrascale prepare-data: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    import json

    metadata = json.loads((out / "metadata.json").read_text())
    unit = "conversations" if metadata.get("kind") == "chat" else "documents"
    print(f"wrote {out}: {metadata['num_tokens']:,} tokens ({metadata['dtype']}), {metadata['num_documents']:,} {unit} "
          f"in {_duration_and_rate(metadata['seconds'], metadata['num_tokens'])}, {metadata['workers']} worker(s)")
    if metadata.get("replaced_bytes"):
        print(f"ultrascale prepare-data: {metadata['replaced_bytes']:,} bytes that are not UTF-8, in "
              f"{metadata['documents_with_replaced_bytes']:,} document(s), were replaced by U+FFFD (--strict refuses them)")


def _duration_and_rate(seconds: float, tokens: int) -> str:
    """"12.3 s (45,600 tokens/s)"; a run too short to time gives no rate (a rate over a few ms says nothing)."""
    if seconds < 0.5:
        return f"{seconds * 1e3:.0f} ms (too short to give a rate)"
    return f"{seconds:.1f} s ({tokens / seconds:,.0f} tokens/s)"


def main(args: list[str] | None = None) -> None:
    from ultrascale import user_errors

    debug = os.environ.get(user_errors.DEBUG_VARIABLE)
    try:
        with known_noise_quieted():
            _main(args)
    finally:
        # Called in-process (tests, a notebook), the caller gets its process back: no command named (a later
        # Python fit raises a child's error rather than exiting), --debug's variable as it was.
        user_errors.set_command(None)
        if debug is None:
            os.environ.pop(user_errors.DEBUG_VARIABLE, None)
        else:
            os.environ[user_errors.DEBUG_VARIABLE] = debug


def _main(args: list[str] | None) -> None:
    from ultrascale import user_errors

    given = args
    args = list(args if args is not None else sys.argv[1:])
    if "--debug" in args:  # every traceback in full, user errors' too (as ULTRASCALE_DEBUG=1)
        args.remove("--debug")
        if given is None:
            sys.argv = [sys.argv[0], *args]  # the script launcher re-runs sys.argv for every other rank
        else:
            given = args
        os.environ[user_errors.DEBUG_VARIABLE] = "1"
    if not args or args[0] in ("-h", "--help"):
        print(_subcommands_help())
        return
    user_errors.set_command(f"ultrascale {args[0]}")
    if args[0] in OWN_SUBCOMMANDS:
        _own_command(args[0])(args[1:])
        return
    import argparse

    try:
        # LightningCLI reads sys.argv itself; handing it the same list as `args` makes it warn on every call.
        UltraScaleCLI(args=given)
    except argparse.ArgumentError as error:  # the recipe or the command line: a knob that does not exist, a bad value
        print(f"ultrascale {args[0]}: error: {describe_argument_error(error)}", file=sys.stderr)
        raise SystemExit(2) from None
    except (RecipeError, *user_errors.user_error_types()) as error:
        # A mistake in the data, a layout the rules refuse (before launch, or on a rank at setup), a wrong or damaged
        # checkpoint, a missing file: one message from whichever rank found it first, no traceback (`--debug` or
        # ULTRASCALE_DEBUG=1 shows it), nothing left behind (ultrascale/user_errors.py).
        if user_errors.debugging():
            raise
        if not user_errors.leave_for_launcher(error):  # a child rank leaves it to rank 0
            user_errors.report(str(error))
        raise SystemExit(user_errors.USER_ERROR_EXIT) from None


def _own_command(name: str) -> Callable[[list[str]], None]:
    """The function behind each of `OWN_SUBCOMMANDS` (imported when called: `ultrascale --help` stays fast)."""
    if name == "verify":
        from ultrascale.verify.app import verify_main

        return verify_main
    if name == "verify-matrix":
        from ultrascale.verify.matrix import matrix_main

        return matrix_main
    if name == "tune":
        from ultrascale.verify.tune import tune_main

        return tune_main
    if name == "plan":
        return _plan_main
    return {"export-hf": export_hf_main, "prepare-data": prepare_data_main, "checkpoint": checkpoint_main}[name]


def _plan_main(args: list[str]) -> None:
    from ultrascale.planner.app import plan_main

    try:
        plan_main(args)
    except ValueError as error:  # an impossible layout: say why, no traceback
        print(f"ultrascale plan: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


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
