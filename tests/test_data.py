"""Tests of ultrascale.data: tokenizers, corpus loading, the dp-independent sampler and resume.

All single process: the data-parallel layout is injected through a fake trainer
(or by building samplers with explicit ``num_replicas``/``rank``).
"""

from __future__ import annotations

import string
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests._parity import BatchesSeen
from ultrascale.data import (
    ByteTokenizer,
    CausalLMDataModule,
    HFTokenizer,
    ResumableBlockSampler,
    load_tokenizer,
)


def _fake_trainer(num_replicas: int = 1, rank: int = 0, epoch: int = 0, processed: int = 0) -> SimpleNamespace:
    batch_progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}),
        current_epoch=epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=batch_progress)),
    )


def _write_corpus(folder, n_docs: int = 20, doc_len: int = 200, suffix: str = ".txt") -> None:
    rng = np.random.default_rng(0)
    letters = np.array(list(string.ascii_letters + " "))
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (folder / f"doc{i:03d}{suffix}").write_text("".join(rng.choice(letters, doc_len)))


def _global_batches(sampler_factory, dp: int, epoch: int = 0) -> list[list[int]]:
    """Reassemble global batches from the per-rank index streams of ``dp`` samplers."""
    streams = []
    for rank in range(dp):
        sampler = sampler_factory(num_replicas=dp, rank=rank)
        sampler.set_epoch(epoch)
        streams.append(list(sampler))
    per_rank = sampler.local_batch_size
    n_batches = len(streams[0]) // per_rank
    return [sum((st[b * per_rank : (b + 1) * per_rank] for st in streams), []) for b in range(n_batches)]


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🙂"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # special ids are dropped
    assert tok.decode(torch.tensor(ids)) == text
    np.testing.assert_array_equal(tok.encode_array(text), np.array(ids))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_load_tokenizer_missing_folder(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        load_tokenizer(str(tmp_path / "nope"))


def _save_hf_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world", "the quick brown fox", "jumps over the lazy dog"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def test_hf_tokenizer_folder(tmp_path) -> None:
    _save_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(tok.tokenizer)
    assert tok.eos_id == tok.tokenizer.convert_tokens_to_ids("</s>")
    ids = tok.encode("hello world")
    assert tok.eos_id not in ids  # documents are terminated by the data module, not the tokenizer
    assert tok.decode(ids) == "hello world"

    _write_corpus(tmp_path / "docs")
    dm = CausalLMDataModule(
        data_path=str(tmp_path / "docs"), file_glob="*.txt", tokenizer_path=str(tmp_path / "tok"),
        seq_len=16, global_batch_size=4, val_fraction=0.0,
    )
    assert dm.vocab_size == tok.vocab_size
    dm.setup("fit")
    tokens = dm.train_dataset.tokens
    assert tokens.max() < dm.vocab_size
    assert (tokens == tok.eos_id).sum() == 20  # one EOS per document


# --------------------------------------------------------------------------- corpus


def test_stdlib_corpus_blocks() -> None:
    dm = CausalLMDataModule(seq_len=32, global_batch_size=8, max_tokens=20_000, val_fraction=0.1)
    assert dm.vocab_size == 258
    dm.setup("fit")
    n_blocks = 20_000 // 33
    assert len(dm.train_dataset) + len(dm.val_dataset) == n_blocks
    assert len(dm.val_dataset) == int(n_blocks * 0.1)
    item = dm.train_dataset[3]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (32,)
    block = torch.from_numpy(dm.train_dataset.tokens[3 * 33 : 4 * 33].astype(np.int64))
    assert torch.equal(item["input_ids"], block[:-1])
    assert torch.equal(item["labels"], block[1:])
    assert torch.equal(item["labels"][:-1], item["input_ids"][1:])  # labels are inputs shifted by one

    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (8, 32) and batch["labels"].shape == (8, 32)
    val = next(iter(dm.val_dataloader()))
    # Validation is in order: its first sample is the first block after the training blocks.
    assert torch.equal(val["input_ids"][0], dm.val_dataset[0]["input_ids"])


def test_text_dir_single_file_and_determinism(tmp_path) -> None:
    _write_corpus(tmp_path / "docs", n_docs=5, doc_len=100)
    (tmp_path / "docs" / "skip.md").write_text("not matched by the glob")
    dm = CausalLMDataModule(data_path=str(tmp_path / "docs"), file_glob="**/*.txt", seq_len=8,
                            global_batch_size=4, val_fraction=0.0)
    dm.setup()
    tokens = dm.train_dataset.tokens
    expected = b"".join((tmp_path / "docs" / f"doc{i:03d}.txt").read_bytes() + b"\x00" for i in range(5))
    expected_ids = [257 if c == 0 else c for c in expected]  # \x00 marks the EOS positions
    n = len(dm.train_dataset) * 9
    assert tokens[:n].tolist() == expected_ids[:n]

    single = CausalLMDataModule(data_path=str(tmp_path / "docs" / "doc000.txt"), seq_len=8,
                                global_batch_size=4, val_fraction=0.0)
    single.setup()
    assert single.train_dataset.tokens.size == 101


def test_saved_dataset(tmp_path) -> None:
    import datasets

    texts = [f"document number {i} " * 5 for i in range(30)]
    datasets.Dataset.from_dict({"body": texts, "id": list(range(30))}).save_to_disk(str(tmp_path / "ds"))
    dm = CausalLMDataModule(dataset_path=str(tmp_path / "ds"), text_column="body", seq_len=16,
                            global_batch_size=4, max_tokens=1000, val_fraction=0.2)
    dm.setup()
    assert len(dm.train_dataset) + len(dm.val_dataset) == 1000 // 17
    expected = ByteTokenizer().encode(texts[0]) + [257]
    assert dm.train_dataset.tokens[: len(expected)].tolist() == expected

    bad = CausalLMDataModule(dataset_path=str(tmp_path / "ds"), text_column="text")
    with pytest.raises(ValueError, match="columns"):
        bad.setup()


# --------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_global_batches_independent_of_dp(shuffle: bool) -> None:
    data = range(83)  # not a multiple of the global batch: the tail is dropped

    def factory(**kw):
        return ResumableBlockSampler(data, global_batch_size=8, shuffle=shuffle, seed=7, **kw)

    reference = _global_batches(factory, dp=1)
    assert len(reference) == 83 // 8
    assert len(set(sum(reference, []))) == 80  # no repeats within an epoch
    for dp in (2, 4):
        assert _global_batches(factory, dp=dp) == reference
        assert len(factory(num_replicas=dp, rank=dp - 1)) == 80 // dp
    if not shuffle:
        assert sum(reference, []) == list(range(80))


def test_sampler_epochs_differ_and_reproduce() -> None:
    def make(epoch):
        s = ResumableBlockSampler(range(64), global_batch_size=8, seed=3)
        s.set_epoch(epoch)
        return list(s)

    assert make(0) == make(0)
    assert make(1) == make(1)
    assert make(0) != make(1)
    assert sorted(make(0)) == sorted(make(1)) == list(range(64))
    # The permutation is exactly torch's randperm under seed + epoch.
    assert make(1) == torch.randperm(64, generator=torch.Generator().manual_seed(4)).tolist()


@pytest.mark.parametrize("dp", [1, 2])
def test_sampler_skip_batches(dp: int) -> None:
    def factory(**kw):
        return ResumableBlockSampler(range(100), global_batch_size=8, seed=1, **kw)

    full = _global_batches(factory, dp=dp, epoch=2)
    resumed = _global_batches(
        lambda **kw: factory(skip_batches=3, resume_epoch=2, **kw), dp=dp, epoch=2
    )
    assert resumed == full[3:]
    skipping = factory(num_replicas=dp, rank=0, skip_batches=3, resume_epoch=2)
    assert len(skipping) == len(factory(num_replicas=dp, rank=0)) == 96 // dp  # __len__ is the full epoch
    skipping.set_epoch(3)  # later epochs are complete
    assert _global_batches(lambda **kw: factory(skip_batches=3, resume_epoch=2, **kw), dp=dp, epoch=3) == (
        _global_batches(factory, dp=dp, epoch=3)
    )
    assert len(list(skipping)) == 96 // dp


def test_sampler_validation_errors() -> None:
    with pytest.raises(ValueError, match="global_batch_size=6.*does not split over the 4 data-parallel ranks"):
        ResumableBlockSampler(range(10), global_batch_size=6, num_replicas=4, rank=0)
    with pytest.raises(ValueError, match="rank"):
        ResumableBlockSampler(range(10), global_batch_size=4, num_replicas=2, rank=2)


# --------------------------------------------------------------------------- data module layout / errors


def test_datamodule_dp_layout_matches_dp1(tmp_path) -> None:
    _write_corpus(tmp_path / "docs")
    kwargs = dict(data_path=str(tmp_path / "docs"), file_glob="*.txt", seq_len=16, global_batch_size=8,
                  val_fraction=0.1)
    dm1 = CausalLMDataModule(**kwargs)
    dm1.setup()
    ref_batches = list(dm1.train_dataloader())
    ref_val = list(dm1.val_dataloader())
    per_rank = []
    for rank in range(4):
        dm = CausalLMDataModule(**kwargs)
        dm.trainer = _fake_trainer(num_replicas=4, rank=rank)
        dm.setup()
        loader = dm.train_dataloader()
        assert loader.batch_size == 2
        per_rank.append((list(loader), list(dm.val_dataloader())))
    for b, ref in enumerate(ref_batches):
        cat = torch.cat([train[b]["input_ids"] for train, _ in per_rank])
        assert torch.equal(cat, ref["input_ids"])
    for b, ref in enumerate(ref_val):
        assert torch.equal(torch.cat([val[b]["labels"] for _, val in per_rank]), ref["labels"])


def test_datamodule_errors(tmp_path) -> None:
    _write_corpus(tmp_path / "docs")
    dm = CausalLMDataModule(data_path=str(tmp_path / "docs"), file_glob="*.txt", seq_len=16, global_batch_size=6,
                            val_fraction=0.0)
    dm.trainer = _fake_trainer(num_replicas=4, rank=0)
    dm.setup()
    with pytest.raises(ValueError, match=r"global_batch_size=6.*4"):
        dm.train_dataloader()

    with pytest.raises(FileNotFoundError, match="data_path"):
        CausalLMDataModule(data_path=str(tmp_path / "missing")).setup()
    with pytest.raises(FileNotFoundError, match="dataset_path"):
        CausalLMDataModule(dataset_path=str(tmp_path / "missing")).setup()

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        CausalLMDataModule(data_path=str(tmp_path / "empty")).setup()
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        CausalLMDataModule(data_path=str(tmp_path / "blank.txt")).setup()

    (tmp_path / "tiny.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        CausalLMDataModule(data_path=str(tmp_path / "tiny.txt"), seq_len=16, global_batch_size=8).setup()
    with pytest.raises(ValueError, match="validation blocks"):
        CausalLMDataModule(data_path=str(tmp_path / "docs"), file_glob="*.txt", seq_len=16,
                           global_batch_size=8, val_fraction=0.01).setup()

    for bad in (dict(seq_len=0), dict(global_batch_size=0), dict(val_fraction=1.0), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            CausalLMDataModule(**bad)


# --------------------------------------------------------------------------- resume


def test_state_dict_round_trip(tmp_path) -> None:
    _write_corpus(tmp_path / "docs")
    kwargs = dict(data_path=str(tmp_path / "docs"), file_glob="*.txt", seq_len=16, global_batch_size=8,
                  val_fraction=0.0)
    assert CausalLMDataModule(**kwargs).state_dict() == {"epoch": 0, "batches_done": 0, "global_batch_size": 8,
                                                         "seed": 1234}
    src = CausalLMDataModule(**kwargs)
    src.trainer = _fake_trainer(epoch=1, processed=5)
    state = src.state_dict()
    assert state["epoch"] == 1 and state["batches_done"] == 5

    ref = CausalLMDataModule(**kwargs)
    ref.setup()
    ref_loader = ref.train_dataloader()
    ref_loader.sampler.set_epoch(1)
    full = list(ref_loader)

    # Resume at dp=2 from a checkpoint written at dp=1: same global batches, split in two.
    resumed = []
    for rank in range(2):
        dm = CausalLMDataModule(**kwargs)
        dm.load_state_dict(state)
        dm.trainer = _fake_trainer(num_replicas=2, rank=rank)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        assert len(loader) == len(full)  # Lightning sees the full epoch length
        resumed.append(list(loader))
    assert len(resumed[0]) == len(full) - 5
    for b, ref_batch in enumerate(full[5:]):
        assert torch.equal(torch.cat([r[b]["input_ids"] for r in resumed]), ref_batch["input_ids"])

    with pytest.raises(ValueError, match="global_batch_size=8.*global_batch_size=4"):
        CausalLMDataModule(**{**kwargs, "global_batch_size": 4}).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        CausalLMDataModule(**{**kwargs, "seed": 1}).load_state_dict(state)


def test_lightning_resume_mid_epoch(tmp_path) -> None:
    """End to end through a real Trainer: checkpoint mid-epoch, resume, continue with the same batches."""
    import lightning as L

    (tmp_path / "c.txt").write_text("".join(chr(ord("a") + i % 26) for i in range(2000)))
    # 17 blocks of 9 tokens -> 4 global batches of 4 per epoch; 6 steps cross an epoch boundary.
    kwargs = dict(data_path=str(tmp_path / "c.txt"), seq_len=8, global_batch_size=4, max_tokens=153,
                  val_fraction=0.0)
    trainer_kwargs = dict(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)

    full_model = BatchesSeen()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    L.Trainer(callbacks=[ckpt], default_root_dir=tmp_path, **trainer_kwargs).fit(
        full_model, datamodule=CausalLMDataModule(**kwargs)
    )
    assert len(full_model.seen) == 6
    assert not torch.equal(full_model.seen[0], full_model.seen[4])  # epoch 1 is reshuffled

    (step3,) = [p for p in (tmp_path / "ckpt").iterdir() if "step=3" in p.name]
    resumed_model = BatchesSeen()
    dm = CausalLMDataModule(**kwargs)
    dm._dp_layout = lambda: (2, 1)  # resume as dp rank 1 of 2: the second half of each global batch
    L.Trainer(default_root_dir=tmp_path, enable_checkpointing=False, **trainer_kwargs).fit(
        resumed_model, datamodule=dm, ckpt_path=step3
    )
    assert len(resumed_model.seen) == 3
    for got, ref in zip(resumed_model.seen, full_model.seen[3:]):
        assert torch.equal(got, ref[2:])
