"""Resuming a restarted job by itself: the newest complete checkpoint where the run writes them.

A job restarted by torchrun (`--max-restarts`) or requeued by SLURM runs the same command
again, on every rank. `ckpt_path="auto"` (the `ultrascale` CLI) or
`ckpt_path=latest_checkpoint(trainer)` (the Trainer API) then resumes from the newest complete
checkpoint, or starts from step 0 when there is none yet. The choice is made from the file
system alone, before any process group exists, and is the same on every rank: completeness is
decided by the names (a checkpoint being written or cut short lives under a hidden temporary
name, see `ultrascale.parallel.checkpoint`) and "newest" by the `global_step` each checkpoint
records. The strategy loads rank 0's choice, and warns where a rank was given another path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ultrascale.parallel.checkpoint import latest_checkpoint as _latest_in
from ultrascale.parallel.manifest import VerifyLevel

AUTO = "auto"
"""The `ckpt_path` value that asks for the newest complete checkpoint (or a fresh start)."""


def checkpoint_folders(trainer: "pl.Trainer") -> list[Path]:
    """Where `trainer`'s `ModelCheckpoint` callbacks write (or wrote in earlier runs of the job).

    A callback with a `dirpath` writes there. One without writes into its logger's
    `<save_dir>/<name>/<version>/checkpoints`, and a versioned logger (TensorBoard, CSV) starts a
    new version at every restart: every version's `checkpoints` folder is searched.
    """
    callbacks = list(trainer.checkpoint_callbacks)
    if not callbacks:
        raise ValueError(
            "ckpt_path='auto' resumes from the checkpoints the Trainer's ModelCheckpoint writes, and this Trainer has "
            "none (`enable_checkpointing=False`?): add a ModelCheckpoint, or pass a checkpoint path"
        )
    folders: list[Path] = []
    for callback in callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath:
            folders.append(Path(dirpath))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            folders.extend(sorted(Path(save_dir, str(logger.name)).glob("*/checkpoints")))
        else:
            folders.append(Path(trainer.default_root_dir, "checkpoints"))
    return list(dict.fromkeys(folders))


def latest_checkpoint(where: Union["pl.Trainer", str, Path, Iterable[Union[str, Path]]]) -> Optional[str]:
    """The newest complete ultrascale checkpoint, as a `ckpt_path`; None when there is none yet.

    `where`: a Trainer (its checkpoint folders, see `checkpoint_folders`), a folder, or folders.
    Every rank calls it and gets the same answer from the same files::

        trainer.fit(model, datamodule, ckpt_path=ultrascale.latest_checkpoint(trainer))
    """
    if isinstance(where, pl.Trainer):
        folders: list[Path] = checkpoint_folders(where)
    elif isinstance(where, (str, Path)):
        folders = [Path(where)]
    else:
        folders = [Path(folder) for folder in where]
    found = _latest_in(folders, verify_level(where) if isinstance(where, pl.Trainer) else "checksum")
    return None if found is None else str(found)


def verify_level(trainer: "pl.Trainer") -> VerifyLevel:
    """The Trainer's strategy's `checkpoint_verify` ("checksum" for a strategy without the knob)."""
    return getattr(trainer.strategy, "checkpoint_verify", "checksum")


def roll_back(module: "pl.LightningModule", *, rollbacks: int, guard: Any, rank: int,
              broadcast: Callable[[str], str], load: Callable[[str], Any]) -> None:
    """`nonfinite="rollback"`: weights and optimizer state back to the newest complete checkpoint
    (`load`: the strategy's `load_checkpoint`), warned and logged as the run's `rollbacks`-th rollback.

    The step counter, the learning-rate schedule and the data go on: the batches between that
    checkpoint and the bad step, the bad one included, are not seen again (PaLM's remedy for
    loss spikes: restart from an earlier checkpoint and skip the batches that led there).
    `guard`: the step's `StepGuard` (its skip count and limit are reported)."""
    from ultrascale.strategies._lightning_compat import logging_as_hook

    trainer = module.trainer
    found = latest_checkpoint(trainer)
    chosen = broadcast(found or "")  # rank 0's view of the folder decides for every rank
    step = trainer.global_step
    if not chosen:
        raise FloatingPointError(
            f"non-finite step {step} (rank {rank}) and nonfinite='rollback', but there is no complete "
            "checkpoint to roll back to yet; save checkpoints (ModelCheckpoint(every_n_train_steps=...)) or use "
            "nonfinite='skip'"
        )
    meta = load(chosen)
    restored = int(meta.get("global_step", -1)) if isinstance(meta, Mapping) else -1
    rank_zero_warn(
        f"ultrascale: non-finite step {step}: weights and optimizer state rolled back to {chosen} (step {restored}); "
        f"the batches since then are skipped ({guard.skipped} of at most {guard.max_skips}; "
        "nonfinite='rollback')"
    )
    with logging_as_hook(module, "on_before_optimizer_step"):
        module.log("rollbacks", float(rollbacks), sync_dist=False)


__all__ = ["AUTO", "checkpoint_folders", "latest_checkpoint", "roll_back", "verify_level"]
