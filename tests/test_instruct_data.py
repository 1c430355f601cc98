"""Tests of ultrascale.data.instruct: prompt-masked labels, packing, the dp layout, resume, errors.

Single process and offline: a tiny BPE tokenizer is trained and saved in a temp
folder, the data-parallel layout is injected through a fake trainer.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._parity import BatchesSeen
from ultrascale.data import InstructionDataModule, load_tokenizer, pack_examples, read_examples
from ultrascale.data.instruct import IGNORE_INDEX

TEMPLATE = "### Instruction:\n{prompt}\n### Response:\n"
WORDS = "the quick brown fox jumps over lazy dog what is sum of and plus two three four five answer".split()


def _fake_trainer(num_replicas: int = 1, rank: int = 0, epoch: int = 0, processed: int = 0) -> SimpleNamespace:
    batch_progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}),
        current_epoch=epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=batch_progress)),
    )


def _save_tokenizer(folder, *, with_bos: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS), " ".join(reversed(WORDS)), TEMPLATE + "question 0:"] * 20, trainer)
    extra = {}
    if with_bos:
        # Like Llama's tokenizer: BOS in front of every encoded text (when special tokens are on).
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
        extra = {"bos_token": "<s>"}
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", **extra
    ).save_pretrained(folder)


def _records(n: int, seed: int = 0, max_words: int = 8) -> list[dict]:
    rng = np.random.default_rng(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS, k))

    return [
        {"prompt": f"question {i}: " + text(rng.integers(1, max_words)),
         "response": text(rng.integers(1, max_words)), "id": i}
        for i in range(n)
    ]


def _write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    _save_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """``(records, path of a .jsonl with them)``."""
    folder = tmp_path_factory.mktemp("data")
    records = _records(64)
    _write_jsonl(folder / "train.jsonl", records)
    return records, str(folder / "train.jsonl")


def _dm(data_path, tok_dir, **kw) -> InstructionDataModule:
    kw = {"prompt_template": TEMPLATE, "seq_len": 64, "global_batch_size": 4, "val_fraction": 0.0, **kw}
    dm = InstructionDataModule(data_path=data_path, tokenizer_path=tok_dir, **kw)
    return dm


def _segments(dm: InstructionDataModule, block: int) -> list[tuple[int, int, int]]:
    """``(example index, start, end)`` of every example in packed block ``block``."""
    out, pos = [], 0
    for index in dm.packed.examples[block]:
        n = min(len(dm._ids[index]) - 1, dm.seq_len)
        out.append((index, pos, pos + n))
        pos += n
    return out


def _setup(dm: InstructionDataModule, pairs) -> InstructionDataModule:
    dm.setup()
    examples = dm.encode_examples(pairs)  # per-example (ids, num_prompt), for checking blocks
    dm._ids, dm._num_prompt = [ids for ids, _ in examples], [n for _, n in examples]
    return dm


# --------------------------------------------------------------------------- labels


def test_labels_mask_the_prompt(tok_dir, data) -> None:
    records, path = data
    dm = _setup(_dm(path, tok_dir, pack=False, seq_len=128), [(r["prompt"], r["response"]) for r in records])
    tok = load_tokenizer(tok_dir)
    assert dm.packed.num_truncated == 0
    assert not dm.add_bos and dm.pad_id == tok.tokenizer.pad_token_id != tok.eos_id
    assert dm.vocab_size == len(tok.tokenizer)
    assert len(dm.train_dataset) == len(records)  # one example per block
    for b in range(len(dm.train_dataset)):
        item = dm.train_dataset[b]
        x, y = item["input_ids"], item["labels"]
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (128,)
        ((index, start, end),) = _segments(dm, b)
        assert start == 0 and index == b
        prompt_ids = tok.encode(TEMPLATE.format(prompt=records[index]["prompt"]))
        response_ids = tok.encode(records[index]["response"])
        n_prompt = len(prompt_ids)
        # Targets of positions 0..n_prompt-2 are prompt tokens 1..n_prompt-1: masked.
        assert (y[: n_prompt - 1] == IGNORE_INDEX).all()
        # From the last prompt position on, every target is the next token.
        assert torch.equal(y[n_prompt - 1 : end - 1], x[n_prompt:end])
        assert y[end - 1] == tok.eos_id
        learned = y[y != IGNORE_INDEX].tolist()
        assert learned == response_ids + [tok.eos_id]
        assert tok.decode(learned) == records[index]["response"]  # EOS is dropped by decode
        assert tok.eos_id not in x[:end].tolist()  # EOS is a target only, never an input
        # Padding: pad id in, no loss.
        assert (x[end:] == dm.pad_id).all() and (y[end:] == IGNORE_INDEX).all()


def test_bos_when_the_tokenizer_adds_one(tmp_path, data) -> None:
    records, path = data
    _save_tokenizer(tmp_path / "tok", with_bos=True)
    dm = _setup(_dm(path, str(tmp_path / "tok"), pack=False), [(r["prompt"], r["response"]) for r in records])
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert dm.add_bos and tok.bos_id == 2
    item = dm.train_dataset[0]
    n_prompt = 1 + len(tok.encode(TEMPLATE.format(prompt=records[0]["prompt"])))  # BOS + prompt
    assert item["input_ids"][0] == tok.bos_id
    assert (item["labels"][: n_prompt - 1] == IGNORE_INDEX).all() and item["labels"][n_prompt - 1] != IGNORE_INDEX
    learned = item["labels"][item["labels"] != IGNORE_INDEX].tolist()
    assert learned == tok.encode(records[0]["response"]) + [tok.eos_id]


# --------------------------------------------------------------------------- the loss


def test_prompt_tokens_contribute_zero_loss(tok_dir, data) -> None:
    from ultrascale.models.lm import LlamaLM

    records, path = data
    dm = _setup(_dm(path, tok_dir, pack=True), [(r["prompt"], r["response"]) for r in records])
    blocks = range(4)
    batch = {k: torch.stack([dm.train_dataset[b][k] for b in blocks]) for k in ("input_ids", "labels")}
    labels = batch["labels"]  # (B, T)
    # Prompt-target positions from the example structure, independently of the labels' -100s.
    prompt_pos = torch.zeros_like(labels, dtype=torch.bool)  # (B, T)
    for row, b in enumerate(blocks):
        for index, start, _ in _segments(dm, b):
            prompt_pos[row, start : start + dm._num_prompt[index] - 1] = True
    masked = labels == IGNORE_INDEX  # (B, T): prompt targets and padding
    assert prompt_pos.sum() > 0 and (~masked).sum() > 0 and max(len(_segments(dm, b)) for b in blocks) > 1
    assert torch.equal(masked & (batch["input_ids"] != dm.pad_id), prompt_pos)

    lm = LlamaLM(preset="tiny", vocab_size=dm.vocab_size)
    lm.configure_model()
    captured: dict[str, torch.Tensor] = {}

    def keep_logits(module, args, out):
        out.retain_grad()
        captured["logits"] = out

    handle = lm.model.output.register_forward_hook(keep_logits)  # the head: its output is the logits
    loss = lm.batch_loss(batch)["loss"]  # LlamaLM's own training loss
    handle.remove()
    loss.backward()
    grad = captured["logits"].grad  # (B, T, V)
    assert torch.count_nonzero(grad[prompt_pos]) == 0  # exactly zero, not just small
    assert torch.count_nonzero(grad[masked]) == 0
    assert (grad[~masked].abs().sum(-1) > 0).all()  # every response target is learned

    # The loss is the mean over response targets only.
    logits = captured["logits"].detach()
    manual = F.cross_entropy(logits[~masked].float(), labels[~masked])
    torch.testing.assert_close(loss.detach(), manual, rtol=0, atol=1e-6)

    # Changing the logits at prompt positions leaves the loss bitwise unchanged ...
    noise = torch.randn_like(logits) * 10.0
    poked = torch.where(prompt_pos[..., None], logits + noise, logits)
    assert torch.equal(
        F.cross_entropy(poked.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX),
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX),
    )
    # ... while changing them at one response position does change it (the check is not vacuous).
    poked = torch.where((~masked).cumsum(-1).eq(1)[..., None] & ~masked[..., None], logits + noise, logits)
    assert not torch.equal(
        F.cross_entropy(poked.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX),
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX),
    )


# --------------------------------------------------------------------------- packing


def test_pack_examples_boundaries() -> None:
    """Example ``k`` uses ids in ``[1000k, 1000k + n)``, so each id names its example."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(3, 14, size=40)
    examples = [(1000 * k + np.arange(n), int(rng.integers(1, n))) for k, n in enumerate(lengths)]
    seq_len = 24
    packed = pack_examples(examples, seq_len, pad_id=-1)
    owner = lambda a: np.where(a >= 0, a // 1000, -1)  # noqa: E731

    assert packed.num_truncated == packed.num_dropped == packed.num_empty == 0
    assert sum(packed.examples, []) == list(range(len(examples)))  # every example once, in order
    for b in range(packed.num_blocks):
        x, y = packed.input_ids[b], packed.labels[b]
        # Whole examples, back to back, then padding.
        expected_x = np.concatenate([examples[k][0][:-1] for k in packed.examples[b]])
        assert np.array_equal(x[: expected_x.size], expected_x) and (x[expected_x.size :] == -1).all()
        assert (y[expected_x.size :] == IGNORE_INDEX).all()
        # No label crosses a boundary: every target belongs to the example of its input position.
        learned = y != IGNORE_INDEX
        assert np.array_equal(owner(y[learned]), owner(x[learned]))
        # In particular the last position of each example targets that example's own last id.
        for k in packed.examples[b]:
            ids, n_prompt = examples[k]
            last = np.flatnonzero(x == ids[-2])[0]
            assert y[last] == ids[-1]
            assert (y[x == ids[0]] == (ids[1] if n_prompt <= 1 else IGNORE_INDEX)).all()
        # Next-fit: the next example would not have fitted in this block.
        if b + 1 < packed.num_blocks:
            nxt = packed.examples[b + 1][0]
            assert expected_x.size + lengths[nxt] - 1 > seq_len
    assert packed.num_tokens == sum(int(n) - 1 for n in lengths)
    assert 0.5 < packed.density <= 1.0

    # The same stream cut naively (CausalLM-style) would put a target across a boundary.
    stream = np.concatenate([ids for ids, _ in examples[:2]])
    assert owner(stream[1:])[lengths[0] - 1] != owner(stream[:-1])[lengths[0] - 1]

    single = pack_examples(examples, seq_len, pad_id=-1, pack=False)
    assert single.examples == [[k] for k in range(len(examples))]


def test_pack_examples_truncation() -> None:
    examples = [
        (np.arange(10), 3),  # fits: 9 inputs
        (np.arange(100, 130), 5),  # 29 inputs: truncated to 12, response tail cut
        (np.arange(200, 230), 20),  # prompt alone longer than the block: dropped
        (np.arange(300, 301), 0),  # a single id: nothing to predict
        (np.arange(400, 413), 2),  # exactly 12 inputs: fits whole
    ]
    packed = pack_examples(examples, seq_len=12, pad_id=0)
    assert (packed.num_truncated, packed.num_dropped, packed.num_empty) == (2, 1, 1)
    assert packed.examples == [[0], [1], [4]]
    assert np.array_equal(packed.input_ids[1], np.arange(100, 112))  # the head is kept
    assert np.array_equal(packed.labels[1], np.r_[[IGNORE_INDEX] * 4, np.arange(105, 113)])
    assert np.array_equal(packed.labels[2], np.r_[IGNORE_INDEX, np.arange(402, 413)])


def test_datamodule_packing(tok_dir, data) -> None:
    records, path = data
    pairs = [(r["prompt"], r["response"]) for r in records]
    dm = _setup(_dm(path, tok_dir, seq_len=48, val_fraction=0.1), pairs)
    eos = dm.tokenizer.eos_id
    n_blocks = len(dm.train_dataset) + len(dm.val_dataset)
    assert n_blocks == dm.packed.num_blocks < len(records)  # several examples per block
    assert len(dm.val_dataset) == max(1, int(n_blocks * 0.1))
    assert sum(dm.packed.examples, []) == list(range(len(records)))
    assert max(len(e) for e in dm.packed.examples) > 1
    for b in range(n_blocks):
        ds, i = (dm.train_dataset, b) if b < len(dm.train_dataset) else (dm.val_dataset, b - len(dm.train_dataset))
        x, y = ds[i]["input_ids"], ds[i]["labels"]
        segs = _segments(dm, b)
        for index, start, end in segs:
            ids = dm._ids[index]
            assert x[start:end].tolist() == ids[:-1].tolist()
            # Each example's last position targets its own EOS, never the next example's first token.
            assert y[end - 1] == eos
            learned = y[start:end][y[start:end] != IGNORE_INDEX].tolist()
            assert learned == dm.tokenizer.encode(records[index]["response"]) + [eos]
        end = segs[-1][2]
        assert (x[end:] == dm.pad_id).all() and (y[end:] == IGNORE_INDEX).all()


def test_truncation_warns_once_with_count(tmp_path, tok_dir) -> None:
    records = _records(16)
    records[3]["response"] = " ".join(["answer"] * 200)
    records[7]["response"] = " ".join(["four"] * 200)
    records[9]["prompt"] = " ".join(["what"] * 200)  # prompt alone overflows: dropped
    _write_jsonl(tmp_path / "d.jsonl", records)
    dm = _dm(str(tmp_path / "d.jsonl"), tok_dir, seq_len=40)
    with pytest.warns(UserWarning, match=r"3 of 16 examples .* truncated .* 1 of them .* dropped") as record:
        dm.setup()
    assert len([w for w in record if "truncated" in str(w.message)]) == 1
    assert (dm.packed.num_truncated, dm.packed.num_dropped) == (3, 1)
    assert 9 not in sum(dm.packed.examples, [])
    (block,) = [b for b, e in enumerate(dm.packed.examples) if 3 in e]
    assert dm.packed.examples[block] == [3]  # a truncated example fills its block
    assert (dm.packed.labels[block] != IGNORE_INDEX).any()
    assert dm.tokenizer.eos_id not in dm.packed.labels[block]  # its EOS was cut with the tail


# --------------------------------------------------------------------------- sources


def test_sources_agree(tmp_path, tok_dir, data) -> None:
    import datasets

    records, path = data
    ref = _dm(path, tok_dir)
    ref.setup()

    (tmp_path / "dir").mkdir()
    _write_jsonl(tmp_path / "dir" / "a.jsonl", records[:30])
    _write_jsonl(tmp_path / "dir" / "b.jsonl", records[30:])
    (tmp_path / "dir" / "notes.txt").write_text("ignored")
    columns = {k: [r[k] for r in records] for k in ("prompt", "response", "id")}
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns)}).save_to_disk(str(tmp_path / "dsd"))
    renamed = {"instruction": columns["prompt"], "output": columns["response"]}
    datasets.Dataset.from_dict(renamed).save_to_disk(str(tmp_path / "renamed"))

    for source, kw in [("dir", {}), ("ds", {}), ("dsd", {}),
                       ("renamed", dict(prompt_field="instruction", response_field="output"))]:
        dm = _dm(str(tmp_path / source), tok_dir, **kw)
        dm.setup()
        assert np.array_equal(dm.train_dataset.input_ids, ref.train_dataset.input_ids), source
        assert np.array_equal(dm.train_dataset.labels, ref.train_dataset.labels), source

    assert list(read_examples(path))[:2] == [(r["prompt"], r["response"]) for r in records[:2]]
    capped = _dm(path, tok_dir, max_examples=20, pack=False)
    capped.setup()
    assert capped.packed.examples == [[k] for k in range(20)]


# --------------------------------------------------------------------------- layout and resume


def test_dp_layout_matches_dp1(tok_dir, data) -> None:
    _, path = data
    # Rows compared across layouts: one shape (pad_to="longest" cuts each rank's batch to its own longest).
    kwargs = dict(seq_len=32, global_batch_size=4, val_fraction=0.2, pad_to="seq_len")
    ref = _dm(path, tok_dir, **kwargs)
    ref.setup()
    ref_train, ref_val = list(ref.train_dataloader()), list(ref.val_dataloader())
    assert len(ref_train) >= 3 and len(ref_val) >= 1
    assert ref_train[0]["input_ids"].shape == (4, 32)
    per_rank = []
    for rank in range(2):
        dm = _dm(path, tok_dir, **kwargs)
        dm.trainer = _fake_trainer(num_replicas=2, rank=rank)
        dm.setup()
        assert dm.train_dataloader().batch_size == 2
        per_rank.append((list(dm.train_dataloader()), list(dm.val_dataloader())))
    for split, refs in ((0, ref_train), (1, ref_val)):
        for b, batch in enumerate(refs):
            for key in ("input_ids", "labels"):
                assert torch.equal(torch.cat([r[split][b][key] for r in per_rank]), batch[key])

    # Shuffled per epoch, deterministically.
    loader = ref.train_dataloader()
    loader.sampler.set_epoch(1)
    assert not torch.equal(next(iter(loader))["input_ids"], ref_train[0]["input_ids"])
    again = _dm(path, tok_dir, **kwargs)
    again.setup()
    assert torch.equal(next(iter(again.train_dataloader()))["labels"], ref_train[0]["labels"])

    bad = _dm(path, tok_dir, global_batch_size=6)
    bad.trainer = _fake_trainer(num_replicas=4)
    bad.setup()
    with pytest.raises(ValueError, match=r"global_batch_size=6.*4"):
        bad.train_dataloader()


def test_resume_skips_consumed_batches(tok_dir, data) -> None:
    _, path = data
    kwargs = dict(seq_len=32, global_batch_size=4, pad_to="seq_len")  # batches compared whole
    assert _dm(path, tok_dir, **kwargs).state_dict() == {"epoch": 0, "batches_done": 0, "global_batch_size": 4,
                                                          "seed": 1234}
    src = _dm(path, tok_dir, **kwargs)
    src.trainer = _fake_trainer(epoch=1, processed=2)
    state = src.state_dict()

    ref = _dm(path, tok_dir, **kwargs)
    ref.setup()
    loader = ref.train_dataloader()
    loader.sampler.set_epoch(1)
    full = list(loader)
    assert len(full) > 3

    resumed = []
    for rank in range(2):  # resume at dp=2 from a dp=1 checkpoint
        dm = _dm(path, tok_dir, **kwargs)
        dm.load_state_dict(state)
        dm.trainer = _fake_trainer(num_replicas=2, rank=rank)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        assert len(loader) == len(full)
        resumed.append(list(loader))
    assert len(resumed[0]) == len(full) - 2
    for b, batch in enumerate(full[2:]):
        assert torch.equal(torch.cat([r[b]["labels"] for r in resumed]), batch["labels"])

    with pytest.raises(ValueError, match="global_batch_size=4.*global_batch_size=8"):
        _dm(path, tok_dir, **{**kwargs, "global_batch_size": 8}).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        _dm(path, tok_dir, **{**kwargs, "seed": 1}).load_state_dict(state)


# --------------------------------------------------------------------------- errors


def test_errors(tmp_path, tok_dir, data) -> None:
    import datasets

    records, path = data
    with pytest.raises(FileNotFoundError, match="data_path"):
        _dm(str(tmp_path / "missing.jsonl"), tok_dir).setup()
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        _dm(path, str(tmp_path / "no_tok"))
    (tmp_path / "not_tok").mkdir()
    (tmp_path / "not_tok" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer_path.*holds no tokenizer.*config\.json"):
        _dm(path, str(tmp_path / "not_tok"))

    _write_jsonl(tmp_path / "fields.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(ValueError, match=r"fields\.jsonl:1: field `response` is missing; fields present: "
                                         r"\['answer', 'prompt'\]"):
        _dm(str(tmp_path / "fields.jsonl"), tok_dir).setup()
    datasets.Dataset.from_dict({"question": ["a"], "response": ["b"]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"ds row 0: field `prompt` is missing; fields present: \['question', 'response'\]"):
        _dm(str(tmp_path / "ds"), tok_dir).setup()
    _write_jsonl(tmp_path / "types.jsonl", [{"prompt": "a", "response": 3}])
    with pytest.raises(ValueError, match="`response` must be a string, got int"):
        _dm(str(tmp_path / "types.jsonl"), tok_dir).setup()
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        _dm(str(tmp_path / "broken.jsonl"), tok_dir).setup()

    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        _dm(str(tmp_path / "blank.jsonl"), tok_dir).setup()
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"no \*.jsonl or \*.parquet files"):
        _dm(str(tmp_path / "empty_dir"), tok_dir).setup()
    _write_jsonl(tmp_path / "few.jsonl", records[:3])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _dm(str(tmp_path / "few.jsonl"), tok_dir, pack=False).setup()
    with pytest.warns(UserWarning, match="truncated"), pytest.raises(ValueError, match="none with a token to learn"):
        _dm(path, tok_dir, seq_len=4).setup()  # every prompt alone is longer than 4 tokens
    with pytest.raises(ValueError, match="validation blocks"):
        _dm(path, tok_dir, pack=False, val_fraction=0.05, global_batch_size=8).setup()

    for bad in ("### {instruction}", "no placeholder", "{prompt} {", "{prompt} {input}"):
        with pytest.raises(ValueError, match="prompt_template"):
            _dm(path, tok_dir, prompt_template=bad)
    _dm(path, tok_dir, prompt_template="{{json}}: {prompt}")  # escaped braces are fine
    for bad in (dict(seq_len=0), dict(global_batch_size=0), dict(val_fraction=1.0), dict(max_examples=0),
                dict(num_workers=-1), dict(response_field="prompt")):
        with pytest.raises(ValueError):
            _dm(path, tok_dir, **bad)


# --------------------------------------------------------------------------- end to end


def test_trains_with_llama(tok_dir, data) -> None:
    """Two optimizer steps of ``LlamaLM`` through a real Trainer, with validation."""
    import lightning as L

    from ultrascale.models.lm import LlamaLM

    _, path = data
    dm = _dm(path, tok_dir, seq_len=32, val_fraction=0.2)
    model = LlamaLM(preset="tiny", vocab_size=dm.vocab_size, warmup_steps=1, max_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    (metrics,) = trainer.validate(model, datamodule=dm, verbose=False)
    assert np.isfinite(metrics["val_loss"])


@pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader`", "ignore:Be aware that when using `ckpt_path`")
def test_lightning_resume_mid_epoch(tmp_path, tok_dir, data) -> None:
    """Through a real Trainer: the position is checkpointed and a resume continues with the same batches."""
    import lightning as L

    _, path = data
    kwargs = dict(seq_len=32, global_batch_size=4, max_examples=24, pad_to="seq_len")  # batches compared whole
    trainer_kwargs = dict(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0)
    dm = _dm(path, tok_dir, **kwargs)
    dm.setup()
    assert len(dm.train_dataset) == 24  # 6 global batches per epoch: 8 steps cross into epoch 1
    full = BatchesSeen("labels")
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    L.Trainer(callbacks=[ckpt], default_root_dir=tmp_path, **trainer_kwargs).fit(full, datamodule=dm)
    assert len(full.seen) == 8
    (step4,) = [p for p in (tmp_path / "ckpt").iterdir() if "step=4" in p.name]
    state = torch.load(step4, weights_only=False)["InstructionDataModule"]
    assert state == {"epoch": 0, "batches_done": 4, "global_batch_size": 4, "seed": 1234}

    resumed = BatchesSeen("labels")
    dm = _dm(path, tok_dir, **kwargs)
    dm._dp_layout = lambda: (2, 1)  # resume as dp rank 1 of 2: the second half of each global batch
    L.Trainer(default_root_dir=tmp_path, enable_checkpointing=False, **trainer_kwargs).fit(
        resumed, datamodule=dm, ckpt_path=step4
    )
    assert len(resumed.seen) == 4  # 2 to finish epoch 0, 2 of epoch 1
    for got, ref in zip(resumed.seen, full.seen[4:]):
        assert torch.equal(got, ref[2:])
