"""A layout (mesh degrees, ZeRO stage, recomputation, batch split), its `--layout` syntax, and the rules
that say whether ultrascale runs it for a model on a cluster (`layout_problems`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ultrascale.estimate import ModelShape
from ultrascale.hardware import Cluster
from ultrascale.parallel import rules
from ultrascale.parallel.dims import zero_ranks
from ultrascale.parallel.rules import (
    CONTEXT_PARALLEL_METHODS,
    RECOMPUTE_MODES,  # re-exported (`__all__`)
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    LayoutKnobs,
    ModelFacts,
    Problem,
    choice_problems,
    raise_first,
)

__all__ = ["LAYOUT_KEYS", "Layout", "PIPELINE_SPLITS", "RECOMPUTE_MODES", "format_layers", "layout_of_strategy", "layout_problems",
           "parse_layout", "runs_as"]


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
    """`RECOMPUTE_MODES` on every block, or "budget": per block the cheapest of them that fits (`recompute_blocks`)."""
    virtual_stages: int = 1
    """Pipeline stages per rank (1: GPipe / 1F1B; 2 or more: the multi-stage schedules; the V ones exactly 2)."""
    pipeline_schedule: Optional[str] = None
    """The torch schedule (`rules.SCHEDULES`); None: 1F1B, or Interleaved1F1B with virtual stages."""
    pipeline_layers: Optional[tuple[int, ...]] = None
    """Layers of stage 0, 1, ... (the strategy's `pipeline_layers`); None: its default, even split."""
    accumulate_unsharded_grads: bool = False
    """ZeRO-3 accumulation without PP: whole fp32 gradients accumulate over the micro-batches and are
    reduce-scattered once per step (the strategy's `accumulate_unsharded_grads=True`), not every one."""
    cp_method: str = "ring"
    """The strategy's `context_parallel_method` under cp > 1: "ring", "allgather", "alltoall" (Ulysses) or "usp"."""
    cp_ulysses: int = 1
    """USP's Ulysses degree inside each group of neighbouring cp ranks (the strategy's `context_parallel_ulysses`)."""
    accumulate_grads_in_fp32: Optional[bool] = None
    """ZeRO-1/2's gradient dtype, the strategy's knob of that name (None: fp32 under bf16-mixed; `estimate.state_bytes`)."""
    recompute_blocks: Optional[tuple[int, int, int]] = None
    """Under recompute="budget": the blocks run (full, selective, none) in that order, as
    `planner.recompute.cheapest_recompute` chose them for the memory (`evaluate` chooses them where None)."""

    def __post_init__(self) -> None:
        # A multi-stage schedule named without virtual stages gets the strategy's default for it (2).
        if self.virtual_stages == 1 and self.pipeline_schedule is not None and self.pipeline_schedule not in SINGLE_STAGE_SCHEDULES:
            object.__setattr__(self, "virtual_stages", 2)
        if self.pipeline_layers is not None:
            object.__setattr__(self, "pipeline_layers", tuple(map(int, self.pipeline_layers)))  # a search makes 10^5

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def zero_ranks(self) -> int:
        return zero_ranks(self.dp_shard, self.cp)

    @property
    def schedule(self) -> Optional[str]:
        if self.pp == 1:
            return None
        return self.pipeline_schedule or ("Interleaved1F1B" if self.virtual_stages > 1 else "1F1B")

    @property
    def recompute_label(self) -> str:
        """The recompute mode; a budget's blocks as "budget(full 4, selective 6, none 22)" once chosen."""
        if self.recompute != "budget" or self.recompute_blocks is None:
            return self.recompute
        return "budget(full {}, selective {}, none {})".format(*self.recompute_blocks)

    def describe(self) -> str:
        parts = [f"pp={self.pp}", f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"cp={self.cp}",
                 f"tp={self.tp}", f"ep={self.ep}", f"zero_stage={self.zero_stage}", f"micro_batch={self.micro_batch}",
                 f"grad_accumulation={self.grad_accumulation}", f"recompute={self.recompute_label}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}" + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else ""))
            if self.pipeline_layers is not None:
                parts.append(f"pipeline_layers={format_layers(self.pipeline_layers)}")
        if self.accumulate_unsharded_grads:
            parts.append("accumulate_unsharded_grads=True")
        if self.cp > 1:
            parts.append(f"cp_method={self.cp_method}")
        if self.cp_method == "usp":
            parts.append(f"cp_ulysses={self.cp_ulysses}")
        if self.accumulate_grads_in_fp32 is not None and self.zero_stage in (1, 2):
            parts.append(f"accumulate_grads_in_fp32={self.accumulate_grads_in_fp32}")
        return ", ".join(parts)


def layout_of_strategy(strategy: Any, dims: Any, *, micro_batch: int, grad_accumulation: int, recompute: str,
                       pipeline: Any = None) -> Layout:
    """The planner's `Layout` of an ultrascale strategy with its mesh degrees `dims` (`ParallelDims`) and its
    `PipelineLayout` (or None), for `micro_batch` sequences a micro-batch and `grad_accumulation` of them a step on
    each data-parallel rank (a pipeline's micro-batches)."""
    return Layout(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                  ep=dims.ep, zero_stage=strategy.zero_stage, micro_batch=micro_batch,
                  grad_accumulation=grad_accumulation, recompute=recompute,
                  accumulate_unsharded_grads=bool(strategy.accumulate_unsharded_grads and strategy.zero_stage == 3
                                              and pipeline is None and grad_accumulation > 1),
                  virtual_stages=pipeline.virtual_stages if pipeline is not None else 1,
                  pipeline_schedule=pipeline.schedule if pipeline is not None else None,
                  pipeline_layers=(pipeline.layers_per_stage if pipeline is not None and strategy.pipeline_layers is not None
                                   else None),
                  cp_method=strategy.context_parallel_method, cp_ulysses=strategy.context_parallel_ulysses or 1,
                  accumulate_grads_in_fp32=getattr(strategy, "accumulate_grads_in_fp32", None))


LAYOUT_KEYS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "zero_stage", "micro_batch", "grad_accumulation",
               "recompute", "virtual_stages", "accumulate_unsharded_grads", "cp_method", "cp_ulysses",
               "pipeline_schedule", "pipeline_layers", "accumulate_grads_in_fp32")
KNOB_DIMENSIONS = {"pipeline_schedule": "pp", "virtual_stages": "pp", "pipeline_layers": "pp", "cp_method": "cp",
                   "cp_ulysses": "cp"}
"""Knobs that mean something only where their dimension is above 1: a search with one of them fixed and the degree
free tries only degrees above 1 (a row without the knob would not be the layout asked for)."""
PIPELINE_SPLITS = ("even", "balanced")
"""`pipeline_layers` by name: the strategy's default split, or the embedding and the loss counted as a layer each
(`ultrascale.planner.pipeline.balanced_layers`)."""


def format_layers(layers: tuple[int, ...]) -> str:
    """(7, 8, 8, 8, 7) -> "7:8:8:8:7", as `--layout pipeline_layers=...` takes it."""
    return ":".join(str(n) for n in layers)


def parse_layout(text: str) -> dict[str, Any]:
    """`"pp=4,dp_shard=8,tp=8,zero_stage=1"` -> {"pp": 4, ...}; unknown keys and bad values are errors."""
    fixed: dict[str, Any] = {}
    aliases = {"dp": "dp_shard", "zero": "zero_stage", "mbs": "micro_batch", "acc": "grad_accumulation", "v": "virtual_stages",
               "schedule": "pipeline_schedule", "layers": "pipeline_layers"}
    for item in filter(None, (part.strip() for part in text.replace(" ", ",").split(","))):
        if "=" not in item:
            raise ValueError(f"layout item {item!r} is not key=value; keys: {', '.join(LAYOUT_KEYS)}")
        key, value = (part.strip() for part in item.split("=", 1))
        key = aliases.get(key, key)
        if key not in LAYOUT_KEYS:
            raise ValueError(f"unknown layout key {key!r}; keys: {', '.join(LAYOUT_KEYS)}")
        if key in ("accumulate_unsharded_grads", "accumulate_grads_in_fp32"):
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{key}={value!r}: give 0/1 or true/false")
            fixed[key] = value.lower() in ("1", "true")
            continue
        if key == "cp_method":
            raise_first(choice_problems(key, value, CONTEXT_PARALLEL_METHODS))
            fixed[key] = value
            continue
        if key == "pipeline_schedule":
            if value not in SCHEDULES:
                raise ValueError(f"schedule={value!r}: choose one of {', '.join(SCHEDULES)}")
            fixed[key] = value
            continue
        if key == "pipeline_layers":
            if value in PIPELINE_SPLITS:
                fixed[key] = value
                continue
            try:
                fixed[key] = tuple(int(n) for n in value.split(":"))
            except ValueError:
                raise ValueError(f"pipeline_layers={value!r}: give {' or '.join(PIPELINE_SPLITS)}, or the layers of each "
                                 "stage as 7:8:8:7") from None
            continue
        if key == "recompute":
            raise_first(choice_problems(key, value, rules.PLANNED_RECOMPUTE))
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


def model_facts_of(shape: ModelShape, hf_config: Any = None) -> ModelFacts:
    """The rulebook's facts of the model behind `shape`: from the config it was read from (or `hf_config`), built
    on the meta device as the strategy builds it; a hand-made shape counts as the built-in Llama of its sizes."""
    config = hf_config if hf_config is not None else shape.config
    plan = repr(getattr(config, "base_model_tp_plan", None))  # a config's plan may be edited in place
    cached = _FACTS_OF_SHAPE.get(id(shape))
    if cached is not None and cached[0] is shape and cached[1] is config and cached[2] == plan:
        return cached[3]  # the search asks thousands of times for one shape
    facts = _model_facts_of(shape, config)
    _FACTS_OF_SHAPE[id(shape)] = (shape, config, plan, facts)
    return facts


_FACTS_OF_SHAPE: dict[int, tuple[ModelShape, Any, str, ModelFacts]] = {}


def _model_facts_of(shape: ModelShape, config: Any) -> ModelFacts:
    from ultrascale.models.adapters import config_facts
    from ultrascale.models.llama import LlamaConfig

    if config is None:
        config = LlamaConfig(
            vocab_size=shape.vocab, dim=shape.hidden, n_layers=shape.n_layers, n_heads=shape.n_heads,
            n_kv_heads=shape.n_kv_heads, ffn_hidden_dim=shape.ffn_hidden, tie_embeddings=shape.tied_embeddings,
            **(dict(n_experts=shape.n_experts, moe_top_k=shape.top_k, moe_hidden_dim=shape.expert_hidden)
               if shape.n_experts else {}),
        )
    return config_facts(config)


def runs_as(layout: Layout) -> Layout:
    """The layout ultrascale runs for `layout`. ZeRO-0 (plain data parallel: weights, gradients and optimizer
    state replicated, gradients all-reduced) is HSDP without sharding: every data-parallel rank a replica
    (dp_replicate = dp, dp_shard = 1 under zero_stage=3). With context parallel the cp ranks would share
    FSDP's shard axis, so ZeRO-0 x cp stays as asked (and is refused by the rulebook)."""
    if layout.zero_stage != 0 or layout.cp > 1:
        return layout
    return dataclasses.replace(layout, dp_replicate=layout.dp, dp_shard=1, zero_stage=3, accumulate_unsharded_grads=False)


def layout_knobs(layout: Layout) -> LayoutKnobs:
    """The strategy knobs a planner layout stands for (its recipe: `ultrascale.planner.recipe.recipe_yaml`)."""
    layout = runs_as(layout)
    return LayoutKnobs(
        dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp, tp=layout.tp, pp=layout.pp,
        ep=layout.ep, zero_stage=layout.zero_stage, pipeline_schedule=layout.schedule or "1F1B",
        pipeline_layers=layout.pipeline_layers,
        pipeline_virtual_stages=layout.virtual_stages if layout.pp > 1 or layout.virtual_stages != 1 else None,
        pipeline_microbatches=layout.grad_accumulation if layout.pp > 1 else None,
        accumulate_unsharded_grads=layout.accumulate_unsharded_grads, context_parallel_method=layout.cp_method,
        # A Ulysses degree beside another method reaches the rulebook, which refuses it by name.
        context_parallel_ulysses=layout.cp_ulysses if layout.cp_method == "usp" or layout.cp_ulysses != 1 else None,
    )


def rule_problems(layout: Layout, shape: ModelShape, cluster: Cluster, seq_len: int, global_batch: int,
                  hf_config: Any = None) -> list[Problem]:
    """The rulebook's verdict on `layout` for this model and batch (`ultrascale.parallel.rules`: the strategy's own
    checks, in its order), then the planner's own choices of what it prices: TP inside a node, accumulation
    of unsharded gradients only where it changes something, a known recompute mode."""
    knobs = layout_knobs(layout)
    problems = rules.knob_problems(knobs)
    dims, mesh_problems = rules.resolve(knobs, cluster.gpus)
    problems += mesh_problems
    if dims is not None:
        facts = model_facts_of(shape, hf_config)
        problems += rules.model_problems(dims, knobs, facts)
        problems += rules.batch_problems(
            dims, seq_len=seq_len, global_batch=global_batch,
            sequence_parallel=rules.sequence_parallel_of(knobs, facts),
            microbatches=layout.grad_accumulation if layout.pp > 1 else None,
            micro_batch=layout.micro_batch, grad_accumulation=layout.grad_accumulation)
    # The planner's search space (not refusals of the strategy): each is a layout it does not price.
    if layout.tp > cluster.gpus_per_node:
        problems.append(Problem(f"tp={layout.tp} spans nodes ({cluster.gpus_per_node} GPUs per node): TP's per-layer "
                                "collectives need NVLink"))
    if layout.accumulate_unsharded_grads and not (layout.pp == 1 and layout.grad_accumulation > 1):
        problems.append(Problem("accumulate_unsharded_grads changes nothing without gradient accumulation, and a "
                                "pipeline reduces once per step anyway"))
    problems += rules.recompute_problems(layout.recompute, layout.pp)
    return problems


def layout_problems(layout: Layout, shape: ModelShape, cluster: Cluster, seq_len: int, global_batch: int,
                    hf_config: Any = None) -> list[str]:
    """Why ultrascale would refuse `layout` for this model on this cluster (empty: it runs), in the words the
    strategy would use (`rule_problems`)."""
    return [problem.text() for problem in rule_problems(layout, shape, cluster, seq_len, global_batch, hf_config)]


