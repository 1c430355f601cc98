"""Pipeline bubble: the idle share of torch's pipeline schedules, measured, beside theory; peak activations per rank.

Every schedule of `torch.distributed.pipelining.schedules` (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) runs on p gloo CPU ranks forked by
`ultrascale.launch.run_ranks` (1 torch thread each), with m micro-batches per step. Nothing of the
schedule is ours: torch's `PipelineStage` and schedule classes run it, and a (schedule, p, m) that torch's
constructor refuses (DualPipeV needs m >= 2p; the interleaved ones m a multiple of the rounds) is skipped
with torch's reason.

Stages of fixed work. The model is --layers layers `x <- tanh((x + b) @ W)` (W: dim x dim) on
micro-batches of (--microbatch, dim), split evenly over the p * v stages (v = 1 for GPipe/1F1B, 2 for the
others: loop placement, rank r holds stages r and r + p, for Interleaved1F1B/LoopedBFS/
InterleavedZeroBubble; V placement, rank r holds stages r and 2p - 1 - r, for ZBVZeroBubble/DualPipeV).
A step therefore does the same work under every schedule at a given p. A layer's backward is two matmuls
of the forward's size (input and weight gradient), so B ~ 2F and the zero-bubble split gives I ~ W ~ F,
the cost model the zero-bubble schedules are designed for. The bias sits before the matmul so that even
the first layer needs its input gradient (for b): stage 0 then costs what the others cost, as the
formulas assume (torch still runs stage 0's split backward all in W: its I is empty).

Bubble, the quantity the textbook formulas give: idle time / compute time over all ranks of a step
(as a share of the step it is b / (1 + b)). The columns:

- theory: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for Interleaved1F1B and LoopedBFS; for the
  zero-bubble schedules only "below (p-1)/(v*m)".
- torch's actions: the action lists torch builds for all ranks (`schedule.pipeline_order`), played on
  the dependency graph below with F = I = W = 1, B = 2 and free communication. The lists are not read
  as timelines: they give every action one slot (a full backward as long as a forward), and those of
  GPipe/1F1B carry no idle slots. A list that does not run every micro-batch through each of its
  stages once is reported instead of played.
- replayed: the measured run. Every forward and backward call of every stage is timed by the CPU
  time of the thread that runs it (`time.thread_time`, which does not grow while the rank waits for a
  message or for a core), and kept in the order the rank ran them. That order is played on the
  dependency graph (F of stage s after F of s-1 for the same micro-batch; B or I of s after B or I of
  s+1; each rank one action at a time, in its order) with each (stage, kind)'s median time, which gives
  the step's length with one core per rank and free communication, the makespan:
  bubble = (p * makespan - compute) / compute, compute = the sum of the durations. It holds whatever
  the number of cores, so it is the column to trust when ranks outnumber them. The summary also plays
  it with every stage's times scaled to the median stage's time per micro-batch (keeping each stage's
  F/B/I/W split): the stages are equal by construction, and what that changes is a core that ran
  slower than another.
- each call: the same with every call's own time (median over the steps). The machine's jitter
  lengthens the critical path; the gap to *replayed* shows how much.
- wall: the measured step time (from the barrier before the step to the last rank's return;
  time.perf_counter is one clock for all processes) against the measured compute, median over the
  steps. It adds what the replay leaves out: gloo transfers, the schedule runtime's Python, the loss.
  Only sound with a core per rank: with more ranks than cores (marked †) p x step time >= p / cores x
  compute by construction, a rank also waits for a core, and other ranks' work fills its waits.

Peak activations: a micro-batch holds its stage's saved activations from the end of its forward to the
end of its backward (B, or W of a split backward, which still needs the layer inputs). Each stage counts
the bytes autograd saves in each forward (`saved_tensors_hooks`, parameters excluded, a tensor saved
twice counted once) and keeps them live until that backward ends; the table gives, per rank, the peak of
the live bytes over the step in micro-batches of the rank's layers (1F1B: p - r on rank r; GPipe: m)
and the largest in MiB.

Each configuration runs one warm-up step (p2p setup, shape inference) and --steps timed steps. The
micro-batch losses are checked to agree across schedules and p. The machine may be shared: through
benchmarks/_common.py's `Undisturbed`, a run waits (at most 10 s) for idle cores and is redone
when other processes took more than 15% of them, within --max-wait s in all.

    python benchmarks/pp_bubble.py [--ps 2 4] [--ms 4 8 16] [--schedules GPipe 1F1B ...] [--steps 4]
        [--dim 512] [--microbatch 128] [--layers 8] [--max-wait 120]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

sys.path.insert(0, str(Path(__file__).parent))
from _common import Undisturbed, cores, load_average, write_results  # noqa: E402
from _common import machine as machine_line

from ultrascale.launch import init_gloo  # noqa: E402
from ultrascale.parallel.device import tune_cpu_allocator  # noqa: E402
from ultrascale.planner.pipeline import compute_actions, makespan  # noqa: E402

MiB = 2**20
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_PLACED = ("ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
UNIT_COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


# ----------------------------------------------------------------------------- the stages


class FixedWork(nn.Module):
    """`n_layers` times x <- tanh((x + b) @ W): the same work for every micro-batch. The bias before the
    matmul makes even the first layer compute its input gradient (for b), so every stage costs the same.
    Weights are seeded by global layer index: every split of the layers computes the same function."""

    def __init__(self, first_layer: int, n_layers: int, dim: int) -> None:
        super().__init__()
        generators = [torch.Generator().manual_seed(layer) for layer in range(first_layer, first_layer + n_layers)]
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5) for g in generators)
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(dim)) for _ in generators)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, b in zip(self.weights, self.biases):
            x = torch.tanh((x + b) @ w)
        return x


@dataclass
class RankLog:
    """One rank's compute actions of a step, in the order it ran them, and its live activation bytes."""

    events: list[tuple[int, str, int, float]] = field(default_factory=list)  # (stage, F/B/I/W, micro-batch, CPU s)
    live_bytes: int = 0
    peak_bytes: int = 0

    def reset(self) -> None:
        self.events.clear()
        self.live_bytes = self.peak_bytes = 0


class TimedStage(PipelineStage):
    """torch's `PipelineStage`, with its forward and backward calls timed (thread CPU time) and the
    activations they save counted. The schedules call these three methods for every compute action."""

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, log: RankLog) -> None:
        super().__init__(module, stage_index, num_stages, torch.device("cpu"))
        self.log = log
        self.param_ptrs = {p.data_ptr() for p in module.parameters()}
        self.saved_bytes: dict[int, int] = {}  # micro-batch -> bytes its forward saved, while live
        self.bytes_per_microbatch = 0

    def _timed(self, kind: str, mb: int, call, *args, **kwargs):
        start = time.thread_time()
        result = call(*args, **kwargs)
        self.log.events.append((self.stage_index, kind, mb, time.thread_time() - start))
        return result

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        seen: set[int] = set()

        def count(t: torch.Tensor) -> torch.Tensor:
            # A tensor that several ops save is stored once; while saved, its address is not reused.
            if t.data_ptr() not in self.param_ptrs and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                self.saved_bytes[fwd_chunk_id] = self.saved_bytes.get(fwd_chunk_id, 0) + t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            output = self._timed("F", fwd_chunk_id, super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)
        self.bytes_per_microbatch = self.saved_bytes.get(fwd_chunk_id, 0)
        self.log.live_bytes += self.bytes_per_microbatch
        self.log.peak_bytes = max(self.log.peak_bytes, self.log.live_bytes)
        return output

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self._timed("B" if full_backward else "I", bwd_chunk_id, super().backward_one_chunk,
                    bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if full_backward:
            self.log.live_bytes -= self.saved_bytes.pop(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        self._timed("W", bwd_chunk_id, super().backward_weight_one_chunk, bwd_chunk_id, last_backward=last_backward)
        self.log.live_bytes -= self.saved_bytes.pop(bwd_chunk_id)


def stages_per_rank(schedule: str) -> int:
    return 1 if issubclass(get_schedule_class(schedule), PipelineScheduleSingle) else 2


def stage_ids(schedule: str, rank: int, p: int) -> list[int]:
    if schedule in V_PLACED:
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(stages_per_rank(schedule))]


# ----------------------------------------------------------------------------- the bubble


def bubble(p: int, length: float, compute: float) -> float:
    """Idle over compute for p ranks busy `compute` in all during a step of `length`."""
    return (p * length - compute) / compute


def _span(indices: list[int]) -> str:
    contiguous = indices == list(range(indices[0], indices[0] + len(indices))) if indices else False
    return f"{indices[0]}..{indices[-1]}" if contiguous else str(indices)


def torch_actions_bubble(schedule, m: int) -> float | str:
    """The bubble of torch's action lists for all ranks, played with unit costs (see module docstring),
    or what is wrong with the lists when they do not run every micro-batch through every stage once."""
    orders = {rank: [(stage, kind, mb, UNIT_COST[kind]) for stage, kind, mb in actions]
              for rank, actions in compute_actions(schedule.pipeline_order).items()}
    num_stages = 1 + max(s for flat in orders.values() for s, *_ in flat)
    for rank, flat in orders.items():
        for stage in {s for s, *_ in flat}:
            forwards = sorted(mb for s, kind, mb, _ in flat if s == stage and kind == "F")
            backwards = sorted(mb for s, kind, mb, _ in flat if s == stage and kind in "BI")
            if forwards != list(range(m)) or backwards != list(range(m)):
                return (f"rank {rank}'s list runs stage {stage}'s forward on micro-batches {_span(forwards)} and its "
                        f"backward on {_span(backwards)}, where the step has 0..{m - 1}")
    compute = sum(d for flat in orders.values() for *_, d in flat)
    return bubble(len(orders), makespan(orders, num_stages), compute)


# ----------------------------------------------------------------------------- one configuration


def _run(rank: int, p: int, schedule_name: str, m: int, args) -> dict:
    torch.set_num_threads(1)
    tune_cpu_allocator()  # as the strategies do on CPU: no page faults in the timed calls from a trimmed heap
    init_gloo(rank, p)
    v = stages_per_rank(schedule_name)
    num_stages, layers_per_stage = p * v, args.layers // (p * v)
    log = RankLog()
    stages = [TimedStage(FixedWork(s * layers_per_stage, layers_per_stage, args.dim), s, num_stages, log)
              for s in stage_ids(schedule_name, rank, p)]
    try:
        schedule = get_schedule_class(schedule_name)(stages[0] if v == 1 else stages, n_microbatches=m,
                                                     loss_fn=F.mse_loss)
    except ValueError as refused:  # deterministic: every rank refuses alike
        return {"refused": str(refused)}
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    inputs = (torch.randn(m * args.microbatch, args.dim, generator=torch.Generator().manual_seed(0)),) if has_first else ()
    target = torch.zeros(m * args.microbatch, args.dim) if has_last else None
    steps = []
    for step in range(1 + args.steps):  # the first one sets up p2p and infers shapes
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
        log.reset()
        losses: list[torch.Tensor] = []
        dist.barrier()
        start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for all processes of the machine
        schedule.step(*inputs, target=target, losses=losses)
        end = time.perf_counter()
        if step:
            steps.append({"start": start, "end": end, "events": list(log.events), "peak_bytes": log.peak_bytes,
                          "losses": [x.item() for x in losses]})
    return {
        "steps": steps,
        "bytes_per_microbatch": sum(s.bytes_per_microbatch for s in stages),
        "torch_actions": torch_actions_bubble(schedule, m) if rank == 0 else None,
    }


def measure(machine: Undisturbed, p: int, schedule: str, m: int, args) -> dict:
    """Run one configuration: its bubble columns, peak activations, the costs of F/B/I/W relative to F,
    and the share of the cores other processes took meanwhile (it slows the wall column; the replayed
    ones count CPU time only)."""
    per_rank, foreign = machine.run(_run, p, schedule, m, args)
    if "refused" in per_rank[0]:
        return {"refused": per_rank[0]["refused"]}
    num_stages = p * stages_per_rank(schedule)
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)  # (stage, F/B/I/W) -> CPU s of its calls
    for res in per_rank:
        for step in res["steps"]:
            for stage, kind, _, cpu in step["events"]:
                durations[(stage, kind)].append(cpu)
    typical = {key: statistics.median(cpu) for key, cpu in durations.items()}
    per_microbatch = [sum(t for (s, _), t in typical.items() if s == stage) for stage in range(num_stages)]
    # Equal stages by construction, but a rank's core can be slower than another's: scaled to the median
    # stage (each keeping its own F/B/I/W split), the replay shows what the unequal times add.
    evened = {(s, k): t * statistics.median(per_microbatch) / per_microbatch[s] for (s, k), t in typical.items()}

    def replay_with(times: dict[tuple[int, str], float]) -> float:
        # Every step runs the same order; played with fixed times per (stage, kind), the jitter drops out.
        orders = {r: [(s, k, mb, times[(s, k)]) for s, k, mb, _ in res["steps"][0]["events"]] for r, res in enumerate(per_rank)}
        return bubble(p, makespan(orders, num_stages), sum(d for events in orders.values() for *_, d in events))

    each_call, wall, compute = [], [], []
    for step in range(args.steps):
        orders = {r: res["steps"][step]["events"] for r, res in enumerate(per_rank)}
        work = sum(cpu for events in orders.values() for *_, cpu in events)
        span = max(res["steps"][step]["end"] for res in per_rank) - min(res["steps"][step]["start"] for res in per_rank)
        each_call.append(bubble(p, makespan(orders, num_stages), work))
        wall.append(bubble(p, span, work))
        compute.append(work)
    forward = statistics.median(typical[(s, "F")] for s in range(num_stages))
    kinds = {(s == 0, k) for s, k in typical}
    return {
        "torch_actions": per_rank[0]["torch_actions"],
        "replayed": replay_with(typical),
        "replayed_evened": replay_with(evened),
        "each_call": statistics.median(each_call),
        "each_call_spread": max(each_call) - min(each_call),
        "stage_imbalance": max(per_microbatch) / min(per_microbatch) - 1,
        "wall": statistics.median(wall),
        "compute_ms": 1000 * statistics.median(compute),
        "peak_microbatches": [max(s["peak_bytes"] for s in res["steps"]) / res["bytes_per_microbatch"] for res in per_rank],
        "peak_mib": max(s["peak_bytes"] for res in per_rank for s in res["steps"]) / MiB,
        "losses": next(s["losses"] for res in per_rank for s in res["steps"] if s["losses"]),
        "foreign": foreign,
        # (stage 0?, kind) -> median over the stages of the kind's typical time, relative to F
        "cost": {(first, kind): statistics.median(t for (s, k), t in typical.items() if (s == 0) == first and k == kind)
                 / forward for first, kind in kinds},
    }


# ----------------------------------------------------------------------------- main


def _percent(x: float | str) -> str:
    return x if isinstance(x, str) else f"{100 * x:.1f}%"


def theory(schedule: str, p: int, m: int) -> str:
    v = stages_per_rank(schedule)
    formula = (p - 1) / (v * m)
    return f"< {100 * formula:.1f}%" if schedule in ZERO_BUBBLE else f"{100 * formula:.1f}%"


def _points(x: float) -> str:
    return f"{round(100 * x):+d}"


def _points_range(values: list[float]) -> str:
    low, high = _points(min(values)), _points(max(values))
    return f"{low} points" if low == high else f"{low} to {high} points"


def _summary(ran: dict[tuple[str, int, int], dict], args, threshold: float) -> list[str]:
    """The measured bubbles beside theory, in words; the gaps are computed, not assumed. Runs during which
    other processes took more than `threshold` of the cores do not enter the wall comparison."""
    ps, ms, out = args.ps, args.ms, []
    at_ms = f"m = {'/'.join(map(str, ms))}"

    def present(schedules) -> list[str]:
        return [s for s in schedules if any((s, p, m) in ran for p in ps for m in ms)]

    def series(schedule: str, p: int, key: str) -> str:
        return "/".join(f"{100 * ran[(schedule, p, m)][key]:.0f}" if (schedule, p, m) in ran else "-" for m in ms)

    def against_theory(schedules: list[str], v: int) -> None:
        def gaps(key: str) -> str:
            return _points_range([ran[(s, p, m)][key] - (p - 1) / (v * m) for s in schedules for p in ps for m in ms
                                  if (s, p, m) in ran])

        if not schedules:
            return
        text = "; ".join(f"p={p}: " + ", ".join(f"{s} {series(s, p, 'replayed')}%" for s in schedules)
                         + " against " + "/".join(f"{100 * (p - 1) / (v * m):.1f}".removesuffix(".0") for m in ms) + "%"
                         for p in ps)
        out.append(f"- {' and '.join(schedules)}, replayed bubble at {at_ms}: {text}. Gaps to "
                   f"{'(p-1)/m' if v == 1 else '(p-1)/(v m)'}: {gaps('replayed')}; {gaps('replayed_evened')} with the "
                   "stages' measured times evened out (see Noise).")

    against_theory(present(("GPipe", "1F1B")), 1)
    against_theory(present(("Interleaved1F1B", "LoopedBFS")), 2)
    zero_bubble = present(ZERO_BUBBLE)
    cost = {key: statistics.median(r["cost"][key] for r in ran.values() if key in r["cost"])
            for key in {key for r in ran.values() for key in r["cost"]}}
    if zero_bubble:
        actions = [ran[(s, p, m)]["torch_actions"] for s in zero_bubble for p in ps for m in ms
                   if (s, p, m) in ran and not isinstance(ran[(s, p, m)]["torch_actions"], str)]
        split = (f"; measured, I = {cost[(False, 'I')]:.2f} F and W = {cost[(False, 'W')]:.2f} F, so the split backward "
                 f"costs {100 * ((cost[(False, 'I')] + cost[(False, 'W')]) / cost[(False, 'B')] - 1):.0f}% more than the "
                 f"fused B = {cost[(False, 'B')]:.2f} F, and stage 0's W = {cost[(True, 'W')]:.2f} F does all of its "
                 "backward (torch skips the first stage's I): their stages are unequal by torch's construction"
                 if {(False, "I"), (False, "W"), (False, "B"), (True, "W")} <= cost.keys() else "")
        out.append(
            f"- Zero-bubble schedules, replayed bubble at {at_ms}: "
            + "; ".join(f"p={p}: " + ", ".join(f"{s} {series(s, p, 'replayed')}%" for s in zero_bubble) for p in ps)
            + ". torch's own action lists, with F = I = W, leave "
            + (f"{100 * min(actions):.0f}%" if round(100 * min(actions)) == round(100 * max(actions))
               else f"{100 * min(actions):.0f} to {100 * max(actions):.0f}%") + " "
            f"(fill and drain at these m){split}."
        )
    full_backward = {key: r for key, r in ran.items() if key[0] not in ZERO_BUBBLE}
    jitter = [r["each_call"] - r["replayed"] for r in ran.values()]
    noise = [f"- Noise: replayed with each call's own time instead of the median per stage and kind, the bubble moves "
             f"by a median {_points(statistics.median(jitter))} points (range {_points_range(jitter)}; step-to-step "
             f"spread a median {100 * statistics.median(r['each_call_spread'] for r in ran.values()):.0f} points)."]
    if full_backward:
        imbalance = [r["stage_imbalance"] for r in full_backward.values()]
        # Schedules that run the same calls on the same stages: any difference in their compute is the machine's.
        same_calls = defaultdict(list)
        for (s, p, m), r in full_backward.items():
            same_calls[(stages_per_rank(s), p, m)].append(r["compute_ms"])
        spread = [max(c) / min(c) - 1 for c in same_calls.values() if len(c) > 1]
        noise.append(
            f"In the schedules with a full backward, stages of equal work measured a median "
            f"{100 * statistics.median(imbalance):.0f}% (max {100 * max(imbalance):.0f}%) apart within a run (median "
            "time per micro-batch, slowest over fastest): one core ran slower than another, which the formulas, "
            "with equal stages, do not have."
            + (f" Schedules running the same calls at the same p and m (GPipe and 1F1B; Interleaved1F1B and "
               f"LoopedBFS) differ by up to {100 * max(spread):.0f}% in compute per step: the machine's speed varies "
               "between runs, and the order of the calls uses the caches differently."
               if spread else "")
        )
    out.append(" ".join(noise))
    over = [p for p in ps if p > cores()]
    under = [p for p in ps if p <= cores()]
    quiet = [r for (_, p, _), r in ran.items() if p in under and r["foreign"] <= threshold]
    wall = []
    if quiet:
        extra = [r["wall"] - r["replayed"] for r in quiet]
        wall.append(
            f"Wall against replayed at p={'/'.join(map(str, under))} (a core per rank), in the {len(quiet)} runs "
            f"other processes left alone: a median {_points(statistics.median(extra))} points (range "
            f"{_points_range(extra)}): the gloo transfers (whose threads share the ranks' "
            "cores), the schedule runtime's Python, the loss and the jitter above."
        )
    if over:
        wall.append(f"At p={'/'.join(map(str, over))} on {cores()} cores the wall column is at least "
                    f"{100 * (max(over) / cores() - 1):.0f}% by construction: it measures oversubscription, and only "
                    "the replayed columns are the pipeline's bubble.")
    if wall:
        out.append("- " + " ".join(wall))
    out.append(
        f"- Peak activations on rank 0, in micro-batches of its layers, at {at_ms}: "
        + "; ".join(f"{s} " + ", ".join(f"p={p}: " + "/".join(f"{ran[(s, p, m)]['peak_microbatches'][0]:g}"
                                                               if (s, p, m) in ran else "-" for m in ms) for p in ps)
                    for s in args.schedules)
        + ". Theory: 1F1B p (p - r on rank r), GPipe and LoopedBFS m."
    )
    return out


def _command(args) -> str:
    return ("python benchmarks/pp_bubble.py --ps " + " ".join(map(str, args.ps)) + " --ms " + " ".join(map(str, args.ms))
            + " --schedules " + " ".join(args.schedules)
            + f" --steps {args.steps} --dim {args.dim} --microbatch {args.microbatch} --layers {args.layers}"
            + f" --max-wait {args.max_wait:g}")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ps", type=int, nargs="+", default=[2, 4], help="pipeline ranks")
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration, after one warm-up step")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--microbatch", type=int, default=128, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=8, help="layers of the whole model, split over p * v stages")
    parser.add_argument("--max-wait", type=float, default=120.0,
                        help="s in all to spend waiting for idle cores (at most 10 s before a run) and redoing disturbed runs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pp_bubble.md"))
    args = parser.parse_args()
    for p in args.ps:
        for schedule in args.schedules:
            if p < 2 or args.layers % (p * stages_per_rank(schedule)):
                parser.error(f"--layers {args.layers} must split evenly over the {p * stages_per_rank(schedule)} "
                             f"stages of {schedule} at p={p} (p >= 2)")
    return args


def main() -> None:
    args = _parse()
    started, load_before = time.perf_counter(), load_average()
    machine = Undisturbed(args.max_wait)
    results: dict[tuple[str, int, int], dict] = {}
    for p in args.ps:
        for m in args.ms:
            for schedule in args.schedules:
                r = results[(schedule, p, m)] = measure(machine, p, schedule, m, args)
                if "refused" in r:
                    print(f"{schedule} p={p} m={m}: skipped, torch refuses: {r['refused']}", flush=True)
                    continue
                print(f"{schedule} p={p} m={m}: bubble theory {theory(schedule, p, m)}, torch's actions "
                      f"{_percent(r['torch_actions'])}, replayed {_percent(r['replayed'])} (each call "
                      f"{_percent(r['each_call'])}), wall {_percent(r['wall'])}; compute {r['compute_ms']:.0f} ms/step; "
                      "peak activations (micro-batches per rank) " + " / ".join(f"{x:.1f}" for x in r["peak_microbatches"])
                      + f", {r['peak_mib']:.1f} MiB; other processes {100 * r['foreign']:.0f}% of the cores", flush=True)
    elapsed = time.perf_counter() - started
    ran = {key: r for key, r in results.items() if "refused" not in r}

    losses_by_m: dict[int, list[list[float]]] = defaultdict(list)
    for (_, _, m), r in ran.items():
        losses_by_m[m].append(r["losses"])
    loss_gap = max(max(abs(a - b) for a, b in zip(ls, group[0])) for group in losses_by_m.values() for ls in group)

    oversubscribed = [p for p in args.ps if p > cores()]
    lines = [
        "# Pipeline bubble: torch's schedules, measured against theory; peak activations per rank",
        "",
        f"`{_command(args)}` ({elapsed:.0f} s, of which {machine.spent:.0f} s waiting for idle cores or in redone runs)",
        "",
        f"Machine: {machine_line()}; load average {load_before} before, {load_average()} after. "
        f"torch {torch.__version__}, Python {platform.python_version()}; gloo, one process per pipeline rank, "
        f"1 torch thread each. The machine is shared: {machine.redone} runs were redone because other processes took "
        f"more than {100 * machine.threshold:.0f}% of the cores during them; during the kept runs they took a median "
        f"{100 * statistics.median(machine.loads):.0f}% (max {100 * max(machine.loads):.0f}%), column *other*.",
        "",
        f"{args.layers} layers x <- tanh((x + b) @ W), W {args.dim}x{args.dim} fp32, micro-batches of {args.microbatch} "
        "rows, split evenly over p x v stages (v = 1 for GPipe/1F1B, 2 for the rest: loop placement, rank r holds "
        "stages r and r+p, for Interleaved1F1B/LoopedBFS/InterleavedZeroBubble; V placement, r and 2p-1-r, for "
        "ZBVZeroBubble/DualPipeV), so every schedule does the same work at a given p. One warm-up step, then "
        f"{args.steps} timed steps. Method: the module docstring of `benchmarks/pp_bubble.py`.",
        "",
        "Bubble = idle time / compute time over all ranks of a step, the quantity (p-1)/m describes (as a share of "
        "the step: b/(1+b)). *theory*: (p-1)/m for GPipe/1F1B, (p-1)/(v m) for Interleaved1F1B/LoopedBFS; the "
        "zero-bubble schedules are below (p-1)/(v m). *torch's actions*: torch's per-rank action lists "
        "(`schedule.pipeline_order`) played on the dependency graph (F after the previous stage's F, B or I after "
        "the next stage's B or I, one action at a time per rank) with F = I = W = 1, B = 2 and free communication. "
        "*replayed*: the order each rank ran its forward and backward calls in, played on the same graph with each "
        "stage's median measured thread CPU time per call kind: the step on one core per rank with free "
        "communication, which neither waiting nor core sharing inflates. *each call*: the same with every call's "
        "own time (median over the steps): adds the machine's jitter. *wall*: the measured step wall time against "
        "the measured compute (median over the steps); it adds the gloo transfers, the runtime's Python and the loss"
        + (f". With p={'/'.join(map(str, oversubscribed))} on {cores()} cores (marked †) the wall column is that "
           "of an oversubscribed machine, not a pipeline's bubble: a rank also waits for a core, and other ranks "
           "fill its waits." if oversubscribed else "."),
        "",
        "Peak activations: per rank, the peak over the step of the bytes autograd saved in forwards whose backward "
        "(B, or W of a split backward, which still needs the layer inputs) has not ended, in micro-batches of the "
        "rank's layers (rank 0 / 1 / ...), and the largest in MiB (parameters excluded). "
        "*compute*: CPU ms of all ranks' forward and backward calls per step.",
        "",
        "| schedule | p | v | m | theory | torch's actions | replayed | each call | wall | compute ms | "
        "peak activations, micro-batches per rank | peak MiB | other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    defects: dict[str, list[str]] = defaultdict(list)
    for (schedule, p, m), r in ran.items():
        invalid = isinstance(r["torch_actions"], str)
        if invalid:
            defects[schedule].append(f"p={p} m={m}: {r['torch_actions']}")
        lines.append(
            f"| {schedule} | {p} | {stages_per_rank(schedule)} | {m} | {theory(schedule, p, m)} | "
            f"{'invalid ‡' if invalid else _percent(r['torch_actions'])} | {_percent(r['replayed'])} | "
            f"{_percent(r['each_call'])} | {_percent(r['wall'])}{' †' if p > cores() else ''}"
            f"{' §' if r['foreign'] > machine.threshold else ''} | {r['compute_ms']:.0f} | "
            f"{' / '.join(f'{x:.1f}' for x in r['peak_microbatches'])} | {r['peak_mib']:.1f} | "
            f"{100 * r['foreign']:.0f}% |"
        )
    for schedule, cases in defects.items():
        runs = sum(1 for s, *_ in ran if s == schedule)
        lines += ["", f"‡ torch's action list for {schedule} does not run every micro-batch through every stage once "
                  f"in {len(cases)} of its {runs} runs, e.g. {cases[0]}."
                  + (f" The list is only descriptive: {schedule}'s runtime does not use it, and the run itself is right."
                     if stages_per_rank(schedule) == 1 else "")]
    if any(r["foreign"] > machine.threshold for r in ran.values()):
        lines += ["", f"§ other processes took more than {100 * machine.threshold:.0f}% of the cores during this run (kept "
                  "when the --max-wait budget was spent): its wall column shows them, not the pipeline; the replayed "
                  "columns count CPU time, which they inflate far less."]
    refused = [f"- {s}, p={p}, m={m}: {r['refused']}" for (s, p, m), r in results.items() if "refused" in r]
    if refused:
        lines += ["", "Refused by torch's constructor (skipped):", "", *refused]
    lines += ["", f"The micro-batch losses agree across all schedules and p at each m to {loss_gap:.1e} "
              "(every run computes the same function).",
              "", "## What it shows", "", *_summary(ran, args, machine.threshold)]
    write_results("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
