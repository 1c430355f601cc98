"""ZeRO-1 / ZeRO-2 / ZeRO-3 vs plain DDP: model-state memory, communication, throughput.

Same LlamaLM job, same ranks, bf16-mixed (the Ultra-Scale Playbook's setting). For each
strategy, measured on the live tensors / collectives of rank 0, beside the formula:

- model-state bytes per rank (params + grads + optimizer state, Ψ parameters, N ranks, Adam):
    DDP 16Ψ (Lightning keeps fp32 params + fp32 grads + 8Ψ Adam; the Playbook's 2+2+12 is also 16Ψ)
    ZeRO-1 2Ψ + 4Ψ + 12Ψ/N,  ZeRO-2 2Ψ + 16Ψ/N (fp32 gradients, bf16-mixed's default),  ZeRO-3 16Ψ/N;
    with `accumulate_grads_in_fp32=False` (the "-bf16grads" rows, the Playbook's own formulas)
    ZeRO-1 2Ψ + 2Ψ + 12Ψ/N,  ZeRO-2 2Ψ + 14Ψ/N
- bytes each rank sends per step (ring algorithms: all-reduce 2(N-1)/N, all-gather and
  reduce-scatter (N-1)/N of the message), with the dtype each implementation uses:
    DDP: all-reduce of fp32 grads            2·4Ψ(N-1)/N
    ZeRO-1/2: reduce-scatter fp32 grads + all-gather bf16 params   (4+2)Ψ(N-1)/N
              (bf16 grads: (2+2)Ψ(N-1)/N)
    ZeRO-3 (FSDP2): all-gathers of bf16 params in forward and again in backward, except for
    the root unit (embeddings, norm, head) and the last block, which ultrascale keeps
    gathered from forward to backward; reduce-scatter of fp32 grads:
    (2Ψ + 2(Ψ - Ψ_root - Ψ_last) + 4Ψ)(N-1)/N; the Playbook's 3Ψ counts every re-gather.
- tokens/s (global).

    python benchmarks/zero_memory_comm.py [--ranks 4] [--steps 12] [--preset small]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).parent))
from _common import WARMUP_STEPS, Data, Throughput, write_results  # noqa: E402

import ultrascale  # noqa: E402
from ultrascale.launch import run_ranks  # noqa: E402
from ultrascale.models.lm import LlamaLM  # noqa: E402
from ultrascale.parallel import zero as zero_module  # noqa: E402
from ultrascale.parallel.memory import model_state_bytes  # noqa: E402


class CountSent:
    """Bytes this rank sends per collective call, by ring-algorithm accounting."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes, self.counting = world, 0.0, False

    def _add(self, nbytes: int, factor: float) -> None:
        if self.counting:
            self.bytes += nbytes * factor * (self.world - 1) / self.world

    def install(self) -> None:
        def wrap(fn):
            def counted(*args, **kwargs):
                # The full message is the larger buffer: the all-gather output, the reduce-scatter input.
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                self._add(max(t.numel() * t.element_size() for t in tensors), 1)
                return fn(*args, **kwargs)

            return counted

        for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, wrap(getattr(dist, name)))
        zero_module._reduce_scatter = wrap(zero_module._reduce_scatter)
        zero_module._all_gather = wrap(zero_module._all_gather)

    def ddp_hook(self):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            self._add(bucket.buffer().numel() * bucket.buffer().element_size(), 2)
            return allreduce_hook(state, bucket)

        return hook


class Measure(L.Callback):
    def __init__(self, counter: CountSent) -> None:
        self.counter, self.memory, self.steps = counter, None, 0

    def on_fit_start(self, trainer, pl_module):
        # Lightning registers DDP comm hooks only on CUDA; on CPU register the counting one here.
        if isinstance(trainer.strategy, DDPStrategy):
            trainer.strategy.model.register_comm_hook(None, self.counter.ddp_hook())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counter.counting = batch_idx >= WARMUP_STEPS

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += int(batch_idx >= WARMUP_STEPS)
        self.counter.counting = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == WARMUP_STEPS:
            self.memory = model_state_bytes(pl_module, [optimizer], getattr(trainer.strategy, "zero_engines", ()))


def _run(rank, world_size, variant, args):
    torch.set_num_threads(1)
    counter = CountSent(world_size)
    counter.install()
    strategy = {
        "ddp": lambda: DDPStrategy(process_group_backend="gloo"),
        "zero1": lambda: ultrascale.ZeRO1Strategy(zero_bucket_mb=args.bucket_mb),
        "zero2": lambda: ultrascale.ZeRO2Strategy(zero_bucket_mb=args.bucket_mb),
        "zero1-bf16grads": lambda: ultrascale.ZeRO1Strategy(zero_bucket_mb=args.bucket_mb, accumulate_grads_in_fp32=False),
        "zero2-bf16grads": lambda: ultrascale.ZeRO2Strategy(zero_bucket_mb=args.bucket_mb, accumulate_grads_in_fp32=False),
        "zero3": lambda: ultrascale.ZeRO3Strategy(),
    }[variant]()
    measure, meter = Measure(counter), Throughput()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, precision="bf16-mixed", max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[measure, meter],
    )
    model = LlamaLM(preset=args.preset, max_seq_len=args.seq_len, max_steps=args.steps)
    trainer.fit(model, Data(args.steps * args.global_batch, args.seq_len, model.config.vocab_size, args.global_batch))
    psi = model.num_params()
    blocks = sum(p.numel() for p in model.model.layers.parameters())
    return {
        "psi": psi,
        "psi_root": psi - blocks,
        "psi_last": sum(p.numel() for p in model.model.layers[-1].parameters()),
        "memory": measure.memory,
        "sent_per_step": counter.bytes / measure.steps,
        "tokens_per_s": meter.steps * args.global_batch * args.seq_len / (meter.end - meter.start),
    }


def formulas(variant: str, result: dict, n: int) -> tuple[float, float]:
    psi, ring = result["psi"], (n - 1) / n
    regathered = psi - result["psi_root"] - result["psi_last"]
    return {
        "ddp": (16 * psi, 2 * 4 * psi * ring),
        "zero1": ((2 + 4) * psi + 12 * psi / n, (4 + 2) * psi * ring),
        "zero2": (2 * psi + 16 * psi / n, (4 + 2) * psi * ring),
        "zero1-bf16grads": ((2 + 2) * psi + 12 * psi / n, (2 + 2) * psi * ring),
        "zero2-bf16grads": (2 * psi + 14 * psi / n, (2 + 2) * psi * ring),
        "zero3": (16 * psi / n, (2 * psi + 2 * regathered + 4 * psi) * ring),
    }[variant]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_memory_comm.md"))
    args = parser.parse_args()
    n = args.ranks
    rows = []
    for variant in ("ddp", "zero1", "zero2", "zero1-bf16grads", "zero2-bf16grads", "zero3"):
        result = run_ranks(_run, n, variant, args)[0]
        memory_formula, comm_formula = formulas(variant, result, n)
        rows.append((variant, result, memory_formula, comm_formula))
    mib = 2**20
    lines = [
        f"LlamaLM preset={args.preset} (Ψ = {rows[0][1]['psi'] / 1e6:.2f}M), {n} CPU ranks (gloo), bf16-mixed, "
        f"AdamW, seq {args.seq_len}, global batch {args.global_batch}; rank 0, after {WARMUP_STEPS} warm-up steps; "
        f"torch {torch.__version__}",
        "",
        "| strategy | model state / rank (MiB) | formula (MiB) | params / grads / optimizer (MiB) "
        "| sent / rank / step (MiB) | formula (MiB) | tokens/s |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for variant, result, memory_formula, comm_formula in rows:
        memory = result["memory"]
        lines.append(
            f"| {variant} | {memory.total / mib:.2f} | {memory_formula / mib:.2f} | "
            f"{memory.params / mib:.2f} / {memory.grads / mib:.2f} / {memory.optimizer / mib:.2f} | "
            f"{result['sent_per_step'] / mib:.2f} | {comm_formula / mib:.2f} | {result['tokens_per_s']:,.0f} |"
        )
    text = "\n".join(lines) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    main()
