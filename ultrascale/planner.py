"""The layout planner behind `ultrascale plan`: every layout ultrascale can run, costed and ranked.

For a model (`ModelShape`), a cluster (`Cluster`: GPU kind, count, GPUs per node) and a
batch (sequence length, global batch in tokens), `search` enumerates the layouts
(pp, dp_replicate, dp_shard, cp, tp, ep, ZeRO stage, recomputation, micro-batch) that
ultrascale's strategy accepts for this model, and `evaluate` prices each one:

- memory per GPU: model states by ZeRO stage and precision (Playbook formulas, with the
  bytes ultrascale keeps), activations (`ActivationModel`) times the micro-batches a
  schedule keeps alive, communication buffers;
- step time: compute at an achievable fraction of the GPU's peak, the communication each
  method needs over intra- or inter-node links minus what it can hide behind compute, and
  the pipeline bubble (p-1)/(v·m);
- predicted MFU and tokens/s per GPU.

Plain arithmetic, no torch.distributed: a 70B search over 256 GPUs takes well under a second.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from ultrascale.estimate import STATE_BYTES, ActivationModel, ModelShape

__all__ = ["Cluster", "GPU_SPECS", "GpuSpec", "Layout", "PlanRow", "Workload", "evaluate", "stage_model_state", "format_table", "parse_layout", "recipe_yaml", "search", "why_not"]

GIB = 2**30


# --------------------------------------------------------------------------- hardware


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind: dense bf16 peak, usable memory, and achievable NCCL bus bandwidths per GPU."""

    name: str
    peak_tflops: float
    """Dense bf16 tensor-core peak (vendor datasheet, without 2:4 sparsity)."""
    memory_gib: float
    """What the driver reports as total (nvidia-smi), before the CUDA context."""
    hbm_gbps: float
    """Memory bandwidth in GB/s (prices the memory-bound ops selective recompute re-runs)."""
    intra_node_gbps: float
    """GB/s per GPU per direction that NCCL's ring reaches inside a node (NVLink/NVSwitch)."""
    inter_node_gbps: float
    """GB/s per GPU per direction between nodes (one NIC per GPU)."""


# Peaks and HBM bandwidth: NVIDIA H100 SXM5 / H200 / A100 / B200 datasheets (dense bf16). Memory: nvidia-smi totals
# (H100 80GB: 81559 MiB; H200: 143771 MiB; A100 80GB: 81920 MiB; B200: 183359 MiB). Bandwidth:
# NVLink 4 (H100/H200) 450 GB/s per direction, NCCL bus bandwidth ~80% of it; NVLink 3 (A100)
# 300 GB/s; NVLink 5 (B200) 900 GB/s. Between nodes one 400 Gb/s NIC per GPU (50 GB/s; A100
# clusters: 200 Gb/s HDR, 25 GB/s), ~80% reached.
GPU_SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM", 989.4, 79.6, 3350.0, 360.0, 40.0),
    "h200": GpuSpec("H200 SXM", 989.4, 140.4, 4800.0, 360.0, 40.0),
    "a100": GpuSpec("A100 SXM 80GB", 312.0, 80.0, 2039.0, 240.0, 20.0),
    "b200": GpuSpec("B200", 2250.0, 179.1, 8000.0, 720.0, 40.0),
}


@dataclass(frozen=True)
class Cluster:
    gpu: GpuSpec
    gpus: int
    gpus_per_node: int = 8
    efficiency: float = 0.55
    """Fraction of the peak that the model's matmuls reach when nothing waits (one number for all
    layouts; `benchmarks/planner_validation.py` shows how it compares with published runs)."""
    memory_headroom: float = 0.9
    """Fraction of `gpu.memory_gib` a layout may plan for: the rest is the CUDA context, NCCL and fragmentation."""
    latency_s: float = 10e-6
    """Fixed cost of one collective."""

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_gib * GIB * self.memory_headroom


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """One way to run the step: the mesh degrees, ZeRO stage, recomputation and the batch split."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero_stage: int = 3
    micro_batch: int = 1
    grad_accumulation: int = 1
    """Micro-batches per optimizer step on each data-parallel rank: Lightning's accumulation, or
    under pipeline parallel the schedule's micro-batches (m)."""
    recompute: str = "none"
    virtual_stages: int = 1
    """Pipeline stages per rank (1: 1F1B; 2 or more: Interleaved1F1B)."""
    accumulate_unsharded_grads: bool = False
    """ZeRO-3 accumulation without PP: whole fp32 gradients accumulate over the micro-batches and are
    reduce-scattered once per step (the strategy's `accumulate_unsharded_grads=True`), not every one."""

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def schedule(self) -> Optional[str]:
        if self.pp == 1:
            return None
        return "Interleaved1F1B" if self.virtual_stages > 1 else "1F1B"

    def describe(self) -> str:
        parts = [f"pp={self.pp}", f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"cp={self.cp}",
                 f"tp={self.tp}", f"ep={self.ep}", f"zero_stage={self.zero_stage}", f"micro_batch={self.micro_batch}",
                 f"grad_accumulation={self.grad_accumulation}", f"recompute={self.recompute}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}" + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else ""))
        if self.accumulate_unsharded_grads:
            parts.append("accumulate_unsharded_grads=True")
        return ", ".join(parts)


LAYOUT_KEYS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "zero_stage", "micro_batch", "grad_accumulation",
               "recompute", "virtual_stages", "accumulate_unsharded_grads")
RECOMPUTE_MODES = ("none", "selective", "full")


def parse_layout(text: str) -> dict[str, Any]:
    """`"pp=4,dp_shard=8,tp=8,zero_stage=1"` -> {"pp": 4, ...}; unknown keys and bad values are errors."""
    fixed: dict[str, Any] = {}
    aliases = {"dp": "dp_shard", "zero": "zero_stage", "mbs": "micro_batch", "acc": "grad_accumulation", "v": "virtual_stages"}
    for item in filter(None, (part.strip() for part in text.replace(" ", ",").split(","))):
        if "=" not in item:
            raise ValueError(f"layout item {item!r} is not key=value; keys: {', '.join(LAYOUT_KEYS)}")
        key, value = (part.strip() for part in item.split("=", 1))
        key = aliases.get(key, key)
        if key not in LAYOUT_KEYS:
            raise ValueError(f"unknown layout key {key!r}; keys: {', '.join(LAYOUT_KEYS)}")
        if key == "accumulate_unsharded_grads":
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{key}={value!r}: give 0/1 or true/false")
            fixed[key] = value.lower() in ("1", "true")
            continue
        if key == "recompute":
            if value not in RECOMPUTE_MODES:
                raise ValueError(f"recompute={value!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
            fixed[key] = value
            continue
        try:
            fixed[key] = int(value)
        except ValueError:
            raise ValueError(f"layout {key}={value!r} is not an integer") from None
        if fixed[key] < (0 if key == "zero_stage" else 1):
            raise ValueError(f"layout {key}={value} must be positive")
    return fixed


# --------------------------------------------------------------------------- what ultrascale runs


def _hf_tp_problem(shape: ModelShape, hf_config: Any) -> Optional[str]:
    if hf_config is None:
        return None
    plan = getattr(hf_config, "base_model_tp_plan", None) or {}
    if not plan:
        return f"{shape.name} ships no tensor-parallel plan (config.base_model_tp_plan); pass `tp_plan=` to the strategy"
    from ultrascale.parallel.tensor import style_from_name

    for key, style in plan.items():
        try:
            style_from_name(style)
        except ValueError as error:
            return f"{shape.name}'s plan entry {key!r}: {error}"
    return None


def _hf_support(shape: ModelShape) -> dict[str, bool]:
    from ultrascale.models.adapters import HF_CONTEXT_PARALLEL_TYPES, HF_EXPERT_PARALLEL_TYPES, HF_PIPELINE_TYPES

    return {
        "cp": shape.model_type in HF_CONTEXT_PARALLEL_TYPES,
        "pp": shape.model_type in HF_PIPELINE_TYPES,
        "ep": shape.model_type in HF_EXPERT_PARALLEL_TYPES,
    }


def layout_problems(layout: Layout, shape: ModelShape, cluster: Cluster, seq_len: int, global_batch: int,
                    hf_config: Any = None) -> list[str]:
    """Why ultrascale would refuse `layout` for this model on this cluster (empty: it runs).

    The same rules as the strategy's checks: mesh product, TP inside a node dividing the
    heads, KV heads, MLP and vocabulary, SP/CP/PP/EP support per architecture, combinations
    not implemented yet, the batch split, the pipeline's layers and micro-batches."""
    problems: list[str] = []
    lay = layout
    if lay.world != cluster.gpus:
        problems.append(f"pp*dp_replicate*dp_shard*cp*tp = {lay.world}, not the {cluster.gpus} GPUs")
    if lay.zero_stage not in (1, 2, 3):
        problems.append(f"zero_stage={lay.zero_stage}: ultrascale runs ZeRO-1, 2 or 3 (no plain replicated data parallel)")
    if lay.accumulate_unsharded_grads and not (lay.zero_stage == 3 and lay.pp == 1 and lay.grad_accumulation > 1):
        problems.append("accumulate_unsharded_grads applies to ZeRO-3 gradient accumulation without pipeline parallel")
    if lay.recompute not in RECOMPUTE_MODES:
        problems.append(f"recompute={lay.recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    if lay.tp > 1:
        if lay.tp > cluster.gpus_per_node:
            problems.append(f"tp={lay.tp} spans nodes ({cluster.gpus_per_node} GPUs per node): TP's per-layer collectives need NVLink")
        sizes = {"n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads, "vocab": shape.vocab}
        if shape.n_experts:  # expert tensor parallel splits each expert's width
            sizes["expert_hidden"] = shape.expert_hidden
        if shape.moe_layers < shape.n_layers:
            sizes["ffn_hidden"] = shape.ffn_hidden
        bad = [f"{name}={size}" for name, size in sizes.items() if size % lay.tp]
        if bad:
            problems.append(f"tp={lay.tp} must divide {', '.join(bad)}")
        if lay.ep > 1:
            problems.append("expert parallel with tensor parallel is not implemented yet (tp alone splits every expert's width)")
        if lay.zero_stage != 3:
            problems.append(f"ZeRO-{lay.zero_stage} with tensor parallel is not implemented (use zero_stage=3)")
        hf_problem = _hf_tp_problem(shape, hf_config) if not shape.builtin else None
        if hf_problem:
            problems.append(hf_problem)
    support = _hf_support(shape) if not shape.builtin else {"cp": True, "pp": True, "ep": True}
    if lay.cp > 1:
        if not support["cp"]:
            problems.append(f"context parallel has no attention hook for {shape.name}")
        if seq_len % (2 * lay.cp):
            problems.append(f"cp={lay.cp}: the sequence ({seq_len}) must divide into 2*cp={2 * lay.cp} load-balanced chunks")
    if lay.ep > 1:
        if not shape.n_experts:
            problems.append(f"ep={lay.ep} on a dense model (no experts)")
        elif shape.n_experts % lay.ep:
            problems.append(f"ep={lay.ep} must divide the {shape.n_experts} experts")
        if (lay.dp_shard * lay.cp) % lay.ep:
            problems.append(f"ep={lay.ep} must divide dp_shard*cp={lay.dp_shard * lay.cp} (expert parallel borrows those ranks)")
        if lay.zero_stage != 3:
            problems.append(f"expert parallel runs with zero_stage=3 (not {lay.zero_stage})")
        if not support["ep"]:
            problems.append(f"expert parallel has no dispatch hook for {shape.name}")
    if lay.pp > 1:
        if not support["pp"]:
            problems.append(f"pipeline parallel has no stage split for {shape.name}")
        if shape.tied_embeddings:
            problems.append("pipeline parallel with tied embeddings (first and last stage share a weight)")
        stages = lay.pp * lay.virtual_stages
        if stages > shape.n_layers:
            problems.append(f"pp*virtual_stages={stages} stages for {shape.n_layers} layers")
        elif lay.virtual_stages > 1 and shape.n_layers % stages:
            problems.append(f"{shape.n_layers} layers do not split evenly into {stages} virtual stages")
        if lay.virtual_stages > 1 and lay.grad_accumulation % lay.pp:
            problems.append(f"Interleaved1F1B needs micro-batches ({lay.grad_accumulation}) divisible by pp={lay.pp}")
        if lay.grad_accumulation < lay.pp:
            problems.append(f"{lay.grad_accumulation} micro-batches cannot fill {lay.pp} pipeline stages")
    elif lay.virtual_stages != 1:
        problems.append("virtual_stages > 1 needs pipeline parallel")
    if lay.micro_batch * lay.grad_accumulation * lay.dp != global_batch:
        problems.append(
            f"micro_batch {lay.micro_batch} x accumulation {lay.grad_accumulation} x dp {lay.dp} = "
            f"{lay.micro_batch * lay.grad_accumulation * lay.dp} sequences, not the global batch of {global_batch}"
        )
    return problems


# --------------------------------------------------------------------------- costing


@dataclass
class PlanRow:
    """A layout with its predicted memory and time per GPU."""

    layout: Layout
    fits: bool
    memory: dict[str, float]
    """Bytes per GPU: params, grads, optimizer, activations, buffers, total (the worst pipeline stage)."""
    step_time: dict[str, float]
    """Seconds per optimizer step: compute, communication (exposed), bubble, total."""
    tokens_per_s_per_gpu: float
    mfu: float
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {key: value for key, value in asdict(self.layout).items()}
        row["schedule"] = self.layout.schedule
        row["fits"] = self.fits
        row["memory_gib"] = {key: round(value / GIB, 4) for key, value in self.memory.items()}
        row["step_time_s"] = {key: round(value, 6) for key, value in self.step_time.items()}
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

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "32-true" else 2


def _stage_layers(n_layers: int, pp: int) -> tuple[int, int]:
    """Layers on the first and on the last stage (the strategy gives the remainder to the first stages)."""
    base, extra = divmod(n_layers, pp)
    return base + (1 if extra else 0), base


def _stage_params(shape: ModelShape, layout: Layout, layers: int, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters one rank of this stage holds before ZeRO sharding (after tp / ep)."""
    counts, t = shape.param_counts(), layout.tp
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
    experts = layers * moe_fraction * shape.expert_params / (layout.ep * t)  # ep or tp (expert tensor parallel)
    return dense, experts


def stage_model_state(shape: ModelShape, layout: Layout, work: Workload, layers: int, first: bool, last: bool) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on one rank of a pipeline stage.

    ZeRO-1 shards the optimizer state over the n = dp_shard·cp ranks, ZeRO-2 also the
    gradients, ZeRO-3 also the weights (Rajbhandari et al. 2020); the bytes per parameter are
    ultrascale's (`STATE_BYTES`). Experts are split over ep first, and their shards over the
    n/ep ranks that hold the same experts."""
    family = "fsdp" if layout.zero_stage == 3 else "zero12"
    w_bytes, g_bytes, o_bytes = STATE_BYTES[(work.precision, family)]
    n = layout.dp_shard * layout.cp
    dense, experts = _stage_params(shape, layout, layers, first, last)
    div = {1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[layout.zero_stage]
    expert_div = (max(n // layout.ep, 1),) * 3 if layout.zero_stage == 3 else div
    return {
        "params": dense * w_bytes / div[0] + experts * w_bytes / expert_div[0],
        "grads": dense * g_bytes / div[1] + experts * g_bytes / expert_div[1],
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
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "p2p": 1.0}[kind]
    return factor * nbytes / bandwidth


def evaluate(shape: ModelShape, layout: Layout, cluster: Cluster, work: Workload, hf_config: Any = None) -> PlanRow:
    """Memory and time per GPU of one layout (also for a refused one: `problems` then says why)."""
    lay = layout
    problems = layout_problems(lay, shape, cluster, work.seq_len, work.global_batch, hf_config)
    acts = ActivationModel(shape, work.seq_len // lay.cp, lay.micro_batch, tp=lay.tp,
                           sequence_parallel=shape.builtin and lay.tp > 1, loss_parallel=lay.tp > 1 and lay.pp == 1,
                           compute_bytes=work.compute_bytes, recompute=lay.recompute,
                           attention_scores_saved=work.attention_scores_saved)
    first_layers, last_layers = _stage_layers(shape.n_layers, lay.pp)
    stages = [(first_layers, True, lay.pp == 1)] + ([(last_layers, False, True)] if lay.pp > 1 else [])
    memory = max((_peak_memory(shape, lay, work, acts, *stage) for stage in stages), key=lambda mem: mem["total"])
    step_time = _step_time(shape, lay, cluster, work, acts)
    peak = cluster.gpu.peak_tflops * 1e12
    tokens_per_s_per_gpu = work.tokens / step_time["total"] / cluster.gpus
    mfu = shape.flops_per_token(work.seq_len) * work.tokens / (step_time["total"] * cluster.gpus * peak)
    fits = not problems and memory["total"] <= cluster.usable_bytes
    return PlanRow(lay, fits, memory, step_time, tokens_per_s_per_gpu, mfu, problems)


def _peak_memory(shape: ModelShape, lay: Layout, work: Workload, acts: ActivationModel, layers: int, first: bool,
                 last: bool) -> dict[str, float]:
    """Bytes per GPU of one pipeline stage at its peak, by category (they sum to `total`)."""
    c, m = work.compute_bytes, lay.grad_accumulation
    n_shard = lay.dp_shard * lay.cp
    moe_fraction = shape.moe_layers / shape.n_layers
    dense, experts = _stage_params(shape, lay, layers, first, last)
    states = stage_model_state(shape, lay, work, layers, first, last)
    params, grads, optimizer = states["params"], states["grads"], states["optimizer"]
    # Activations alive at the peak: 1F1B's first stage holds p micro-batches, GPipe all m,
    # interleaving adds (p-1)/(p·v) (Narayanan et al. 2021); the last stage also the logits.
    in_flight = 1.0
    if lay.pp > 1 and first:
        interleaving = 1 + (lay.pp - 1) / (lay.pp * lay.virtual_stages) if lay.virtual_stages > 1 else 1.0
        in_flight = min(m, lay.pp) * interleaving
    activations = acts.peak_bytes(layers, in_flight=in_flight, with_loss=last, moe_fraction=moe_fraction)
    # Buffers (FSDP keeps compute-dtype copies of gathered units). Without PP, at the peak (the
    # loss): the root unit (embedding, norm, head; never resharded after forward) and the last
    # block and the one before it (FSDPMemTracker on the 8B preset shows root + about one unit).
    # Under PP nothing is resharded: the stage's whole gathered copy and its unsharded
    # gradients, reduce-scattered (fp32) one unit at a time. ZeRO-1/2: two buckets.
    layer_unit = (shape.attention_params / lay.tp + shape.norm_params + (1 - moe_fraction) * shape.dense_mlp_params / lay.tp
                  + moe_fraction * (shape.router_params + shape.expert_params / (lay.ep * lay.tp)))
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
    # The step itself adds foreach AdamW's temporary: 4 bytes per parameter it updates
    # (measured with torch's MemTracker on CPU: states 8 + temporary 4 bytes per parameter).
    accumulating = m > 1 or lay.pp > 1 or lay.zero_stage in (1, 2)
    grads_in_forward = grads if accumulating else 0.0
    if lay.accumulate_unsharded_grads and m > 1:
        # FSDP keeps each parameter's whole (tp-local) fp32 gradient from the first micro-batch to the last one's
        # reduce-scatter; the sharded gradients appear only then (measured: `measure_layout`, small, dp_shard 2).
        grads_in_forward = (dense + experts) * 4
    optimizer_bytes = STATE_BYTES[(work.precision, "fsdp" if lay.zero_stage == 3 else "zero12")][2]
    step_temporary = optimizer * 4 / optimizer_bytes
    if activations + grads_in_forward >= grads + step_temporary:
        moment = {"grads": grads_in_forward, "optimizer": optimizer, "activations": activations}
    else:
        moment = {"grads": grads, "optimizer": optimizer + step_temporary, "activations": 0.0}
    memory = {"params": params, **moment, "buffers": buffers}
    return {**memory, "total": sum(memory.values())}


def _step_time(shape: ModelShape, lay: Layout, cluster: Cluster, work: Workload, acts: ActivationModel) -> dict[str, float]:
    """Seconds per optimizer step of the slowest stage: compute, exposed communication, bubble."""
    c, m = work.compute_bytes, lay.grad_accumulation
    rate = cluster.gpu.peak_tflops * 1e12 * cluster.efficiency
    first_layers, last_layers = _stage_layers(shape.n_layers, lay.pp)
    flops_token = shape.flops_per_token(work.seq_len)
    extra_token = 0.0
    if lay.recompute == "full":  # the forward again: 2N of the blocks + 4·L·h·s of attention
        blocks_n = shape.active_matmul_params() - shape.vocab * shape.hidden
        extra_token = 2 * blocks_n + 4 * shape.n_layers * shape.q_width * work.seq_len
    # Work per GPU of the slowest stage: its layers' share plus the head on the last stage.
    head_token = 6 * shape.vocab * shape.hidden
    layer_token = (flops_token - head_token + extra_token) / shape.n_layers
    stage_tokens = work.tokens / (lay.dp * lay.cp * lay.tp)  # tokens one rank's stage processes per step
    stage_flops = max(first_layers * layer_token + (head_token if lay.pp == 1 else 0.0), last_layers * layer_token + head_token)
    compute = stage_tokens * stage_flops / rate
    if lay.recompute == "selective":  # norms, SiLU and products re-run: memory-bound, read + write once more
        rerun = (acts.layer_bytes(False) - acts.kept_layer_bytes(False)) * 2
        compute += m * first_layers * rerun / (cluster.gpu.hbm_gbps * 1e9)
    bubble = (lay.pp - 1) / lay.virtual_stages * compute / m if lay.pp > 1 else 0.0

    n_shard = lay.dp_shard * lay.cp
    n_expert_shard = max(n_shard // lay.ep, 1)
    w_bytes, g_bytes, _ = STATE_BYTES[(work.precision, "fsdp" if lay.zero_stage == 3 else "zero12")]
    cp_stride = lay.tp  # mesh order pp, dp_replicate, dp_shard, cp, tp: tp innermost
    dpr_stride = lay.tp * lay.cp * lay.dp_shard
    bw_tp = _group_bandwidth(cluster, 1, lay.tp)
    bw_cp = _group_bandwidth(cluster, cp_stride, lay.cp)
    bw_fsdp = _group_bandwidth(cluster, cp_stride, n_shard)  # dp_shard x cp, flattened
    bw_ep = _group_bandwidth(cluster, cp_stride, lay.ep)
    bw_dpr = _group_bandwidth(cluster, dpr_stride, lay.dp_replicate)
    bw_pp = _group_bandwidth(cluster, dpr_stride * lay.dp_replicate, lay.pp)
    dense, experts = _stage_params(shape, lay, first_layers, True, lay.pp == 1)
    tokens_mb = acts.seq_len * lay.micro_batch  # tokens of one micro-batch on this rank
    layers, lat = first_layers, cluster.latency_s
    moe_fraction = shape.moe_layers / shape.n_layers
    hidden_comm = 0.0  # communication that overlaps compute (FSDP prefetch, ZeRO-2 buckets, CP ring)
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
        grads_rs = _ring("reduce_scatter", dense * g_bytes, n_shard, bw_fsdp)
        if lay.zero_stage == 2:
            hidden_comm += grads_rs
        else:
            exposed += grads_rs
        exposed += _ring("all_gather", dense * w_bytes, n_shard, bw_fsdp)
    if lay.dp_replicate > 1:  # HSDP / replicas: all-reduce of each shard's fp32 gradient, half hidden
        replicas = _ring("all_reduce", (dense + experts) * 4 / max(n_shard, 1), lay.dp_replicate, bw_dpr)
        hidden_comm += replicas * 0.5
        exposed += replicas * 0.5
    if lay.tp > 1:  # per layer and micro-batch: 4 collectives of s·b·h forward and 4 backward
        act = tokens_mb * shape.hidden * c
        per_layer = 4 * _ring("all_gather", act, lay.tp, bw_tp) + 4 * _ring("reduce_scatter", act, lay.tp, bw_tp)
        exposed += m * layers * (per_layer + 8 * lat)
    if lay.cp > 1:  # ring: K,V passed cp-1 times forward, K,V and dK,dV backward, hidden behind attention
        kv = tokens_mb * 2 * shape.kv_width / lay.tp * c
        ring = 3 * (lay.cp - 1) * kv / bw_cp
        attention_time = 12 * shape.q_width * work.seq_len * tokens_mb / lay.tp / rate
        exposed += m * layers * (max(ring - attention_time, 0.0) + 3 * (lay.cp - 1) * lat)
        hidden_comm += m * layers * min(ring, attention_time)
    if lay.ep > 1 and shape.moe_layers:  # dispatch and combine, forward and backward, not overlapped
        routed = tokens_mb * shape.top_k * shape.hidden * c
        exposed += m * layers * moe_fraction * 4 * (_ring("all_to_all", routed, lay.ep, bw_ep) + lat)
    if lay.pp > 1:  # boundary sends: on the critical path while the pipeline fills and drains
        boundary = tokens_mb * shape.hidden * c / (lay.tp if acts.sequence_parallel else 1)
        exposed += 2 * (lay.pp - 1) * (_ring("p2p", boundary, 2, bw_pp) + lat)
    # What the compute cannot hide (FSDP prefetch ahead of a short layer, a slow ring) is exposed.
    exposed += max(hidden_comm - compute, 0.0)
    return {"compute": compute, "communication": exposed, "bubble": bubble, "total": compute + exposed + bubble}


# --------------------------------------------------------------------------- search


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
                for v, whole in itertools.product(vs, unsharded):
                    yield Layout(pp=pp, dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, ep=ep, zero_stage=zero,
                                 micro_batch=mbs, grad_accumulation=acc, recompute=recompute, virtual_stages=v,
                                 accumulate_unsharded_grads=whole)


def search(shape: ModelShape, cluster: Cluster, work: Workload, fixed: Optional[dict[str, Any]] = None,
           hf_config: Any = None, include_refused: bool = False) -> list[PlanRow]:
    """All candidate layouts, costed: fitting ones first by predicted tokens/s per GPU (then less memory)."""
    rows = [evaluate(shape, layout, cluster, work, hf_config) for layout in candidate_layouts(shape, cluster, work, fixed)]
    if not include_refused:
        rows = [row for row in rows if not row.problems]
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


# --------------------------------------------------------------------------- output


def format_table(rows: list[PlanRow], top: int) -> str:
    header = (f"{'#':>3} {'pp':>3} {'dpr':>4} {'dps':>4} {'cp':>3} {'tp':>3} {'ep':>3} {'zero':>4} {'recomp':>9} "
              f"{'mbs':>3} {'acc':>4} | {'params':>7} {'grads':>6} {'optim':>6} {'acts':>6} {'bufs':>5} {'total':>6} {'fits':>4} | "
              f"{'comp s':>7} {'comm s':>7} {'bubble':>7} {'step s':>7} | {'tok/s/GPU':>9} {'MFU':>5}")
    lines = [header, "-" * len(header)]
    for i, row in enumerate(rows[:top], 1):
        lay, mem, t = row.layout, {k: v / GIB for k, v in row.memory.items()}, row.step_time
        recompute = lay.recompute + (f"/v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        accumulation = f"{lay.grad_accumulation}{'w' if lay.accumulate_unsharded_grads else ''}"  # w: whole gradients
        lines.append(
            f"{i:>3} {lay.pp:>3} {lay.dp_replicate:>4} {lay.dp_shard:>4} {lay.cp:>3} {lay.tp:>3} {lay.ep:>3} {lay.zero_stage:>4} "
            f"{recompute:>9} {lay.micro_batch:>3} {accumulation:>4} | {mem['params']:>7.2f} {mem['grads']:>6.2f} "
            f"{mem['optimizer']:>6.2f} {mem['activations']:>6.2f} {mem['buffers']:>5.2f} {mem['total']:>6.2f} "
            f"{'yes' if row.fits else 'NO':>4} | {t['compute']:>7.3f} {t['communication']:>7.3f} {t['bubble']:>7.3f} "
            f"{t['total']:>7.3f} | {row.tokens_per_s_per_gpu:>9,.0f} {row.mfu:>5.1%}"
        )
    return "\n".join(lines)



def describe_search(shape: ModelShape, fixed: dict[str, Any]) -> str:
    """One line: the dimensions searched, what was fixed, and what was left out."""
    dims = "pp x dp_replicate x dp_shard x cp x tp" + (" x ep" if shape.n_experts else "")
    text = (f"{dims}; ZeRO-1/2/3; recompute none/selective/full; micro-batch 1-8; pipeline 1F1B and Interleaved1F1B (v=2); "
            "ZeRO-3 accumulation with sharded or whole gradients (acc 'w')")
    if fixed:
        text += "; fixed " + ", ".join(f"{key}={value}" for key, value in fixed.items())
    left_out = ["ZeRO-0 (ultrascale has no plain replicated data parallel)", "GPipe and zero-bubble schedules", "Float8"]
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
        f"activations {mem['activations']:.2f} + buffers {mem['buffers']:.2f} = {mem['total']:.2f} GiB: {verdict}",
        f"step       compute {t['compute']:.3f} s + exposed communication {t['communication']:.3f} s + bubble "
        f"{t['bubble']:.3f} s = {t['total']:.3f} s; {row.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {row.mfu:.1%}",
    ]


def what_would_fit(shape: ModelShape, cluster: Cluster, work: Workload, fixed: dict[str, Any], hf_config: Any = None) -> list[str]:
    """When nothing fits: the best layout without the fixed values, else the fewest GPUs (or a larger GPU) that fit."""
    if fixed:
        rows = [row for row in search(shape, cluster, work, None, hf_config) if row.fits]
        if rows:
            return [f"would fit  without {', '.join(f'{k}={v}' for k, v in fixed.items())}: {rows[0].layout.describe()} "
                    f"({rows[0].memory['total'] / GIB:.1f} GiB, {rows[0].tokens_per_s_per_gpu:,.0f} tokens/s per GPU)"]
    for factor in (2, 4, 8, 16, 32):
        bigger = Cluster(cluster.gpu, cluster.gpus * factor, cluster.gpus_per_node, cluster.efficiency, cluster.memory_headroom)
        batch = max(work.global_batch, bigger.gpus) if work.global_batch % bigger.gpus else work.global_batch
        rows = [row for row in search(shape, bigger, Workload(work.seq_len, batch, work.precision, work.attention_scores_saved),
                                      None, hf_config) if row.fits]
        if rows:
            return [f"would fit  on {bigger.gpus} GPUs: {rows[0].layout.describe()} ({rows[0].memory['total'] / GIB:.1f} GiB per GPU)"]
    return ["would fit  on none of up to 32x the GPUs: shorten the sequence or use a larger GPU (--gpu)"]


def recipe_yaml(row: PlanRow, model: str, shape: ModelShape, cluster: Cluster, work: Workload) -> str:
    """A LightningCLI recipe running `row`'s layout (`ultrascale fit --config PATH` under torchrun / SLURM)."""
    lay = row.layout
    nodes = max(cluster.gpus // cluster.gpus_per_node, 1)
    devices = min(cluster.gpus, cluster.gpus_per_node)
    pipeline = lay.pp > 1
    init = {
        "data_parallel_replicate": lay.dp_replicate, "data_parallel_shard": lay.dp_shard, "context_parallel": lay.cp,
        "tensor_parallel": lay.tp, "pipeline_parallel": lay.pp, "expert_parallel": lay.ep, "zero_stage": lay.zero_stage,
        "meta_init": True,
    }
    if pipeline:
        init.update(pipeline_schedule=lay.schedule, pipeline_microbatches=lay.grad_accumulation)
        if lay.virtual_stages > 1:
            init["pipeline_virtual_stages"] = lay.virtual_stages
    if lay.accumulate_unsharded_grads:
        init["accumulate_unsharded_grads"] = True
    strategy = "\n".join(f"      {key}: {value}" for key, value in init.items())
    callbacks = ""
    if lay.recompute != "none":
        callbacks = ("    - class_path: ultrascale.callbacks.ActivationCheckpointing\n"
                     f"      init_args:\n        mode: {lay.recompute}\n")
    if shape.builtin:
        model_block = f"  class_path: ultrascale.models.LlamaLM\n  init_args:\n    preset: {model}\n    max_seq_len: {work.seq_len}\n"
    else:
        model_block = (f"  class_path: ultrascale.models.hf.HFCausalLM\n  init_args:\n    pretrained_path: {model}\n"
                       "    attn_implementation: sdpa\n")
    local_batch = lay.micro_batch * (lay.grad_accumulation if pipeline else 1)
    mem, t = row.memory, row.step_time
    return f"""# Written by `ultrascale plan`: {shape.name} on {cluster.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node).
# Layout: {lay.describe()}
# Predicted per GPU: {mem['total'] / GIB:.1f} GiB, step {t['total']:.2f} s, {row.tokens_per_s_per_gpu:,.0f} tokens/s, MFU {row.mfu:.1%}.
# Launch on every node (torchrun sets the ranks; SLURM's srun works the same way):
#   torchrun --nnodes {nodes} --nproc-per-node {devices} --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
#       -m ultrascale.cli fit --config THIS_FILE
# Replace the data section with your corpus (`dataset_path`, `tokenizer_path`).
seed_everything: 1234
trainer:
  accelerator: gpu
  devices: {devices}
  num_nodes: {nodes}
  precision: {work.precision}
  max_steps: 1000
  accumulate_grad_batches: {1 if pipeline else lay.grad_accumulation}
  gradient_clip_val: 1.0
  log_every_n_steps: 10
  strategy:
    class_path: ultrascale.UltraScaleStrategy
    init_args:
{strategy}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        save_last: true
        every_n_train_steps: 500
{callbacks}model:
{model_block}data:
  class_path: ultrascale.data.CausalLMDataModule
  init_args:
    data_path: stdlib
    seq_len: {work.seq_len}
    global_batch_size: {local_batch * lay.dp}
"""
