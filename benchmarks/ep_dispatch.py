"""Expert parallel: tokens/s and bytes of the all-to-all token dispatch; grouped matmul vs the per-expert loop.

Part 1, dispatch. One MoE experts layer, `ultrascale.models.moe.GroupedExperts` (E experts, SwiGLU, hidden
dim H, expert hidden dim I, fp32), runs forward + backward through `ultrascale.parallel.expert.experts_forward`
on ep gloo CPU ranks forked by `ultrascale.launch.run_ranks` (1 torch thread each). For ep > 1 the experts
are split over a 1-D ("ep",) DeviceMesh by `shard_experts(experts, ExpertParallel(mesh))`: every rank holds
E / ep experts and routes its own N tokens, so a step is: all-to-all of the per-expert counts, all-to-all of
the token copies (uneven splits: the "dispatch"), the local experts, and the inverse all-to-all of their
outputs (the "combine"); backward runs the two token all-to-alls again with the splits swapped. ep = 1 is
the same layer unsharded on one rank (no communication). Router choices are random: each token picks k
distinct experts uniformly (`rand(N, E).topk(k)`) with random weights summing to 1, drawn per rank.

- bytes: the token all-to-all's send splits, recorded from the real routing by wrapping
  `all_to_all_single_autograd` where `ultrascale.parallel.expert` calls it. A rank's bytes per direction are
  the rows it sends to the other ranks (its own split stays local) x H x 4 bytes: the dispatch's send
  splits, and the combine's (= what the rank received in the dispatch). Beside them, the formula for
  balanced routing: k * N * H * 4 * (ep-1)/ep per direction and per rank. A TorchDispatchMode on torch's
  functional all-to-all also counts one whole step (forward and backward): with the swapped splits in
  backward it is 2 x (dispatch + combine). The counts all-to-all adds E x 8 x (ep-1)/ep bytes.
- time: after --warmup steps, --repeats steps, each started after a barrier; a step's time is the slowest
  rank's wall time for it, and a run's the median over the repeats. --rounds runs of every ep, alternating
  the ep sizes; the table gives the best run's time (other processes and slow spells of a shared machine can
  only slow a run down), the spread over the runs, and the median CPU time. tokens/s per rank = N / step
  time, aggregate = ep x N / step time (weak scaling: every rank brings N tokens and, balanced, computes
  about k x N token copies whatever ep). CPU ms: the process CPU time of all ranks per step (the gloo
  threads included).
- check: each rank also runs an unsharded copy of the layer (same weights) on its tokens; the table
  gives the largest relative difference (max |ep - unsharded| / max |unsharded|) of the outputs, the input
  gradients and the (all-reduced) expert gradients against the ep run.

Ranks beyond the machine's cores share them: on the 2-core machine of the results, ep = 4 puts 4 ranks on
2 cores, so its times are those of an oversubscribed machine (a rank also waits for a core), and even
ep = 2 shares its 2 cores with gloo's threads. The tokens/s of ep > 1 here say what the dispatch costs on this machine, not what ep gains on
one accelerator per rank. Through benchmarks/_common.py's `Undisturbed`, a run waits (at most 10 s) for
idle cores and is redone when other processes took more than 15% of them, within --max-wait s in all.

Part 2, grouped matmul vs loop. One process (1 torch thread): `run_experts(x, counts, gate_up, down,
grouped=True)` (one `torch._grouped_mm` per projection, forward and backward) against `grouped=False`
(a Python loop over the experts, one host sync for the counts), forward + backward, for S tokens spread
uniformly at random over E experts, and their forwards alone (no grad). The two are timed alternately
(--warmup, then --repeats each); the table gives the medians and loop / grouped, and the largest output
difference between them. One profiled loop step gives the share of its CPU time spent in SelectBackward0 (the
backward of the loop's `gate_up[e]` / `down[e]`), and one profiled grouped step the `aten::mm` calls torch
runs under its `aten::_grouped_mm` calls.

Figures are ratios measured in one run; nothing here asserts a timing.

    python benchmarks/ep_dispatch.py [--eps 1 2 4] [--ks 1 2] [--tokens 2048] [--hidden 256]
        [--expert-hidden 512] [--experts 8] [--warmup 2] [--repeats 8] [--rounds 3]
        [--mm-tokens 1024 4096] [--mm-experts 8 32] [--max-wait 60]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from _common import Undisturbed, cores, load_average, write_results  # noqa: E402
from _common import machine as machine_line

import ultrascale.parallel.expert as expert  # noqa: E402
from ultrascale.launch import init_gloo  # noqa: E402
from ultrascale.models.moe import GroupedExperts  # noqa: E402
from ultrascale.parallel.device import tune_cpu_allocator  # noqa: E402

MiB = 2**20
FP32 = 4


# ----------------------------------------------------------------------------- counting the all-to-all


class SplitRecorder:
    """Wraps `all_to_all_single_autograd` as `ultrascale.parallel.expert` calls it; records the send
    splits of each forward token all-to-all (dispatch first, combine second)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.original = expert.all_to_all_single_autograd

    def __call__(self, x, output_split_sizes, input_split_sizes, group, *args, **kwargs):
        self.calls.append(list(input_split_sizes))
        return self.original(x, output_split_sizes, input_split_sizes, group, *args, **kwargs)

    def __enter__(self) -> "SplitRecorder":
        expert.all_to_all_single_autograd = self
        return self

    def __exit__(self, *exc) -> None:
        expert.all_to_all_single_autograd = self.original


class CountAllToAll(TorchDispatchMode):
    """Rows each functional all-to-all sends to other ranks (forward and backward of a step)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.rows, self.calls = rank, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            send = args[2]  # (input, output_split_sizes, input_split_sizes, group_name)
            self.rows += sum(n for r, n in enumerate(send) if r != self.rank)
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _off_rank(splits: list[int], rank: int) -> int:
    return sum(n for r, n in enumerate(splits) if r != rank)


# ----------------------------------------------------------------------------- part 1: the dispatch


def _layer(args) -> GroupedExperts:
    torch.manual_seed(0)  # the same weights on every rank (shard_experts keeps each rank's slice)
    layer = GroupedExperts(args.hidden, args.expert_hidden, args.experts)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0.0, args.hidden**-0.5)
        layer.down_proj.normal_(0.0, args.expert_hidden**-0.5)
    return layer


def _routing(rank: int, k: int, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + rank)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    top_k_index = torch.rand(args.tokens, args.experts, generator=g).topk(k, dim=-1).indices  # k distinct, uniform
    weights = torch.rand(args.tokens, k, generator=g) + 0.1
    grad_out = torch.randn(args.tokens, args.hidden, generator=g)
    return hidden, top_k_index, weights / weights.sum(-1, keepdim=True), grad_out


def _dispatch(rank: int, world_size: int, args) -> dict:
    init_gloo(rank, world_size)
    tune_cpu_allocator()
    ep = world_size
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)) if ep > 1 else None
    results = {}
    for k in args.ks:
        layer = _layer(args)
        reference = _layer(args)  # unsharded, the same weights
        if mesh is not None:
            expert.shard_experts(layer, expert.ExpertParallel(mesh))
        hidden, top_k_index, weights, grad_out = _routing(rank, k, args)

        def step() -> torch.Tensor:
            x = hidden.detach().requires_grad_()
            expert.experts_forward(layer, x, top_k_index, weights).backward(grad_out)
            return x

        # One untimed step, counted and checked.
        with SplitRecorder() as recorder, CountAllToAll(rank) as counter:
            x = hidden.detach().requires_grad_()
            out = expert.experts_forward(layer, x, top_k_index, weights)
            out.backward(grad_out)
        x_ref = hidden.detach().requires_grad_()
        out_ref = expert.experts_forward(reference, x_ref, top_k_index, weights)
        out_ref.backward(grad_out)
        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

        diff = max(rel(out, out_ref), rel(x.grad, x_ref.grad))
        for name in expert.EXPERT_WEIGHTS:
            full_grad = getattr(reference, name).grad
            if ep > 1:
                dist.all_reduce(full_grad)  # every rank's tokens, as the sharded experts saw them
            n_local = args.experts // ep
            local = expert.local_tensor(getattr(layer, name).grad)
            diff = max(diff, rel(local, full_grad[rank * n_local:(rank + 1) * n_local]))
        calls = recorder.calls
        if ep > 1 and len(calls) != 2:
            raise RuntimeError(f"expected 2 forward token all-to-alls per step, recorded {len(calls)}")
        dispatch_rows = _off_rank(calls[0], rank) if calls else 0
        combine_rows = _off_rank(calls[1], rank) if calls else 0

        layer.zero_grad(set_to_none=True)
        times, cpu = [], []
        for i in range(args.warmup + args.repeats):
            if ep > 1:
                dist.barrier()
            wall0, cpu0 = time.perf_counter(), time.process_time()
            step()
            wall1, cpu1 = time.perf_counter(), time.process_time()
            layer.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(wall1 - wall0)
                cpu.append(cpu1 - cpu0)
        results[k] = {
            "times": times, "cpu": cpu, "dispatch_rows": dispatch_rows, "combine_rows": combine_rows,
            "step_rows": counter.rows, "step_calls": counter.calls, "diff": diff,
        }
    return results


# ----------------------------------------------------------------------------- part 2: grouped vs loop


def _step_s(per_rank: list[dict], k: int) -> float:
    """Median over the timed steps of the slowest rank's time."""
    return statistics.median(max(ts) for ts in zip(*(r[k]["times"] for r in per_rank)))


def _cpu_s(per_rank: list[dict], k: int) -> float:
    """Median over the timed steps of all ranks' CPU time."""
    return statistics.median(sum(cs) for cs in zip(*(r[k]["cpu"] for r in per_rank)))


def _grouped_vs_loop(rank: int, world_size: int, args) -> dict:
    tune_cpu_allocator()
    results = {}
    for n_experts in args.mm_experts:
        for n_tokens in args.mm_tokens:
            g = torch.Generator().manual_seed(n_experts * 100_000 + n_tokens)
            counts = torch.bincount(torch.randint(0, n_experts, (n_tokens,), generator=g), minlength=n_experts)
            x = torch.randn(n_tokens, args.hidden, generator=g)
            gate_up = (torch.randn(n_experts, 2 * args.expert_hidden, args.hidden, generator=g) * args.hidden**-0.5)
            down = torch.randn(n_experts, args.hidden, args.expert_hidden, generator=g) * args.expert_hidden**-0.5
            grad_out = torch.randn(n_tokens, args.hidden, generator=g)
            leaves = [t.requires_grad_() for t in (x, gate_up, down)]

            def step(grouped: bool) -> torch.Tensor:
                out = expert.run_experts(x, counts, gate_up, down, grouped=grouped)
                out.backward(grad_out)
                for t in leaves:
                    t.grad = None
                return out.detach()

            def forward(grouped: bool) -> torch.Tensor:
                with torch.no_grad():
                    return expert.run_experts(x, counts, gate_up, down, grouped=grouped)

            diff = (step(True) - step(False)).abs().max().item()
            times: dict[tuple[str, bool], list[float]] = {(kind, g): [] for kind in ("step", "forward") for g in (True, False)}
            for i in range(args.warmup + args.repeats):
                for grouped in ((True, False) if i % 2 == 0 else (False, True)):
                    for kind, fn in (("step", step), ("forward", forward)):
                        start = time.perf_counter()
                        fn(grouped)
                        if i >= args.warmup:
                            times[(kind, grouped)].append(time.perf_counter() - start)
            # Where the loop's backward goes: one profiled step, the share of its CPU time in the backward
            # of `gate_up[e]` / `down[e]` (SelectBackward0), which scatters each expert's gradient into a
            # zero tensor of the whole (E, ...) weight.
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step(False)
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events)
            select = sum(e.cpu_time_total for e in events if "SelectBackward0" in e.key and "evaluate_function" in e.key)
            # And what one grouped step runs underneath: `aten::mm` calls per `aten::_grouped_mm` call.
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step(True)
            calls = {e.key: e.count for e in prof.key_averages()}
            results[(n_experts, n_tokens)] = {
                "grouped": times[("step", True)], "loop": times[("step", False)],
                "grouped_fwd": times[("forward", True)], "loop_fwd": times[("forward", False)],
                "select_share": select / total if total else float("nan"), "diff": diff,
                "grouped_mm_calls": calls.get("aten::_grouped_mm", 0), "mm_calls": calls.get("aten::mm", 0),
                "min_count": int(counts.min()), "max_count": int(counts.max()),
            }
    return results


# ----------------------------------------------------------------------------- the report


def _command(args) -> str:
    return "python benchmarks/ep_dispatch.py " + " ".join([
        "--eps " + " ".join(map(str, args.eps)), "--ks " + " ".join(map(str, args.ks)), f"--tokens {args.tokens}",
        f"--hidden {args.hidden}", f"--expert-hidden {args.expert_hidden}", f"--experts {args.experts}",
        f"--warmup {args.warmup}", f"--repeats {args.repeats}", f"--rounds {args.rounds}",
        "--mm-tokens " + " ".join(map(str, args.mm_tokens)),
        "--mm-experts " + " ".join(map(str, args.mm_experts)), f"--max-wait {args.max_wait:g}",
    ])


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank (N)")
    parser.add_argument("--hidden", type=int, default=256, help="model dim (H)")
    parser.add_argument("--expert-hidden", type=int, default=512, help="expert hidden dim (I)")
    parser.add_argument("--experts", type=int, default=8, help="experts (E) in part 1")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every ep in part 1 (the best is kept)")
    parser.add_argument("--mm-tokens", type=int, nargs="+", default=[1024, 4096], help="tokens (S) in part 2")
    parser.add_argument("--mm-experts", type=int, nargs="+", default=[8, 32], help="experts (E) in part 2")
    parser.add_argument("--max-wait", type=float, default=60.0,
                        help="seconds in all for waiting for idle cores and redoing disturbed runs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ep_dispatch.md"))
    args = parser.parse_args()
    for ep in args.eps:
        if args.experts % ep:
            parser.error(f"--experts {args.experts} do not split over ep={ep}")
    return args


def main() -> None:
    args = _parse()
    start, load_before = time.perf_counter(), load_average()
    machine = Undisturbed(args.max_wait)

    # runs[ep]: one (per-rank results, other processes' share of the cores) per round; the rounds alternate
    # the ep sizes, so a slow spell of the machine does not fall on one ep only.
    runs: dict[int, list[tuple[list[dict], float]]] = {ep: [] for ep in args.eps}
    for round_ in range(args.rounds):
        for ep in args.eps:
            per_rank, foreign = machine.run(_dispatch, ep, args)
            runs[ep].append((per_rank, foreign))
            for k in args.ks:
                print(f"round {round_ + 1}/{args.rounds} ep={ep} k={k}: step {1000 * _step_s(per_rank, k):.1f} ms, "
                      f"{ep * args.tokens / _step_s(per_rank, k):,.0f} tokens/s aggregate, "
                      f"dispatch rows/rank {[r[k]['dispatch_rows'] for r in per_rank]}; "
                      f"other processes {100 * foreign:.0f}% of the cores", flush=True)
    (mm,), mm_foreign = machine.run(_grouped_vs_loop, 1, args)
    for (n_experts, n_tokens), r in mm.items():
        print(f"E={n_experts} S={n_tokens}: grouped {1000 * statistics.median(r['grouped']):.1f} ms, "
              f"loop {1000 * statistics.median(r['loop']):.1f} ms", flush=True)
    elapsed = time.perf_counter() - start

    H, N = args.hidden, args.tokens
    rows_dispatch = [
        "| ep | k | step ms | spread over rounds | CPU ms per step (all ranks) | tokens/s per rank | "
        "aggregate tokens/s (vs ep=1) | largest relative difference to unsharded | other |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows_bytes = [
        "| ep | k | dispatch MiB per rank, measured (min–max over ranks) | combine MiB per rank, measured | "
        "formula k·N·H·4·(ep-1)/ep | measured / formula (mean over ranks) | whole step, fwd + bwd, MiB per rank | "
        "/ (4 × formula) |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    summary: dict[tuple[int, int], dict] = {}
    spreads, foreign_kept = [], {}
    for ep in args.eps:
        for k in args.ks:
            # Time: the best round (other processes and a slow spell can only slow a run down); CPU: the median.
            steps = [_step_s(per_rank, k) for per_rank, _ in runs[ep]]
            best = min(range(len(steps)), key=steps.__getitem__)
            step_s, foreign = steps[best], runs[ep][best][1]
            spreads.append(max(steps) / min(steps) - 1)
            foreign_kept[(ep, k)] = foreign
            cpu_s = statistics.median(_cpu_s(per_rank, k) for per_rank, _ in runs[ep])
            rs = [r[k] for r in runs[ep][0][0]]  # the routing, hence the bytes, is the same in every round
            aggregate = ep * N / step_s
            summary[(ep, k)] = {"step_s": step_s, "cpu_s": cpu_s, "aggregate": aggregate}
            base = summary.get((1, k))
            ratio = f" ({aggregate / base['aggregate']:.2f})" if base and ep != 1 else ""
            diff = max(r[k]["diff"] for per_rank, _ in runs[ep] for r in per_rank)
            rows_dispatch.append(
                f"| {ep} | {k} | {1000 * step_s:.1f} | {max(steps) / min(steps) - 1:.0%} | {1000 * cpu_s:.0f} | "
                f"{N / step_s:,.0f} | {aggregate:,.0f}{ratio} | {diff:.1e} | {100 * foreign:.0f}% |")
            formula = k * N * H * FP32 * (ep - 1) / ep
            dispatch = [r["dispatch_rows"] * H * FP32 for r in rs]
            combine = [r["combine_rows"] * H * FP32 for r in rs]
            whole = [r["step_rows"] * H * FP32 for r in rs]

            def span(values: list[float]) -> str:
                return f"{min(values) / MiB:.3f} – {max(values) / MiB:.3f}" if len(values) > 1 else f"{values[0] / MiB:.3f}"

            measured_ratio = f"{statistics.mean(dispatch) / formula:.3f}" if formula else "–"
            whole_ratio = f"{statistics.mean(whole) / (4 * formula):.3f}" if formula else "–"
            summary[(ep, k)].update(dispatch=statistics.mean(dispatch), formula=formula,
                                    whole=statistics.mean(whole), calls=rs[0]["step_calls"])
            rows_bytes.append(
                f"| {ep} | {k} | {span(dispatch)} | {span(combine)} | {formula / MiB:.3f} | {measured_ratio} | "
                f"{statistics.mean(whole) / MiB:.3f} | {whole_ratio} |")

    rows_mm = [
        "| experts E | tokens S | tokens per expert (min–max) | fwd+bwd grouped ms | fwd+bwd loop ms | loop / grouped | "
        "forward only: grouped ms | loop ms | loop / grouped | loop fwd+bwd in SelectBackward0 | largest difference |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mm_ratios, mm_fwd_ratios, mm_select = {}, {}, {}
    for (n_experts, n_tokens), r in mm.items():
        grouped, loop = statistics.median(r["grouped"]), statistics.median(r["loop"])
        grouped_fwd, loop_fwd = statistics.median(r["grouped_fwd"]), statistics.median(r["loop_fwd"])
        mm_ratios[(n_experts, n_tokens)] = loop / grouped
        mm_fwd_ratios[(n_experts, n_tokens)] = loop_fwd / grouped_fwd
        mm_select[(n_experts, n_tokens)] = r["select_share"]
        rows_mm.append(f"| {n_experts} | {n_tokens} | {r['min_count']}–{r['max_count']} | {1000 * grouped:.1f} | "
                       f"{1000 * loop:.1f} | {loop / grouped:.2f} | {1000 * grouped_fwd:.1f} | {1000 * loop_fwd:.1f} | "
                       f"{loop_fwd / grouped_fwd:.2f} | {100 * r['select_share']:.0f}% | {r['diff']:.1e} |")

    oversubscribed = [ep for ep in args.eps if ep > cores()]
    multi = [ep for ep in args.eps if ep > 1]
    lines = [
        "# Expert parallel: all-to-all token dispatch, tokens/s and bytes; grouped matmul vs the per-expert loop",
        "",
        f"`{_command(args)}` ({elapsed:.0f} s, of which {machine.spent:.0f} s waiting for idle cores or in redone runs)",
        "",
        f"Machine: {machine_line()}; load average {load_before} before, {load_average()} after. "
        f"torch {torch.__version__}, Python {platform.python_version()}; gloo, one process per ep rank, 1 torch "
        f"thread each. The machine is shared: {machine.redone} runs were redone because other processes took more "
        f"than {100 * machine.threshold:.0f}% of the cores during them; during the kept runs they took a median "
        f"{100 * statistics.median(machine.loads):.0f}% (max {100 * max(machine.loads):.0f}%).",
        "",
        f"`GroupedExperts` E={args.experts}, H={H}, I={args.expert_hidden} (SwiGLU), fp32; N={N} tokens per rank, "
        f"each routed to k distinct experts drawn uniformly; forward + backward of `experts_forward`, ep > 1 "
        f"sharded by `shard_experts(experts, ExpertParallel(mesh))` on a 1-D ep mesh, ep=1 unsharded on one rank. "
        f"{args.warmup} warm-up steps, then {args.repeats} steps each after a barrier; step time = the slowest rank's, "
        f"median over the steps; {args.rounds} rounds of every ep, alternating: the time is the best round's "
        f"(spread over rounds: median {statistics.median(spreads):.0%}, max {max(spreads):.0%}), the CPU time the "
        "median. Method: the module docstring of `benchmarks/ep_dispatch.py`. "
        + (f"ep={'/'.join(map(str, oversubscribed))} puts more ranks than cores ({cores()}) on the machine: its times "
           "are those of an oversubscribed machine. " if oversubscribed else "")
        + "Every rank computes about k·N token copies at any ep (weak scaling), so on this machine the ideal "
        f"aggregate tokens/s is min(ep, {cores()}) x ep=1's.",
        "",
        "## Throughput",
        "",
        *rows_dispatch,
        "",
        "*largest relative difference to unsharded*: max |ep - unsharded| / max |unsharded| of the outputs, the input "
        "gradients and the expert gradients, against the same layer unsharded on each rank's tokens (its expert "
        "gradients all-reduced over the ranks); fp32 rounding, from summing in another order. *other*: the share of "
        "the machine's cores other processes kept busy during the best round.",
        "",
        "## Bytes sent by the token all-to-all, per rank",
        "",
        "Measured from the routing: the rows a rank sends to other ranks (its own split stays local) x H x 4 bytes. "
        "*dispatch*: tokens to the experts' ranks; *combine*: the experts' outputs back (what the rank received "
        "in the dispatch). *whole step*: every functional all-to-all of one forward + backward, counted by a "
        f"TorchDispatchMode ({summary[(multi[0], args.ks[0])]['calls'] if multi else 0} per step: backward repeats "
        "dispatch and combine with the splits swapped), against 4 x the formula. The per-expert counts' all-to-all "
        f"adds E·8·(ep-1)/ep bytes ({args.experts * 8 * (max(args.eps) - 1) // max(args.eps)} B at ep={max(args.eps)}).",
        "",
        *rows_bytes,
        "",
        "## Grouped matmul vs the per-expert loop",
        "",
        f"`run_experts(x, counts, gate_up, down, grouped=...)` forward + backward, one process, 1 torch thread, "
        f"H={H}, I={args.expert_hidden}, fp32; S tokens spread uniformly at random over E experts; "
        f"{args.warmup} warm-up and {args.repeats} timed calls of each, alternating; medians. "
        f"Other processes took {100 * mm_foreign:.0f}% of the cores during this run.",
        "",
        *rows_mm,
        "",
        "## What the numbers show",
        "",
    ]
    byte_parts = [f"k={k} ep={ep}: {summary[(ep, k)]['dispatch'] / summary[(ep, k)]['formula']:.3f}"
                  for k in args.ks for ep in multi]
    if byte_parts:
        lines.append("- Bytes: measured dispatch / formula " + ", ".join(byte_parts) + ". The formula is the "
                     "expectation for uniform routing; the measured splits differ from it only by the sampling noise "
                     "of the random router, and they scale with k and (ep-1)/ep as it says. The combine sends what "
                     "the dispatch received, and a whole step sends 4 x the dispatch volume (dispatch and combine, "
                     "forward and backward).")
    throughput_parts = []
    for k in args.ks:
        base = summary.get((1, k))
        if base is None:
            continue
        throughput_parts += [f"k={k} ep={ep}: {summary[(ep, k)]['aggregate'] / base['aggregate']:.2f}x the aggregate "
                             f"tokens/s, {summary[(ep, k)]['cpu_s'] / base['cpu_s'] / ep:.2f}x the CPU time per rank"
                             for ep in multi]
    if throughput_parts:
        lines.append("- Throughput against ep=1: " + "; ".join(throughput_parts) + ". Every rank does about the "
                     "same expert work at any ep; what ep adds per rank is the all-to-alls (and their copies and "
                     "the reordering of the arrived tokens), which with gloo on one machine are CPU work too.")
    disturbed = [f"ep={ep} k={k}" for (ep, k), f in foreign_kept.items() if f > machine.threshold]
    if disturbed:
        lines.append(f"- Other processes took more than {100 * machine.threshold:.0f}% of the cores during the best "
                     f"round of {', '.join(disturbed)} (column *other*; --max-wait ran out before a quiet run): those "
                     "rows' times are slowed by them and their ratios to ep=1 are not to be trusted.")
    if oversubscribed:
        lines.append(f"- ep={'/'.join(map(str, oversubscribed))} runs {max(oversubscribed)} ranks on {cores()} cores: "
                     f"its aggregate tokens/s can at best match ep={cores()}'s, and the gloo transfers wait for cores; "
                     "its wall-clock numbers measure the oversubscribed machine, not expert parallel.")
    if 1 in args.eps and len(args.ks) > 1:
        k_lo, k_hi = min(args.ks), max(args.ks)
        lines.append(f"- k={k_hi} vs k={k_lo} at ep=1: step time {summary[(1, k_hi)]['step_s'] / summary[(1, k_lo)]['step_s']:.2f}x "
                     f"(the expert work is {k_hi // k_lo}x); the bytes scale with k exactly.")
    first = next(iter(mm.values()))
    lines.append(
        "- Grouped vs loop, loop / grouped time, forward + backward: "
        + ", ".join(f"E={e} S={s}: {v:.2f}" for (e, s), v in mm_ratios.items())
        + "; forward only: " + ", ".join(f"E={e} S={s}: {v:.2f}" for (e, s), v in mm_fwd_ratios.items())
        + f". On CPU `torch._grouped_mm` is itself a loop of matmuls: one grouped step (E={next(iter(mm))[0]}) ran "
        f"{first['mm_calls']} `aten::mm` under {first['grouped_mm_calls']} `aten::_grouped_mm` calls, one per expert "
        "and projection (forward and backward), so it saves only the Python loop, the slicing and the concatenation. "
        + (
            "Share of the loop's forward + backward spent in SelectBackward0 (the backward of indexing one expert's "
            "weight, which writes its gradient into a zero tensor of the whole (E, ...) weight: O(E²·I·H) memory "
            "traffic): " + ", ".join(f"E={e} S={s}: {100 * v:.0f}%" for (e, s), v in mm_select.items())
            + ". `run_experts` iterates `unbind(0)` for this reason (at E=32 indexing took 62-90% of the loop's step)."
        )
    )
    if mm_foreign > machine.threshold:
        lines.append(f"- Other processes took {100 * mm_foreign:.0f}% of the cores during the grouped-vs-loop run: "
                     "with 1 torch thread it still had a core to itself only if they left one free; its ratios "
                     "are less sure than its shares.")
    lines.append(f"- All timings come from one invocation on a shared {cores()}-core machine, whose speed varies from run "
                 f"to run (part 1's rounds of the same configuration differ by a median {statistics.median(spreads):.0%}): "
                 "ratios between rows of one table are the figures to read, and differences of that size are noise.")
    write_results("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
