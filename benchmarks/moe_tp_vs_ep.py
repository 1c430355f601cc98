"""Splitting one MoE experts layer over 2 ranks: expert parallel (ep) against expert tensor parallel (tp).

One `ultrascale.models.moe.GroupedExperts` layer (E experts, SwiGLU, hidden dim H, expert hidden dim I,
fp32) runs forward + backward through `ultrascale.parallel.expert.experts_forward` on 2 gloo CPU ranks
forked by `ultrascale.launch.run_ranks` (1 torch thread each). Both ways every rank holds half of the
expert weights:

- ep: `shard_experts` gives each rank E/2 whole experts. Each rank routes its OWN N tokens; their copies
  travel to the experts' rank by all-to-all and back (forward and backward). A step processes 2N tokens.
- tp: `ExpertTensorParallel` gives each rank half of every expert's width (packed [gate; up]). Both ranks
  route the SAME N tokens (tensor parallel: the tp ranks of a data rank see one batch); each computes
  partial sums over its half of I, all-reduced in forward, and the input and routing-weight gradients
  are all-reduced in backward. A step processes N tokens.

Router choices are random (each token picks k distinct experts uniformly, weights summing to 1). Bytes
are per rank per step (forward + backward) and come from the formulas of what each sends, fp32:
ep: 2 x 2 x k N H 4 (ep-1)/ep (dispatch + combine, both ways; balanced routing); tp: ring all-reduce of
(N, H) in forward and of (N, H) + (N, k) in backward, 2 (tp-1)/tp x bytes each. Time: after --warmup
steps, --repeats steps each started after a barrier; a step's time is the slowest rank's, a run's the
median; --rounds runs of each way, alternating, the best run kept (a shared machine only slows runs down).
Check: each rank also runs the unsharded layer on the same tokens; the table gives the largest relative
difference of outputs and input gradients.

On the 2-core machine of the results the two ranks and gloo's threads share 2 cores: the figures say
what each split costs here, relative to the other in the same run, not what it gains on accelerators.
Figures are ratios measured in one run; nothing here asserts a timing.

    python benchmarks/moe_tp_vs_ep.py [--ks 1 2] [--tokens 2048] [--hidden 256] [--expert-hidden 512]
        [--experts 8] [--warmup 2] [--repeats 8] [--rounds 3] [--max-wait 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).parent))
from _common import Undisturbed, load_average, write_results  # noqa: E402
from _common import machine as machine_line

import ultrascale.parallel.expert as expert  # noqa: E402
from ultrascale.launch import init_gloo  # noqa: E402
from ultrascale.models.moe import GroupedExperts  # noqa: E402
from ultrascale.parallel.device import tune_cpu_allocator  # noqa: E402
from ultrascale.parallel.tensor_styles import ExpertTensorParallel  # noqa: E402

RANKS = 2
MiB = 2**20


def _layer(args) -> GroupedExperts:
    torch.manual_seed(0)  # the same weights on every rank (each keeps its part)
    layer = GroupedExperts(args.hidden, args.expert_hidden, args.experts)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0.0, args.hidden**-0.5)
        layer.down_proj.normal_(0.0, args.expert_hidden**-0.5)
    return layer


def _tokens(seed: int, k: int, args) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    top_k_index = torch.rand(args.tokens, args.experts, generator=g).topk(k, dim=-1).indices  # k distinct, uniform
    weights = torch.rand(args.tokens, k, generator=g) + 0.1
    grad_out = torch.randn(args.tokens, args.hidden, generator=g)
    return hidden, top_k_index, weights / weights.sum(-1, keepdim=True), grad_out


def _run(rank: int, world_size: int, way: str, args) -> dict:
    init_gloo(rank, world_size)
    tune_cpu_allocator()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=(way,))
    results = {}
    for k in args.ks:
        layer, reference = _layer(args), _layer(args)
        if way == "ep":
            expert.shard_experts(layer, expert.ExpertParallel(mesh))
            hidden, index, weights, grad_out = _tokens(1000 * k + rank, k, args)  # each rank its own tokens
        else:
            parallelize_module(layer, mesh, ExpertTensorParallel())
            hidden, index, weights, grad_out = _tokens(1000 * k, k, args)  # the same tokens on both ranks

        def step(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
            x = hidden.detach().requires_grad_()
            out = module(x, index, weights)
            out.backward(grad_out)
            return out, x

        out, x = step(layer)
        out_ref, x_ref = step(reference)

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

        diff = max(rel(out.detach(), out_ref.detach()), rel(x.grad, x_ref.grad))
        times = []
        for i in range(args.warmup + args.repeats):
            layer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            step(layer)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        results[k] = {"times": times, "diff": diff}
    return results


def _step_s(per_rank: list[dict], k: int) -> float:
    return statistics.median(max(r[k]["times"][i] for r in per_rank) for i in range(len(per_rank[0][k]["times"])))


def _bytes(way: str, k: int, args) -> float:
    n, h, share = args.tokens, args.hidden, (RANKS - 1) / RANKS
    if way == "ep":
        return 2 * 2 * k * n * h * 4 * share  # dispatch + combine, forward and backward
    ring = 2 * share
    return ring * (n * h * 4) + ring * (n * h * 4 + n * k * 4)  # forward output; backward input and weights


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank under ep; per tp group under tp (N)")
    parser.add_argument("--hidden", type=int, default=256, help="model dim (H)")
    parser.add_argument("--expert-hidden", type=int, default=512, help="expert hidden dim (I)")
    parser.add_argument("--experts", type=int, default=8, help="experts (E)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-wait", type=float, default=60.0, help="seconds in all to wait for a quiet machine")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_tp_vs_ep.md"))
    return parser.parse_args()


def main() -> None:
    args = _parse()
    started, load_before = time.perf_counter(), load_average()
    machine = Undisturbed(args.max_wait)
    runs: dict[str, list[list[dict]]] = {"ep": [], "tp": []}
    for round_ in range(args.rounds):
        for way in ("ep", "tp"):  # alternating: a slow spell does not fall on one way only
            per_rank, foreign = machine.run(_run, RANKS, way, args)
            runs[way].append(per_rank)
            print(f"round {round_ + 1}/{args.rounds} {way}: " + ", ".join(
                f"k={k} {1000 * _step_s(per_rank, k):.1f} ms" for k in args.ks)
                + f"; other processes {100 * foreign:.0f}% of the cores", flush=True)
    lines = [
        "# Expert parallel vs expert tensor parallel, one MoE layer on 2 ranks",
        "",
        f"`python benchmarks/moe_tp_vs_ep.py --tokens {args.tokens} --hidden {args.hidden} --expert-hidden "
        f"{args.expert_hidden} --experts {args.experts} --ks {' '.join(map(str, args.ks))} --rounds {args.rounds}`",
        "",
        f"{machine_line()}; load before {load_before}; {time.perf_counter() - started:.0f} s.",
        "",
        "| k | split | tokens per step | step ms (best run) | tokens/s (all ranks) | MiB sent per rank per step | "
        "max rel. diff vs unsharded |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in args.ks:
        for way in ("ep", "tp"):
            best = min(runs[way], key=lambda per_rank: _step_s(per_rank, k))
            step_s = _step_s(best, k)
            tokens = RANKS * args.tokens if way == "ep" else args.tokens
            diff = max(r[k]["diff"] for r in best)
            lines.append(f"| {k} | {way}2 | {tokens} | {1000 * step_s:.1f} | {tokens / step_s:,.0f} | "
                         f"{_bytes(way, k, args) / MiB:.2f} | {diff:.1e} |")
    write_results("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
