"""A pipeline priced as the strategy runs it: torch's own schedule action lists, played with each stage's times.

torch builds every rank's list of compute actions (F: forward, B: full backward, I / W: the input- and
weight-gradient halves of a split backward) when a schedule is constructed (`schedule.pipeline_order`). The
lists are built here from placeholder stages (no process group, no model), so the planner prices exactly
the order a run executes, for every schedule the strategy accepts (`rules.SCHEDULES`), any number of virtual
stages and any layer split (`PipelineLayout`, the strategy's own).

`play` runs those lists on the dependency graph with the stages' own durations and free communication
(`makespan`): the step's length is then compute + bubble, imbalance between stages included. The same order
gives each rank's activation holding: a micro-batch's activations of a stage live from its F to its B (or
to its W, which still needs the layer inputs), so a rank's peak is the most layer-micro-batches it holds
at once (1F1B's rank r: p - r micro-batches; GPipe: all m).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

from ultrascale.parallel.pipeline import PipelineLayout

__all__ = ["PipelinePlay", "balanced_layers", "compute_actions", "makespan", "play", "schedule_actions", "timeline"]

PLAYED_ROUNDS = 4
"""Micro-batches played per pipeline rank (m' = 4p, or m when smaller); later ones run in the steady state."""

Action = tuple[int, str, int]
"""(stage, "F" / "B" / "I" / "W", micro-batch)."""


class _PlaceholderStage:
    """What a torch schedule's constructor reads from its stages to build the action lists."""

    def __init__(self, index: int, num_stages: int, pp: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_rank, self.group_size = 0, pp
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = nn.Module()  # the zero-bubble runtimes look for FSDP modules in it


def compute_actions(pipeline_order: dict) -> dict[int, list[Action]]:
    """A torch `pipeline_order` reduced to each rank's compute actions, in order (an overlapped F+B is its F,
    then its B; communication, gradient reductions and idle slots dropped)."""
    orders: dict[int, list[Action]] = {}
    for rank, actions in pipeline_order.items():
        flat = []
        for action in actions:
            if action is None:
                continue
            for part in action.sub_actions or (action,):
                kind = part.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    flat.append((part.stage_index, kind, part.microbatch_index))
        orders[rank] = flat
    return orders


@functools.lru_cache(maxsize=512)
def schedule_actions(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's compute actions as torch's `schedule` orders them for pp ranks x virtual_stages stages and
    `microbatches` micro-batches (the constructor's own refusals propagate as ValueError)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    if schedule == "1F1B":
        return tuple(_one_f_one_b(rank, pp, microbatches) for rank in range(pp))
    layout = PipelineLayout(pp=pp, schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches,
                            layers_per_stage=(1,) * (pp * virtual_stages))
    num_stages = layout.num_stages
    stages = [_PlaceholderStage(s, num_stages, pp) for s in layout.stage_ids(0)]
    cls = _without_lowering(get_schedule_class(schedule))
    def loss(output, target):
        return output
    built = (cls(stages[0], n_microbatches=microbatches, loss_fn=loss) if issubclass(cls, PipelineScheduleSingle)
             else cls(stages, n_microbatches=microbatches, loss_fn=loss))
    orders = compute_actions(built.pipeline_order)
    return tuple(tuple(orders[rank]) for rank in range(pp))


@functools.lru_cache(maxsize=None)
def _without_lowering(cls: type) -> type:
    """`cls` whose constructor stops at the compute order: the runtime schedules' constructors then lower it to
    communication actions (`_prepare_schedule_with_comms`: unshard / reshard, gradient reductions, sends and
    receives), which the planner never reads and which is most of the construction (64 ranks: 0.1 s a schedule). The
    order is still validated as the lowering validates it, stage mapping included."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineScheduleRuntime

    if not issubclass(cls, _PipelineScheduleRuntime):
        return cls

    def validate_only(self: Any, actions: dict, format: str = "compute_only") -> None:
        PipelineScheduleMulti._validate_and_set_stage_mapping(self, actions)

    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": validate_only})


def _one_f_one_b(rank: int, pp: int, m: int) -> tuple[Action, ...]:
    """The order `Schedule1F1B._step_microbatches` runs on pp rank `rank`: min(m, p - rank) forwards, then a
    backward and a forward in turn while forwards remain, then the remaining backwards. (Its `pipeline_order`
    is descriptive only, not what the runtime executes, and skips the last rank's first forward.)"""
    warmup = min(m, pp - rank)
    actions: list[Action] = [(rank, "F", mb) for mb in range(warmup)]
    for mb in range(m):
        actions.append((rank, "B", mb))
        if warmup + mb < m:
            actions.append((rank, "F", warmup + mb))
    return tuple(actions)


def makespan(orders: dict[int, Sequence[tuple[int, str, int, float]]], num_stages: int,
             record: Optional[dict[int, list[tuple[int, str, int, float, float]]]] = None,
             visits: Optional[list[tuple[int, int, Optional[tuple[str, int, int]], tuple[str, int, int]]]] = None) -> float:
    """Length of a step whose ranks run their (stage, kind, micro-batch, duration) actions in the given order,
    each rank on its own device, an action starting when its rank is free and its input exists: F(s, i) needs
    F(s-1, i); B or I (s, i) needs B or I (s+1, i). The rest (B after F, W after I) happens on the same rank,
    earlier in its order. `record`, if given, gets each rank's (stage, kind, micro-batch, start, end); `visits`, every
    action as (rank, duration slot, the output it waits for or None, the output it makes) in the order it was run,
    an order in which each input comes first (`_dependency_order`)."""
    # Event-driven: a rank runs its actions until one needs an input not yet made, then waits on that input and is
    # resumed when it is made; each action is visited once (a rescan of every rank per pass was O(ranks x passes)).
    # Times do not depend on the order ranks are visited in: start = max(the rank free, the input made).
    ends: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(orders, 0.0)
    next_action = dict.fromkeys(orders, 0)
    waiting: dict[tuple[str, int, int], list[int]] = {}
    runnable = list(orders)
    last_stage = num_stages - 1
    done = 0
    while runnable:
        r = runnable.pop()
        actions, i, t = orders[r], next_action[r], free[r]
        while i < len(actions):
            stage, kind, mb, duration = actions[i]
            if kind == "F":
                needs = ("F", stage - 1, mb) if stage > 0 else None
            elif kind == "B" or kind == "I":
                needs = ("B", stage + 1, mb) if stage < last_stage else None
            else:
                needs = None
            start = t
            if needs is not None:
                made = ends.get(needs)
                if made is None:
                    waiting.setdefault(needs, []).append(r)
                    break
                if made > start:
                    start = made
            t = start + duration
            made_key = ("B" if kind == "B" or kind == "I" else kind, stage, mb)
            ends[made_key] = t
            if record is not None:
                record.setdefault(r, []).append((stage, kind, mb, start, t))
            if visits is not None:
                visits.append((r, _KIND_SLOT[kind] * num_stages + stage, needs, made_key))
            woken = waiting.pop(made_key, None)
            if woken:
                runnable.extend(woken)
            i += 1
        done += i - next_action[r]
        next_action[r], free[r] = i, t
    if done != sum(len(actions) for actions in orders.values()):
        raise RuntimeError("the actions' dependencies form a cycle: not a valid pipeline order")
    return max(free.values())


@dataclass(frozen=True)
class PipelinePlay:
    """One optimizer step of a pipeline, played."""

    step: float
    """Seconds of the step without communication: compute of the busiest rank + its idle time (the bubble)."""
    busiest: float
    """Compute seconds of the busiest rank."""
    peak_layers: tuple[float, ...]
    """Per rank: the most layer-micro-batches of activations it holds at once (a stage of n layers holding k
    micro-batches counts n·k)."""


def _played_microbatches(schedule: str, layout: PipelineLayout) -> int:
    """How many micro-batches `play` plays of torch's lists: m' = min(m, 4p); GPipe, whose holding grows with m, all."""
    return layout.microbatches if schedule == "GPipe" else min(layout.microbatches, PLAYED_ROUNDS * layout.pp)


def timeline(schedule: str, layout: PipelineLayout, forward: Sequence[float], backward: Sequence[float],
             weight: Sequence[float]) -> dict[int, list[tuple[int, str, int, float, float]]]:
    """Each rank's actions as `play` plays them: (stage, kind, micro-batch, start, end), seconds (`plan --plot`)."""
    orders = schedule_actions(schedule, layout.pp, layout.virtual_stages, _played_microbatches(schedule, layout))
    durations = {"F": forward, "B": backward, "W": weight, "I": [b - w for b, w in zip(backward, weight)]}
    timed = {r: [(s, kind, mb, durations[kind][s]) for s, kind, mb in actions] for r, actions in enumerate(orders)}
    out: dict[int, list[tuple[int, str, int, float, float]]] = {}
    makespan(timed, layout.num_stages, out)
    return out


def play(schedule: str, layout: PipelineLayout, forward: Sequence[float], backward: Sequence[float],
         weight: Sequence[float]) -> PipelinePlay:
    """The step of `layout` under torch's `schedule` with stage s taking forward[s] for F, backward[s] for B, and
    backward[s] - weight[s] + weight[s] split into I then W under a zero-bubble schedule (seconds per micro-batch).

    torch's lists are played for m' = min(m, 4p) micro-batches (rounded to what the schedule accepts); each
    micro-batch beyond them adds the busiest rank's F + B of one micro-batch, the steady state's rate. GPipe,
    whose holding grows with m, is played whole."""
    pp, m = layout.pp, layout.microbatches
    played = _played_microbatches(schedule, layout)
    per_microbatch = [sum(forward[s] + backward[s] for s in layout.stage_ids(r)) for r in range(pp)]
    durations = [*forward, *backward, *weight, *(b - w for b, w in zip(backward, weight))]
    step = _replay(_dependency_order(schedule, pp, layout.virtual_stages, played), durations, pp)
    step += (m - played) * max(per_microbatch)
    return PipelinePlay(step=step, busiest=m * max(per_microbatch), peak_layers=held_layers(schedule, layout))


def held_layers(schedule: str, layout: PipelineLayout) -> tuple[float, ...]:
    """`play`'s `peak_layers`, without the stage times: which activations a rank holds depends only on its order."""
    return _peak_layers(schedule, layout.pp, layout.virtual_stages, _played_microbatches(schedule, layout),
                        layout.layers_per_stage)


_KIND_SLOT = {"F": 0, "B": 1, "W": 2, "I": 3}
"""Where an action's duration sits in `play`'s flat list: forward, backward, weight, input-gradient, each per stage."""


@functools.lru_cache(maxsize=512)
def _dependency_order(schedule: str, pp: int, virtual_stages: int, played: int) -> tuple[tuple[int, int, int], ...]:
    """torch's action lists in an order `makespan` can run them in, as (rank, duration slot, index of the action
    whose output it waits for or -1). Which action waits on which does not depend on the durations, so a search
    that plays one schedule at many stage times walks this flat list (`_replay`) instead of the event queue."""
    orders = schedule_actions(schedule, pp, virtual_stages, played)
    num_stages = pp * virtual_stages
    timed = {r: [(s, kind, mb, 0.0) for s, kind, mb in actions] for r, actions in enumerate(orders)}
    visits: list[tuple[int, int, Optional[tuple[str, int, int]], tuple[str, int, int]]] = []
    makespan(timed, num_stages, visits=visits)
    index_of: dict[tuple[str, int, int], int] = {}
    flat = []
    for i, (rank, slot, needs, made) in enumerate(visits):
        flat.append((rank, slot, index_of[needs] if needs is not None else -1))
        index_of[made] = i
    return tuple(flat)


def _replay(order: tuple[tuple[int, int, int], ...], durations: list[float], pp: int) -> float:
    """`makespan` of a `_dependency_order`: each action starts when its rank is free and its input is made."""
    ends = [0.0] * len(order)
    free = [0.0] * pp
    for i, (rank, slot, needs) in enumerate(order):
        start = free[rank]
        if needs >= 0 and ends[needs] > start:
            start = ends[needs]
        free[rank] = ends[i] = start + durations[slot]
    return max(free)


@functools.lru_cache(maxsize=4096)
def _peak_layers(schedule: str, pp: int, virtual_stages: int, played: int, layers_per_stage: tuple[int, ...]
                 ) -> tuple[float, ...]:
    """Per rank, the most layer-micro-batches of activations held at once: a stage's F adds its layers, its B (or,
    when the backward is split, its W) frees them."""
    peaks = []
    for actions in schedule_actions(schedule, pp, virtual_stages, played):
        live = peak = 0.0
        split = {(s, mb) for s, kind, mb in actions if kind == "W"}
        for s, kind, mb in actions:
            if kind == "F":
                live += layers_per_stage[s]
                peak = max(peak, live)
            elif kind == "W" or (kind == "B" and (s, mb) not in split):
                live -= layers_per_stage[s]
        peaks.append(peak)
    return tuple(peaks)


def balanced_layers(n_layers: int, num_stages: int) -> tuple[int, ...] | None:
    """The split that counts the embedding and the loss as a layer each (Megatron-LM's
    `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`; Llama 3 405B's 126 layers on
    16 stages: 7, 8 x 14, 7): n + 2 units spread evenly, the remainder on the middle stages, then the first and
    the last stage give one back. None where a stage would be left without a layer."""
    base, extra = divmod(n_layers + 2, num_stages)
    units = [base] * num_stages
    middle = list(range(1, num_stages - 1)) or list(range(num_stages))
    for k in range(extra):
        units[middle[k % len(middle)]] += 1
    units[0] -= 1
    units[-1] -= 1
    if min(units) < 1:
        return None
    return tuple(units)
