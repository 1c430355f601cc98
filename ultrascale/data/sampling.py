"""The block layout shared by the data modules: split, dp-size-independent sampling, resume.

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

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ultrascale.data.errors import DataError
from ultrascale.parallel.device import pins_host_memory
from ultrascale.parallel.rules import batch_split_problem

__all__ = ["BlockDataModule", "ResumableBlockSampler", "split_blocks"]


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
        lengths: Each block's length (its positions that are not padding), to group by: the
            epoch's order is cut into windows of ``GROUP_WINDOW`` global batches and each window
            sorted longest first (Hugging Face's ``group_by_length``, its mega-batches), so a
            batch cut to its longest pads little. Deterministic and resumable like the order.
    """

    GROUP_WINDOW = 50
    """Global batches per window sorted by length (transformers' LengthGroupedSampler uses 50 batches)."""

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
        lengths: Any = None,
    ) -> None:
        name = type(self).__name__
        if lengths is not None and len(lengths) != len(dataset):
            raise ValueError(f"{name}: {len(lengths)} `lengths` for {len(dataset)} blocks")
        if global_batch_size < 1:
            raise ValueError(f"{name}: `global_batch_size={global_batch_size}` must be >= 1")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"{name}: need 0 <= `rank={rank}` < `num_replicas={num_replicas}`")
        split = batch_split_problem(global_batch_size, num_replicas, f"{name}: `global_batch_size={global_batch_size}`")
        if split is not None:
            raise ValueError(split.text())
        if skip_batches < 0:
            raise ValueError(f"{name}: `skip_batches={skip_batches}` must be >= 0")
        # num_replicas/rank are always passed, so the parent never queries torch.distributed.
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.skip_batches = skip_batches
        self.resume_epoch = resume_epoch
        self.lengths = None if lengths is None else torch.as_tensor(lengths)

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
        order = order[: nb * g]
        if self.lengths is not None:
            window = self.GROUP_WINDOW * g
            order = torch.cat([chunk[torch.argsort(-self.lengths[chunk], stable=True)] for chunk in order.split(window)])
        return order.view(nb, g)  # (num_global_batches, G)

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

    The position itself lives in :meth:`BlockDataModule.state_dict` (it must be
    known before the loader is built, to set the sampler's skip), so the loader's
    own state is empty. Having ``state_dict``/``load_state_dict`` only stops
    Lightning from warning that a mid-epoch resume is unreliable.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


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
        raise DataError(
            f"{name}: {what}, of which {num_train} are for training (`val_fraction={val_fraction}`): fewer than "
            f"one global batch (`global_batch_size={global_batch_size}`). {remedy}"
        )
    if 0 < num_val < global_batch_size:
        raise DataError(
            f"{name}: only {num_val} validation blocks (`val_fraction={val_fraction}` of {num_blocks}), "
            f"fewer than one global batch (`global_batch_size={global_batch_size}`). "
            "Raise `val_fraction`, use more data, or set `val_fraction=0` to disable validation."
        )
    return num_train, num_val


class BlockDataModule(L.LightningDataModule):
    """Dataloaders and checkpointed position of a data module whose samples are fixed blocks.

    A subclass validates and stores ``global_batch_size``, ``val_fraction``,
    ``seed`` and ``num_workers`` in its own constructor (LightningCLI reads that
    signature) and fills ``train_dataset`` / ``val_dataset`` in ``setup``, usually
    cut with :func:`split_blocks`. This class lays their blocks out in global
    batches with :class:`ResumableBlockSampler` and saves and restores the
    position in the data stream.
    """

    global_batch_size: int
    val_fraction: float
    seed: int
    num_workers: int

    def __init__(self) -> None:
        super().__init__()
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        # Set by `load_state_dict` when resuming: skip this many global batches of that epoch.
        self._resume_epoch = 0
        self._skip_batches = 0

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

    def _dataloader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call `setup()` before requesting dataloaders")
        dp_size, dp_rank = self._dp_layout()
        split = batch_split_problem(self.global_batch_size, dp_size,
                                    f"{type(self).__name__}: `global_batch_size={self.global_batch_size}`")
        if split is not None:
            raise ValueError(split.text())
        group = train and getattr(self, "group_by_length", False)
        sampler = ResumableBlockSampler(
            dataset,
            global_batch_size=self.global_batch_size,
            num_replicas=dp_size,
            rank=dp_rank,
            shuffle=train and getattr(self, "shuffle", True),
            seed=self.seed,
            skip_batches=self._skip_batches if train else 0,
            resume_epoch=self._resume_epoch,
            lengths=dataset.lengths if group else None,
        )
        return _ResumableDataLoader(
            dataset,
            batch_size=self.global_batch_size // dp_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=self.collate_fn(),
            num_workers=self.num_workers,
            pin_memory=pins_host_memory(getattr(getattr(self.trainer, "strategy", None), "root_device", torch.device("cpu"))),
        )

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """How a rank's rows become its batch (None: torch's default, a stack)."""
        return None

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
