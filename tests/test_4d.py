"""`ultrascale_4d`: every dimension at once, the planner-chosen layout, accelerate layouts, the attention choice.

Parity is against `tests._parity.reference_run` (plain torch, whole global batch, the token-mean
loss written inline) on prompt-masked data with an empty row.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, assert_parity, merge_stages, parity_trainer, reference_run, step_losses
from tests.test_pipeline_parallel import BATCH, SEQ, STEPS, _check, make_llama, masked_data
from ultrascale import planner
from ultrascale.models.lm import LlamaLM


@pytest.mark.slow
def test_pp2_dp2_cp2_tp2_world16_parity():
    """All four at once on 16 ranks: 1F1B stages, ZeRO-3 over dp_shard x cp, ring attention over the
    sequence halves, TP with sequence parallel inside each stage."""
    _check(16, {"pipeline_parallel": 2, "data_parallel_shard": 2, "context_parallel": 2, "tensor_parallel": 2,
                "pipeline_microbatches": 2})


class SizedParityData(ParityData):
    """`ParityData` declaring its batch as ultrascale's data modules do (what `auto_layout` reads)."""

    def __init__(self, global_batch: int) -> None:
        super().__init__(masked_data(), global_batch)
        self.seq_len = SEQ
        self.global_batch_size = global_batch


def _train_auto(rank, world_size, strategy, global_batch, n_layers):
    recorder = Recorder()
    trainer = parity_trainer(world_size, strategy, recorder, STEPS)
    trainer.fit(make_llama(n_layers), SizedParityData(global_batch))
    chosen = trainer.strategy.chosen_layout
    return {**recorder.result(), "chosen": chosen.layout if chosen else None,
            "mesh": trainer.strategy.parallel_dims.describe(), "cp_method": trainer.strategy.context_parallel_method}


def _expected_layout(world: int, global_batch: int, fixed: dict, n_layers: int = 4, calibration=None) -> planner.Layout:
    """The planner's best layout for the parity model on CPU ranks, asked directly (with a calibration file)."""
    from ultrascale.estimate import ModelShape
    from ultrascale.strategies.auto_layout import AutoLayoutInputs, choose_layout, device_cluster

    config = make_llama(n_layers).config
    cluster = device_cluster(torch.device("cpu"), world, world)
    if calibration is not None:
        cluster = planner.calibrated(cluster, planner.load_calibration(calibration, cluster.gpu.name))
    inputs = AutoLayoutInputs(ModelShape.from_llama_config(config), None, planner.Workload(SEQ, global_batch, "32-true"),
                              cluster, 1)
    return choose_layout(inputs, fixed).layout


@pytest.mark.parametrize(("world", "global_batch", "strategy", "fixed", "n_layers"), [
    (2, BATCH, "ultrascale_4d", {}, 4),
    (4, BATCH, {"auto_layout": True, "tensor_parallel": 2}, {"tp": 2}, 4),
    # cp fixed at 4: the planner prices Ulysses below the ring here, and the strategy runs the method it chose.
    (4, BATCH, {"auto_layout": True, "context_parallel": 4}, {"cp": 4}, 4),
    # 6 layers on 2 ranks x 2 interleaved stages: no even split, so the planner's balanced one (1, 2, 2, 1), which
    # the strategy must then run (it refuses 4 stages over 6 layers without `pipeline_layers`).
    (2, BATCH, {"auto_layout": True, "pipeline_parallel": 2, "pipeline_schedule": "Interleaved1F1B"},
     {"pp": 2, "pipeline_schedule": "Interleaved1F1B"}, 6),
    # A cp method with cp free asks for cp: before, the planner's cp=1 row ran and the method was dropped silently.
    (2, BATCH, {"auto_layout": True, "context_parallel_method": "alltoall"}, {"cp_method": "alltoall"}, 4),
], ids=["by-name-world2", "tp-fixed-world4", "cp-fixed-world4", "interleaved-balanced-world2", "cp-method-world2"])
def test_auto_layout_is_the_planners_and_exact(world, global_batch, strategy, fixed, n_layers):
    strategy = ultrascale.UltraScaleStrategy(**strategy) if isinstance(strategy, dict) else strategy
    results = run_ranks(_train_auto, world, strategy, global_batch, n_layers)
    expected = _expected_layout(world, global_batch, fixed, n_layers)
    if n_layers == 6:
        assert expected.pipeline_layers == (1, 2, 2, 1)
    assert all(result["chosen"] == expected for result in results), (results[0]["chosen"], expected)
    assert all(getattr(expected, key) == value for key, value in fixed.items())
    dims = f"pp={expected.pp} x dp_replicate={expected.dp_replicate} x dp_shard={expected.dp_shard} x cp={expected.cp} x tp={expected.tp}"
    assert results[0]["mesh"].startswith(dims)
    if expected.cp > 1:
        assert expected.cp_method == "alltoall" and results[0]["cp_method"] == expected.cp_method
    reference = reference_run(make_llama(n_layers), masked_data(), global_batch=global_batch, steps=STEPS)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    # The planner may recompute (cp fixed at 4: ZeRO-2's reduce-scatter outlasts one backward, and the recomputed forward
    # hides it at no cost): the wrapped blocks' names lose their wrapper.
    assert_parity(merge_stages(results, strip="_checkpoint_wrapped_module." if expected.recompute != "none" else ""),
                  reference, losses)


def test_auto_layout_follows_this_machines_calibration(tmp_path):
    """A calibration (`ultrascale tune --calibrate`) that measured the planner's first choice's layout family at a
    hundredth of its predicted speed moves the auto layout to another family; the run stays exact."""
    plain = _expected_layout(2, BATCH, {})
    path = tmp_path / "calibration.json"
    planner.Calibration("CPU", {planner.layout_family(plain): 0.01, "all": 1.0}, devices="cpu").save(path)
    expected = _expected_layout(2, BATCH, {}, calibration=str(path))
    assert planner.layout_family(expected) != planner.layout_family(plain)
    strategy = ultrascale.UltraScaleStrategy(auto_layout=True, planner_calibration=str(path))
    results = run_ranks(_train_auto, 2, strategy, BATCH, 4)
    assert all(result["chosen"] == expected for result in results), (results[0]["chosen"], expected)
    reference = reference_run(make_llama(4), masked_data(), global_batch=BATCH, steps=STEPS)
    assert_parity(merge_stages(results), reference, step_losses(results))
    with pytest.raises(ValueError, match="needs|pass `auto_layout=True`"):
        ultrascale.UltraScaleStrategy(planner_calibration=str(path))


def test_auto_layout_on_one_device_takes_the_batch_as_one_micro_batch():
    """16 sequences on one device: one Lightning batch is one micro-batch of 16, above the planner's default search
    cap of 8 (`ultrascale verify-matrix` found this refused)."""
    layout = _expected_layout(1, 16, {})
    assert (layout.micro_batch, layout.grad_accumulation, layout.world) == (16, 1, 1)


def test_registry_turns_auto_layout_on_only_by_name():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ultrascale_4d", logger=False)
    assert trainer.strategy.auto_layout is True
    assert ultrascale.UltraScaleStrategy().auto_layout is False


def _auto_refused(rank, world_size, preset):
    import torch.distributed as dist

    from ultrascale.data import CausalLMDataModule

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ultrascale_4d", max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    data = CausalLMDataModule(seq_len=64, global_batch_size=2, max_tokens=5_000, val_fraction=0.0)
    try:
        trainer.fit(LlamaLM(preset=preset, max_seq_len=64), data)
    except ValueError as error:
        return str(error), dist.is_initialized()
    return None, dist.is_initialized()


def test_auto_layout_that_cannot_fit_says_so_before_any_process_group():
    # 70B parameters on two CPU ranks: no layout's model states fit in this machine's memory.
    for error, initialised in run_ranks(_auto_refused, 2, "llama3_70b"):
        assert error is not None and "no layout of Llama (LlamaLM)" in error and "fits" in error, error
        assert "UltraScaleStrategy(auto_layout=True)" in error
        assert not initialised


class _Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _auto_unknown(rank, world_size):
    import warnings

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ultrascale_4d", max_steps=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Plain())
    said = [str(w.message) for w in caught if "auto_layout" in str(w.message)]
    return said, trainer.strategy.parallel_dims.describe()


def test_auto_layout_on_a_model_the_planner_cannot_read_says_so_and_keeps_zero3():
    said, mesh = run_ranks(_auto_unknown, 2)[0]
    assert said and "_Plain has no `config` the planner reads" in said[0], said
    assert mesh.startswith("pp=1 x dp_replicate=1 x dp_shard=2")


# --------------------------------------------------------------------------- accelerate


def test_from_accelerate_maps_every_field():
    import dataclasses

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import TorchContextParallelConfig

    from ultrascale.strategies.accelerate_interop import ACCELERATE_FIELDS

    # Every field accelerate declares is in the table (a new accelerate field fails here, not silently).
    declared = {f.name for f in dataclasses.fields(ParallelismConfig)} - {"tp_handler", "cp_handler", "sp_handler"}
    assert declared <= {name.split(".")[0] for name in ACCELERATE_FIELDS}, declared

    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=2,
                               cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))
    strategy = ultrascale.UltraScaleStrategy.from_accelerate(config, zero_stage=3, pipeline_parallel=1)
    assert strategy.resolve_dims(16).describe().startswith("pp=1 x dp_replicate=2 x dp_shard=2 x cp=2 x tp=2")
    assert strategy.context_parallel_method == "ring"
    allgather = ultrascale.UltraScaleStrategy.from_accelerate({"dp_shard_size": 4, "cp_size": 2})
    assert allgather.context_parallel_method == "allgather"  # accelerate's default comm strategy
    assert allgather.resolve_dims(8).describe().startswith("pp=1 x dp_replicate=1 x dp_shard=4 x cp=2 x tp=1")
    ulysses = ultrascale.UltraScaleStrategy.from_accelerate(ParallelismConfig(dp_shard_size=2, sp_size=2))
    assert ulysses.context_parallel_method == "alltoall"  # DeepSpeed-Ulysses sequence parallel
    assert ulysses.resolve_dims(4).describe().startswith("pp=1 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=1")
    # cp with sp (accelerate's own ParallelismConfig refuses it; a mapping carries it): USP, sp inside cp.
    usp = ultrascale.UltraScaleStrategy.from_accelerate({"dp_shard_size": 2, "cp_size": 2, "sp_size": 2})
    assert (usp.context_parallel_method, usp.context_parallel_ulysses) == ("usp", 2)
    assert usp.resolve_dims(8).describe().startswith("pp=1 x dp_replicate=1 x dp_shard=2 x cp=4 x tp=1")
    # accelerate's sizes are exact: a layout that does not fill the world is refused, naming the product.
    with pytest.raises(ValueError, match="world size"):
        ultrascale.UltraScaleStrategy.from_accelerate(ParallelismConfig(dp_shard_size=2)).resolve_dims(4)


def test_from_accelerate_refuses_what_ultrascale_does_not_run():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig, TorchTensorParallelConfig

    with pytest.raises(ValueError, match="USP passes K/V around the ring"):
        ultrascale.UltraScaleStrategy.from_accelerate(
            {"dp_shard_size": 2, "cp_size": 2, "sp_size": 2, "cp_handler": {"cp_comm_strategy": "allgather"}})
    with pytest.raises(NotImplementedError, match="SDPA"):
        ultrascale.UltraScaleStrategy.from_accelerate(ParallelismConfig(
            dp_shard_size=2, sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="flash_attention_2")))
    with pytest.raises(ValueError, match="async_tensor_parallel=True` is a pass of inductor's"):
        ultrascale.UltraScaleStrategy.from_accelerate(
            ParallelismConfig(dp_shard_size=2, tp_size=2, tp_handler=TorchTensorParallelConfig(enable_async_tp=True)))
    with pytest.raises(ValueError, match="unknown ParallelismConfig field"):
        ultrascale.UltraScaleStrategy.from_accelerate({"dp_shard_size": 2, "pp_size": 2})
    with pytest.raises(ValueError, match="come from the ParallelismConfig"):
        ultrascale.UltraScaleStrategy.from_accelerate({"tp_size": 2}, tensor_parallel=4)


# --------------------------------------------------------------------------- attention kernel


def test_attention_kernel_is_chosen_in_one_place(monkeypatch):
    from ultrascale.parallel import device as device_module

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert device_module.attention_backend(cpu, torch.bfloat16) == "sdpa"
    monkeypatch.setattr(device_module, "flash_attn_installed", lambda: False)
    assert device_module.attention_backend(cuda, torch.bfloat16) == "sdpa"
    monkeypatch.setattr(device_module, "flash_attn_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert device_module.attention_backend(cuda, torch.bfloat16) == "flash"
    assert device_module.hf_attention_implementation(cuda, torch.bfloat16) == "flash_attention_2"
    assert device_module.attention_backend(cuda, torch.float32) == "sdpa"  # flash-attn has no fp32 kernel
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert device_module.attention_backend(cuda, torch.float16) == "sdpa"  # pre-Ampere


def test_context_parallel_cuda_blocks_go_to_flash_where_it_applies(monkeypatch):
    """Which CUDA kernel a ring block takes, and both kernels' calls checked against torch's op schemas on meta tensors
    (the numbers are tests/test_gpu.py's): flash without a bias, with a head width that is a multiple of 8 and where
    torch's own flash rule (asked as for training) agrees; the efficient kernel otherwise."""
    from ultrascale.parallel import attention_kernels as kernels

    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = torch.empty(2, 8, 37, 32, **meta), torch.empty(2, 2, 74, 32, **meta), torch.empty(2, 2, 74, 32, **meta)
    asked = []

    def torch_rule(params, debug):
        asked.append((params.query.requires_grad, params.enable_gqa, params.is_causal))
        return True

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", torch_rule)
    bias = torch.zeros(1, 1, 37, 74, **meta)
    assert not kernels._flash_takes(q, k, v, False, bias)  # documents / windows
    assert not kernels._flash_takes(q[..., :20], k[..., :20], v[..., :20], False, None)  # 20 is not a multiple of 8
    assert not kernels._flash_takes(q, k, v, True, None)  # causal only on the square own block
    assert asked == []
    assert kernels._flash_takes(q, k, v, False, None)
    assert asked == [(True, True, False)]

    checked = []

    def check_shapes(kind, names, got, efficient):  # meta tensors have no values: the shapes agree
        assert [x.shape for x in got] == [x.shape for x in efficient()]
        checked.append(kind[:2])
        return got

    monkeypatch.setattr(kernels, "_checked_against_efficient", check_shapes)
    efficient_calls = []
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention",
                        lambda *a, **kw: efficient_calls.append(1) or efficient(*a, **kw))
    out, lse = kernels._cuda_forward(q, k, v, False, None, 0.2)
    assert (out.shape, lse.shape, lse.dtype, efficient_calls) == ((2, 8, 37, 32), (2, 8, 37), torch.float32, [1])
    dq, dk, dv = kernels._cuda_backward(torch.empty_like(out), q, k, v, out, lse, False, None, 0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)  # dK/dV on the kv heads
    assert checked == [("forward", torch.bfloat16), ("backward", torch.bfloat16)]
    out, lse = kernels._cuda_forward(q, k, v, False, bias, 0.2)
    assert (out.shape, lse.shape, efficient_calls, len(checked)) == ((2, 8, 37, 32), (2, 8, 37), [1, 1], 2)
    dq, dk, dv = kernels._cuda_backward(torch.empty_like(out), q, k, v, out, lse, False, bias, 0.2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    monkeypatch.undo()
    on_cpu = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    assert not kernels._flash_takes(on_cpu, on_cpu, on_cpu, True, None)  # torch's rule: not on a CPU


def test_flash_blocks_are_checked_against_the_efficient_kernel_once_per_kind(monkeypatch):
    """Until the flash blocks have met a GPU, a process checks the first flash call of each kind against the efficient
    kernel on the same inputs, and refuses with the figures where they disagree."""
    from ultrascale.parallel import attention_kernels as kernels

    monkeypatch.setattr(kernels, "_flash_checked", set())
    torch.manual_seed(0)
    out, lse = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8)
    kind = ("forward", torch.bfloat16, 16, 2, True)
    slightly_off = (out * (1 + 1e-3), lse)
    assert kernels._checked_against_efficient(kind, ("out", "lse"), slightly_off, lambda: (out, lse)) is slightly_off
    assert kernels._flash_checked == {kind}
    wrong = (out * 1.3, lse)
    assert kernels._checked_against_efficient(kind, ("out", "lse"), wrong, lambda: 1 / 0) is wrong  # checked once
    other = ("backward", torch.bfloat16, 16, 2, True)
    with pytest.raises(RuntimeError, match=r"backward block .* out 3\.0e-01, lse 0\.0e\+00.*enable_flash_sdp\(False\)"):
        kernels._checked_against_efficient(other, ("out", "lse"), wrong, lambda: (out, lse))
    assert other not in kernels._flash_checked


def test_hf_model_without_an_attention_choice_gets_the_devices(tmp_path):
    from tests._parity import make_hf_checkpoint
    from ultrascale.models.hf import HF_DOCUMENT_ATTENTION, HFCausalLM

    path = make_hf_checkpoint(tmp_path, "llama", vocab_size=64)
    assert HFCausalLM(path).attention_implementation() == "sdpa"  # CPU
    assert HFCausalLM(path, attn_implementation="eager").attention_implementation() == "eager"
    module = HFCausalLM(path)
    module.configure_model()
    assert module.model.config._attn_implementation == HF_DOCUMENT_ATTENTION  # SDPA, packed documents one at a time
    eager = HFCausalLM(path, attn_implementation="eager")
    eager.configure_model()
    assert eager.model.config._attn_implementation == "eager"


@pytest.mark.slow
def test_loss_compare_layouts_of_world_8_give_one_curve():
    """`benchmarks/loss_compare.py` at world 8, 5 steps, on its two layouts no other world-8 test runs: dp x cp x tp
    and pp x dp4 under ZeRO-1 with Interleaved1F1B (HSDP x TP and pp x dp x tp at world 8 are parity tests in
    test_tensor_parallel.py and test_pipeline_parallel.py, ZeRO-3 at world 2 and 4 everywhere)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "loss_compare.py"
    spec = importlib.util.spec_from_file_location("loss_compare", path)
    loss_compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loss_compare)
    names = ["dp2 x cp2 x tp2 (ZeRO-3)", "pp2 x dp4 ZeRO-1 (Interleaved1F1B)"]
    reference, curves, _ = loss_compare.compare(8, 5, {name: loss_compare.LAYOUTS[name] for name in names})
    assert len(curves) == 2 and all(len(curve) == 5 for curve in curves.values())
    for name, curve in curves.items():
        assert max(abs(a - b) for a, b in zip(curve, reference)) < 1e-4, (name, curve, reference)
