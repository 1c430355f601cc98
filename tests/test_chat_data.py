"""Conversations through the chat template (ultrascale.data.chat via InstructionDataModule): the labels are -100
exactly outside the assistant turns, packed and not, for a template with generation markers (checked against
transformers' `return_assistant_tokens_mask`) and templates without (each learned run decoded back to the assistant's
words); the options, truncation by whole turns, the three input kinds, and the errors, each naming its record.

Single process and offline: a tiny BPE tokenizer with the templates' special tokens is trained in a temp folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from ultrascale.data import InstructionDataModule
from ultrascale.data.instruct import IGNORE_INDEX
from ultrascale.parallel.device import CPU_HALF_SEQUENCE_MULTIPLE, compute_dtype, sequence_length_multiple

WORDS = "the quick brown fox jumps over lazy dog what is sum of and plus two three four five answer".split()
SPECIAL = ["<unk>", "<pad>", "<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]

# ChatML, its assistant answers marked for transformers' assistant mask (what TRL's assistant_only_loss needs).
CHATML_MARKED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same without markers: the prefix rendering finds the same tokens (the newline after <|im_end|> is no one's).
CHATML = CHATML_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Llama 3's shape: BOS from the template, a header per turn, <|eot_id|> ending each.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Renders the last assistant turn differently from the same turn followed by others: no prefix split.
UNSTABLE = CHATML.replace("message['content'] + '<|im_end|>' }}",
                          "message['content'] + ('<|im_end|>' if loop.last else ' <|im_end|>') }}")


def save_chat_tokenizer(folder, chat_template: str | None = None, eos: str = "<|endoftext|>") -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS), " ".join(reversed(WORDS)), "system user assistant\n\n"] * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<pad>", unk_token="<unk>",
                                 bos_token="<|begin_of_text|>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(folder)
    return str(folder)


def conversations(n: int, seed: int = 0, max_words: int = 7) -> list[list[dict]]:
    """Multi-turn conversations, most with a system prompt, 1-3 exchanges of uneven lengths."""
    rng = np.random.default_rng(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS, k))

    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "be brief " + text(rng.integers(1, 3))}] if i % 4 else []
        for _ in range(rng.integers(1, 4)):
            messages.append({"role": "user", "content": f"question {i} " + text(rng.integers(1, max_words))})
            messages.append({"role": "assistant", "content": text(rng.integers(1, max_words))})
        out.append(messages)
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def chats():
    return conversations(24)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, chats):
    """{"marked": tokenizer with CHATML_MARKED, "chatml": CHATML, "llama3": LLAMA3, "base": none} and the data."""
    root = tmp_path_factory.mktemp("chat")
    out = {name: save_chat_tokenizer(root / name, template, eos) for name, template, eos in (
        ("marked", CHATML_MARKED, "<|im_end|>"), ("chatml", CHATML, "<|im_end|>"), ("llama3", LLAMA3, "<|eot_id|>"),
        ("base", None, "<|endoftext|>"))}
    out["data"] = write_jsonl(root / "train.jsonl", [{"messages": m, "id": i} for i, m in enumerate(chats)])
    return out


def dm_for(data_path, tokenizer_path, **kw) -> InstructionDataModule:
    kw = {"seq_len": 192, "global_batch_size": 4, "val_fraction": 0.0, **kw}
    return InstructionDataModule(data_path=data_path, tokenizer_path=tokenizer_path, **kw)


def example_labels(dm: InstructionDataModule) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per example kept, in data order: (its inputs, its labels) cut out of the blocks by `position_ids`."""
    out = {}
    for b, indices in enumerate(dm.packed.examples):
        starts = np.flatnonzero(dm.packed.position_ids[b] == 0)
        for index, start in zip(indices, starts):
            stop = next((s for s in starts if s > start), dm.seq_len)
            out[index] = (dm.packed.input_ids[b, start:stop], dm.packed.labels[b, start:stop])
    return [out[i] for i in sorted(out)]


def learned_runs(tokenizer, inputs: np.ndarray, labels: np.ndarray) -> list[str]:
    """The text of each maximal run of learned targets."""
    ids = np.concatenate([inputs[1:], labels[-1:]])  # targets: inputs shifted, the last from the label
    learned = labels != IGNORE_INDEX
    assert (labels[learned] == ids[learned]).all()  # a learned label is the next input token
    runs, current = [], []
    for token, on in zip(ids, learned):
        if on:
            current.append(int(token))
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(r) for r in runs]


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# --------------------------------------------------------------------------- the labels


@pytest.mark.parametrize("pack", [True, False])
def test_marked_template_labels_are_transformers_assistant_mask(folders, chats, pack) -> None:
    dm = dm_for(folders["data"], folders["marked"], pack=pack)
    dm.setup()
    tok = hf_tokenizer(folders["marked"])
    kept = example_labels(dm)
    assert len(kept) == len(chats)
    assert dm.packed.num_blocks < len(chats) if pack else dm.packed.num_blocks == len(chats)
    for messages, (inputs, labels) in zip(chats, kept):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)
        assert (inputs == ids[:-1]).all()
        expected = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        assert (labels == expected).all()
        assert learned_runs(tok, inputs, labels) == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("pack", [True, False])
def test_template_without_markers_learns_each_answer_and_its_end_of_turn(folders, chats, pack) -> None:
    """Llama 3's shape: every learned run is one assistant answer and its <|eot_id|>, nothing else."""
    dm = dm_for(folders["data"], folders["llama3"], pack=pack)
    dm.setup()
    tok = hf_tokenizer(folders["llama3"])
    for messages, (inputs, labels) in zip(chats, example_labels(dm), strict=True):
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert inputs.tolist() == ids[:-1] and ids[0] == tok.bos_token_id
        assert learned_runs(tok, inputs, labels) == [m["content"] + "<|eot_id|>" for m in messages if m["role"] == "assistant"]


def test_prefix_rendering_equals_the_marked_mask(folders, chats) -> None:
    """ChatML without markers, its end-of-turn named: the same labels as the marked template's assistant mask."""
    marked, plain = dm_for(folders["data"], folders["marked"]), dm_for(folders["data"], folders["chatml"], end_of_turn="<|im_end|>")
    marked.setup()
    plain.setup()
    assert (marked.packed.labels == plain.packed.labels).all() and (marked.packed.input_ids == plain.packed.input_ids).all()
    assert (plain.packed.labels != IGNORE_INDEX).sum() > 0


def test_options(folders, chats) -> None:
    tok = hf_tokenizer(folders["marked"])
    answers = [[m["content"] for m in messages if m["role"] == "assistant"] for messages in chats]
    for name in ("marked", "chatml"):
        last = dm_for(folders["data"], folders[name], learn="last")
        last.setup()
        assert [learned_runs(tok, i, lab) for i, lab in example_labels(last)] == [[a[-1] + "<|im_end|>"] for a in answers]
        no_eot = dm_for(folders["data"], folders[name], learn_end_of_turn=False)
        no_eot.setup()
        assert [learned_runs(tok, i, lab) for i, lab in example_labels(no_eot)] == answers
    everything = dm_for(folders["data"], folders["llama3"], learn="all")
    everything.setup()
    for inputs, labels in example_labels(everything):
        assert (labels[:-1] == inputs[1:]).all() and labels[-1] != IGNORE_INDEX


def test_prompt_completion_form_learns_the_completion_only(tmp_path, folders, chats) -> None:
    """TRL's conversational prompt-completion records: the prompt's own assistant turns are context."""
    records = [{"prompt": m[:-1], "completion": m[-1:]} for m in chats]
    dm = dm_for(write_jsonl(tmp_path / "pc.jsonl", records), folders["llama3"])
    dm.setup()
    tok = hf_tokenizer(folders["llama3"])
    assert [learned_runs(tok, i, lab) for i, lab in example_labels(dm)] == [[m[-1]["content"] + "<|eot_id|>"] for m in chats]


def test_long_conversations_lose_whole_turns_from_the_end(tmp_path, folders) -> None:
    tok = hf_tokenizer(folders["llama3"])
    long = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        long += [{"role": "user", "content": f"question {i} the quick brown fox"}, {"role": "assistant", "content": "four five answer"}]
    lengths = [len(tok.apply_chat_template(long[:k], tokenize=True, return_dict=True)["input_ids"]) for k in range(1, len(long) + 1)]
    seq_len = lengths[6] + 2 - 1  # ids of turns 0..6 (3 answers) fit, with a token to spare; turn 8 does not
    too_long_first = [{"role": "user", "content": " ".join(["the quick brown fox"] * 40)}, {"role": "assistant", "content": "dog"}]
    path = write_jsonl(tmp_path / "long.jsonl", [{"messages": long}, {"messages": too_long_first}] + [{"messages": long[:3]}] * 3)
    dm = dm_for(path, folders["llama3"], seq_len=seq_len, global_batch_size=1, pack=False)
    with pytest.warns(UserWarning, match=r"2 of 5 conversations are longer than `seq_len \+ 1.*1 conversations had no token"):
        dm.setup()
    (inputs, labels), *rest = example_labels(dm)
    assert len(rest) == 3
    whole = tok.apply_chat_template(long[:7], tokenize=True, return_dict=True)["input_ids"]
    assert inputs.tolist() == whole[:-1] and learned_runs(tok, inputs, labels) == ["four five answer<|eot_id|>"] * 3
    with pytest.raises(ValueError, match=r"long\.jsonl:1: the conversation is \d+ tokens, more than `seq_len \+ 1"):
        dm_for(path, folders["llama3"], seq_len=seq_len, global_batch_size=1, truncation="error").setup()


def test_input_kinds_agree(tmp_path, folders, chats) -> None:
    """JSONL, Parquet and a saved dataset give the same blocks."""
    import datasets

    jsonl = dm_for(folders["data"], folders["marked"])
    jsonl.setup()
    table = datasets.Dataset.from_dict({"messages": chats, "id": list(range(len(chats)))})
    table.to_parquet(str(tmp_path / "train.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "train.parquet", tmp_path / "saved"):
        other = dm_for(str(path), folders["marked"])
        other.setup()
        assert (other.packed.labels == jsonl.packed.labels).all() and (other.packed.input_ids == jsonl.packed.input_ids).all()


def test_recipe_template_for_a_base_model(tmp_path, folders, chats) -> None:
    """A tokenizer without a template takes the recipe's (text or file); without either it is refused."""
    as_text = dm_for(folders["data"], folders["base"], chat_template=CHATML_MARKED)
    (tmp_path / "chatml.jinja").write_text(CHATML_MARKED)
    as_file = dm_for(folders["data"], folders["base"], chat_template=str(tmp_path / "chatml.jinja"))
    reference = dm_for(folders["data"], folders["marked"])
    for dm in (as_text, as_file, reference):
        dm.setup()
    assert (as_text.packed.labels == reference.packed.labels).all() and (as_file.packed.labels == reference.packed.labels).all()
    assert as_file.hparams["chat_template"] == CHATML_MARKED  # the checkpoint carries the text
    with pytest.raises(ValueError, match="has no chat template.*`chat_template:`"):
        dm_for(folders["data"], folders["base"]).setup()
    with pytest.raises(FileNotFoundError, match="neither a Jinja template"):
        dm_for(folders["data"], folders["base"], chat_template=str(tmp_path / "missing.jinja"))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("record, message", [
    ({"prompt": "a", "response": "b"}, r":2: field `messages` is missing"),
    ({"text": "a"}, r":2: field `messages` is missing \(the first record is a conversation.*fields present: \['text'\]"),
    ({"messages": [{"role": "bot", "content": "a"}]}, r":2: field `messages\[0\]`.role is 'bot'; known roles"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, r":2: field `messages\[0\]`.content must be a string, got list"),
    ({"messages": [{"role": "user"}]}, r":2: field `messages\[0\]` has no `content`"),
    ({"messages": []}, r":2: field `messages` is an empty conversation"),
    ({"messages": "hi"}, r":2: field `messages` must be a list"),
])
def test_bad_records_are_named(tmp_path, folders, chats, record, message) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": chats[0]}, record])
    with pytest.raises(ValueError, match=r"bad\.jsonl" + message):
        dm_for(path, folders["marked"]).setup()


def test_templates_that_cannot_be_used_are_refused_by_record(tmp_path, folders, chats) -> None:
    path = write_jsonl(tmp_path / "two.jsonl", [{"messages": chats[1]}, {"messages": chats[2]}])
    with pytest.raises(ValueError, match=r"two\.jsonl:1: the chat template does not render message \d+ \(\w+\) with"):
        dm_for(path, folders["base"], chat_template=UNSTABLE).setup()
    failing = "{{ raise_exception('only user and assistant roles are supported') if messages[0]['role'] == 'system' }}" + CHATML
    with pytest.raises(ValueError, match=r"two\.jsonl:1: the chat template failed to render this conversation.*only user"):
        dm_for(path, folders["base"], chat_template=failing).setup()
    for bad in (dict(learn="user"), dict(truncation="cut")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dm_for(path, folders["marked"], **bad)
    with pytest.raises(ValueError, match="`end_of_turn='<eot>'` is not a token"):
        dm_for(path, folders["marked"], end_of_turn="<eot>").setup()


# --------------------------------------------------------------------------- under the layouts

PARITY_SEQ, PARITY_MICRO, PARITY_ACCUMULATE, PARITY_STEPS = 64, 2, 2, 10
PARITY_LAYOUTS = {
    "TP 2": {"tensor_parallel": 2, "data_parallel_shard": 1},
    "CP 2": {"context_parallel": 2, "data_parallel_shard": 1},
    "PP 2": {"pipeline_parallel": 2, "pipeline_microbatches": 2, "data_parallel_shard": 1},
}


@pytest.fixture(scope="module")
def packed_chats(tmp_path_factory):
    """(checkpoint folder, the packed chat blocks): a tiny Llama whose vocabulary is the ChatML tokenizer's, and
    enough blocks of seq_len 64 for ten steps of two micro-batches of two."""
    from tests._parity import make_hf_checkpoint

    root = tmp_path_factory.mktemp("chat_parity")
    tokenizer = save_chat_tokenizer(root / "tok", CHATML_MARKED, "<|im_end|>")
    data = write_jsonl(root / "chats.jsonl", [{"messages": m} for m in conversations(120, seed=5, max_words=5)])
    dm = dm_for(data, tokenizer, seq_len=PARITY_SEQ, global_batch_size=PARITY_MICRO)
    dm.setup()
    need = PARITY_STEPS * PARITY_MICRO * PARITY_ACCUMULATE
    assert len(dm.train_dataset) >= need, len(dm.train_dataset)
    from torch.utils.data import Subset

    blocks = Subset(dm.train_dataset, range(need))
    path = make_hf_checkpoint(root / "llama", "llama", vocab_size=dm.vocab_size, hidden_size=32)
    return path, blocks


def _train_chat(rank, world_size, path, blocks, strategy_kwargs):
    import ultrascale
    from tests._parity import ParityData, Recorder, make_hf, parity_trainer

    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, PARITY_STEPS,
                             accumulate_grad_batches=PARITY_ACCUMULATE)
    trainer.fit(make_hf(path), ParityData(blocks, PARITY_MICRO))
    return recorder.result()


@pytest.mark.parametrize("layout", list(PARITY_LAYOUTS))
def test_chat_blocks_train_like_one_process(layout, packed_chats) -> None:
    """Packed conversations (labels only on the assistant turns, uneven per row and micro-batch; positions
    restarting per conversation) under tp 2, cp 2 and pp 2: first-step loss and gradients, the weights after it and
    the ten-step curve of the inline one-process reference."""
    from tests._dist import run_ranks
    from tests._parity import assert_parity, make_hf, merge_stages, reference_run, step_losses

    path, blocks = packed_chats
    learned = torch.stack([blocks[i]["labels"] for i in range(len(blocks))]) != IGNORE_INDEX
    per_micro_batch = learned.reshape(-1, PARITY_MICRO, PARITY_SEQ).sum(dim=(1, 2))
    assert len(set(learned.sum(dim=1).tolist())) > 3 and len(set(per_micro_batch.tolist())) > 3  # uneven counts
    reference = reference_run(make_hf(path), blocks, global_batch=PARITY_MICRO, steps=PARITY_STEPS,
                              accumulate=PARITY_ACCUMULATE)
    results = run_ranks(_train_chat, 2, path, blocks, PARITY_LAYOUTS[layout])
    result = merge_stages(results) if layout.startswith("PP") else results[0]
    assert_parity(result, reference, step_losses(results))



# --------------------------------------------------------------------------- the command line

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "hf_chat.yaml"


def _base_model_with_data(root: Path) -> tuple[str, str]:
    """A tiny Llama checkpoint whose tokenizer has no chat template (a base model), and 40 conversations."""
    from tests._parity import make_hf_checkpoint

    tokenizer = save_chat_tokenizer(root / "base", None, "<|im_end|>")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer, local_files_only=True))
    make_hf_checkpoint(root / "base", "llama", vocab_size=vocab, hidden_size=32)
    return str(root / "base"), write_jsonl(root / "chats.jsonl", [{"messages": m} for m in conversations(40, seed=3)])


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_chat_recipe_end_to_end_and_export_keeps_the_template(tmp_path, capfd, monkeypatch) -> None:
    """README's three commands, a base model given the recipe's template: `ultrascale fit --config
    recipes/hf_chat.yaml` (ZeRO-3 over 2), then `export-hf`; the exported tokenizer renders with that template."""
    from tests._cli import run_main
    from tests.test_hf import FORKED_ZERO3

    source, data = _base_model_with_data(tmp_path)
    (tmp_path / "chatml.jinja").write_text(CHATML_MARKED)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(
        capfd, "fit", "--config", str(RECIPE), "--model.pretrained_path", source, "--data.data_path", data,
        "--data.init_args.chat_template", str(tmp_path / "chatml.jinja"), "--data.init_args.seq_len", "64",
        "--data.init_args.global_batch_size", "4", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
        "--trainer.callbacks.init_args.every_n_train_steps", "4", "--trainer.log_every_n_steps", "1", *FORKED_ZERO3)
    assert code == 0, (out + err)[-3000:]
    events = b"".join(f.read_bytes() for f in (tmp_path / "runs" / "hf_chat" / "version_0").glob("events.out.tfevents*"))
    assert b"val_loss" in events and b"train_loss" in events
    code, out, err = run_main(capfd, "export-hf", "--checkpoint", "runs/hf_chat", "--out", str(tmp_path / "out"))
    assert code == 0, (out + err)[-3000:]
    exported = hf_tokenizer(str(tmp_path / "out"))
    assert exported.chat_template == CHATML_MARKED
    messages = conversations(1)[0]
    assert exported.apply_chat_template(messages, tokenize=False) == hf_tokenizer(
        save_chat_tokenizer(tmp_path / "ref", CHATML_MARKED)).apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "robot", "content": "a"}]}, "field `messages[0]`.role is 'robot'"),
    ({"prompt": "a", "response": "b"}, "field `messages` is missing"),
])
def test_a_bad_record_is_one_message_before_any_rank_starts(tmp_path, capfd, record, message) -> None:
    """`ultrascale fit` on 2 ranks: exit 2, one line naming file, line and field, no traceback, no run folder."""
    from tests._cli import run_main
    from tests.test_hf import FORKED_ZERO3

    source, data = _base_model_with_data(tmp_path)
    lines = Path(data).read_text().splitlines()
    bad = write_jsonl(tmp_path / "bad.jsonl", [json.loads(line) for line in lines[:3]] + [record])
    code, out, err = run_main(
        capfd, "fit", "--config", str(RECIPE), "--model.pretrained_path", source, "--data.data_path", bad,
        "--data.init_args.chat_template", CHATML_MARKED, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        *FORKED_ZERO3)
    assert code == 2, (out + err)[-3000:]
    assert f"ultrascale fit: error: {bad}:4: {message}" in err, err
    assert "Traceback" not in err and "[rank" not in err
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- prepared once

def test_prepared_conversations_give_the_raw_blocks(tmp_path, folders, chats, capsys) -> None:
    """`ultrascale prepare-data --chat` (one worker or two: the same bytes) then InstructionDataModule on the folder:
    the blocks of the raw JSONL, at every seq_len and learn option (cut and selected when read)."""
    from tests._cli import run_main

    for workers in ("1", "2"):
        code, out, err = run_main(capsys, "prepare-data", folders["data"], "--tokenizer", folders["llama3"], "--chat",
                                  "--out", str(tmp_path / f"prepared{workers}"), "--workers", workers, "--no-progress")
        assert code == 0, err
        assert f"{len(chats)} conversations" in out
    for name in ("tokens.bin", "assistant.bin", "documents.npy"):
        assert (tmp_path / "prepared1" / name).read_bytes() == (tmp_path / "prepared2" / name).read_bytes()
    for options in ({}, {"learn": "last", "seq_len": 48}, {"learn_end_of_turn": False}, {"learn": "all", "pack": False}):
        raw = dm_for(folders["data"], folders["llama3"], **options)
        prepared = dm_for(str(tmp_path / "prepared1"), folders["llama3"], **options)
        for dm in (raw, prepared):
            dm.setup()
        assert (raw.packed.labels == prepared.packed.labels).all() and (raw.packed.input_ids == prepared.packed.input_ids).all()
        assert (raw.packed.position_ids == prepared.packed.position_ids).all()
    assert prepared.hparams["chat_template"] == LLAMA3

    with pytest.raises(ValueError, match="is not the tokenizer .* was prepared with"):
        dm_for(str(tmp_path / "prepared1"), folders["marked"]).setup()
    with pytest.raises(ValueError, match="differs from the one .* was rendered with"):
        dm_for(str(tmp_path / "prepared1"), folders["llama3"], chat_template=CHATML).setup()
    from ultrascale.data import CausalLMDataModule

    with pytest.raises(ValueError, match="holds prepared conversations"):
        CausalLMDataModule(data_path=str(tmp_path / "prepared1"), seq_len=16).setup()

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": chats[0]}, {"messages": [{"role": "user", "content": 3}]}])
    code, out, err = run_main(capsys, "prepare-data", bad, "--tokenizer", folders["llama3"], "--chat",
                              "--out", str(tmp_path / "never"), "--no-progress")
    assert code == 2 and f"ultrascale prepare-data: error: {bad}:2: field `messages[0]`.content must be a string" in err, err
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never*"))


# --------------------------------------------------------------------------- padded to the batch

def test_pad_to_longest_cuts_each_batch_to_its_content(folders) -> None:
    """Unpacked blocks of known lengths: the batch is cut to its longest, rounded up to the multiple, capped."""
    from ultrascale.data.collate import PadToLongest
    from ultrascale.data.instruct import pack_examples

    examples = [(np.arange(n + 1), 1) for n in (5, 9, 3, 12)]  # inputs of 5, 9, 3, 12 positions
    packed = pack_examples(examples, seq_len=16, pad_id=0, pack=False)
    rows = [{"input_ids": torch.from_numpy(packed.input_ids[i].astype(np.int64)),
             "labels": torch.from_numpy(packed.labels[i].astype(np.int64)),
             "position_ids": torch.from_numpy(packed.position_ids[i].astype(np.int64))} for i in range(4)]
    assert PadToLongest(1, 16)(rows[:3])["input_ids"].shape == (3, 9)
    assert PadToLongest(4, 16)(rows[:3])["labels"].shape == (3, 12)
    assert PadToLongest(8, 16)(rows[2:3])["position_ids"].shape == (1, 8)
    assert PadToLongest(8, 16)(rows)["input_ids"].shape == (4, 16)  # 12 rounds to 16
    assert PadToLongest(5, 16)(rows)["input_ids"].shape == (4, 15)
    assert [PadToLongest(2, 16, buckets=True)(rows[i : i + 1])["input_ids"].shape[1] for i in range(4)] == [8, 16, 4, 16]
    cut = PadToLongest(1, 16)(rows)
    assert (cut["labels"] == torch.stack([r["labels"] for r in rows])[:, :12]).all()


def test_padding_free_lays_the_rows_end_to_end(folders) -> None:
    """Rows of known content (5, 9, 3, 12 positions; one packed row of 4 + 6) become one row of their sum, rounded up
    to the multiple by a tail that is a document of its own without a target; positions restart at every example."""
    from ultrascale.data.collate import PaddingFree
    from ultrascale.data.instruct import pack_examples

    def rows_of(packed):
        return [{key: torch.from_numpy(getattr(packed, key)[i].astype(np.int64))
                 for key in ("input_ids", "labels", "position_ids")} for i in range(packed.num_blocks)]

    rows = rows_of(pack_examples([(np.arange(n + 1) + 10, 1) for n in (5, 9, 3, 12)], seq_len=16, pad_id=0, pack=False))
    flat = PaddingFree(1, 16, pad_id=0)(rows)
    assert set(flat) == {"input_ids", "labels", "position_ids"} and flat["input_ids"].shape == (1, 29)
    expected = torch.cat([torch.arange(n) for n in (5, 9, 3, 12)])
    assert torch.equal(flat["position_ids"][0], expected)
    assert torch.equal(flat["input_ids"][0], expected + 10)
    assert torch.equal(flat["labels"][0], torch.cat([torch.arange(1, n + 1) + 10 for n in (5, 9, 3, 12)]))
    padded = PaddingFree(8, 16, pad_id=7)(rows)
    assert padded["input_ids"].shape == (1, 32)
    assert padded["input_ids"][0, 29:].tolist() == [7, 7, 7] and padded["labels"][0, 29:].tolist() == [-100] * 3
    assert padded["position_ids"][0, 29:].tolist() == [0, 1, 2]
    assert PaddingFree(2, 16, pad_id=0, buckets=True)(rows)["input_ids"].shape == (1, 32)  # 29 -> 2 x 16
    assert PaddingFree(5, 8, pad_id=0)(rows[:2])["input_ids"].shape == (1, 15)  # 14 -> 15, under the cap of 16
    two = rows_of(pack_examples([(np.arange(n + 1), 1) for n in (4, 6, 9)], seq_len=12, pad_id=0, pack=True))
    assert [len(e) for e in pack_examples([(np.arange(n + 1), 1) for n in (4, 6, 9)], 12, 0).examples] == [2, 1]
    assert PaddingFree(1, 12, pad_id=0)(two)["position_ids"][0].tolist() == [*range(4), *range(6), *range(9)]


def test_padding_free_is_the_default_where_the_model_attends_within_documents(folders) -> None:
    """padding_free=None: on for a module that declares `attends_within_documents` (LlamaLM, HFCausalLM), off for
    one that does not, under pipeline parallel and with pad_to="seq_len"; True under pipeline parallel and True with
    pad_to="seq_len" are refused, the first by the rulebook before launch."""
    from types import SimpleNamespace

    from ultrascale.data.collate import PaddingFree, PadToLongest
    from ultrascale.parallel.dims import ParallelDims
    from ultrascale.parallel.rules import batch_problems

    def collate(layout, module, **kwargs):
        dm = dm_for(folders["data"], folders["marked"], pack=False, **kwargs)
        dm.trainer = SimpleNamespace(strategy=_Layout(*layout), lightning_module=module)
        return dm.collate_fn()

    declares = SimpleNamespace(attends_within_documents=True)
    assert isinstance(collate((1, "any"), declares), PaddingFree)
    assert collate((4, "buckets"), declares).multiple == 4 and collate((4, "buckets"), declares).buckets
    assert isinstance(collate((1, "any"), SimpleNamespace()), PadToLongest)
    assert isinstance(collate((1, "any"), SimpleNamespace(), padding_free=True), PaddingFree)
    assert isinstance(collate((1, "any"), declares, padding_free=False), PadToLongest)
    assert collate((1, "static"), declares) is None
    with pytest.raises(ValueError, match="padding_free=True. under pipeline parallel"):
        collate((1, "static"), declares, padding_free=True)
    with pytest.raises(ValueError, match="choose one"):
        dm_for(folders["data"], folders["marked"], padding_free=True, pad_to="seq_len")
    [problem] = batch_problems(ParallelDims.resolve(2, pp=2, dp_shard=1), padding_free=True, where="Chat")
    assert "Chat(padding_free=True)" in problem.message and "pp=2" in problem.message


def test_hf_models_declare_documents_apart_except_those_whose_masks_ignore_positions(tmp_path) -> None:
    """HFCausalLM declares `attends_within_documents` from its config: GPT-OSS builds its masks without
    `position_ids` (its packed documents would see each other), so its batches stay rows."""
    import transformers

    from tests._parity import make_hf_checkpoint
    from ultrascale.models.hf import HFCausalLM, hf_attends_within_documents
    from ultrascale.models.lm import LlamaLM

    llama = make_hf_checkpoint(tmp_path / "llama", "llama", vocab_size=64, hidden_size=32)
    assert HFCausalLM(str(llama)).attends_within_documents is True and LlamaLM.attends_within_documents is True
    assert hf_attends_within_documents(transformers.GptOssConfig()) is False
    assert hf_attends_within_documents(transformers.Qwen2Config()) is True


class _Layout:
    """A strategy's `batch_length_rule` and device, for the data module's collate."""

    def __init__(self, multiple: int, static: bool) -> None:
        self.rule, self.root_device = (multiple, static), torch.device("cpu")

    def batch_length_rule(self):
        return self.rule


@pytest.mark.parametrize("layout, expected", [((1, "any"), 1), ((4, "any"), 4), ((2, "any"), 2), ((1, "static"), None),
                                              ((4, "buckets"), 4)])
def test_padded_length_follows_the_layout(folders, layout, expected) -> None:
    """cp 2 (zig-zag: 2 x cp = 4), tp 2 under sequence parallel (2), pipeline stages (one shape: seq_len),
    compile (power-of-two buckets of the multiple)."""
    from types import SimpleNamespace

    dm = dm_for(folders["data"], folders["marked"], pack=False)
    dm.trainer = SimpleNamespace(strategy=_Layout(*layout))
    collate = dm.collate_fn()
    assert (collate is None) if expected is None else (collate.multiple, collate.buckets) == (expected, layout[1] == "buckets")
    assert dm_for(folders["data"], folders["marked"], pad_to="seq_len").collate_fn() is None
    custom = dm_for(folders["data"], folders["marked"], pad_to_multiple_of=6)
    custom.trainer = SimpleNamespace(strategy=_Layout(*layout))
    assert expected is None or custom.collate_fn().multiple == np.lcm(6, expected)
    half = dm_for(folders["data"], folders["marked"], pack=False)
    half.trainer = SimpleNamespace(strategy=_Layout(*layout), precision="bf16-mixed")
    assert expected is None or half.collate_fn().multiple == np.lcm(CPU_HALF_SEQUENCE_MULTIPLE, expected)


def test_the_device_default_multiple_follows_the_compute_dtype() -> None:
    """CUDA 8 in any precision; CPU 1 in fp32/fp64 and CPU_HALF_SEQUENCE_MULTIPLE in bf16/fp16 (oneDNN's kernel per
    shape), read from Lightning's precision names."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    dtypes = {name: compute_dtype(name) for name in ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "64-true")}
    assert dtypes == {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                      "16-mixed": torch.float16, "64-true": torch.float64}
    half = CPU_HALF_SEQUENCE_MULTIPLE
    assert [sequence_length_multiple(cpu, d) for d in dtypes.values()] == [1, half, half, half, 1]
    assert {sequence_length_multiple(cuda, d) for d in dtypes.values()} == {8}


MIXED_LAYOUTS = {
    "ZeRO-3": {"data_parallel_shard": 2},
    "ZeRO-3, rows padded to the longest": {"data_parallel_shard": 2},
    "TP 2 + SP": {"tensor_parallel": 2, "data_parallel_shard": 1},
    "CP 2": {"context_parallel": 2, "data_parallel_shard": 1},
    "PP 2": {"pipeline_parallel": 2, "pipeline_microbatches": 2, "data_parallel_shard": 1},
}


def _unpacked_chats(root):
    tokenizer = save_chat_tokenizer(root / "tok", CHATML_MARKED, "<|im_end|>")
    data = write_jsonl(root / "chats.jsonl", [{"messages": m} for m in conversations(100, seed=11, max_words=4)])
    return tokenizer, data


def _train_unpacked(rank, world_size, path, tokenizer, data, strategy_kwargs, padding_free):
    import ultrascale
    from tests._parity import Recorder, make_hf, parity_trainer

    recorder, lengths = Recorder(), []
    dm = dm_for(data, tokenizer, seq_len=PARITY_SEQ, global_batch_size=4, pack=False, padding_free=padding_free)

    class Lengths(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            lengths.append(tuple(batch["input_ids"].shape))

    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, PARITY_STEPS,
                             accumulate_grad_batches=2)
    trainer.callbacks.append(Lengths())
    trainer.fit(make_hf(path), dm)
    return {**recorder.result(), "lengths": lengths}


@pytest.mark.parametrize("layout", list(MIXED_LAYOUTS))
def test_batches_of_mixed_lengths_train_like_one_process(layout, tmp_path) -> None:
    """Unpacked conversations, each micro-batch's rows laid end to end (padding-free, the default: one row whose
    length differs per rank and micro-batch) or cut to its own longest; pipeline stages keep rows of seq_len;
    accumulation 2: the inline one-process reference on the same global batches at full seq_len, one row per
    conversation, which neither can change."""
    from torch.utils.data import Subset

    from tests._dist import run_ranks
    from tests._parity import assert_parity, make_hf, make_hf_checkpoint, merge_stages, reference_run, step_losses
    from ultrascale.data import ResumableBlockSampler

    tokenizer, data = _unpacked_chats(tmp_path)
    dm = dm_for(data, tokenizer, seq_len=PARITY_SEQ, global_batch_size=4, pack=False)
    dm.setup()
    path = make_hf_checkpoint(tmp_path / "llama", "llama", vocab_size=dm.vocab_size, hidden_size=32)
    order = list(ResumableBlockSampler(dm.train_dataset, 4, num_replicas=1, rank=0, shuffle=True, seed=dm.seed))
    reference = reference_run(make_hf(path), Subset(dm.train_dataset, order), global_batch=4, steps=PARITY_STEPS,
                              accumulate=2)
    padded = layout.endswith("longest")
    results = run_ranks(_train_unpacked, 2, path, tokenizer, data, MIXED_LAYOUTS[layout], False if padded else None)
    shapes = [shape for result in results for shape in result["lengths"]]
    lengths = [length for _, length in shapes]
    # A rank's micro-batch: 2 rows (4 under TP, CP and PP: one data-parallel rank) of seq_len or less, or one row of
    # at most all of them.
    rows = 2 if layout.startswith("ZeRO") else 4
    if layout.startswith("PP"):
        assert set(shapes) == {(rows, PARITY_SEQ)}, shapes
    elif padded:
        assert {b for b, _ in shapes} == {rows} and len(set(lengths)) > 2 and max(lengths) <= PARITY_SEQ, shapes
    else:
        assert {b for b, _ in shapes} == {1} and len(set(lengths)) > 2 and max(lengths) <= rows * PARITY_SEQ, shapes
        if layout.startswith("CP"):  # a rank sees its half, of a length the 4 zig-zag chunks divide
            assert all((2 * length) % 4 == 0 for length in lengths), lengths
    assert_parity(merge_stages(results) if layout.startswith("PP") else results[0], reference, step_losses(results))


def test_group_by_length_batches_similar_lengths_deterministically(folders) -> None:
    """The same blocks each epoch, in seeded windows sorted longest first (every rank's slice of a global batch
    alike), resumable mid-epoch; fewer padded positions under pad_to="longest"; `shuffle=False` keeps file order."""
    from types import SimpleNamespace

    from tests.test_instruct_data import _fake_trainer
    from ultrascale.data import ResumableBlockSampler

    def batches(dm, **layout):
        dm.trainer = _fake_trainer(**layout)
        dm.trainer.strategy.root_device = torch.device("cpu")
        return [b for b in dm.train_dataloader()]

    grouped = dm_for(folders["data"], folders["marked"], pack=False, group_by_length=True, global_batch_size=4)
    plain = dm_for(folders["data"], folders["marked"], pack=False, global_batch_size=4)
    for dm in (grouped, plain):
        dm.setup()
    lengths = grouped.train_dataset.lengths
    sampler = ResumableBlockSampler(grouped.train_dataset, 4, seed=grouped.seed, lengths=lengths)
    order = sampler.global_batches().reshape(-1)
    assert sorted(order.tolist()) == sorted(ResumableBlockSampler(plain.train_dataset, 4, seed=plain.seed)
                                            .global_batches().reshape(-1).tolist())
    assert (lengths[order][:-1] >= lengths[order][1:]).all()  # one window here: longest first
    assert torch.equal(order, ResumableBlockSampler(grouped.train_dataset, 4, seed=grouped.seed, lengths=lengths)
                       .global_batches().reshape(-1))
    resumed = ResumableBlockSampler(grouped.train_dataset, 4, seed=grouped.seed, lengths=lengths, skip_batches=2)
    assert list(resumed) == order[8:].tolist()
    computed = {name: sum(b["input_ids"].numel() for b in batches(dm)) for name, dm in (("grouped", grouped), ("plain", plain))}
    assert computed["grouped"] < computed["plain"], computed
    two = [batches(grouped, num_replicas=2, rank=r) for r in (0, 1)]
    assert sum(b["input_ids"].shape[0] for rank in two for b in rank) == len(order)
    in_order = dm_for(folders["data"], folders["marked"], pack=False, shuffle=False, global_batch_size=4)
    in_order.setup()
    in_order.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=None, root_device=torch.device("cpu")))
    assert list(in_order.train_dataloader().sampler) == list(range(len(in_order.train_dataset)))
