"""ultrascale ZeRO-3 vs Lightning's ModelParallelStrategy with a hand-written FSDP2 `configure_model`.

Same LlamaLM job, same ranks, steps and data; the two strategies alternate (A B A B ...)
so that machine noise hits both alike. Prints tokens/s of each, their ratio, and peak RSS
per rank, and writes benchmarks/results/zero_vs_lightning.md.

    python benchmarks/zero_vs_lightning.py [--ranks 2] [--steps 40] [--repeats 5] [--preset small]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from _common import WARMUP_STEPS, Data, Throughput, write_results  # noqa: E402

import ultrascale  # noqa: E402,F401
from ultrascale.launch import run_ranks  # noqa: E402
from ultrascale.models.lm import LlamaLM  # noqa: E402


class HandShardedLlama(LlamaLM):
    """What a Lightning user writes for ModelParallelStrategy: FSDP2 per block, then the root."""

    def configure_model(self) -> None:
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _run(rank, world_size, variant, preset, steps, seq_len, global_batch):
    torch.set_num_threads(1)
    model_cls, strategy = {
        "ultrascale_zero3": (LlamaLM, "ultrascale_zero3"),
        "lightning_model_parallel": (HandShardedLlama, ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)),
    }[variant]
    meter = Throughput()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
    )
    model = model_cls(preset=preset, max_seq_len=seq_len, max_steps=steps)
    trainer.fit(model, Data(steps * global_batch, seq_len, model.config.vocab_size, global_batch))
    tokens = meter.steps * global_batch * seq_len  # global tokens: each rank timed the same steps
    return {"tokens_per_s": tokens / (meter.end - meter.start), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_vs_lightning.md"))
    args = parser.parse_args()
    variants = ["ultrascale_zero3", "lightning_model_parallel"]
    measured: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            per_rank = run_ranks(_run, args.ranks, variant, args.preset, args.steps, args.seq_len, args.global_batch)
            measured[variant].append({
                "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in per_rank),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank),
            })
    rows = {}
    for variant in variants:
        speeds = [m["tokens_per_s"] for m in measured[variant]]
        rows[variant] = (
            statistics.median(speeds),
            statistics.median(m["peak_rss_mib"] for m in measured[variant]),
            f"{min(speeds):,.0f}-{max(speeds):,.0f}",
        )
    ratio = rows["ultrascale_zero3"][0] / rows["lightning_model_parallel"][0]
    header = (
        f"LlamaLM preset={args.preset}, seq {args.seq_len}, global batch {args.global_batch}, {args.ranks} CPU ranks (gloo), "
        f"{args.steps} steps ({WARMUP_STEPS} warm-up), fp32, median of {args.repeats} alternating runs; "
        f"{torch.__version__}, lightning {L.__version__}"
    )
    table = [
        "| strategy | tokens/s (global, median) | tokens/s (min-max) | peak RSS per rank (MiB) |",
        "|---|---:|---:|---:|",
        *(f"| {v} | {rows[v][0]:,.0f} | {rows[v][2]} | {rows[v][1]:,.0f} |" for v in variants),
        f"| **ratio ultrascale / Lightning** | **{ratio:.3f}** | "
        f"| {rows['ultrascale_zero3'][1] / rows['lightning_model_parallel'][1]:.3f} |",
    ]
    text = header + "\n\n" + "\n".join(table) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    main()
