"""The planner's predictions beside published training runs: tokens/s per GPU, MFU and peak memory.

Every published figure comes from `benchmarks/planner_published.py` (copied from the cited
source, with the quoted row). For each run the planner costs *the published layout* (not its
own choice) with `ultrascale.planner.evaluate`, at the default achievable fraction of peak,
and the table gives predicted / published. Where a source leaves a field out, this script
fills it and says so in the `assumed` column:

- sequence length: 8192 (torchtitan's Llama 3 configs) where the table gives none;
- ZeRO stage: 3 for FSDP (torchtitan, llm-foundry), 1 for Megatron/NeMo (the distributed
  optimizer shards the optimizer state only);
- recompute: torchtitan's config default (selective) for torchtitan runs, "none" for the
  others, where unstated; micro-batch 1 where unstated; a global batch of one micro-batch per
  data rank (pp micro-batches under pipeline parallel) where unstated; 8 GPUs per node;
- the GPT-3 175B vocabulary: 50257.

The planner has no Float8 model: an fp8 run is priced at the bf16 peak, so its ratio is
expected below 1 (torchtitan measured Float8 at 1.2-1.5x bf16). Ratios "inside 25%" are
counted over all runs and over the bf16 runs alone.

With `--measure` it also sets the planner's memory beside `ultrascale.measure` (the real model
under FakeTensorMode and FSDPMemTracker, about 20 s per layout) for the 8B preset at world 8.

    python benchmarks/planner_validation.py [--efficiency 0.55] [--measure] [--out benchmarks/results/planner_validation.md]
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results  # noqa: E402

from ultrascale import planner  # noqa: E402
from ultrascale.estimate import ModelShape, model_shape  # noqa: E402

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


def predict(run: dict, efficiency: float) -> dict:
    shape, assumed = _shape(run["model"])
    lay = dict(run["layout"])
    lay.pop("schedule", None)
    gpus = run["gpus"]
    seq = run["seq_len"]
    if seq is None:
        seq, _ = 8192, assumed.append("seq 8192")
    per_node = run["gpus_per_node"] or 8
    if run["gpus_per_node"] is None:
        assumed.append("8 GPUs/node")
    if "zero_stage" not in lay:
        megatron = "NeMo" in run["source"] or "Megatron" in run["source"]
        lay["zero_stage"] = 1 if megatron else 3
        assumed.append(f"ZeRO-{lay['zero_stage']}")
    tp, pp, cp, dpr = (lay.get(k, 1) for k in ("tp", "pp", "cp", "dp_replicate"))
    lay.setdefault("dp_shard", gpus // (tp * pp * cp * dpr))
    lay.pop("dp", None)
    dp = lay["dp_shard"] * dpr
    mbs = run["micro_batch"]
    if mbs is None:
        mbs, _ = 1, assumed.append("micro-batch 1")
    global_batch = run["global_batch"] or (run["global_batch_tokens"] // seq if run["global_batch_tokens"] else None)
    if global_batch is None:
        global_batch = dp * mbs * pp
        assumed.append(f"{pp} micro-batches per data rank" if pp > 1 else "one micro-batch per data rank")
    recompute = run["recompute"]
    if recompute is None:
        recompute = "selective" if "torchtitan" in run["source"] else "none"
        assumed.append(f"recompute {recompute}")
    accumulation = max(global_batch // (mbs * dp), 1)
    layout = planner.Layout(micro_batch=mbs, grad_accumulation=accumulation, recompute=recompute,
                            **{k: v for k, v in lay.items() if k in planner.LAYOUT_KEYS})
    spec = planner.GPU_SPECS[run["gpu"].lower()]
    cluster = planner.Cluster(spec, gpus, per_node, efficiency=efficiency)
    work = planner.Workload(seq, mbs * accumulation * dp, "bf16-mixed")
    row = planner.evaluate(shape, layout, cluster, work)
    return {"row": row, "shape": shape, "assumed": assumed, "layout": layout}


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efficiency", type=float, default=planner.Cluster.efficiency)
    parser.add_argument("--measure", action="store_true", help="also compare memory with ultrascale.measure (8B, world 8)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "planner_validation.md"))
    options = parser.parse_args()

    lines = [
        f"Planner predictions for published layouts (achievable fraction of peak {options.efficiency}); "
        "ratio = predicted / published.",
        "",
        "| source | model | GPUs | layout | prec. | published tok/s/GPU | predicted | ratio | published MFU | predicted MFU "
        "| published GiB | predicted GiB | ratio | assumed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    speed_ratios: dict[str, list[float]] = {"all": [], "bf16": []}
    memory_ratios: list[float] = []
    for run in PUBLISHED:
        got = predict(run, options.efficiency)
        row, lay = got["row"], got["layout"]
        degrees = " ".join(f"{k}{getattr(lay, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if getattr(lay, k) > 1)
        degrees += f" z{lay.zero_stage} mbs{lay.micro_batch} acc{lay.grad_accumulation} {lay.recompute}"
        if lay.virtual_stages > 1:
            degrees += f" v{lay.virtual_stages}"
        published = run["tokens_per_s_per_gpu"]
        predicted = row.tokens_per_s_per_gpu
        speed_ratios["all"].append(predicted / published)
        if run["precision"] in ("bf16", None):
            speed_ratios["bf16"].append(predicted / published)
        memory = row.memory["total"] / GIB
        if run["memory_gib"]:
            memory_ratios.append(memory / run["memory_gib"])
        name = run["model"] if isinstance(run["model"], str) else got["shape"].name
        refused = " (ultrascale refuses: " + "; ".join(row.problems) + ")" if row.problems else ""
        lines.append(
            f"| {run['source']} | {name} | {run['gpus']} x {run['gpu']} | {degrees} | {run['precision'] or '?'} "
            f"| {published:,} | {predicted:,.0f} | {_ratio(predicted, published)} "
            f"| {run['mfu'] if run['mfu'] is not None else '-'} | {row.mfu:.3f} "
            f"| {run['memory_gib'] if run['memory_gib'] else '-'} | {memory:.1f} | {_ratio(memory, run['memory_gib'])} "
            f"| {', '.join(got['assumed']) or '-'}{refused} |"
        )

    def inside(values: list[float]) -> str:
        n = sum(1 for v in values if 0.75 <= v <= 1.25)
        return f"{n} of {len(values)}"

    lines += [
        "",
        f"tokens/s per GPU inside 25%: {inside(speed_ratios['all'])} runs ({inside(speed_ratios['bf16'])} bf16 runs); "
        f"median ratio {statistics.median(speed_ratios['all']):.2f} (bf16 runs {statistics.median(speed_ratios['bf16']):.2f}).",
        f"peak memory inside 25%: {inside(memory_ratios)} runs with a published figure; median ratio "
        f"{statistics.median(memory_ratios):.2f}.",
        f"The achievable fraction that would centre the bf16 runs: "
        f"{options.efficiency / statistics.median(speed_ratios['bf16']):.2f} (the default stays {planner.Cluster.efficiency}).",
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
