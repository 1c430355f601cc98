"""Causal-LM data: a token stream cut into fixed blocks, sharded by data-parallel rank.

The blocks are split, laid out in global batches (identical at any dp size) and
resumed by :class:`~ultrascale.data.sampling.BlockDataModule`.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ultrascale.data.errors import DataError, DataNotFound
from ultrascale.data.prepared import BlendedBlocks, PreparedTokens, is_prepared, tokenizer_fingerprint
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


def _text_path(data_path: str) -> Path:
    """A raw-text `data_path` (a file or a directory): FileNotFoundError naming it when it is neither."""
    path = Path(data_path)
    if not path.is_file() and not path.is_dir():
        raise DataNotFound(f"`data_path={data_path!r}` is neither a file, a directory nor 'stdlib'")
    return path


def _text_files(data_path: str, file_glob: str) -> list[Path]:
    if data_path == "stdlib":
        return stdlib_files()
    path = _text_path(data_path)
    if path.is_file():
        return [path]
    # Sorted so every rank (and every rerun) concatenates documents in the same order.
    return sorted(p for p in path.glob(file_glob) if p.is_file())


def _read_files(files: Iterable[Path]) -> Iterator[str]:
    for f in files:
        # errors="replace": the stdlib's own test suite ships deliberately mis-encoded files.
        yield f.read_text(encoding="utf-8", errors="replace")


def _read_dataset(dataset_path: str, text_column: str) -> Iterator[str]:
    if not os.path.isdir(dataset_path):
        raise DataNotFound(
            f"`dataset_path={dataset_path!r}` does not exist; expected a folder written by `Dataset.save_to_disk`"
        )
    import datasets  # imported lazily: only needed for this input kind

    ds = datasets.load_from_disk(dataset_path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"`dataset_path={dataset_path!r}` holds a DatasetDict without a 'train' split "
                f"(splits: {sorted(ds)}); save a single Dataset or one with a 'train' split"
            )
        # The validation split is carved from the tail of the token stream, so only one split is read.
        ds = ds["train"]
    if text_column not in ds.column_names:
        raise DataError(
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
    """Next-token-prediction data from a prepared folder (or a blend of them), text files, the stdlib, or a
    saved ``datasets`` dataset.

    A folder written by ``ultrascale prepare-data`` is memory-mapped on every rank (start-up time and
    memory independent of the corpus size; sizes and tokenizer checked when the module is made, before
    any process group). Raw text is tokenized by every rank itself in :meth:`setup` (deterministic and
    cheap for the byte tokenizer and ``max_tokens``; for a real corpus prepare it once instead). Batches
    are laid out by :class:`ResumableBlockSampler`: the same global batches at any dp size.

    Args:
        data_path: a prepared folder; a list of ``{"path": folder, "weight": w}`` blending prepared folders
            by weight (deterministic, resumable); ``"stdlib"`` (this interpreter's standard library sources, a
            corpus present on every machine without downloads), a directory (files matched by
            ``file_glob``) or a single text file.
        file_glob: Pattern for files under a ``data_path`` directory, e.g.
            ``"**/*.txt"``. Not used for ``"stdlib"`` (always ``*.py``).
        dataset_path: Folder of a ``datasets`` dataset written by ``save_to_disk``;
            when set it is used instead of ``data_path``.
        text_column: Column of ``dataset_path`` holding the documents.
        tokenizer_path: Local folder of a Hugging Face tokenizer; ``None`` uses the
            byte tokenizer (vocabulary of 258). With prepared data, optional: when given it must be the
            tokenizer the data was prepared with (compared by the SHA-256 of its files).
        seq_len: Tokens per training sequence (blocks hold ``seq_len + 1`` tokens
            for the shifted labels).
        global_batch_size: Sequences per micro-step summed over all data-parallel
            ranks; must be divisible by the data-parallel size.
        max_tokens: Cap on the corpus size in tokens, so CPU runs stay quick;
            ``None`` uses the whole corpus; ``"auto"``: 2,000,000 for raw text, the whole of prepared data.
        val_fraction: Fraction of blocks (taken from the end of the stream) held
            out for validation; 0 disables validation.
        seed: Seed of the per-epoch shuffle (epoch ``e`` uses ``seed + e``).
        num_workers: DataLoader worker processes; 0 loads in the main process.
        document_positions: (prepared data) give each block ``position_ids`` restarting at every document,
            so that attention stays inside documents (document masking, as packed SFT data does).
    """

    train_dataset: Any
    val_dataset: Any

    def __init__(
        self,
        data_path: Union[str, list[dict[str, Any]]] = "stdlib",
        file_glob: str = "**/*.py",
        dataset_path: Optional[str] = None,
        text_column: str = "text",
        tokenizer_path: Optional[str] = None,
        seq_len: int = 128,
        global_batch_size: int = 8,
        max_tokens: Union[int, None, Literal["auto"]] = "auto",
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        document_positions: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if seq_len < 1:
            raise ValueError(f"{name}: `seq_len={seq_len}` must be >= 1")
        if global_batch_size < 1:
            raise ValueError(f"{name}: `global_batch_size={global_batch_size}` must be >= 1")
        if max_tokens != "auto" and max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{name}: `max_tokens={max_tokens!r}` must be >= 1, None (no cap) or 'auto'")
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
        self.document_positions = document_positions
        # Opened and checked eagerly, before any process group: `vocab_size` must be readable right after
        # construction, when LightningCLI links it to the model's arguments.
        self.prepared = _prepared_sources(name, data_path, dataset_path, tokenizer_path)
        if self.prepared is None and dataset_path is None and data_path != "stdlib":
            _text_path(str(data_path))  # a path that is not there fails here, in the launching process
        if self.prepared is None and document_positions:
            raise ValueError(f"{name}: `document_positions=True` needs prepared data (`ultrascale prepare-data`), "
                             f"which records where documents start; got `data_path={data_path!r}`")
        self.tokenizer = load_tokenizer(tokenizer_path) if self.prepared is None or tokenizer_path else None

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (special tokens included)."""
        if self.prepared is not None:
            return self.prepared[0][0].vocab_size
        assert self.tokenizer is not None
        return self.tokenizer.vocab_size

    def check_model(self, module: Any) -> None:
        """ValueError if the data's vocabulary does not fit the model's embedding (ids past it would index out
        of range); the strategies call it before any process group."""
        config = getattr(module, "config", None)
        model_vocab = getattr(config, "vocab_size", None)
        if isinstance(model_vocab, int) and self.vocab_size > model_vocab:
            source = (f"prepared with tokenizer {self.prepared[0][0].metadata['tokenizer']['name']!r}"
                      if self.prepared is not None else f"tokenized with {self.tokenizer!r}")
            raise ValueError(
                f"{type(self).__name__}: the data is {source}, vocabulary {self.vocab_size:,}, but the model "
                f"{type(module).__name__} has vocab_size={model_vocab:,}: use the model's tokenizer (or a model "
                "with that vocabulary)"
            )

    # ---------------------------------------------------------------- corpus

    def _texts(self) -> Iterator[str]:
        if self.dataset_path is not None:
            return _read_dataset(self.dataset_path, self.text_column)
        return _read_files(_text_files(self.data_path, self.file_glob))

    def _source(self) -> str:
        return f"`dataset_path={self.dataset_path!r}`" if self.dataset_path else f"`data_path={self.data_path!r}`"

    def setup(self, stage: str | None = None) -> None:
        """Map (prepared data) or tokenize the corpus and split its blocks into train/val (once; later calls are no-ops)."""
        if self.train_dataset is not None:
            return
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        if module is not None:  # again here for strategies that are not ultrascale's
            self.check_model(module)
        if self.prepared is not None:
            self._setup_prepared()
            return
        name = type(self).__name__
        max_tokens = 2_000_000 if self.max_tokens == "auto" else self.max_tokens
        assert self.tokenizer is not None
        tokens = tokenize_corpus(self._texts(), self.tokenizer, max_tokens)
        if tokens.size == 0:
            raise DataError(f"{name}: the corpus {self._source()} is empty (no documents or no text)")
        num_blocks = tokens.size // (self.seq_len + 1)
        num_train, num_val = split_blocks(
            type(self).__name__, num_blocks, self.val_fraction, self.global_batch_size,
            what=f"the corpus {self._source()} has {tokens.size} tokens = {num_blocks} blocks of `seq_len={self.seq_len}`+1",
            remedy="Use more data (`max_tokens`), a smaller `seq_len` or a smaller `global_batch_size`.",
        )
        self.train_dataset = TokenBlockDataset(tokens, self.seq_len, 0, num_train)
        self.val_dataset = TokenBlockDataset(tokens, self.seq_len, num_train, num_val)

    def _setup_prepared(self) -> None:
        assert self.prepared is not None
        sources, weights = [s for s, _ in self.prepared], [w for _, w in self.prepared]
        cap = None if self.max_tokens in ("auto", None) else int(self.max_tokens) // (self.seq_len + 1)
        blocks = BlendedBlocks(sources, weights, self.seq_len, max_blocks=cap, document_positions=self.document_positions)
        described = ", ".join(f"{s.path} ({s.metadata['num_tokens']:,} tokens)" for s in sources)
        num_train, num_val = split_blocks(
            type(self).__name__, len(blocks), self.val_fraction, self.global_batch_size,
            what=f"the prepared data {described} gives {len(blocks)} blocks of `seq_len={self.seq_len}`+1",
            remedy="Use more data, a smaller `seq_len` or a smaller `global_batch_size`.",
        )
        self.train_dataset = Subset(blocks, range(num_train))
        self.val_dataset = Subset(blocks, range(num_train, num_train + num_val))


def _prepared_sources(owner: str, data_path: Any, dataset_path: Optional[str],
                      tokenizer_path: Optional[str]) -> Optional[list[tuple[PreparedTokens, float]]]:
    """The prepared folders `data_path` names, opened and checked, with their weights; None for raw text."""
    if isinstance(data_path, (list, tuple)):
        entries = []
        for entry in data_path:
            if not isinstance(entry, dict) or "path" not in entry:
                raise ValueError(f"{owner}: a blend is a list of {{path: folder, weight: w}}; got {entry!r}")
            entries.append((entry["path"], float(entry.get("weight", 1.0))))
        if not entries:
            raise ValueError(f"{owner}: `data_path=[]` names no data")
    elif is_prepared(data_path):
        entries = [(data_path, 1.0)]
    else:
        return None
    if dataset_path is not None:
        raise ValueError(f"{owner}: `dataset_path` reads raw text; with prepared data (`data_path={data_path!r}`) leave it unset")
    sources = []
    for path, weight in entries:
        if not is_prepared(path):
            raise DataError(f"{owner}: blend entry {path!r} is not a prepared folder (`ultrascale prepare-data`)")
        if weight <= 0:
            raise ValueError(f"{owner}: blend entry {path!r} has weight {weight}; weights must be positive")
        source = PreparedTokens.open(path)
        if source.is_chat:
            raise DataError(f"{owner}: {path} holds prepared conversations (`prepare-data --chat`): they are read by "
                             "InstructionDataModule, whose labels learn the assistant turns only")
        sources.append((source, weight))
    fingerprints = {s.tokenizer_sha256 for s, _ in sources}
    if len(fingerprints) > 1:
        names = [f"{s.path}: {s.metadata['tokenizer']['name']}" for s, _ in sources]
        raise DataError(f"{owner}: the blended folders were prepared with different tokenizers ({names})")
    if tokenizer_path is not None and tokenizer_fingerprint(tokenizer_path) != sources[0][0].tokenizer_sha256:
        raise DataError(
            f"{owner}: `tokenizer_path={tokenizer_path!r}` is not the tokenizer {sources[0][0].path} was prepared with "
            f"({sources[0][0].metadata['tokenizer']['name']!r}); leave tokenizer_path unset or prepare the data with it"
        )
    return sources
