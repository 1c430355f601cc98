"""Pipeline parallel: split a model into stages by layers and run torch's schedules on them.

The model object is never rebuilt. On each rank the parts held by other ranks are replaced by
parameter-free `PipelineGap`s, so every parameter keeps its fully qualified name (checkpoints
and the HF export move between pipeline degrees) and the model's own forward runs unchanged:
a gap passes its input through. Each (virtual) stage of this rank is a `PipelineStageModule`
that registers only its own parts (its `parameters()` are the stage's, which the zero-bubble
schedules and FSDP need) and, while it runs, swaps in gaps for the parts of this rank's other
stages.

    stage s holds layers  [offset_s, offset_s + n_s)   (balanced, or an explicit list)
    stage 0 also holds the embedding, stage S-1 the final norm, the head and the loss
    rank r holds stages   r, r + p, r + 2p, ...         (loop: GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
                                                         InterleavedZeroBubble)
                          r, 2p - 1 - r                 (V: ZBVZeroBubble, DualPipeV)

The schedules are torch's (`torch.distributed.pipelining`), run with `scale_grads=False`: the
loss of a micro-batch is its token-loss *sum* times a constant, and the caller normalises the
step once by the valid tokens of the global batch (`ultrascale.parallel.loss`). Stage shapes are
fixed when a stage first runs, so `PipelineRunner` keeps one set of stages per batch shape.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleLoopedBFS,
    _Action,
    _ComputationType,
    get_schedule_class,
)

from ultrascale.parallel.expert import routing_not_counted
from ultrascale.parallel.loss import IGNORE_INDEX, cross_entropy_sum
from ultrascale.parallel.rules import (  # the rulebook owns the schedule names and their rules
    SCHEDULES,  # noqa: F401  (re-exported: `ultrascale.parallel.pipeline.SCHEDULES`)
    V_SCHEDULES,
    pipeline_problems,
    raise_first,
    resolved_stages,
)


def even_layers(n_layers: int, num_stages: int) -> tuple[int, ...]:
    """The default split: n_layers // num_stages each, the remainder to the first stages (the last one also runs
    the head and the loss)."""
    base, extra = divmod(n_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


@dataclass(frozen=True)
class PipelineLayout:
    """Which layers each stage holds and which stages each pipeline rank runs."""

    pp: int
    """Pipeline ranks."""
    schedule: str
    """Name of the torch schedule (one of `SCHEDULES`)."""
    virtual_stages: int
    """Stages per rank."""
    microbatches: int
    """Micro-batches each local batch is cut into."""
    layers_per_stage: tuple[int, ...]
    """Transformer layers of stage 0, 1, ..., num_stages - 1 (in model order)."""

    @classmethod
    def build(
        cls,
        *,
        n_layers: int,
        pp: int,
        schedule: str = "1F1B",
        virtual_stages: Optional[int] = None,
        microbatches: Optional[int] = None,
        layers_per_stage: Optional[Sequence[int]] = None,
    ) -> "PipelineLayout":
        """Check the choice against the model's `n_layers` (ValueError naming the fix) and resolve defaults:
        virtual stages 1 for GPipe/1F1B and 2 for the others, micro-batches = number of stages."""
        raise_first(pipeline_problems(n_layers=n_layers, pp=pp, schedule=schedule, virtual_stages=virtual_stages,
                                      microbatches=microbatches, layers_per_stage=layers_per_stage))
        virtual_stages = resolved_stages(schedule, virtual_stages)
        num_stages = pp * virtual_stages
        if microbatches is None:
            microbatches = num_stages
        if layers_per_stage is not None:
            layers = tuple(int(n) for n in layers_per_stage)
        else:
            layers = even_layers(n_layers, num_stages)
        return cls(pp=pp, schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches, layers_per_stage=layers)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """The stages rank `pp_rank` runs, in model order."""
        if self.schedule in V_SCHEDULES:
            return (pp_rank, 2 * self.pp - 1 - pp_rank)
        return tuple(pp_rank + v * self.pp for v in range(self.virtual_stages))

    def layers_of(self, stage: int) -> range:
        start = sum(self.layers_per_stage[:stage])
        return range(start, start + self.layers_per_stage[stage])

    def describe(self) -> str:
        return (
            f"{self.schedule}, {self.pp} ranks x {self.virtual_stages} stage(s), {self.microbatches} micro-batches, "
            f"layers per stage {list(self.layers_per_stage)}"
        )


# --------------------------------------------------------------------------- the model's parts


def _default_loss(output: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cross_entropy_sum(output, labels)


@dataclass(frozen=True)
class PipelineParts:
    """Where a model keeps the parts a pipeline splits, and how to run it: the adapter for PP.

    Paths are attribute paths relative to `root` ("tok_embeddings", "model.layers", "lm_head").
    `run(root, x, position_ids, is_first)` runs `root`'s forward on the first stage's input
    (token ids) or, after the first stage, on hidden states `x` (B, T, dim); parts held
    elsewhere are `PipelineGap`s that pass their input through, so the model's forward needs
    only to accept hidden states in place of token ids. `loss(output, labels)` returns
    ``(sum of the token losses, number of valid tokens)``.
    """

    root: nn.Module
    embed: str
    layers: str
    norm: str
    head: str
    run: Callable[[nn.Module, torch.Tensor, Optional[torch.Tensor], bool], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = field(default=_default_loss)

    def layer_list(self) -> nn.ModuleList:
        layers = self.root.get_submodule(self.layers)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"pipeline parallel: `{self.layers}` of {type(self.root).__name__} must be a ModuleList of layers")
        return layers

    def problem(self, model_name: str) -> Optional[str]:
        """Why this model cannot be split (a part missing, embedding and head tied), or None."""
        for role, path in (("embedding", self.embed), ("layers", self.layers), ("final norm", self.norm), ("head", self.head)):
            try:
                self.root.get_submodule(path)
            except AttributeError:
                return f"pipeline parallel: {model_name} has no {role} at `{path}`"
        embed_params = {id(p) for p in self.root.get_submodule(self.embed).parameters()}
        if any(id(p) in embed_params for p in self.root.get_submodule(self.head).parameters()):
            return (
                f"pipeline parallel: {model_name} ties its input embedding to its output head; the first and the last "
                "stage would each need the one weight. Untie them (e.g. `tie_embeddings=False` / `tie_word_embeddings=False`)"
            )
        return None


class PipelineGap(nn.Module):
    """Stands in for a part another stage holds: no parameters; passes its first input through."""

    def forward(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        return x if x is not None else kwargs.get("hidden_states")


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, name, module)


def stage_slots(parts: PipelineParts, layout: PipelineLayout, stage: int) -> list[str]:
    """The module paths (relative to `parts.root`) stage `stage` holds."""
    slots = [f"{parts.layers}.{i}" for i in layout.layers_of(stage)]
    if stage == 0:
        slots.insert(0, parts.embed)
    if stage == layout.num_stages - 1:
        slots += [parts.norm, parts.head]
    return slots


def split_model(parts: PipelineParts, layout: PipelineLayout, pp_rank: int) -> list[str]:
    """Replace, in place, every part that rank `pp_rank`'s stages do not hold by a `PipelineGap`;
    returns the paths of the parts it keeps."""
    keep = {slot for stage in layout.stage_ids(pp_rank) for slot in stage_slots(parts, layout, stage)}
    n_layers = len(parts.layer_list())
    if n_layers != sum(layout.layers_per_stage):
        raise ValueError(f"pipeline layout covers {sum(layout.layers_per_stage)} layers, the model has {n_layers}")
    every = [parts.embed, *(f"{parts.layers}.{i}" for i in range(n_layers)), parts.norm, parts.head]
    for slot in every:
        if slot not in keep:
            _set_submodule(parts.root, slot, PipelineGap())
    return [slot for slot in every if slot in keep]


def plan_for_present(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """A tensor-parallel plan restricted to the modules this rank holds: each wildcard key is expanded
    to the matching module paths that are not inside a `PipelineGap`."""
    paths = [name for name, _ in module.named_modules() if name]
    present: dict[str, Any] = {}
    for key, style in plan.items():
        depth = key.count(".")
        for path in paths:
            if path.count(".") == depth and fnmatch.fnmatchcase(path, key) and not _under_gap(module, path):
                present[path] = style
    return present


def _under_gap(root: nn.Module, path: str) -> bool:
    atoms = path.split(".")
    return any(isinstance(root.get_submodule(".".join(atoms[: i + 1])), PipelineGap) for i in range(len(atoms)))


class PipelineStageModule(nn.Module):
    """Stage `stage` of `parts.root` on this rank: what torch's `PipelineStage` runs.

    Its registered children are the stage's own parts (so `parameters()` are exactly the
    stage's, and FSDP can make it the root unit of the stage); the root model is only referenced.
    While it runs, the parts of this rank's other stages are swapped for gaps.
    """

    def __init__(self, parts: PipelineParts, layout: PipelineLayout, stage: int, pp_rank: int) -> None:
        super().__init__()
        self.stage = stage
        self.is_first = stage == 0
        self.slots = stage_slots(parts, layout, stage)
        self.parts_held = nn.ModuleDict({slot.replace(".", "_"): parts.root.get_submodule(slot) for slot in self.slots})
        self._other_slots = [
            slot for other in layout.stage_ids(pp_rank) if other != stage for slot in stage_slots(parts, layout, other)
        ]
        object.__setattr__(self, "_parts", parts)  # not a child: its other parts are not this stage's

    @contextlib.contextmanager
    def _only_own_parts(self) -> Iterator[None]:
        root = self._parts.root
        held = {slot: root.get_submodule(slot) for slot in self._other_slots}
        for slot in held:
            _set_submodule(root, slot, PipelineGap())
        try:
            yield
        finally:
            for slot, module in held.items():
                _set_submodule(root, slot, module)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        with self._only_own_parts():
            output = self._parts.run(self._parts.root, x, position_ids, self.is_first)
        # A stage output that is a view (a gap returned a slice of its input, as HF's head does) cannot
        # be detached in place, which torch's zero-bubble backward does to free the graph.
        return output.clone() if output._base is not None else output


def gather_stage_states(local: dict[str, torch.Tensor], stage_mesh: Any) -> Optional[dict[str, torch.Tensor]]:
    """The union of every pipeline stage's full state dict on global rank 0 (None elsewhere).

    `local`: this rank's full (unsharded) tensors of the parameters it holds; `stage_mesh`: the
    ranks of this rank's stage, whose first rank sends them. Every rank must call this."""
    sender = stage_mesh.get_local_rank() == 0
    gathered: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local if sender else {}, gathered, dst=0)
    if gathered is None:
        return None
    return {name: tensor for state in gathered for name, tensor in state.items()}


# --------------------------------------------------------------------------- running the schedules


class _ForwardOnlyV(ScheduleLoopedBFS):
    """Forward-only pass over the V placement (rank r holds stages r and 2p-1-r), run through `eval()`.

    Every micro-batch goes through the rank's first stage, then through its second. torch lowers a
    schedule (adds the sends, receives, FSDP unshards) only after checking that it holds a backward
    per micro-batch, so the order is lowered with full backwards, which are then dropped with their
    communication: they would run, and fail, even under `eval()` where two stages share a rank."""

    _FORWARD_ONLY = (
        _ComputationType.FORWARD,
        _ComputationType.SEND_F,
        _ComputationType.RECV_F,
        _ComputationType.UNSHARD,
        _ComputationType.RESHARD,
    )

    def _calculate_single_rank_operations(self, rank: int) -> list[Optional[_Action]]:
        stages = (rank, 2 * self.pp_group_size - 1 - rank)
        microbatches = range(self._n_microbatches)
        forward = [_Action(s, _ComputationType.FORWARD, mb) for s in stages for mb in microbatches]
        backward = [_Action(s, _ComputationType.FULL_BACKWARD, mb) for s in reversed(stages) for mb in reversed(microbatches)]
        return [*forward, *backward]

    def _prepare_schedule_with_comms(self, actions: Any, format: Any = "compute_only") -> None:
        super()._prepare_schedule_with_comms(actions, format)
        self.pipeline_order_with_comms = {
            rank: [a for a in order if a.computation_type in self._FORWARD_ONLY]
            for rank, order in self.pipeline_order_with_comms.items()
        }


def _split_count(count: int, microbatches: int) -> None:
    if count % microbatches:
        raise ValueError(
            f"pipeline parallel: the local batch holds {count} sequences, which pipeline_microbatches={microbatches} "
            "does not divide (every micro-batch must have the same shape). Make the batch size a multiple of it "
            "(and drop the last, smaller batch: `drop_last=True`)"
        )


def _exclude_shape_inference_from_expert_load(stage: PipelineStage) -> None:
    """torch's stage runs one extra forward (grad enabled) on its first step to infer its shapes; an MoE
    layer's routing counts must not see it (`ultrascale.parallel.expert.routing_not_counted`). Wraps
    torch's private `_forward_metadata_inference` (torch 2.13); check on a torch upgrade."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return

    def uncounted(*args: Any, **kwargs: Any) -> Any:
        with routing_not_counted():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = uncounted  # type: ignore[method-assign]


class PipelineRunner:
    """This rank's stages and torch's schedules over them, one set per batch shape and mode.

    `step(input_ids, labels, position_ids, loss_scale)` runs every micro-batch of a local batch
    through the pipeline (forward and backward when `train`) and returns the batch's token-loss
    sum and its number of valid tokens, the same on every pipeline rank. The backward of each
    micro-batch runs on ``loss_scale * (its token-loss sum)``.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStageModule],
        layout: PipelineLayout,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = _default_loss,
    ) -> None:
        self.stages = list(stages)
        self.layout = layout
        self.group = pp_group
        self.device = device
        self.loss = loss
        self.loss_scale = 1.0
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self.has_last_stage = any(s.stage == layout.num_stages - 1 for s in self.stages)
        self.has_first_stage = any(s.stage == 0 for s in self.stages)

    def _loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, _ = self.loss(output, labels)
        return loss_sum * self.loss_scale

    def _schedule(self, train: bool, key: tuple[Any, ...]) -> Any:
        schedule = self._schedules.get((train, *key))
        if schedule is not None:
            return schedule
        stages = [
            PipelineStage(module, module.stage, self.layout.num_stages, self.device, group=self.group)
            for module in self.stages
        ]
        for stage in stages:
            _exclude_shape_inference_from_expert_load(stage)
        m = self.layout.microbatches
        cls = get_schedule_class(self.layout.schedule)
        if not train and self.layout.schedule in V_SCHEDULES:
            cls = _ForwardOnlyV  # torch 2.13's `eval()` of the V schedules runs backward actions and fails
        if issubclass(cls, PipelineScheduleSingle):
            schedule = cls(stages[0], n_microbatches=m, loss_fn=self._loss_fn, scale_grads=False)
        else:
            schedule = cls(stages, n_microbatches=m, loss_fn=self._loss_fn, scale_grads=False)
        self._schedules[(train, *key)] = schedule
        return schedule

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        *,
        train: bool,
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token-loss sum, valid tokens)`` of the local batch (float64 and int64, on every pp rank)."""
        _split_count(input_ids.shape[0], self.layout.microbatches)
        self.loss_scale = loss_scale
        if position_ids is None:
            # Every stage gets the positions: after the first one the hidden states are all it sees, and
            # under sequence parallel their local length is T / tp, not T.
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        schedule = self._schedule(train, tuple(input_ids.shape))
        kwargs = {"position_ids": position_ids}
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        if train:
            schedule.step(*args, target=target, losses=losses, **kwargs)
        else:
            with torch.no_grad():
                schedule.eval(*args, target=target, losses=losses, **kwargs)
        local = (torch.stack([loss.detach().double() for loss in losses]).sum() / loss_scale if losses
                 else torch.zeros((), dtype=torch.float64))
        total = local.to(self.device)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)  # only the last stage holds the losses
        return total, (labels != IGNORE_INDEX).sum()
