"""Causal-LM data: a token stream cut into fixed blocks, sharded by data-parallel rank.

The layout is defined in terms of *global* batches so that the data a run sees
does not depend on how it is parallelised:

* each epoch is a seeded permutation of all training blocks, cut into global
  batches of ``global_batch_size`` blocks;
* data-parallel rank ``r`` of ``dp`` takes the ``r``-th contiguous slice of
  each global batch.

A run at dp=4 (per-rank batch 2) and one at dp=1 (batch 8) therefore consume
the same samples at every step, and a checkpoint can resume at another world
size by skipping the global batches already consumed.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ultrascale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["CausalLMDataModule", "ResumableBlockSampler", "TokenBlockDataset", "stdlib_files", "tokenize_corpus"]

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


# --------------------------------------------------------------------------- sampler


class ResumableBlockSampler(DistributedSampler):
    """Global-batch-major sampler: identical global batches at any dp size, resumable mid-epoch.

    For epoch ``e`` the block indices are permuted with
    ``torch.Generator().manual_seed(seed + e)`` (or kept in order when
    ``shuffle=False``), the tail is dropped to a multiple of
    ``global_batch_size``, global batch ``b`` is ``perm[b*G:(b+1)*G]`` and rank
    ``r`` yields the slice ``[r*G/dp, (r+1)*G/dp)`` of each global batch, in order.

    It subclasses :class:`DistributedSampler` because Lightning leaves such
    samplers alone; any other sampler would be wrapped in Lightning's own
    distributed sampler, which shards by world size and would break the layout
    (and give tensor-parallel peers different data).

    Args:
        dataset: The indexed dataset (only its length is used).
        global_batch_size: Samples per step summed over all data-parallel ranks.
        num_replicas: Data-parallel size (not the world size under TP/PP).
        rank: Data-parallel rank of this process.
        shuffle: Permute blocks each epoch; ``False`` keeps them in order (validation).
        seed: Base seed; epoch ``e`` uses ``seed + e``.
        skip_batches: Global batches to skip at the start of epoch ``resume_epoch``
            (those already consumed before a checkpoint). Later epochs are complete.
        resume_epoch: The epoch ``skip_batches`` applies to.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        skip_batches: int = 0,
        resume_epoch: int = 0,
    ) -> None:
        name = type(self).__name__
        if global_batch_size < 1:
            raise ValueError(f"{name}: `global_batch_size={global_batch_size}` must be >= 1")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"{name}: need 0 <= `rank={rank}` < `num_replicas={num_replicas}`")
        if global_batch_size % num_replicas != 0:
            raise ValueError(
                f"{name}: `global_batch_size={global_batch_size}` is not divisible by the "
                f"data-parallel size {num_replicas}"
            )
        if skip_batches < 0:
            raise ValueError(f"{name}: `skip_batches={skip_batches}` must be >= 0")
        # num_replicas/rank are always passed, so the parent never queries torch.distributed.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.skip_batches = skip_batches
        self.resume_epoch = resume_epoch

    @property
    def num_global_batches(self) -> int:
        """Complete global batches per epoch (the tail that does not fill one is dropped)."""
        return len(self.dataset) // self.global_batch_size

    def global_batches(self) -> torch.Tensor:
        """This epoch's block indices as a ``(num_global_batches, global_batch_size)`` tensor."""
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(n)
        nb, g = self.num_global_batches, self.global_batch_size
        return order[: nb * g].view(nb, g)  # (num_global_batches, G)

    def __iter__(self) -> Iterator[int]:
        local = self.global_batches()[:, self.rank * self.local_batch_size : (self.rank + 1) * self.local_batch_size]
        # (num_global_batches, G // dp)
        start = self.skip_batches if self.epoch == self.resume_epoch else 0
        return iter(local[start:].reshape(-1).tolist())

    def __len__(self) -> int:
        # The full epoch even when skipping: Lightning restores its batch counter to
        # the skipped count and uses this length to know where the epoch ends.
        return self.num_global_batches * self.local_batch_size


class _ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it resumes mid-epoch correctly.

    The position itself lives in :meth:`CausalLMDataModule.state_dict` (it must be
    known before the loader is built, to set the sampler's skip), so the loader's
    own state is empty. Having ``state_dict``/``load_state_dict`` only stops
    Lightning from warning that a mid-epoch resume is unreliable.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# --------------------------------------------------------------------------- data module


def split_blocks(
    name: str, num_blocks: int, val_fraction: float, global_batch_size: int, *, what: str, remedy: str
) -> tuple[int, int]:
    """``(num_train, num_val)``: the last ``val_fraction`` of the blocks (at least one if > 0) for
    validation, with a ValueError when either split holds less than one global batch (validation
    drops its tail to whole global batches, so it would otherwise be silently empty)."""
    num_val = int(num_blocks * val_fraction)
    if val_fraction > 0 and num_blocks > 0:
        num_val = max(num_val, 1)
    num_train = num_blocks - num_val
    if num_train < global_batch_size:
        raise ValueError(
            f"{name}: {what}, of which {num_train} are for training (`val_fraction={val_fraction}`): fewer than "
            f"one global batch (`global_batch_size={global_batch_size}`). {remedy}"
        )
    if 0 < num_val < global_batch_size:
        raise ValueError(
            f"{name}: only {num_val} validation blocks (`val_fraction={val_fraction}` of {num_blocks}), "
            f"fewer than one global batch (`global_batch_size={global_batch_size}`). "
            "Raise `val_fraction`, use more data, or set `val_fraction=0` to disable validation."
        )
    return num_train, num_val


class CausalLMDataModule(L.LightningDataModule):
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
        self.train_dataset: TokenBlockDataset | None = None
        self.val_dataset: TokenBlockDataset | None = None
        # Set by `load_state_dict` when resuming: skip this many global batches of that epoch.
        self._resume_epoch = 0
        self._skip_batches = 0

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

    # ---------------------------------------------------------------- layout

    def _dp_layout(self) -> tuple[int, int]:
        """``(dp_size, dp_rank)`` of this process.

        Taken from the strategy's ``distributed_sampler_kwargs``, not the world
        size: under tensor/pipeline parallelism several ranks share a dp rank and
        must see identical batches.
        """
        strategy = getattr(self.trainer, "strategy", None)
        # Single-device strategies do not define the property at all.
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _dataloader(self, dataset: TokenBlockDataset | None, *, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call `setup()` before requesting dataloaders")
        dp_size, dp_rank = self._dp_layout()
        if self.global_batch_size % dp_size != 0:
            raise ValueError(
                f"{type(self).__name__}: `global_batch_size={self.global_batch_size}` is not divisible by "
                f"the data-parallel size {dp_size}; choose a multiple of {dp_size}"
            )
        sampler = ResumableBlockSampler(
            dataset,
            global_batch_size=self.global_batch_size,
            num_replicas=dp_size,
            rank=dp_rank,
            shuffle=train,
            seed=self.seed,
            skip_batches=self._skip_batches if train else 0,
            resume_epoch=self._resume_epoch,
        )
        return _ResumableDataLoader(
            dataset,
            batch_size=self.global_batch_size // dp_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled per-rank slices of the global batches; skips consumed batches after a resume."""
        return self._dataloader(self.train_dataset, train=True)

    def val_dataloader(self) -> DataLoader | list:
        """In-order per-rank slices of the validation global batches (``[]`` if `val_fraction=0`)."""
        if self.val_fraction == 0:
            return []
        return self._dataloader(self.val_dataset, train=False)

    # ---------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """Position in the data stream, saved by Lightning into every checkpoint.

        ``batches_done`` counts the global micro-batches of ``epoch`` already
        processed; it is independent of the dp size because each per-rank batch
        is one slice of one global batch.
        """
        epoch, done = 0, 0
        if self.trainer is not None:
            epoch = self.trainer.current_epoch
            done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": epoch, "batches_done": done, "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next train dataloader skip the global batches consumed before the checkpoint."""
        name = type(self).__name__
        # Either change would reorder the samples, so "skip N batches" would no longer
        # mean "skip the N batches already trained on".
        if state_dict["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                f"{name}: the checkpoint was written with `global_batch_size={state_dict['global_batch_size']}` but "
                f"this run has `global_batch_size={self.global_batch_size}`; resuming with a different global batch "
                "changes the data order. Keep the global batch (change the per-rank split via the dp size instead)."
            )
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"{name}: the checkpoint was written with `seed={state_dict['seed']}` but this run has "
                f"`seed={self.seed}`; resuming with another seed changes the data order"
            )
        self._resume_epoch = int(state_dict["epoch"])
        self._skip_batches = int(state_dict["batches_done"])
