"""The named layouts of `ultrascale verify --against NAME` and `ultrascale verify-matrix`, as `UltraScaleStrategy`
knobs at a world size. Whether a layout runs for a model is the rulebook's call (`ultrascale.parallel.rules`);
a name only says which degrees to ask for, and when the world is too small for the name to mean anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class NamedLayout:
    name: str
    what: str
    knobs: Callable[[int], dict[str, Any]]
    """The strategy's knobs at a world size."""
    min_world: int = 1
    multiple_of: int = 1
    moe: bool = False
    """Needs a Mixture-of-Experts model."""

    def fits(self, world: int) -> str | None:
        """None when the name means something at `world`, else why not."""
        if world < self.min_world or world % self.multiple_of:
            multiple = f", a multiple of {self.multiple_of}" if self.multiple_of > 1 else ""
            return f"{self.name} needs a world of at least {self.min_world}{multiple}"
        return None


LAYOUTS: dict[str, NamedLayout] = {layout.name: layout for layout in [
    NamedLayout("zero1", "ZeRO-1 over every rank", lambda w: {"data_parallel_shard": w, "zero_stage": 1}),
    NamedLayout("zero2", "ZeRO-2 over every rank", lambda w: {"data_parallel_shard": w, "zero_stage": 2}),
    NamedLayout("zero3", "ZeRO-3 (FSDP2) over every rank", lambda w: {"data_parallel_shard": w}),
    NamedLayout("hsdp", "HSDP: 2 replicas x w/2 shards", lambda w: {"data_parallel_replicate": 2, "data_parallel_shard": w // 2},
                min_world=4, multiple_of=2),
    NamedLayout("tp", "tensor + sequence parallel over every rank", lambda w: {"data_parallel_shard": 1, "tensor_parallel": w},
                min_world=2),
    NamedLayout("cp_ring", "context parallel over every rank, ring attention",
                lambda w: {"data_parallel_shard": 1, "context_parallel": w, "context_parallel_method": "ring"}, min_world=2),
    NamedLayout("cp_allgather", "context parallel over every rank, all-gathered K/V",
                lambda w: {"data_parallel_shard": 1, "context_parallel": w, "context_parallel_method": "allgather"}, min_world=2),
    NamedLayout("cp_usp", "context parallel over every rank as USP: Ulysses pairs, the ring across them",
                lambda w: {"data_parallel_shard": 1, "context_parallel": w, "context_parallel_method": "usp",
                           "context_parallel_ulysses": 2}, min_world=4, multiple_of=2),
    NamedLayout("pp_1f1b", "2 pipeline stages (1F1B) x ZeRO-3 over w/2",
                lambda w: {"pipeline_parallel": 2, "data_parallel_shard": w // 2, "pipeline_schedule": "1F1B"},
                min_world=2, multiple_of=2),
    NamedLayout("pp_zbv", "2 pipeline ranks x 2 stages (ZBVZeroBubble) x ZeRO-3 over w/2",
                lambda w: {"pipeline_parallel": 2, "data_parallel_shard": w // 2, "pipeline_schedule": "ZBVZeroBubble"},
                min_world=2, multiple_of=2),
    NamedLayout("ep", "expert parallel over every rank, ZeRO-3 (MoE model)",
                lambda w: {"data_parallel_shard": w, "expert_parallel": w}, min_world=2, moe=True),
    NamedLayout("ep_zero1", "expert parallel 2 x ZeRO-1 over every rank (MoE model)",
                lambda w: {"data_parallel_shard": w, "expert_parallel": 2, "zero_stage": 1}, min_world=2, multiple_of=2,
                moe=True),
    NamedLayout("ep_x_tp", "tp 2 x expert parallel 2 x ZeRO-3 over w/2 (MoE model)",
                lambda w: {"tensor_parallel": 2, "data_parallel_shard": w // 2, "expert_parallel": 2}, min_world=4,
                multiple_of=4, moe=True),
    NamedLayout("tp_x_dp", "tp 2 x ZeRO-3 over w/2", lambda w: {"tensor_parallel": 2, "data_parallel_shard": w // 2},
                min_world=4, multiple_of=2),
    NamedLayout("pp_x_dp_x_tp", "pp 2 (1F1B) x ZeRO-3 over w/4 x tp 2",
                lambda w: {"pipeline_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": w // 4},
                min_world=8, multiple_of=4),
    NamedLayout("auto", "ultrascale_4d: the planner's layout, chosen when the ranks start", lambda w: {"auto_layout": True}),
]}

ONE = "one"
"""`--against one`: the same recipe on one process and one device."""


def layout_names() -> str:
    return ", ".join([ONE, *LAYOUTS])
