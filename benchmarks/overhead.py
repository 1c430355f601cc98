"""Framework overhead: `Trainer(strategy="ultrascale_zero3")` vs the same training in a hand-written torch loop.

Both variants train the built-in `LlamaLM` (same preset, init seed and data) with FSDP2 on the
same number of gloo ranks and do the same work per optimizer step:

- FSDP2: `fully_shard` on each transformer block (all but the last resharded after forward), then
  on the root (not resharded after forward), gradient reductions set to SUM (divide factor 1);
- forward, the micro-batch's cross-entropy *sum* over its valid tokens, backward of that sum;
- one all-reduce of (loss sum, valid tokens) per step, every gradient shard multiplied by 1/N
  (the exact global token mean, `ultrascale.parallel.loss`);
- clipping by the global gradient norm, AdamW (decay on matrices only, `ADAMW_KERNEL` as the module), LambdaLR
  warm-up + cosine stepped every step, `zero_grad(set_to_none=True)`.

The hand loop is what a torch user writes (torchtitan-style): `torch.nn.utils.clip_grad_norm_`
on the DTensor gradients, `torch._foreach_mul_` for the 1/N scaling, no logging. The two
alternate (ultrascale, hand, ultrascale, hand, ...) in one invocation, so that machine noise
hits both alike. Printed and written to benchmarks/results/overhead.md: tokens/s of every run,
the medians and their ratio, the median of the per-pair ratios (a run and the one right after
it see the same machine state), CPU time and minor page faults per step (extra work shows there
even when waiting for a busy core hides it in wall time), and, to check that both train the
same thing, the step-0 loss, the step-0 gradient norm (normalised, before clipping: it checks
the token normalisation, which AdamW's near scale-invariance would hide in later losses) and
the last-step loss of each; the script fails if step 0 differs (loss by > 1e-5, norm relatively).

    python benchmarks/overhead.py [--ranks 2] [--steps 40] [--runs 9] [--preset tiny] [--seq-len 256] [--global-batch 8]

Trainer flags: `enable_progress_bar=False, logger=False, enable_checkpointing=False,
enable_model_summary=False` -- what a throughput run sets, and what the hand loop does (it
prints, logs and saves nothing); the summary and the checkpoint fall outside the timed steps
anyway. The strategy's own per-step `self.log("train_loss")` runs in every setting;
`--progress-bar` / `--logger` (CSVLogger, every 50 steps) switch those on to price them.
On CPU the strategy is told to keep freed heap memory in the process (`tune_cpu_allocator=True`); the
hand loop does the same, so the ratio prices the framework, not glibc's trimming.
"""

from __future__ import annotations

import argparse
import functools
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from _common import WARMUP_STEPS, Data, RandomTokens, Throughput, load_average, machine, write_results  # noqa: E402

import ultrascale  # noqa: E402,F401  (registers the strategies)
from ultrascale.data import ResumableBlockSampler  # noqa: E402
from ultrascale.estimate import ADAMW_KERNEL  # noqa: E402
from ultrascale.launch import run_ranks  # noqa: E402
from ultrascale.models.lm import LlamaLM, warmup_cosine  # noqa: E402
from ultrascale.parallel.device import tune_cpu_allocator  # noqa: E402
from ultrascale.parallel.loss import cross_entropy_sum  # noqa: E402

VARIANTS = ("ultrascale_zero3", "hand_fsdp2")


class Meter(Throughput):
    """`Throughput`'s wall-clock window, plus this process's CPU time (all threads) over the same window:
    CPU per step does not count waiting (for the other rank, for a core), so it shows a framework's extra
    work through the noise of a shared machine."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_start = self.cpu_end = 0.0
        self.faults_start = self.faults_end = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if batch_idx == WARMUP_STEPS:
            self.cpu_start, self.faults_start = time.process_time(), _minor_faults()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if batch_idx >= WARMUP_STEPS:
            self.cpu_end, self.faults_end = time.process_time(), _minor_faults()


class StepZero(L.Callback):
    """At step 0 (a warm-up step): the gradient norm the optimizer sees (normalised, before clipping)
    and the step loss the strategy logs (the global token mean)."""

    def __init__(self) -> None:
        self.loss = self.grad_norm = float("nan")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            self.grad_norm = _global_norm([p.grad for p in pl_module.parameters() if p.grad is not None])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.loss = float(trainer.callback_metrics["train_loss"])


def _global_norm(grads: list[torch.Tensor]) -> float:
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _ultrascale(rank, world_size, preset, steps, seq_len, global_batch, seed, clip, progress_bar, logger, log_dir):
    torch.manual_seed(seed)
    meter, first = Meter(), StepZero()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ultrascale.ZeRO3Strategy(tune_cpu_allocator=True), max_steps=steps,
        gradient_clip_val=clip, enable_progress_bar=progress_bar,
        logger=L.pytorch.loggers.CSVLogger(log_dir) if logger else False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[meter, first],
    )
    model = LlamaLM(preset=preset, max_seq_len=seq_len, max_steps=steps, init_seed=seed)
    trainer.fit(model, Data(steps * global_batch, seq_len, model.config.vocab_size, global_batch))
    tokens = meter.steps * global_batch * seq_len  # global tokens: each rank timed the same steps
    return {
        "tokens_per_s": tokens / (meter.end - meter.start),
        "cpu_ms_per_step": 1000 * (meter.cpu_end - meter.cpu_start) / meter.steps,
        "faults_per_step": (meter.faults_end - meter.faults_start) / meter.steps,
        "first_loss": first.loss,
        "first_grad_norm": first.grad_norm,
        "last_loss": float(trainer.callback_metrics["train_loss"]),
    }


def _hand(rank, world_size, preset, steps, seq_len, global_batch, seed, clip, *_):
    torch.manual_seed(seed)
    tune_cpu_allocator()  # what the strategy does with tune_cpu_allocator=True: compare framework work, not malloc settings
    dist.init_process_group("gloo")  # env:// (run_ranks sets what torchrun would)
    mesh = init_device_mesh("cpu", (world_size,))
    lm = LlamaLM(preset=preset, max_seq_len=seq_len, max_steps=steps, init_seed=seed)
    lm.configure_model()  # the same weights as under the Trainer: drawn from `init_seed` alone
    model, hp = lm.model, lm.hparams
    for i, block in enumerate(model.layers):
        # the last block's parameters are needed right at the start of backward: keep them gathered
        fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):  # sum the gradients; the step divides once by the tokens
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)

    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps, **ADAMW_KERNEL,
    )
    schedule = functools.partial(warmup_cosine, warmup_steps=hp.warmup_steps, max_steps=steps, min_lr_ratio=hp.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    dataset = RandomTokens(steps * global_batch, seq_len, model.config.vocab_size)
    sampler = ResumableBlockSampler(dataset, global_batch, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=sampler.local_batch_size, sampler=sampler)

    model.train()
    first_grad_norm, losses, start, end, cpu_start, cpu_end, faults_start, faults_end, timed = float("nan"), [], 0.0, 0.0, 0.0, 0.0, 0, 0, 0
    for step, batch in enumerate(loader):
        if step == WARMUP_STEPS:  # as `Meter`: from the start of step 3 (its batch already loaded)
            start, cpu_start, faults_start = time.perf_counter(), time.process_time(), _minor_faults()
        optimizer.zero_grad(set_to_none=True)
        loss_sum, num_tokens = cross_entropy_sum(model(batch["input_ids"]), batch["labels"])
        loss_sum.backward()  # this micro-batch's token sum; FSDP reduce-scatters with SUM
        totals = torch.stack([loss_sum.detach().double(), num_tokens.double()])
        dist.all_reduce(totals)  # (loss sum, valid tokens) of the global batch
        num_tokens = totals[1].clamp(min=1)
        with torch.no_grad():
            torch._foreach_mul_([p.grad.to_local() for p in params if p.grad is not None], (1.0 / num_tokens).float())
        losses.append((totals[0] / num_tokens).float())  # stays a tensor: no host sync in the loop
        norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)  # the norm before clipping
        if step == 0:
            first_grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        optimizer.step()
        scheduler.step()
        if step >= WARMUP_STEPS:
            end, cpu_end, faults_end, timed = time.perf_counter(), time.process_time(), _minor_faults(), timed + 1
    dist.destroy_process_group()
    return {
        "tokens_per_s": timed * global_batch * seq_len / (end - start),
        "cpu_ms_per_step": 1000 * (cpu_end - cpu_start) / timed,
        "faults_per_step": (faults_end - faults_start) / timed,
        "first_loss": float(losses[0]),
        "first_grad_norm": first_grad_norm,
        "last_loss": float(losses[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=9, help="runs of each variant, alternating")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (gradient_clip_val)")
    parser.add_argument("--progress-bar", action="store_true", help="Trainer(enable_progress_bar=True)")
    parser.add_argument("--logger", action="store_true", help="Trainer(logger=CSVLogger) (logs every 50 steps)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "overhead.md"))
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")

    load_before = load_average()
    workers = {"ultrascale_zero3": _ultrascale, "hand_fsdp2": _hand}
    measured: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as log_dir:
        for run in range(args.runs):
            for variant in VARIANTS:
                per_rank = run_ranks(
                    workers[variant], args.ranks, args.preset, args.steps, args.seq_len, args.global_batch,
                    args.seed, args.clip, args.progress_bar, args.logger, log_dir,
                )
                result = {
                    "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in per_rank),
                    "cpu_ms_per_step": statistics.mean(r["cpu_ms_per_step"] for r in per_rank),
                    "faults_per_step": statistics.mean(r["faults_per_step"] for r in per_rank),
                    "first_loss": per_rank[0]["first_loss"],
                    "first_grad_norm": per_rank[0]["first_grad_norm"],
                    "last_loss": per_rank[0]["last_loss"],
                }
                measured[variant].append(result)
                print(f"run {run + 1}/{args.runs} {variant}: {result['tokens_per_s']:,.0f} tokens/s, "
                      f"{result['cpu_ms_per_step']:.1f} CPU ms/step, {result['faults_per_step']:.0f} page faults/step, "
                      f"loss step 0 {result['first_loss']:.7f}, step {args.steps - 1} {result['last_loss']:.7f}, "
                      f"gradient norm step 0 {result['first_grad_norm']:.7g}", flush=True)

    medians = {v: statistics.median(m["tokens_per_s"] for m in measured[v]) for v in VARIANTS}
    cpu = {v: statistics.median(m["cpu_ms_per_step"] for m in measured[v]) for v in VARIANTS}
    faults = {v: statistics.median(m["faults_per_step"] for m in measured[v]) for v in VARIANTS}
    ratio = medians["ultrascale_zero3"] / medians["hand_fsdp2"]
    # Each ultrascale run and the hand run right after it share the machine's state: their ratio is less noisy.
    pairs = [u["tokens_per_s"] / h["tokens_per_s"] for u, h in zip(measured["ultrascale_zero3"], measured["hand_fsdp2"])]
    cpu_ratio = cpu["ultrascale_zero3"] / cpu["hand_fsdp2"]
    first = {v: measured[v][0]["first_loss"] for v in VARIANTS}
    last = {v: measured[v][0]["last_loss"] for v in VARIANTS}
    first_diff = abs(first["ultrascale_zero3"] - first["hand_fsdp2"])
    last_diff = abs(last["ultrascale_zero3"] - last["hand_fsdp2"])
    norm0 = {v: measured[v][0]["first_grad_norm"] for v in VARIANTS}
    norm_diff = abs(norm0["ultrascale_zero3"] - norm0["hand_fsdp2"])
    step_ms = {v: 1000 * args.global_batch * args.seq_len / medians[v] for v in VARIANTS}
    flags = [f for f, on in (("--progress-bar", args.progress_bar), ("--logger", args.logger)) if on]
    trainer_flags = (
        f"enable_progress_bar={args.progress_bar}, logger={'CSVLogger' if args.logger else False}, "
        f"enable_checkpointing=False, enable_model_summary=False, gradient_clip_val={args.clip:g}"
    )
    command = "python benchmarks/overhead.py " + " ".join(
        [f"--ranks {args.ranks}", f"--steps {args.steps}", f"--runs {args.runs}", f"--preset {args.preset}",
         f"--seq-len {args.seq_len}", f"--global-batch {args.global_batch}", f"--seed {args.seed}", f"--clip {args.clip:g}", *flags]
    )
    header = [
        "# Framework overhead: `Trainer(strategy=\"ultrascale_zero3\")` vs a hand-written FSDP2 loop",
        "",
        f"`{command}`",
        "",
        f"LlamaLM preset={args.preset}, seq {args.seq_len}, global batch {args.global_batch}, {args.ranks} CPU ranks "
        f"(gloo, 1 torch thread each), fp32, {args.steps} steps per run of which the first {WARMUP_STEPS} are "
        f"warm-up (not timed), {args.runs} alternating runs of each (ultrascale, hand, ultrascale, ...).",
        "",
        f"Machine: {machine()}; load average {load_before} before, {load_average()} after. "
        f"torch {torch.__version__}, lightning {L.__version__}, Python {platform.python_version()}.",
        "",
        f"Trainer: {trainer_flags}. Hand loop: the same FSDP2 layout and SUM reductions, token-sum backward, "
        "one all-reduce of (loss sum, tokens) per step, gradients times 1/N, `torch.nn.utils.clip_grad_norm_`, "
        "AdamW, LambdaLR; no logging.",
        "",
        "tokens/s: global tokens of the timed steps over their wall time, mean of the ranks. CPU ms/step: "
        "process CPU time (all threads) over the same steps, mean of the ranks; it leaves out time spent waiting "
        "(for the other rank, for a core), so it shows extra work through a shared machine's noise. "
        "Page faults/step: minor page faults (getrusage), mean of the ranks: memory that glibc gave back to the "
        "system (heap trimming) and the step touched again.",
        "",
    ]
    table = [
        "| run | " + " | ".join(f"{v} tokens/s | CPU ms/step | page faults/step" for v in VARIANTS)
        + " | tokens/s ratio of the pair |",
        "|---:|" + "---:|---:|---:|" * len(VARIANTS) + "---:|",
        *(f"| {i + 1} | " + " | ".join(
            f"{m['tokens_per_s']:,.0f} | {m['cpu_ms_per_step']:.1f} | {m['faults_per_step']:,.0f}"
            for m in (measured[v][i] for v in VARIANTS)
        ) + f" | {pairs[i]:.3f} |" for i in range(args.runs)),
        "| **median** | " + " | ".join(
            f"**{medians[v]:,.0f}** ({step_ms[v]:.1f} ms/step) | **{cpu[v]:.1f}** | {faults[v]:,.0f}" for v in VARIANTS
        ) + f" | {statistics.median(pairs):.3f} |",
        "",
        f"**ratio ultrascale / hand (median tokens/s): {ratio:.3f}**; median of the paired ratios "
        f"{statistics.median(pairs):.3f} (range {min(pairs):.3f}-{max(pairs):.3f}); CPU time per step "
        f"ultrascale / hand: {cpu_ratio:.3f} ({cpu['ultrascale_zero3'] - cpu['hand_fsdp2']:+.1f} ms).",
        "",
        "| same training? (rank 0, run 1) | " + " | ".join(VARIANTS) + " | abs. difference |",
        "|---|" + "---:|" * (len(VARIANTS) + 1),
        "| loss, step 0 (global token mean) | " + " | ".join(f"{first[v]:.7f}" for v in VARIANTS) + f" | {first_diff:.1e} |",
        "| gradient norm, step 0 (normalised, before clipping) | "
        + " | ".join(f"{norm0[v]:.7g}" for v in VARIANTS) + f" | {norm_diff:.1e} |",
        f"| loss, step {args.steps - 1} | " + " | ".join(f"{last[v]:.7f}" for v in VARIANTS) + f" | {last_diff:.1e} |",
    ]
    write_results("\n".join(header + table) + "\n", args.out)
    if first_diff > 1e-5 or not norm_diff <= 1e-5 * norm0["hand_fsdp2"]:
        raise SystemExit(
            f"step 0 differs (loss by {first_diff:.2e}, gradient norm by {norm_diff:.2e}): "
            "the two variants do not train the same thing"
        )


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


if __name__ == "__main__":
    main()
