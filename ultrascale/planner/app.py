"""The application behind `ultrascale plan`: its options, the ranked plan for a model on a cluster
(`plan_main`), and a recipe checked on the meta device and priced (`check_recipe`, `plan_recipe_main`).

`ultrascale.cli` parses the subcommand and dispatches here; the planner's arithmetic lives in the
sibling modules. Imports `ultrascale.cli` (for `UltraScaleCLI`), which imports this module lazily.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L

from ultrascale.estimate import ModelShape
from ultrascale.hardware import COMPILE_SPEEDUP, FLOAT8_SPEEDUP, GIB, GPU_SPECS, Cluster, GpuSpec
from ultrascale.models.adapters import model_shape
from ultrascale.parallel import rules
from ultrascale.parallel.dims import ParallelDims, context_chunks
from ultrascale.parallel.rules import PRECISIONS, LayoutKnobs, batch_problems, choice_problems, raise_first
from ultrascale.planner.cost import PlanRow, Workload, evaluate
from ultrascale.planner.layouts import RECOMPUTE_MODES, Layout, model_facts_of, parse_layout
from ultrascale.planner.recipe import recipe_yaml
from ultrascale.planner.report import compile_assumption, describe_search, explain, format_table, what_would_fit
from ultrascale.planner.search import search, why_not
from ultrascale.recipe_cli import UltraScaleCLI

__all__ = ["RecipePlan", "check_recipe", "format_recipe_plan", "plan_main", "plan_recipe_main"]


def _positive(kind: type) -> Any:
    """argparse type: a number > 0 of `kind`, else a usage error naming the value."""

    def parse(text: str) -> Any:
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
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4M, 512K, 1048576)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def _gpu_spec(options: argparse.Namespace) -> GpuSpec:
    """The `--gpu` kind, with the figures given as flags (`--device-memory-gib`, `--peak-tflops`,
    `--intra-node-gbps`, `--inter-node-gbps`) in place of its own."""
    given = {"memory_gib": options.device_memory_gib, "peak_tflops": options.peak_tflops,
             "intra_node_gbps": options.intra_node_gbps, "inter_node_gbps": options.inter_node_gbps}
    given = {key: value for key, value in given.items() if value}
    spec = GPU_SPECS[options.gpu]
    return dataclasses.replace(spec, **given) if given else spec


def _cluster(spec: GpuSpec, gpus: int, gpus_per_node: int, efficiency: Optional[float]) -> Cluster:
    """The cluster a plan is priced for; `efficiency` (`--efficiency`) None keeps `Cluster`'s default."""
    return Cluster(spec, gpus, gpus_per_node, **({"efficiency": efficiency} if efficiency else {}))


# `plan` options that a recipe fixes itself.
_RECIPE_FIXES = ("seq_len", "global_batch_tokens", "global_batch", "precision", "layout", "why_not", "top", "emit_recipe",
                 "measure", "dp_replicate", "tp", "zero_stage", "micro_batch", "recompute", "full_recompute", "compile",
                 "fp8")


def plan_main(args: list[str]) -> str:
    """`ultrascale plan`: which layout for this model on these GPUs? Every layout ultrascale can run is
    costed (memory per GPU, step time, MFU) and ranked, before any GPU is used. Exits 1 when
    nothing fits (or the given layout does not), saying what would."""
    from ultrascale.models.llama import LLAMA_PRESETS

    parser = argparse.ArgumentParser(prog="ultrascale plan", description=plan_main.__doc__)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(LLAMA_PRESETS), help="built-in Llama preset")
    model.add_argument("--hf-config", help="Hugging Face checkpoint folder (only config.json is read)")
    model.add_argument("--recipe", metavar="YAML",
                       help="check a LightningCLI recipe without running it (model on the meta device, the strategy's "
                            "checks at its world size) and price its layout; LightningCLI overrides may follow, "
                            "e.g. --model.pretrained_path DIR")
    parser.add_argument("--gpus", "--world", dest="gpus", type=_positive(int), default=None,
                        help="number of GPUs (ranks); with --recipe: trainer.num_nodes x trainer.devices")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_SPECS), help="GPU kind (default h100)")
    parser.add_argument("--gpus-per-node", type=_positive(int), default=None,
                        help="default 8; with --recipe: trainer.devices")
    parser.add_argument("--seq-len", type=_positive(int), default=4096)
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", type=_token_count,
                       help="tokens per optimizer step, e.g. 4M (default: one sequence per GPU)")
    batch.add_argument("--global-batch", type=_positive(int), help="sequences per optimizer step")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
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
    parser.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                        help="0: plain data parallel (runs as dp_replicate alone)")
    parser.add_argument("--micro-batch", type=_positive(int), default=None)
    parser.add_argument("--recompute", default=None, choices=RECOMPUTE_MODES)
    parser.add_argument("--full-recompute", action="store_true", help="same as --recompute full")
    parser.add_argument("--eager-attention", action="store_true",
                        help="attention keeps its s x s scores (no flash / fused kernel)")
    parser.add_argument("--compile", action="store_true",
                        help=f"price every layout with each block compiled (the strategies' `compile=True`): compute "
                             f"time / {COMPILE_SPEEDUP:.3f}, torchtitan's published speed-up; with --recipe, the "
                             "strategy's `compile` decides")
    parser.add_argument("--fp8", action="store_true",
                        help=f"price every layout with Float8 matmuls (the `Float8Training` callback), compiled: compute time "
                             f"/ {COMPILE_SPEEDUP:.3f} / {FLOAT8_SPEEDUP:.3f}, torchtitan's published gains; with --recipe, "
                             "its callbacks decide")
    parser.add_argument("--device-memory-gib", type=_positive(float), default=None, help="memory of one GPU (default: the GPU's)")
    parser.add_argument("--peak-tflops", type=_positive(float), default=None, help="dense bf16 peak of one GPU (default: the GPU's)")
    parser.add_argument("--intra-node-gbps", type=_positive(float), default=None,
                        help="GB/s per GPU inside a node (default: the GPU's NVLink figure)")
    parser.add_argument("--inter-node-gbps", type=_positive(float), default=None,
                        help="GB/s per GPU between nodes (default: one 400 Gb/s NIC per GPU)")
    parser.add_argument("--efficiency", type=_positive(float), default=None,
                        help=f"fraction of the peak the matmuls reach (default {Cluster.efficiency})")
    options, unknown = parser.parse_known_args(args)
    if options.recipe:
        # The recipe fixes the layout, batch and precision: a flag that would contradict it is refused.
        # From the raw arguments, not the values: a flag given at its default value contradicts the recipe too.
        fixed_by_recipe = [flag for action in parser._actions if action.dest in _RECIPE_FIXES
                           for flag in action.option_strings if any(a == flag or a.startswith(flag + "=") for a in args)]
        if fixed_by_recipe:
            parser.error(f"{', '.join(fixed_by_recipe)}: with --recipe the layout, batch, precision and compile come from the "
                         "recipe; change it there or override its keys (e.g. --data.seq_len 4096, "
                         "--trainer.strategy.init_args.tensor_parallel 4, --trainer.strategy.init_args.compile true)")
        return plan_recipe_main(options, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if options.gpus is None:
        parser.error("--gpus is required with --preset / --hf-config")
    options.gpus_per_node = options.gpus_per_node or 8

    fixed = parse_layout(options.layout)
    for key, value in (("dp_replicate", options.dp_replicate), ("tp", options.tp), ("zero_stage", options.zero_stage),
                       ("micro_batch", options.micro_batch),
                       ("recompute", "full" if options.full_recompute else options.recompute)):
        if value is not None:
            fixed[key] = value
    model_spec = options.preset or options.hf_config
    shape = model_shape(model_spec)
    hf_config = None if shape.builtin else shape.config
    degrees = {key: fixed[key] for key in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") if key in fixed}
    if degrees:  # degrees that cannot make this world, or split these heads, are usage errors (exit 2)
        knobs = LayoutKnobs(**{"dp_shard": -1, **degrees})
        dims, problems = rules.resolve(knobs, options.gpus)
        if dims is not None and dims.tp_enabled:
            divides = rules.tp_divides_problem(dims.tp, model_facts_of(shape, hf_config).tp_sizes, shape.name)
            problems += [divides] if divides else []
        rules.raise_first(problems)
    cluster = _cluster(_gpu_spec(options), options.gpus, options.gpus_per_node, options.efficiency)
    spec = cluster.gpu
    if options.global_batch_tokens:
        global_batch = max(options.global_batch_tokens // options.seq_len, 1)
    else:
        global_batch = options.global_batch or options.gpus
    work = Workload(options.seq_len, global_batch, options.precision, attention_scores_saved=options.eager_attention,
                    compiled=options.compile or options.fp8, float8=options.fp8)

    if options.why_not is not None:
        reasons = why_not(shape, cluster, work, {**fixed, **parse_layout(options.why_not)}, hf_config)
        text = "\n".join([f"why not {options.why_not}:"] + [f"  - {reason}" for reason in reasons])
        print(text)
        return text

    rows = search(shape, cluster, work, fixed, hf_config)
    fitting = [row for row in rows if row.fits]
    if options.json:
        print(json.dumps([row.to_json() for row in (fitting or rows)[: options.top]], indent=1))
    searched = describe_search(shape, fixed)
    lines = [
        f"model      {shape.name}: {shape.num_params / 1e9:.2f}B parameters, "
        f"{shape.flops_per_token(options.seq_len) / 1e9:.1f} GFLOPs per token (6N + 12·L·h·s)",
        f"cluster    {options.gpus} x {spec.name} ({options.gpus_per_node} per node), {spec.memory_gib:g} GiB each "
        f"({cluster.memory_headroom:.0%} planned for), peak {spec.peak_tflops:g} TFLOP/s at {cluster.efficiency:.0%} achievable"
        + compile_assumption(work),
        f"batch      {global_batch} sequences x {options.seq_len} tokens = {work.tokens:,} tokens per step; {options.precision}",
        f"searched   {searched}",
    ]
    best = fitting[0] if fitting else None
    if best is not None:
        lines += ["", format_table(fitting, options.top), "", "best       " + best.layout.describe()]
        lines += explain(best, cluster)
    else:
        lines += ["", "nothing fits:"] + [f"  - {reason}" for reason in why_not(shape, cluster, work, fixed, hf_config)]
        if rows:
            closest = min(rows, key=lambda row: row.memory["total"])
            lines += [f"closest    {closest.layout.describe()}"] + explain(closest, cluster)
        lines += what_would_fit(shape, cluster, work, fixed, hf_config)
    if best is not None and options.measure:
        from ultrascale.measure import measure_layout

        lay = best.layout
        try:
            measured = measure_layout(
                model_spec, world=options.gpus, pp=lay.pp, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, cp=lay.cp,
                tp=lay.tp, ep=lay.ep, zero_stage=lay.zero_stage, precision=options.precision, seq_len=options.seq_len,
                micro_batch=lay.micro_batch, recompute=lay.recompute,
                pipeline_microbatches=lay.grad_accumulation if lay.pp > 1 else None,
                # The accumulation's peak is reached by its second micro-batch (gradients from the first held).
                grad_accumulation=min(lay.grad_accumulation, 2) if lay.pp == 1 else 1,
                accumulate_unsharded_grads=lay.accumulate_unsharded_grads,
            )
        except NotImplementedError as error:
            lines.append(f"measured   not measured: {error}")
        else:
            predicted = best.memory["total"] / GIB
            parts = " + ".join(f"{key} {value:.2f}" for key, value in measured["breakdown_gib"].items())
            lines.append(
                f"measured   peak {measured['peak_gib']:.2f} GiB on rank 0 ({parts}; {measured['tracker']} under "
                f"FakeTensorMode, {measured['seconds']:.0f} s) vs predicted {predicted:.2f} GiB: "
                f"predicted/measured {predicted / measured['peak_gib']:.2f}"
            )
    if best is not None and options.emit_recipe:
        from pathlib import Path

        Path(options.emit_recipe).write_text(recipe_yaml(best, model_spec, shape, cluster, work))
        lines.append(f"recipe     wrote {options.emit_recipe}")
    text = "\n".join(lines)
    if not options.json:
        print(text)
    if best is None:
        raise SystemExit(1)
    return text


# --------------------------------------------------------------------------- plan --recipe

# The recipe knob behind each mesh axis: ParallelDims speaks in axes, a recipe in strategy arguments.
_AXIS_KNOBS = {"pp": "pipeline_parallel", "dp_replicate": "data_parallel_replicate", "dp_shard": "data_parallel_shard",
               "cp": "context_parallel", "tp": "tensor_parallel", "ep": "expert_parallel"}
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "None": "32-true"}


class _RecipeCLI(UltraScaleCLI):
    """Parses a recipe and instantiates its classes exactly as `ultrascale fit --config` does, but builds no
    Trainer: a GPU recipe's Trainer would look for its GPUs, and the check runs on any laptop."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        return None


@dataclass
class RecipePlan:
    """What `ultrascale plan --recipe` found: the recipe's objects, its layout resolved for the world size,
    the checks it passed and the planner's price of that fixed layout."""

    path: str
    module: L.LightningModule
    """The recipe's LightningModule with its network built on the meta device (no weights)."""
    strategy: Any
    dims: ParallelDims
    """The strategy's degrees at `world` ranks."""
    world: int
    shape: ModelShape
    """What the planner prices."""
    cluster: Cluster
    work: Workload
    row: PlanRow
    """The planner's price of the recipe's layout."""
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return bool(self.row.fits)


def _parse_recipe(path: str, overrides: Sequence[str]) -> _RecipeCLI:
    import logging
    import warnings

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # "Seed set to ..." is noise in a plan
    try:
        with warnings.catch_warnings():
            # `args=` given while `ultrascale plan ...` is in sys.argv: intended here.
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            return _RecipeCLI(args=["--config", str(path), *overrides], run=False)
    finally:
        seed_log.setLevel(level)


def _parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _device_count(devices: Any, gpus_per_node: Optional[int]) -> int:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        return int(devices)
    if isinstance(devices, (list, tuple)) and devices:
        return len(devices)
    if gpus_per_node:
        return gpus_per_node
    raise ValueError(f"`trainer.devices={devices!r}` is not a device count: write the number of devices per node in the "
                     "recipe, or pass --gpus-per-node")


def _recipe_strategy(value: Any) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    from ultrascale.strategies import UltraScaleStrategy

    name = value
    if isinstance(value, str) and value in StrategyRegistry:
        value = StrategyRegistry.get(value)
    if not isinstance(value, UltraScaleStrategy):
        shown = name if isinstance(name, str) else type(name).__name__
        raise ValueError(f"`trainer.strategy={shown!r}`: `ultrascale plan --recipe` checks ultrascale strategies (a name "
                         "such as `ultrascale_zero3`, or `class_path: ultrascale.UltraScaleStrategy` with its degrees)")
    return value


def _recompute_mode(callbacks: list[Any], notes: list[str]) -> str:
    """The planner's recompute mode for the recipe's ActivationCheckpointing callback ("none" without one)."""
    from ultrascale.callbacks import ActivationCheckpointing

    modes = [cb for cb in callbacks if isinstance(cb, ActivationCheckpointing)]
    if not modes:
        return "none"
    callback = modes[-1]
    if callback.mode in ("full", "selective") and type(callback.policy).__name__ in ("FullAC", "SelectiveAC"):
        return callback.mode
    notes.append(f"ActivationCheckpointing(mode={callback.mode!r}, policy {type(callback.policy).__name__}) is priced as "
                 "no recomputation: an upper bound on the activations")
    return "none"


def check_recipe(path: str, overrides: Sequence[str] = (), *, gpus: Optional[int] = None, gpu: str = "h100",
                 gpus_per_node: Optional[int] = None, spec: Optional[GpuSpec] = None, efficiency: Optional[float] = None,
                 eager_attention: bool = False) -> RecipePlan:
    """Check a recipe for its cluster without running it: parse it as `ultrascale fit --config` would (the
    strategy's constructor validates its knobs), build the model's network on the meta device (no weight
    is allocated), resolve the strategy's degrees for `gpus` ranks (default: trainer.num_nodes x
    trainer.devices), run the model checks the strategy runs before any collective (TP/CP/EP/PP support
    and divisibility, the pipeline's stages and micro-batches, sequence length, batch split), then price
    that fixed layout with the planner. ValueError (the strategy's own messages) if the layout is invalid.

    `overrides` are LightningCLI arguments applied over the recipe (e.g. `--model.pretrained_path DIR`)."""
    import itertools

    import torch

    from ultrascale.models.llama import LlamaConfig
    from ultrascale.strategies.precision import SUPPORTED_PRECISION

    cli = _parse_recipe(path, overrides)
    trainer_args = cli.config_init["trainer"]
    module, datamodule = cli.model, cli.datamodule
    strategy = _recipe_strategy(trainer_args.get("strategy"))
    checks: list[str] = []
    notes: list[str] = []

    nodes = int(trainer_args.get("num_nodes") or 1)
    devices = _device_count(trainer_args.get("devices"), gpus_per_node)
    per_node = gpus_per_node or devices
    world = gpus or nodes * devices
    # Degrees given as "auto" resolve from the devices of one node, as under a Trainer.
    strategy.parallel_devices = [torch.device("cpu")] * per_node
    strategy.num_nodes = max(world // per_node, 1)
    try:
        dims = strategy.resolve_dims(world)
    except ValueError as error:
        knobs = ", ".join(f"{axis} = {knob}" for axis, knob in _AXIS_KNOBS.items())
        source = f"--gpus {world}" if gpus else f"trainer.num_nodes {nodes} x trainer.devices {devices}"
        raise ValueError(f"{error} (world size {world} from {source}; strategy knobs: {knobs})") from None
    checks.append(f"mesh {dims.describe()}")

    precision = str(trainer_args.get("precision"))
    precision = _PRECISION_ALIASES.get(precision, precision)
    raise_first(choice_problems("trainer.precision", precision, SUPPORTED_PRECISION))

    seq_len = getattr(datamodule, "seq_len", None)
    global_batch = getattr(datamodule, "global_batch_size", None)
    if not isinstance(seq_len, int) or not isinstance(global_batch, int):
        raise ValueError(f"{type(datamodule).__name__} has no integer `seq_len` and `global_batch_size`: the plan needs "
                         "both (ultrascale.data's data modules have them)")
    accumulate = int(trainer_args.get("accumulate_grad_batches") or 1)

    # The network on the meta device: shapes only. `configure_model` is where ultrascale's modules build it,
    # as under `meta_init=True`; anything a module builds in its constructor is counted below.
    with torch.device("meta"):
        module.configure_model()
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    allocated = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
    num_params = sum(p.numel() for p in module.parameters())
    checks.append(f"model built on the meta device: {_parameters(num_params)} parameters, "
                  f"{allocated / 2**20:.1f} MiB of real tensors")

    if (getattr(module, "hparams", None) or {}).get("lora") is not None:
        notes.append("LoRA: only the adapters train, but the layout is priced as full fine-tuning (the frozen base's "
                     "gradients and optimizer state are counted, so memory is over-estimated)")
    config = getattr(module, "config", None)
    hparams = getattr(module, "hparams", {})
    preset = hparams.get("preset") if isinstance(config, LlamaConfig) and hparams.get("config") is None else None
    try:
        shape = model_shape(module, name=f"Llama {preset}" if preset else None)
    except ValueError as error:
        raise ValueError(f"{type(module).__name__}: `ultrascale plan --recipe` prices the built-in Llama (LlamaLM) and "
                         f"Hugging Face models (HFCausalLM): {error}") from None
    hf_config = None if shape.builtin else shape.config
    # HF RoPE extends past max_position_embeddings: only the built-in Llama's table is a limit.
    max_positions, vocab = (config.max_seq_len, config.vocab_size) if shape.builtin else (None, hf_config.vocab_size)

    # The strategy's own checks (`UltraScaleStrategy.check_model`, what `setup` runs), on the meta-built model
    # (tied embeddings under PP included: `rules._tied_stage_problems`).
    owner = type(strategy).__name__
    checked = strategy.check_model(module, dims=dims)  # the degrees for this world, not the Trainer's
    adapter, sequence_parallel = checked.adapter, checked.sequence_parallel
    pipeline = checked.pipeline[1] if checked.pipeline is not None else None
    if dims.cp_enabled:
        checks.append(f"context parallel cp={dims.cp}: {strategy.context_parallel_method} attention on {adapter.name}")
    if dims.ep_enabled:
        checks.append(f"expert parallel ep={dims.ep}: {adapter.num_experts // dims.ep} of {adapter.num_experts} experts "
                      f"per rank, within dp_shard x cp = {dims.dp_shard * dims.cp}")
    if pipeline is not None:
        checks.append(f"pipeline {pipeline.describe()}")
    if dims.tp_enabled:
        sizes = ", ".join(f"{name}={size}" for name, size in adapter.tp_sizes.items())
        experts = f"; each of the {adapter.num_experts} experts split on its width" if adapter.num_experts else ""
        checks.append(f"tensor parallel tp={dims.tp} divides {sizes} (sequence parallel {'on' if sequence_parallel else 'off'}"
                      f"{experts})")
    where = f"{type(datamodule).__name__}(seq_len={seq_len})"
    raise_first(batch_problems(dims, seq_len=seq_len, global_batch=global_batch,
                               sequence_parallel=sequence_parallel, where=type(datamodule).__name__,
                               microbatches=pipeline.microbatches if pipeline is not None else None), owner)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"{where} is longer than the model's RoPE table (max_seq_len={max_positions}): set "
                         f"`model.init_args.max_seq_len` to at least {seq_len}")
    local = global_batch // dims.dp
    splits = []
    if dims.cp > 1:
        splits.append(f"{context_chunks(dims.cp, load_balance=True)} context-parallel chunks")
    if sequence_parallel and dims.tp > 1:
        splits.append(f"tp={dims.tp} (sequence parallel)")
    checks.append(f"seq_len {seq_len}{' splits into ' + ' x '.join(splits) if splits else ''}"
                  f"{f', within max_seq_len {max_positions}' if max_positions else ''}; global_batch_size {global_batch} = "
                  f"{local} per data-parallel rank per micro-step")
    try:
        data_vocab = datamodule.vocab_size
    except (AttributeError, ValueError):  # a tokenizer that comes from the Trainer's module (InstructionDataModule)
        data_vocab = None
    if isinstance(data_vocab, int) and data_vocab > vocab:
        raise ValueError(f"the tokenizer of {type(datamodule).__name__} has {data_vocab} ids but the model only {vocab} "
                         "embeddings: set the model's `vocab_size` (or the data's `tokenizer_path`)")

    recompute = _recompute_mode(trainer_args.get("callbacks") or [], notes)
    if pipeline is not None:
        micro_batch, grad_accumulation = local // pipeline.microbatches, pipeline.microbatches * accumulate
        if accumulate > 1:
            notes.append(f"accumulate_grad_batches={accumulate} under pipeline parallel is priced as {grad_accumulation} "
                         "micro-batches in one schedule: the real run drains the pipeline once more per accumulation step")
    else:
        micro_batch, grad_accumulation = local, accumulate
    layout = Layout(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                    ep=dims.ep, zero_stage=strategy.zero_stage, micro_batch=micro_batch,
                    grad_accumulation=grad_accumulation, recompute=recompute,
                    accumulate_unsharded_grads=bool(strategy.accumulate_unsharded_grads and strategy.zero_stage == 3
                                                and pipeline is None and grad_accumulation > 1),
                    virtual_stages=pipeline.virtual_stages if pipeline is not None else 1,
                    pipeline_schedule=pipeline.schedule if pipeline is not None else None,
                    pipeline_layers=(pipeline.layers_per_stage if pipeline is not None and strategy.pipeline_layers is not None
                                     else None),
                    cp_method=strategy.context_parallel_method)
    cluster = _cluster(spec or GPU_SPECS[gpu], world, per_node, efficiency)
    # The strategy's `compile` knob: each block compiled, priced with the published speed-up (`COMPILE_SPEEDUP`).
    from ultrascale.callbacks import Float8Training

    compiled = bool(getattr(strategy, "compile", False))
    float8 = any(isinstance(cb, Float8Training) for cb in trainer_args.get("callbacks") or [])
    if float8 and not compiled:
        notes.append("Float8Training without the strategy's `compile`: priced as bf16 (Float8's published gain is compiled)")
    elif float8:
        notes.append(f"Float8Training: compute / {FLOAT8_SPEEDUP:.3f} on top of compile (torchtitan's published gain); "
                     "memory as bf16")
    work = Workload(seq_len, global_batch * accumulate, precision, attention_scores_saved=eager_attention,
                    compiled=compiled, float8=float8 and compiled)
    row = evaluate(shape, layout, cluster, work, hf_config)
    if row.problems:  # the planner's copy of the strategy's remaining rules (TP inside a node, ZeRO-1/2 limits, ...)
        raise ValueError(f"{owner} layout {layout.describe()}: " + "; ".join(row.problems))
    if str(trainer_args.get("accelerator")) == "cpu":
        notes.append(f"a CPU recipe: priced as if on {cluster.gpu.name}, for scale")
    return RecipePlan(str(path), module, strategy, dims, world, shape, cluster, work, row, checks, notes)


def format_recipe_plan(plan: RecipePlan) -> list[str]:
    lay, work, cluster = plan.row.layout, plan.work, plan.cluster
    lines = [
        f"recipe     {plan.path}: {type(plan.module).__name__}, {type(plan.strategy).__name__} on {plan.world} ranks",
        f"model      {plan.shape.name}: {_parameters(plan.shape.num_params)} parameters, "
        f"{plan.shape.flops_per_token(work.seq_len) / 1e9:.1f} GFLOPs per token",
        f"cluster    {cluster.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node), {cluster.gpu.memory_gib:g} GiB "
        f"each ({cluster.memory_headroom:.0%} planned for){compile_assumption(work)}",
        f"batch      {work.global_batch} sequences x {work.seq_len} tokens = {work.tokens:,} tokens per optimizer step "
        f"({lay.dp} data-parallel ranks x micro-batch {lay.micro_batch} x {lay.grad_accumulation} "
        f"{'pipeline micro-batches' if lay.pp > 1 else 'accumulation steps'}); {work.precision}",
    ]
    lines += [f"checked    {check}" for check in plan.checks]
    lines += ["layout     " + lay.describe()]
    lines += explain(plan.row, cluster)
    lines += [f"note       {note}" for note in plan.notes]
    return lines


def plan_recipe_main(options: Any, overrides: list[str]) -> str:
    """`ultrascale plan --recipe PATH`: check a recipe and price its layout; exit 1 if it does not fit."""
    try:
        plan = check_recipe(options.recipe, overrides, gpus=options.gpus, gpu=options.gpu,
                            gpus_per_node=options.gpus_per_node, spec=_gpu_spec(options), efficiency=options.efficiency,
                            eager_attention=options.eager_attention)
    except NotImplementedError as error:  # the strategy's "not implemented yet" combinations: invalid here
        raise ValueError(str(error)) from None
    if options.json:
        text = json.dumps({"recipe": plan.path, "world": plan.world, **plan.row.to_json(), "compiled": plan.work.compiled,
                           "checks": plan.checks, "notes": plan.notes}, indent=1)
    else:
        text = "\n".join(format_recipe_plan(plan))
    print(text)
    if not plan.fits:
        raise SystemExit(1)
    return text

