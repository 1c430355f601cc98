"""The application behind `ultrascale plan`: its options, the ranked plan for a model on a cluster
(`plan_main`), and `plan --recipe` (`plan_recipe_main`; the recipe's check is `ultrascale.planner.recipe_check`).

`ultrascale.cli` parses the subcommand and dispatches here; the planner's arithmetic lives in the
sibling modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from ultrascale.estimate import ModelShape
from ultrascale.hardware import COMPILE_SPEEDUP, FLOAT8_SPEEDUP, GIB, GPU_SPECS, TORCH_NATIVE_EFFICIENCY, Cluster, GpuSpec
from ultrascale.models.adapters import model_shape
from ultrascale.parallel import rules
from ultrascale.parallel.rules import PLANNED_RECOMPUTE, PRECISIONS, LayoutKnobs
from ultrascale.planner.cost import Workload, pipeline_timeline
from ultrascale.planner.layouts import model_facts_of, parse_layout
from ultrascale.planner.plot import plot_path_problem, write_plan_plot
from ultrascale.planner.recipe import recipe_yaml
from ultrascale.planner.recipe_check import check_recipe, format_recipe_plan, priced_cluster
from ultrascale.planner.report import compile_assumption, describe_search, explain, format_table, what_would_fit
from ultrascale.planner.search import search, why_not

__all__ = ["plan_main", "plan_recipe_main"]


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
    parser.add_argument("--plot", default=None, metavar="FILE.svg",
                        help="draw the chosen layout's memory per GPU by component and, with a pipeline, its schedule as "
                             "a timeline per rank (SVG)")
    parser.add_argument("--measure", action="store_true",
                        help="also build the model under FakeTensorMode at the real world size and measure the best layout's peak memory")
    # Single-degree options of the first `plan` (kept: each fixes that value of the layout).
    parser.add_argument("--dp-replicate", type=_positive(int), default=None)
    parser.add_argument("--tp", type=_positive(int), default=None)
    parser.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                        help="0: plain data parallel (runs as dp_replicate alone)")
    parser.add_argument("--micro-batch", type=_positive(int), default=None)
    parser.add_argument("--recompute", default=None, choices=PLANNED_RECOMPUTE,
                        help="a mode on every block, or budget: per block the cheapest mode that fits the memory")
    parser.add_argument("--full-recompute", action="store_true", help="same as --recompute full")
    parser.add_argument("--eager-attention", action="store_true",
                        help="attention keeps its s x s scores (no flash / fused kernel)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=None,
                        help="the models' `loss_chunk_tokens`: the head and the loss fused over chunks of this many "
                             "tokens (default: the model's default where it is built; 0: the whole logits); with "
                             "--recipe, the recipe's model decides")
    parser.add_argument("--compile", action="store_true",
                        help=f"price every layout with each block compiled (the strategies' `compile=True`): the compute "
                             f"outside attention faster by the gain that gives torchtitan's published {COMPILE_SPEEDUP:.3f} "
                             "on its run; with --recipe, the strategy's `compile` decides")
    parser.add_argument("--fp8", action="store_true",
                        help=f"price every layout with Float8 matmuls (the `Float8Training` callback), compiled: the compute "
                             f"outside attention faster by the gains that give torchtitan's published {COMPILE_SPEEDUP:.3f} x "
                             f"{FLOAT8_SPEEDUP:.3f} on its run; with --recipe, its callbacks decide")
    parser.add_argument("--device-memory-gib", type=_positive(float), default=None, help="memory of one GPU (default: the GPU's)")
    parser.add_argument("--peak-tflops", type=_positive(float), default=None, help="dense bf16 peak of one GPU (default: the GPU's)")
    parser.add_argument("--intra-node-gbps", type=_positive(float), default=None,
                        help="GB/s per GPU inside a node (default: the GPU's NVLink figure)")
    parser.add_argument("--inter-node-gbps", type=_positive(float), default=None,
                        help="GB/s per GPU between nodes (default: one 400 Gb/s NIC per GPU)")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="this machine's measured / predicted tokens/s per layout family (`ultrascale tune --calibrate "
                             "FILE`): each layout's predicted times are divided by its family's ratio")
    parser.add_argument("--efficiency", type=_positive(float), default=None,
                        help="fraction of the peak the matmuls reach (default: ultrascale's own, fitted per GPU generation "
                             "on torchtitan's published runs: " + ", ".join(f"{generation} {value}" for generation, value
                                                                           in TORCH_NATIVE_EFFICIENCY.items()) + ")")
    options, unknown = parser.parse_known_args(args)
    problem = plot_path_problem(Path(options.plot)) if options.plot else None
    if problem is not None:
        parser.error(problem)
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
    cluster = priced_cluster(_gpu_spec(options), options.gpus, options.gpus_per_node, options.efficiency,
                             options.calibration, devices="cuda")
    spec = cluster.gpu
    if options.global_batch_tokens:
        global_batch = max(options.global_batch_tokens // options.seq_len, 1)
    else:
        global_batch = options.global_batch or options.gpus
    work = Workload(options.seq_len, global_batch, options.precision, attention_scores_saved=options.eager_attention,
                    compiled=options.compile or options.fp8, float8=options.fp8, loss_chunk_tokens=options.loss_chunk_tokens)

    if options.why_not is not None:
        reasons = why_not(shape, cluster, work, {**fixed, **parse_layout(options.why_not)}, hf_config)
        text = "\n".join([f"why not {options.why_not}:"] + [f"  - {reason}" for reason in reasons])
        print(text)
        return text

    rows = search(shape, cluster, work, fixed, hf_config, top=options.top)
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
    if cluster.calibration:
        lines.insert(2, f"calibrated {options.calibration}: predicted times / measured-to-predicted tokens/s per layout "
                        f"family ({', '.join(f'{family} {ratio:.3g}' for family, ratio in cluster.calibration)})")
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
                accumulate_grads_in_fp32=lay.accumulate_grads_in_fp32,
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
        Path(options.emit_recipe).write_text(recipe_yaml(best, model_spec, shape, cluster, work))
        lines.append(f"recipe     wrote {options.emit_recipe}")
    if best is not None and options.plot:
        lines.append(_plot(Path(options.plot), best, shape, cluster, work))
    text = "\n".join(lines)
    if not options.json:
        print(text)
    if best is None:
        raise SystemExit(1)
    return text


# --------------------------------------------------------------------------- plan --recipe

def _plot(path: Path, row: Any, shape: ModelShape, cluster: Cluster, work: Workload) -> str:
    """`--plot`: `row`'s memory and, under pipeline parallel, its played schedule, written to `path`."""
    pipe, actions = pipeline_timeline(shape, row.layout, cluster, work, None if shape.builtin else shape.config)
    write_plan_plot(path, row, cluster, pipe, actions)
    return f"plot       wrote {path}"


def plan_recipe_main(options: Any, overrides: list[str]) -> str:
    """`ultrascale plan --recipe PATH`: check a recipe and price its layout; exit 1 if it does not fit."""
    try:
        plan = check_recipe(options.recipe, overrides, gpus=options.gpus, gpu=options.gpu,
                            gpus_per_node=options.gpus_per_node, spec=_gpu_spec(options), efficiency=options.efficiency,
                            eager_attention=options.eager_attention, calibration=options.calibration)
    except NotImplementedError as error:  # the strategy's "not implemented yet" combinations: invalid here
        raise ValueError(str(error)) from None
    if options.json:
        text = json.dumps({"recipe": plan.path, "world": plan.world, **plan.row.to_json(), "compiled": plan.work.compiled,
                           "checks": plan.checks, "notes": plan.notes}, indent=1)
    else:
        text = "\n".join(format_recipe_plan(plan))
    if options.plot:
        drawn = _plot(Path(options.plot), plan.row, plan.shape, plan.cluster, plan.work)
        text += "" if options.json else "\n" + drawn
    print(text)
    if not plan.fits:
        raise SystemExit(1)
    return text

