"""Context parallel scaling: tokens/s and peak memory per rank against sequence length, and load balance.

Two measurements, on gloo CPU ranks forked by `ultrascale.launch.run_ranks` (1 torch thread each):

1. Training. `Trainer(strategy=ContextParallelStrategy(context_parallel=cp, context_parallel_method=m))`
   trains the built-in `LlamaLM` (a Llama a bit wider than preset "tiny", so that attention dominates
   at long sequences) on random tokens, for cp = 1, 2, 4 and both methods; cp = 1 is the same
   strategy on one rank (no context parallel: plain attention, ZeRO-3 over one rank). The global batch
   holds the same number of tokens at every sequence length (batch = --tokens-per-step / seq), so
   steps cost alike and tokens/s across sequence lengths shows what the quadratic attention adds.
   tokens/s: global tokens of the timed steps (after the warm-up steps) over their wall time, mean of
   the ranks. Peak memory per rank: growth of the process's peak resident set (VmHWM, reset through
   /proc/self/clear_refs at `on_train_start`, after the model is built and sharded) over its resident
   set at that moment, max over the ranks: activations, the all-gathered K/V, gradients, AdamW state
   (created at step 1) and whatever glibc and gloo keep. The step-0 loss of every run is printed
   beside it: every configuration trains the same model on the same data.
2. Balance. `ContextParallel.attention` alone on random q/k/v of one sequence of --balance-seq tokens,
   forward + backward, for cp = 2, 4, both methods, zig-zag (`context_parallel_load_balance=True`)
   and contiguous chunks (False). Per rank: the median over the repetitions of the CPU time of the
   process (what the rank computed: a rank waiting in a gloo collective sleeps and adds nothing),
   the wall time, and `attention_work` (query-key pairs computed, per sequence and head). Reported:
   max/min over the ranks. Wall time evens out between ranks, since every exchange waits for the
   slowest one; CPU time shows the imbalance.

With cp = 4 on a machine with fewer than 4 cores the ranks share cores: tokens/s then shows the
oversubscribed machine, not 4 devices; CPU time per rank still measures each rank's work.

    python benchmarks/cp_scaling.py [--seq-lens 512 1024 2048 4096] [--cps 1 2 4] [--tokens-per-step 4096]
        [--steps 6] [--dim 128] [--layers 2] [--heads 4] [--kv-heads 2] [--balance-seq 4096] [--balance-reps 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
import ultrascale  # noqa: E402
from _common import Data, Throughput, WARMUP_STEPS, write_results  # noqa: E402
from ultrascale.launch import init_gloo, run_ranks  # noqa: E402
from ultrascale.models.llama import LlamaConfig  # noqa: E402
from ultrascale.models.lm import LlamaLM  # noqa: E402
from ultrascale.parallel.context import CONTEXT_PARALLEL_METHODS, ContextParallel  # noqa: E402

MiB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Meter(Throughput):
    """`Throughput`'s timing window, plus peak resident-set growth from `on_train_start` and the step-0 loss."""

    def __init__(self) -> None:
        super().__init__()
        self.baseline_kib = self.peak_kib = 0
        self.cpu_start = self.cpu_end = 0.0
        self.first_loss = float("nan")

    def on_train_start(self, trainer, pl_module):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.baseline_kib = _status_kib("VmRSS")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if batch_idx == WARMUP_STEPS:
            self.cpu_start = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if batch_idx >= WARMUP_STEPS:
            self.cpu_end = time.process_time()
        if batch_idx == 0:
            self.first_loss = float(trainer.callback_metrics["train_loss"])

    def on_train_end(self, trainer, pl_module):
        self.peak_kib = _status_kib("VmHWM")


def _config(args, seq_len: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                       ffn_hidden_dim=2 * args.dim, max_seq_len=seq_len)


def _train(rank, world_size, method, seq_len, args):
    torch.set_num_threads(1)
    meter = Meter()
    strategy = ultrascale.ContextParallelStrategy(context_parallel=world_size, context_parallel_method=method)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=args.steps,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[meter],
    )
    batch = args.tokens_per_step // seq_len
    model = LlamaLM(config=_config(args, seq_len), max_steps=args.steps, init_seed=0)
    trainer.fit(model, Data(args.steps * batch, seq_len, 512, batch))
    return {
        "tokens_per_s": meter.steps * batch * seq_len / (meter.end - meter.start),
        "peak_mib": (meter.peak_kib - meter.baseline_kib) / 1024,
        "cpu_s_per_step": (meter.cpu_end - meter.cpu_start) / meter.steps,
        "first_loss": meter.first_loss,
    }


def _balance(rank, world_size, method, load_balance, args):
    torch.set_num_threads(1)
    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    cp = ContextParallel(mesh, method, load_balance)
    seq_len, head_dim = args.balance_seq, args.dim // args.heads
    cp.shard_batch({"input_ids": torch.zeros(1, seq_len, dtype=torch.long)})
    local = seq_len // world_size
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, args.heads, local, head_dim, generator=g, requires_grad=True)
    k, v = (torch.randn(1, args.kv_heads, local, head_dim, generator=g, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(1, args.heads, local, head_dim, generator=g)
    cpu, wall = [], []
    for rep in range(args.balance_reps + 1):  # the first is warm-up
        torch.distributed.barrier()
        cp.attention_work = 0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        cp.attention(q, k, v).backward(grad_out)
        wall1, cpu1 = time.perf_counter(), time.process_time()
        if rep:
            cpu.append(cpu1 - cpu0)
            wall.append(wall1 - wall0)
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall), "work": cp.attention_work}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens-per-step", type=int, default=4096, help="global batch = this / seq len sequences")
    parser.add_argument("--steps", type=int, default=6, help=f"optimizer steps per run, the first {WARMUP_STEPS} not timed")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--balance-seq", type=int, default=4096)
    parser.add_argument("--balance-reps", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cp_scaling.md"))
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    for seq_len in args.seq_lens:
        if args.tokens_per_step % seq_len:
            parser.error(f"--tokens-per-step {args.tokens_per_step} must be a multiple of every sequence length ({seq_len})")
        if any(cp > 1 and seq_len % (2 * cp) for cp in args.cps):
            parser.error(f"sequence length {seq_len} must be a multiple of 2 * cp for every cp in {args.cps}")

    start, load_before = time.perf_counter(), _load()
    configs = [(cp, method) for cp in args.cps for method in ((None,) if cp == 1 else CONTEXT_PARALLEL_METHODS)]
    train: dict[tuple[int, str | None, int], dict] = {}
    for seq_len in args.seq_lens:
        for cp, method in configs:
            t0 = time.perf_counter()
            per_rank = run_ranks(_train, cp, method or "allgather", seq_len, args)
            result = {
                "cpu_s_per_step": sum(r["cpu_s_per_step"] for r in per_rank),
                "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in per_rank),
                "peak_mib": max(r["peak_mib"] for r in per_rank),
                "first_loss": per_rank[0]["first_loss"],
            }
            train[(cp, method, seq_len)] = result
            print(f"seq {seq_len} cp={cp} {method or '-'}: {result['tokens_per_s']:,.0f} tokens/s, peak +{result['peak_mib']:.0f} MiB/rank, "
                  f"CPU {1000 * result['cpu_s_per_step']:.0f} ms/step (all ranks), loss step 0 {result['first_loss']:.6f} "
                  f"({time.perf_counter() - t0:.1f} s, load {_load()})", flush=True)

    balance: dict[tuple[int, str, bool], list[dict]] = {}
    for cp in (c for c in args.cps if c > 1):
        for method in CONTEXT_PARALLEL_METHODS:
            for load_balance in (True, False):
                per_rank = run_ranks(_balance, cp, method, load_balance, args)
                balance[(cp, method, load_balance)] = per_rank
                print(f"balance cp={cp} {method} zig-zag={load_balance}: CPU s/rank "
                      + " ".join(f"{r['cpu_s']:.3f}" for r in per_rank)
                      + ", wall s/rank " + " ".join(f"{r['wall_s']:.3f}" for r in per_rank)
                      + ", work/rank " + " ".join(str(r["work"]) for r in per_rank), flush=True)
    elapsed = time.perf_counter() - start

    name = lambda cp, method: "cp=1 (no CP)" if cp == 1 else f"cp={cp} {method}"  # noqa: E731
    seqs = args.seq_lens
    cfg = _config(args, max(seqs))
    lines = [
        "# Context parallel: tokens/s and peak memory per rank against sequence length; load balance",
        "",
        f"`{_command(args)}` ({elapsed:.0f} s)",
        "",
        f"Machine: {_machine()}; load average {load_before} before, {_load()} after. "
        f"torch {torch.__version__}, lightning {L.__version__}, Python {platform.python_version()}.",
        "",
        f"LlamaLM dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} KV heads, head dim "
        f"{cfg.head_dim}), FFN {cfg.ffn_hidden_dim}, vocab {cfg.vocab_size}, fp32; "
        f"`ContextParallelStrategy(context_parallel=cp, context_parallel_method=m)` (zig-zag on), one rank per cp rank, "
        f"gloo, 1 torch thread per rank; {args.tokens_per_step} tokens per step (batch = {args.tokens_per_step} / seq), "
        f"{args.steps} steps per run of which the first {WARMUP_STEPS} are warm-up. "
        f"{'cp=4 puts 4 ranks on ' + str(_cores()) + ' cores: its tokens/s is that of an oversubscribed machine. ' if max(args.cps) > _cores() else ''}"
        "cp=1 is the same strategy on one rank: one core.",
        "",
        "## Training throughput (global tokens/s; in brackets: ratio to cp=1 at that sequence length)",
        "",
        "| configuration | " + " | ".join(f"seq {s}" for s in seqs) + " |",
        "|---|" + "---:|" * len(seqs),
    ]
    for cp, method in configs:
        cells = []
        for s in seqs:
            tps = train[(cp, method, s)]["tokens_per_s"]
            base = train.get((1, None, s))
            cells.append(f"{tps:,.0f}" + (f" ({tps / base['tokens_per_s']:.2f})" if base and cp != 1 else ""))
        lines.append(f"| {name(cp, method)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Peak memory per rank (MiB of resident-set growth over the built model, max over ranks; "
        "in brackets: ratio to cp=1)",
        "",
        "Measured: VmHWM at the end of training minus VmRSS at `on_train_start` (peak reset there). "
        "Not an allocator statistic (CPU has none): it includes what glibc keeps after a free. "
        "Analytic extra of the all-gather method: the whole sequence's K/V (and, in backward, its fp32 dK/dV) "
        "held for one layer at a time: 2 x batch x seq x KV heads x head dim x 4 B each.",
        "",
        "| configuration | " + " | ".join(f"seq {s}" for s in seqs) + " |",
        "|---|" + "---:|" * len(seqs),
    ]
    for cp, method in configs:
        cells = []
        for s in seqs:
            peak = train[(cp, method, s)]["peak_mib"]
            base = train.get((1, None, s))
            cells.append(f"{peak:,.0f}" + (f" ({peak / base['peak_mib']:.2f})" if base and cp != 1 else ""))
        lines.append(f"| {name(cp, method)} | " + " | ".join(cells) + " |")
    kv_mib = {s: 2 * (args.tokens_per_step // s) * s * args.kv_heads * cfg.head_dim * 4 / MiB for s in seqs}
    lines.append("| all-gathered K/V per layer (analytic) | " + " | ".join(f"{kv_mib[s]:.2f}" for s in seqs) + " |")
    lines += [
        "",
        "Step-0 loss (same model, same data in every configuration): "
        + "; ".join(
            f"seq {s}: " + ", ".join(f"{train[(cp, m, s)]['first_loss']:.6f}" for cp, m in configs) for s in seqs
        )
        + f" (order: {', '.join(name(cp, m) for cp, m in configs)}).",
    ]
    if balance:
        lines += [
            "",
            f"## Load balance: attention alone, seq {args.balance_seq}, batch 1, forward + backward, "
            f"median of {args.balance_reps} repetitions per rank",
            "",
            "CPU time: the rank process's CPU time (gloo waits sleep), i.e. the rank's own work. Wall time: "
            "per rank, it includes waiting for the slowest rank at every exchange. Work: `attention_work` "
            "(query-key pairs computed, forward; per sequence and head).",
            "",
            "| cp | method | zig-zag | CPU ms per rank | CPU max/min | wall ms per rank | wall max/min | work per rank (M pairs) | work max/min |",
            "|---:|---|---|---|---:|---|---:|---|---:|",
        ]
        for (cp, method, load_balance), per_rank in balance.items():
            cpu = [r["cpu_s"] * 1000 for r in per_rank]
            wall = [r["wall_s"] * 1000 for r in per_rank]
            work = [r["work"] for r in per_rank]
            lines.append(
                f"| {cp} | {method} | {'yes' if load_balance else 'no'} | {' / '.join(f'{x:.0f}' for x in cpu)} | "
                f"{max(cpu) / min(cpu):.2f} | {' / '.join(f'{x:.0f}' for x in wall)} | {max(wall) / min(wall):.2f} | "
                f"{' / '.join(f'{w / 1e6:.2f}' for w in work)} | {max(work) / min(work):.2f} |"
            )
    lines += ["", "## What the numbers say", "", "SUMMARY"]
    write_results("\n".join(lines) + "\n", args.out)


def _command(args) -> str:
    return "python benchmarks/cp_scaling.py " + " ".join([
        "--seq-lens " + " ".join(map(str, args.seq_lens)), "--cps " + " ".join(map(str, args.cps)),
        f"--tokens-per-step {args.tokens_per_step}", f"--steps {args.steps}", f"--dim {args.dim}",
        f"--layers {args.layers}", f"--heads {args.heads}", f"--kv-heads {args.kv_heads}",
        f"--balance-seq {args.balance_seq}", f"--balance-reps {args.balance_reps}",
    ])


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {_cores()} CPU cores available, {platform.system()} {platform.release()}"


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


if __name__ == "__main__":
    main()
