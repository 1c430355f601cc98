"""What `ultrascale verify --explain` records in each run: the first optimizer step, module by module.

`ModuleTrace` is a callback both runs get. During the first step it keeps, for every module of the
LightningModule, sums over the elements of its forward output and of its first input, over every call of this rank
(each micro-batch: `parallel.expert.is_step_forward`, so neither a recompute in backward nor torch's pipeline
running a stage on placeholders first): per feature (the last dim) the sum over all tokens, the sum of squares of
all elements, and the token count. Added over the ranks, they give each feature's mean over all tokens of the
global batch, and the root mean square, whatever splits the tokens:

    mean_f = sum_r S_rf / sum_r N_r,   rms = sqrt(sum_r Q_r / (sum_r N_r · F))

holds for data-parallel and context-parallel ranks (each its own tokens), sequence-parallel shards, replicated
outputs (every tp rank counts the same tokens, so S and N both grow tp-fold), pipeline micro-batches and
expert-parallel dispatch (each rank its tokens). A DTensor output is gathered whole first; a plain output that
holds 1/tp of the features (a column-parallel projection) is kept per tp coordinate, and the comparison puts the
coordinates' features side by side (`explain.py`), since only the reference knows the whole width.

At `on_before_optimizer_step` of that step (the step's gradients reduced and normalised, before clipping) every
parameter's gradient is gathered to a full tensor from whatever holds it (FSDP shards, ZeRO-1/2 slices through the
strategy's engines, tensor-parallel and expert-parallel DTensors; each pipeline stage its own), one parameter at a
time, and written by the lowest rank holding it. Rank 0 writes `trace.json`: the merged module sums, the forward
order, each parameter's pipeline stage and the layout's sizes that a scaling error would show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ultrascale.parallel.expert import is_step_forward
from ultrascale.parallel.zero_layouts import clean_name


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in (_first_tensor(v) for v in value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in (_first_tensor(v) for v in value.values()) if t is not None), None)
    logits = getattr(value, "logits", None)  # transformers' model outputs
    return logits if isinstance(logits, torch.Tensor) else None


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (every rank of its mesh runs the same module, so the gather is matched); a plain
    tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _sums(tensor: Optional[torch.Tensor]) -> Optional[tuple[torch.Tensor, float, float]]:
    """(per-feature sums over the tokens (F,), sum of squares of all elements, tokens), fp64 on the host."""
    if tensor is None or not tensor.is_floating_point() or tensor.dim() == 0:
        return None
    values = _whole(tensor.detach()).double()
    features = values.reshape(-1, values.shape[-1])
    return features.sum(0).cpu(), float(features.square().sum()), float(features.shape[0])


def _add(previous: Optional[tuple[torch.Tensor, float, float]], new: Optional[tuple[torch.Tensor, float, float]]
         ) -> Optional[tuple[torch.Tensor, float, float]]:
    if previous is None or new is None or previous[0].shape != new[0].shape:
        return new if previous is None else previous
    return previous[0] + new[0], previous[1] + new[1], previous[2] + new[2]


class ModuleTrace(Callback):
    """Records the first optimizer step's module outputs and parameter gradients into `folder` (see the module)."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self._sums: dict[str, list[Any]] = {}  # name -> [output's `_sums`, first input's `_sums`]
        self._order: dict[str, int] = {}
        self._handles: list[Any] = []
        self._done = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from ultrascale.parallel.pipeline import PipelineGap

        for name, module in pl_module.named_modules():
            if name and not isinstance(module, PipelineGap):  # the parts another pipeline stage holds
                self._handles.append(module.register_forward_hook(self._hook(clean_name(name))))

    def _hook(self, name: str) -> Any:
        def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if self._done or not is_step_forward():
                return
            out = _first_tensor(output)
            if out is None:
                return
            sums = [_sums(out), _sums(_first_tensor(args))]
            if sums[0] is None:
                return
            self._order.setdefault(name, len(self._order))
            previous = self._sums.get(name)
            self._sums[name] = sums if previous is None else [_add(a, b) for a, b in zip(previous, sums)]

        return record

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._done:
            return
        self._done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.folder.mkdir(parents=True, exist_ok=True)
        strategy = trainer.strategy
        rank, world = trainer.global_rank, trainer.world_size
        stage, tp_rank = _mesh_coordinate(strategy, "pp"), _mesh_coordinate(strategy, "tp") or 0
        engines = tuple(getattr(strategy, "zero_engines", ()))
        engine_names = {clean_name(engine.names[id(p)]) for engine in engines for b in engine.buckets for p in b.params}
        names = sorted(engine_names | {clean_name(n) for n, p in pl_module.named_parameters() if p.grad is not None})
        mine_summary = (self._sums, self._order, stage, names, tp_rank)
        gathered: list[Any] = [mine_summary]
        if world > 1 and dist.is_initialized():
            gathered = [None] * world
            dist.all_gather_object(gathered, mine_summary)
        first_holder: dict[str, int] = {}
        for holder, (_, _, _, held, _) in enumerate(gathered):
            for name in held:
                first_holder.setdefault(name, holder)
        self._write_gradients(pl_module, engines, engine_names, {n for n, holder in first_holder.items() if holder == rank},
                              self.folder / f"grads-rank{rank}")
        if rank == 0:
            self._write_summary(gathered, first_holder, strategy, trainer)

    @staticmethod
    def _write_gradients(pl_module: pl.LightningModule, engines: tuple[Any, ...], engine_names: set[str], mine: set[str],
                         folder: Path) -> None:
        """Every gradient gathered whole (a collective of the ranks sharing it: all of them gather, in the same
        order), and written at once, one file each, by the rank that holds it first: one gathered tensor at a time
        on the host (a ZeRO-1/2 engine hands its gradients over together)."""
        from safetensors.torch import save_file
        from torch.distributed.tensor import DTensor

        folder.mkdir(parents=True, exist_ok=True)
        written = 0

        def write(name: str, grad: torch.Tensor) -> None:
            nonlocal written
            if name in mine:
                save_file({name: grad.detach().float().cpu().contiguous()}, str(folder / f"{written}.safetensors"))
                written += 1

        for engine in engines:
            for name, grad in engine.full_gradients().items():
                write(clean_name(name), grad)
        for name, param in pl_module.named_parameters():
            name = clean_name(name)
            if name in engine_names or param.grad is None:
                continue
            grad = param.grad.detach()
            write(name, grad.full_tensor() if isinstance(grad, DTensor) else grad)

    def _write_summary(self, gathered: list[Any], first_holder: dict[str, int], strategy: Any,
                       trainer: pl.Trainer) -> None:
        merged: dict[str, dict[int, list[Any]]] = {}  # name -> tp coordinate -> [output sums, input sums]
        order: dict[str, tuple[int, int]] = {}
        stages_of: dict[str, set[Optional[int]]] = {}
        for sums, local_order, stage, _, tp_rank in gathered:
            for name, (out, inp) in sums.items():
                by_tp = merged.setdefault(name, {})
                previous = by_tp.get(tp_rank)
                by_tp[tp_rank] = [out, inp] if previous is None else [_add(previous[0], out), _add(previous[1], inp)]
                key = (stage or 0, local_order[name])
                order[name] = min(order.get(name, key), key)
                stages_of.setdefault(name, set()).add(stage)
        # A module every pipeline stage calls (the model's root, which runs its own part on each) computes something
        # else on each stage: not comparable with one device's.
        comparable = [name for name in sorted(merged, key=lambda n: order[n]) if len(stages_of[name]) == 1]
        modules = {name: {"output": _by_tp(merged[name], 0), "input": _by_tp(merged[name], 1)} for name in comparable}
        dims = getattr(strategy, "parallel_dims", None)
        layout = getattr(strategy, "pipeline_layout", None)
        sizes = {"micro-batches": trainer.accumulate_grad_batches * (layout.microbatches if layout is not None else 1)}
        if dims is not None:
            sizes.update({"dp": dims.dp, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "ep": dims.ep})
        stages = {name: gathered[holder][2] for name, holder in first_holder.items()}
        summary = {"modules": modules, "stages": stages, "sizes": sizes, "world": trainer.world_size}
        (self.folder / "trace.json").write_text(json.dumps(summary))


def _by_tp(by_tp: dict[int, list[Any]], which: int) -> Optional[list[dict[str, Any]]]:
    """One entry per tp coordinate, in order: {"sum": per-feature sums, "squares": ..., "tokens": ...}."""
    entries = []
    for tp_rank in sorted(by_tp):
        sums = by_tp[tp_rank][which]
        if sums is None:
            return None
        entries.append({"sum": sums[0].tolist(), "squares": sums[1], "tokens": sums[2]})
    return entries


def _mesh_coordinate(strategy: Any, axis: str) -> Optional[int]:
    dims = getattr(strategy, "parallel_dims", None)
    if dims is None or getattr(dims, axis) <= 1:
        return None
    return strategy.parallel_mesh[axis].get_local_rank()


__all__ = ["ModuleTrace"]
