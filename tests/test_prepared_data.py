"""Pretraining data prepared once (`ultrascale prepare-data`) and memory-mapped by `CausalLMDataModule`:
every input kind, the same bytes for any number of workers, the same global batches at any dp size, a
mid-epoch resume, blends by weight, position ids per document, and the errors before any process group."""

import json

import numpy as np
import pytest
import torch

from tests._parity import BatchesSeen
from tests.test_data import _fake_trainer, _save_hf_tokenizer
from ultrascale.cli import main as cli_main
from ultrascale.data import CausalLMDataModule
from ultrascale.data.prepared import BlendedBlocks, PreparedTokens, prepare_data

WORDS = "the quick brown fox jumps over lazy dog hello world".split()


def _documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(5, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    _save_hf_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 300 documents as text files, JSONL lines and Parquet rows (100 each), in one folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    docs = _documents(300, seed=0)
    for i, doc in enumerate(docs[:100]):
        (folder / "a_text").mkdir(exist_ok=True)
        (folder / "a_text" / f"{i:03d}.txt").write_text(doc)
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[100:200])))
    pq.write_table(pa.table({"text": docs[200:]}), folder / "c.parquet")
    return folder, docs


def _prepare(inputs, tokenizer, out, **kwargs):
    return prepare_data([str(p) for p in inputs], tokenizer, out, progress=False, **kwargs)


def test_every_input_kind_in_order_and_the_same_for_any_workers(tmp_path, tokenizer, corpus):
    from transformers import AutoTokenizer

    folder, docs = corpus
    one = PreparedTokens.open(_prepare([folder], tokenizer, tmp_path / "one"))
    two = PreparedTokens.open(_prepare([folder], tokenizer, tmp_path / "two", workers=2))
    assert (tmp_path / "one" / "tokens.bin").read_bytes() == (tmp_path / "two" / "tokens.bin").read_bytes()
    assert np.array_equal(one.document_starts, two.document_starts)
    hf = AutoTokenizer.from_pretrained(tokenizer)
    expected = [t for d in docs for t in (*hf(d, add_special_tokens=False)["input_ids"], hf.eos_token_id)]
    assert one.tokens.dtype == np.uint16 and np.array_equal(np.asarray(one.tokens), expected)
    meta = one.metadata
    assert meta["num_documents"] == 300 and meta["num_tokens"] == len(expected)
    assert meta["tokenizer"]["vocab_size"] == len(hf) and meta["tokenizer"]["eos_id"] == hf.eos_token_id
    assert len(meta["tokenizer"]["sha256"]) == 64 and len(meta["sources"]) == 102  # 100 text files, JSONL, Parquet
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # nothing left beside the targets


def test_saved_dataset_and_the_command(tmp_path, tokenizer, capsys):
    import datasets

    docs = _documents(50, seed=1)
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "saved"))
    out = tmp_path / "prepared"
    cli_main(["prepare-data", "--tokenizer", tokenizer, "--out", str(out), "--text-field", "body", "--no-progress",
              str(tmp_path / "saved")])
    assert "50 documents" in capsys.readouterr().out
    assert PreparedTokens.open(out).metadata["num_documents"] == 50
    with pytest.raises(SystemExit):  # a non-empty target is refused
        cli_main(["prepare-data", "--tokenizer", tokenizer, "--out", str(out), str(tmp_path / "saved")])
    assert "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["prepare-data", "--tokenizer", tokenizer, "--out", str(tmp_path / "x"), "--text-field", "nope",
                  str(tmp_path / "saved")])
    assert "no column `nope`" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_records_are_named_where_they_are(tmp_path, tokenizer, capsys):
    """A malformed JSONL line names its file, line and column; a Parquet row that is not text its row group and row;
    bytes that are not UTF-8 are replaced and counted (`--strict` refuses them, naming the file and line); a run too
    short to time prints no rate."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests._cli import run_main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "tab\there"}\n')
    code, _, err = run_main(capsys, "prepare-data", "--tokenizer", tokenizer, "--out", str(tmp_path / "o1"), "--no-progress", str(bad))
    assert code == 2 and f"{bad}:2: not valid JSON (Invalid control character" in err, err
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None]}), table, row_group_size=2)
    code, _, err = run_main(capsys, "prepare-data", "--tokenizer", tokenizer, "--out", str(tmp_path / "o2"), "--no-progress", str(table))
    assert code == 2 and f"{table} row group 1, row 0: field `text` must be a string, got null" in err, err
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "caf\xe9 cr\xe8me"}\n')
    code, out, _ = run_main(capsys, "prepare-data", "--tokenizer", tokenizer, "--out", str(tmp_path / "o3"), "--no-progress", str(latin))
    assert code == 0 and "2 bytes that are not UTF-8, in 1 document(s), were replaced by U+FFFD" in out, out
    assert "too short to give a rate" in out and "tokens/s" not in out, out
    assert PreparedTokens.open(tmp_path / "o3").metadata["replaced_bytes"] == 2
    code, _, err = run_main(capsys, "prepare-data", "--tokenizer", tokenizer, "--out", str(tmp_path / "o4"), "--no-progress",
                            "--strict", str(latin))
    assert code == 2 and f"{latin}:2: byte 14 is not UTF-8" in err, err
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 4))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer):
    """Two prepared folders of different documents (blends)."""
    root = tmp_path_factory.mktemp("prepared")
    paths = []
    for name, seed, n in (("a", 2, 600), ("b", 3, 300)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(n, seed)))
        paths.append(str(_prepare([root / f"{name}.jsonl"], tokenizer, root / name)))
    return paths


def test_identical_global_batches_at_dp_1_2_4(prepared):
    kwargs = dict(data_path=prepared[0], seq_len=16, global_batch_size=8, val_fraction=0.1)
    reference = CausalLMDataModule(**kwargs)
    reference.setup()
    assert reference.vocab_size == PreparedTokens.open(prepared[0]).vocab_size
    full = list(reference.train_dataloader())
    assert len(full) >= 4
    for dp in (2, 4):
        ranks = []
        for rank in range(dp):
            dm = CausalLMDataModule(**kwargs)
            dm.trainer = _fake_trainer(num_replicas=dp, rank=rank)
            dm.setup()
            ranks.append(list(dm.train_dataloader()))
        for b, batch in enumerate(full):
            assert torch.equal(torch.cat([r[b]["input_ids"] for r in ranks]), batch["input_ids"])
            assert torch.equal(torch.cat([r[b]["labels"] for r in ranks]), batch["labels"])


def test_mid_epoch_resume_continues_the_batches(prepared):
    kwargs = dict(data_path=prepared[0], seq_len=16, global_batch_size=8, val_fraction=0.0)
    uninterrupted = CausalLMDataModule(**kwargs)
    uninterrupted.setup()
    full = list(uninterrupted.train_dataloader())
    source = CausalLMDataModule(**kwargs)
    source.trainer = _fake_trainer(processed=3)
    state = source.state_dict()  # what a checkpoint after step 3 holds
    resumed = CausalLMDataModule(**kwargs)
    resumed.load_state_dict(state)
    resumed.trainer = _fake_trainer(num_replicas=2, rank=1)
    resumed.setup()
    rest = list(resumed.train_dataloader())
    assert len(rest) == len(full) - 3
    for got, expected in zip(rest, full[3:]):
        assert torch.equal(got["input_ids"], expected["input_ids"][4:])  # dp rank 1's half of the same global batch


def test_blend_proportions_over_10000_samples(tmp_path, tokenizer):
    sources = []
    for name, seed in (("x", 5), ("y", 6)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(3000, seed)))
        sources.append(PreparedTokens.open(_prepare([tmp_path / f"{name}.jsonl"], tokenizer, tmp_path / name)))
    blend = BlendedBlocks(sources, [0.7, 0.3], seq_len=4)
    assert len(blend) >= 10_000
    for count in (100, 1000, 10_000):
        x, y = blend.source_counts(count)
        assert abs(x / count - 0.7) < 0.01 and x + y == count
    again = BlendedBlocks(sources, [7, 3], seq_len=4)  # weights are normalised; the order is deterministic
    located = [blend.locate(i) for i in range(len(blend))]
    assert [again.locate(i) for i in range(len(blend))] == located
    first = blend[0]["input_ids"]
    source, block = located[0]
    assert torch.equal(first, torch.from_numpy(np.asarray(sources[source].tokens[block * 5 : block * 5 + 4], dtype=np.int64)))
    # Each block is used once: no source is read past its end.
    for s, src in enumerate(sources):
        used = [b for source, b in located if source == s]
        assert len(set(used)) == len(used) and max(used) < src.tokens.size // 5


def _blend_by_sorting(blocks: list[int], weights: list[float], max_blocks=None) -> list[tuple[int, int]]:
    """The blend's order written out: every block at time (k + 1/2) / w_s, sorted (stable: lower source first on a
    tie), the first n = min blocks_s / w_s kept."""
    weights = [w / sum(weights) for w in weights]
    length = int(min(b / w for b, w in zip(blocks, weights)))
    length = length if max_blocks is None else min(length, max_blocks)
    timed = [((k + 0.5) / w, s, k) for s, (b, w) in enumerate(zip(blocks, weights)) for k in range(b)]
    return [(s, k) for _, s, k in sorted(timed)[:length]]


@pytest.mark.parametrize("blocks, weights, max_blocks", [
    ([50, 50], [0.5, 0.5], None),  # every time a tie
    ([300, 100], [0.7, 0.3], None),
    ([40, 90, 70], [1, 1, 2], None),
    ([60, 60, 60], [1 / 3, 1 / 3, 1 / 3], None),
    ([500, 7, 80], [0.9, 0.01, 0.09], None),
    ([200, 200], [0.61803398875, 0.38196601125], 150),
    ([1, 1000], [0.001, 0.999], None),
])
def test_blend_positions_equal_the_sorted_order(blocks, weights, max_blocks):
    """Sample i is found by counting, without an index: the same (source, block) as sorting every block by time."""
    from types import SimpleNamespace

    sources = [SimpleNamespace(tokens=np.zeros(b * 5 + 3, dtype=np.uint16)) for b in blocks]
    blend = BlendedBlocks(sources, weights, seq_len=4, max_blocks=max_blocks)
    expected = _blend_by_sorting(blocks, weights, max_blocks)
    assert len(blend) == len(expected) > 0
    assert [blend.locate(i) for i in range(len(blend))] == expected
    for count in (1, 2, len(blend) // 3, len(blend)):
        assert blend.source_counts(count) == [sum(1 for s, _ in expected[:count] if s == k) for k in range(len(blocks))]


def test_blend_through_the_data_module(prepared):
    dm = CausalLMDataModule(data_path=[{"path": prepared[0], "weight": 0.5}, {"path": prepared[1], "weight": 0.5}],
                            seq_len=16, global_batch_size=8, val_fraction=0.0)
    dm.setup()
    blend = dm.train_dataset.dataset
    x, y = blend.source_counts(len(blend))
    assert abs(x - y) <= 1 and len(blend) > 0
    assert len(list(dm.train_dataloader())) == len(blend) // 8


def test_position_ids_restart_at_every_document(prepared):
    dm = CausalLMDataModule(data_path=prepared[0], seq_len=64, global_batch_size=8, val_fraction=0.0,
                            document_positions=True)
    dm.setup()
    tokens = PreparedTokens.open(prepared[0])
    eos = tokens.metadata["tokenizer"]["eos_id"]
    for index in range(3):
        item = dm.train_dataset[index]
        positions, ids = item["position_ids"], item["input_ids"]
        assert positions[0] == 0
        after_eos = torch.nonzero(ids[:-1] == eos).flatten() + 1
        assert len(after_eos) > 0 and torch.all(positions[after_eos] == 0)
        # Elsewhere the position counts up by one.
        steps = positions[1:] - positions[:-1]
        inside = torch.ones_like(steps, dtype=torch.bool)
        inside[after_eos - 1] = False
        assert torch.all(steps[inside] == 1)


def test_errors_before_any_process_group(tmp_path, prepared, tokenizer):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared[0], copy)
    with open(copy / "tokens.bin", "r+b") as handle:
        handle.truncate((copy / "tokens.bin").stat().st_size - 10)
    with pytest.raises(ValueError, match=r"tokens.bin holds .* bytes, its metadata says .*truncated"):
        CausalLMDataModule(data_path=str(copy))
    other = tmp_path / "other_tokenizer"
    _save_hf_tokenizer(other)
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1))
    with pytest.raises(ValueError, match="is not the tokenizer .* was prepared with"):
        CausalLMDataModule(data_path=prepared[0], tokenizer_path=str(other))
    with pytest.raises(ValueError, match="needs prepared data"):
        CausalLMDataModule(data_path="stdlib", document_positions=True)
    with pytest.raises(ValueError, match="is not a prepared folder"):
        CausalLMDataModule(data_path=[{"path": prepared[0]}, {"path": str(tmp_path)}])


def _fit_refused(rank, world_size, path, model_vocab):
    import lightning as L

    import ultrascale
    from ultrascale.models.lm import LlamaLM

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = CausalLMDataModule(data_path=path, seq_len=16, global_batch_size=8, val_fraction=0.0)
    try:
        trainer.fit(LlamaLM(preset="tiny", vocab_size=model_vocab), data)
    except ValueError as error:
        return str(error), torch.distributed.is_initialized()
    return None, torch.distributed.is_initialized()


def test_a_vocabulary_larger_than_the_model_fails_before_the_process_group(prepared):
    """Under an ultrascale strategy the data is checked against the model in `setup_environment`, before the
    process group (a rank would otherwise index past the embedding on its first batch). In forked ranks: a
    fit that stops in setup_environment leaves the launch environment behind."""
    from tests._dist import run_ranks

    vocab = PreparedTokens.open(prepared[0]).vocab_size
    for error, initialised in run_ranks(_fit_refused, 2, prepared[0], vocab - 1):
        assert error is not None and f"vocabulary {vocab:,}, but the model LlamaLM has vocab_size={vocab - 1:,}" in error
        assert not initialised


def test_trainer_resume_mid_epoch_from_a_prepared_folder(tmp_path, prepared):
    """Through a real Trainer: a checkpoint after step 3, resumed as dp rank 1 of 2, sees the second half of
    each global batch the uninterrupted run saw (blocks of a memory-mapped folder, shuffled, across an epoch)."""
    import lightning as L

    kwargs = dict(data_path=prepared[1], seq_len=8, global_batch_size=4, max_tokens=153, val_fraction=0.0)  # 17 blocks
    trainer_kwargs = dict(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
    full = BatchesSeen()
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    L.Trainer(callbacks=[ckpt], default_root_dir=tmp_path, **trainer_kwargs).fit(full, datamodule=CausalLMDataModule(**kwargs))
    assert len(full.seen) == 6 and not torch.equal(full.seen[0], full.seen[4])  # epoch 1 is reshuffled
    (step3,) = [p for p in (tmp_path / "ckpt").iterdir() if "step=3" in p.name]
    resumed = BatchesSeen()
    data = CausalLMDataModule(**kwargs)
    data._dp_layout = lambda: (2, 1)
    L.Trainer(default_root_dir=tmp_path, enable_checkpointing=False, **trainer_kwargs).fit(resumed, datamodule=data,
                                                                                          ckpt_path=step3)
    assert len(resumed.seen) == 3
    for got, expected in zip(resumed.seen, full.seen[3:]):
        assert torch.equal(got, expected[2:])
