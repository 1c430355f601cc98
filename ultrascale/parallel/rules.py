"""The rulebook: which layouts ultrascale runs, for which models, batches and clusters.

Every caller that decides whether a layout runs asks here and nowhere else: the strategy (its
constructor, its checks before launch and `check_model`), the planner's search (`layout_problems`),
`measure_layout`, `ultrascale plan --recipe`, the auto layout and `from_accelerate`. A rule is a
pure function of what is known at the moment it is asked, and returns `Problem`s instead of
raising, so the planner can list every reason and the strategy can raise the first with its name
in front (`raise_first`).

What each function needs, in the order a run learns it:

    knob_problems(knobs)                         the strategy's arguments alone (constructor)
    resolve(knobs, world)                        + the world size: the mesh (ParallelDims)
    model_problems(dims, knobs, facts)           + the model (`ModelFacts`, from its adapter)
    pipeline_problems(...)                       + the model's layer count (under pp)
    batch_problems(dims, ...)                    + the data: sequence length, global batch

`ModelFacts` carries what the rules need to know of a model; `ultrascale.models.adapters` makes
them from a built (or meta-built) model, so the planner, which sees only a config, and the
strategy, which sees the model, judge the same facts (tests/test_rules.py holds them equal).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ultrascale.parallel.dims import ParallelDims, sequence_split_problem

__all__ = [
    "CONTEXT_PARALLEL_METHODS",
    "LayoutError", "LayoutKnobs", "LayoutNotImplemented", "ModelFacts", "NOT_BUILT", "NotBuilt", "Problem", "SCHEDULES",
    "SINGLE_STAGE_SCHEDULES", "V_SCHEDULES",
    "batch_problems", "choice_problems", "expert_split", "experts_over_tp", "knob_problems", "model_problems",
    "not_built", "pipeline_problems", "raise_first", "resolve",
    "tp_divides_problem", "ulysses_problems",
]

# --------------------------------------------------------------------------- what ultrascale supports

CONTEXT_PARALLEL_METHODS: tuple[str, ...] = ("allgather", "ring", "alltoall", "usp")
"""`context_parallel_method` values: one all-gather of K/V per layer, K/V passed around a P2P ring, all-to-alls
trading heads for sequence around attention (Ulysses; the heads of a rank must split over cp), or both (USP:
Ulysses inside groups of `context_parallel_ulysses` neighbouring cp ranks, the ring across the groups)."""

SCHEDULES: tuple[str, ...] = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
)
"""The pipeline schedule names, as `torch.distributed.pipelining.schedules.get_schedule_class` knows them."""

SINGLE_STAGE_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B")
V_SCHEDULES: tuple[str, ...] = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per rank in a V: rank r holds stages r and 2p-1-r."""
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Zero-bubble schedules: each backward runs in two passes (input gradients, then weight gradients later), so the
autograd graph is kept between them (`retain_graph`)."""

ZERO_STAGES: tuple[int, ...] = (1, 2, 3)

# --------------------------------------------------------------------------- inputs and answers


class LayoutError(ValueError):
    """A layout the rules refuse (the `ultrascale` command prints it as one message, exit status 2)."""


class LayoutNotImplemented(NotImplementedError):
    """A combination ultrascale does not run yet (printed like `LayoutError`); `key` names its `NOT_BUILT` entry."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class NotBuilt:
    """One thing ultrascale refuses because it is not built yet (not because it cannot work)."""

    line: str
    """What it is, as README's and docs/troubleshooting.md's lists say it (`python -m benchmarks.doc_tables`)."""
    layout: bool = True
    """A layout or a combination of knobs (README's list); else a narrower case (docs/troubleshooting.md only)."""


NOT_BUILT: dict[str, NotBuilt] = {
    "accelerate_ulysses_kernel": NotBuilt("Ulysses from accelerate with an attention kernel other than SDPA "
                                          "(`sp_attn_implementation`)", layout=False),
    "context_parallel_attention_dropout": NotBuilt("attention dropout under context parallel", layout=False),
    "context_parallel_non_causal": NotBuilt("non-causal attention under context parallel", layout=False),
    "pipeline_layer_state": NotBuilt("pipeline stages of a Hugging Face model whose decoder layers hand the next "
                                     "one state besides the hidden states (GLM-MoE-DSA's top-k indices)", layout=False),
    "context_parallel_model_mask": NotBuilt("a mask or bias a model computes for its own attention (Doge's dynamic "
                                            "mask) under context parallel", layout=False),
    "context_parallel_device": NotBuilt("context parallel on devices other than CPU and CUDA", layout=False),
    "lora_data_dependent_init": NotBuilt("LoRA with DoRA or a data-dependent initialisation (PiSSA, OLoRA, ...)",
                                         layout=False),
    "prompt_learning_sharded_save": NotBuilt("saving prompt-learning adapters (prompt, prefix, p-tuning) from sharded "
                                             "parameters (ZeRO-1/2 save them)", layout=False),
    "hf_conversion_not_per_expert": NotBuilt("Hugging Face checkpoints whose load-time conversion the sharded loader "
                                             "cannot rebuild one expert at a time (the error names the operation)",
                                             layout=False),
    "hf_router_form": NotBuilt("router balance and z-losses on a Hugging Face MoE whose router does not return "
                               "(logits, weights, indices) (Llama 4's, Inkling's)", layout=False),
    "export_lora_checkpoint": NotBuilt("`export-hf` of a LoRA run's checkpoint (export the adapter or the merged model "
                                       "when fit ends)", layout=False),
    "export_moe_llama": NotBuilt("`export-hf` of the built-in Llama's MoE variant (the dense one exports)", layout=False),
    "measure_expert_parallel": NotBuilt("`measure_layout` (`plan --measure`) with expert parallel (MoE models measure "
                                        "at ep=1)", layout=False),
    "measure_pipeline_accumulation": NotBuilt("`measure_layout` with gradient accumulation under pipeline parallel "
                                              "(give `pipeline_microbatches`)", layout=False),
    "chunked_loss_pipeline": NotBuilt("the chunked head and loss (`loss_chunk_tokens`) under pipeline parallel (its "
                                      "last stage computes the whole logits)", layout=False),
    "chunked_loss_hf_architecture": NotBuilt("the chunked head and loss (`loss_chunk_tokens`) on a Hugging Face "
                                             "architecture it is not checked against (`models.head_loss.HEAD_TO_LOGITS`, "
                                             "docs/exact-loss.md)", layout=False),
    "optimizer_on_slices": NotBuilt("an optimizer whose update is not elementwise (Muon, Shampoo, LAMB, Adafactor, "
                                    "...) on weights a layout shards (ZeRO-1/2/3, HSDP, tensor and expert parallel)",
                                    layout=False),
    "recompute_budget_pipeline": NotBuilt("a recompute budget (`ActivationCheckpointing(memory_budget_gib=)`, the "
                                          "planner's `recompute=budget`) under pipeline parallel (choose `mode` per run)"),
    "fork_launcher_second_fit": NotBuilt("a second `fit` on one Trainer under the fork launcher (make a new Trainer)",
                                         layout=False),
}
"""Every refusal of something not built yet, by key: each raises `LayoutNotImplemented` with its key (a `Problem`
with `not_built=key`, or `not_built(key, message)`), tests/test_not_built.py triggers each, and the lists in the docs
are written from this table."""


def not_built(key: str, message: str) -> LayoutNotImplemented:
    """The error refusing `NOT_BUILT[key]`, with the caller's message (what to use instead)."""
    if key not in NOT_BUILT:
        raise KeyError(f"{key!r} is not in NOT_BUILT")
    return LayoutNotImplemented(message, key)


@dataclass(frozen=True)
class Problem:
    """One reason a layout does not run: the knobs to change and what is wrong with them."""

    message: str
    knobs: tuple[str, ...] = ()
    """`name=value` of the arguments at fault, in the strategy's names (shown in backticks)."""
    not_built: Optional[str] = None
    """A `NOT_BUILT` key: a combination ultrascale may run one day (NotImplementedError), not an impossible one
    (ValueError)."""

    def text(self, owner: str = "") -> str:
        """The message users see: ``Owner(`a=1`, `b=2`): message`` (``Owner: message`` without knobs)."""
        knobs = ", ".join(f"`{knob}`" for knob in self.knobs)
        if owner:
            return f"{owner}({knobs}): {self.message}" if knobs else f"{owner}: {self.message}"
        return f"{knobs}: {self.message}" if knobs else self.message

    def error(self, owner: str = "") -> Exception:
        if self.not_built is not None:
            return not_built(self.not_built, self.text(owner))
        return LayoutError(self.text(owner))


PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")
"""The precisions ultrascale trains in (FSDP2 mixed-precision policies); the planner, its auto layout and
`measure_layout` price these and no other."""

CHECKING_PRECISION = "64-true"
"""fp64 everywhere, to check a layout rather than to train: a sum taken in another order moves an fp64 result by
~1e-16 of its size instead of fp32's ~1e-7 (which a 512-wide head or a long reduction grows to 1e-5, and by how
much depends on the CPU's kernels), so a layout that computes one process's numbers agrees with it to ~1e-12.
The strategies accept it; the planner does not price it (no GPU trains in fp64)."""

STRATEGY_PRECISIONS: tuple[str, ...] = (*PRECISIONS, CHECKING_PRECISION)
"""What the strategies' precision plugin accepts."""

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
"""Activation recompute as the planner and `measure_layout` price it: none, `ActivationCheckpointing`'s
"selective" or its "full" on every block."""

RECOMPUTE_BUDGET = "budget"
"""The planner's recompute choice per block: the cheapest mix of `RECOMPUTE_MODES` that fits the memory
(`ActivationCheckpointing(memory_budget_gib=)`; `planner.cost.cheapest_recompute`)."""

PLANNED_RECOMPUTE: tuple[str, ...] = (*RECOMPUTE_MODES, RECOMPUTE_BUDGET)
"""What the planner prices: a mode on every block, or the budget's mix (searched only when asked: `--recompute budget`)."""


def recompute_problems(recompute: object, pp: int) -> list[Problem]:
    """A recompute the planner prices, and the budget's mix only without a pipeline."""
    problems = choice_problems("recompute", recompute, PLANNED_RECOMPUTE)
    if recompute == RECOMPUTE_BUDGET and pp > 1:
        problems.append(Problem("a recompute budget is chosen for one stage of blocks: under pipeline parallel give "
                                "each run a `mode`", (f"recompute={recompute!r}", f"pp={pp}"),
                                not_built="recompute_budget_pipeline"))
    return problems


def choice_problems(knob: str, value: object, choices: Sequence[str]) -> list[Problem]:
    """A knob that takes one of `choices`: a precision (`PRECISIONS`), a recompute mode (`RECOMPUTE_MODES`), a
    context-parallel method (`CONTEXT_PARALLEL_METHODS`). The one check of each, wherever the knob arrives."""
    return [] if value in choices else [Problem(f"choose one of {', '.join(choices)}", (f"{knob}={value!r}",))]


def raise_first(problems: Sequence[Problem], owner: str = "") -> None:
    """Raise the first problem (ValueError, or NotImplementedError for a combination not built yet)."""
    if problems:
        raise problems[0].error(owner) from None


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def positive_int_problems(**values: object) -> list[Problem]:
    """Counts (a sequence length, a micro-batch, accumulation steps, a degree given as a number): positive ints."""
    return [Problem("must be a positive integer", (f"{name}={value!r}",)) for name, value in values.items()
            if not _positive_int(value)]


def auto_degree_problems(**degrees: object) -> list[Problem]:
    """A degree a strategy resolves at launch (from the world size or the planner) is 'auto' or a positive int."""
    return [Problem("give a positive int or 'auto'", (f"{name}={value!r}",)) for name, value in degrees.items()
            if value != "auto" and not _positive_int(value)]


@dataclass(frozen=True)
class LayoutKnobs:
    """The layout a run asks for, in the strategy's terms (degrees named by their mesh axes)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero_stage: int = 3
    context_parallel_method: str = "ring"
    context_parallel_ulysses: Optional[int] = None
    """USP's Ulysses degree inside each group of neighbouring cp ranks (method "usp" only)."""
    pipeline_schedule: str = "1F1B"
    pipeline_virtual_stages: Optional[int] = None
    pipeline_microbatches: Optional[int] = None
    pipeline_layers: Optional[tuple[int, ...]] = None
    sequence_parallel: Optional[bool] = None
    """None: wherever the model's plan supports it."""
    loss_parallel: Optional[bool] = None
    tp_plan_given: bool = False
    """The user passed `tp_plan=`: it replaces the model's own plan (and that plan's refusal)."""
    accumulate_unsharded_grads: bool = False
    zero_bucket_mb: Optional[float] = None

    @property
    def degrees(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                "pp": self.pp, "ep": self.ep}


@dataclass(frozen=True)
class ModelFacts:
    """What the rules need to know of one model (made by `ultrascale.models.adapters.model_facts`)."""

    name: str
    """Architecture name for messages ('generic' for a model ultrascale has no adapter for)."""
    n_layers: Optional[int] = None
    """Pipeline units (transformer layers); None where unknown."""
    tp_sizes: Mapping[str, int] = field(default_factory=dict)
    """Sizes a tensor-parallel degree must divide under the model's own plan (heads, MLP width, vocabulary)."""
    tp_head_sizes: Mapping[str, int] = field(default_factory=dict)
    """The attention heads among them: a user's `tp_plan` must still give each rank whole heads."""
    attention_heads: Optional[int] = None
    """Query heads per layer; None where unknown."""
    tp_plan: bool = False
    """The model ships (or ultrascale has) a tensor-parallel plan."""
    tp_refusal: Optional[str] = None
    """Why the model's own plan cannot run; None: it can."""
    sequence_parallel: bool = False
    """Its plan can shard norms and the residual stream on the sequence."""
    sequence_parallel_default: bool = True
    """With `sequence_parallel` left unset, it runs where the plan can (False: only when asked)."""
    sequence_parallel_refusal: Optional[str] = None
    """Without `sequence_parallel`: the piece the model lacks, named by the adapter; None: the generic message."""
    context_parallel: bool = False
    """Its attention can be routed through ring / all-gather / all-to-all attention."""
    context_parallel_refusal: Optional[str] = None
    """Without `context_parallel`: the piece it lacks (attention outside transformers' AttentionInterface, a layer
    without softmax attention), named by the adapter; None: the generic message."""
    pipeline: bool = False
    """It can be split into stages (an adapter's or the module's own `pipeline_parts`)."""
    pipeline_refusal: Optional[str] = None
    """Why its stage split cannot run (a missing part, no pp plan); None: it can."""
    n_experts: int = 0
    """Routed experts per MoE layer; 0: dense."""
    expert_parallel: bool = False
    """Its experts can be split over ep ranks (a dispatch hook exists)."""
    expert_parallel_refusal: Optional[str] = None
    """Of an MoE model without `expert_parallel`: the piece its experts or routers lack; None: the generic message."""
    chunked_loss: bool = False
    """Its head and loss can run fused in chunks (`loss_chunk_tokens`, `parallel.loss.loss_chunk_tokens_of`)."""


# --------------------------------------------------------------------------- the rules


def knob_problems(k: LayoutKnobs) -> list[Problem]:
    """What is wrong with the knobs alone, before any world size or model is known."""
    problems: list[Problem] = []
    problems += choice_problems("context_parallel_method", k.context_parallel_method, CONTEXT_PARALLEL_METHODS)
    if k.context_parallel_method == "usp" or k.context_parallel_ulysses is not None:
        problems += ulysses_problems(None, k.context_parallel_method, k.context_parallel_ulysses)
    if k.zero_stage not in ZERO_STAGES:
        plain = (" (plain replicated data parallel, ZeRO-0, is `data_parallel_replicate=N, data_parallel_shard=1`: HSDP "
                 "without sharding)") if k.zero_stage == 0 else ""
        problems.append(Problem(f"choose 1, 2 or 3{plain}", (f"zero_stage={k.zero_stage!r}",)))
    if k.accumulate_unsharded_grads and k.zero_stage != 3:
        problems.append(Problem(
            "accumulate_unsharded_grads chooses how ZeRO-3 (FSDP) accumulates gradients; ZeRO-1/2 always accumulate "
            "whole gradients and reduce once per step", ("accumulate_unsharded_grads=True", f"zero_stage={k.zero_stage}")))
    problems += schedule_problems(k.pipeline_schedule, k.pipeline_virtual_stages, k.pipeline_microbatches)
    if k.pp != 1 and k.loss_parallel:
        problems.append(Problem(
            "the last pipeline stage computes the loss on replicated logits; leave loss_parallel unset",
            ("loss_parallel=True", f"pipeline_parallel={k.pp}")))
    if k.zero_bucket_mb is not None and k.zero_bucket_mb <= 0:
        problems.append(Problem("must be positive", (f"zero_bucket_mb={k.zero_bucket_mb}",)))
    return problems


def resolve(k: LayoutKnobs, world: int) -> tuple[Optional[ParallelDims], list[Problem]]:
    """The degrees resolved for `world` ranks (one may be -1), or why they do not fit."""
    try:
        dims = ParallelDims.resolve(world, **k.degrees)
    except ValueError as error:
        return None, [Problem(f"invalid layout for {world} processes: {error}")]
    problems = []
    if k.context_parallel_method == "usp" and _positive_int(k.context_parallel_ulysses):
        problems += ulysses_problems(dims.cp, k.context_parallel_method, k.context_parallel_ulysses)
    if dims.pp == 1 and (k.pipeline_virtual_stages or 1) > 1:
        problems.append(Problem("virtual pipeline stages need pipeline parallel (pipeline_parallel > 1)",
                                (f"pipeline_virtual_stages={k.pipeline_virtual_stages}", "pipeline_parallel=1")))
    return dims, problems


def ulysses_problems(cp: Optional[int], method: str, ulysses: Optional[int]) -> list[Problem]:
    """USP's Ulysses degree: given with method "usp" only, and splitting cp into ring x Ulysses groups of 2 or more each
    (`cp` None: before the degrees are resolved). ulysses = cp is `alltoall`, ulysses = 1 is `ring`."""
    knob = f"context_parallel_ulysses={ulysses!r}"
    if method != "usp":
        return [] if ulysses is None else [Problem(
            "the Ulysses degree splits cp for context_parallel_method='usp' only", (knob, f"context_parallel_method={method!r}"))]
    if not _positive_int(ulysses) or ulysses < 2:
        return [Problem("USP needs the Ulysses degree inside each group of neighbouring cp ranks: an int of 2 or more",
                        (knob, "context_parallel_method='usp'"))]
    if cp is not None and (cp % ulysses or cp == ulysses):
        fits = [d for d in range(2, cp) if cp % d == 0]
        return [Problem(
            f"USP runs cp = ring x Ulysses with both of 2 or more, so the Ulysses degree divides cp={cp} and is smaller: "
            f"{fits or 'none (cp needs 4 or more ranks)'}; context_parallel_method='alltoall' is Ulysses over all of cp",
            (knob, f"context_parallel={cp}"))]
    return []


def schedule_problems(schedule: str, virtual_stages: Optional[int], microbatches: Optional[int]) -> list[Problem]:
    """A schedule / virtual-stage / micro-batch choice that cannot work, whatever the model."""
    if schedule not in SCHEDULES:
        return [Problem(f"`pipeline_schedule={schedule!r}` is not a torch pipeline schedule; choose one of {list(SCHEDULES)}")]
    problems = []
    if virtual_stages is not None:
        if not _positive_int(virtual_stages):
            problems += positive_int_problems(pipeline_virtual_stages=virtual_stages)
        elif schedule in SINGLE_STAGE_SCHEDULES and virtual_stages != 1:
            problems.append(Problem(
                f"`pipeline_schedule={schedule!r}` runs one stage per rank; `pipeline_virtual_stages={virtual_stages}` "
                f"needs a multi-stage schedule: {[s for s in SCHEDULES if s not in SINGLE_STAGE_SCHEDULES]}"))
        elif schedule in V_SCHEDULES and virtual_stages != 2:
            problems.append(Problem(f"`pipeline_schedule={schedule!r}` places exactly 2 stages per rank (a V); got "
                                    f"`pipeline_virtual_stages={virtual_stages}`"))
    if microbatches is not None:
        problems += positive_int_problems(pipeline_microbatches=microbatches)
    return problems


def resolved_stages(schedule: str, virtual_stages: Optional[int]) -> int:
    """Stages per rank: the given count, else 1 for GPipe/1F1B and 2 for the others."""
    if virtual_stages is not None:
        return virtual_stages
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def pipeline_problems(*, n_layers: int, pp: int, schedule: str, virtual_stages: Optional[int] = None,
                      microbatches: Optional[int] = None, layers_per_stage: Optional[Sequence[int]] = None) -> list[Problem]:
    """The pipeline's stages against the model's layers and its micro-batches against the schedule."""
    problems = schedule_problems(schedule, virtual_stages, microbatches)
    if problems:
        return problems
    v = resolved_stages(schedule, virtual_stages)
    stages = pp * v
    m = microbatches if microbatches is not None else stages
    if layers_per_stage is not None:
        layers = [int(n) for n in layers_per_stage]
        if len(layers) != stages or any(n < 1 for n in layers) or sum(layers) != n_layers:
            problems.append(Problem(
                f"`pipeline_layers={list(layers_per_stage)}` must list {stages} positive layer counts "
                f"(pp={pp} x {v} virtual stages) that sum to the model's {n_layers} layers"))
    elif stages > n_layers:
        problems.append(Problem(
            f"pipeline_parallel={pp} x pipeline_virtual_stages={v} = {stages} stages, but the model has only "
            f"{n_layers} layers; every stage needs at least one"))
    elif v > 1 and n_layers % stages:
        problems.append(Problem(
            f"{v} virtual stages per rank over pp={pp}: {stages} stages do not divide the model's {n_layers} layers; "
            "pick pipeline_virtual_stages so that they do, or give `pipeline_layers` explicitly"))
    if schedule == "1F1B" and m < pp:
        # torch's Schedule1F1B refuses fewer micro-batches than stages (when the schedule is built, after sharding).
        problems.append(Problem(f"1F1B needs at least as many micro-batches as stages ({pp}); got pipeline_microbatches={m}"))
    if schedule == "DualPipeV" and m < stages:
        problems.append(Problem(f"DualPipeV needs at least as many micro-batches as stages ({stages}); got "
                                f"pipeline_microbatches={m}"))
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and v > 1 and m % pp:
        problems.append(Problem(f"{schedule} needs pipeline_microbatches to be a multiple of pipeline_parallel={pp}; "
                                f"got {m}"))
    return problems


def tp_divides_problem(tp: int, sizes: Mapping[str, int], model_name: str) -> Optional[Problem]:
    """Every size `tp` does not divide (whole heads / rows per rank), and the degrees that would fit."""
    bad = {name: size for name, size in sizes.items() if size % tp != 0}
    if not bad:
        return None
    common = math.gcd(*sizes.values())
    fits = [d for d in range(1, common + 1) if common % d == 0]
    details = ", ".join(f"{name}={size}" for name, size in bad.items())
    return Problem(f"`tensor_parallel={tp}` must divide {details} of {model_name} (whole heads / rows per rank). "
                   f"Tensor-parallel degrees that fit: {fits}")


def sequence_parallel_of(k: LayoutKnobs, facts: ModelFacts) -> bool:
    """Whether sequence parallel runs: as asked, else wherever the model's own plan supports it."""
    if k.sequence_parallel is not None:
        return k.sequence_parallel
    return facts.sequence_parallel and facts.sequence_parallel_default and not k.tp_plan_given


def experts_over_tp(ep: int) -> bool:
    """Whether tp splits each routed expert's intermediate width (expert tensor parallel): only when ep does not
    split the experts. Under ep > 1, beside tp too (EP x TP), each expert stays whole on its ep rank and the TP
    plans' expert entries are dropped."""
    return ep == 1


def expert_split(ep: int, tp: int) -> int:
    """The ranks one layer's routed experts are split over (`experts_over_tp`)."""
    return tp if experts_over_tp(ep) else ep


def model_problems(dims: ParallelDims, k: LayoutKnobs, facts: ModelFacts) -> list[Problem]:
    """Whether this model supports each parallelism the mesh turns on, and divides as the layout needs."""
    problems: list[Problem] = []
    name = facts.name
    if dims.cp_enabled and not facts.context_parallel:
        problems.append(Problem(facts.context_parallel_refusal or (
            f"context parallel (cp={dims.cp}) has no attention hook for {name}: ultrascale routes the attention of the "
            "built-in Llama and of Hugging Face models whose attention runs through transformers' AttentionInterface")))
    elif dims.cp_enabled and k.context_parallel_method in ("alltoall", "usp") and facts.attention_heads:
        problems += _alltoall_problems(dims, k, facts)
    if dims.ep_enabled:
        if facts.n_experts == 0:
            problems.append(Problem(
                f"expert parallel (ep={dims.ep}) needs a Mixture-of-Experts model, and {name} has no experts: set "
                "`n_experts` in the LlamaConfig (e.g. preset 'tiny_moe'), or load an MoE checkpoint"))
        elif not facts.expert_parallel:
            problems.append(Problem(facts.expert_parallel_refusal or (
                f"expert parallel (ep={dims.ep}) has no expert dispatch for {name}: ultrascale splits the experts of "
                "the built-in MoE Llama and of Hugging Face models with fused experts behind transformers' "
                "ExpertsInterface")))
        elif facts.n_experts % dims.ep:
            valid = [d for d in range(1, facts.n_experts + 1) if facts.n_experts % d == 0]
            problems.append(Problem(
                f"expert parallel: {name} has {facts.n_experts} experts per layer, which ep={dims.ep} does not divide "
                f"(each ep rank holds the same number of experts); valid ep: {valid}"))
    if dims.pp_enabled:
        if not facts.pipeline:
            problems.append(Problem(
                (f"{facts.pipeline_refusal}. " if facts.pipeline_refusal else
                 f"pipeline parallel has no stage split for {name}. ")
                + "For a model of your own, define `pipeline_parts(self)` on the LightningModule returning "
                "`ultrascale.parallel.pipeline.PipelineParts(root=..., embed=..., layers=..., norm=..., head=..., run=..., "
                "loss=...)` and compute the loss with `self.trainer.strategy.pipeline_loss(batch)` in the steps"))
        elif facts.pipeline_refusal is not None:
            problems.append(Problem(facts.pipeline_refusal))
        elif facts.n_layers is not None:
            problems += pipeline_problems(n_layers=facts.n_layers, pp=dims.pp, schedule=k.pipeline_schedule,
                                          virtual_stages=k.pipeline_virtual_stages, microbatches=k.pipeline_microbatches,
                                          layers_per_stage=k.pipeline_layers)
    if dims.tp_enabled:
        problems += _tensor_parallel_problems(dims.tp, k, facts)
    return problems


def _alltoall_problems(dims: ParallelDims, k: LayoutKnobs, facts: ModelFacts) -> list[Problem]:
    """Ulysses gives each of its ranks (all cp ranks; under USP, each group's) 1/n of a tp rank's query heads: whole
    heads, or it cannot split them."""
    usp = k.context_parallel_method == "usp"
    n = (k.context_parallel_ulysses or 0) if usp else dims.cp
    heads = facts.attention_heads or 0
    if not n or heads % dims.tp or (heads // dims.tp) % n == 0:
        return []  # a tp degree that does not divide the heads is tensor parallel's own problem
    per_rank = heads // dims.tp
    after_tp = f" / tensor_parallel={dims.tp} = {per_rank} per tp rank" if dims.tp_enabled else ""
    fits = [d for d in range(2, per_rank + 1) if per_rank % d == 0]
    if usp:
        return [Problem(
            f"USP's all-to-all splits the attention heads over the {n} Ulysses ranks of each group, and {facts.name}'s "
            f"{heads} query heads{after_tp} do not split over {n}. Ulysses degrees that fit: {fits}",
            (f"context_parallel_ulysses={n}", "context_parallel_method='usp'"))]
    return [Problem(
        f"all-to-all (Ulysses) context parallel splits the attention heads over the cp ranks, and {facts.name}'s "
        f"{heads} query heads{after_tp} do not split over cp={dims.cp}. cp degrees that fit: {fits}; or use "
        "context_parallel_method='ring' or 'allgather', which split the sequence only, or 'usp' with a Ulysses "
        "degree that fits",
        (f"context_parallel={dims.cp}", "context_parallel_method='alltoall'"))]


def _tensor_parallel_problems(tp: int, k: LayoutKnobs, facts: ModelFacts) -> list[Problem]:
    name = facts.name
    if k.tp_plan_given:  # the user's plan replaces the model's; each rank still needs whole heads
        divides = tp_divides_problem(tp, facts.tp_head_sizes, name) if facts.tp_head_sizes else None
        return [divides] if divides else []
    if facts.tp_refusal is not None:
        return [Problem(facts.tp_refusal)]
    if not facts.tp_plan:
        return [Problem(
            f"tensor parallel has no plan for {name}: ultrascale has one for the built-in Llama and runs the plan a "
            "Hugging Face causal LM's config ships (`base_model_tp_plan`: Llama, Mistral, Qwen2/3, Gemma3, Phi3, OLMo2 "
            "and every other dense model with one), and this model has none. Pass your own plan to the strategy, e.g. "
            "`UltraScaleStrategy(tp_plan={'layers.*.attn.q': 'colwise', 'layers.*.attn.out': 'rowwise', ...})` "
            "(module path -> ParallelStyle or one of ultrascale.parallel.tensor_styles.STYLE_NAMES).")]
    if k.sequence_parallel and not facts.sequence_parallel:
        return [Problem(facts.sequence_parallel_refusal or (
            f"sequence parallel is not implemented for {name}; set `sequence_parallel=False`."),
            ("sequence_parallel=True",))]
    divides = tp_divides_problem(tp, facts.tp_sizes, name)
    return [divides] if divides else []


def async_tensor_parallel_problems(tp: int, sequence_parallel: bool, device_type: str, symmetric_memory: bool) -> list[Problem]:
    """Async tensor parallel splits the all-gather before a column-parallel matmul and the reduce-scatter after a
    row-parallel one into chunks the matmul overlaps: only sequence parallel has those collectives (without it TP
    all-reduces, which the pass leaves alone), and the fused kernels are CUDA's (`device.symmetric_memory_available`)."""
    knob = "async_tensor_parallel=True"
    if tp <= 1:
        return [Problem("needs tensor parallel (`tensor_parallel` above 1): it overlaps TP's collectives", (knob,))]
    if not sequence_parallel:
        return [Problem("overlaps the all-gathers and reduce-scatters of sequence parallel, which is off for this model "
                        "(TP alone all-reduces): set `sequence_parallel=True`", (knob,))]
    if not symmetric_memory:
        return [Problem(f"runs torch's symmetric-memory kernels, CUDA over NCCL only; the devices here are "
                        f"{device_type!r}", (knob,))]
    return []


def batch_split_problem(global_batch: int, dp: int, source: str) -> Optional[Problem]:
    """The global batch over data parallel: every dp rank (dp_replicate x dp_shard) holds global_batch / dp whole
    sequences. `source` names the batch in the message. The one statement of this rule: the strategy's data
    check, the sampler and the planner's search ask it."""
    if global_batch % dp == 0:
        return None
    return Problem(f"{source} does not split over the {dp} data-parallel ranks (dp_replicate x dp_shard); use a "
                   f"multiple of {dp}")


def microbatch_split_problem(local_batch: int, microbatches: int, source: str, *, fix: str) -> Optional[Problem]:
    """A rank's batch into the pipeline's `microbatches` micro-batches of one shape. The message reads
    "`source` `local_batch` sequences, which pipeline_microbatches=`microbatches` does not divide`fix`"."""
    if local_batch % microbatches == 0:
        return None
    return Problem(f"{source} {local_batch} sequences, which pipeline_microbatches={microbatches} does not divide{fix}")


def batch_problems(dims: ParallelDims, *, seq_len: Optional[int] = None,
                   global_batch: Optional[int] = None, sequence_parallel: bool = False,
                   microbatches: Optional[int] = None, micro_batch: Optional[int] = None,
                   grad_accumulation: Optional[int] = None, where: str = "",
                   load_balance: bool = True, padding_free: bool = False) -> list[Problem]:
    """The data against the layout: the sequence splits over sp x cp (`load_balance`: context parallel's zig-zag
    chunks, `sequence_split_problem`), the global batch over dp, each rank's batch into the pipeline's micro-batches;
    with `micro_batch` and `grad_accumulation` (the planner's split of the batch) also that they make the global
    batch; with `padding_free` (the data lays a batch's rows end to end in one row) that no pipeline splits it."""
    problems: list[Problem] = []
    if padding_free and dims.pp_enabled:
        problems.append(Problem(
            f"{where or 'the data'}(padding_free=True) lays each batch's rows end to end in one row, and pipeline "
            f"parallel (pp={dims.pp}) splits a batch's rows into its micro-batches, its stages keeping one shape: set "
            "`padding_free: null` (rows of seq_len under pipeline parallel) or train without pipeline parallel"))
    if seq_len is not None:
        split = sequence_split_problem(seq_len, tp=dims.tp if sequence_parallel and dims.tp_enabled else 1, cp=dims.cp,
                                       load_balance=load_balance,
                                       where=f"{where}(seq_len={seq_len})" if where else "the batch")
        problems += [Problem(split)] if split is not None else []
    if global_batch is not None:
        source = f"{where}(global_batch_size={global_batch})" if where else f"the global batch of {global_batch} sequences"
        split = batch_split_problem(global_batch, dims.dp, source)
        if split is not None:
            problems.append(split)
        elif dims.pp_enabled and microbatches is not None:
            pipeline = microbatch_split_problem(
                global_batch // dims.dp, microbatches, f"{source} gives each of the {dims.dp} data-parallel ranks",
                fix=f"; pick a global batch size that is a multiple of {microbatches * dims.dp}")
            problems += [pipeline] if pipeline is not None else []
        if micro_batch is not None and grad_accumulation is not None and micro_batch * grad_accumulation * dims.dp != global_batch:
            problems.append(Problem(
                f"micro_batch {micro_batch} x accumulation {grad_accumulation} x dp {dims.dp} = "
                f"{micro_batch * grad_accumulation * dims.dp} sequences, not the global batch of {global_batch}"))
    return problems
