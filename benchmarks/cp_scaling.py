"""Context parallel scaling: tokens/s and peak memory per rank against sequence length, and load balance.

Two measurements, on gloo CPU ranks forked by `ultrascale.launch.run_ranks` (1 torch thread each):

1. Training. `Trainer(strategy=ContextParallelStrategy(context_parallel=cp, context_parallel_method=m))`
   trains the built-in `LlamaLM` (wider than preset "tiny", so that attention dominates at long
   sequences) on random tokens, for cp = 1, 2, 4 and each method (allgather, ring, alltoall); cp = 1 is the same strategy on
   one rank (no context parallel: plain attention, ZeRO-3 over one rank). The global batch holds the
   same number of tokens at every sequence length (batch = --tokens-per-step / seq), so tokens/s across
   sequence lengths shows what the quadratic attention adds. Each configuration runs --runs times,
   in rounds (every sequence length and configuration once per round).
   - tokens/s: global tokens of the timed steps (after the warm-up steps) over their wall time, mean
     of the ranks; the best of the runs (other processes can only slow a run down).
   - CPU ms per step: CPU time of all ranks together over the same steps, median of the runs: the
     work a step costs, which waiting (for another rank, for a core) does not inflate.
   - peak memory per rank: growth of the process's peak resident set (VmHWM, reset through
     /proc/self/clear_refs at `on_train_start`, after the model is built and sharded) over its
     resident set at that moment, max over the ranks: activations, the all-gathered K/V, gradients,
     AdamW state (created at step 1) and the freed memory glibc keeps (the strategy's
     `tune_cpu_allocator`). CPU has no allocator statistics; this is what the OS saw.
   The step-0 loss of every run is checked to agree: every configuration trains the same model on
   the same data.
2. Balance. `ContextParallel.attention` alone on random q/k/v of one sequence of --balance-seq tokens,
   forward + backward, for cp = 2, 4, allgather and ring, zig-zag (`context_parallel_load_balance=True`)
   and contiguous chunks (False). Per rank, median over the repetitions: the CPU time of the
   process (the rank's own work: a rank waiting in a gloo collective sleeps), the wall time, and
   `attention_work` (query-key pairs computed). Wall time evens out between ranks, since every
   exchange waits for the slowest rank; CPU time shows the imbalance.

The machine may be shared: before each run the script waits (at most 10 s) for other processes to
leave the cores idle, and it redoes a run during which they took more than 15% of the cores, for at
most --max-wait s in all; it reports the share they took during the kept runs.
With cp = 4 on fewer than 4 cores the ranks share cores: tokens/s then is that of an oversubscribed
machine, while CPU time per rank still measures each rank's work.

    python benchmarks/cp_scaling.py [--seq-lens 512 1024 2048 4096] [--cps 1 2 4] [--tokens-per-step 4096]
        [--steps 6] [--runs 3] [--dim 128] [--layers 2] [--heads 4] [--kv-heads 2]
        [--balance-seq 4096] [--balance-reps 7] [--max-wait 90]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).parent))
from _common import WARMUP_STEPS, Data, Throughput, Undisturbed, cores, load_average, write_results  # noqa: E402
from _common import machine as machine_line

import ultrascale  # noqa: E402
from ultrascale.launch import init_gloo  # noqa: E402
from ultrascale.models.llama import LlamaConfig  # noqa: E402
from ultrascale.models.lm import LlamaLM  # noqa: E402
from ultrascale.parallel.context import CONTEXT_PARALLEL_METHODS, ContextParallel  # noqa: E402

MiB = 2**20
VOCAB = 512
# The methods that compute attention block by block, whose per-rank work the zig-zag layout balances; all-to-all
# attention (Ulysses) runs the whole sequence on 1/cp of the heads on every rank, balanced by construction.
BLOCK_METHODS = tuple(m for m in CONTEXT_PARALLEL_METHODS if m != "alltoall")


# ----------------------------------------------------------------------------- training


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Meter(Throughput):
    """`Throughput`'s wall-clock window, the process's CPU time over it, peak resident-set growth from
    `on_train_start`, and the step-0 loss."""

    def __init__(self) -> None:
        super().__init__()
        self.baseline_kib = self.peak_kib = 0
        self.cpu_start = self.cpu_end = 0.0
        self.first_loss = float("nan")

    def on_train_start(self, trainer, pl_module):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
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


def _config(args) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_hidden_dim=2 * args.dim, max_seq_len=max(args.seq_lens))


def _train(rank, world_size, method, seq_len, args):
    torch.set_num_threads(1)  # run_ranks does too; Lightning leaves it (checked: 1 in the training step)
    meter = Meter()
    strategy = ultrascale.ContextParallelStrategy(context_parallel=world_size, context_parallel_method=method)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=args.steps,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[meter],
    )
    batch = args.tokens_per_step // seq_len
    model = LlamaLM(config=_config(args), max_steps=args.steps, init_seed=0)
    trainer.fit(model, Data(args.steps * batch, seq_len, VOCAB, batch))
    return {
        "tokens_per_s": meter.steps * batch * seq_len / (meter.end - meter.start),
        "cpu_s_per_step": (meter.cpu_end - meter.cpu_start) / meter.steps,
        "peak_mib": (meter.peak_kib - meter.baseline_kib) / 1024,
        "first_loss": meter.first_loss,
    }


# ----------------------------------------------------------------------------- balance


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
    cpu, wall, work = [], [], 0
    for rep in range(args.balance_reps + 1):  # the first is warm-up
        dist.barrier()
        cp.attention_work = 0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        cp.attention(q, k, v).backward(grad_out)
        wall1, cpu1 = time.perf_counter(), time.process_time()
        if rep:
            cpu.append(cpu1 - cpu0)
            wall.append(wall1 - wall0)
            work = cp.attention_work
    return {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall), "work": work}


# ----------------------------------------------------------------------------- machine


# ----------------------------------------------------------------------------- main


def _label(cp: int, method: str | None) -> str:
    return "cp=1 (no CP)" if cp == 1 else f"cp={cp} {method}"


def _command(args) -> str:
    return "python benchmarks/cp_scaling.py " + " ".join([
        "--seq-lens " + " ".join(map(str, args.seq_lens)), "--cps " + " ".join(map(str, args.cps)),
        f"--tokens-per-step {args.tokens_per_step}", f"--steps {args.steps}", f"--runs {args.runs}",
        f"--dim {args.dim}", f"--layers {args.layers}", f"--heads {args.heads}", f"--kv-heads {args.kv_heads}",
        f"--balance-seq {args.balance_seq}", f"--balance-reps {args.balance_reps}", f"--max-wait {args.max_wait:g}",
    ])


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens-per-step", type=int, default=4096, help="global batch = this / seq len sequences")
    parser.add_argument("--steps", type=int, default=6, help=f"optimizer steps per run, the first {WARMUP_STEPS} not timed")
    parser.add_argument("--runs", type=int, default=3, help="runs of every configuration, in rounds; tables give medians")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--balance-seq", type=int, default=4096)
    parser.add_argument("--balance-reps", type=int, default=7)
    parser.add_argument("--max-wait", type=float, default=90.0,
                        help="s in all to spend waiting for idle cores (at most 10 s before a run) and redoing disturbed runs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cp_scaling.md"))
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    for seq_len in [*args.seq_lens, args.balance_seq]:
        if any(cp > 1 and seq_len % (2 * cp) for cp in args.cps):
            parser.error(f"sequence length {seq_len} must be a multiple of 2 * cp for every cp in {args.cps}")
    for seq_len in args.seq_lens:
        if args.tokens_per_step % seq_len:
            parser.error(f"--tokens-per-step {args.tokens_per_step} must be a multiple of every sequence length ({seq_len})")
    return args


def main() -> None:
    args = _parse()
    start, load_before = time.perf_counter(), load_average()
    configs = [(cp, method) for cp in args.cps for method in ((None,) if cp == 1 else CONTEXT_PARALLEL_METHODS)]
    runs: dict[tuple[int, str | None, int], list[dict]] = {(cp, m, s): [] for cp, m in configs for s in args.seq_lens}
    machine = Undisturbed(args.max_wait)
    for round_ in range(args.runs):
        for seq_len in args.seq_lens:
            for cp, method in configs:
                per_rank, foreign = machine.run(_train, cp, method or "allgather", seq_len, args)
                result = {
                    "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in per_rank),
                    "cpu_s_per_step": sum(r["cpu_s_per_step"] for r in per_rank),
                    "peak_mib": max(r["peak_mib"] for r in per_rank),
                    "first_loss": per_rank[0]["first_loss"],
                }
                runs[(cp, method, seq_len)].append(result)
                print(f"round {round_ + 1}/{args.runs} seq {seq_len} {_label(cp, method)}: "
                      f"{result['tokens_per_s']:,.0f} tokens/s, {1000 * result['cpu_s_per_step']:.0f} CPU ms/step (all ranks), "
                      f"peak +{result['peak_mib']:.0f} MiB/rank, loss step 0 {result['first_loss']:.6f}; "
                      f"other processes {100 * foreign:.0f}% of the cores", flush=True)

    balance: dict[tuple[int, str, bool], list[dict]] = {}
    for cp in (c for c in args.cps if c > 1):
        for method in BLOCK_METHODS:
            for load_balance in (True, False):
                per_rank, _ = machine.run(_balance, cp, method, load_balance, args)
                balance[(cp, method, load_balance)] = per_rank
                print(f"balance cp={cp} {method} zig-zag={load_balance}: CPU ms/rank "
                      + " ".join(f"{1000 * r['cpu_s']:.0f}" for r in per_rank)
                      + ", wall ms/rank " + " ".join(f"{1000 * r['wall_s']:.0f}" for r in per_rank)
                      + ", pairs/rank " + " ".join(str(r["work"]) for r in per_rank), flush=True)
    elapsed = time.perf_counter() - start

    seqs = args.seq_lens
    # tokens/s: the best run (other processes can only slow a run down); work and memory: the median.
    med = {key: {"tokens_per_s": max(r["tokens_per_s"] for r in rs),
                 **{m: statistics.median(r[m] for r in rs) for m in ("cpu_s_per_step", "peak_mib")}}
           for key, rs in runs.items()}
    spread = [max(r["tokens_per_s"] for r in rs) / min(r["tokens_per_s"] for r in rs) - 1 for rs in runs.values()]
    losses = {s: [r["first_loss"] for cp, m in configs for r in runs[(cp, m, s)]] for s in seqs}
    loss_gap = max(max(v) - min(v) for v in losses.values())

    def table(metric: str, fmt) -> list[str]:
        rows = ["| configuration | " + " | ".join(f"seq {s} (batch {args.tokens_per_step // s})" for s in seqs) + " |",
                "|---|" + "---:|" * len(seqs)]
        for cp, method in configs:
            cells = []
            for s in seqs:
                value, base = med[(cp, method, s)][metric], med.get((1, None, s))
                cells.append(fmt(value) + (f" ({value / base[metric]:.2f})" if base and cp != 1 else ""))
            rows.append(f"| {_label(cp, method)} | " + " | ".join(cells) + " |")
        return rows

    cfg = _config(args)
    oversubscribed = [cp for cp in args.cps if cp > cores()]
    kv_mib = 2 * args.tokens_per_step * cfg.n_kv_heads * cfg.head_dim * 4 / MiB  # the same at every seq: batch x seq fixed
    lines = [
        "# Context parallel: tokens/s and peak memory per rank against sequence length; load balance",
        "",
        f"`{_command(args)}` ({elapsed:.0f} s, of which {machine.spent:.0f} s waiting for idle cores or in redone runs)",
        "",
        f"Machine: {machine_line()}; load average {load_before} before, {load_average()} after. "
        f"torch {torch.__version__}, lightning {L.__version__}, Python {platform.python_version()}. "
        f"The machine is shared: {machine.redone} runs were redone because other processes took more than "
        f"{100 * machine.threshold:.0f}% of the cores during them; during the kept runs they took a median "
        f"{100 * statistics.median(machine.loads):.0f}% (max {100 * max(machine.loads):.0f}%).",
        "",
        f"LlamaLM dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} KV heads, head dim "
        f"{cfg.head_dim}), FFN {cfg.ffn_hidden_dim}, vocab {cfg.vocab_size}, fp32, random tokens. "
        "`Trainer(strategy=ContextParallelStrategy(context_parallel=cp, context_parallel_method=m))` with zig-zag on, "
        "one process per cp rank (gloo, 1 torch thread each); cp=1 is the same strategy on one rank (plain attention). "
        f"{args.tokens_per_step} tokens per step at every sequence length (batch = {args.tokens_per_step} / seq), "
        f"{args.steps} steps per run of which the first {WARMUP_STEPS} are warm-up; {args.runs} runs of each: tokens/s is "
        f"the best run's (run-to-run spread: median {100 * statistics.median(spread):.0f}%, max {100 * max(spread):.0f}%), "
        "CPU work and memory the median. "
        + (f"cp={'/'.join(map(str, oversubscribed))} puts more ranks than cores ({cores()}) on the machine: "
           "its tokens/s is that of an oversubscribed machine. " if oversubscribed else "")
        + f"cp=1 uses one core, cp=2 {min(2, cores())}.",
        "",
        "## Training throughput: global tokens/s (ratio to cp=1 at that sequence length)",
        "",
        *table("tokens_per_s", lambda x: f"{x:,.0f}"),
        "",
        "## Work per step: CPU ms of all ranks together (ratio to cp=1)",
        "",
        *table("cpu_s_per_step", lambda x: f"{1000 * x:,.0f}"),
        "",
        "## Peak memory per rank: MiB of resident-set growth over the built model, max over ranks (ratio to cp=1)",
        "",
        "VmHWM at the end of training minus VmRSS at `on_train_start` (peak reset there): activations, gradients, "
        "AdamW state, all-gathered K/V, and the freed memory glibc keeps. The step's tokens are fixed, so activations "
        "do not grow with the sequence (the CPU flash kernel keeps attention O(seq)). The all-gather method's extra "
        f"for the whole sequence's K/V is {kv_mib:.1f} MiB per layer in forward (and as much again in fp32 dK/dV in "
        "backward), held one layer at a time (2 x batch x seq x KV heads x head dim x 4 B), plus the buffers gloo's "
        "all-gather and reduce-scatter allocate internally.",
        "",
        *table("peak_mib", lambda x: f"{x:,.0f}"),
        "",
        f"Step-0 loss agrees across all configurations and runs to {loss_gap:.1e} at every sequence length "
        "(same model, same data).",
    ]
    if balance:
        lines += [
            "",
            f"## Load balance: attention alone, seq {args.balance_seq}, batch 1, forward + backward, "
            f"median of {args.balance_reps} repetitions per rank",
            "",
            "CPU: the rank process's CPU time (gloo waits sleep): the rank's own work. Wall: per rank, it includes "
            "waiting for the slowest rank at every exchange, so the slowest rank sets it for all. Pairs: "
            "`attention_work`, query-key pairs computed per sequence and head (forward).",
            "",
            "| cp | method | zig-zag | CPU ms per rank | CPU max/min | wall ms (max) | pairs per rank (M) | pairs max/min |",
            "|---:|---|---|---|---:|---:|---|---:|",
        ]
        for (cp, method, load_balance), per_rank in balance.items():
            cpu = [r["cpu_s"] * 1000 for r in per_rank]
            work = [r["work"] for r in per_rank]
            lines.append(
                f"| {cp} | {method} | {'yes' if load_balance else 'no'} | {' / '.join(f'{x:.0f}' for x in cpu)} | "
                f"{max(cpu) / min(cpu):.2f} | {1000 * max(r['wall_s'] for r in per_rank):.0f} | "
                f"{' / '.join(f'{w / 1e6:.2f}' for w in work)} | {max(work) / min(work):.2f} |"
            )
    lines += ["", "## What the numbers say", "", *_summary(args, configs, med, balance, statistics.median(spread))]
    write_results("\n".join(lines) + "\n", args.out)
    if loss_gap > 1e-4:
        raise SystemExit(f"step-0 losses differ by {loss_gap:.2e}: the configurations do not train the same thing")


def _geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else float("nan")


def _summary(args, configs, med, balance, noise) -> list[str]:
    """Measured ratios, in words; which method wins is read off the numbers (a tie within `noise`, the
    median run-to-run tokens/s spread), not assumed."""
    seqs, out, longest = args.seq_lens, [], max(args.seq_lens)
    methods = CONTEXT_PARALLEL_METHODS
    for cp in (c for c in args.cps if c > 1 and 1 in args.cps):
        base = med[(1, None, longest)]
        speedup = {m: med[(cp, m, longest)]["tokens_per_s"] / base["tokens_per_s"] for m in methods}
        work = {m: med[(cp, m, longest)]["cpu_s_per_step"] / base["cpu_s_per_step"] for m in methods}
        memory = {m: med[(cp, m, longest)]["peak_mib"] / base["peak_mib"] for m in methods}
        each = lambda values, unit="": " / ".join(f"{values[m]:.2f}{unit}" for m in methods)  # noqa: E731
        out.append(
            f"- cp={cp} at seq {longest} ({' / '.join(methods)}): {each(speedup, 'x')} the tokens/s of cp=1, on "
            f"{min(cp, cores())} cores instead of 1, for {each(work, 'x')} its CPU work per step (the exchanges, and "
            f"ZeRO-3 over the cp ranks gathers the weights), and {each(memory)} of its peak memory per rank."
        )

    def verdict(ratio: float, method: str = "allgather") -> str:
        """`method` against the ring, from their tokens/s ratio."""
        if abs(ratio - 1) <= noise:
            return f"a tie within the run-to-run noise ({100 * noise:.0f}%)"
        return f"{method if ratio > 1 else 'ring'} is faster here"

    for cp in (c for c in args.cps if c > 1):
        ratios = [med[(cp, "allgather", s)]["tokens_per_s"] / med[(cp, "ring", s)]["tokens_per_s"] for s in seqs]
        cpu = _geomean([med[(cp, "allgather", s)]["cpu_s_per_step"] / med[(cp, "ring", s)]["cpu_s_per_step"] for s in seqs])
        mem = statistics.mean(med[(cp, "allgather", s)]["peak_mib"] - med[(cp, "ring", s)]["peak_mib"] for s in seqs)
        line = (
            f"- cp={cp} training, allgather / ring tokens/s: " + ", ".join(f"{r:.2f}" for r in ratios)
            + f" at seq {', '.join(map(str, seqs))} (geometric mean {_geomean(ratios):.2f}: {verdict(_geomean(ratios))}); "
            f"CPU work allgather / ring {cpu:.2f}; allgather's peak memory per rank {mem:+.0f} MiB vs ring"
        )
        if "alltoall" in methods:
            a2a = [med[(cp, "alltoall", s)]["tokens_per_s"] / med[(cp, "ring", s)]["tokens_per_s"] for s in seqs]
            a2a_mem = statistics.mean(med[(cp, "alltoall", s)]["peak_mib"] - med[(cp, "ring", s)]["peak_mib"] for s in seqs)
            line += (f"; alltoall (Ulysses) / ring tokens/s: {', '.join(f'{r:.2f}' for r in a2a)} (geometric mean "
                     f"{_geomean(a2a):.2f}: {verdict(_geomean(a2a), 'alltoall')}), alltoall's peak "
                     f"memory per rank {a2a_mem:+.0f} MiB vs ring")
        if (cp, "allgather", True) in balance:
            wall = {m: max(r["wall_s"] for r in balance[(cp, m, True)]) for m in BLOCK_METHODS}
            work = {m: sum(r["cpu_s"] for r in balance[(cp, m, True)]) for m in BLOCK_METHODS}
            line += (f". Attention alone (seq {args.balance_seq}, zig-zag): allgather / ring wall time "
                     f"{wall['allgather'] / wall['ring']:.2f}, CPU time {work['allgather'] / work['ring']:.2f}")
        out.append(line + ".")
    out.append(
        "- Per layer, allgather makes one all-gather in forward and an all-gather + a reduce-scatter in backward; "
        "the ring makes cp-1 neighbour exchanges of K/V in forward and cp-1 of K/V plus cp of dK/dV in backward, "
        "each waiting for the neighbours. In exchange the ring never holds the whole sequence's K/V, nor the "
        "buffers gloo's all-gather and reduce-scatter allocate for it. alltoall makes two all-to-alls in forward "
        "(q, k and v there in one, the output back) and two in backward, whatever cp."
    )
    for cp in sorted({key[0] for key in balance}):
        text = []
        for method in BLOCK_METHODS:
            on, off = balance[(cp, method, True)], balance[(cp, method, False)]
            cpu_on = max(r["cpu_s"] for r in on) / min(r["cpu_s"] for r in on)
            cpu_off = max(r["cpu_s"] for r in off) / min(r["cpu_s"] for r in off)
            wall = max(r["wall_s"] for r in off) / max(r["wall_s"] for r in on)
            text.append(f"{method} max/min CPU time {cpu_on:.2f} with zig-zag, {cpu_off:.2f} without "
                        f"(attention wall time without / with zig-zag: {wall:.2f})")
        pairs = [r["work"] for r in balance[(cp, "ring", False)]]
        out.append(f"- cp={cp} balance: " + "; ".join(text)
                   + f". Without zig-zag the last rank computes {max(pairs) / min(pairs):.1f}x the pairs of the first "
                   f"(2cp-1 = {2 * cp - 1}); with it every rank computes the same."
                   + (f" Here {cp} ranks share {cores()} cores, so wall time follows the total work, which zig-zag "
                      "does not change." if cp > cores() else ""))
    return out


if __name__ == "__main__":
    main()
