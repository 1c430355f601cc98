"""ZeRO-1 and ZeRO-2 against a single-process run, and their memory and communication formulas."""

import math

import lightning as L
import pytest
import torch

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from ultrascale.estimate import state_bytes
from ultrascale.models.lm import LlamaLM
from ultrascale.parallel import zero as zero_module
from ultrascale.parallel.memory import model_state_bytes

SEQ, BATCH, STEPS = 32, 8, 10
SMALL_BUCKET_MB = 0.05  # ~13k fp32 elements: the tiny Llama (~140k params) gets 7 buckets


def make_model(**kwargs) -> LlamaLM:
    return LlamaLM(preset="tiny", learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6, **kwargs)


def dataset(accumulate: int = 1) -> TokenDataset:
    return TokenDataset(STEPS * accumulate * BATCH, SEQ, 512, seed=6, masked=True)


class CountZeroCollectives(L.Callback):
    """Counts the engine's reduce-scatters (and whether backward was still running) and all-gathers."""

    def __init__(self) -> None:
        self.calls = {"reduce_scatter": 0, "all_gather": 0, "in_backward": 0, "bytes": 0}

    def setup(self, trainer, pl_module, stage) -> None:
        rs, ag, calls = zero_module._reduce_scatter, zero_module._all_gather, self.calls

        def reduce_scatter(out, inp, *args, **kwargs):
            calls["reduce_scatter"] += 1
            calls["bytes"] += inp.numel() * inp.element_size()
            calls["in_backward"] += int(any(e._backward_queued for e in trainer.strategy._zero_engines))
            return rs(out, inp, *args, **kwargs)

        def all_gather(out, inp, *args, **kwargs):
            calls["all_gather"] += 1
            calls["bytes"] += out.numel() * out.element_size()
            return ag(out, inp, *args, **kwargs)

        zero_module._reduce_scatter, zero_module._all_gather = reduce_scatter, all_gather


def _train(rank, world_size, strategy, accumulate=1, clip=None, precision="32-true", steps=STEPS):
    recorder, counter = Recorder(), CountZeroCollectives()
    trainer = parity_trainer(world_size, strategy, recorder, steps, precision=precision, callbacks=[counter],
                             accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    model = make_model()
    trainer.fit(model, ParityData(dataset(accumulate), BATCH))
    engines = trainer.strategy._zero_engines
    return {**recorder.result(), **counter.calls, "buckets": sum(len(e.buckets) for e in engines),
            "psi": sum(p.numel() for p in model.parameters())}


CASES = {
    "zero1-w2": (2, lambda: ultrascale.ZeRO1Strategy(zero_bucket_mb=SMALL_BUCKET_MB), 1, None),
    "zero2-w2": (2, lambda: ultrascale.ZeRO2Strategy(zero_bucket_mb=SMALL_BUCKET_MB), 1, None),
    "zero2-w4": (4, lambda: ultrascale.ZeRO2Strategy(zero_bucket_mb=SMALL_BUCKET_MB), 1, None),
    "zero1-w2-accum4-clip": (2, lambda: ultrascale.ZeRO1Strategy(zero_bucket_mb=SMALL_BUCKET_MB), 4, 0.05),
    "zero2-w4-accum4-clip": (4, lambda: ultrascale.ZeRO2Strategy(zero_bucket_mb=SMALL_BUCKET_MB), 4, 0.05),
    "zero2-replicate2xshard2": (4, lambda: ultrascale.UltraScaleStrategy(
        data_parallel_replicate=2, data_parallel_shard=2, zero_stage=2, zero_bucket_mb=SMALL_BUCKET_MB), 1, None),
    # HSDP-like ZeRO over (replicate, shard) inside each tp group, with accumulation and clipping.
    "zero1-replicate2xshard2xtp2-accum2-clip": (8, lambda: ultrascale.UltraScaleStrategy(
        data_parallel_replicate=2, data_parallel_shard=2, tensor_parallel=2, zero_stage=1,
        zero_bucket_mb=SMALL_BUCKET_MB / 2), 2, 0.05),
    "zero2-replicate2xshard2xtp2-accum2-clip": (8, lambda: ultrascale.UltraScaleStrategy(
        data_parallel_replicate=2, data_parallel_shard=2, tensor_parallel=2, zero_stage=2,
        zero_bucket_mb=SMALL_BUCKET_MB / 2), 2, 0.05),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_process(case):
    world, make_strategy, accumulate, clip = CASES[case]
    reference = reference_run(make_model(), dataset(accumulate), global_batch=BATCH, steps=STEPS, accumulate=accumulate, clip=clip)
    results = run_ranks(_train, world, make_strategy(), accumulate, clip)
    assert_parity(results[0], reference, step_losses(results))
    result = results[0]
    assert result["buckets"] >= 6  # several buckets really exercised
    # One reduce-scatter and one all-gather per bucket per optimizer step, none on the
    # accumulation micro-batches.
    assert result["reduce_scatter"] == result["buckets"] * STEPS
    assert result["all_gather"] == result["buckets"] * STEPS
    # ZeRO-1 and ZeRO-2: all but the last bucket are launched while the step's last backward is still running.
    assert result["in_backward"] >= (result["buckets"] - 1) * STEPS


@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_communicated_per_step_match_ddp(stage):
    world = 4
    strategy = ultrascale.UltraScaleStrategy(zero_stage=stage, zero_bucket_mb=SMALL_BUCKET_MB)
    result = run_ranks(_train, world, strategy, 1, None, "32-true", 2)[0]
    psi_bytes = 4 * result["psi"]
    # Reduce-scatter + all-gather: each moves a Ψ-sized buffer, of which a rank sends (N-1)/N:
    # 2Ψ(N-1)/N per step, the same as DDP's ring all-reduce. Buckets are padded to multiples of N.
    sent_per_step = result["bytes"] / 2 * (world - 1) / world
    expected = 2 * psi_bytes * (world - 1) / world
    assert expected <= sent_per_step <= expected * 1.02


class MeasureModelState(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 1:
            self.measured = model_state_bytes(pl_module, [optimizer], trainer.strategy.zero_engines)


def _memory(rank, world_size, stage, tp=1):
    measure = MeasureModelState()
    strategy = ultrascale.UltraScaleStrategy(zero_stage=stage, zero_bucket_mb=0.5, tensor_parallel=tp)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy,
        precision="bf16-mixed", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[measure],
    )
    model = LlamaLM(preset="small", learning_rate=1e-3, warmup_steps=1, max_steps=100)
    trainer.fit(model, ParityData(TokenDataset(24, 64, 512, seed=3), 8))
    from ultrascale.callbacks import MemoryMonitor

    estimate = MemoryMonitor().estimate(trainer, model)  # the analytic figure the callback logs
    return {"bytes": measure.measured, "psi": sum(p.numel() for p in model.parameters()),
            "param_dtype": str(next(model.parameters()).dtype), "estimate": estimate.total}


@pytest.mark.parametrize("stage, tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_model_state_bytes_match_playbook(stage, tp):
    """The Playbook's formulas with fp32 gradients (bf16-mixed reduces in fp32, as ZeRO-3 does: 2Ψ more than the
    paper's bf16 gradients); with tensor parallel each term divided by tp (Megatron's distributed optimizer: ZeRO
    over the dp ranks of each tp group). The planner prices the same bytes."""
    world = 4
    dp = world // tp
    assert state_bytes("bf16-mixed", 1) == (2, 4, 12)
    for result in run_ranks(_memory, world, stage, tp):
        psi, measured = result["psi"] / tp, result["bytes"]
        assert result["param_dtype"] == "torch.bfloat16"  # bf16 weights for compute, fp32 masters in the optimizer
        expected = {1: 2 * psi + 4 * psi + 12 * psi / dp, 2: 2 * psi + (4 + 12) * psi / dp}[stage]
        assert abs(measured.total - expected) / expected < 0.02, (stage, measured, expected)
        assert abs(measured.params - 2 * psi) / (2 * psi) < 0.02
        grads = 4 * psi if stage == 1 else 4 * psi / dp
        assert abs(measured.grads - grads) / grads < 0.02
        assert abs(measured.optimizer - 12 * psi / dp) / (12 * psi / dp) < 0.02
        assert abs(result["estimate"] - measured.total) / measured.total < 0.02  # MemoryMonitor's estimate agrees


def test_non_elementwise_optimizer_is_refused():
    class Lamb(torch.optim.Optimizer):  # layer-wise trust ratio: not elementwise
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3})

    module = torch.nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=r"Lamb under ZeRO-2: .*not elementwise.*\(SGD, Adam, AdamW") as refused:
        zero_module.ZeroEngine(module, Lamb(module.parameters()), stage=2, dp_mesh=None)  # type: ignore[arg-type]
    assert refused.value.key == "optimizer_on_slices"


def _sgd_momentum(rank, world_size, stage):
    from torch.distributed.device_mesh import init_device_mesh

    from tests._dist import init_gloo
    from ultrascale.parallel.loss import scale_gradients

    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    engine = zero_module.ZeroEngine(model, optimizer, stage=stage, dp_mesh=mesh, bucket_bytes=512)
    tokens = torch.randint(0, 32, (3, world_size, 6), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        optimizer.zero_grad()
        model(tokens[step, rank : rank + 1]).pow(2).mean().backward()
        engine.reduce_gradients()  # the engine sums over ranks; the loop normalises (a raw loop's explicit step)
        scale_gradients(engine.grad_shards(), 1.0 / world_size)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_sgd_momentum_matches_single_process(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    tokens = torch.randint(0, 32, (3, 2, 6), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        optimizer.zero_grad()
        model(tokens[step]).pow(2).mean().backward()  # mean over both ranks' rows = the dp average
        optimizer.step()
    for result in run_ranks(_sgd_momentum, 2, stage):
        for name, param in model.named_parameters():
            torch.testing.assert_close(result[name], param.detach(), rtol=1e-5, atol=1e-6)


def _two_synced_backwards(rank, world_size, stage):
    from torch.distributed.device_mesh import init_device_mesh

    from tests._dist import init_gloo
    from ultrascale.parallel.loss import scale_gradients

    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard_cp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    engine = zero_module.ZeroEngine(model, optimizer, stage=stage, dp_mesh=mesh, bucket_bytes=512)
    tokens = torch.randint(0, 32, (3, 3, world_size, 6), generator=torch.Generator().manual_seed(1))
    grads_let_go = []
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(3):  # three backwards, all synchronised (manual optimization without no_sync)
            model(tokens[step, micro, rank : rank + 1]).pow(2).mean().backward()
            grads_let_go.append(all(p.grad is None for p in model.parameters()))
        engine.reduce_gradients()
        scale_gradients(engine.grad_shards(), 1.0 / (3 * world_size))
        optimizer.step()
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads_let_go": grads_let_go}


@pytest.mark.parametrize("stage", [1, 2])
def test_backwards_reduced_one_by_one_sum_once_over_replicas(stage):
    """Each synchronised backward is reduced as it ends; the later ones of the same step add only their own
    gradients, over (replicate 2, shard 2), where ZeRO-1's reduced slice left in its region would be summed twice."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    tokens = torch.randint(0, 32, (3, 3, 4, 6), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        optimizer.zero_grad()
        model(tokens[step].reshape(12, 6)).pow(2).mean().backward()  # the mean over three micro-batches of 4 ranks
        optimizer.step()
    for result in run_ranks(_two_synced_backwards, 4, stage):
        assert all(result["grads_let_go"])  # the reduced gradients are the engine's slices, not `.grad`
        for name, param in model.named_parameters():
            torch.testing.assert_close(result["weights"][name], param.detach(), rtol=1e-5, atol=1e-6)


def _fp32_accumulation(rank, world_size, accumulate_in_fp32):
    measure, recorder = MeasureModelState(), Recorder()
    strategy = ultrascale.ZeRO1Strategy(zero_bucket_mb=0.5, accumulate_grads_in_fp32=accumulate_in_fp32)
    trainer = parity_trainer(world_size, strategy, recorder, 3, precision="bf16-mixed", accumulate_grad_batches=2,
                             callbacks=[measure])
    model = make_model()
    trainer.fit(model, ParityData(TokenDataset(48, SEQ, 512, seed=9, masked=True), 8))
    return {"bytes": measure.measured, "psi": sum(p.numel() for p in model.parameters()), "losses": recorder.losses}


def test_bf16_weights_with_fp32_gradient_accumulation():
    """bf16-mixed accumulates and reduces ZeRO-1/2 gradients in fp32 unless told not to (the paper's bf16 ones)."""
    bf16 = run_ranks(_fp32_accumulation, 2, False)[0]
    fp32 = run_ranks(_fp32_accumulation, 2, True)[0]
    default = run_ranks(_fp32_accumulation, 2, None)[0]
    psi = bf16["psi"]
    assert abs(bf16["bytes"].grads - 2 * psi) / (2 * psi) < 0.02  # bf16 gradient buckets
    assert abs(fp32["bytes"].grads - 4 * psi) / (4 * psi) < 0.02  # fp32 gradient buckets
    assert default["bytes"].grads == fp32["bytes"].grads and default["losses"] == fp32["losses"]
    assert len(fp32["losses"]) == 3 and all(math.isfinite(x) for x in fp32["losses"])
    assert all(abs(a - b) < 2e-2 for a, b in zip(bf16["losses"], fp32["losses"]))


def _clip_by_value(rank, world_size, stage):
    recorder = Recorder()
    strategy = ultrascale.UltraScaleStrategy(zero_stage=stage, zero_bucket_mb=SMALL_BUCKET_MB)
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, gradient_clip_val=2e-3,
                             gradient_clip_algorithm="value")
    trainer.fit(make_model(), ParityData(dataset(), BATCH))
    return recorder.result()


@pytest.mark.parametrize("stage", [2, 3])
def test_clip_by_value_matches_single_process(stage):
    reference = reference_run(make_model(), dataset(), global_batch=BATCH, steps=STEPS, clip=2e-3, clip_algorithm="value")
    assert max(g.abs().max() for g in reference["grads"].values()) > 4e-3  # values really get clipped
    results = run_ranks(_clip_by_value, 2, stage)
    assert_parity(results[0], reference, step_losses(results))


class _CountHooks(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in pl_module.parameters())


def _fit_twice(rank, world_size):
    model = make_model()
    losses, hooks = [], []
    for _ in range(2):  # the same module fitted again: the old engine must detach
        recorder, count = Recorder(), _CountHooks()
        strategy = ultrascale.ZeRO2Strategy(zero_bucket_mb=SMALL_BUCKET_MB)
        trainer = parity_trainer(world_size, strategy, recorder, 3, callbacks=[count])
        trainer.fit(model, ParityData(dataset(), BATCH))
        losses.append(recorder.losses)
        hooks.append(count.hooks)
    after = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return {"losses": losses, "hooks": hooks, "after": after, "params": len(list(model.parameters()))}


def test_second_fit_replaces_the_engine():
    result = run_ranks(_fit_twice, 2)[0]
    assert result["hooks"] == [result["params"]] * 2  # one gradient hook per parameter during each fit, not two
    assert result["after"] == 0  # and none once the fit is over
    assert result["losses"][1][0] < result["losses"][0][0]  # the second fit continues from trained weights


def _odd_model() -> torch.nn.Module:
    """Odd sizes, so buckets, rank slices and checkpoint chunks all cut parameters in different places."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Embedding(11, 3), torch.nn.Linear(3, 13))


def _steps_of(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Per step, a gradient per parameter that bf16 holds exactly (multiples of 1/4), the same on every rank."""
    generator = torch.Generator().manual_seed(5)
    return [{n: torch.randint(-4, 5, p.shape, generator=generator) / 4 for n, p in model.named_parameters()}
            for _ in range(3)]


def _zero_step(model, optimizer, engine, grads) -> None:
    optimizer.zero_grad()
    sum((p * grads[n].to(p.dtype)).sum() for n, p in model.named_parameters()).backward()
    optimizer.step()


def _save_then_load_elsewhere(rank, world_size, stage, folder, saving_world):
    """Ranks < `saving_world` train 2 steps and save; then every rank loads into a fresh engine, steps once more."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests._dist import init_gloo
    from ultrascale.parallel.checkpoint import save_sharded_checkpoint
    from ultrascale.parallel.resume import load_training_state

    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    model = _odd_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    # 200 bytes: two buckets of several parameters, so one pair of ranks exchanges several runs per bucket
    engine = zero_module.ZeroEngine(model, optimizer, stage=stage, dp_mesh=mesh, bucket_bytes=200,
                                    compute_dtype=torch.bfloat16)
    steps = _steps_of(model)
    out = {}
    if world_size == saving_world:
        for grads in steps[:2]:
            _zero_step(model, optimizer, engine, grads)
        saved = engine.sharded_state_dict()
        out["saved"] = {f"{n}.{k}": v.full_tensor() for n, entry in saved["state"].items() for k, v in entry.items()}
        save_sharded_checkpoint({"state_dict": get_model_state_dict(model), "optimizer_0": saved}, {}, folder)
        return out
    engine.init_state()
    load_training_state(folder, model, [optimizer], zero_stage=stage, engines=[engine])
    _zero_step(model, optimizer, engine, steps[2])
    out["masters"] = engine.full_master_weights()
    return out


def _load_without_the_engine(rank, world_size, folder):
    from torch.distributed.device_mesh import init_device_mesh

    from tests._dist import init_gloo
    from ultrascale.parallel.resume import load_training_state

    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    model = _odd_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    zero_module.ZeroEngine(model, optimizer, stage=1, dp_mesh=mesh)
    try:
        load_training_state(folder, model, [optimizer], zero_stage=1)
    except ValueError as error:
        return str(error)
    return None


def test_a_zero12_optimizer_loaded_without_its_engine_is_refused_before_any_read(tmp_path):
    """A raw loop that forgets `engines=` is told so by name, before the checkpoint is opened (the folder does not
    even exist here), not with DCP's error about unknown parameters."""
    message = run_ranks(_load_without_the_engine, 1, tmp_path / "never-written")[0]
    assert message is not None and "not parameters of the model" in message and "engines=[engine]" in message


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_relayout_is_exact_across_world_sizes(tmp_path, stage):
    """Saved at dp3 (every parameter's chunk cut at rank-slice and bucket boundaries), loaded at dp2 and
    dp4: the checkpoint holds one process's AdamW state, and the step after the load is one process's third."""
    saved = run_ranks(_save_then_load_elsewhere, 3, stage, tmp_path / "ckpt", 3)[0]["saved"]
    reference = _one_process_adamw(ranks_per_step=(3, 3))
    assert set(saved) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(saved[key], value.reshape(-1), rtol=1e-6, atol=1e-7, msg=key)
    for world in (2, 4):
        masters = run_ranks(_save_then_load_elsewhere, world, stage, tmp_path / "ckpt", 3)[0]["masters"]
        reference = _one_process_adamw(ranks_per_step=(3, 3, world))
        for name in masters:
            torch.testing.assert_close(masters[name], reference[f"{name}.master"], rtol=1e-6, atol=1e-7, msg=name)


def _one_process_adamw(ranks_per_step: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """AdamW's weights and state after one step per entry, each on the sum of that many ranks' gradients."""
    model = _odd_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for grads, ranks in zip(_steps_of(model), ranks_per_step):
        for n, p in model.named_parameters():
            p.grad = grads[n] * ranks
        optimizer.step()
    return ({f"{n}.{k}": v for n, p in model.named_parameters() for k, v in optimizer.state[p].items() if v.dim()}
            | {f"{n}.master": p.detach() for n, p in model.named_parameters()})
