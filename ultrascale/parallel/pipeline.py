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
from torch.distributed.tensor import DTensor

from ultrascale.parallel.expert import routing_not_counted
from ultrascale.parallel.loss import IGNORE_INDEX, cross_entropy_sum
from ultrascale.parallel.rules import (  # the rulebook owns the schedule names and their rules
    SCHEDULES,  # noqa: F401  (re-exported: `ultrascale.parallel.pipeline.SCHEDULES`)
    V_SCHEDULES,
    microbatch_split_problem,
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

    @property
    def ends_on_one_rank(self) -> bool:
        """Whether the first and the last stage run on one rank (the V placement): tied embeddings then stay one weight."""
        return self.num_stages - 1 in self.stage_ids(0)

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
        """Why this model cannot be split (a part missing), or None."""
        for role, path in (("embedding", self.embed), ("layers", self.layers), ("final norm", self.norm), ("head", self.head)):
            try:
                self.root.get_submodule(path)
            except AttributeError:
                return f"pipeline parallel: {model_name} has no {role} at `{path}`"
        held = {id(p) for path in (self.embed, self.layers, self.norm, self.head)
                for p in self.root.get_submodule(path).parameters()}
        outside = [name for name, p in self.root.named_parameters() if id(p) not in held and p.requires_grad]
        if outside:
            # Stage-less parameters stay on every stage: each keeps its own copy, trained only where the forward
            # uses it (DeepSeek-V4's `hc_head` after the layers), and the copies part ways (frozen ones do not).
            return (f"pipeline parallel: {model_name} holds parameters outside its embedding, layers, final norm and "
                    f"head ({', '.join(outside[:4])}{' ...' if len(outside) > 4 else ''}), of which every stage would "
                    "keep a copy that only the stage using it trains: train it without pipeline parallel")
        shared = {id(p) for p in self.root.get_submodule(self.embed).parameters()} & {
            id(p) for p in self.root.get_submodule(self.head).parameters()}
        if len(shared) != len(self.tied_weights()):
            return (f"pipeline parallel: {model_name}'s input embedding and output head share a weight inside a "
                    f"submodule of `{self.embed}`; only a weight of the modules themselves (`{self.embed}.weight`) "
                    "can be tied across stages")
        return None

    def tied_weights(self) -> list[tuple[str, str]]:
        """(embedding attribute, head attribute) of each Parameter the input embedding shares with the output
        head (tied embeddings: `[("weight", "weight")]`); empty when they share none."""
        head = dict(self.root.get_submodule(self.head).named_parameters(recurse=False))
        by_id = {id(p): name for name, p in head.items()}
        return [(name, by_id[id(p)]) for name, p in self.root.get_submodule(self.embed).named_parameters(recurse=False)
                if id(p) in by_id]


class PipelineGap(nn.Module):
    """Stands in for a part another stage holds: no parameters of its own (a `TiedGap` names the head's);
    passes its first input through."""

    def forward(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        return x if x is not None else kwargs.get("hidden_states")


class TiedGap(PipelineGap):
    """The input embedding's place on a rank whose last stage holds the output head tied to it.

    It computes nothing, like any gap, but keeps the shared weight under the embedding's name: the
    parameter is then named as in the whole model on every rank (`named_parameters` lists the
    embedding's name first), so checkpoints, optimizer state and the HF export move between
    pipeline degrees. `ties`: (embedding attribute, head attribute) pairs (`PipelineParts.tied_weights`).
    It takes the head's Parameters in `retie`, once sharding (FSDP, TP) has given the head its own: before,
    the tensor-parallel plan would see a tie it must keep and lay out only one end of it."""

    def __init__(self, ties: Sequence[tuple[str, str]]) -> None:
        super().__init__()
        self.ties = list(ties)

    def retie(self, head: nn.Module) -> None:
        """Share the head's current Parameters."""
        for embed_attribute, head_attribute in self.ties:
            self._parameters[embed_attribute] = getattr(head, head_attribute)


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
    """Replace, in place, every part that rank `pp_rank`'s stages do not hold by a `PipelineGap` (a `TiedGap` for
    an embedding tied to a head this rank holds); returns the paths of the parts it keeps. A second call changes
    nothing."""
    keep = {slot for stage in layout.stage_ids(pp_rank) for slot in stage_slots(parts, layout, stage)}
    n_layers = len(parts.layer_list())
    if n_layers != sum(layout.layers_per_stage):
        raise ValueError(f"pipeline layout covers {sum(layout.layers_per_stage)} layers, the model has {n_layers}")
    every = [parts.embed, *(f"{parts.layers}.{i}" for i in range(n_layers)), parts.norm, parts.head]
    ties = parts.tied_weights()
    for slot in every:
        if slot not in keep and not isinstance(parts.root.get_submodule(slot), PipelineGap):  # split once
            tied_head = ties and slot == parts.embed and parts.head in keep
            _set_submodule(parts.root, slot, TiedGap(ties) if tied_head else PipelineGap())
    return [slot for slot in every if slot in keep]


@dataclass
class TiedStageWeights:
    """The weights the first stage's embedding shares with the last stage's head, on one of the two
    pipeline ranks that hold them (tied embeddings).

    Each of the two ranks holds its own copy. Their gradients are the two halves of one gradient,
    dL/dW = (embedding's) + (head's): `sync_gradients` sums them on both ranks, so both copies take
    the same optimizer step and stay equal. The norm counts the first stage's copy only.

    Under a V schedule with ZeRO-3 both ends are stages of one rank, each its own FSDP unit, and one
    Parameter cannot belong to two units: the head then holds `mirrors`, copies of `params` sharded
    alike. A mirror takes no optimizer step (`leave_out_of`): its gradient is added to its weight's
    (`sync_gradients`) and the stepped weight copied back into it (`copy_to_mirrors`)."""

    params: list[nn.Parameter]
    group: Optional[dist.ProcessGroup]
    """This rank and the other end of its pipeline (the same dp, cp and tp coordinates); None when this rank holds
    both ends (`mirrors`)."""
    counted: bool
    """Whether this rank's copy counts in the global gradient norm (the first stage's does)."""
    mirrors: list[nn.Parameter] = field(default_factory=list)
    """Both ends on this rank: the head's copies of `params`, in the same order."""

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Once per optimizer step, after the last backward; both ranks call it."""
        if self.group is None:
            for param, mirror in zip(self.params, self.mirrors):
                if mirror.grad is not None and param.requires_grad:
                    if param.grad is None:
                        param.grad = mirror.grad
                    else:  # cut alike (`_check_same_layout`), so the local blocks add up element by element
                        _local(param.grad).add_(_local(mirror.grad))
                mirror.grad = None
            return
        for param in self.params:
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            # Both ends shard the weight alike (FSDP over the same dp ranks, the same tp layout: checked in
            # `tie_stage_weights`), so the local blocks add up element by element.
            dist.all_reduce(_local(param.grad), group=self.group)

    @torch.no_grad()
    def copy_to_mirrors(self) -> None:
        """After each optimizer step (and once the weights are in place): the head's copies take the weights' values."""
        for param, mirror in zip(self.params, self.mirrors):
            _local(mirror).copy_(_local(param))

    def leave_out_of(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the mirrors out of `optimizer`'s parameter groups (before its first step): it then holds the tied weight
        once, as under every other layout, and so does its checkpoint."""
        mirrors = {id(m) for m in self.mirrors}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in mirrors]

    def not_counted(self) -> list[torch.Tensor]:
        """The gradients a norm over this rank's parameters must leave out (another rank counts them)."""
        return [] if self.counted else [p.grad for p in self.params if p.grad is not None]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def head_holds_tied_copy(zero_stage: int, both_ends_here: bool) -> bool:
    """Whether the head holds its own copy of a weight it shares with the embedding (`TiedStageWeights.mirrors`):
    under ZeRO-3 on a rank holding both the first and the last stage (a V schedule), where each stage is its own
    FSDP unit and one Parameter cannot belong to two. ZeRO-1/2 have no units and keep the one weight."""
    return zero_stage == 3 and both_ends_here


def untie_stage_weights(parts: PipelineParts, ties: Sequence[tuple[str, str]]) -> None:
    """Give the head its own copy of each weight it shares with the embedding (before sharding, on a rank holding
    both ends; a no-op elsewhere); `tie_stage_weights` then makes them its mirrors."""
    embed, head = parts.root.get_submodule(parts.embed), parts.root.get_submodule(parts.head)
    if isinstance(embed, PipelineGap) or isinstance(head, PipelineGap):
        return
    for embed_attribute, head_attribute in ties:
        weight = getattr(embed, embed_attribute)
        setattr(head, head_attribute, nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad))


def tie_stage_weights(parts: PipelineParts, ties: Sequence[tuple[str, str]], world: Any, pp_rank: int,
                      ends_on_one_rank: bool = False) -> Optional[TiedStageWeights]:
    """After sharding, for a model whose embedding and head share `ties` (`PipelineParts.tied_weights()`, read
    before the split): the `TiedGap` of the rank holding the head shares the head's new Parameters, and the
    first and last pipeline ranks of every (dp, cp, tp) coordinate get a process group for their tied
    gradients. Every rank calls it (it creates process groups); returns None on a rank holding neither end.
    `world`: the device mesh, pipeline axis first. `ends_on_one_rank`: the V placement, after
    `untie_stage_weights` on the rank holding both ends: no process group; the head's copies become mirrors,
    equal to the weights from here on."""
    if ends_on_one_rank:
        embed, head = parts.root.get_submodule(parts.embed), parts.root.get_submodule(parts.head)
        if isinstance(embed, PipelineGap):
            return None
        tied = TiedStageWeights([getattr(embed, name) for name, _ in ties], None, counted=True,
                                mirrors=[getattr(head, name) for _, name in ties])
        _check_same_layout(tied)
        tied.copy_to_mirrors()
        return tied
    if world.mesh_dim_names[0] != "pp":
        raise ValueError(f"tie_stage_weights needs the pipeline axis first; the mesh has {world.mesh_dim_names}")
    ranks = world.mesh.reshape(world.mesh.shape[0], -1)  # (pp, every other coordinate)
    group, _ = dist.new_subgroups_by_enumeration([[int(ranks[0, j]), int(ranks[-1, j])] for j in range(ranks.shape[1])])
    embed = parts.root.get_submodule(parts.embed)
    if isinstance(embed, TiedGap):
        embed.retie(parts.root.get_submodule(parts.head))
    elif isinstance(embed, PipelineGap):
        return None
    assert group is not None
    tied = TiedStageWeights([getattr(embed, name) for name, _ in ties], group, counted=pp_rank == 0)
    _check_same_layout(tied)
    with torch.no_grad():  # the two ends start equal, whichever way each was initialised (meta init draws per rank)
        for param in tied.params:
            dist.broadcast(_local(param), src=dist.get_global_rank(group, 0), group=group)
    return tied


def _check_same_layout(tied: TiedStageWeights) -> None:
    """The two copies must be cut alike (FSDP over the same dp ranks; the embedding's and the head's tensor-parallel
    layouts, which the plan chooses separately, the same), or their local gradients do not add up."""
    def layout(params: Sequence[nn.Parameter]) -> list[tuple[str, tuple[int, ...]]]:
        return [(str(tuple(p.placements)) if isinstance(p, DTensor) else "None", tuple(_local(p).shape)) for p in params]

    both: list[Any] = [None, None]
    if tied.group is None:
        both = [layout(tied.params), layout(tied.mirrors)]
    else:
        dist.all_gather_object(both, layout(tied.params), group=tied.group)
    if both[0] != both[1]:
        raise ValueError(
            "pipeline parallel with tied embeddings: the first stage's embedding and the last stage's head lay out their "
            f"shared weight differently ({both[0]} vs {both[1]}: placements and local shape); give both the same "
            "tensor-parallel layout (a vocab-parallel embedding and a column-parallel head both shard dim 0)"
        )


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
    problem = microbatch_split_problem(
        count, microbatches, "pipeline parallel: the local batch holds",
        fix=" (every micro-batch must have the same shape). Make the batch size a multiple of it (and drop the last, "
            "smaller batch: `drop_last=True`)")
    if problem is not None:
        raise ValueError(problem.text())


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

    def _schedule(self, train: bool, key: tuple[Any, ...], with_loss: bool = True) -> Any:
        """torch's schedule over this rank's stages for batches of `key` (cached); `with_loss=False`: no loss
        function, the last stage's outputs are the result (forward only)."""
        schedule = self._schedules.get((train, with_loss, *key))
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
        loss_fn = self._loss_fn if with_loss else None
        if issubclass(cls, PipelineScheduleSingle):
            schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = cls(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        self._schedules[(train, with_loss, *key)] = schedule
        return schedule

    def logits(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The model's output for the local batch (forward only, every micro-batch), on every pipeline rank: the
        rank holding the last stage sends it to the others (one broadcast over the pp group)."""
        _split_count(input_ids.shape[0], self.layout.microbatches)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        schedule = self._schedule(False, tuple(input_ids.shape), with_loss=False)
        with torch.no_grad():
            output = schedule.eval(*((input_ids,) if self.has_first_stage else ()), position_ids=position_ids)
        if dist.get_world_size(self.group) == 1:
            return output
        # The last stage's pp rank: the one whose stages include num_stages - 1.
        last = next(r for r in range(dist.get_world_size(self.group))
                    if self.layout.num_stages - 1 in self.layout.stage_ids(r))
        source = dist.get_global_rank(self.group, last)
        header: list[Any] = [(tuple(output.shape), output.dtype) if self.has_last_stage else None]
        dist.broadcast_object_list(header, src=source, group=self.group)
        shape, dtype = header[0]
        out = output.contiguous() if self.has_last_stage else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(out, src=source, group=self.group)
        return out

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
