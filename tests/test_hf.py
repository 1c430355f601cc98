"""Hugging Face checkpoints: load under ZeRO-3 and TP (each rank reads its slices), fine-tune, export, reload."""

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, step_losses
from ultrascale.models.hf import HFCausalLM

VOCAB, SEQ = 128, 16
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "mixtral": lambda **kw: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                          shared_expert_intermediate_size=32, **kw),
    "olmoe": lambda **kw: transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **kw),
}


def make_checkpoint(folder: Path, arch: str = "llama", tied: bool = False, dtype=torch.float32) -> Path:
    config = CONFIGS[arch](vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # non-trivial weights everywhere (HF inits norms to 1 and biases to 0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder, max_shard_size="100KB")  # several safetensors shards
    return folder


def tokens(n: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))


def _logits(rank, world_size, path, strategy_kwargs):
    module = HFCausalLM(path)
    built_on: list[str] = []  # the device `configure_model` built the model on (the strategy's init context)
    configure = module.configure_model
    module.configure_model = lambda: (built_on.append(torch.empty(()).device.type), configure())[1]
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**strategy_kwargs),
                        logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=0)
    trainer.validate(module, torch.utils.data.DataLoader(TokenDataset(4, SEQ, VOCAB), batch_size=2), verbose=False)
    with torch.no_grad():
        logits = module(tokens())
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    q = module.model.model.layers[0].self_attn.q_proj.weight
    q_local = tuple(q.to_local().shape) if hasattr(q, "to_local") else tuple(q.shape)
    tie_kept = module.model.get_output_embeddings().weight is module.model.get_input_embeddings().weight
    return {"logits": logits, "q_local": q_local, "meta_built": built_on == ["meta"], "tie_kept": tie_kept}


@pytest.mark.parametrize(
    "arch, tied, layout",
    [("llama", False, "zero3"), ("llama", False, "tp2"), ("qwen2", False, "zero3"), ("qwen2", False, "tp2"),
     ("mistral", False, "tp2"), ("llama", True, "zero3"), ("llama", True, "zero2"), ("qwen2", True, "tp2"),
     ("mixtral", False, "zero3"), ("mixtral", False, "zero2"), ("qwen2_moe", False, "zero3"), ("qwen2_moe", False, "ep2")],
    ids=["llama-zero3", "llama-tp2", "qwen2-zero3", "qwen2-tp2", "mistral-tp2", "llama-tied-zero3", "llama-tied-zero2",
         "qwen2-tied-tp2", "mixtral-zero3", "mixtral-zero2", "qwen2_moe-zero3", "qwen2_moe-ep2"],
)
def test_loaded_logits_equal_from_pretrained(tmp_path, arch, tied, layout):
    path = make_checkpoint(tmp_path / "ckpt", arch, tied)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        expected = reference(input_ids=tokens()).logits
    kwargs = {"tp2": {"tensor_parallel": 2, "data_parallel_shard": 1}, "zero3": {}, "zero2": {"zero_stage": 2},
              "ep2": {"expert_parallel": 2}}[layout]
    results = run_ranks(_logits, 2, str(path), kwargs)
    for result in results:
        assert result["meta_built"]  # tied too: materialising after sharding shares the tie again
        assert result["tie_kept"] is tied
        assert result["q_local"] == ((64, 64) if layout == "zero2" else (32, 64))  # 64x64 split in 2, or whole under ZeRO-2
        assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)


def make_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "</s>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def _finetune(rank, world_size, path, ckpt_dir, export_dir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = HFCausalLM(path, learning_rate=3e-3, warmup_steps=1, max_steps=100, export_dir=export_dir)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ultrascale_zero3", max_steps=10, logger=recorder.logger,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder, ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=10)],
    )
    trainer.fit(module, ParityData(TokenDataset(80, SEQ, VOCAB, seed=8), 8))
    plain = [n for n, p in module.named_parameters() if not hasattr(p, "full_tensor")]
    assert not plain, plain  # every weight is still sharded after fit
    weights = {n[len("model."):]: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
    batch = {"input_ids": tokens(4), "labels": tokens(4).roll(-1, dims=1)}
    with torch.no_grad():
        loss = float(module.batch_loss(batch)["loss"])
    return {"losses": recorder.losses, "loss_after": loss, "weights": weights}


def test_finetune_export_reload(tmp_path):
    source = make_checkpoint(tmp_path / "source")
    make_tokenizer(source)
    results = run_ranks(_finetune, 2, str(source), str(tmp_path / "ckpts"), str(tmp_path / "exported_at_fit_end"))
    assert len(step_losses(results)) == 10  # one exact train_loss per step, the same on both ranks
    trained = results[0]["weights"]
    original = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True).state_dict()
    assert all(not torch.equal(original[name], value) for name, value in trained.items())  # every weight trained
    # Offline export from the sharded training checkpoint, through the CLI.
    from ultrascale.cli import main

    main(["export-hf", "--checkpoint", str(tmp_path / "ckpts" / "last.ckpt"), "--out", str(tmp_path / "exported_cli")])
    batch = {"input_ids": tokens(4), "labels": tokens(4).roll(-1, dims=1)}
    for folder in ("exported_at_fit_end", "exported_cli"):
        out = tmp_path / folder
        assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        for name, value in reloaded.state_dict().items():
            assert torch.equal(value, trained[name]), (folder, name)  # bit-exact
        with torch.no_grad():
            logits = reloaded(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        assert_close(float(loss), results[0]["loss_after"], rtol=1e-6, atol=1e-6)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
        assert tokenizer("t1 t2")["input_ids"] == [1, 2]
        assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_bad_checkpoint_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        HFCausalLM(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFCausalLM(str(tmp_path / "empty"))
    source = make_checkpoint(tmp_path / "noweights")
    for file in source.glob("*.safetensors"):
        file.unlink()
    (source / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights \(.bin weights are not supported"):
        HFCausalLM(str(source))
    with pytest.raises(ValueError, match="dtype='float16'"):
        HFCausalLM(str(make_checkpoint(tmp_path / "ok")), dtype="float16")


def _vocab_error(rank, world_size, path):
    module = HFCausalLM(path)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                        strategy=ultrascale.UltraScaleStrategy(tensor_parallel=4, data_parallel_shard=1), max_steps=1)
    try:
        trainer.fit(module, ParityData(TokenDataset(8, SEQ, 100), 8))
    except ValueError as error:
        return str(error)
    return "no error"


def test_tp_not_dividing_vocab(tmp_path):
    config_dir = tmp_path / "odd_vocab"
    config = transformers.LlamaConfig(vocab_size=102, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(config_dir)
    for message in run_ranks(_vocab_error, 4, str(config_dir)):
        assert "`tensor_parallel=4` must divide vocab_size=102 of HFCausalLM (LlamaConfig)" in message  # checked on the declared config


def _checkpoint_and_instructions(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny HF checkpoint with a tokenizer, and 200 prompt/response rows of its words as JSONL."""
    source = make_checkpoint(tmp_path / "source")
    make_tokenizer(source)
    data = tmp_path / "train.jsonl"
    words = [f"t{i}" for i in range(VOCAB - 2)]
    with data.open("w") as f:
        for i in range(200):
            f.write(json.dumps({"prompt": " ".join(words[i % 50: i % 50 + 5]), "response": " ".join(words[i % 40: i % 40 + 8])}) + "\n")
    return source, data


# The recipes' commands run in the test's process (`ultrascale.cli.main`) with their ranks forked: the same strategy
# as the recipe's registered name (`ultrascale_zero3`), without the command and each rank importing everything again.
FORKED_ZERO3 = ["--trainer.strategy", "ultrascale.ZeRO3Strategy", "--trainer.strategy.init_args.launcher", "fork"]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_finetune_recipe_end_to_end(tmp_path, capfd, monkeypatch):
    """The fine-tuning commands of README and docs/huggingface.md: `ultrascale fit --config recipes/hf_finetune.yaml ...`
    then `export-hf` of the run directory."""
    from tests._cli import run_main

    source, data = _checkpoint_and_instructions(tmp_path)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "hf_finetune.yaml"
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(
        capfd, "fit", "--config", str(recipe), "--model.pretrained_path", str(source), "--data.data_path", str(data),
        "--data.init_args.prompt_template", "{prompt}", "--data.init_args.seq_len", "32",
        # An epoch of this small file is fewer batches than the validation interval (which failed in
        # Lightning's epoch-based counting): the recipe counts it in steps across epochs.
        "--trainer.max_steps", "24", "--trainer.val_check_interval", "20", "--trainer.callbacks.init_args.every_n_train_steps", "12",
        *FORKED_ZERO3)
    assert code == 0, (out + err)[-3000:]
    events = b"".join(f.read_bytes() for f in (tmp_path / "runs" / "hf_finetune" / "version_0").glob("events.out.tfevents*"))
    assert b"val_loss" in events and b"throughput/tokens_per_sec" in events  # validated at step 20; tokens/s logged
    # The run directory is enough: export-hf finds its newest complete checkpoint.
    code, out, err = run_main(capfd, "export-hf", "--checkpoint", "runs/hf_finetune", "--out", str(tmp_path / "out"))
    assert code == 0, (out + err)[-3000:]
    assert "last.ckpt" in out
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    original = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    assert not torch.equal(reloaded.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)("t3")["input_ids"] == [3]


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_lora_recipe_end_to_end(tmp_path, capfd, monkeypatch):
    """`ultrascale fit --config recipes/hf_lora.yaml ...`: LoRA adapters trained over a frozen base loaded shard by
    shard; the adapter folder reloads with peft and the merged folder without it, giving the same logits."""
    import peft

    from tests._cli import run_main

    source, data = _checkpoint_and_instructions(tmp_path)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "hf_lora.yaml"
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(
        capfd, "fit", "--config", str(recipe), "--model.pretrained_path", str(source), "--data.data_path", str(data),
        "--data.init_args.prompt_template", "{prompt}", "--data.init_args.seq_len", "32", "--trainer.max_steps", "6",
        "--trainer.val_check_interval", "6", "--trainer.callbacks.init_args.every_n_train_steps", "6", *FORKED_ZERO3)
    assert code == 0, (out + err)[-3000:]
    adapter, merged = tmp_path / "runs" / "hf_lora" / "adapter", tmp_path / "runs" / "hf_lora" / "merged"
    probe = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    with torch.no_grad():
        before = base(input_ids=probe).logits
        with_adapter = peft.PeftModel.from_pretrained(base, adapter)(input_ids=probe).logits
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)(input_ids=probe).logits
    assert not torch.allclose(with_adapter, before, atol=1e-4)  # the adapters trained
    torch.testing.assert_close(merged_logits, with_adapter, rtol=1e-5, atol=1e-5)


def _load_error(rank, world_size, path):
    try:
        _logits(rank, world_size, path, {})
    except NotImplementedError as error:
        return str(error)
    return "no error"


def test_unknown_converted_layout_is_refused_under_sharding(tmp_path, monkeypatch):
    """The sharded loader reads the conversions transformers applies while loading (per-expert weights stacked and
    concatenated); a conversion with any other operation is refused, naming the architecture, the converted tensor
    and the operation, instead of loading something else."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import ConversionOps, MergeModulelist, WeightConverter

    class Unknown(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            raise AssertionError("never run")

    path = make_checkpoint(tmp_path / "olmoe", "olmoe")  # before the patch: saving reverts the real conversion
    original = conversion_mapping.get_checkpoint_conversion_mapping
    unknown = WeightConverter(["mlp.experts.*.down_proj.weight"], ["mlp.experts.down_proj"],
                              operations=[MergeModulelist(dim=0), Unknown()])
    monkeypatch.setattr(conversion_mapping, "get_checkpoint_conversion_mapping",  # the ranks fork: they see it too
                        lambda model_type: [unknown] if model_type == "olmoe" else original(model_type))
    for message in run_ranks(_load_error, 2, str(path)):
        assert "model_type 'olmoe'" in message and "'mlp.experts.down_proj'" in message, message
        assert "operation Unknown is not supported" in message, message


def test_mixtral_export_roundtrip(tmp_path):
    """Fused in memory, per-expert on disk: export writes the checkpoint layout transformers reads back."""
    from ultrascale.models.hf import write_hf_folder

    path = make_checkpoint(tmp_path / "mixtral", "mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    write_hf_folder(model.state_dict(), model.config, str(path), tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    for name, value in again.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def _finetune_zero12_bf16(rank, world_size, path, ckpt_dir, export_dir, strategy_kwargs):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = HFCausalLM(path, learning_rate=3e-3, warmup_steps=1, max_steps=100, export_dir=export_dir)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**strategy_kwargs), max_steps=3,
        precision="bf16-mixed", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=3)],
    )
    trainer.fit(module, ParityData(TokenDataset(24, SEQ, VOCAB, seed=8), 8))
    (engine,) = trainer.strategy.zero_engines
    assert engine.has_master_copies
    masters = {n[len("model."):]: w for n, w in engine.full_master_weights().items()}
    return {"masters": masters, "compute_dtypes": {str(p.dtype) for p in module.parameters()}}


@pytest.mark.parametrize("strategy_kwargs", [dict(zero_stage=2, data_parallel_shard=2),
                                             dict(zero_stage=1, tensor_parallel=2),
                                             dict(zero_stage=1, pipeline_parallel=2, pipeline_microbatches=2)],
                         ids=["zero2", "zero1_tp2", "zero1_pp2"])
def test_zero12_bf16_exports_the_fp32_masters(tmp_path, strategy_kwargs):
    """Under ZeRO-1/2 with bf16-mixed the module holds bf16 compute copies; both exports (at fit end and offline from
    the checkpoint) write the fp32 weights the optimizer steps, as ZeRO-3 does (they once wrote the bf16 copies)."""
    from ultrascale.cli import main

    source = make_checkpoint(tmp_path / "source")
    results = run_ranks(_finetune_zero12_bf16, 2, str(source), str(tmp_path / "ckpts"), str(tmp_path / "at_fit_end"),
                        strategy_kwargs)
    masters = {name: value for result in results for name, value in result["masters"].items()}  # pp: each its stage's
    assert results[0]["compute_dtypes"] == {"torch.bfloat16"}
    assert all(value.dtype == torch.float32 for value in masters.values())
    assert any(not torch.equal(value, value.bfloat16().float()) for value in masters.values())  # bf16 would lose bits
    main(["export-hf", "--checkpoint", str(tmp_path / "ckpts" / "last.ckpt"), "--out", str(tmp_path / "offline")])
    for folder in ("at_fit_end", "offline"):
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder, local_files_only=True,
                                                                     torch_dtype=None).state_dict()
        assert set(reloaded) == set(masters), folder
        for name, value in masters.items():
            assert reloaded[name].dtype == torch.float32 and torch.equal(reloaded[name], value), (folder, name)


# ----------------------------------------------------------------------------- exports never destroy anything


def _short_finetune(rank, world_size, path, ckpt_dir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ultrascale_zero3", max_steps=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=2)],
    )
    trainer.fit(HFCausalLM(path, learning_rate=1e-2, max_steps=2), ParityData(TokenDataset(16, SEQ, VOCAB, seed=8), 8))


def test_offline_export_of_a_multimodal_checkpoints_text_model_writes_the_whole_model(tmp_path, capsys):
    """`export-hf` of a run that trained Gemma 3's text model (from its multimodal checkpoint): the whole model again,
    the trained language model in it, the vision tower the source's; refused by name once the source folder is gone
    (the vision weights are only there), where it would otherwise write the text model alone."""
    import shutil

    from tests._parity import save_perturbed_multimodal
    from ultrascale.cli import main

    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, pad_token_id=None, bos_token_id=1, eos_token_id=2),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, image_size=28, patch_size=14), mm_tokens_per_image=4)
    source = save_perturbed_multimodal(config, tmp_path / "gemma3")
    run_ranks(_short_finetune, 2, source, str(tmp_path / "ckpts"))
    main(["export-hf", "--checkpoint", str(tmp_path / "ckpts" / "last.ckpt"), "--out", str(tmp_path / "out")])
    before = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True).state_dict()
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).state_dict()
    assert set(after) == set(before)
    vision = [name for name in before if ".language_model." not in name and not name.startswith("lm_head")]
    assert vision and all(torch.equal(after[name], before[name]) for name in vision)
    assert not torch.equal(after["model.language_model.norm.weight"], before["model.language_model.norm.weight"])  # trained
    shutil.move(source, tmp_path / "moved")
    with pytest.raises(SystemExit):
        main(["export-hf", "--checkpoint", str(tmp_path / "ckpts" / "last.ckpt"), "--out", str(tmp_path / "again")])
    assert re.search("trained the text model of the multimodal checkpoint .* restore it there", capsys.readouterr().err)
    assert not (tmp_path / "again").exists()


def _checksums(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_export_never_destroys_its_source_or_other_files(tmp_path, capsys):
    from ultrascale.cli import main

    source = make_checkpoint(tmp_path / "source")
    make_tokenizer(source)
    run_ranks(_short_finetune, 1, str(source), str(tmp_path / "ckpts"))
    checkpoint = str(tmp_path / "ckpts" / "last.ckpt")
    before = _checksums(source)
    for overwrite in ([], ["--overwrite"]):  # onto the source: refused, with or without --overwrite
        with pytest.raises(SystemExit) as exited:
            main(["export-hf", "--checkpoint", checkpoint, "--out", str(source), *overwrite])
        assert exited.value.code == 2 and "it is the model's source folder" in capsys.readouterr().err
    assert _checksums(source) == before  # every original file intact, nothing added
    with pytest.raises(ValueError, match="source folder"):  # and refused before training, not after it
        HFCausalLM(str(source), export_dir=str(source))

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is not empty \(\['notes.txt'\]\).*--overwrite"):
        main(["export-hf", "--checkpoint", checkpoint, "--out", str(busy)])
    with pytest.raises(FileExistsError, match="export_overwrite=True"):
        HFCausalLM(str(source), export_dir=str(busy))
    assert (busy / "notes.txt").read_text() == "mine"
    main(["export-hf", "--checkpoint", checkpoint, "--out", str(busy), "--overwrite"])
    assert not (busy / "notes.txt").exists() and (busy / "config.json").is_file()
    # A run directory: its newest complete checkpoint is found; a wrong path says what is there instead.
    main(["export-hf", "--checkpoint", str(tmp_path / "ckpts"), "--out", str(tmp_path / "from_run_dir")])
    assert f"exporting {checkpoint}" in capsys.readouterr().out and (tmp_path / "from_run_dir" / "config.json").is_file()
    with pytest.raises(SystemExit):
        main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "nowhere")])
    assert "ckpt does not exist" in (err := capsys.readouterr().err) and "ckpts/" in err
    assert transformers.AutoModelForCausalLM.from_pretrained(busy, local_files_only=True) is not None
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_truncated_safetensors_is_named(tmp_path):
    source = make_checkpoint(tmp_path / "source")
    shard = sorted(source.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:6])  # cut inside the header
    with pytest.raises(ValueError, match=rf"{shard.name}: not a readable safetensors file"):
        HFCausalLM(str(source))  # at construction, before any process or weight


def _validate_hf(rank, world_size, path):
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ultrascale_zero3", logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(TokenDataset(16, SEQ, VOCAB, seed=4, masked=True), batch_size=2)
    module = HFCausalLM(path)
    metrics = trainer.validate(module, loader, verbose=False)
    return metrics[0]["val_loss"], module.prefers_meta_init


def test_val_loss_of_a_meta_built_model_is_the_token_mean(tmp_path):
    """A model built on the meta device and materialised after sharding: its LightningModule's metric states (the
    `val_loss` MeanMetric) are not meta, and keep their zeros; they were given uninitialised memory (val_loss
    1.7e-05, -1.5e-31 or 4.9e+26 in the recipe's runs)."""
    path = make_checkpoint(tmp_path / "source")
    data = TokenDataset(16, SEQ, VOCAB, seed=4, masked=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    batch = data[0:16]
    with torch.no_grad():
        logits = reference(batch["input_ids"]).logits
    valid = batch["labels"] != -100
    expected = float(F.cross_entropy(logits[valid], batch["labels"][valid]))
    for value, meta_built in run_ranks(_validate_hf, 2, path):
        assert meta_built
        assert_close(value, expected, rtol=1e-5, atol=1e-6)
