"""Instruction data for supervised fine-tuning: prompt/response pairs, loss masked on the prompt, or conversations
rendered with the chat template, loss on the assistant turns (:mod:`ultrascale.data.chat`).

Each example becomes one token sequence::

    ids    = [bos?] + tokenize(template(prompt)) + tokenize(response) + [eos]
    input  = ids[:-1]
    labels = ids[1:], with -100 wherever the target token belongs to the prompt

so only the response tokens and the final EOS are learned. Labels are built per
example *before* packing; when several examples share a block, the last position
of example A keeps A's own target (its EOS) and the first token of example B is
never a target of anything. No label crosses a document boundary.

Examples are packed whole into blocks of ``seq_len`` positions (next-fit, in data
order), the rest of a block padded with labels -100. The blocks then follow
exactly the layout of :class:`~ultrascale.data.datamodule.CausalLMDataModule`
(both derive from :class:`~ultrascale.data.sampling.BlockDataModule`): validation
blocks from the end, :class:`ResumableBlockSampler` global batches (identical at
any dp size), and the same mid-epoch resume state.

Batches also carry ``position_ids`` restarting at 0 at every example, from which the
models keep each example's attention to itself (`ultrascale.parallel.documents`), so a
packed or padding-free row computes what each example alone would.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from ultrascale.contract import attends_within_documents
from ultrascale.data.chat import (
    LEARN,
    TRUNCATION,
    ChatCounts,
    ChatEncoder,
    Conversation,
    conversation_of,
    learned_tokens,
    resolve_chat_template,
)
from ultrascale.data.collate import PaddingFree, PadToLongest
from ultrascale.data.errors import DataError
from ultrascale.data.prepared import PreparedTokens, is_prepared, tokenizer_fingerprint
from ultrascale.data.records import read_records
from ultrascale.data.sampling import BlockDataModule, split_blocks
from ultrascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from ultrascale.parallel.device import compute_dtype, sequence_length_multiple
from ultrascale.parallel.loss import IGNORE_INDEX, content_lengths

__all__ = [
    "InstructionBlockDataset", "InstructionDataModule", "PackedBlocks", "pack_examples", "read_examples", "read_records",
]

PAD_TO = ("longest", "seq_len")


# Files that make a folder loadable by `AutoTokenizer` (fast, sentencepiece, BPE vocab, config).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


# --------------------------------------------------------------------------- reading


def _fields_of(record: dict[str, Any], fields: tuple[str, str], where: str) -> tuple[str, str]:
    for name in fields:
        if name not in record:
            raise DataError(f"{where}: field `{name}` is missing; fields present: {sorted(record)}")
    return _check_strings((record[fields[0]], record[fields[1]]), fields, where)


def _check_strings(pair: tuple[Any, Any], fields: tuple[str, str], where: str) -> tuple[str, str]:
    for name, value in zip(fields, pair):
        if not isinstance(value, str):
            raise DataError(f"{where}: field `{name}` must be a string, got {type(value).__name__}")
    return pair


def read_examples(
    data_path: str, prompt_field: str = "prompt", response_field: str = "response"
) -> Iterator[tuple[str, str]]:
    """Yield ``(prompt, response)`` strings from the records of `data_path` (:func:`read_records`)."""
    fields = (prompt_field, response_field)
    return (_fields_of(record, fields, where) for where, record in read_records(data_path))


# --------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class PackedBlocks:
    """Fixed-length blocks of whole examples, ready to batch."""

    input_ids: np.ndarray
    """``(num_blocks, seq_len)`` int32 model inputs; the tail of each block is the pad id."""
    labels: np.ndarray
    """``(num_blocks, seq_len)`` int32 targets of ``input_ids`` (already shifted); -100 = no loss."""
    position_ids: np.ndarray
    """``(num_blocks, seq_len)`` int32 position of each input within its own example (0 at every
    example start, and at the start of the padding), so attention and RoPE can treat every
    example as if it were alone in its block (models derive a per-document causal mask from it)."""
    examples: list[list[int]]
    """Per block, the indices (into the ``examples`` argument) of the examples it holds, in order."""
    num_truncated: int
    """Examples longer than ``seq_len`` whose response tail was cut (including the dropped ones)."""
    num_dropped: int
    """Truncated examples left without a single response token (the prompt alone fills a block)."""
    num_empty: int
    """Examples of fewer than two tokens: nothing to predict."""
    num_tokens: int
    """Block positions holding example tokens (the rest is padding)."""

    @property
    def num_blocks(self) -> int:
        return self.input_ids.shape[0]

    @property
    def density(self) -> float:
        """Fraction of block positions that hold example tokens, not padding."""
        return self.num_tokens / self.input_ids.size if self.input_ids.size else 0.0


def pack_examples(
    examples: Sequence[tuple[Sequence[int], int | np.ndarray]], seq_len: int, pad_id: int, *, pack: bool = True
) -> PackedBlocks:
    """Turn tokenized examples into blocks of ``seq_len`` inputs with masked, shifted labels.

    Args:
        examples: ``(ids, learned)`` per example: ``ids`` is the whole sequence
            (BOS if any, prompt, response, EOS); ``learned`` is either the number
            of leading prompt ids, whose positions are never targets, or a bool
            array over ``ids`` saying which ids are targets (a conversation's
            assistant turns, :class:`~ultrascale.data.chat.ChatEncoder`).
        seq_len: Input positions per block.
        pad_id: Input id of the padding (its labels are -100).
        pack: Put as many whole examples as fit in a block, next-fit in the given
            order; ``False`` gives every example its own block.

    An example of more than ``seq_len + 1`` ids keeps its first ``seq_len + 1``
    (the head of the prompt; the response tail and the EOS are cut). One that is
    then left with no response target is dropped.
    """
    if seq_len < 1:
        raise ValueError(f"pack_examples: `seq_len={seq_len}` must be >= 1")
    segments: list[tuple[int, np.ndarray, np.ndarray]] = []  # (example index, input, labels)
    num_truncated = num_dropped = num_empty = 0
    for index, (ids, learned) in enumerate(examples):
        ids = np.asarray(ids, dtype=np.int32)
        if isinstance(learned, (int, np.integer)):
            learned = np.arange(ids.size) >= learned
        if ids.size < 2:
            num_empty += 1
            continue
        if ids.size - 1 > seq_len:
            ids, learned = ids[: seq_len + 1], learned[: seq_len + 1]
            num_truncated += 1
        labels = ids[1:].copy()
        # labels[j] is ids[j + 1]: a target only where ids[j + 1] is learned.
        labels[~learned[1:]] = IGNORE_INDEX
        if (labels == IGNORE_INDEX).all():
            num_dropped += 1
            continue
        segments.append((index, ids[:-1], labels))

    # Next-fit: close the block as soon as the next example does not fit in it.
    blocks: list[list[int]] = []  # segment positions per block
    fill = seq_len + 1  # forces a new block for the first segment
    for s, (_, inputs, _) in enumerate(segments):
        if not pack or fill + inputs.size > seq_len:
            blocks.append([])
            fill = 0
        blocks[-1].append(s)
        fill += inputs.size

    input_ids = np.full((len(blocks), seq_len), pad_id, dtype=np.int32)  # (num_blocks, seq_len)
    labels = np.full((len(blocks), seq_len), IGNORE_INDEX, dtype=np.int32)  # (num_blocks, seq_len)
    position_ids = np.zeros((len(blocks), seq_len), dtype=np.int32)  # (num_blocks, seq_len)
    for b, block in enumerate(blocks):
        pos = 0
        for s in block:
            _, seg_in, seg_lab = segments[s]
            input_ids[b, pos : pos + seg_in.size] = seg_in
            labels[b, pos : pos + seg_in.size] = seg_lab
            position_ids[b, pos : pos + seg_in.size] = np.arange(seg_in.size)
            pos += seg_in.size
        position_ids[b, pos:] = np.arange(seq_len - pos)  # the padding is a document of its own
    return PackedBlocks(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        examples=[[segments[s][0] for s in block] for block in blocks],
        num_truncated=num_truncated,
        num_dropped=num_dropped,
        num_empty=num_empty,
        num_tokens=sum(seg_in.size for _, seg_in, _ in segments),
    )


class InstructionBlockDataset(Dataset):
    """Rows of packed blocks as ``{"input_ids", "labels", "position_ids"}``, each ``(seq_len,)`` int64.

    Args:
        input_ids: ``(num_blocks, seq_len)`` model inputs.
        labels: ``(num_blocks, seq_len)`` shifted targets, -100 where there is no loss.
        position_ids: ``(num_blocks, seq_len)`` positions within each example (None: 0..seq_len-1).
    """

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray | None = None) -> None:
        if input_ids.shape != labels.shape or input_ids.ndim != 2:
            raise ValueError(
                f"{type(self).__name__}: `input_ids` {input_ids.shape} and `labels` {labels.shape} must be "
                "equal (num_blocks, seq_len) shapes"
            )
        self.input_ids = input_ids
        self.labels = labels
        self.position_ids = position_ids if position_ids is not None else np.broadcast_to(
            np.arange(input_ids.shape[1], dtype=np.int32), input_ids.shape
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """``(num_blocks,)`` positions of each block that are not padding (`parallel.loss.content_lengths`)."""
        if getattr(self, "_lengths", None) is None:
            self._lengths = content_lengths(torch.from_numpy(np.ascontiguousarray(self.position_ids, dtype=np.int64)),
                                            torch.from_numpy(self.labels.astype(np.int64)))
        return self._lengths

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        return {
            "input_ids": torch.from_numpy(self.input_ids[index].astype(np.int64)),
            "labels": torch.from_numpy(self.labels[index].astype(np.int64)),
            "position_ids": torch.from_numpy(self.position_ids[index].astype(np.int64)),
        }


# --------------------------------------------------------------------------- data module


class InstructionDataModule(BlockDataModule):
    """Supervised fine-tuning data: prompt/response pairs (loss on the response) or conversations through the chat
    template (loss on the assistant turns, :mod:`ultrascale.data.chat`), packed.

    Every rank reads and tokenizes the data itself in :meth:`setup` (deterministic,
    no cache to share). Batches are ``{"input_ids", "labels", "position_ids"}``, ``(B, T)`` rows
    cut to their longest (T <= seq_len) or one padding-free ``(1, T)`` row (`padding_free`), with labels
    already shifted and -100 on prompt targets and padding, the format of ``LlamaLM`` and the Hugging Face module. Layout, split,
    shuffling and resume are those of :class:`CausalLMDataModule`: both inherit
    them from :class:`BlockDataModule`.

    Tokenization: the templated prompt and the response are encoded separately,
    without special tokens, so the prompt/response boundary is exact; EOS is
    appended. If the tokenizer has a BOS token *and* adds it by itself (e.g.
    Llama's), one BOS starts every example (a prompt token: never a target).
    Encoding the response on its own can differ from encoding it inside the full
    text at the seam (e.g. SentencePiece's leading-space marker); the model sees
    the separately encoded form at training time.

    Args:
        data_path: A ``.jsonl`` file (one JSON object per line), a folder of
            ``*.jsonl`` files (sorted by name), or a folder written by
            ``datasets.Dataset.save_to_disk`` (its ``train`` split for a ``DatasetDict``).
        tokenizer_path: Local folder of a Hugging Face tokenizer, usually the
            checkpoint folder; read offline with ``AutoTokenizer``. Needs an EOS token.
            ``None``: the LightningModule's ``tokenizer_path`` (``HFCausalLM`` points
            it at its checkpoint folder), so a fine-tuning recipe names the folder once.
        prompt_field: Field (column) holding the prompt.
        response_field: Field (column) holding the response to learn.
        prompt_template: Format string applied to the prompt, with one ``{prompt}``
            placeholder, e.g. ``"### Instruction:\\n{prompt}\\n### Response:\\n"``;
            the whole result is masked. Write literal braces as ``{{`` and ``}}``.
        seq_len: Input positions per block; longer examples are truncated (response
            tail cut, counted and warned about).
        global_batch_size: Blocks per micro-step summed over all data-parallel
            ranks; must be divisible by the data-parallel size.
        pack: Pack several whole examples per block (next-fit, data order);
            ``False`` puts one example per block.
        val_fraction: Fraction of blocks (taken from the end) held out for
            validation; 0 disables validation.
        seed: Seed of the per-epoch shuffle of blocks (epoch ``e`` uses ``seed + e``).
        num_workers: DataLoader worker processes; 0 loads in the main process.
        max_examples: Read at most this many examples (in file order); ``None`` reads all.
        messages_field: Field (column) of a conversation: a list of ``{"role", "content"}``
            messages (:mod:`ultrascale.data.chat`). The first record decides: a data set is
            all conversations (this field, or TRL's prompt-completion message lists) or all
            prompt/response pairs.
        chat_template: The Jinja chat template conversations are rendered with (its text, or a
            file holding it); ``None``: the tokenizer's own. Kept in the checkpoint, and
            ``export-hf`` writes it into the exported tokenizer.
        learn: Which tokens of a conversation carry the loss: ``"assistant"`` (every assistant
            turn), ``"last"`` (the last assistant turn), ``"all"`` (system and user turns too).
        learn_end_of_turn: Learn the end-of-turn token with its turn.
        end_of_turn: The template's end-of-turn token (e.g. ``"<|im_end|>"``); ``None``: the
            tokenizer's EOS.
        pad_to: ``"longest"``: each batch is cut to its longest row's content, rounded up
            (:class:`PadToLongest`), so the padding after a block's last example is never
            computed; ``"seq_len"``: every batch is ``seq_len`` long (static shapes). Under
            pipeline parallel batches are ``seq_len`` long either way; under ``compile=True``
            lengths are rounded up to a power of two of the multiple (a few shapes to compile).
        pad_to_multiple_of: The rounding of ``"longest"``; ``None``: the device's
            (``parallel.device.sequence_length_multiple``: 8 on CUDA; on CPU 64 in bf16/fp16, 1 in
            fp32). Always also a multiple of what the layout splits a sequence by (``2 x cp``, ``tp``
            under sequence parallel).
        padding_free: Lay the rows of each batch end to end in one row, each cut to its content
            (:class:`PaddingFree`; TRL's ``padding_free``): no position of a batch is padding but the
            rounding at its end, and each example attends to itself alone (the positions restart
            at 0 where it starts). ``None`` (default): on where the model declares it attends
            within documents (`ultrascale.contract.ModuleContract.attends_within_documents`:
            ``LlamaLM``, ``HFCausalLM``) and the layout takes batches of any shape, i.e. not under
            pipeline parallel (its micro-batches split the batch's rows and its stages keep one
            shape) nor with ``pad_to="seq_len"``; ``True``: always (refused under pipeline parallel
            and with ``pad_to="seq_len"``); ``False``: rows stay rows, padded by ``pad_to``.
        group_by_length: Draw each global batch from blocks of similar length (windows of
            :attr:`~ultrascale.data.sampling.ResumableBlockSampler.GROUP_WINDOW` global batches of the
            epoch's order, sorted longest first), so ``pad_to="longest"`` pads little; off by default.
        shuffle: Permute the blocks each epoch (seeded); ``False`` trains in file order.
        truncation: A conversation longer than ``seq_len + 1`` tokens: ``"drop_turns"`` cuts it
            after its last assistant turn that fits (skipped, and counted in one warning, when
            none does); ``"error"`` refuses it, naming the record.
    """

    train_dataset: InstructionBlockDataset | None
    val_dataset: InstructionBlockDataset | None

    def __init__(
        self,
        data_path: str,
        tokenizer_path: str | None = None,
        prompt_field: str = "prompt",
        response_field: str = "response",
        prompt_template: str = "{prompt}",
        seq_len: int = 512,
        global_batch_size: int = 8,
        pack: bool = True,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        max_examples: int | None = None,
        messages_field: str = "messages",
        chat_template: str | None = None,
        learn: str = "assistant",
        learn_end_of_turn: bool = True,
        end_of_turn: str | None = None,
        truncation: str = "drop_turns",
        pad_to: str = "longest",
        pad_to_multiple_of: int | None = None,
        group_by_length: bool = False,
        shuffle: bool = True,
        padding_free: bool | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if seq_len < 1:
            raise ValueError(f"{name}: `seq_len={seq_len}` must be >= 1")
        if global_batch_size < 1:
            raise ValueError(f"{name}: `global_batch_size={global_batch_size}` must be >= 1")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"{name}: `val_fraction={val_fraction}` must be in [0, 1)")
        if num_workers < 0:
            raise ValueError(f"{name}: `num_workers={num_workers}` must be >= 0")
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"{name}: `max_examples={max_examples}` must be >= 1 or None (all)")
        if prompt_field == response_field:
            raise ValueError(f"{name}: `prompt_field` and `response_field` are both {prompt_field!r}")
        _check_template(name, prompt_template)
        if learn not in LEARN:
            raise ValueError(f"{name}: `learn={learn!r}` must be one of {', '.join(LEARN)}")
        if truncation not in TRUNCATION:
            raise ValueError(f"{name}: `truncation={truncation!r}` must be one of {', '.join(TRUNCATION)}")
        if pad_to not in PAD_TO:
            raise ValueError(f"{name}: `pad_to={pad_to!r}` must be one of {', '.join(PAD_TO)}")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"{name}: `pad_to_multiple_of={pad_to_multiple_of}` must be >= 1 or None (the device's)")
        if padding_free and pad_to == "seq_len":
            raise ValueError(f"{name}: `padding_free=True` lays a batch's rows end to end, `pad_to='seq_len'` keeps "
                             "every row seq_len long: choose one")
        if chat_template is not None:
            chat_template = resolve_chat_template(chat_template, None, str(tokenizer_path))  # a missing file: now
        self.save_hyperparameters()
        self.hparams["chat_template"] = chat_template  # the text, never the file: the checkpoint carries it
        self.data_path = data_path
        self.tokenizer_path = tokenizer_path
        self.prompt_field = prompt_field
        self.response_field = response_field
        self.prompt_template = prompt_template
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.pack = pack
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.max_examples = max_examples
        self.messages_field = messages_field
        self.chat_template = chat_template
        self.learn = learn
        self.learn_end_of_turn = learn_end_of_turn
        self.end_of_turn = end_of_turn
        self.truncation = truncation
        self.pad_to = pad_to
        self.pad_to_multiple_of = pad_to_multiple_of
        self.group_by_length = group_by_length
        self.shuffle = shuffle
        self.padding_free = padding_free
        # Loaded eagerly when the path is known (errors surface at construction), otherwise
        # on first use from the LightningModule's `tokenizer_path`.
        self._tokenizer: HFTokenizer | ByteTokenizer | None = None
        self._checked_before_launch = False
        if tokenizer_path is not None:
            self._set_tokenizer(tokenizer_path)
        self.packed: PackedBlocks | None = None

    def _set_tokenizer(self, path: str) -> None:
        self._tokenizer = _load_hf_tokenizer(path)
        self._tokenizer_dir = path
        self.add_bos = _adds_bos(self._tokenizer)
        self.pad_id = _pad_id(self._tokenizer)

    @property
    def tokenizer(self) -> HFTokenizer | ByteTokenizer:
        if self._tokenizer is None:
            module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
            path = getattr(module, "tokenizer_path", None)
            if path is None:
                raise ValueError(
                    f"{type(self).__name__}: no `tokenizer_path`, and the LightningModule does not provide one "
                    "(HFCausalLM does); set `tokenizer_path` to a Hugging Face tokenizer folder"
                )
            self._set_tokenizer(path)
        assert self._tokenizer is not None
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (special tokens included)."""
        return self.tokenizer.vocab_size

    # ---------------------------------------------------------------- examples

    def encode_examples(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[np.ndarray, int]]:
        """``(ids, num_prompt)`` per ``(prompt, response)``: the input of :func:`pack_examples`."""
        # One `encode` per text: the fast tokenizer's batched `__call__` measured slower here (BatchEncoding overhead).
        tokenizer = self.tokenizer  # resolves a deferred `tokenizer_path` (sets add_bos / pad_id)
        head = [tokenizer.bos_id] if self.add_bos else []
        tail = [self.tokenizer.eos_id]
        out = []
        for prompt, response in pairs:
            prompt_ids = head + self.tokenizer.encode(self.prompt_template.format(prompt=prompt))
            ids = prompt_ids + self.tokenizer.encode(response) + tail
            out.append((np.asarray(ids, dtype=np.int32), len(prompt_ids)))
        return out

    def encode_conversations(self, conversations: Sequence[Conversation]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(ids, learned)`` per conversation that keeps a learned token (:class:`~ultrascale.data.chat.ChatEncoder`);
        the others are counted in ``self.chat_counts``."""
        encoder = self.chat_encoder()
        encoded = [encoder.encode(c) for c in conversations]
        self.chat_counts = encoder.counts
        return [e for e in encoded if e is not None]

    def chat_encoder(self) -> ChatEncoder:
        """The encoder of this module's conversations, with the template resolved (and kept in the hparams)."""
        tokenizer = self.tokenizer
        assert isinstance(tokenizer, HFTokenizer)
        path = self.tokenizer_path or getattr(tokenizer.tokenizer, "name_or_path", "")
        template = resolve_chat_template(self.chat_template, tokenizer.tokenizer, str(path))
        self.hparams["chat_template"] = template
        return ChatEncoder(tokenizer.tokenizer, template, self.seq_len + 1, learn=self.learn,
                           learn_end_of_turn=self.learn_end_of_turn, end_of_turn=self.end_of_turn,
                           truncation=self.truncation)

    def open_prepared(self) -> PreparedTokens | None:
        """`data_path` as conversations `ultrascale prepare-data --chat` wrote (None where it is not a prepared
        folder), checked against this module: the same tokenizer, the same template and end-of-turn token."""
        if not is_prepared(self.data_path):
            return None
        name, prepared = type(self).__name__, PreparedTokens.open(self.data_path)
        if not prepared.is_chat:
            raise DataError(f"{name}: {self.data_path} holds prepared text (CausalLMDataModule's); prepare "
                             "conversations with `ultrascale prepare-data --chat`")
        tokenizer = self.tokenizer
        if tokenizer_fingerprint(self._tokenizer_dir) != prepared.tokenizer_sha256:
            raise DataError(f"{name}: `tokenizer_path={self._tokenizer_dir!r}` is not the tokenizer {self.data_path} "
                             f"was prepared with ({prepared.metadata['tokenizer']['name']})")
        template = prepared.metadata["chat_template"]
        if self.chat_template is not None and self.chat_template != template:
            raise DataError(f"{name}: `chat_template` differs from the one {self.data_path} was rendered with; "
                             "prepare it again with this template, or leave `chat_template` unset")
        eot = prepared.metadata["end_of_turn_id"]
        if self.end_of_turn is not None and tokenizer.tokenizer.convert_tokens_to_ids(self.end_of_turn) != eot:
            raise DataError(f"{name}: `end_of_turn={self.end_of_turn!r}` is not the end-of-turn token {self.data_path} "
                             f"was prepared with (id {eot})")
        self.hparams["chat_template"] = template
        return prepared

    def prepared_examples(self, prepared: PreparedTokens) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(ids, learned)`` of each prepared conversation that keeps a learned token at this `seq_len` and these
        `learn` options (:func:`~ultrascale.data.chat.learned_tokens`, as for conversations read raw)."""
        counts = self.chat_counts = ChatCounts()
        starts = np.asarray(prepared.document_starts)
        out = []
        stop = len(starts) - 1 if self.max_examples is None else min(len(starts) - 1, self.max_examples)
        for d in range(stop):
            ids = np.asarray(prepared.tokens[starts[d] : starts[d + 1]], dtype=np.int32)
            assistant = np.asarray(prepared.assistant[starts[d] : starts[d + 1]], dtype=bool)
            kept = learned_tokens(ids, assistant, max_ids=self.seq_len + 1, learn=self.learn,
                                  learn_end_of_turn=self.learn_end_of_turn,
                                  end_of_turn_id=prepared.metadata["end_of_turn_id"], truncation=self.truncation,
                                  where=f"{self.data_path} conversation {d}")
            counts.cut += ids.size > self.seq_len + 1
            counts.skipped += kept is None
            if kept is not None:
                out.append(kept)
        return out

    def check_before_launch(self, module: Any = None, records: int = 1000, rendered: int = 100) -> None:
        """What can be checked cheaply, in the launching process before any rank starts (`ultrascale fit` calls it):
        the path, the tokenizer (``module.tokenizer_path`` where this module names none), the first `records`
        records' fields, and the first `rendered` conversations through the chat template. DataError naming the
        record (ValueError for a knob the data cannot be used with); a fault deeper in the data is found by `setup`.
        Once per module: the command checks, then the launcher asks again (for the Python API)."""
        if self._checked_before_launch:
            return
        if self._tokenizer is None and getattr(module, "tokenizer_path", None) is not None:
            self._set_tokenizer(module.tokenizer_path)
        if is_prepared(self.data_path):
            if self._tokenizer is not None:
                self.open_prepared()
            self._checked_before_launch = True
            return
        first = self.read(limit=records)
        if not first:
            raise DataError(f"{type(self).__name__}: `data_path={self.data_path!r}` is empty (no examples)")
        if isinstance(first[0], Conversation) and self._tokenizer is not None:
            encoder = self.chat_encoder()
            for conversation in first[:rendered]:
                encoder.encode(conversation)
        self._checked_before_launch = True

    def read(self, limit: int | None = None) -> list[tuple[str, str]] | list[Conversation]:
        """The records of `data_path` (at most `max_examples`, or `limit`): all conversations or all
        ``(prompt, response)`` pairs, as the first record is."""
        fields = (self.prompt_field, self.response_field)
        out: list[Any] = []
        chat: bool | None = None
        limits = [n for n in (self.max_examples, limit) if n is not None]
        for where, record in read_records(self.data_path):
            if limits and len(out) >= min(limits):
                break
            conversation = conversation_of(record, self.messages_field, where)
            if chat is None:
                chat = conversation is not None
            if chat and conversation is None:
                raise DataError(f"{where}: field `{self.messages_field}` is missing (the first record is a "
                                 f"conversation, so every record is one); fields present: {sorted(record)}")
            if not chat and conversation is not None:
                raise DataError(f"{where}: a conversation among prompt/response records (the first record is a "
                                 "pair, so every record is one)")
            if chat:
                out.append(conversation)
            elif all(name in record for name in fields) or self.messages_field in record:
                out.append(_fields_of(record, fields, where))
            else:
                missing = next(name for name in fields if name not in record)
                raise DataError(f"{where}: field `{missing}` is missing; fields present: {sorted(record)} (a record "
                                 f"is a prompt/response pair, or a conversation in `{self.messages_field}`)")
        return out

    def collate_fn(self) -> PadToLongest | PaddingFree | None:
        """:class:`PaddingFree` or :class:`PadToLongest` (`padding_free`) at the strategy's rule
        (`batch_length_rule`: length buckets under `compile=True`) and the device's multiple, unless
        `pad_to="seq_len"` or the layout needs one shape for every batch."""
        trainer = self.trainer
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        layout, shapes = strategy.batch_length_rule() if hasattr(strategy, "batch_length_rule") else (1, "any")
        if self.padding_free and shapes == "static":
            raise ValueError(f"{type(self).__name__}: `padding_free=True` under pipeline parallel: its micro-batches "
                             "split a batch's rows and its stages keep one shape; set `padding_free: null` (rows of "
                             "seq_len there)")
        if self.pad_to == "seq_len" or shapes == "static":
            return None
        device = getattr(strategy, "root_device", torch.device("cpu"))
        dtype = compute_dtype(str(getattr(trainer, "precision", "32-true")))
        multiple = math.lcm(self.pad_to_multiple_of or sequence_length_multiple(device, dtype), layout)
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        free = self.padding_free if self.padding_free is not None else attends_within_documents(module)
        if free:
            return PaddingFree(multiple, self.seq_len, self.pad_id, buckets=shapes == "buckets")
        return PadToLongest(multiple, self.seq_len, buckets=shapes == "buckets")

    def setup(self, stage: str | None = None) -> None:
        """Read, tokenize and pack the examples; split the blocks into train/val (once; later calls are no-ops)."""
        if self.train_dataset is not None:
            return
        name = type(self).__name__
        source = f"`data_path={self.data_path!r}`"
        prepared = self.open_prepared()
        if prepared is not None:
            records, examples, chat = range(prepared.metadata["num_documents"]), self.prepared_examples(prepared), True
        else:
            records = self.read()
            if not records:
                raise DataError(f"{name}: {source} is empty (no examples)")
            chat = isinstance(records[0], Conversation)
            # Either encoding resolves the tokenizer first, which sets pad_id.
            examples = self.encode_conversations(records) if chat else self.encode_examples(records)
        packed = pack_examples(examples, self.seq_len, self.pad_id, pack=self.pack)
        if chat and (self.chat_counts.cut or self.chat_counts.skipped):
            rank_zero_warn(
                f"{name}: {self.chat_counts.cut} of {len(records)} conversations are longer than `seq_len + 1 = "
                f"{self.seq_len + 1}` tokens and were cut after their last assistant turn that fits; "
                f"{self.chat_counts.skipped} conversations had no token to learn (left) and were skipped. Raise "
                "`seq_len` to keep them whole."
            )
        if packed.num_truncated:
            rank_zero_warn(
                f"{name}: {packed.num_truncated} of {len(examples)} examples are longer than `seq_len={self.seq_len}` "
                f"and were truncated (response tail cut); {packed.num_dropped} of them had no response token left "
                "and were dropped. Raise `seq_len` to keep them whole."
            )
        if packed.num_blocks == 0:
            raise DataError(
                f"{name}: {source} has {len(records)} examples but none with a token to learn "
                f"({packed.num_empty} empty, {packed.num_dropped} with the prompt alone filling "
                f"`seq_len={self.seq_len}`)"
            )
        unit = "examples per block packed" if self.pack else "example per block"
        num_train, _ = split_blocks(
            name, packed.num_blocks, self.val_fraction, self.global_batch_size,
            what=f"{source} has {len(examples)} examples = {packed.num_blocks} blocks of `seq_len={self.seq_len}` ({unit})",
            remedy="Use more data (`max_examples`), or a smaller `seq_len` or `global_batch_size`.",
        )
        self.packed = packed
        self.train_dataset = InstructionBlockDataset(
            packed.input_ids[:num_train], packed.labels[:num_train], packed.position_ids[:num_train]
        )
        self.val_dataset = InstructionBlockDataset(
            packed.input_ids[num_train:], packed.labels[num_train:], packed.position_ids[num_train:]
        )


# --------------------------------------------------------------------------- tokenizer helpers


def _check_template(name: str, template: str) -> None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"{name}: `prompt_template={template!r}` is not a valid format string ({e})") from None
    others = sorted({f for f in fields if f != "prompt"})
    if others or "prompt" not in fields:
        raise ValueError(
            f"{name}: `prompt_template={template!r}` must contain `{{prompt}}` and no other placeholder "
            f"(found {sorted(set(fields))}); write literal braces as '{{{{' and '}}}}'"
        )


def _load_hf_tokenizer(path: str) -> HFTokenizer | ByteTokenizer:
    folder = Path(path)
    if folder.is_dir() and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        # AutoTokenizer's own message for this case talks about sentencepiece and slow tokenizers.
        raise FileNotFoundError(
            f"`tokenizer_path={path!r}` holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            f"files there: {sorted(p.name for p in folder.iterdir())[:20]}"
        )
    return load_tokenizer(path)  # raises FileNotFoundError naming `tokenizer_path` if the folder is missing


def _adds_bos(tokenizer: HFTokenizer | ByteTokenizer) -> bool:
    """Whether the tokenizer has a BOS and puts it in front of text by itself (Llama yes, GPT-2 no)."""
    if tokenizer.bos_id is None or not isinstance(tokenizer, HFTokenizer):
        return False
    ids = tokenizer.tokenizer.encode("a", add_special_tokens=True)
    return len(ids) > 0 and ids[0] == tokenizer.bos_id


def _pad_id(tokenizer: HFTokenizer | ByteTokenizer) -> int:
    pad = getattr(getattr(tokenizer, "tokenizer", None), "pad_token_id", None)
    return tokenizer.eos_id if pad is None else int(pad)
