"""The search: every layout of the GPUs and batch (`candidate_layouts`), priced and ranked (`search`),
and why none with some fixed values is chosen (`why_not`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Optional

from ultrascale.estimate import ModelShape
from ultrascale.planner.cost import PlanRow, Workload, evaluate
from ultrascale.planner.hardware import GIB, Cluster
from ultrascale.planner.layouts import RECOMPUTE_MODES, Layout, layout_problems

__all__ = ["candidate_layouts", "search", "why_not"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, cluster: Cluster, work: Workload, fixed: Optional[dict[str, Any]] = None,
                      max_micro_batch: int = 8) -> Iterable[Layout]:
    """Every factorisation of the GPUs and batch, restricted to the `fixed` values."""
    fixed = dict(fixed or {})
    n = cluster.gpus
    pow2 = lambda limit: [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= limit]  # noqa: E731
    tps = [fixed["tp"]] if "tp" in fixed else [d for d in pow2(cluster.gpus_per_node) if n % d == 0]
    pps = [fixed["pp"]] if "pp" in fixed else [d for d in _divisors(n) if d <= shape.n_layers and d <= 64]
    cps = [fixed["cp"]] if "cp" in fixed else [d for d in pow2(32) if n % d == 0]
    zeros = [fixed["zero_stage"]] if "zero_stage" in fixed else [1, 2, 3]
    recomputes = [fixed["recompute"]] if "recompute" in fixed else list(RECOMPUTE_MODES)
    eps = [fixed["ep"]] if "ep" in fixed else ([d for d in _divisors(shape.n_experts) if d <= n] if shape.n_experts else [1])
    for pp, tp, cp in itertools.product(pps, tps, cps):
        if n % (pp * tp * cp):
            continue
        dp = n // (pp * tp * cp)
        replicates = [fixed["dp_replicate"]] if "dp_replicate" in fixed else _divisors(dp)
        for dpr in replicates:
            if dp % dpr:
                continue
            dps = dp // dpr
            if "dp_shard" in fixed and fixed["dp_shard"] != dps:
                continue
            if work.global_batch % dp:
                continue
            local = work.global_batch // dp
            mbs_options = [fixed["micro_batch"]] if "micro_batch" in fixed else [d for d in _divisors(local) if d <= max_micro_batch]
            for mbs, zero, recompute, ep in itertools.product(mbs_options, zeros, recomputes, eps):
                if local % mbs:
                    continue
                acc = local // mbs
                if "grad_accumulation" in fixed and fixed["grad_accumulation"] != acc:
                    continue
                vs = [fixed["virtual_stages"]] if "virtual_stages" in fixed else ([1, 2] if pp > 1 else [1])
                unsharded = ([fixed["accumulate_unsharded_grads"]] if "accumulate_unsharded_grads" in fixed
                             else [False, True] if zero == 3 and pp == 1 and acc > 1 else [False])
                methods = [fixed["cp_method"]] if "cp_method" in fixed else (["ring", "alltoall"] if cp > 1 else ["ring"])
                for v, whole, method in itertools.product(vs, unsharded, methods):
                    yield Layout(pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, ep=ep, zero_stage=zero,
                                 micro_batch=mbs, grad_accumulation=acc, recompute=recompute, virtual_stages=v,
                                 accumulate_unsharded_grads=whole, cp_method=method)


def search(shape: ModelShape, cluster: Cluster, work: Workload, fixed: Optional[dict[str, Any]] = None,
           hf_config: Any = None, include_refused: bool = False) -> list[PlanRow]:
    """All candidate layouts, costed: fitting ones first by predicted tokens/s per GPU (then less memory)."""
    layouts = candidate_layouts(shape, cluster, work, fixed)
    if not include_refused:  # judge first, price only what runs
        layouts = (lay for lay in layouts if not layout_problems(lay, shape, cluster, work.seq_len, work.global_batch, hf_config))
    rows = [evaluate(shape, layout, cluster, work, hf_config) for layout in layouts]
    rows.sort(key=lambda row: (not row.fits, bool(row.problems), -row.tokens_per_s_per_gpu, row.memory["total"]))
    return rows


def why_not(shape: ModelShape, cluster: Cluster, work: Workload, fixed: dict[str, Any], hf_config: Any = None) -> list[str]:
    """Why no layout with the `fixed` values is chosen: the refusals and memory shortfalls, most common first."""
    rows = search(shape, cluster, work, fixed, hf_config, include_refused=True)
    if not rows:
        return [f"no layout of {cluster.gpus} GPUs has {', '.join(f'{k}={v}' for k, v in fixed.items())} "
                f"with a global batch of {work.global_batch} sequences"]
    if any(row.fits for row in rows):
        best = next(row for row in rows if row.fits)
        return [f"it is possible: best such layout {best.layout.describe()} at {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"]
    reasons: dict[str, int] = {}
    for row in rows:
        for problem in row.problems or [f"needs at least {min(r.memory['total'] for r in rows if not r.problems) / GIB:.1f} GiB "
                                        f"per GPU, more than the {cluster.usable_bytes / GIB:.1f} GiB planned for"]:
            reasons[problem] = reasons.get(problem, 0) + 1
    return [f"{reason} ({count} of {len(rows)} candidates)" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])]

