"""The planner's predictions beside published training runs: tokens/s per GPU, MFU and peak memory.

Every published figure comes from `benchmarks/planner_published.yaml` (copied from the cited
source, under the quoted row; `planner_published.py` loads it against its schema). For each
run the planner costs *the published layout* (not its own choice) with `ultrascale.planner.evaluate`,
at ultrascale's own achievable fraction of peak (`TORCH_NATIVE_EFFICIENCY`, which `fit_torch_native` fits on the
torchtitan runs: the stack ultrascale runs), and the table gives predicted / published, per stack: the other stacks'
runs (Megatron, NeMo, llm-foundry) are reported with their speed over ultrascale's pricing, never fitted in.
Where a source leaves a field out, this script fills it and says so in the `assumed` column:

- sequence length: 8192 (torchtitan's Llama 3 configs) where the table gives none;
- ZeRO stage: 3 for FSDP (torchtitan, llm-foundry), 1 for Megatron/NeMo (the distributed
  optimizer shards the optimizer state only);
- recompute: torchtitan's config default (selective) for torchtitan runs, "none" for the
  others, where unstated; micro-batch 1 where unstated; a global batch of one micro-batch per
  data rank (pp micro-batches under pipeline parallel) where unstated; 8 GPUs per node;
- the GPT-3 175B vocabulary: 50257.

An fp8 run is priced as `ultrascale plan --fp8` prices it (compiled blocks with Float8 matmuls:
torchtitan's published gains, `ultrascale.hardware`). A run whose source gives MFU or TFLOP/s
rather than tokens/s is compared by MFU: model FLOPs over the bf16 peak (hardware FLOPs converted with
the source's own formula; an MFU against the fp8 peak doubled; a stated FLOP count per sequence
rescaled to the planner's 6N + 12·L·h·s). The summary reports the median ratio,
the share within 25% and within 1.35x, for all runs, bf16 (without and with a pipeline), fp8 and
pipelined runs. Pipelines are priced as laid out: the stated schedule and virtual stages (v = 2 where
a paper names interleaving without a count), the balanced split where the source states lighter
first and last stages or where no even split exists.

With `--measure` it also sets the planner's memory beside `ultrascale.measure` (the real model
under FakeTensorMode and FSDPMemTracker, about 20 s per layout) for the 8B preset at world 8.

    python benchmarks/planner_validation.py [--efficiency 0.5] [--measure] [--out benchmarks/results/planner_validation.md]
"""

from __future__ import annotations

import argparse
import math
import runpy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results  # noqa: E402

from ultrascale import planner  # noqa: E402
from ultrascale.estimate import ModelShape  # noqa: E402
from ultrascale.hardware import TORCH_NATIVE_EFFICIENCY  # noqa: E402
from ultrascale.models.adapters import model_shape  # noqa: E402
from ultrascale.planner.pipeline import balanced_layers  # noqa: E402

PUBLISHED = runpy.run_path(str(Path(__file__).resolve().parent / "planner_published.py"))["PUBLISHED_RUNS"]
GIB = 2**30


def _shape(model) -> tuple[ModelShape, list[str]]:
    if isinstance(model, str):
        return model_shape(model), []
    assumed = []
    vocab = model.get("vocab")
    if vocab is None:
        vocab, _ = 50257, assumed.append("vocab 50257")
    gpt = "GPT" in model.get("style", "")
    shape = ModelShape(
        name=model.get("config", "GPT").split(" ")[0] if not gpt else f"GPT-style {model['n_layers']}L h{model['hidden']}",
        n_layers=model["n_layers"], hidden=model["hidden"], n_heads=model["heads"], n_kv_heads=model["kv_heads"],
        head_dim=model["hidden"] // model["heads"], ffn_hidden=model["ffn_hidden"], vocab=vocab,
        gated_mlp=not gpt, builtin=True,
    )
    return shape, assumed


MEGATRON_STYLE = ("NeMo", "Megatron", "dgxc", "Narayanan", "Korthikanti", "GLM", "Llama 3 paper")
"""Sources whose data parallelism is Megatron's (the distributed optimizer: ZeRO-1) rather than FSDP."""


STACKS = {"torch-native": ("torchtitan",), "Megatron": MEGATRON_STYLE, "llm-foundry": ("llm-foundry",)}
"""Which training stack each source ran: ultrascale's own (torch-native: FSDP2, DTensor, torch.distributed.pipelining,
torch.compile, torchao Float8, as torchtitan) or another. Only torch-native runs calibrate the planner."""


def stack_of(run: dict) -> str:
    return next(stack for stack, sources in STACKS.items() if any(name in run["source"] for name in sources))


def fit_torch_native(generation: str, iterations: int = 12) -> float:
    """The achievable fraction for `generation` (a `GpuSpec.generation`) that makes the geometric mean of published /
    predicted tokens/s over its torch-native runs 1. Communication does not scale with it, so it is iterated."""
    runs = [run for run in PUBLISHED if stack_of(run) == "torch-native"
            and planner.GPU_SPECS[run["gpu"].lower()].generation == generation]
    efficiency = planner.GPU_SPECS["h100"].efficiency
    for _ in range(iterations):
        logs = [math.log(run["tokens_per_s_per_gpu"] / predict(run, efficiency)["row"].tokens_per_s_per_gpu) for run in runs]
        efficiency *= math.exp(sum(logs) / len(logs))
    return efficiency


def predict(run: dict, efficiency: float | None = None) -> dict:
    shape, assumed = _shape(run["model"])
    lay = dict(run["layout"])
    schedule = lay.pop("schedule", None)
    gpus = run["gpus"]
    seq = run["seq_len"]
    if seq is None:
        seq, _ = 8192, assumed.append("seq 8192")
    per_node = run["gpus_per_node"] or 8
    if run["gpus_per_node"] is None:
        assumed.append("8 GPUs/node")
    if "zero_stage" not in lay:
        megatron = any(name in run["source"] for name in MEGATRON_STYLE)
        lay["zero_stage"] = 1 if megatron else 3
        assumed.append(f"ZeRO-{lay['zero_stage']}")
    if "dp" in lay:
        lay["dp_shard"] = lay.pop("dp")
    tp, pp, cp, dpr = (lay.get(k, 1) for k in ("tp", "pp", "cp", "dp_replicate"))
    lay.setdefault("dp_shard", gpus // (tp * pp * cp * dpr))
    dp = lay["dp_shard"] * dpr
    if pp > 1:
        if schedule is None:
            schedule = "Interleaved1F1B" if lay.get("virtual_stages", 1) > 1 else "1F1B"
            assumed.append(f"schedule {schedule}")
        lay["pipeline_schedule"] = schedule
        if schedule == "Interleaved1F1B" and "virtual_stages" not in lay:
            lay["virtual_stages"] = 2
            assumed.append("v=2")
        stages = pp * lay.get("virtual_stages", 1)
        if run.get("pipeline_layers"):  # the sources that state one describe the first and last stage one layer lighter
            lay["pipeline_layers"] = balanced_layers(shape.n_layers, stages)
        elif shape.n_layers % stages and lay.get("virtual_stages", 1) > 1:
            lay["pipeline_layers"] = balanced_layers(shape.n_layers, stages)
            assumed.append("balanced split")
    mbs = run["micro_batch"]
    if mbs is None:
        mbs, _ = 1, assumed.append("micro-batch 1")
    global_batch = run["global_batch"] or (run["global_batch_tokens"] // seq if run["global_batch_tokens"] else None)
    if global_batch is None:
        global_batch = dp * mbs * pp
        assumed.append(f"{pp} micro-batches per data rank" if pp > 1 else "one micro-batch per data rank")
    recompute = run["recompute"]
    if recompute is None and run.get("recompute_assumed"):
        recompute, why = run["recompute_assumed"]
        assumed.append(f"recompute {recompute} ({why})")
    elif recompute is None:
        recompute = "selective" if "torchtitan" in run["source"] else "none"
        assumed.append(f"recompute {recompute}")
    accumulation = max(global_batch // (mbs * dp), 1)
    layout = planner.Layout(micro_batch=mbs, grad_accumulation=accumulation, recompute=recompute,
                            **{k: v for k, v in lay.items() if k in planner.LAYOUT_KEYS})
    spec = planner.GPU_SPECS[run["gpu"].lower()]
    cluster = planner.Cluster(spec, gpus, per_node, efficiency=efficiency)
    fp8 = run["precision"] == "fp8"  # priced as `plan --fp8`: compiled blocks with Float8 matmuls
    # The published stacks computed every token's logits at once: their memory is priced so (`loss_chunk_tokens=0`).
    work = planner.Workload(seq, mbs * accumulation * dp, "bf16-mixed", compiled=fp8 or bool(run.get("compile")), float8=fp8,
                            loss_chunk_tokens=0)
    row = planner.evaluate(shape, layout, cluster, work)
    return {"row": row, "shape": shape, "assumed": assumed, "layout": layout}


def published_mfu(run: dict, shape: ModelShape) -> tuple[float | None, str]:
    """The source's utilisation as model FLOPs over the bf16 peak (what the planner predicts), and how it was read.

    Hardware FLOPs (the recomputed forward counted) become model FLOPs with Narayanan et al. 2021's own formulas:
    model / hardware = 72(1 + s/6h + V/12lh) / 96(1 + s/6h + V/16lh). An fp8 MFU stated against the fp8 peak
    (the DGX-Cloud tables say so) is doubled: the fp8 peak is twice the bf16 one."""
    how = []
    if run["mfu"] is not None:
        mfu = run["mfu"]
        how.append("stated MFU")
    elif run["tflops_per_gpu"] is not None:
        mfu = run["tflops_per_gpu"] / planner.GPU_SPECS[run["gpu"].lower()].peak_tflops
        how.append("TFLOP/s over the bf16 peak")
    else:
        return None, ""
    if run.get("flops_include_recompute"):
        s, h, L, V = run["seq_len"], shape.hidden, shape.n_layers, shape.vocab
        mfu *= 72 * (1 + s / (6 * h) + V / (12 * L * h)) / (96 * (1 + s / (6 * h) + V / (16 * L * h)))
        how.append("hardware to model FLOPs")
    if run["precision"] == "fp8" and run["mfu"] is not None and "1979" in run["notes"]:
        mfu *= 2
        how.append("fp8 peak to bf16 peak")
    if run.get("flops_per_sequence"):  # the source's own FLOP count, stated: rescaled to the planner's (6N + 12·L·h·s)
        mfu *= shape.flops_per_token(run["seq_len"]) * run["seq_len"] / run["flops_per_sequence"]
        how.append("the source's FLOPs per sequence to the planner's")
    return mfu, ", ".join(how)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efficiency", type=float, default=None,
                        help="one achievable fraction for every run (default: each GPU's, `TORCH_NATIVE_EFFICIENCY`)")
    parser.add_argument("--measure", action="store_true", help="also compare memory with ultrascale.measure (8B, world 8)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "planner_validation.md"))
    options = parser.parse_args()

    fraction = (f"achievable fraction of peak {options.efficiency}" if options.efficiency else
                "achievable fraction of peak: ultrascale's own per GPU generation, " + ", ".join(
                    f"{g} {v}" for g, v in TORCH_NATIVE_EFFICIENCY.items()) + " (`ultrascale.hardware`)")
    lines = [
        f"Planner predictions for published layouts ({fraction}); ratio = predicted / published tokens/s per GPU, or "
        "predicted / published MFU (model FLOPs over the bf16 peak) where the source gives no tokens/s. fp8 runs are "
        "priced as `plan --fp8` (compiled, Float8 matmuls); bf16 runs the source states compiled as `plan --compile`. "
        "Runs are grouped by the stack that ran them: torch-native (torchtitan: ultrascale's own stack, which calibrates "
        "the planner) and the others, reported apart.",
    ]
    header = ["", "| source | model | GPUs | layout | prec. | published tok/s/GPU | predicted | published MFU | predicted MFU "
              "| ratio | published GiB | predicted GiB | ratio | assumed |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    tables: dict[str, list[str]] = {stack: list(header) for stack in STACKS}
    ratios: dict[str, list[float]] = {stack: [] for stack in STACKS}
    kinds: dict[str, list[float]] = {"torch-native eager bf16": [], "torch-native compiled bf16": [],
                                     "torch-native Float8": []}
    memory_ratios: list[float] = []
    for run in PUBLISHED:
        got = predict(run, options.efficiency)
        row, lay = got["row"], got["layout"]
        degrees = " ".join(f"{k}{getattr(lay, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if getattr(lay, k) > 1)
        degrees += f" z{lay.zero_stage} mbs{lay.micro_batch} acc{lay.grad_accumulation} {lay.recompute}"
        if lay.pp > 1:
            degrees += f" {lay.schedule}" + (f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
            degrees += " balanced" if lay.pipeline_layers is not None else ""
        published = run["tokens_per_s_per_gpu"]
        mfu, how = published_mfu(run, got["shape"])
        if published is not None:
            ratio = row.tokens_per_s_per_gpu / published
        elif mfu is not None:
            ratio = row.mfu / mfu
        else:
            continue
        stack = stack_of(run)
        ratios[stack].append(ratio)
        if stack == "torch-native":
            kind = ("Float8" if run["precision"] == "fp8" else
                    "compiled bf16" if run.get("compile") else "eager bf16")
            kinds.setdefault(f"torch-native {kind}", []).append(ratio)
        name = run["model"] if isinstance(run["model"], str) else got["shape"].name
        memory = row.memory["total"] / GIB
        if run["memory_gib"]:
            memory_ratios.append(memory / run["memory_gib"])
        refused = " (ultrascale refuses: " + "; ".join(row.problems) + ")" if row.problems else ""
        mfu_text = f"{mfu:.3f}" + (f" ({how})" if how and how != "stated MFU" else "") if mfu is not None else "-"
        precision = (run["precision"] or "?") + (" compiled" if run.get("compile") and run["precision"] != "fp8" else "")
        tables[stack].append(
            f"| {run['source']} | {name} | {run['gpus']} x {run['gpu']} | {degrees} | {precision} "
            f"| {f'{published:,}' if published else '-'} | {row.tokens_per_s_per_gpu:,.0f} "
            f"| {mfu_text} | {row.mfu:.3f} | {ratio:.2f} "
            f"| {run['memory_gib'] if run['memory_gib'] else '-'} | {memory:.1f} | {_ratio(memory, run['memory_gib'])} "
            f"| {', '.join(got['assumed']) or '-'}{refused} |"
        )
    for stack, table in tables.items():
        title = ("torch-native runs (torchtitan): the stack ultrascale runs, which the planner is calibrated on"
                 if stack == "torch-native" else f"{stack} runs: another stack, not fitted")
        lines += ["", f"### {title}", *table]

    def inside(values: list[float], within: float = 0.25) -> str:
        n = sum(1 for v in values if 1 / (1 + within) <= v <= 1 + within)
        return f"{n} of {len(values)}"

    def geomean(values: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in values) / len(values))

    lines += ["", "| runs | count | median ratio | inside 25% | inside 1.35x | the stack's speed over ultrascale's pricing |",
              "|---|---|---|---|---|---|"]
    for group, values in {**{stack: ratios[stack] for stack in STACKS}, **kinds}.items():
        if values:
            lines.append(f"| {group} | {len(values)} | {statistics.median(values):.2f} | {inside(values)} "
                         f"| {inside(values, 0.35)} | {1 / geomean(values):.2f}x |")
    fitted = {g: fit_torch_native(g) for g in TORCH_NATIVE_EFFICIENCY}
    lines += [
        "",
        "Inside 25%: ratio in [1/1.25, 1.25]; inside 1.35x: in [1/1.35, 1.35]. The stack's speed over ultrascale's "
        "pricing: the geometric mean of published / predicted (another stack's factor is reported, never fitted in).",
        f"peak memory inside 25%: {inside(memory_ratios)} runs with a published figure; median ratio "
        f"{statistics.median(memory_ratios):.2f}.",
        "The torch-native fit (`fit_torch_native`): " + ", ".join(f"{g} {v:.3f}" for g, v in fitted.items())
        + "; `TORCH_NATIVE_EFFICIENCY` holds " + ", ".join(f"{g} {v}" for g, v in TORCH_NATIVE_EFFICIENCY.items()) + ".",
    ]
    if options.measure:
        lines += ["", *measured_table()]
    write_results("\n".join(lines), options.out)


MEASURED_LAYOUTS = (
    dict(dp_shard=8, recompute="none"), dict(dp_shard=8, recompute="selective"), dict(dp_shard=8, recompute="full"),
    dict(dp_shard=4, tp=2, recompute="none"), dict(dp_shard=4, tp=2, recompute="full"),
    dict(dp_shard=4, cp=2, recompute="none"), dict(dp_replicate=2, dp_shard=4, recompute="full"),
    dict(dp_shard=8, zero_stage=1, recompute="full"), dict(dp_shard=8, zero_stage=2, recompute="full"),
    dict(dp_shard=8, grad_accumulation=2, recompute="full"),
    dict(pp=2, dp_shard=4, pipeline_microbatches=4, recompute="full"),
)


def measured_table() -> list[str]:
    """Llama-3 8B, 8 GPUs, seq 8192, micro-batch 1, bf16-mixed: predicted vs measured peak per GPU."""
    from ultrascale.measure import measure_layout

    shape = model_shape("llama3_8b")
    lines = [
        "Llama-3 8B on 8 GPUs, seq 8192, micro-batch 1, bf16-mixed, ZeRO-3 unless named: the planner's peak per GPU "
        "beside `ultrascale.measure` (FakeTensorMode + FSDPMemTracker, or MemTracker for ZeRO-1/2; rank 0). "
        "The measured breakdown uses the trackers' categories: *other* is the backward's temporaries and FSDP's "
        "gathered parameters and collective buffers (the planner's *buffers* and part of its activations).",
        "",
        "| layout | predicted GiB (params + grads + optimizer + activations + buffers) | measured GiB (params + grads + "
        "optimizer + activations + other) | measured peak at | predicted / measured |",
        "|---|---|---|---|---|",
    ]
    for layout in MEASURED_LAYOUTS:
        knobs = dict(layout)
        microbatches = knobs.pop("pipeline_microbatches", None)
        lay = planner.Layout(**{"zero_stage": 3, **knobs, **({"grad_accumulation": microbatches} if microbatches else {})})
        row = planner.evaluate(shape, lay, planner.Cluster(planner.GPU_SPECS["h100"], 8),
                               planner.Workload(8192, lay.dp * lay.micro_batch * lay.grad_accumulation))
        measured = measure_layout("llama3_8b", world=8, seq_len=8192, micro_batch=1, **layout)
        m, b = row.memory, measured["breakdown_gib"]
        name = ", ".join(f"{k}={v}" for k, v in layout.items())
        lines.append(
            f"| {name} | {m['total'] / GIB:.2f} ({m['params'] / GIB:.2f} + {m['grads'] / GIB:.2f} + {m['optimizer'] / GIB:.2f} + "
            f"{m['activations'] / GIB:.2f} + {m['buffers'] / GIB:.2f}) | {measured['peak_gib']:.2f} ({b['params']:.2f} + "
            f"{b['grads']:.2f} + {b['optimizer']:.2f} + {b['activations']:.2f} + {b['other']:.2f}) "
            f"| {measured['peak_phase']} | {m['total'] / GIB / measured['peak_gib']:.3f} |"
        )
    return lines


if __name__ == "__main__":
    main()
