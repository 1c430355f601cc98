"""The `ultrascale` command: LightningCLI with ultrascale's strategies registered.

    ultrascale fit --config recipes/tiny_cpu.yaml
    ultrascale fit --config recipes/tiny_cpu.yaml --trainer.devices 4 --trainer.strategy ultrascale_hsdp
    ultrascale export-hf --checkpoint runs/.../last.ckpt --out my_hf_model
    ultrascale plan --preset llama3_70b --gpus 256 --gpu h100 --seq-len 8192 --global-batch-tokens 4M

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


def _token_count(text: str) -> int:
    """argparse type: "4M", "512K", "4194304" -> tokens."""
    import argparse

    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4M, 512K, 1048576)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def plan_main(args: list[str]) -> str:
    """`ultrascale plan`: which layout for this model on these GPUs? Every layout ultrascale can run is
    costed (memory per GPU, step time, MFU) and ranked, before any GPU is used. Exits 1 when
    nothing fits (or the given layout does not), saying what would."""
    import argparse
    import json

    from ultrascale import planner
    from ultrascale.estimate import ModelShape
    from ultrascale.models.llama import LLAMA_PRESETS, LlamaConfig
    from ultrascale.parallel.dims import ParallelDims
    from ultrascale.parallel.tensor import check_tp_divides

    parser = argparse.ArgumentParser(prog="ultrascale plan", description=plan_main.__doc__)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(LLAMA_PRESETS), help="built-in Llama preset")
    model.add_argument("--hf-config", help="Hugging Face checkpoint folder (only config.json is read)")
    parser.add_argument("--gpus", "--world", dest="gpus", type=_positive(int), required=True, help="number of GPUs (ranks)")
    parser.add_argument("--gpu", default="h100", choices=sorted(planner.GPU_SPECS), help="GPU kind (default h100)")
    parser.add_argument("--gpus-per-node", type=_positive(int), default=8)
    parser.add_argument("--seq-len", type=_positive(int), default=4096)
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", type=_token_count, help="tokens per optimizer step, e.g. 4M (default: one sequence per GPU)")
    batch.add_argument("--global-batch", type=_positive(int), help="sequences per optimizer step")
    parser.add_argument("--precision", default="bf16-mixed", choices=("32-true", "bf16-mixed", "bf16-true"))
    parser.add_argument("--layout", default="", help='fix some or all of the layout, e.g. "pp=4,dp_shard=8,tp=8,zero_stage=1"')
    parser.add_argument("--why-not", default=None, metavar="LAYOUT", help='explain why no layout with these values is chosen, e.g. "tp=16"')
    parser.add_argument("--top", type=_positive(int), default=10, help="rows of the ranked table (default 10)")
    parser.add_argument("--json", action="store_true", help="print the ranked rows as JSON (a list of objects)")
    parser.add_argument("--emit-recipe", default=None, metavar="PATH", help="write the best layout as a LightningCLI recipe")
    parser.add_argument("--measure", action="store_true",
                        help="also build the model under FakeTensorMode at the real world size and measure the best layout's peak memory")
    # Single-degree options of the first `plan` (kept: each fixes that value of the layout).
    parser.add_argument("--dp-replicate", type=_positive(int), default=None)
    parser.add_argument("--tp", type=_positive(int), default=None)
    parser.add_argument("--zero-stage", type=int, default=None, choices=(1, 2, 3))
    parser.add_argument("--micro-batch", type=_positive(int), default=None)
    parser.add_argument("--recompute", default=None, choices=planner.RECOMPUTE_MODES)
    parser.add_argument("--full-recompute", action="store_true", help="same as --recompute full")
    parser.add_argument("--eager-attention", action="store_true",
                        help="attention keeps its s x s scores (no flash / fused kernel)")
    parser.add_argument("--device-memory-gib", type=_positive(float), default=None, help="memory of one GPU (default: the GPU's)")
    parser.add_argument("--peak-tflops", type=_positive(float), default=None, help="dense bf16 peak of one GPU (default: the GPU's)")
    parser.add_argument("--intra-node-gbps", type=_positive(float), default=None,
                        help="GB/s per GPU inside a node (default: the GPU's NVLink figure)")
    parser.add_argument("--inter-node-gbps", type=_positive(float), default=None,
                        help="GB/s per GPU between nodes (default: one 400 Gb/s NIC per GPU)")
    parser.add_argument("--efficiency", type=_positive(float), default=None,
                        help=f"fraction of the peak the matmuls reach (default {planner.Cluster.efficiency})")
    options = parser.parse_args(args)

    fixed = planner.parse_layout(options.layout)
    for key, value in (("dp_replicate", options.dp_replicate), ("tp", options.tp), ("zero_stage", options.zero_stage),
                       ("micro_batch", options.micro_batch),
                       ("recompute", "full" if options.full_recompute else options.recompute)):
        if value is not None:
            fixed[key] = value
    hf_config = None
    if options.preset:
        shape = ModelShape.from_llama_config(LlamaConfig.from_preset(options.preset), name=f"Llama {options.preset}")
        model_spec = options.preset
    else:
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(options.hf_config, local_files_only=True)
        hf_config = getattr(hf_config, "text_config", None) or hf_config
        shape = ModelShape.from_hf_config(hf_config)
        model_spec = options.hf_config
    degrees = {key: fixed[key] for key in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") if key in fixed}
    if degrees:  # the strategy's own checks first, with its messages
        ParallelDims.resolve(options.gpus, **{"dp_shard": -1, **degrees} if "dp_shard" not in degrees else degrees)
        if degrees.get("tp", 1) > 1:
            check_tp_divides(degrees["tp"], {"n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads,
                                             "ffn_hidden_dim": shape.ffn_hidden, "vocab_size": shape.vocab}, shape.name)
    spec = planner.GPU_SPECS[options.gpu]
    overrides = {"memory_gib": options.device_memory_gib, "peak_tflops": options.peak_tflops,
                 "intra_node_gbps": options.intra_node_gbps, "inter_node_gbps": options.inter_node_gbps}
    if any(overrides.values()):
        import dataclasses

        spec = dataclasses.replace(spec, **{key: value for key, value in overrides.items() if value})
    cluster = planner.Cluster(spec, options.gpus, options.gpus_per_node,
                              **({"efficiency": options.efficiency} if options.efficiency else {}))
    if options.global_batch_tokens:
        global_batch = max(options.global_batch_tokens // options.seq_len, 1)
    else:
        global_batch = options.global_batch or options.gpus
    work = planner.Workload(options.seq_len, global_batch, options.precision, attention_scores_saved=options.eager_attention)

    if options.why_not is not None:
        reasons = planner.why_not(shape, cluster, work, {**fixed, **planner.parse_layout(options.why_not)}, hf_config)
        text = "\n".join([f"why not {options.why_not}:"] + [f"  - {reason}" for reason in reasons])
        print(text)
        return text

    rows = planner.search(shape, cluster, work, fixed, hf_config)
    fitting = [row for row in rows if row.fits]
    if options.json:
        print(json.dumps([row.to_json() for row in (fitting or rows)[: options.top]], indent=1))
    searched = planner.describe_search(shape, fixed)
    lines = [
        f"model      {shape.name}: {shape.num_params / 1e9:.2f}B parameters, "
        f"{shape.flops_per_token(options.seq_len) / 1e9:.1f} GFLOPs per token (6N + 12·L·h·s)",
        f"cluster    {options.gpus} x {spec.name} ({options.gpus_per_node} per node), {spec.memory_gib:g} GiB each "
        f"({cluster.memory_headroom:.0%} planned for), peak {spec.peak_tflops:g} TFLOP/s at {cluster.efficiency:.0%} achievable",
        f"batch      {global_batch} sequences x {options.seq_len} tokens = {work.tokens:,} tokens per step; {options.precision}",
        f"searched   {searched}",
    ]
    best = fitting[0] if fitting else None
    if best is not None:
        lines += ["", planner.format_table(fitting, options.top), "", "best       " + best.layout.describe()]
        lines += planner.explain(best, cluster)
    else:
        lines += ["", "nothing fits:"] + [f"  - {reason}" for reason in planner.why_not(shape, cluster, work, fixed, hf_config)]
        if rows:
            closest = min(rows, key=lambda row: row.memory["total"])
            lines += [f"closest    {closest.layout.describe()}"] + planner.explain(closest, cluster)
        lines += planner.what_would_fit(shape, cluster, work, fixed, hf_config)
    if best is not None and options.measure:
        from ultrascale.measure import measure_layout

        lay = best.layout
        try:
            measured = measure_layout(
                model_spec, world=options.gpus, pp=lay.pp, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, cp=lay.cp,
                tp=lay.tp, ep=lay.ep, zero_stage=lay.zero_stage, precision=options.precision, seq_len=options.seq_len,
                micro_batch=lay.micro_batch, recompute=lay.recompute,
                pipeline_microbatches=lay.grad_accumulation if lay.pp > 1 else None,
            )
        except NotImplementedError as error:
            lines.append(f"measured   not measured: {error}")
        else:
            predicted = best.memory["total"] / planner.GIB
            parts = " + ".join(f"{key} {value:.2f}" for key, value in measured["breakdown_gib"].items())
            lines.append(
                f"measured   peak {measured['peak_gib']:.2f} GiB on rank 0 ({parts}; {measured['tracker']} under "
                f"FakeTensorMode, {measured['seconds']:.0f} s) vs predicted {predicted:.2f} GiB: "
                f"predicted/measured {predicted / measured['peak_gib']:.2f}"
            )
    if best is not None and options.emit_recipe:
        from pathlib import Path

        Path(options.emit_recipe).write_text(planner.recipe_yaml(best, model_spec, shape, cluster, work))
        lines.append(f"recipe     wrote {options.emit_recipe}")
    text = "\n".join(lines)
    if not options.json:
        print(text)
    if best is None:
        raise SystemExit(1)
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
