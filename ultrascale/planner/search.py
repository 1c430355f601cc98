"""The search: every layout of the GPUs and batch (`candidate_layouts`), priced and ranked (`search`),
and why none with some fixed values is chosen (`why_not`)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator
from collections.abc import Iterable
from typing import Any, Optional

from ultrascale.estimate import ModelShape
from ultrascale.hardware import GIB, Cluster
from ultrascale.parallel import rules
from ultrascale.parallel.dims import zero_ranks
from ultrascale.parallel.pipeline import even_layers
from ultrascale.parallel.rules import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, batch_split_problem
from ultrascale.planner.cost import PlanRow, Workload, communication_floor, evaluate, model_state_floor, peak_memory, step_time_floor
from ultrascale.planner.layouts import KNOB_DIMENSIONS, RECOMPUTE_MODES, Layout, layout_problems, model_facts_of, runs_as
from ultrascale.planner.pipeline import balanced_layers

__all__ = ["candidate_layouts", "search", "why_not"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, cluster: Cluster, work: Workload, fixed: Optional[dict[str, Any]] = None,
                      max_micro_batch: int = 8, left_out: Optional[dict[str, int]] = None) -> Iterable[Layout]:
    """Every factorisation of the GPUs and batch, restricted to the `fixed` values. `left_out`, if given, counts
    why a degree split was not a candidate (the reason -> how many times)."""
    for fields in _candidate_fields(shape, cluster, work, fixed, max_micro_batch, left_out):
        yield Layout(*fields)


# A candidate's fields in `Layout`'s order (a search makes a `Layout` only for the candidates it reaches); the last,
# a budget's blocks, is never in a candidate: `evaluate` chooses it.
(_PP, _DP_REPLICATE, _DP_SHARD, _CP, _TP, _EP, _ZERO, _MICRO_BATCH, _ACCUMULATION, _RECOMPUTE, _VIRTUAL_STAGES, _SCHEDULE,
 _LAYERS, _UNSHARDED, _CP_METHOD, _CP_ULYSSES, _GRADS_FP32, _RECOMPUTE_BLOCKS) = range(18)
_STATE_FIELDS = (_PP, _DP_REPLICATE, _DP_SHARD, _CP, _TP, _EP, _ZERO, _VIRTUAL_STAGES, _SCHEDULE, _LAYERS, _GRADS_FP32)
"""What a layout's model state on its first pipeline rank depends on (`model_state_floor`): the degrees, the ZeRO
stage and the pipeline's stages (virtual stages, schedule, layer split)."""
_COMPUTE_FIELDS = (_PP, _CP, _TP, _MICRO_BATCH, _ACCUMULATION, _RECOMPUTE)
"""What a layout's compute depends on; with a calibration also its family's degrees (`_FAMILY_FIELDS`)."""
_FAMILY_FIELDS = (_DP_REPLICATE, _DP_SHARD, _EP)


def _candidate_fields(shape: ModelShape, cluster: Cluster, work: Workload, fixed: Optional[dict[str, Any]],
                      max_micro_batch: int, left_out: Optional[dict[str, int]] = None) -> Iterable[tuple]:
    fixed = dict(fixed or {})
    left_out = {} if left_out is None else left_out

    def leave_out(reason: str) -> None:
        left_out[reason] = left_out.get(reason, 0) + 1

    n = cluster.gpus
    grads_fp32 = fixed.get("accumulate_grads_in_fp32")  # a precision knob, not searched
    pow2 = lambda limit: [d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d <= limit]  # noqa: E731
    # A fixed knob of a free dimension (a schedule without pp, a cp method without cp) asks for that dimension.
    asked = {KNOB_DIMENSIONS[knob]: knob for knob in sorted(fixed.keys() & KNOB_DIMENSIONS.keys())}
    least = {dim: 2 if dim in asked else 1 for dim in ("pp", "cp")}
    tps = [fixed["tp"]] if "tp" in fixed else [d for d in pow2(cluster.gpus_per_node) if n % d == 0]
    pps = [fixed["pp"]] if "pp" in fixed else [d for d in _divisors(n) if least["pp"] <= d <= min(shape.n_layers, 64)]
    cps = [fixed["cp"]] if "cp" in fixed else [d for d in pow2(32) if n % d == 0 and d >= least["cp"]]
    for dim, degrees in (("pp", pps), ("cp", cps)):
        if not degrees and dim in asked:
            leave_out(f"{asked[dim]} asks for {dim} above 1, and no such degree divides the {n} GPUs")
    zeros = [fixed["zero_stage"]] if "zero_stage" in fixed else [1, 2, 3]
    recomputes = [fixed["recompute"]] if "recompute" in fixed else list(RECOMPUTE_MODES)
    eps = [fixed["ep"]] if "ep" in fixed else ([d for d in _divisors(shape.n_experts) if d <= n] if shape.n_experts else [1])
    pipelines = {pp: _pipelines(shape, pp, fixed) for pp in pps}  # the same few per pp, asked for by every other split
    cp_methods = {(cp, tp): _cp_methods(cp, tp, cluster, fixed) for cp in cps for tp in tps}
    for pp, tp, cp in itertools.product(pps, tps, cps):
        if n % (pp * tp * cp):
            if fixed.keys() & {"pp", "tp", "cp"}:  # otherwise only the enumeration's own products
                leave_out(f"pp x tp x cp must divide the {n} GPUs")
            continue
        dp = n // (pp * tp * cp)
        replicates = [fixed["dp_replicate"]] if "dp_replicate" in fixed else _divisors(dp)
        for dpr in replicates:
            if dp % dpr:
                leave_out("dp_replicate must divide the data-parallel ranks pp x tp x cp leave")
                continue
            dps = dp // dpr
            if "dp_shard" in fixed and fixed["dp_shard"] != dps:
                leave_out(f"dp_shard={fixed['dp_shard']} x dp_replicate x pp x tp x cp must make the {n} GPUs")
                continue
            split = batch_split_problem(work.global_batch, dp, f"the global batch of {work.global_batch} sequences")
            if split is not None:
                leave_out(split.text())
                continue
            local = work.global_batch // dp
            mbs_options = [fixed["micro_batch"]] if "micro_batch" in fixed else [d for d in _divisors(local) if d <= max_micro_batch]
            # Over one ZeRO rank, stage 2 shards nothing more than stage 1: one layout, priced and run alike.
            stages = [z for z in zeros if not (z == 2 and 1 in zeros and zero_ranks(dps, cp) == 1)]
            for mbs, zero, recompute, ep in itertools.product(mbs_options, stages, recomputes, eps):
                if local % mbs:
                    leave_out(f"micro_batch={mbs} must divide the sequences each data-parallel rank holds")
                    continue
                acc = local // mbs
                if "grad_accumulation" in fixed and fixed["grad_accumulation"] != acc:
                    leave_out(f"grad_accumulation={fixed['grad_accumulation']} x micro_batch x dp must make the global "
                              f"batch of {work.global_batch}")
                    continue
                unsharded = ([fixed["accumulate_unsharded_grads"]] if "accumulate_unsharded_grads" in fixed
                             else [False, True] if zero == 3 and pp == 1 and acc > 1 else [False])
                for (schedule, v, layers), whole, (method, ulysses) in itertools.product(
                        pipelines[pp], unsharded, cp_methods[(cp, tp)]):
                    yield (pp, dpr, dps, cp, tp, ep, zero, mbs, acc, recompute, v, schedule, layers, whole, method, ulysses,
                           grads_fp32)


def _cp_methods(cp: int, tp: int, cluster: Cluster, fixed: dict[str, Any]) -> list[tuple[str, int]]:
    """(context_parallel_method, USP's Ulysses degree) for `cp` ranks: the ring and Ulysses over all of cp; and where
    cp x tp spans more than a node, USP with the largest Ulysses group that stays inside one (the all-to-alls on the
    node's links, the ring across nodes). A fixed `cp_method=usp` without `cp_ulysses` takes that group too; a fixed
    `cp_ulysses` alone means USP."""
    if cp == 1:
        return [("ring", 1)]
    inside_node = max((u for u in range(2, cp) if cp % u == 0 and u * tp <= cluster.gpus_per_node), default=None)
    if "cp_method" in fixed or "cp_ulysses" in fixed:  # a Ulysses degree alone asks for USP
        method = fixed.get("cp_method", "usp")
        return [(method, fixed.get("cp_ulysses", inside_node or 2) if method == "usp" else 1)]
    usp = [("usp", inside_node)] if inside_node is not None and cp * tp > cluster.gpus_per_node else []
    return [("ring", 1), ("alltoall", 1), *usp]


SEARCHED_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
"""The schedules the search tries. The others are priced when asked (`--layout schedule=NAME`): GPipe has 1F1B's
bubble and holds all m micro-batches; LoopedBFS holds more than Interleaved1F1B for its bubble; torch's
InterleavedZeroBubble and DualPipeV lists leave about ZBVZeroBubble's bubble (benchmarks/pp_bubble.py)."""
SEARCHED_VIRTUAL_STAGES = (2,)
"""Virtual stages per rank the search tries for Interleaved1F1B, with the most the model allows (up to 16, at least
one layer per stage); `--layout v=N` prices any count the strategy accepts."""


def _pipelines(shape: ModelShape, pp: int, fixed: dict[str, Any]) -> list[tuple[Optional[str], int, Optional[tuple[int, ...]]]]:
    """(schedule, virtual stages, pipeline_layers) for `pp` pipeline ranks. A fixed `pipeline_layers` ("even",
    "balanced" or the counts) is taken as given; otherwise 1F1B tries the strategy's even split (None) and
    `balanced_layers`, and the multi-stage schedules the even split where the strategy accepts it (the stages
    divide the layers), else the balanced one."""
    if pp == 1:
        return [(None, 1, None)]
    wanted = fixed.get("pipeline_layers")
    options = []
    for schedule in [fixed["pipeline_schedule"]] if "pipeline_schedule" in fixed else SEARCHED_SCHEDULES:
        if "virtual_stages" in fixed:
            vs = [fixed["virtual_stages"]]
        elif schedule in SINGLE_STAGE_SCHEDULES:
            vs = [1]
        elif schedule in V_SCHEDULES:
            vs = [2]
        else:
            splits_exist = [v for v in range(2, 17) if pp * v <= shape.n_layers
                            and (shape.n_layers % (pp * v) == 0 or balanced_layers(shape.n_layers, pp * v))]
            vs = sorted({v for v in SEARCHED_VIRTUAL_STAGES if v in splits_exist} | set(splits_exist[-1:])) or [2]
        for v in vs:
            stages = pp * v
            balanced = balanced_layers(shape.n_layers, stages)
            if isinstance(wanted, tuple):
                splits = [wanted]
            elif wanted == "even":
                splits = [None]
            elif wanted == "balanced":
                splits = [balanced] if balanced is not None else []
            elif v == 1:
                splits = [None] + ([balanced] if balanced not in (None, even_layers(shape.n_layers, stages)) else [])
            else:
                splits = [None if shape.n_layers % stages == 0 or balanced is None else balanced]
            options += [(schedule, v, split) for split in splits]
    return options


def search(shape: ModelShape, cluster: Cluster, work: Workload, fixed: Optional[dict[str, Any]] = None,
           hf_config: Any = None, include_refused: bool = False, max_micro_batch: int = 8,
           top: Optional[int] = None) -> list[PlanRow]:
    """All candidate layouts (micro-batches up to `max_micro_batch` sequences), costed: fitting ones first by
    predicted tokens/s per GPU (then less memory).

    With `top`, only the rows that can be among the `top` best fitting ones are priced, and those are the same rows
    in the same order as without it. Each candidate's ceiling is cheap: tokens over `step_time_floor` (its compute
    alone) plus `communication_floor` (the collectives nothing hides). Candidates are priced from the highest
    ceiling down, and once `top` fitting rows are found, a candidate whose ceiling is below the `top`-th best
    tokens/s (and every one after it) cannot enter them; a pipelined one the rulebook accepts is also skipped when
    its schedule's bubble brings it below, and any one whose memory (`peak_memory`, which needs no step times) exceeds
    the GPU's, before the rulebook judges it. Fewer than `top` fitting rows: every candidate is priced, as without it."""
    candidates = list(_candidate_fields(shape, cluster, work, fixed, max_micro_batch))
    order = list(range(len(candidates)))
    # The floors depend only on what sets the compute (the compute's sum over stages not on their split or schedule,
    # the played step on both; with a calibration, also the degrees that make the layout's family) and, for the
    # communication, on everything but the recompute mode: memos keyed so.
    floors: dict[tuple, float] = {}
    played_floors: dict[tuple, float] = {}
    communication: dict[tuple, float] = {}
    memory: dict[tuple, float] = {}  # keyed without the cp method and Ulysses degree: activations do not depend on them

    compute_key = operator.itemgetter(*_COMPUTE_FIELDS, *(_FAMILY_FIELDS if cluster.calibration else ()))

    def communication_of(fields: tuple) -> float:
        key = fields[:_RECOMPUTE] + fields[_RECOMPUTE + 1:]
        if key not in communication:
            communication[key] = communication_floor(shape, Layout(*fields), cluster, work, hf_config)
        return communication[key]

    def ceiling_with_bubble(layout: Layout, fields: tuple) -> float:
        key = (*compute_key(fields), *fields[_VIRTUAL_STAGES:_LAYERS + 1])
        if key not in played_floors:
            played_floors[key] = step_time_floor(shape, layout, cluster, work, hf_config, schedule=True)
        return work.tokens / (played_floors[key] + communication_of(fields)) / cluster.gpus

    pruning = top is not None and not include_refused
    best: list[float] = []  # a min-heap of the `top` best fitting tokens/s so far
    priced: list[tuple[PlanRow, int]] = []
    too_big: list[int] = []  # cannot fit: priced only if fewer than `top` rows fit (their rows then follow those)
    ceiling: list[float] = []
    if pruning:  # `communication_of` inlined: this loop meets every candidate (400k at 16,384 GPUs)
        states: dict[tuple, float] = {}
        state_key = operator.itemgetter(*_STATE_FIELDS)
        for index, fields in enumerate(candidates):
            key = state_key(fields)
            state = states.get(key)
            if state is None:
                state = states[key] = model_state_floor(shape, Layout(*fields), work)
            if state > cluster.usable_bytes:  # no communication floor for what cannot fit (a third at 16,384 GPUs)
                too_big.append(index)
                ceiling.append(-1.0)
                continue
            key = compute_key(fields)
            floor = floors.get(key)
            if floor is None:
                floor = floors[key] = step_time_floor(shape, Layout(*fields), cluster, work, hf_config)
            key = fields[:_RECOMPUTE] + fields[_RECOMPUTE + 1:]
            exposed = communication.get(key)
            if exposed is None:
                exposed = communication[key] = communication_floor(shape, Layout(*fields), cluster, work, hf_config)
            ceiling.append(work.tokens / (floor + exposed) / cluster.gpus)
        order = [index for index in order if ceiling[index] >= 0]
        order.sort(key=ceiling.__getitem__, reverse=True)

    pipelines_refused: dict[tuple, bool] = {}

    def pipeline_refused(fields: tuple) -> bool:
        """The rulebook's pipeline rule alone (its other rules need the whole layout, and cost more)."""
        key = (fields[_PP], fields[_SCHEDULE], fields[_VIRTUAL_STAGES], fields[_ACCUMULATION], fields[_LAYERS])
        if key not in pipelines_refused:
            n_layers = model_facts_of(shape, hf_config).n_layers
            pipelines_refused[key] = n_layers is None or bool(rules.pipeline_problems(
                n_layers=n_layers, pp=key[0], schedule=key[1], virtual_stages=key[2], microbatches=key[3],
                layers_per_stage=key[4]))
        return pipelines_refused[key]

    def price(index: int) -> None:
        fields = candidates[index]
        layout = Layout(*fields)
        # The bubble and the memory first: they need only a pipeline torch can build, and rule out most of what the
        # loop reaches (at 16,384 GPUs, 45k of 48k) for less than the whole rulebook costs.
        if pruning and (layout.pp == 1 or not pipeline_refused(fields)):
            if len(best) >= top and layout.pp > 1 and ceiling_with_bubble(layout, fields) < best[0]:
                return  # the bubble too: the schedule `evaluate` would play
            key = fields[:_CP_METHOD] + fields[_GRADS_FP32:]
            if key not in memory:  # a budget's least memory: every block full
                memory[key] = peak_memory(shape, dataclasses.replace(layout, recompute="full")
                                          if layout.recompute == "budget" else layout, work, hf_config)
            if memory[key] > cluster.usable_bytes:
                too_big.append(index)
                return
        problems = None
        if not include_refused:  # judge first, price only what runs
            if layout_problems(layout, shape, cluster, work.seq_len, work.global_batch, hf_config):
                return
            problems = [] if runs_as(layout) == layout else None  # what `evaluate` would judge again
        row = evaluate(shape, layout, cluster, work, hf_config, problems=problems)
        priced.append((row, index))
        if pruning and row.fits:
            heapq.heappush(best, row.tokens_per_s_per_gpu)
            if len(best) > top:
                heapq.heappop(best)

    for index in order:
        if pruning and len(best) >= top and ceiling[index] < best[0]:
            break  # the ceilings only fall from here: nothing left can enter the top rows
        price(index)
    if pruning and len(best) < top:  # every candidate was reached: the rows as without `top`
        pruning = False
        for index in too_big:
            price(index)
    priced.sort(key=lambda pair: (rank_key(pair[0]), pair[1]))  # candidate order breaks ties, as a stable sort did
    return [row for row, _ in priced]


def rank_key(row: PlanRow) -> tuple:
    """The order of `search`'s rows: fitting ones first, by predicted tokens/s per GPU, then less memory."""
    return (not row.fits, bool(row.problems), -row.tokens_per_s_per_gpu, row.memory["total"])


def why_not(shape: ModelShape, cluster: Cluster, work: Workload, fixed: dict[str, Any], hf_config: Any = None) -> list[str]:
    """Why no layout with the `fixed` values is chosen: the refusals and memory shortfalls, most common first."""
    rows = search(shape, cluster, work, fixed, hf_config, include_refused=True)
    if not rows:
        left_out: dict[str, int] = {}
        for _ in candidate_layouts(shape, cluster, work, fixed, left_out=left_out):
            pass
        wanted = ", ".join(f"{k}={v}" for k, v in fixed.items())
        return [f"no layout of {cluster.gpus} GPUs has {wanted} with a global batch of {work.global_batch} sequences:"] + [
            f"{reason} ({count} degree split{'s' if count > 1 else ''} left out)"
            for reason, count in sorted(left_out.items(), key=lambda kv: -kv[1])]
    if any(row.fits for row in rows):
        best = next(row for row in rows if row.fits)
        return [f"it is possible: best such layout {best.layout.describe()} at {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"]
    reasons: dict[str, int] = {}
    for row in rows:
        for problem in row.problems or [f"needs at least {min(r.memory['total'] for r in rows if not r.problems) / GIB:.1f} GiB "
                                        f"per GPU, more than the {cluster.usable_bytes / GIB:.1f} GiB planned for"]:
            reasons[problem] = reasons.get(problem, 0) + 1
    return [f"{reason} ({count} of {len(rows)} candidates)" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])]

