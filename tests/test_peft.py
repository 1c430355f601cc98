"""PEFT LoRA under ZeRO-2/3: the adapter saved from the sharded model reloads with peft and gives the trained
model's logits; the merged Hugging Face folder loads without peft and gives them too."""

import json
import sys
from pathlib import Path

import lightning as L
import peft  # the `test` extra installs it
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    assert_parity,
    full,
    make_hf_checkpoint,
    parity_trainer,
    reference_run,
    step_losses,
)
from ultrascale.models.lm import CausalLMModule
from ultrascale.models.peft import PeftAdapterExport, export_merged_hf, find_peft_model, save_peft_adapter

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 128, 16, 8, 4


class LoraLM(CausalLMModule):
    """A Hugging Face Llama from a local folder wrapped in LoRA on q_proj and v_proj, as a PEFT user writes it."""

    def __init__(self, path: str, targets: tuple[str, ...] = ("q_proj", "v_proj"), dropout: float = 0.0) -> None:
        super().__init__()
        self.path, self.targets, self.dropout = path, targets, dropout
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        base = transformers.AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True)
        torch.manual_seed(0)  # the same LoRA init on every rank and in the reference
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=self.dropout, target_modules=list(self.targets))
        self.model = peft.get_peft_model(base, config)

    def forward(self, input_ids, position_ids=None):
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def configure_optimizers(self):
        # eps 1e-6: Adam's first update of a near-zero gradient stays comparable across reduction orders.
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)


def dataset() -> TokenDataset:
    return TokenDataset(STEPS * GLOBAL_BATCH, SEQ, VOCAB, seed=1, masked=True)


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(3))


def lora_weights(module: LoraLM) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in find_peft_model(module).named_parameters() if "lora_" in n}


def _train(rank, world_size, path, strategy, adapter_dir, merged_dir, use_callback):
    strategies = {"zero3": ultrascale.ZeRO3Strategy, "zero2": ultrascale.ZeRO2Strategy}
    recorder = Recorder()
    callbacks = [PeftAdapterExport(adapter_dir, merged_dir)] if use_callback else []
    trainer = parity_trainer(world_size, strategies[strategy](), recorder, STEPS, callbacks=callbacks)
    module = LoraLM(path)
    trainer.fit(module, ParityData(dataset(), GLOBAL_BATCH))
    if not use_callback:  # the functions, called by every rank (they are collectives)
        assert save_peft_adapter(trainer, adapter_dir) == Path(adapter_dir).resolve()
        export_merged_hf(module, merged_dir)
    q = find_peft_model(module).base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    with torch.no_grad():
        logits = module(probe())
    return {"logits": full(logits), "lora": lora_weights(module), "losses": recorder.losses,
            "sharded": isinstance(q, torch.distributed.tensor.DTensor)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_hf_checkpoint(tmp_path_factory.mktemp("peft") / "base", "llama", vocab_size=VOCAB)


@pytest.mark.parametrize("strategy, use_callback", [("zero3", True), ("zero2", False)],
                         ids=["zero3-callback", "zero2-functions"])
def test_adapter_and_merged_export_reload(tmp_path, checkpoint, strategy, use_callback):
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    results = run_ranks(_train, 2, checkpoint, strategy, str(adapter_dir), str(merged_dir), use_callback)
    trained, logits = results[0]["lora"], results[0]["logits"]
    assert results[0]["sharded"] is (strategy == "zero3")  # ZeRO-3 really held LoRA weights as DTensor shards
    assert_close(results[1]["logits"], logits)

    # LoRA trains correctly under ZeRO: the adapter equals one process trained on the same global batches.
    reference = reference_run(LoraLM(checkpoint), dataset(), global_batch=GLOBAL_BATCH, steps=STEPS)
    assert_close(results[0]["losses"], reference["losses"], rtol=0, atol=1e-5)
    for name, value in trained.items():
        assert_close(value, reference["final_params"][f"model.{name}"], rtol=1e-5, atol=1e-5,
                     msg=lambda m: f"{name}: {m}")
    initial = lora_weights(_configured(checkpoint))
    assert all(not torch.allclose(trained[n], initial[n], atol=1e-4) for n in trained)  # every LoRA tensor moved

    # The folder PEFT's own save_pretrained writes for the same model, key for key.
    expected_dir = tmp_path / "peft_own"
    find_peft_model(_configured(checkpoint)).save_pretrained(expected_dir)
    assert sorted(p.name for p in adapter_dir.iterdir()) == sorted(p.name for p in expected_dir.iterdir())
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    expected = load_file(expected_dir / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in expected.items()}
    assert json.loads((adapter_dir / "adapter_config.json").read_text()) == json.loads(
        (expected_dir / "adapter_config.json").read_text())
    assert not list(tmp_path.glob(".*tmp-*"))  # no temporary folder left behind

    # Reload with peft on one process: the trained weights, and the trained model's logits.
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    reloaded = peft.PeftModel.from_pretrained(base, adapter_dir)
    for name, value in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(value, trained[name]), name
    with torch.no_grad():
        assert_close(reloaded(input_ids=probe()).logits, logits, rtol=1e-5, atol=1e-5)

    # The merged folder is a plain HF model: no peft, same logits, q_proj/v_proj changed and nothing else.
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        assert_close(merged(input_ids=probe()).logits, logits, rtol=1e-5, atol=1e-5)
    original = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).state_dict()
    changed = {name for name, value in merged.state_dict().items() if not torch.equal(value, original[name])}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"}


def _configured(path: str) -> LoraLM:
    module = LoraLM(path)
    module.configure_model()
    return module


def test_single_process_save_matches_peft(tmp_path, checkpoint):
    """Without a process group the functions write what PEFT writes, tensor for tensor."""
    module = _configured(checkpoint)
    with torch.no_grad():  # a non-zero B, so the merge changes the weights
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    save_peft_adapter(module, tmp_path / "ours")
    find_peft_model(module).save_pretrained(tmp_path / "peft_own")
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "peft_own" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    export_merged_hf(module.model, tmp_path / "merged")  # the PeftModel itself is accepted too
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    with torch.no_grad():
        assert_close(merged(input_ids=probe()).logits, module(probe()), rtol=1e-5, atol=1e-5)
    assert isinstance(module.model, peft.PeftModel)  # the trained model is left as it was (not merged)
    assert any("lora_A" in n for n, _ in module.model.named_parameters())


def test_errors(tmp_path, checkpoint, monkeypatch):
    plain = ultrascale.models.LlamaLM(preset="tiny")
    with pytest.raises(ValueError, match="LlamaLM holds no peft.PeftModel"):
        save_peft_adapter(plain, tmp_path / "a")
    module = _configured(checkpoint)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        save_peft_adapter(module, tmp_path / "full")
    with pytest.raises(FileExistsError, match="not empty"):
        PeftAdapterExport(tmp_path / "full").on_fit_start(None, module)  # refused before training
    assert (tmp_path / "full" / "keep.txt").is_file()
    save_peft_adapter(module, tmp_path / "full", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["README.md", "adapter_config.json",
                                                                       "adapter_model.safetensors"]
    with pytest.raises(ValueError, match="model's source folder"):
        export_merged_hf(module, checkpoint, overwrite=True)
    with pytest.raises(ValueError, match=r"unknown adapter\(s\) \['other'\]"):
        save_peft_adapter(module, tmp_path / "b", adapters=["other"])
    with pytest.raises(ValueError, match="same folder"):
        PeftAdapterExport(tmp_path / "x", merged_dir=tmp_path / "x")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "ultrascale\[peft\]"'):
        save_peft_adapter(module, tmp_path / "c")


# --------------------------------------------------------------------------- tensor parallel

TP_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")  # column-parallel and row-parallel base layers


def _train_tp(rank, world_size, path, adapter_dir):
    recorder = Recorder()
    strategy = ultrascale.UltraScaleStrategy(tensor_parallel=2)
    trainer = parity_trainer(world_size, strategy, recorder, STEPS)
    module = LoraLM(path, targets=TP_TARGETS)
    trainer.fit(module, ParityData(dataset(), GLOBAL_BATCH))
    save_peft_adapter(trainer, adapter_dir)
    attention = find_peft_model(module).base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        logits = module(probe())
    local = {name: tuple(getattr(attention, proj).lora_A["default"].weight.to_local().shape)
             if isinstance(getattr(attention, proj).lora_A["default"].weight, torch.distributed.tensor.DTensor)
             else tuple(getattr(attention, proj).lora_A["default"].weight.shape) for name, proj in (("q", "q_proj"), ("o", "o_proj"))}
    base = tuple(attention.q_proj.base_layer.weight.to_local().shape)
    return {"logits": full(logits), "lora": lora_weights(module), "losses": recorder.losses, "lora_A": local, "q_base": base}


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "tp2xdp2"])
def test_lora_under_tensor_parallel(tmp_path, checkpoint, world):
    """LoRA on column-parallel (q, v) and row-parallel (o, down) layers of a tp=2 model (x dp_shard=2) equals one
    process; the saved adapter reloads with peft and gives the trained logits."""
    adapter_dir = tmp_path / "adapter"
    results = run_ranks(_train_tp, world, checkpoint, str(adapter_dir))
    reference = reference_run(LoraLM(checkpoint, targets=TP_TARGETS), dataset(), global_batch=GLOBAL_BATCH, steps=STEPS)
    assert_close(results[0]["losses"], reference["losses"], rtol=0, atol=1e-5)
    trained = results[0]["lora"]
    assert len(trained) == 2 * 2 * len(TP_TARGETS)  # A and B of 4 targets in 2 layers
    for name, value in trained.items():
        assert_close(value, reference["final_params"][f"model.{name}"], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # The base q_proj is column-split (64 -> 32 rows per rank; FSDP halves it again at dp2); q's A (r=4, 64) stays
    # whole (or FSDP-sharded by rows), o's A (4, 64) is split on its input (4, 32).
    assert results[0]["q_base"][0] == 64 // world
    assert results[0]["lora_A"]["o"][1] == 32
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    reloaded = peft.PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        assert_close(reloaded(input_ids=probe()).logits, results[0]["logits"], rtol=1e-5, atol=1e-5)


class _DesyncRandomState(L.Callback):
    """Every rank's default generator in another state when training starts (a user who never seeded)."""

    def on_train_start(self, trainer, pl_module):
        torch.manual_seed(100 + trainer.global_rank)


def _train_tp_dropout(rank, world_size, path):
    from ultrascale.parallel.tensor import TensorParallelDropout

    drawn: dict[int, list[torch.Tensor]] = {}
    draw = TensorParallelDropout.full_mask

    def recording(self, shape, dtype, device):
        mask = draw(self, shape, dtype, device)
        drawn.setdefault(id(self), []).append(mask.clone())
        return mask

    TensorParallelDropout.full_mask = recording
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(tensor_parallel=2), recorder, STEPS,
                             callbacks=[_DesyncRandomState()])
    module = LoraLM(path, targets=TP_TARGETS, dropout=0.25)
    trainer.fit(module, ParityData(dataset(), GLOBAL_BATCH))
    names = {id(m): n for n, m in find_peft_model(module).named_modules()}
    replaced = sorted(n for n, m in find_peft_model(module).named_modules() if isinstance(m, TensorParallelDropout))
    return {**recorder.result(), "masks": {names[key]: masks for key, masks in drawn.items()}, "replaced": replaced}


class _ReplayDropout(torch.nn.Module):
    """The reference's LoRA dropout: the masks the tp run drew, in the order it drew them."""

    def __init__(self, masks):
        super().__init__()
        self.masks = list(masks)

    def forward(self, x):
        return x * self.masks.pop(0)


class _ReplayLoraLM(LoraLM):
    def __init__(self, path, masks):
        super().__init__(path, targets=TP_TARGETS, dropout=0.25)
        self.masks = masks

    def configure_model(self):
        super().configure_model()
        peft_model = find_peft_model(self)
        for name, masks in self.masks.items():
            owner, _, adapter = name.rpartition(".")
            peft_model.get_submodule(owner)[adapter] = _ReplayDropout(masks)


def test_lora_dropout_under_tensor_parallel_draws_one_mask(checkpoint):
    """lora_dropout=0.25 on column-parallel (q, v: whole input) and row-parallel (o, down: split input) layers at
    tp=2, the ranks' generators put out of step first: both ranks draw the same masks (synchronised each step),
    and training equals one process applying those masks (loss, every gradient, weights)."""
    results = run_ranks(_train_tp_dropout, 2, checkpoint)
    masks = results[0]["masks"]
    assert len(results[0]["replaced"]) == 2 * len(TP_TARGETS) and sorted(masks) == results[0]["replaced"]
    assert all(len(drawn) == STEPS for drawn in masks.values())
    for name, drawn in masks.items():
        for mine, other in zip(drawn, results[1]["masks"][name]):
            assert torch.equal(mine, other), name  # one mask on every tp rank
    every = torch.cat([m.flatten() for drawn in masks.values() for m in drawn])
    assert 0.2 < (every == 0).float().mean() < 0.3  # p = 0.25 really drops
    reference = reference_run(_ReplayLoraLM(checkpoint, masks), dataset(), global_batch=GLOBAL_BATCH, steps=STEPS)
    assert_parity(results[0], reference, step_losses(results))


# --------------------------------------------------------------------------- HFCausalLM(lora=...)

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
HP = dict(learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)  # as tests._parity.make_hf


def _train_hf_lora(rank, world_size, path, strategy_kwargs, adapter_dir, merged_dir):
    import lightning as L

    from ultrascale.models.hf import HFCausalLM

    class Snapshot(L.Callback):  # the adapters as training starts, gathered
        def on_train_start(self, trainer, pl_module):
            self.initial = lora_weights(pl_module)

    recorder, snapshot = Recorder(), Snapshot()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS,
                             callbacks=[snapshot])
    module = HFCausalLM(path, lora=LORA, lora_dir=adapter_dir, export_dir=merged_dir, **HP)
    trainer.fit(module, ParityData(dataset(), GLOBAL_BATCH))
    base = find_peft_model(module).base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    with torch.no_grad():
        logits = module(probe())
    return {"losses": recorder.losses, "lora": lora_weights(module), "initial": snapshot.initial, "logits": full(logits),
            "base_is_meta_built": base.device.type != "meta" and isinstance(base, torch.distributed.tensor.DTensor),
            "base_requires_grad": base.requires_grad}


@pytest.mark.parametrize("world, kwargs", [(2, {}), (2, {"tensor_parallel": 2})], ids=["zero3", "tp2"])
def test_hfcausallm_lora_loads_after_sharding_and_exports(tmp_path, checkpoint, world, kwargs):
    """`HFCausalLM(lora=...)`: the base model is built on the meta device and each rank loads its shards (no rank
    reads the whole model), the adapters start the same under any layout (zero B: the base model's output), train
    like one process, and the adapter and merged folders reload with the trained logits."""
    from ultrascale.models.hf import HFCausalLM

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    results = run_ranks(_train_hf_lora, world, checkpoint, kwargs, str(adapter_dir), str(merged_dir))
    result = results[0]
    assert result["base_is_meta_built"] and result["base_requires_grad"] is False
    alone = HFCausalLM(checkpoint, lora=LORA, **HP)
    alone.configure_model()  # one process, from_pretrained: the same initial adapters
    initial = lora_weights(alone)
    assert set(initial) == set(result["initial"]) and len(initial) == 2 * 2 * 4
    for name, value in initial.items():
        assert torch.equal(result["initial"][name], value), name
        assert (value == 0).all() if "lora_B" in name else value.abs().max() > 0
    reference = reference_run(alone, dataset(), global_batch=GLOBAL_BATCH, steps=STEPS)
    assert_close(result["losses"], reference["losses"], rtol=0, atol=1e-5)
    for name, value in result["lora"].items():
        assert_close(value, reference["final_params"][f"model.{name}"], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    reloaded = peft.PeftModel.from_pretrained(base, adapter_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    with torch.no_grad():
        assert_close(reloaded(input_ids=probe()).logits, result["logits"], rtol=1e-5, atol=1e-5)
        assert_close(merged(input_ids=probe()).logits, result["logits"], rtol=1e-5, atol=1e-5)


def test_hfcausallm_lora_errors(tmp_path, checkpoint):
    from ultrascale.models.hf import HFCausalLM

    with pytest.raises(NotImplementedError, match="init_lora_weights='pissa'.*not supported"):
        HFCausalLM(checkpoint, lora={**LORA, "init_lora_weights": "pissa"})
    with pytest.raises(TypeError, match="not_a_field"):
        HFCausalLM(checkpoint, lora={**LORA, "not_a_field": 1})
    with pytest.raises(ValueError, match="set `lora` too"):
        HFCausalLM(checkpoint, lora_dir=str(tmp_path / "adapter"))


# ----------------------------------------------------------------------------- pipeline parallel


def _train_lora_pp(rank, world_size, path, strategy_kwargs, adapter_dir, merged_dir, own_module):
    """LoRA under pipeline parallel: `HFCausalLM(lora=...)` (the adapter and the merged model written when fit
    ends), or a user's PeftModel (`LoraLM`) saved by the functions, which every rank calls."""
    from ultrascale.models.hf import HFCausalLM

    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    if own_module:
        module = LoraLM(path, targets=tuple(LORA["target_modules"]))
    else:
        module = HFCausalLM(path, lora=LORA, lora_dir=adapter_dir, export_dir=merged_dir, **HP)
    trainer.fit(module, ParityData(dataset(), GLOBAL_BATCH))
    if own_module:
        save_peft_adapter(trainer, adapter_dir)
        export_merged_hf(module, merged_dir)
    held = {n for n, _ in find_peft_model(module).named_parameters() if "lora_" in n}
    return {"losses": recorder.losses, "held": held}


@pytest.mark.parametrize("schedule, own_module", [("1F1B", False), ("ZBVZeroBubble", False), ("1F1B", True)],
                         ids=["hf-lora-1f1b", "hf-lora-zbv", "own-peft-1f1b"])
def test_lora_under_pipeline_parallel(tmp_path, schedule, own_module):
    """pp=2: each rank trains the adapters of its stages only; the adapter folder rank 0 writes holds every stage's,
    equal to one process trained on the same batches, reloads with peft, and the merged folder gives its logits."""
    from ultrascale.models.hf import HFCausalLM

    path = make_hf_checkpoint(tmp_path / "base", "llama", vocab_size=VOCAB, layers=4)  # ZBV: 4 stages of one layer
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    kwargs = {"pipeline_parallel": 2, "pipeline_schedule": schedule, "pipeline_microbatches": 4}
    results = run_ranks(_train_lora_pp, 2, path, kwargs, str(adapter_dir), str(merged_dir), own_module)
    assert results[0]["held"] and results[1]["held"] and not results[0]["held"] & results[1]["held"]  # split stages

    alone = LoraLM(path, targets=tuple(LORA["target_modules"])) if own_module else HFCausalLM(path, lora=LORA, **HP)
    reference = reference_run(alone, dataset(), global_batch=GLOBAL_BATCH, steps=STEPS)
    assert_close(results[0]["losses"], reference["losses"], rtol=0, atol=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    reloaded = peft.PeftModel.from_pretrained(base, adapter_dir)
    trained = {name: value for name, value in reloaded.named_parameters() if "lora_" in name}
    assert len(trained) == 4 * len(LORA["target_modules"]) * 2  # every layer's A and B, from both stages
    for name, value in trained.items():
        assert_close(value, reference["final_params"][f"model.{name}"], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    with torch.no_grad():
        assert_close(merged(input_ids=probe()).logits, reloaded(input_ids=probe()).logits, rtol=1e-5, atol=1e-5)
