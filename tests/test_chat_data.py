"""Conversations through the chat template (ultrascale.data.chat via InstructionDataModule): the labels are -100
exactly outside the assistant turns, packed and not, for a template with generation markers (checked against
transformers' `return_assistant_tokens_mask`) and templates without (each learned run decoded back to the assistant's
words); the options, truncation by whole turns, the three input kinds, and the errors, each naming its record.

Single process and offline: a tiny BPE tokenizer with the templates' special tokens is trained in a temp folder.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ultrascale.data import InstructionDataModule
from ultrascale.data.instruct import IGNORE_INDEX

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
