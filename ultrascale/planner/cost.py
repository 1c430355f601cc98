"""The price of one layout: memory per GPU (model states by ZeRO stage, activations, buffers) and step
time (compute, exposed communication, pipeline bubble), with the predicted MFU (`evaluate`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ultrascale.estimate import ActivationModel, ModelShape, state_bytes
from ultrascale.hardware import COMPILE_SPEEDUP, FLOAT8_SPEEDUP, GIB, Cluster
from ultrascale.parallel.loss import loss_chunk_tokens_of
from ultrascale.parallel.pipeline import PipelineLayout, even_layers, head_holds_tied_copy
from ultrascale.parallel.rules import expert_split
from ultrascale.planner.calibration import family_ratio
from ultrascale.planner.layouts import Layout, layout_problems, model_facts_of, runs_as
from ultrascale.planner.pipeline import PipelinePlay, held_layers, play, timeline

__all__ = ["PlanRow", "Workload", "cheapest_recompute", "evaluate", "pipeline_of", "pipeline_timeline", "rank_parts", "stage_model_state"]


@dataclass
class PlanRow:
    """A layout with its predicted memory and time per GPU."""

    layout: Layout
    fits: bool
    memory: dict[str, float]
    """Bytes per GPU: params, grads, optimizer (model state: the formulas), activations, buffers, total (the worst
    pipeline stage)."""
    step_time: dict[str, float]
    """Seconds per optimizer step: compute, communication (exposed), bubble, total."""
    tokens_per_s_per_gpu: float
    mfu: float
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    model_state: dict[str, float] = field(default_factory=dict)
    """Bytes per GPU of weights, gradients and optimizer state as the ZeRO formulas give them (that stage's), whatever
    exists at the peak moment `memory` describes (FSDP's gradients, for one, do not exist during the forward)."""

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {key: value for key, value in asdict(self.layout).items()}
        row["schedule"] = self.layout.schedule
        row["fits"] = self.fits
        row["memory_gib"] = {key: round(value / GIB, 4) for key, value in self.memory.items()}
        if self.model_state:
            state = {key: round(value / GIB, 4) for key, value in self.model_state.items()}
            row["model_state_gib"] = {**state, "total": round(sum(self.model_state.values()) / GIB, 4)}
        row["step_time_s"] = {key: round(value, 6) for key, value in self.step_time.items()}
        ran = runs_as(self.layout)
        if ran != self.layout:  # ZeRO-0: what ultrascale runs for it
            row["runs_as"] = {"dp_replicate": ran.dp_replicate, "dp_shard": ran.dp_shard, "zero_stage": ran.zero_stage}
        row["tokens_per_s_per_gpu"] = round(self.tokens_per_s_per_gpu, 2)
        row["mfu"] = round(self.mfu, 4)
        if self.problems:
            row["problems"] = self.problems
        return row


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    precision: str = "bf16-mixed"
    attention_scores_saved: bool = False
    compiled: bool = False
    """Each block under torch.compile (the strategies' `compile=True`): the compute outside attention's kernel is
    faster by `matmul_gains`' compile factor."""
    float8: bool = False
    """Float8 matmuls (`Float8Training`) in compiled blocks: the compute outside attention's kernel is also faster by
    `matmul_gains`' Float8 factor."""
    loss_chunk_tokens: int | None = None
    """The models' `loss_chunk_tokens`: None, the default chunk where the model fuses its head and loss and the layout
    has no pipeline; 0, the whole logits (`parallel.loss.loss_chunk_tokens_of`)."""

    def __post_init__(self) -> None:
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            raise ValueError(f"Workload: `loss_chunk_tokens={self.loss_chunk_tokens}` must be a positive number of tokens, "
                             "0 (the whole logits) or None (the model's default)")
        if self.float8 and not self.compiled:
            raise ValueError("Float8 is priced compiled only (its published gain is on top of torch.compile): "
                             "Workload(float8=True) needs compiled=True")

    @property
    def speedup(self) -> float:
        """Time eager bf16 / as run of the compute outside attention's kernel (matmuls, norms, activations)."""
        compile_gain, float8_gain = matmul_gains()
        return (compile_gain if self.compiled else 1.0) * (float8_gain if self.float8 else 1.0)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "32-true" else 2


SPEEDUP_SOURCE_RUN = ("llama3_8b", 8192)
"""(preset, sequence length) of the run `COMPILE_SPEEDUP` and `FLOAT8_SPEEDUP` were published for (torchtitan's
Llama 3.1 8B at 8,192 tokens, `ultrascale.hardware`)."""


@functools.cache
def matmul_gains() -> tuple[float, float]:
    """(compile, Float8) speed-ups of the compute outside attention's kernel.

    torch.compile fuses the blocks' other ops and Float8 runs their matmuls in fp8; neither changes the fused attention
    kernel (SDPA's flash / cuDNN, or the context-parallel one). The published whole-compute gains S were measured on
    a run whose attention is a share a of its FLOPs, so the gain g of the rest solves 1/S = a + (1 - a)/g:
    g = (1 - a) / (1/S - a). On that run the planner then reproduces S exactly; at 262k tokens (a ~ 0.9) the gains
    nearly vanish, as torchtitan's long-context rows show."""
    from ultrascale.models.adapters import model_shape

    preset, seq_len = SPEEDUP_SOURCE_RUN
    source = model_shape(preset)
    share = _attention_share(source, seq_len)
    compile_gain = (1 - share) / (1 / COMPILE_SPEEDUP - share)
    both = (1 - share) / (1 / (COMPILE_SPEEDUP * FLOAT8_SPEEDUP) - share)
    return compile_gain, both / compile_gain


def _attention_share(shape: ModelShape, seq_len: int) -> float:
    """Attention scores' share of the training FLOPs per token (12·L·h·s of 6N + 12·L·h·s)."""
    return 12 * shape.n_layers * shape.q_width * seq_len / shape.flops_per_token(seq_len)


def pipeline_of(shape: ModelShape, lay: Layout) -> PipelineLayout | None:
    """The strategy's pipeline for `lay` (None without one): its schedule, stages and layer split (`pipeline_layers`
    when it fits the stages, else the strategy's even split)."""
    if lay.pp == 1:
        return None
    return _memoised(shape, "pipeline", (lay.pp, lay.schedule, lay.virtual_stages, lay.grad_accumulation, lay.pipeline_layers),
                     lambda: _pipeline_of(shape, lay))


def _pipeline_of(shape: ModelShape, lay: Layout) -> PipelineLayout:
    stages = lay.pp * lay.virtual_stages
    layers = lay.pipeline_layers
    if layers is None or len(layers) != stages or sum(layers) != shape.n_layers:
        layers = even_layers(shape.n_layers, stages)
    return PipelineLayout(pp=lay.pp, schedule=lay.schedule, virtual_stages=lay.virtual_stages,
                          microbatches=lay.grad_accumulation, layers_per_stage=tuple(layers))


def _played(pipe: PipelineLayout, times: tuple[list[float], list[float], list[float]]) -> PipelinePlay:
    """`play`, in units of the first stage's forward: a search asks for the same few pipelines at many scales."""
    unit = times[0][0] or 1.0
    scaled = tuple(tuple(t / unit for t in kind) for kind in times)
    result = _played_in_units(pipe, scaled)
    return PipelinePlay(step=result.step * unit, busiest=result.busiest * unit, peak_layers=result.peak_layers)


@functools.lru_cache(maxsize=4096)
def _played_in_units(pipe: PipelineLayout, times: tuple[tuple[float, ...], ...]) -> PipelinePlay:
    return play(pipe.schedule, pipe, *times)


def rank_parts(shape: ModelShape, pipe: PipelineLayout | None) -> list[tuple[int, bool, bool]]:
    """Per pipeline rank: (its layers over all its stages, whether it holds the embedding, whether the head)."""
    if pipe is None:
        return [(shape.n_layers, True, True)]
    return list(_pipeline_ranks(pipe))


@functools.lru_cache(maxsize=4096)
def _pipeline_ranks(pipe: PipelineLayout) -> tuple[tuple[int, bool, bool], ...]:
    last = pipe.num_stages - 1
    return tuple((sum(pipe.layers_per_stage[s] for s in ids), 0 in ids, last in ids)
                 for ids in (pipe.stage_ids(r) for r in range(pipe.pp)))


def _memoised(shape: ModelShape, table: str, key: tuple, compute: Any) -> Any:
    """`compute()`, kept on `shape` under (table, key): a search prices the same few stages hundreds of thousands
    of times (the cache lives and dies with the shape, as `ModelShape.param_counts` does)."""
    cache = shape.__dict__.setdefault("_planner_cache", {})
    value = cache.get((table, key))
    if value is None:
        value = cache[(table, key)] = compute()
    return value


def _stage_params(shape: ModelShape, layout: Layout, layers: int, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters one rank of this stage holds before ZeRO sharding (after tp / ep)."""
    return _memoised(shape, "stage_params", (layout.tp, layout.ep, layers, first, last),
                     lambda: _count_stage_params(shape, layout.tp, layout.ep, layers, first, last))


def _count_stage_params(shape: ModelShape, t: int, ep: int, layers: int, first: bool, last: bool) -> tuple[float, float]:
    counts = shape.param_counts()
    L = shape.n_layers
    dense = 0.0
    if first:
        dense += counts["embedding"] / t
    if last:
        dense += (counts["head"] / t) + counts["final_norm"]
        if shape.tied_embeddings and not first:
            dense += counts["embedding"] / t
    moe_fraction = shape.moe_layers / L
    dense += layers * (shape.attention_params / t + shape.norm_params)
    dense += layers * (1 - moe_fraction) * shape.dense_mlp_params / t
    shared = 3 * shape.hidden * shape.shared_expert_hidden  # split by tp like a dense MLP
    dense += layers * moe_fraction * (shape.router_params - shared + shared / t)
    experts = layers * moe_fraction * shape.expert_params / expert_split(ep, t)
    return dense, experts


def stage_model_state(shape: ModelShape, layout: Layout, work: Workload, layers: int, first: bool, last: bool) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on one rank of a pipeline stage.

    ZeRO-1 shards the optimizer state over the n = dp_shard·cp ranks, ZeRO-2 also the
    gradients, ZeRO-3 also the weights (Rajbhandari et al. 2020); the bytes per parameter are
    ultrascale's (`estimate.state_bytes`). Experts are split over ep first, and their shards over the
    n/ep ranks that hold the same experts."""
    layout = runs_as(layout)
    key = (layout.zero_stage, layout.dp_shard, layout.cp, layout.tp, layout.ep, work.precision, layers, first, last,
           layout.pp > 1, layout.accumulate_grads_in_fp32)
    return dict(_memoised(shape, "model_state", key, lambda: _model_state(shape, layout, work, layers, first, last)))


def _model_state(shape: ModelShape, layout: Layout, work: Workload, layers: int, first: bool, last: bool) -> dict[str, float]:
    w_bytes, g_bytes, o_bytes = state_bytes(work.precision, layout.zero_stage, layout.accumulate_grads_in_fp32)
    n = layout.zero_ranks
    dense, experts = _stage_params(shape, layout, layers, first, last)
    # ZeRO-0 runs as unsharded HSDP (`runs_as`); with cp it is refused but still priced: everything replicated.
    def shards(ranks: int) -> tuple[int, int, int]:
        return {0: (1, 1, 1), 1: (1, 1, ranks), 2: (1, ranks, ranks), 3: (ranks, ranks, ranks)}[layout.zero_stage]

    div, expert_div = shards(n), shards(max(n // layout.ep, 1))
    # The head's copy of a tied weight, sharded alike: its weight, and its gradient until the step sums it in; no
    # optimizer state.
    mirror = (shape.param_counts()["embedding"] / layout.tp
              if shape.tied_embeddings and head_holds_tied_copy(layout.zero_stage, layout.pp > 1 and first and last)
              else 0.0)
    return {
        "params": (dense + mirror) * w_bytes / div[0] + experts * w_bytes / expert_div[0],
        "grads": (dense + mirror) * g_bytes / div[1] + experts * g_bytes / expert_div[1],
        "optimizer": dense * o_bytes / div[2] + experts * o_bytes / expert_div[2],
    }


def _group_bandwidth(cluster: Cluster, stride: int, size: int) -> float:
    """Bus bandwidth (bytes/s per GPU) of a group of `size` ranks `stride` apart (mesh order pp,
    dp_replicate, dp_shard, cp, tp: tp innermost, so its ranks are neighbours).

    Inside a node: NVLink. Across nodes NCCL runs one ring per NIC (rail), so a group with k
    GPUs on each node crosses nodes over k NICs at once: min(NVLink, k x one NIC)."""
    if size <= 1 or stride * size <= cluster.gpus_per_node:
        return cluster.gpu.intra_node_gbps * 1e9
    per_node = max(1, min(size, cluster.gpus_per_node // stride)) if stride < cluster.gpus_per_node else 1
    return min(cluster.gpu.intra_node_gbps, cluster.gpu.inter_node_gbps * per_node) * 1e9


def _ring(kind: str, nbytes: float, n: int, bandwidth: float) -> float:
    """NCCL ring time for a buffer of `nbytes` (the whole, unsharded size) over `n` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "p2p":
        return 1.0 * nbytes / bandwidth
    if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        raise ValueError(f"no ring cost for {kind!r}")
    factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n  # all_gather, reduce_scatter, all_to_all: (n-1)/n
    return factor * nbytes / bandwidth


def _activations_and_stage_times(shape: ModelShape, lay: Layout, cluster: Cluster, work: Workload, hf_config: Any
                                 ) -> tuple[ActivationModel, PipelineLayout | None, tuple[list[float], list[float], list[float]]]:
    """The activation model of `lay` (as ultrascale runs it), its pipeline and the stages' forward, backward and
    weight-gradient seconds per micro-batch."""
    acts = _activations(shape, lay, work, hf_config)
    pipe = pipeline_of(shape, lay)
    return acts, pipe, _stage_times(shape, lay, cluster, work, acts, pipe)


def _activations(shape: ModelShape, lay: Layout, work: Workload, hf_config: Any) -> ActivationModel:
    facts = model_facts_of(shape, hf_config)
    sequence_parallel = lay.tp > 1 and facts.sequence_parallel
    chunk = loss_chunk_tokens_of(work.loss_chunk_tokens, shape.vocab, built=facts.chunked_loss and lay.pp == 1)
    key = (work.seq_len // lay.cp, lay.micro_batch, lay.tp, sequence_parallel, lay.tp > 1 and lay.pp == 1,
           work.compute_bytes, lay.recompute, work.attention_scores_saved, chunk, lay.recompute_blocks)
    return _memoised(shape, "activations", key, lambda: ActivationModel(
        shape, key[0], lay.micro_batch, tp=lay.tp, sequence_parallel=sequence_parallel, loss_parallel=key[4],
        compute_bytes=work.compute_bytes, recompute=lay.recompute, attention_scores_saved=work.attention_scores_saved,
        loss_chunk_tokens=chunk, recompute_blocks=lay.recompute_blocks))


def step_time_floor(shape: ModelShape, layout: Layout, cluster: Cluster, work: Workload, hf_config: Any = None,
                    schedule: bool = False) -> float:
    """A lower bound on `evaluate(...).step_time["total"]`, without the memory or the collectives.

    The layout's compute spread evenly over its pipeline ranks, m·Σ_s(F_s + B_s)/pp: the busiest rank computes at
    least that (`play`'s busiest is m·max over ranks of their stages' F + B; without a pipeline it is m·(F + B)).
    With `schedule`, the played schedule's step instead (the busiest rank's compute and the bubble; `_played`,
    cached per pipeline, as `evaluate` plays it). The step adds the exposed communication, never negative; a
    calibration divides both alike."""
    lay = runs_as(layout)
    _, pipe, times = _activations_and_stage_times(shape, lay, cluster, work, hf_config)
    forward, backward, _ = times
    if pipe is not None and schedule:
        floor = _played(pipe, times).step
    else:
        floor = lay.grad_accumulation * sum(f + b for f, b in zip(forward, backward)) / lay.pp
    return floor / family_ratio(dict(cluster.calibration), lay)[0] if cluster.calibration else floor


def communication_floor(shape: ModelShape, layout: Layout, cluster: Cluster, work: Workload, hf_config: Any = None) -> float:
    """A lower bound on `evaluate(...).step_time["communication"]`: all of it but what the compute fails to hide (that
    part needs the compute and is never negative), calibrated as the step is. `step_time_floor` + this is below the
    step: the step is compute (+ bubble) + this + that part."""
    lay = runs_as(layout)
    exposed, _, _ = _communication(shape, lay, cluster, work, _activations(shape, lay, work, hf_config), pipeline_of(shape, lay))
    return exposed / family_ratio(dict(cluster.calibration), lay)[0] if cluster.calibration else exposed


def model_state_floor(shape: ModelShape, layout: Layout, work: Workload) -> float:
    """A lower bound on `peak_memory`, without activations or the schedule: the first pipeline rank's weights,
    gradients and optimizer state. `_peak_memory`'s total is weights + buffers + a moment that holds at least the
    gradients and the optimizer state (the step's, or the forward's whose activations and accumulating gradients
    outweigh them), and the row's memory is its largest rank's."""
    lay = runs_as(layout)
    layers, first, last = rank_parts(shape, pipeline_of(shape, lay))[0]
    return sum(stage_model_state(shape, lay, work, layers, first, last).values())


def activation_model(shape: ModelShape, layout: Layout, work: Workload, hf_config: Any = None) -> ActivationModel:
    """The activation pricing of `layout` as ultrascale runs it (what `peak_memory` adds to the model state)."""
    return _activations(shape, runs_as(layout), work, hf_config)


def peak_memory(shape: ModelShape, layout: Layout, work: Workload, hf_config: Any = None) -> float:
    """`evaluate(...).memory["total"]` alone, without the step times: what a rank holds depends on its schedule's
    order, not on how long each action takes."""
    lay = runs_as(layout)
    return _memory(shape, lay, work, _activations(shape, lay, work, hf_config), pipeline_of(shape, lay))[0]["total"]


def _memory(shape: ModelShape, lay: Layout, work: Workload, acts: ActivationModel, pipe: PipelineLayout | None
            ) -> tuple[dict[str, float], dict[str, float]]:
    """The peak memory of the largest rank, by category, and that rank's model state."""
    held = held_layers(pipe.schedule, pipe) if pipe is not None else None
    ranks = [(*part, held[r] if held else None) for r, part in enumerate(rank_parts(shape, pipe))]
    return max(((_peak_memory(shape, lay, work, acts, *rank), stage_model_state(shape, lay, work, *rank[:3]))
                for rank in _undominated(ranks)), key=lambda pair: pair[0]["total"])


def pipeline_timeline(shape: ModelShape, layout: Layout, cluster: Cluster, work: Workload, hf_config: Any = None
                      ) -> tuple[PipelineLayout | None, dict[int, list[tuple[int, str, int, float, float]]]]:
    """`layout`'s pipeline and each rank's actions as the planner plays them (`planner.pipeline.timeline`):
    (stage, kind, micro-batch, start, end) in seconds; (None, {}) without a pipeline."""
    _, pipe, times = _activations_and_stage_times(shape, runs_as(layout), cluster, work, hf_config)
    if pipe is None:
        return None, {}
    return pipe, timeline(pipe.schedule, pipe, *times)


def evaluate(shape: ModelShape, layout: Layout, cluster: Cluster, work: Workload, hf_config: Any = None,
             problems: list[str] | None = None) -> PlanRow:
    """Memory and time per GPU of one layout (also for a refused one: `problems` then says why). ZeRO-0 is priced
    as ultrascale runs it (`runs_as`: HSDP without sharding); the row keeps the layout as asked. `problems`: the
    rulebook's verdict on `runs_as(layout)` if the caller has it already (a search judges before it prices)."""
    lay = runs_as(layout)
    if problems is None:
        problems = layout_problems(lay, shape, cluster, work.seq_len, work.global_batch, hf_config)
    if lay.recompute == "budget" and lay.recompute_blocks is None and not problems:
        lay = cheapest_recompute(shape, lay, cluster, work, cluster.usable_bytes, hf_config)[0]
        layout = dataclasses.replace(layout, recompute_blocks=lay.recompute_blocks)
    acts, pipe, times = _activations_and_stage_times(shape, lay, cluster, work, hf_config)
    played = _played(pipe, times) if pipe is not None else None
    memory, state = _memory(shape, lay, work, acts, pipe)
    step_time = _step_time(shape, lay, cluster, work, acts, pipe, times, played)
    notes = []
    if cluster.calibration:  # this machine's measured / predicted tokens/s for the layout's family
        ratio, family = family_ratio(dict(cluster.calibration), lay)
        step_time = {part: seconds / ratio for part, seconds in step_time.items()}
        notes.append(f"calibrated: predicted times / {ratio:.3g} (measured / predicted tokens/s of the {family} layouts)")
    peak = cluster.gpu.peak_tflops * 1e12
    tokens_per_s_per_gpu = work.tokens / step_time["total"] / cluster.gpus
    mfu = shape.flops_per_token(work.seq_len) * work.tokens / (step_time["total"] * cluster.gpus * peak)
    fits = not problems and memory["total"] <= cluster.usable_bytes
    return PlanRow(layout, fits, memory, step_time, tokens_per_s_per_gpu, mfu, problems, notes, model_state=state)


def cheapest_recompute(shape: ModelShape, layout: Layout, cluster: Cluster, work: Workload, budget_bytes: float,
                       hf_config: Any = None) -> tuple[Layout, bool]:
    """(`layout` under recompute="budget" with its blocks chosen, whether it fits): of every count of blocks run full,
    selective and none, the one with the shortest backward (`_stage_times`: a full block re-runs its forward's
    FLOPs, a selective one its memory-bound ops) whose peak (`peak_memory`) is at most `budget_bytes`; ties go to
    fewer blocks recomputed. Where even every block full does not fit, all full and False.

    The peak falls as blocks move from none to selective to full, so for each count of full blocks the fewest
    selective ones that fit are found by bisection: O(L log L) prices, not L²/2. Without a pipeline only (each
    stage would choose its own; `rules.RECOMPUTE_BUDGET_PIPELINE` refuses it)."""
    lay = runs_as(layout)
    if lay.pp > 1:
        raise ValueError(f"cheapest_recompute: pp={lay.pp}; a recompute budget is chosen without a pipeline only")
    blocks = shape.n_layers

    def priced(full: int, selective: int) -> tuple[float, float, Layout]:
        trial = dataclasses.replace(lay, recompute="budget", recompute_blocks=(full, selective, blocks - full - selective))
        acts = _activations(shape, trial, work, hf_config)
        peak = _memory(shape, trial, work, acts, None)[0]["total"]
        return peak, _stage_times(shape, trial, cluster, work, acts, None)[1][0], trial

    best: tuple[float, int, Layout] | None = None
    for full in range(blocks + 1):
        low, high = 0, blocks - full  # the fewest selective blocks that fit, if `high` does
        if priced(full, high)[0] > budget_bytes:
            continue
        # With nothing recomputed yet no block re-runs in backward, which can peak lower than one selective block:
        # the bisection starts above that step.
        if priced(full, 0)[0] <= budget_bytes:
            high = 0
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if priced(full, middle)[0] <= budget_bytes else (middle + 1, high)
        _, backward, trial = priced(full, low)
        if best is None or (backward, full + low) < best[:2]:
            best = (backward, full + low, trial)
    if best is None:
        return priced(blocks, 0)[2], False
    return best[2], True


def _undominated(ranks: list[tuple]) -> list[tuple]:
    """The ranks whose (layers, embedding, head, held activations) no other rank has all of, at least: a rank's
    memory grows with each, so the peak is among these (1F1B: the first rank and the head's)."""
    return list(_undominated_of(tuple(ranks)))


@functools.lru_cache(maxsize=4096)
def _undominated_of(ranks: tuple[tuple, ...]) -> tuple[tuple, ...]:
    # O(ranks^2): 64 pipeline ranks compare 4096 pairs, and a search asks for the same few pipelines many times.
    distinct = list(dict.fromkeys(ranks))
    return tuple(a for a in distinct
                 if not any(b != a and all(x is None or x <= y for x, y in zip(a, b)) for b in distinct))


def _peak_memory(shape: ModelShape, lay: Layout, work: Workload, acts: ActivationModel, layers: int, first: bool,
                 last: bool, held_layers: float | None) -> dict[str, float]:
    """Bytes per GPU of one pipeline rank at its peak, by category (they sum to `total`). `held_layers`: the
    most layer-micro-batches of activations the rank's schedule holds at once (`PipelinePlay.peak_layers`)."""
    c, m = work.compute_bytes, lay.grad_accumulation
    n_shard = lay.zero_ranks
    moe_fraction = shape.moe_layers / shape.n_layers
    dense, experts = _stage_params(shape, lay, layers, first, last)
    states = stage_model_state(shape, lay, work, layers, first, last)
    params, grads, optimizer = states["params"], states["grads"], states["optimizer"]
    # Activations alive at the peak: one micro-batch of every layer without a pipeline; under one, what the
    # schedule's order holds (1F1B's rank r: p - r micro-batches, GPipe: all m); the head's rank also the logits.
    if held_layers is None:
        activations = acts.peak_bytes(layers, with_loss=last, moe_fraction=moe_fraction)
    else:
        activations = acts.peak_bytes(1, in_flight=held_layers, with_loss=last, moe_fraction=moe_fraction)
    # Buffers (FSDP keeps compute-dtype copies of gathered units). Without PP, at the peak (the
    # loss): the root unit (embedding, norm, head; never resharded after forward) and the last
    # block and the one before it (FSDPMemTracker on the 8B preset shows root + about one unit).
    # Under PP nothing is resharded: the stage's whole gathered copy and its unsharded
    # gradients, reduce-scattered (fp32) one unit at a time. ZeRO-1/2: two buckets.
    layer_unit = (shape.attention_params / lay.tp + shape.norm_params + (1 - moe_fraction) * shape.dense_mlp_params / lay.tp
                  + moe_fraction * (shape.router_params + shape.expert_params / expert_split(lay.ep, lay.tp)))
    counts = shape.param_counts()
    if lay.zero_stage == 3 and n_shard > 1 and lay.pp > 1:
        buffers = 2 * c * (dense + experts) + 4 * layer_unit
    elif lay.zero_stage == 3 and n_shard > 1:
        buffers = c * ((counts["embedding"] + counts["head"]) / lay.tp + 2 * layer_unit)
    elif lay.zero_stage in (1, 2) and n_shard > 1:
        buffers = 2 * 100 * 2**20
    else:
        buffers = 0.0
    # The peak is at the end of the forward, or at the optimizer step. FSDP's gradients do not
    # exist during the forward (zero_grad sets them to None) unless they accumulate over
    # micro-batches (accumulation, pipeline schedules); ZeRO-1/2 keep their gradient buffers.
    # The step adds nothing: fused AdamW (`ADAMW_KERNEL`) updates in place (MemTracker on CPU: 8 bytes of state per
    # parameter at the step, foreach's 8 + a 4-byte temporary).
    accumulating = m > 1 or lay.pp > 1 or lay.zero_stage in (1, 2)
    grads_in_forward = grads if accumulating else 0.0
    if lay.accumulate_unsharded_grads and m > 1:
        # FSDP keeps each parameter's whole (tp-local) fp32 gradient from the first micro-batch to the last one's
        # reduce-scatter; the sharded gradients appear only then (measured: `measure_layout`, small, dp_shard 2).
        grads_in_forward = (dense + experts) * 4
    if activations + grads_in_forward >= grads:
        moment = {"grads": grads_in_forward, "optimizer": optimizer, "activations": activations}
    else:  # the step's peak: model state as the formulas have it
        moment = {"grads": grads, "optimizer": optimizer, "activations": 0.0}
    if (lay.zero_stage == 3 and n_shard > 1 and lay.pp == 1 and not accumulating and last
            and 0 < acts.loss_chunk_tokens < acts.seq_len * acts.micro_batch):
        # The head and the loss fused in chunks compute the head's gradient in forward: its whole compute-dtype copy
        # waits for the root unit's reduce-scatter at the end of the backward. Without the whole logits the peak moves
        # late into the backward: every other unit's sharded gradient, the root's whole ones (embedding, head) and
        # one block rerun (measured: `measure_layout`, 8B at 8,192 tokens, FSDPMemTracker).
        head = c * (counts["head"] or counts["embedding"]) / lay.tp
        root = c * (counts["embedding"] + counts["head"]) / lay.tp
        ends = [{**moment, "grads": moment["grads"] + head},
                {"grads": grads + root, "optimizer": optimizer, "activations": acts.recompute_peak_bytes(moe_fraction > 0)}]
        moment = max(ends, key=lambda candidate: sum(candidate.values()))
    memory = {"params": params, **moment, "buffers": buffers}
    return {**memory, "total": sum(memory.values())}


def _stage_times(shape: ModelShape, lay: Layout, cluster: Cluster, work: Workload, acts: ActivationModel,
                 pipe: PipelineLayout | None) -> tuple[list[float], list[float], list[float]]:
    """Seconds per micro-batch of each stage (one without a pipeline): forward, backward, and the backward's
    weight-gradient half (the W of a zero-bubble schedule; its I is the rest, recomputation included).

    A layer's forward is a third of its 6N + attention FLOPs per token, its backward two; full recomputation runs
    the forward again in the backward; the head (6·V·h per token) is on the last stage."""
    base = cluster.gpu.peak_tflops * 1e12 * cluster.efficiency * lay.tp
    rate = base * work.speedup  # the compute outside attention's kernel: compile and Float8 speed it up
    tokens_mb = acts.seq_len * lay.micro_batch  # tokens of one micro-batch on this rank
    head_token = 6 * shape.vocab * shape.hidden
    attention_forward = 4 * shape.q_width * work.seq_len  # a layer's scores and AV per token: a third of 12·h·s
    attention_weight = work.speedup  # its kernel runs at the base rate: in `rate` units a FLOP of it weighs this much
    layer_forward = (shape.flops_per_token(work.seq_len) - head_token) / (3 * shape.n_layers) + attention_forward * (attention_weight - 1)
    # A block run full does its forward again: 2N of the blocks + 4·L·h·s of attention, over L blocks.
    blocks_n = shape.active_matmul_params() - shape.vocab * shape.hidden
    recompute_token = (2 * blocks_n + 4 * shape.n_layers * shape.q_width * work.seq_len * attention_weight) / shape.n_layers
    # A block run selective re-runs its norms, SiLU and products: memory-bound, read + write once more.
    rerun = (acts.layer_bytes(False) - acts.kept_layer_bytes(False, "selective")) * 2 / (cluster.gpu.hbm_gbps * 1e9) / work.speedup
    layers = pipe.layers_per_stage if pipe is not None else (shape.n_layers,)
    forward, backward, weight = [], [], []
    for s, n in enumerate(layers):
        head = head_token / 3 if s == len(layers) - 1 else 0.0
        blocks = acts.blocks_by_mode(n)
        forward.append(tokens_mb * (n * layer_forward + head) / rate)
        weight.append(tokens_mb * (n * layer_forward + head) / rate)
        backward.append(tokens_mb * (n * 2 * layer_forward + blocks.get("full", 0) * recompute_token + 2 * head) / rate
                        + blocks.get("selective", 0) * rerun)
    return forward, backward, weight


def _step_time(shape: ModelShape, lay: Layout, cluster: Cluster, work: Workload, acts: ActivationModel,
               pipe: PipelineLayout | None, times: tuple[list[float], list[float], list[float]],
               played: PipelinePlay | None) -> dict[str, float]:
    """Seconds per optimizer step of the busiest rank: compute, exposed communication, bubble.

    Under a pipeline the schedule's order is played with the stages' times (`ultrascale.planner.pipeline`): the
    bubble is the busiest rank's idle time, uneven stages included. torch.compile (`COMPILE_SPEEDUP`) and Float8
    (`FLOAT8_SPEEDUP`) divide the compute alone; the collectives are priced as eager, though less of them hides
    behind the shorter compute (below). Memory is not changed by either (torchtitan's compiled and Float8 runs
    used less: 82.4 -> 77.0 -> 76.8 GiB)."""
    forward, backward, _ = times
    if played is None:
        compute, bubble = lay.grad_accumulation * (forward[0] + backward[0]), 0.0
    else:
        compute, bubble = played.busiest, played.step - played.busiest
    exposed, hidden_comm, in_last_backward = _communication(shape, lay, cluster, work, acts, pipe)
    # ZeRO-1/2's reduce-scatter runs inside the step's last backward: only that micro-batch's backward hides it.
    exposed += max(in_last_backward - backward[0], 0.0)
    hidden_comm += min(in_last_backward, backward[0])
    # What the compute cannot hide (FSDP prefetch ahead of a short layer, a slow ring) is exposed.
    exposed += max(hidden_comm - compute, 0.0)
    return {"compute": compute, "communication": exposed, "bubble": bubble, "total": compute + exposed + bubble}


def _communication(shape: ModelShape, lay: Layout, cluster: Cluster, work: Workload, acts: ActivationModel,
                   pipe: PipelineLayout | None) -> tuple[float, float, float]:
    """Seconds per optimizer step of the first pipeline rank's collectives: (exposed, meant to hide behind the compute,
    meant to hide behind the step's last backward)."""
    c, m = work.compute_bytes, lay.grad_accumulation
    rate = cluster.gpu.peak_tflops * 1e12 * cluster.efficiency
    layers, first, last = rank_parts(shape, pipe)[0]  # the first rank: embedding, the most layers of the even split
    n_shard = lay.zero_ranks
    n_expert_shard = max(n_shard // lay.ep, 1)
    w_bytes, g_bytes, _ = state_bytes(work.precision, lay.zero_stage, lay.accumulate_grads_in_fp32)
    cp_stride = lay.tp  # mesh order pp, dp_replicate, dp_shard, cp, tp: tp innermost
    dpr_stride = lay.tp * lay.cp * lay.dp_shard
    bw_tp = _group_bandwidth(cluster, 1, lay.tp)
    bw_fsdp = _group_bandwidth(cluster, cp_stride, n_shard)  # dp_shard x cp, flattened
    bw_ep = _group_bandwidth(cluster, cp_stride, lay.ep)
    bw_dpr = _group_bandwidth(cluster, dpr_stride, lay.dp_replicate)
    bw_pp = _group_bandwidth(cluster, dpr_stride * lay.dp_replicate, lay.pp)
    dense, experts = _stage_params(shape, lay, layers, first, last)
    tokens_mb = acts.seq_len * lay.micro_batch  # tokens of one micro-batch on this rank
    lat = cluster.latency_s
    moe_fraction = shape.moe_layers / shape.n_layers
    hidden_comm = 0.0  # communication that overlaps compute (FSDP prefetch, CP ring)
    in_last_backward = 0.0  # ZeRO-1/2's bucketed reduce-scatter
    exposed = 0.0
    # ZeRO-3: all-gather forward and backward every micro-batch (reshard after forward; under PP
    # once per step), reduce-scatter fp32 grads every micro-batch into the shards (the strategy's
    # default: `accumulate_unsharded_grads=False` keeps ZeRO-3's gradient memory); under PP once per step.
    if lay.zero_stage == 3:
        per_step = 1 if lay.pp > 1 else m
        reductions = 1 if lay.pp > 1 or lay.accumulate_unsharded_grads else m
        fsdp = 2 * per_step * (_ring("all_gather", dense * c, n_shard, bw_fsdp) + _ring("all_gather", experts * c, n_expert_shard, bw_fsdp))
        fsdp += reductions * (_ring("reduce_scatter", dense * 4, n_shard, bw_fsdp)
                              + _ring("reduce_scatter", experts * 4, n_expert_shard, bw_fsdp))
        hidden_comm += fsdp * (1 - 1 / max(layers, 1))
        exposed += fsdp / max(layers, 1)  # the first gather and the last reduce-scatter wait
    elif n_shard > 1:  # ZeRO-1/2: reduce-scatter grads, all-gather the updated params after the step
        grads_rs = (_ring("reduce_scatter", dense * g_bytes, n_shard, bw_fsdp)
                    + _ring("reduce_scatter", experts * g_bytes, n_expert_shard, bw_fsdp))
        # Launched per bucket inside the step's last backward; under PP every micro-batch's backward defers it to
        # the step, after the schedule.
        if lay.pp == 1:
            in_last_backward += grads_rs
        else:
            exposed += grads_rs
        exposed += (_ring("all_gather", dense * w_bytes, n_shard, bw_fsdp)
                    + _ring("all_gather", experts * w_bytes, n_expert_shard, bw_fsdp))
    if lay.dp_replicate > 1:  # HSDP / replicas: all-reduce of each shard's fp32 gradient, half hidden
        shard = dense / max(n_shard, 1) + experts / n_expert_shard
        replicas = _ring("all_reduce", shard * 4, lay.dp_replicate, bw_dpr)
        hidden_comm += replicas * 0.5
        exposed += replicas * 0.5
    if lay.tp > 1:  # per layer and micro-batch: 4 collectives of s·b·h forward and 4 backward
        act = tokens_mb * shape.hidden * c
        per_layer = 4 * _ring("all_gather", act, lay.tp, bw_tp) + 4 * _ring("reduce_scatter", act, lay.tp, bw_tp)
        exposed += m * layers * (per_layer + 8 * lat)
    if lay.cp > 1:
        # Ulysses over all of cp (alltoall), over groups of cp_ulysses neighbouring cp ranks (USP), or none (ring).
        ulysses = {"alltoall": lay.cp, "usp": lay.cp_ulysses}.get(lay.cp_method, 1)
        kv_heads = shape.n_kv_heads // lay.tp
        kv_heads *= ulysses // math.gcd(kv_heads, ulysses) if kv_heads else 1
        if ulysses > 1:
            # Per layer: q, k, v there in one all-to-all and the output back in another, forward and again (their
            # gradients) backward; an all-to-all of a rank's (T/cp)·width sends (u-1)/u of it, not overlapped. kv
            # heads the u ranks cannot split evenly are repeated to lcm(kv heads per tp rank, u) first.
            width = 2 * shape.q_width / lay.tp + 2 * kv_heads * shape.head_dim
            bw_ulysses = _group_bandwidth(cluster, cp_stride, ulysses)
            exposed += m * layers * (2 * _ring("all_to_all", tokens_mb * width * c, ulysses, bw_ulysses) + 4 * lat)
        ring_ranks = lay.cp // ulysses
        if ring_ranks > 1:
            # The ring over cp/u ranks, each holding u·T/cp tokens of Hkv/u heads: K,V passed cp/u - 1 times forward,
            # K,V and dK,dV backward, hidden behind attention.
            kv = tokens_mb * 2 * (kv_heads * shape.head_dim if ulysses > 1 else shape.kv_width / lay.tp) * c
            ring = 3 * (ring_ranks - 1) * kv / _group_bandwidth(cluster, cp_stride * ulysses, ring_ranks)
            attention_time = 12 * shape.q_width * work.seq_len * tokens_mb / lay.tp / rate
            exposed += m * layers * (max(ring - attention_time, 0.0) + 3 * (ring_ranks - 1) * lat)
            hidden_comm += m * layers * min(ring, attention_time)
    if lay.ep > 1 and shape.moe_layers:  # dispatch and combine, forward and backward, not overlapped
        routed = tokens_mb * shape.top_k * shape.hidden * c  # the token copies of a micro-batch
        # EP x TP: each tp rank dispatches 1/tp of them; the outputs (and in backward the inputs' gradients) are
        # all-gathered over tp, and the local experts' gradients all-reduced over tp in every backward.
        exposed += m * layers * moe_fraction * 4 * (_ring("all_to_all", routed / lay.tp, lay.ep, bw_ep) + lat)
        if lay.tp > 1:
            exposed += m * layers * moe_fraction * 2 * (_ring("all_gather", routed, lay.tp, bw_tp) + lat)
            exposed += m * _ring("all_reduce", experts * c, lay.tp, bw_tp)
    if pipe is not None:  # boundary sends: on the critical path while the pipeline fills and drains, every stage
        boundary = tokens_mb * shape.hidden * c / (lay.tp if acts.sequence_parallel else 1)
        exposed += 2 * (pipe.num_stages - 1) * (_ring("p2p", boundary, 2, bw_pp) + lat)
    return exposed, hidden_comm, in_last_backward

