"""`ultrascale.measure`: per-GPU memory of a layout, measured on fake tensors in a child process.

Each measurement starts a child Python (importing ultrascale costs ~5 s of its ~8 s on a small model).
"""

import pytest
import torch

from ultrascale import planner
from ultrascale.measure import CATEGORIES, GIB, measure_layout
from ultrascale.models.adapters import model_shape
from ultrascale.models.llama import Llama, LlamaConfig


def _numel(preset: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(LlamaConfig.from_preset(preset)).parameters())


def check_sums(result: dict) -> None:
    assert set(result["breakdown_gib"]) == set(CATEGORIES)
    assert sum(result["breakdown_gib"].values()) == pytest.approx(result["peak_gib"], rel=1e-9)
    assert sum(result["tracker_gib"].values()) == pytest.approx(result["peak_gib"], rel=1e-9)
    assert result["phases"][result["peak_phase"]]["peak_gib"] == result["peak_gib"]
    assert max(phase["peak_gib"] for phase in result["phases"].values()) == result["peak_gib"]


@pytest.mark.parametrize(
    ("world", "degrees", "shards"),
    [(2, {}, 2), (4, {"dp_shard": 2, "tp": 2}, 4)],
    ids=["fsdp2", "fsdp2xtp2"],
)
def test_small_model_params_are_the_sharded_fp32_weights(world, degrees, shards):
    result = measure_layout("small", world=world, seq_len=256, micro_batch=2, **degrees)
    # bf16-mixed under ZeRO-3: every rank keeps 1/shards of the fp32 weights.
    expected = _numel("small") * 4 / shards
    assert result["breakdown_gib"]["params"] * GIB == pytest.approx(expected, rel=0.05)
    assert result["params_per_rank"] == pytest.approx(_numel("small") / shards, rel=0.05)
    assert result["tracker"] == "FSDPMemTracker" and result["rank"] == 0
    assert result["layout"]["dp_shard"] == world // degrees.get("tp", 1) and result["layout"]["tp"] == degrees.get("tp", 1)
    assert result["layout"]["sequence_parallel"] == (degrees.get("tp", 1) > 1)
    # AdamW's two fp32 moments and nothing more: fused AdamW (`ADAMW_KERNEL`) holds no temporary at the step
    assert result["phases"]["optimizer step"]["breakdown_gib"]["optimizer"] * GIB == pytest.approx(2 * expected, rel=0.05)
    assert result["breakdown_gib"]["activations"] > 0
    check_sums(result)


def test_refusals_come_before_any_child_process():
    with pytest.raises(NotImplementedError, match="expert parallel"):
        measure_layout("tiny_moe", world=2, ep=2)
    with pytest.raises(ValueError, match="precision"):
        measure_layout("small", world=2, precision="fp8")
    with pytest.raises(ValueError, match="recompute"):
        measure_layout("small", world=2, recompute="sometimes")
    with pytest.raises(ValueError, match="world size"):
        measure_layout("small", world=3, dp_shard=2)
    with pytest.raises(ValueError, match="preset"):
        measure_layout("no_such_model", world=2)


# Llama 3 8B at world 8 (ZeRO-3, full recompute) is measured once, by tests/test_planner.py's
# `test_measure_agrees_with_the_formulas_on_8b_at_world_8`, which also holds this file's checks of it.


@pytest.mark.slow
@pytest.mark.parametrize(
    ("degrees", "param_bytes"),
    [
        # ZeRO-2, bf16-mixed: replicated bf16 weights (the fp32 masters count as optimizer state)
        ({"zero_stage": 2}, lambda n, emb, layer: 2 * n),
        # pp=2, 1F1B: rank 0 holds stage 0 (embedding + first half of the layers), fp32 weights
        ({"pp": 2, "pipeline_microbatches": 4}, lambda n, emb, layer: 4 * (emb + 2 * layer)),
        # ZeRO-1 over tp 2: each rank's bf16 tp shards (the norms, whole on both, are 0.1%)
        ({"zero_stage": 1, "tp": 2}, lambda n, emb, layer: 2 * n / 2),
    ],
    ids=["zero2", "pp2", "zero1xtp2"],
)
def test_zero12_and_pipeline_paths(degrees, param_bytes):
    config = LlamaConfig.from_preset("small")
    with torch.device("meta"):
        model = Llama(config)
    n = sum(p.numel() for p in model.parameters())
    emb = model.tok_embeddings.weight.numel()
    layer = sum(p.numel() for p in model.layers[0].parameters())
    result = measure_layout("small", world=2, seq_len=256, **degrees)
    assert result["breakdown_gib"]["params"] * GIB == pytest.approx(param_bytes(n, emb, layer), rel=0.05)
    check_sums(result)


@pytest.mark.slow
def test_gradient_accumulation_keeps_zero3_gradients_sharded_unless_asked():
    # By default the strategy reduce-scatters every micro-batch: FSDP's gradients stay 1/N shards, so
    # accumulation adds only the sharded fp32 gradients kept between micro-batches. With
    # `accumulate_unsharded_grads` it skips the reduce-scatter on all but the last (`block_backward_sync`)
    # and FSDP2 accumulates every parameter's whole gradient in its reduce dtype (fp32 under bf16-mixed).
    n = _numel("small")
    one = measure_layout("small", world=2, seq_len=256)
    sharded = measure_layout("small", world=2, seq_len=256, grad_accumulation=2)
    unsharded = measure_layout("small", world=2, seq_len=256, grad_accumulation=2, accumulate_unsharded_grads=True)
    assert sharded["layout"]["grad_accumulation"] == 2
    assert sharded["breakdown_gib"]["params"] == pytest.approx(one["breakdown_gib"]["params"])
    assert (sharded["peak_gib"] - one["peak_gib"]) * GIB < 0.6 * 4 * n  # at most the fp32 shards (4n / 2) and noise
    assert unsharded["tracker_gib"]["Temp"] * GIB >= 4 * n  # the fp32 whole gradients (and the backward's temporaries)
    assert (unsharded["peak_gib"] - one["peak_gib"]) * GIB > 0.8 * 4 * n
    # The planner prices both within 10% of these measurements (its own side: tests/test_planner.py's
    # `test_accumulate_unsharded_grads_priced_and_searched`).
    for whole, measured in ((False, sharded), (True, unsharded)):
        predicted = planner.evaluate(
            model_shape("small"), planner.Layout(dp_shard=2, micro_batch=1, grad_accumulation=2, accumulate_unsharded_grads=whole),
            planner.Cluster(planner.GPU_SPECS["h100"], 2), planner.Workload(256, 4)).memory["total"] / GIB
        assert abs(predicted - measured["peak_gib"]) / measured["peak_gib"] < 0.10, (whole, predicted, measured)
    for result in (sharded, unsharded):
        check_sums(result)


def _measure_in(queue):
    queue.put(measure_layout("small", world=2, seq_len=256)["peak_gib"])


def test_a_daemonic_caller_can_measure():
    """A multiprocessing.Pool worker is daemonic, and multiprocessing refuses it children: the measurement forks
    with os.fork."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    worker = context.Process(target=_measure_in, args=(queue,), daemon=True)
    worker.start()
    peak = queue.get(timeout=120)
    worker.join(timeout=60)
    assert worker.exitcode == 0 and peak > 0
