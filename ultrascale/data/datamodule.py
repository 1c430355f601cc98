"""Causal-LM data: a token stream cut into fixed blocks, sharded by data-parallel rank.

The blocks are split, laid out in global batches (identical at any dp size) and
resumed by :class:`~ultrascale.data.sampling.BlockDataModule`.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ultrascale.data.sampling import BlockDataModule, split_blocks
from ultrascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["CausalLMDataModule", "TokenBlockDataset", "stdlib_files", "tokenize_corpus"]

# Folders of the stdlib tree that hold third-party code (installed packages), not the stdlib.
_NON_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# --------------------------------------------------------------------------- corpus


def stdlib_files() -> list[Path]:
    """All ``*.py`` files of this interpreter's standard library, sorted, without ``site-packages``.

    ``os.walk`` with pruning rather than ``Path.glob("**/*.py")``: the glob would
    first enumerate every installed package (torch alone is thousands of files).
    """
    root = sysconfig.get_paths()["stdlib"]
    files: list[Path] = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _NON_STDLIB_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def _text_files(data_path: str, file_glob: str) -> list[Path]:
    if data_path == "stdlib":
        return stdlib_files()
    path = Path(data_path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"`data_path={data_path!r}` is neither a file, a directory nor 'stdlib'")
    # Sorted so every rank (and every rerun) concatenates documents in the same order.
    return sorted(p for p in path.glob(file_glob) if p.is_file())


def _read_files(files: Iterable[Path]) -> Iterator[str]:
    for f in files:
        # errors="replace": the stdlib's own test suite ships deliberately mis-encoded files.
        yield f.read_text(encoding="utf-8", errors="replace")


def _read_dataset(dataset_path: str, text_column: str) -> Iterator[str]:
    if not os.path.isdir(dataset_path):
        raise FileNotFoundError(
            f"`dataset_path={dataset_path!r}` does not exist; expected a folder written by `Dataset.save_to_disk`"
        )
    import datasets  # imported lazily: only needed for this input kind

    ds = datasets.load_from_disk(dataset_path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(
                f"`dataset_path={dataset_path!r}` holds a DatasetDict without a 'train' split "
                f"(splits: {sorted(ds)}); save a single Dataset or one with a 'train' split"
            )
        # The validation split is carved from the tail of the token stream, so only one split is read.
        ds = ds["train"]
    if text_column not in ds.column_names:
        raise ValueError(
            f"`text_column={text_column!r}` is not a column of `dataset_path={dataset_path!r}`; "
            f"columns: {ds.column_names}"
        )
    # Batched iteration so `max_tokens` can stop reading early without loading the whole column.
    for batch in ds.select_columns([text_column]).iter(batch_size=1000):
        yield from batch[text_column]


def tokenize_corpus(
    texts: Iterable[str], tokenizer: ByteTokenizer | HFTokenizer, max_tokens: int | None = None
) -> np.ndarray:
    """Encode ``texts`` in order, each followed by ``tokenizer.eos_id``, as one ``int32`` stream.

    Texts that encode to nothing are skipped. Stops reading once ``max_tokens``
    tokens are collected and truncates to exactly that many; ``None`` reads
    everything.
    """
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    chunks: list[np.ndarray] = []
    total = 0
    for text in texts:
        ids = tokenizer.encode_array(text)
        if ids.size == 0:
            continue  # an empty file would only add a stray EOS
        chunks += [ids, eos]
        total += ids.size + 1
        if max_tokens is not None and total >= max_tokens:
            break
    if not chunks:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(chunks)[:max_tokens]


class TokenBlockDataset(Dataset):
    """Non-overlapping blocks of ``seq_len + 1`` tokens from a token stream.

    Item ``i`` is ``{"input_ids": block[:-1], "labels": block[1:]}`` (int64), so
    ``labels[t]`` is the target of ``input_ids[t]``.

    Args:
        tokens: The token stream (any integer dtype).
        seq_len: Tokens per training sequence.
        first_block: Index of this split's first block in the stream.
        num_blocks: Number of blocks in this split.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, first_block: int, num_blocks: int) -> None:
        if first_block < 0 or num_blocks < 0 or (first_block + num_blocks) * (seq_len + 1) > tokens.size:
            raise ValueError(
                f"blocks [{first_block}, {first_block + num_blocks}) of {seq_len + 1} tokens "
                f"do not fit in a stream of {tokens.size} tokens"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.first_block = first_block
        self.num_blocks = num_blocks

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for {self.num_blocks} blocks")
        start = (self.first_block + index) * (self.seq_len + 1)
        block = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}


# --------------------------------------------------------------------------- data module


class CausalLMDataModule(BlockDataModule):
    """Next-token-prediction data from text files, the stdlib, or a saved ``datasets`` dataset.

    Every rank tokenizes the corpus itself in :meth:`setup` (deterministic and
    cheap for the default byte tokenizer and ``max_tokens``), so there is no
    cache to share. Batches are laid out by :class:`ResumableBlockSampler`.

    Args:
        data_path: ``"stdlib"`` (this interpreter's standard library sources, a
            corpus present on every machine without downloads), a directory
            (files matched by ``file_glob``) or a single text file.
        file_glob: Pattern for files under a ``data_path`` directory, e.g.
            ``"**/*.txt"``. Not used for ``"stdlib"`` (always ``*.py``).
        dataset_path: Folder of a ``datasets`` dataset written by ``save_to_disk``;
            when set it is used instead of ``data_path``.
        text_column: Column of ``dataset_path`` holding the documents.
        tokenizer_path: Local folder of a Hugging Face tokenizer; ``None`` uses the
            byte tokenizer (vocabulary of 258).
        seq_len: Tokens per training sequence (blocks hold ``seq_len + 1`` tokens
            for the shifted labels).
        global_batch_size: Sequences per micro-step summed over all data-parallel
            ranks; must be divisible by the data-parallel size.
        max_tokens: Cap on the corpus size in tokens, so CPU runs stay quick;
            ``None`` uses the whole corpus.
        val_fraction: Fraction of blocks (taken from the end of the stream) held
            out for validation; 0 disables validation.
        seed: Seed of the per-epoch shuffle (epoch ``e`` uses ``seed + e``).
        num_workers: DataLoader worker processes; 0 loads in the main process.
    """

    train_dataset: TokenBlockDataset | None
    val_dataset: TokenBlockDataset | None

    def __init__(
        self,
        data_path: str = "stdlib",
        file_glob: str = "**/*.py",
        dataset_path: str | None = None,
        text_column: str = "text",
        tokenizer_path: str | None = None,
        seq_len: int = 128,
        global_batch_size: int = 8,
        max_tokens: int | None = 2_000_000,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if seq_len < 1:
            raise ValueError(f"{name}: `seq_len={seq_len}` must be >= 1")
        if global_batch_size < 1:
            raise ValueError(f"{name}: `global_batch_size={global_batch_size}` must be >= 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"{name}: `max_tokens={max_tokens}` must be >= 1 or None (no cap)")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"{name}: `val_fraction={val_fraction}` must be in [0, 1)")
        if num_workers < 0:
            raise ValueError(f"{name}: `num_workers={num_workers}` must be >= 0")
        self.save_hyperparameters()
        self.data_path = data_path
        self.file_glob = file_glob
        self.dataset_path = dataset_path
        self.text_column = text_column
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.max_tokens = max_tokens
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        # Loaded eagerly: `vocab_size` must be readable right after construction,
        # when LightningCLI links it to the model's arguments.
        self.tokenizer = load_tokenizer(tokenizer_path)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (special tokens included)."""
        return self.tokenizer.vocab_size

    # ---------------------------------------------------------------- corpus

    def _texts(self) -> Iterator[str]:
        if self.dataset_path is not None:
            return _read_dataset(self.dataset_path, self.text_column)
        return _read_files(_text_files(self.data_path, self.file_glob))

    def _source(self) -> str:
        return f"`dataset_path={self.dataset_path!r}`" if self.dataset_path else f"`data_path={self.data_path!r}`"

    def setup(self, stage: str | None = None) -> None:
        """Tokenize the corpus and split its blocks into train/val (once; later calls are no-ops)."""
        if self.train_dataset is not None:
            return
        name = type(self).__name__
        tokens = tokenize_corpus(self._texts(), self.tokenizer, self.max_tokens)
        if tokens.size == 0:
            raise ValueError(f"{name}: the corpus {self._source()} is empty (no documents or no text)")
        num_blocks = tokens.size // (self.seq_len + 1)
        num_train, num_val = split_blocks(
            type(self).__name__, num_blocks, self.val_fraction, self.global_batch_size,
            what=f"the corpus {self._source()} has {tokens.size} tokens = {num_blocks} blocks of `seq_len={self.seq_len}`+1",
            remedy="Use more data (`max_tokens`), a smaller `seq_len` or a smaller `global_batch_size`.",
        )
        self.train_dataset = TokenBlockDataset(tokens, self.seq_len, 0, num_train)
        self.val_dataset = TokenBlockDataset(tokens, self.seq_len, num_train, num_val)
