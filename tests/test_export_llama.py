"""A LlamaLM leaves as a Hugging Face model: `ultrascale fit`, `ultrascale export-hf`, then transformers alone.

The converter is checked against transformers' own `LlamaForCausalLM` (logits of the same weights, tied and
untied, grouped-query heads); the byte tokenizer against `ByteTokenizer`; and end to end, for a ZeRO-3 and a 2-D
(tp2 x dp2) checkpoint of the tiny recipes, the exported folder's validation loss on the recipe's validation
batches equals `ultrascale validate`'s on the same checkpoint, and `generate` runs. The tokenizer written is the one
the data used (`tokenizer_path`, the prepared data's folder, bytes), or `--tokenizer DIR`'s, refused at another size.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from ultrascale.data.tokenizer import ByteTokenizer
from ultrascale.models.llama import Llama, LlamaConfig
from ultrascale.models.llama_hf import byte_tokenizer_for_hf, hf_llama_config, hf_llama_state

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
STEPS, VAL_BATCHES = 4, 1
FAST = ["--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", str(STEPS), "--trainer.limit_val_batches",
        str(VAL_BATCHES), "--data.init_args.max_tokens", "200000", "--trainer.strategy.init_args.launcher", "fork"]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_converted_weights_give_transformers_the_same_logits(tie):
    import transformers

    config = LlamaConfig.from_preset("tiny", vocab_size=258, max_seq_len=128, tie_embeddings=tie)
    assert config.n_kv_heads < config.n_heads  # grouped-query heads: wk's reordering uses the kv heads
    torch.manual_seed(0)
    ours = Llama(config).eval()
    theirs = transformers.LlamaForCausalLM(hf_llama_config(config, bos_token_id=256, eos_token_id=257)).eval()
    result = theirs.load_state_dict(hf_llama_state(ours.state_dict(), config), strict=False)
    assert not result.unexpected_keys and result.missing_keys == (["lm_head.weight"] if tie else [])
    theirs.tie_weights()
    tokens = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_an_unknown_weight_and_the_moe_variant_are_refused():
    config = LlamaConfig.from_preset("tiny")
    with pytest.raises(ValueError, match="`layers.0.extra.weight` is not a weight of the built-in Llama"):
        hf_llama_state({"layers.0.extra.weight": torch.zeros(1)}, config)
    moe = LlamaConfig.from_preset("tiny", n_experts=4)
    with pytest.raises(NotImplementedError, match="its MoE variant .n_experts=4."):
        hf_llama_state({}, moe)


def test_the_byte_tokenizer_encodes_as_the_data_pipeline():
    tokenizer = byte_tokenizer_for_hf()
    text = "déjà vu ✓\n\tdef f(x):  return x  # 日本"
    ids = tokenizer(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, len(tokenizer)) == (256, 257, 258)


def _recipe_val_batches(recipe: Path) -> list[torch.Tensor]:
    """The validation rows `limit_val_batches` global batches cover (each rank validates its slice of each)."""
    from ultrascale.data import CausalLMDataModule

    init_args = yaml.safe_load(recipe.read_text())["data"]["init_args"]
    data = CausalLMDataModule(**{**init_args, "max_tokens": 200000})
    data.setup("validate")
    rows = [data.val_dataset[i] for i in range(VAL_BATCHES * init_args["global_batch_size"])]
    return [torch.stack([torch.as_tensor(row[key]) for row in rows]) for key in ("input_ids", "labels")]


def test_the_tokenizer_is_the_one_the_data_used(tmp_path):
    """Which tokenizer an export writes when `--tokenizer` is not given: the data module's `tokenizer_path`, the
    folder its prepared data was tokenized with, the byte tokenizer for raw text; asked for where nobody says."""
    from ultrascale.data.prepared import prepare_data
    from ultrascale.models.hf import _data_tokenizer

    checkpoint = tmp_path / "last.ckpt"
    folder = tmp_path / "tokenizer"
    byte_tokenizer_for_hf().save_pretrained(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one document\nanother one\n")
    prepared = prepare_data([str(corpus)], folder, tmp_path / "prepared", progress=False)

    def data(**hparams):
        return {"datamodule_hyper_parameters": hparams}

    assert _data_tokenizer(checkpoint, data(tokenizer_path=str(folder))) == str(folder)
    assert _data_tokenizer(checkpoint, data(dataset_path=str(corpus), tokenizer_path=None)) == "bytes"
    for sources in (str(prepared), [{"path": str(prepared), "weight": 1.0}]):  # one folder, or a blend
        assert Path(_data_tokenizer(checkpoint, data(data_path=sources))) == folder.resolve()
    with pytest.raises(ValueError, match="pass --tokenizer DIR"):
        _data_tokenizer(checkpoint, {})
    folder.rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="is not a folder here: pass --tokenizer DIR"):
        _data_tokenizer(checkpoint, data(data_path=str(prepared)))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny_cpu.yaml", "tiny_cpu_2d.yaml"], ids=["zero3", "tp2xdp2"])
def test_exported_model_validates_as_ultrascale_validate(recipe, tmp_path, monkeypatch):
    import transformers

    from ultrascale.cli import main
    from ultrascale.recipe_cli import UltraScaleCLI

    monkeypatch.chdir(tmp_path)
    config = RECIPES / recipe
    strategy = ["--trainer.strategy", "ultrascale.ZeRO3Strategy"] if recipe == "tiny_cpu.yaml" else []  # named in it
    main(["fit", "--config", str(config), *strategy, *FAST, "--trainer.default_root_dir", str(tmp_path)])
    (checkpoint,) = tmp_path.rglob("last.ckpt")
    cli = UltraScaleCLI(args=["validate", "--config", str(config), *strategy, *FAST, "--ckpt_path", str(checkpoint)])
    validated = float(cli.trainer.callback_metrics["val_loss"])

    main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    input_ids, labels = _recipe_val_batches(config)
    with torch.no_grad():
        logits = model(input_ids).logits
    exported = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    assert abs(exported.item() - validated) < 1e-4, (exported.item(), validated)
    assert validated < math.log(258) - 0.2  # trained a little (uniform: ln 258): the comparison is of a model that moved

    if recipe == "tiny_cpu.yaml":  # a checkpoint written before LlamaLM saved its config: rebuilt from its preset
        import ultrascale.parallel.checkpoint as checkpoint_module

        real = checkpoint_module.read_checkpoint_metadata
        monkeypatch.setattr(checkpoint_module, "read_checkpoint_metadata",
                            lambda path: {k: v for k, v in real(path).items() if k != "llama_config"})
        main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf_old")])
        old = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_old", local_files_only=True)
        assert {**old.config.to_dict(), "_name_or_path": ""} == {**model.config.to_dict(), "_name_or_path": ""}
        for name, value in model.state_dict().items():
            assert torch.equal(old.state_dict()[name], value), name

    if recipe == "tiny_cpu_2d.yaml":  # --tokenizer DIR: that folder's files; a tokenizer of another size: refused
        folder = tmp_path / "tokenizer"
        byte_tokenizer_for_hf().save_pretrained(folder)
        main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf_dir"), "--tokenizer", str(folder)])
        assert (tmp_path / "hf_dir" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
        larger = transformers.AutoTokenizer.from_pretrained(folder)
        larger.add_tokens(["<extra>"])
        larger.save_pretrained(tmp_path / "larger")
        with pytest.raises(SystemExit) as refused:
            main(["export-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf_no"), "--tokenizer",
                  str(tmp_path / "larger")])
        assert refused.value.code != 0 and not (tmp_path / "hf_no").exists()

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompt = tokenizer("def main(", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 8)
    assert tokenizer.decode(generated[0]).startswith("def main(")
