"""ActivationCheckpointing: same losses and gradients as without it, less activation memory, loadable checkpoints."""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

import ultrascale  # noqa: F401
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from ultrascale.callbacks import ActivationCheckpointing, EveryKAC, SelectiveAC
from ultrascale.callbacks.activation_checkpointing import CheckpointWrapper, apply_ac, make_policy
from ultrascale.data import CausalLMDataModule
from ultrascale.models.llama import Llama, LlamaConfig, TransformerBlock
from ultrascale.models.lm import LlamaLM

MODES = ["full", "every_k", "selective", "attention"]
PREFIX = "_checkpoint_wrapped_module."
SEQ, MICRO_BATCH, STEPS = 32, 8, 4


def masked_data(steps: int = STEPS) -> TokenDataset:
    return TokenDataset(steps * MICRO_BATCH, SEQ, 512, seed=1, masked=True)


def make_model() -> LlamaLM:
    return LlamaLM(preset="tiny", learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def strip(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.replace(PREFIX, ""): value for name, value in named.items()}


# --------------------------------------------------------------------------- errors


def test_bad_knobs_raise_with_the_valid_values():
    with pytest.raises(ValueError, match=r"unknown `mode='layer'`; valid modes: full, every_k, selective, attention"):
        ActivationCheckpointing(mode="layer")
    with pytest.raises(ValueError, match=r"`every_k=0` must be an integer >= 1"):
        ActivationCheckpointing(mode="every_k", every_k=0)
    with pytest.raises(ValueError, match=r"`k=-1` must be an integer >= 1"):
        EveryKAC(-1)
    model = Llama(LlamaConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=r"no attention submodule named mixer; set `attention_module=`"):
        apply_ac(model, model.layers, make_policy("attention", attention_module="mixer"))
    with pytest.raises(ValueError, match="no transformer blocks found"):
        ActivationCheckpointing().transform_model(torch.nn.Linear(2, 2), [])


# --------------------------------------------------------------------------- memory and exactness


class LiveActivations(TorchDispatchMode):
    """Bytes of tensor storages created during forward that are still alive when forward ends.

    Saved-tensor hooks cannot see inside a checkpointed region (torch's checkpoint installs
    its own hooks there, and selective AC keeps its saved outputs in a cache of its own), so
    we follow every storage the forward creates, with weak references, and sum the ones the
    autograd graph (or a checkpoint) still holds: the activation memory backward will need.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def _forward_backward(mode):
    torch.manual_seed(0)
    config = LlamaConfig.from_preset("tiny", n_layers=4, vocab_size=64)
    model = Llama(config)
    if mode is not None:
        apply_ac(model, model.layers, make_policy(mode))
    tokens = torch.randint(0, 64, (4, 128), generator=torch.Generator().manual_seed(1))
    counter = LiveActivations()
    with counter:
        loss = model(tokens).float().logsumexp(-1).mean()
    live = counter.live_bytes()
    loss.backward()
    grads = {n.replace(PREFIX, ""): p.grad.clone() for n, p in model.named_parameters()}
    return live, loss.detach(), grads


def test_activation_memory_order_and_exact_gradients():
    results = {mode: _forward_backward(mode) for mode in [None, *MODES]}
    live = {mode: r[0] for mode, r in results.items()}
    # none > every_k (2 of 4 blocks) > full; none > selective > full; none > attention.
    assert live[None] > live["selective"] > live["full"], live
    assert live[None] > live["every_k"] > live["full"], live
    assert live[None] > live["attention"] > live["full"], live
    # Selective keeps matmul outputs: it must save materially more than full and less than none.
    assert live["selective"] < 0.8 * live[None] and live["selective"] > 2 * live["full"], live
    for mode in MODES:  # recomputation reruns the same kernels: bitwise equal
        assert torch.equal(results[mode][1], results[None][1]), mode
        for name, grad in results[None][2].items():
            assert torch.equal(results[mode][2][name], grad), (mode, name)


def test_policies_select_the_expected_regions():
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=4))
    summary = apply_ac(model, list(model.layers), EveryKAC(2))
    assert [type(layer).__name__ for layer in model.layers] == ["TransformerBlock", "CheckpointWrapper"] * 2
    assert summary.regions == 2 and summary.attention_layers == 2
    model = Llama(LlamaConfig.from_preset("tiny", n_layers=2))
    summary = apply_ac(model, list(model.layers), make_policy("attention"))
    assert all(isinstance(layer.attention, CheckpointWrapper) for layer in model.layers)
    assert summary.matmul_params == sum(_attn_params(layer) for layer in model.layers)
    assert apply_ac(model, list(model.layers), make_policy("attention")).regions == 0  # idempotent
    summary = apply_ac(model := Llama(LlamaConfig.from_preset("tiny")), list(model.layers), SelectiveAC())
    assert summary.regions == 2 and summary.matmul_params == 0  # selective recomputes no matmul


def _attn_params(layer: TransformerBlock) -> int:
    attention = layer.attention._checkpoint_wrapped_module
    return sum(m.weight.numel() for m in (attention.wq, attention.wk, attention.wv, attention.wo))


def test_state_dict_keys_are_unchanged_and_load_without_ac():
    plain = Llama(LlamaConfig.from_preset("tiny"))
    wrapped = copy.deepcopy(plain)
    apply_ac(wrapped, list(wrapped.layers), make_policy("full"))
    assert any(PREFIX in name for name, _ in wrapped.named_parameters())
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    fresh = Llama(LlamaConfig.from_preset("tiny"))
    fresh.load_state_dict(wrapped.state_dict())  # strict: every key matches
    for name, value in plain.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)


# --------------------------------------------------------------------------- under strategies


def _count_block_forwards(model: LlamaLM) -> dict[str, int]:
    calls = {"n": 0}

    def hook(module, args):
        calls["n"] += 1

    for module in model.modules():
        if isinstance(module, TransformerBlock):
            module.register_forward_pre_hook(hook)
    return calls


class _CountForwards(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        self.calls = _count_block_forwards(pl_module)


def _train(rank, world_size, mode, strategy, steps):
    L.seed_everything(rank, verbose=False)
    recorder, counter = Recorder(), _CountForwards()
    callbacks = [counter] + ([ActivationCheckpointing(mode=mode)] if mode else [])
    trainer = parity_trainer(world_size, strategy, recorder, steps, callbacks=callbacks)
    model = make_model()
    dataset = masked_data(steps)
    if strategy == "auto":  # Lightning's single-device strategy: the batches in order
        trainer.fit(model, DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False))
    else:
        trainer.fit(model, ParityData(dataset, MICRO_BATCH))
    result = recorder.result()
    result["grads"], result["params"] = strip(result["grads"]), strip(result["params"])
    wrapped = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    return {**result, "block_forwards": counter.calls["n"], "wrapped": wrapped}


# mode -> (wrapped regions, block forwards per step: 2 blocks + those re-run in backward)
EXPECTED = {"full": (2, 4), "every_k": (1, 3), "selective": (2, 4), "attention": (2, 2)}


@pytest.mark.parametrize("mode", MODES)
def test_parity_under_zero3_world2(mode):
    reference = reference_run(make_model(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train, 2, mode, "ultrascale_zero3", STEPS)
    assert_parity(results[0], reference, step_losses(results))
    wrapped, forwards = EXPECTED[mode]
    assert results[0]["wrapped"] == wrapped
    assert results[0]["block_forwards"] == forwards * STEPS  # the recompute really happened


def test_lightning_single_device_applies_at_fit_start():
    reference = reference_run(make_model(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    result = _train(0, 1, "full", "auto", STEPS)
    assert result["wrapped"] == 2 and result["block_forwards"] == 4 * STEPS
    assert_parity(result, reference, result["losses"])


def _save_then_resume(rank, world_size, ckpt_dir, phase):
    L.seed_everything(rank, verbose=False)
    recorder = Recorder()
    callbacks = [recorder] + ([ActivationCheckpointing(mode="selective")] if phase != "resume_plain" else [])
    if phase == "save":
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ultrascale_zero3", max_steps=3 if phase == "save" else 6,
        logger=recorder.logger, log_every_n_steps=1, enable_checkpointing=phase == "save", enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    # The data module saves its sampler position, so the resumed run sees batches 4-6.
    data = CausalLMDataModule(seq_len=SEQ, global_batch_size=MICRO_BATCH, max_tokens=30_000, val_fraction=0.0, seed=7)
    model = LlamaLM(preset="tiny", vocab_size=258, learning_rate=3e-3, warmup_steps=2, max_steps=6)
    ckpt_path = f"{ckpt_dir}/epoch=0-step=3.ckpt" if phase.startswith("resume") else None
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return recorder.losses


@pytest.mark.parametrize("resume", ["resume_plain", "resume_ac"])
def test_sharded_checkpoint_saved_with_ac_resumes(tmp_path, resume):
    """A DCP checkpoint written with AC (wrapped module names) resumes with and without AC."""
    run_ranks(_save_then_resume, 2, str(tmp_path), "save")
    resumed = step_losses([{"losses": r} for r in run_ranks(_save_then_resume, 2, str(tmp_path), resume)])
    straight = step_losses([{"losses": r} for r in run_ranks(_save_then_resume, 2, str(tmp_path), "straight")])
    assert len(resumed) == 3 and len(straight) == 6
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[3:]), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- a memory budget


BUDGET_LAYERS = 4


def make_deep_model() -> LlamaLM:
    config = dataclasses.replace(LlamaConfig.from_preset("tiny"), n_layers=BUDGET_LAYERS)
    return LlamaLM(config=config, learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


class _SizedParityData(ParityData):
    """ParityData declaring its batch, as ultrascale's data modules do (the budget prices it)."""

    def __init__(self, dataset, global_batch: int) -> None:
        super().__init__(dataset, global_batch)
        self.seq_len, self.global_batch_size = SEQ, global_batch


def _budget_between_selective_and_none() -> float:
    """A budget in GiB halfway between the planner's peaks of ZeRO-3 over 2 ranks with every block selective and
    with none: what fits is a mix."""
    from ultrascale import planner
    from ultrascale.models.adapters import model_shape
    from ultrascale.strategies.auto_layout import device_cluster

    shape, cluster = model_shape(make_deep_model()), device_cluster(torch.device("cpu"), 2, 2)
    work = planner.Workload(SEQ, MICRO_BATCH, "32-true")
    peaks = [planner.evaluate(shape, planner.Layout(dp_shard=2, micro_batch=MICRO_BATCH // 2, recompute=mode), cluster,
                              work).memory["total"] for mode in ("selective", "none")]
    return sum(peaks) / 2 / planner.GIB


def _train_with_budget(rank, world_size, budget_gib, steps):
    L.seed_everything(rank, verbose=False)
    recorder, counter = Recorder(), _CountForwards()
    budget = ActivationCheckpointing(memory_budget_gib=budget_gib)
    trainer = parity_trainer(world_size, "ultrascale_zero3", recorder, steps, callbacks=[counter, budget])
    model = make_deep_model()
    trainer.fit(model, _SizedParityData(masked_data(steps), MICRO_BATCH))
    result = recorder.result()
    result["grads"], result["params"] = strip(result["grads"]), strip(result["params"])
    wrapped = [index for index, block in enumerate(model.model.layers) if isinstance(block, CheckpointWrapper)
               and isinstance(block._checkpoint_wrapped_module, TransformerBlock)]
    assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == len(wrapped)
    return {**result, "block_forwards": counter.calls["n"], "wrapped": wrapped, "modes": budget.block_modes,
            "predicted_gib": budget.predicted_peak_gib, "described": budget.describe_blocks()}


def test_a_memory_budget_mixes_modes_per_block_and_trains_exactly():
    budget = _budget_between_selective_and_none()
    reference = reference_run(make_deep_model(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train_with_budget, 2, budget, STEPS)
    assert_parity(results[0], reference, step_losses(results))
    modes = results[0]["modes"]
    assert results[1]["modes"] == modes and len(modes) == BUDGET_LAYERS
    assert "none" in modes and "full" not in modes and "selective" in modes, modes  # a mix, cheapest first
    assert list(modes) == sorted(modes, key=("full", "selective", "none").index)  # none on the last blocks
    recomputed = BUDGET_LAYERS - modes.count("none")
    assert results[0]["wrapped"] == list(range(recomputed))  # whole blocks, the first ones
    assert results[0]["block_forwards"] == (BUDGET_LAYERS + recomputed) * STEPS
    assert results[0]["predicted_gib"] <= budget
    assert results[0]["described"].startswith("blocks 0")


def test_a_memory_budget_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`memory_budget_gib=0` must be a positive number of GiB per rank"):
        ActivationCheckpointing(memory_budget_gib=0)
    with pytest.raises(ValueError, match=r"give `memory_budget_gib=8` or `mode`, not both"):
        ActivationCheckpointing(mode="full", memory_budget_gib=8)
    # Lightning's own strategies: no layout to price a rank's memory with
    with pytest.raises(ValueError, match=r"`memory_budget_gib=8`\) needs an ultrascale strategy"):
        model = Llama(LlamaConfig.from_preset("tiny"))
        ActivationCheckpointing(memory_budget_gib=8).transform_model(model, model.layers)


def test_a_budget_nothing_fits_names_what_a_rank_holds():
    from ultrascale import planner
    from ultrascale.models.adapters import model_shape
    from ultrascale.strategies.auto_layout import device_cluster

    shape, cluster = model_shape(make_deep_model()), device_cluster(torch.device("cpu"), 2, 2)
    work, layout = planner.Workload(SEQ, MICRO_BATCH, "32-true"), planner.Layout(dp_shard=2, micro_batch=4, recompute="budget")
    full = planner.evaluate(shape, planner.Layout(dp_shard=2, micro_batch=4, recompute="full"), cluster, work).memory
    held = (full["total"] - full["activations"]) / planner.GIB
    with pytest.raises(ValueError, match=rf"`memory_budget_gib=.*`\): a rank holds {held:.3g} GiB besides activations "
                                         r"\(params .* GiB\) under pp=1, dp_replicate=1, dp_shard=2, .*grad_accumulation=1: "):
        ActivationCheckpointing(memory_budget_gib=held / 2).choose_blocks(shape, layout, cluster, work)
    with pytest.raises(ValueError, match=rf"even every block run full peaks at {full['total'] / planner.GIB:.3g} GiB a rank"):
        ActivationCheckpointing(memory_budget_gib=(held + full["total"] / planner.GIB) / 2).choose_blocks(
            shape, layout, cluster, work)
    # a budget that every block full fits exactly: all full
    callback = ActivationCheckpointing(memory_budget_gib=full["total"] / planner.GIB)
    assert callback.choose_blocks(shape, layout, cluster, work) == ("full",) * BUDGET_LAYERS


def test_plan_recipe_prices_the_blocks_the_budget_will_choose():
    from pathlib import Path

    from ultrascale.planner.recipe_check import check_recipe

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu_2d.yaml")
    budget = ["--trainer.callbacks+=ultrascale.callbacks.ActivationCheckpointing", "--trainer.callbacks.memory_budget_gib"]
    plan = check_recipe(recipe, [*budget, "1"])
    assert plan.row.layout.recompute_blocks == (0, 0, 2)  # a 2-block model in 1 GiB: nothing recomputed
    assert "ActivationCheckpointing(memory_budget_gib=1.0): blocks 0-1 none" in plan.notes
    with pytest.raises(ValueError, match=r"`memory_budget_gib=1e-05`\): a rank holds .* GiB besides activations"):
        check_recipe(recipe, [*budget, "0.00001"])
