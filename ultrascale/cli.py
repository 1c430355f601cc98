"""The `ultrascale` command: LightningCLI with ultrascale's strategies registered.

    ultrascale fit --config recipes/tiny_cpu.yaml
    ultrascale fit --config recipes/tiny_cpu.yaml --trainer.devices 4 --trainer.strategy ultrascale_hsdp
    ultrascale export-hf --checkpoint runs/.../last.ckpt --out my_hf_model

Any LightningModule / LightningDataModule can be named with `class_path`; the recipes
use `ultrascale.models.llama.LlamaLM` and `ultrascale.data.CausalLMDataModule`.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI

import ultrascale  # noqa: F401  (registers the strategies by name)

TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "ultrascale"},
    },
    "enable_progress_bar": True,
}


class UltraScaleCLI(LightningCLI):
    """LightningCLI with TensorBoard logging and a progress bar by default."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        super().__init__(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults={**TRAINER_DEFAULTS, **kwargs.pop("trainer_defaults", {})},
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            **kwargs,
        )


def export_hf_main(args: list[str]) -> None:
    import argparse

    from ultrascale.models.hf import export_hf_checkpoint

    parser = argparse.ArgumentParser(
        prog="ultrascale export-hf",
        description="Write an HFCausalLM training checkpoint (any layout) as a Hugging Face folder: "
        "sharded safetensors, config.json, generation config and the tokenizer files.",
    )
    parser.add_argument("--checkpoint", required=True, help="ultrascale checkpoint directory (e.g. .../last.ckpt)")
    parser.add_argument("--out", required=True, help="folder to write (loadable with from_pretrained)")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    options = parser.parse_args(args)
    out = export_hf_checkpoint(options.checkpoint, options.out, options.max_shard_size)
    print(f"wrote {out}")


def main(args: list[str] | None = None) -> None:
    args = list(args if args is not None else sys.argv[1:])
    if args and args[0] == "export-hf":
        export_hf_main(args[1:])
        return
    UltraScaleCLI(args=args)


if __name__ == "__main__":
    main()
