"""Sharded checkpoints written in the background and published once complete.

Shaped like Lightning's `CheckpointIO` (`save_checkpoint`, `remove_checkpoint`, `teardown`), but
not one: a DCP checkpoint is a collective of every rank and a load needs the live model and
optimizers, so the strategy keeps its own `load_checkpoint` and calls this object from its hooks.

An asynchronous save (DCP `async_save`) returns once this rank's shards are copied to host
memory. The checkpoint is published under its name (found by a resume or `latest_checkpoint`)
only once every rank has written it: at the first step after that (`written_everywhere`), at
the next save, before a load, or at the end of `fit`. Until then it is not the newest complete
checkpoint, so the removals `ModelCheckpoint` asks for (the previous top-k / last one) wait.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ultrascale.parallel.checkpoint import (
    PendingSave,
    async_save_sharded_checkpoint,
    check_checkpoint_dir,
    save_sharded_checkpoint,
)
from ultrascale.parallel.device import async_checkpoint_backend
from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.fsdp import reshard
from ultrascale.parallel.manifest import CheckpointDamaged, VerifyLevel, damage_message, verify_distributed
from ultrascale.parallel.resume import load_training_state
from ultrascale.parallel.zero import ZeroEngine, engine_for
from ultrascale.strategies.autoresume import AUTO

PathLike = Union[str, Path]


class AsyncCheckpointPublisher:
    """Writes the strategy's sharded checkpoints, in the background under `asynchronous` (inside `fit` only,
    where `teardown` publishes the last one), and publishes them once every rank has written its shards."""

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self._open = False
        self._pending: Optional[PendingSave] = None
        self._deferred_removals: list[Path] = []
        self._groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]] = None  # (save, poll)

    @property
    def pending(self) -> Optional[PendingSave]:
        """The save being written, not yet published; None if none."""
        return self._pending

    def open(self, fitting: bool) -> None:
        """At the strategy's `setup`: saves may run in the background only inside `fit`."""
        self._open = fitting

    def save_checkpoint(self, tensors: dict[str, Any], metadata: dict[str, Any], path: Path) -> None:
        """Save `tensors` (DCP, resharded on load) and `metadata` (rank 0's) under `path`; every rank calls it."""
        self.finish_checkpoint()  # one save in flight at a time: DCP's background collectives share one group
        if self.asynchronous and self._open:
            if self._groups is None:
                backend = async_checkpoint_backend()
                self._groups = (dist.new_group(backend=backend), dist.new_group(backend=backend))
            self._pending = async_save_sharded_checkpoint(tensors, metadata, path, group=self._groups[0])
        else:
            save_sharded_checkpoint(tensors, metadata, path)

    def written_everywhere(self) -> bool:
        """Whether a save is in flight and every rank has written its shards (one all-reduce of a flag,
        on a group of its own); every rank calls it at the same point."""
        if self._pending is None or self._groups is None:
            return False
        return self._pending.done_everywhere(self._groups[1])

    def finish_checkpoint(self) -> Optional[Path]:
        """Publish the save in flight once every rank has written its shards, then apply the removals that
        waited for it; its path, or None if none was in flight. Every rank calls it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        removals, self._deferred_removals = self._deferred_removals, []
        path = pending.finish()
        for removal in removals:
            _remove(removal)
        return path

    def remove_checkpoint(self, path: PathLike, *, owner: bool) -> None:
        """Remove a checkpoint; `owner`: whether this rank touches the files (global rank 0)."""
        if self._pending is not None:
            # ModelCheckpoint drops the previous top-k / last checkpoint right after saving the next one; while
            # that one is still being written, the previous one is the newest complete checkpoint: kept until then.
            if owner:
                self._deferred_removals.append(Path(path))
            return
        if owner:
            _remove(Path(path))

    def teardown(self, *, interrupted: bool) -> None:
        """At the end of `fit`: no more background saves. `interrupted`: a failed or killed peer would never
        join the collectives of publishing, so the write is left unpublished (the previous checkpoint stays
        the newest; the next save in the folder removes the leftover). The caller then publishes the rest
        with `finish_checkpoint`."""
        self._open = False
        if self._pending is not None and interrupted:
            rank_zero_warn(f"ultrascale: the asynchronous save of {self._pending.path} was not published: "
                           "the run was interrupted while it was being written")
            self._pending, self._deferred_removals = None, []


def pack_checkpoint(checkpoint: dict[str, Any], dims: ParallelDims, zero_stage: int) -> dict[str, Any]:
    """Split Lightning's `checkpoint` in place: the tensors are returned (DCP, resharded on load: the model's
    `state_dict`, then `optimizer_<i>` per optimizer); `checkpoint` keeps the rest (rank 0's metadata) plus
    the layout it was saved under."""
    tensors = {
        "state_dict": checkpoint.pop("state_dict"),
        **{f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))},
    }
    checkpoint["ultrascale"] = {
        "parallel_dims": dims.__dict__,
        "num_optimizers": len(tensors) - 1,
        "zero_stage": zero_stage,
    }
    return tensors


def model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's sharded state dict (DTensors), as DCP saves it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    reshard(model)  # a checkpoint written from on_validation_end runs before the strategy hook
    return get_model_state_dict(model)


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         engines: Sequence[ZeroEngine] = ()) -> dict[str, Any]:
    """An optimizer's sharded state dict: its ZeRO-1/2 engine's own (one of `engines`), or DCP's for FSDP's
    parameters."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    engine = engine_for(optimizer, engines)
    if engine is not None:
        return engine.sharded_state_dict()
    return get_optimizer_state_dict(model, optimizer)


def plain_optimizers(optimizers: Iterable[Any]) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind Lightning's `LightningOptimizer` wrappers."""
    return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]


def refuse_auto(checkpoint_path: PathLike, owner: str) -> None:
    """ValueError for `ckpt_path='auto'` outside the CLI; every rank gets the same value: all raise,
    before any collective."""
    if str(checkpoint_path) == AUTO:
        raise ValueError(
            f"{owner}: `ckpt_path='auto'` is resolved by the `ultrascale` CLI; with the Trainer API pass "
            "`ckpt_path=ultrascale.latest_checkpoint(trainer)` (None, a fresh start, when there is no checkpoint yet)"
        )


def agreed_checkpoint(checkpoint_path: PathLike, broadcast: Callable[[str], str], rank: int) -> Path:
    """Rank 0's `checkpoint_path` (`broadcast`: the strategy's), checked to be a complete checkpoint; warns
    where this rank was given another path."""
    chosen = broadcast(str(checkpoint_path))
    if chosen != str(checkpoint_path):
        warnings.warn(
            f"rank {rank} was asked to resume from {checkpoint_path}, rank 0 from {chosen}: every rank "
            f"loads {chosen}. Do the ranks see the same checkpoint folder?",
            stacklevel=2,
        )
    return check_checkpoint_dir(chosen)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class CheckpointHooks:
    """Lightning's checkpoint hooks of `UltraScaleStrategy`: sharded DCP saves (published by `checkpoint_publisher`,
    in the background under `async_checkpoint`), loads verified against their manifest and resharded to this run's
    layout. The strategy provides what is declared here."""

    model: Optional[torch.nn.Module]
    checkpoint_publisher: AsyncCheckpointPublisher
    checkpoint_verify: VerifyLevel
    zero_stage: int
    parallel_dims: ParallelDims
    broadcast: Callable[..., Any]
    global_rank: int
    is_global_zero: bool
    optimizers: list[Any]
    lightning_module: Any

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.model is not None
        return optimizer_state_dict(self.model, optimizer, self._zero_engines)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: model state is loaded (and resharded) by DCP in `load_checkpoint`."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: optimizer state is loaded (and resharded) by DCP in `load_checkpoint`."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(`storage_options=...`) is not supported")
        path = Path(self.broadcast(str(filepath)))
        tensors = pack_checkpoint(checkpoint, self.parallel_dims, self.zero_stage)
        self.finish_checkpoint()  # one save in flight at a time: DCP's background collectives share one group
        self.checkpoint_publisher.save_checkpoint(tensors, checkpoint, path)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Publish a finished asynchronous save at the next step, not at the next save: a job killed in
        # between then resumes from it rather than from the one before.
        if self.checkpoint_publisher.written_everywhere():
            self.finish_checkpoint()

    def finish_checkpoint(self) -> Optional[Path]:
        """Publish the asynchronous save in flight, once every rank has written its shards (then apply the
        removals that waited for it); returns its path, or None if none was in flight. Every rank calls it."""
        return self.checkpoint_publisher.finish_checkpoint()

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a sharded checkpoint, resharded to this run's layout: any world size, ZeRO family,
        TP / CP layout or pipeline degree (`ultrascale.parallel.resume.load_training_state`)."""
        refuse_auto(checkpoint_path, type(self).__name__)  # before any collective
        self.finish_checkpoint()
        path = agreed_checkpoint(checkpoint_path, self.broadcast, self.global_rank)
        problems = verify_distributed(path, self.checkpoint_verify)  # every rank gets every finding: all refuse
        if problems:
            raise CheckpointDamaged(damage_message(path, problems))
        assert self.model is not None and self.lightning_module is not None
        return load_training_state(path, self.model, plain_optimizers(self.optimizers),
                                   strict=self.lightning_module.strict_loading, zero_stage=self.zero_stage,
                                   engines=self._zero_engines)

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        # Waits while a save is being written (`AsyncCheckpointPublisher.remove_checkpoint`).
        self.checkpoint_publisher.remove_checkpoint(filepath, owner=self.is_global_zero)
