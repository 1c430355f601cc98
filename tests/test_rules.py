"""The rulebook (`ultrascale.parallel.rules`) is the one judge of what runs.

The drift test walks a grid of layouts x model configs and holds three verdicts equal:

- the strategy's, on the model built on the meta device (its constructor, `resolve_dims`, `check_model`:
  what a `Trainer.fit` checks before any weight moves);
- the rulebook's on the facts a config declares (what `ultrascale plan`, the auto layout and the
  launcher's early check see before any model exists);
- the planner's `layout_problems` for the layouts it can express.

Accepted means it parallelises: every accepted layout of a sample is applied with `parallelize` on the
meta device under a fake process group of its world size. A caller that changes a rule on its own
(the planner refusing what the strategy runs, the strategy refusing what the planner offers) fails here.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import pytest
import torch

from ultrascale import planner
from ultrascale.estimate import ModelShape
from ultrascale.models.adapters import config_facts, plan_model
from ultrascale.models.llama import Llama, LlamaConfig
from ultrascale.parallel import rules
from ultrascale.parallel.rules import LayoutKnobs, Problem
from ultrascale.strategies import UltraScaleStrategy

SEQ_LEN = 64  # divisible by 2 * cp * tp for every degree in the grid
MICROBATCHES = 4  # fills every schedule of pp=2 (DualPipeV and the interleaved ones need 4)


def _configs() -> dict[str, Any]:
    import transformers as T

    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256)
    return {
        "llama": LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128),
        "llama_moe": LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128,
                                 n_experts=4, moe_top_k=2, moe_hidden_dim=32),
        "hf_llama": T.LlamaConfig(**common),
        "qwen3": T.Qwen3Config(**common, head_dim=16),
        "mixtral": T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        "gemma3": T.Gemma3TextConfig(**common, head_dim=16),
        "gpt2": T.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256, bos_token_id=0, eos_token_id=0),
    }


def _build(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        if isinstance(config, LlamaConfig):
            return Llama(config)
        import transformers

        return transformers.AutoModelForCausalLM.from_config(config)


def _grid() -> list[dict[str, Any]]:
    """Each degree 1 or 2, ZeRO 1/2/3, every schedule under pp, both cp methods under cp."""
    layouts = []
    for dpr, dps, cp, tp, pp, ep in itertools.product((1, 2), repeat=6):
        for zero in (1, 2, 3):
            schedules = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble") if pp > 1 else ("1F1B",)
            methods = ("ring", "allgather") if cp > 1 else ("ring",)
            for schedule, method in itertools.product(schedules, methods):
                layouts.append(dict(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep, zero_stage=zero,
                                    pipeline_schedule=schedule, context_parallel_method=method))
    return layouts


def _world(layout: dict[str, Any]) -> int:
    return layout["dp_replicate"] * layout["dp_shard"] * layout["cp"] * layout["tp"] * layout["pp"]


def _knobs(layout: dict[str, Any]) -> LayoutKnobs:
    return LayoutKnobs(**layout, pipeline_microbatches=MICROBATCHES if layout["pp"] > 1 else None)


def _strategy_verdict(layout: dict[str, Any], model: torch.nn.Module) -> Optional[str]:
    """What the strategy says, in its order: constructor, the mesh for the world size, the built model."""
    try:
        strategy = UltraScaleStrategy(
            data_parallel_replicate=layout["dp_replicate"], data_parallel_shard=layout["dp_shard"],
            context_parallel=layout["cp"], tensor_parallel=layout["tp"], pipeline_parallel=layout["pp"],
            expert_parallel=layout["ep"], zero_stage=layout["zero_stage"],
            context_parallel_method=layout["context_parallel_method"], pipeline_schedule=layout["pipeline_schedule"],
            pipeline_microbatches=MICROBATCHES if layout["pp"] > 1 else None,
        )
        strategy.check_model(model, dims=strategy.resolve_dims(_world(layout)))
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None


def _config_verdict(layout: dict[str, Any], config: Any) -> Optional[Problem]:
    """The rulebook on what the config declares, in the same order."""
    knobs = _knobs(layout)
    problems = rules.knob_problems(knobs)
    dims, mesh = rules.resolve(knobs, _world(layout))
    problems += mesh
    if dims is not None:
        problems += rules.model_problems(dims, knobs, config_facts(config))
    return problems[0] if problems else None


def _planner_layout(layout: dict[str, Any]) -> Optional[planner.Layout]:
    """The planner's Layout for this grid point; None where the planner has no words for it (its schedules are
    1F1B and Interleaved1F1B, its context parallel the ring)."""
    if layout["pipeline_schedule"] not in ("1F1B", "Interleaved1F1B") or layout["context_parallel_method"] != "ring":
        return None
    pp = layout["pp"]
    return planner.Layout(pp=pp, dp_replicate=layout["dp_replicate"], dp_shard=layout["dp_shard"], cp=layout["cp"],
                          tp=layout["tp"], ep=layout["ep"], zero_stage=layout["zero_stage"], micro_batch=1,
                          grad_accumulation=MICROBATCHES if pp > 1 else 1,
                          virtual_stages=2 if layout["pipeline_schedule"] == "Interleaved1F1B" else 1)


@pytest.mark.parametrize("name", list(_configs()))
def test_strategy_planner_and_config_rules_agree(name):
    config = _configs()[name]
    model = _build(config)
    try:
        shape = ModelShape.from_hf_config(config) if not isinstance(config, LlamaConfig) else (
            ModelShape.from_llama_config(config))
    except ValueError:
        shape = None  # a model the cost model does not describe (GPT-2): the planner does not price it
    checked = priced = refused = 0
    for layout in _grid():
        strategy = _strategy_verdict(layout, model)
        expected = _config_verdict(layout, config)
        owner = "UltraScaleStrategy"
        assert strategy == (expected.text(owner) if expected else None), (name, layout)
        checked += 1
        refused += strategy is not None
        lay = _planner_layout(layout)
        if shape is None or lay is None:
            continue
        cluster = planner.Cluster(planner.GPU_SPECS["h100"], _world(layout), gpus_per_node=32)
        hf_config = None if isinstance(config, LlamaConfig) else config
        found = planner.layout_problems(lay, shape, cluster, SEQ_LEN, lay.dp * lay.micro_batch * lay.grad_accumulation,
                                        hf_config=hf_config)
        assert (found[0] if found else None) == (expected.text() if expected else None), (name, layout, found)
        priced += 1
    assert checked == len(_grid()) and 0 < refused < checked
    assert priced > 0 or shape is None


def _parallelise_sample(stride: int) -> int:
    """Every `stride`-th grid point over every model that the rulebook accepts, applied as the strategy applies it
    (`plan_model` then `parallelize`) on the meta device under a fake process group of the layout's world size."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultrascale.parallel.context import ContextParallel
    from ultrascale.parallel.dims import build_mesh
    from ultrascale.parallel.parallelize import parallelize

    configs = _configs()
    applied = 0
    for layout in _grid()[::stride]:
        for name, config in configs.items():
            if _config_verdict(layout, config) is not None:
                continue
            knobs, world, model = _knobs(layout), _world(layout), _build(config)
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            try:
                dims, _ = rules.resolve(knobs, world)
                mesh = build_mesh(dims, "cpu")
                plan = plan_model(model, dims, knobs)
                context = ContextParallel(mesh["cp"], knobs.context_parallel_method) if dims.cp_enabled else None
                parallelize(model, mesh, blocks=plan.adapter.blocks, tp_plan=plan.tp_plan, transforms=[],
                            mp_policy=None, reshard_after_forward=True, shard_parameters=knobs.zero_stage == 3,
                            context_parallel=context, enable_context_parallel=plan.adapter.enable_context_parallel,
                            pipeline=plan.pipeline, enable_expert_parallel=plan.adapter.enable_expert_parallel,
                            experts=plan.adapter.experts)
            except Exception as error:  # noqa: BLE001 - any failure of an accepted layout is the finding
                raise AssertionError(f"{name} {layout}: accepted by the rulebook, but parallelize failed: {error!r}") from error
            finally:
                dist.destroy_process_group()
            applied += 1
    return applied


def _child(stride: int, queue: Any) -> None:
    try:
        queue.put(("ok", _parallelise_sample(stride)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put(("error", str(error)))


def test_accepted_layouts_parallelise_on_the_meta_device():
    """In a forked child: torch keeps the meshes a process group built (and their group names) in process-wide
    caches, which would leak this fake group into the later multi-rank tests of this pytest process."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(7, queue))
    child.start()
    status, value = queue.get(timeout=600)
    child.join(timeout=60)
    assert status == "ok", value
    assert value > 20


def test_rules_explain_with_the_knob_names():
    problem = rules.knob_problems(LayoutKnobs(accumulate_unsharded_grads=True, zero_stage=1))[0]
    assert problem.knobs == ("accumulate_unsharded_grads=True", "zero_stage=1")
    assert problem.text("UltraScaleStrategy").startswith(
        "UltraScaleStrategy(`accumulate_unsharded_grads=True`, `zero_stage=1`): accumulate_unsharded_grads chooses")
    with pytest.raises(ValueError, match="accumulate_unsharded_grads chooses how ZeRO-3"):
        rules.raise_first([problem], "X")
    assert rules.knob_problems(LayoutKnobs(tp=2, ep=2)) == []  # EP x TP
    assert rules.knob_problems(LayoutKnobs(tp=2, zero_stage=1)) == []  # ZeRO-1/2 over the tp shards
    dims, problems = rules.resolve(LayoutKnobs(dp_shard=3), 4)
    assert dims is None and "dp_shard(3)" in problems[0].text()
    assert rules.pipeline_problems(n_layers=4, pp=2, schedule="1F1B", microbatches=1)[0].message.startswith(
        "1F1B needs at least as many micro-batches as stages (2)")
    assert rules.knob_problems(LayoutKnobs(zero_stage=2, accumulate_unsharded_grads=True))[0].knobs == (
        "accumulate_unsharded_grads=True", "zero_stage=2")


@pytest.mark.parametrize("strategy, knob", [
    ("TensorParallelStrategy", "tensor_parallel"), ("ContextParallelStrategy", "context_parallel"),
    ("PipelineParallelStrategy", "pipeline_parallel"), ("ExpertParallelStrategy", "expert_parallel"),
    ("HSDPStrategy", "data_parallel_replicate"),
])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "two"])
def test_a_degree_resolved_at_launch_is_auto_or_a_positive_int(strategy, knob, value):
    """One rule (`rules.auto_degree_problems`) for every strategy whose degree may be 'auto', asked at construction."""
    import ultrascale

    with pytest.raises(rules.LayoutError, match=rf"{strategy}\(`{knob}={value!r}`\): give a positive int or 'auto'"):
        getattr(ultrascale, strategy)(**{knob: value})
    assert rules.auto_degree_problems(**{knob: "auto"}) == rules.auto_degree_problems(**{knob: 3}) == []


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_a_count_is_a_positive_int_wherever_it_arrives(value):
    """One rule (`rules.positive_int_problems`) for counts given as numbers: a pipeline knob of a strategy, a size of
    accelerate's ParallelismConfig, measure_layout's sequence length (refused before its child process starts)."""
    import ultrascale
    from ultrascale.measure import measure_layout

    with pytest.raises(rules.LayoutError, match=rf"\(`pipeline_microbatches={value!r}`\): must be a positive integer"):
        ultrascale.PipelineParallelStrategy(pipeline_parallel=2, pipeline_microbatches=value)
    with pytest.raises(rules.LayoutError, match=rf"from_accelerate\(`tp_size={value!r}`\): must be a positive integer"):
        ultrascale.UltraScaleStrategy.from_accelerate({"tp_size": value})
    with pytest.raises(rules.LayoutError, match=rf"measure_layout\(`seq_len={value!r}`\): must be a positive integer"):
        measure_layout("tiny", world=2, seq_len=value)
    assert rules.positive_int_problems(seq_len=4096, micro_batch=1) == []
