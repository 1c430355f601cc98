"""The `ultrascale` command: LightningCLI with ultrascale's strategies registered.

    ultrascale fit --config recipes/tiny_cpu.yaml
    ultrascale fit --config recipes/tiny_cpu.yaml --trainer.devices 4 --trainer.strategy ultrascale_hsdp
    ultrascale export-hf --checkpoint runs/.../last.ckpt --out my_hf_model
    ultrascale plan --preset llama3_8b --world 64 --tp 8 --seq-len 8192 --device-memory-gib 80

Any LightningModule / LightningDataModule can be named with `class_path`; the recipes
use `ultrascale.models.LlamaLM` and `ultrascale.data.CausalLMDataModule`.
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

    def before_fit(self) -> None:
        self._restore_interrupted_last()

    before_validate = before_test = before_predict = before_fit

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
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out folder (never the model's source folder)")
    options = parser.parse_args(args)
    out = export_hf_checkpoint(options.checkpoint, options.out, options.max_shard_size, overwrite=options.overwrite)
    print(f"wrote {out}")


def _positive(kind: type) -> Any:
    """argparse type: a number > 0 of `kind`, else a usage error naming the value."""

    def parse(text: str) -> Any:
        import argparse

        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def plan_main(args: list[str]) -> str:
    """`ultrascale plan`: check a layout against a model and estimate memory per rank, before any GPU is used."""
    import argparse

    import torch

    from ultrascale.estimate import STATE_BYTES, activation_bytes_per_layer, estimate_model_state_bytes, model_flops
    from ultrascale.models.llama import LLAMA_PRESETS, Llama, LlamaConfig
    from ultrascale.parallel.tensor import check_tp_divides
    from ultrascale.parallel.dims import ParallelDims

    parser = argparse.ArgumentParser(prog="ultrascale plan", description=plan_main.__doc__)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(LLAMA_PRESETS), help="built-in Llama preset")
    model.add_argument("--hf-config", help="Hugging Face checkpoint folder (only config.json is read)")
    parser.add_argument("--world", type=_positive(int), required=True, help="number of ranks (GPUs)")
    parser.add_argument("--dp-replicate", type=_positive(int), default=1)
    parser.add_argument("--tp", type=_positive(int), default=1)
    parser.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--precision", default="bf16-mixed", choices=("32-true", "bf16-mixed", "bf16-true"))
    parser.add_argument("--seq-len", type=_positive(int), default=4096)
    parser.add_argument("--micro-batch", type=_positive(int), default=1)
    parser.add_argument("--full-recompute", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--eager-attention", action="store_true",
                        help="attention keeps its s x s scores (no flash / fused kernel)")
    parser.add_argument("--device-memory-gib", type=_positive(float), default=None,
                        help="memory of one device, to say whether it fits")
    options = parser.parse_args(args)
    dims = ParallelDims.resolve(options.world, dp_replicate=options.dp_replicate, dp_shard=-1, tp=options.tp)
    if options.preset:
        config = LlamaConfig.from_preset(options.preset)
        name, layers, hidden, heads = f"Llama {options.preset}", config.n_layers, config.dim, config.n_heads
        sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
                 "ffn_hidden_dim": config.resolved_ffn_hidden_dim, "vocab_size": config.vocab_size}
        with torch.device("meta"):
            meta_model = Llama(config)
        psi = meta_model.num_params()
    else:
        import transformers

        config = transformers.AutoConfig.from_pretrained(options.hf_config, local_files_only=True)
        name, layers, hidden, heads = config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads
        sizes = {"num_attention_heads": heads,
                 "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
                 "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
        with torch.device("meta"):
            meta_model = transformers.AutoModelForCausalLM.from_config(config)
        psi = sum(p.numel() for p in meta_model.parameters())
    flops_model = model_flops(meta_model)
    assert flops_model is not None
    flops = flops_model.per_token(options.seq_len)
    if dims.tp_enabled:
        check_tp_divides(dims.tp, sizes, name)
    weight, grad, optim = STATE_BYTES[(options.precision, "fsdp" if options.zero_stage == 3 else "zero12")]
    state = estimate_model_state_bytes(
        psi, zero_stage=options.zero_stage, shard_degree=dims.dp_shard_cp, model_parallel_degree=dims.tp,
        param_bytes=weight, grad_bytes=grad, optimizer_bytes=optim,
    )
    activations = layers * activation_bytes_per_layer(
        options.seq_len, options.micro_batch, hidden, heads, tp=dims.tp, full_recompute=options.full_recompute,
        attention_scores_saved=options.eager_attention,
    )
    gib = 2**30
    total = state.total + activations
    lines = [
        f"model      {name}: {psi / 1e9:.2f}B parameters, {flops / 1e9:.1f} GFLOPs per token (6N + 12·L·h·s)",
        f"layout     {dims.describe()}; ZeRO-{options.zero_stage}, {options.precision}",
        f"per rank   parameters {state.params / gib:.2f} GiB + gradients {state.grads / gib:.2f} GiB + "
        f"optimizer {state.optimizer / gib:.2f} GiB = model state {state.total / gib:.2f} GiB",
        f"           activations {activations / gib:.2f} GiB (seq {options.seq_len}, micro-batch {options.micro_batch}, "
        f"{'full recompute' if options.full_recompute else 'no recompute'}{', sequence parallel' if dims.tp_enabled else ''})",
        f"           total {total / gib:.2f} GiB",
    ]
    if options.device_memory_gib is not None:
        verdict = "fits" if total <= options.device_memory_gib * gib else "does NOT fit"
        lines.append(f"verdict    {verdict} in {options.device_memory_gib:g} GiB (before buffers, fragmentation, CUDA context)")
    text = "\n".join(lines)
    print(text)
    return text


def main(args: list[str] | None = None) -> None:
    args = list(args if args is not None else sys.argv[1:])
    if args and args[0] == "export-hf":
        export_hf_main(args[1:])
        return
    if args and args[0] == "plan":
        try:
            plan_main(args[1:])
        except ValueError as error:  # an impossible layout: say why, no traceback
            print(f"ultrascale plan: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    UltraScaleCLI(args=args)


if __name__ == "__main__":
    main()
