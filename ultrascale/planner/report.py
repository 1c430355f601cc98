"""What `ultrascale plan` prints: the ranked table, what was searched, one row explained, and what
would fit when nothing does."""

from __future__ import annotations

import dataclasses
from typing import Any

from ultrascale.estimate import ModelShape
from ultrascale.hardware import COMPILE_SOURCE, COMPILE_SPEEDUP, FLOAT8_SOURCE, FLOAT8_SPEEDUP, GIB, Cluster
from ultrascale.planner.cost import PlanRow, Workload, matmul_gains
from ultrascale.planner.search import search

__all__ = ["compile_assumption", "describe_search", "explain", "format_table", "what_would_fit"]


def compile_assumption(work: Workload) -> str:
    """What the cluster line adds for a compiled (or Float8) plan ("" for an eager one): the factors and their sources."""
    if not work.compiled:
        return ""
    compile_gain, float8_gain = matmul_gains()
    text = (f"; compiled (torch.compile per block): compute outside attention / {compile_gain:.3f} (the published "
            f"{COMPILE_SPEEDUP:.3f} of {COMPILE_SOURCE}, attention's kernel unchanged)")
    if work.float8:
        text += (f"; Float8 matmuls: / {float8_gain:.3f} more (the published {FLOAT8_SPEEDUP:.3f} of {FLOAT8_SOURCE}, "
                 "attention's kernel unchanged)")
    return text + ", communication and memory as eager bf16"


_SHORT_SCHEDULES = {"GPipe": "G", "1F1B": "1F", "Interleaved1F1B": "I", "LoopedBFS": "L", "InterleavedZeroBubble": "IZ",
                    "ZBVZeroBubble": "ZV", "DualPipeV": "DV"}
"""The table's recompute column carries the schedule and its virtual stages: "none/I4" is Interleaved1F1B, v=4."""


def format_table(rows: list[PlanRow], top: int) -> str:
    header = (f"{'#':>3} {'pp':>3} {'dpr':>4} {'dps':>4} {'cp':>4} {'tp':>3} {'ep':>3} {'zero':>4} {'recomp/pp':>12} "
              f"{'mbs':>3} {'acc':>4} | {'params':>7} {'grads':>6} {'optim':>6} {'acts':>6} {'bufs':>5} {'total':>6} {'fits':>4} | "
              f"{'comp s':>7} {'comm s':>7} {'bubble':>7} {'step s':>7} | {'tok/s/GPU':>9} {'MFU':>5}")
    lines = [header, "-" * len(header)]
    for i, row in enumerate(rows[:top], 1):
        lay, mem, t = row.layout, {k: v / GIB for k, v in row.memory.items()}, row.step_time
        # a budget's blocks: "4f6s22n" is 4 full, 6 selective, 22 none
        mode = "{}f{}s{}n".format(*lay.recompute_blocks) if lay.recompute_blocks is not None else lay.recompute
        recompute = mode + (f"/{_SHORT_SCHEDULES[lay.schedule]}{lay.virtual_stages if lay.virtual_stages > 1 else ''}"
                                     if lay.pp > 1 else "")
        accumulation = f"{lay.grad_accumulation}{'w' if lay.accumulate_unsharded_grads else ''}"  # w: whole gradients
        # u: Ulysses (all-to-all) over all of cp; 4u2: USP, Ulysses over groups of 2, the ring across them
        ulysses = {"alltoall": "u", "usp": f"u{lay.cp_ulysses}"}.get(lay.cp_method, "") if lay.cp > 1 else ""
        cp = f"{lay.cp}{ulysses}"
        lines.append(
            f"{i:>3} {lay.pp:>3} {lay.dp_replicate:>4} {lay.dp_shard:>4} {cp:>4} {lay.tp:>3} {lay.ep:>3} {lay.zero_stage:>4} "
            f"{recompute:>12} {lay.micro_batch:>3} {accumulation:>4} | {mem['params']:>7.2f} {mem['grads']:>6.2f} "
            f"{mem['optimizer']:>6.2f} {mem['activations']:>6.2f} {mem['buffers']:>5.2f} {mem['total']:>6.2f} "
            f"{'yes' if row.fits else 'NO':>4} | {t['compute']:>7.3f} {t['communication']:>7.3f} {t['bubble']:>7.3f} "
            f"{t['total']:>7.3f} | {row.tokens_per_s_per_gpu:>9,.0f} {row.mfu:>5.1%}"
        )
    return "\n".join(lines)


def describe_search(shape: ModelShape, fixed: dict[str, Any]) -> str:
    """One line: the dimensions searched, what was fixed, and what was left out."""
    dims = "pp x dp_replicate x dp_shard x cp x tp" + (" x ep" if shape.n_experts else "")
    text = (f"{dims}; ZeRO-1/2/3 (ZeRO-0 when asked: it runs as dp_replicate alone); "
            "recompute none/selective/full; micro-batch 1-8; pipeline 1F1B (even and balanced splits), "
            "Interleaved1F1B (v=2 and the most the layers allow, up to 16) and ZBVZeroBubble; "
            "ZeRO-3 accumulation with sharded or whole gradients (acc 'w'); context parallel by ring or all-to-all "
            "(Ulysses, cp 'u')")
    if fixed:
        text += "; fixed " + ", ".join(f"{key}={value}" for key, value in fixed.items())
    left_out = ["GPipe, LoopedBFS, InterleavedZeroBubble and DualPipeV (priced with --layout schedule=NAME)"]
    if not shape.n_experts:
        left_out.append("ep (a dense model)")
    return text + ". Not searched: " + ", ".join(left_out)


def explain(row: PlanRow, cluster: Cluster) -> list[str]:
    """Two lines: the memory breakdown with its verdict, and the step time breakdown."""
    mem = {key: value / GIB for key, value in row.memory.items()}
    t = row.step_time
    if row.problems:
        verdict = "refused: " + "; ".join(row.problems)
    else:
        verdict = f"{'fits' if row.fits else 'does NOT fit'} in the {cluster.usable_bytes / GIB:.1f} GiB planned for"
    return [
        f"per GPU    parameters {mem['params']:.2f} + gradients {mem['grads']:.2f} + optimizer {mem['optimizer']:.2f} + "
        + f"activations {mem['activations']:.2f} + buffers {mem['buffers']:.2f} = {mem['total']:.2f} GiB: {verdict}",
        f"step       compute {t['compute']:.3f} s + exposed communication {t['communication']:.3f} s + bubble "
        f"{t['bubble']:.3f} s = {t['total']:.3f} s; {row.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {row.mfu:.1%}",
    ]


def what_would_fit(shape: ModelShape, cluster: Cluster, work: Workload, fixed: dict[str, Any], hf_config: Any = None) -> list[str]:
    """When nothing fits: the best layout without the fixed values, else the fewest GPUs (or a larger GPU) that fit."""
    if fixed:
        rows = [row for row in search(shape, cluster, work, None, hf_config, top=1) if row.fits]
        if rows:
            return [f"would fit  without {', '.join(f'{k}={v}' for k, v in fixed.items())}: {rows[0].layout.describe()} "
                    f"({rows[0].memory['total'] / GIB:.1f} GiB, {rows[0].tokens_per_s_per_gpu:,.0f} tokens/s per GPU)"]
    for factor in (2, 4, 8, 16, 32):
        bigger = dataclasses.replace(cluster, gpus=cluster.gpus * factor)
        batch = max(work.global_batch, bigger.gpus) if work.global_batch % bigger.gpus else work.global_batch
        rows = [row for row in search(shape, bigger, dataclasses.replace(work, global_batch=batch), None, hf_config, top=1)
                if row.fits]
        if rows:
            return [f"would fit  on {bigger.gpus} GPUs: {rows[0].layout.describe()} ({rows[0].memory['total'] / GIB:.1f} GiB per GPU)"]
    return ["would fit  on none of up to 32x the GPUs: shorten the sequence or use a larger GPU (--gpu)"]

