"""Peak memory per rank and tokens/s at a real vocabulary, with the head and the loss chunked and not.

A Llama with Qwen 2.5's vocabulary of 151,936 tokens (narrow and shallow, so that the head and its logits are
most of the memory and of the compute, as in a long-context fine-tune of a small model), ZeRO-3 over 2 CPU ranks,
one sequence per rank: `LlamaLM(loss_chunk_tokens=0)` (every token's logits at once) against the default
(`default_loss_chunk_tokens`, 1,024 tokens at this vocabulary). Each configuration runs in fresh processes, so
each rank's peak is its own.

Measured per rank: the peak resident set (`VmHWM`) less the resident set at Lightning's `setup` hook (the
process, torch and the process group, before the model is built), and tokens/s of the steps after the warm-up.
Beside them, the planner's prediction of the same rank (`planner.cost.peak_memory`: the model state and the
activations, the loss's logits priced as `estimate.ActivationModel.loss_bytes` prices them, whole or one chunk),
and the loss's share of it. A configuration whose predicted peak on both ranks would not fit in the machine's
free memory is not started.

    python benchmarks/memory_at_scale.py [--seq-lens 2048,4096,8192] [--steps 2] [--precision 32-true]

fp32 by default: on CPUs without bf16 matrix instructions (the AMD EPYC this was first run on) a bf16 matmul
runs 8-10x slower than fp32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Data, ForeignLoad, machine, write_results  # noqa: E402

import ultrascale  # noqa: E402
from ultrascale import planner  # noqa: E402
from ultrascale.estimate import ModelShape  # noqa: E402
from ultrascale.launch import run_ranks  # noqa: E402
from ultrascale.models.llama import LlamaConfig  # noqa: E402
from ultrascale.models.lm import LlamaLM  # noqa: E402
from ultrascale.parallel.loss import default_loss_chunk_tokens  # noqa: E402
from ultrascale.planner.cost import activation_model, peak_memory  # noqa: E402

VOCAB = 151_936
WARMUP = 1
RANKS = 2
GIB = 2**30


def _config(seq_len: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=256,
                       max_seq_len=seq_len)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20


class Peak(L.Callback):
    def setup(self, trainer, pl_module, stage):
        self.start_kib = _status_kib("VmRSS")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == WARMUP:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.t1, self.timed = time.perf_counter(), batch_idx + 1 - WARMUP


def _run(rank, world_size, seq_len, chunk, steps, precision):
    torch.set_num_threads(1)
    module = LlamaLM(config=_config(seq_len), learning_rate=1e-4, warmup_steps=0, max_steps=WARMUP + steps,
                     loss_chunk_tokens=chunk)
    peak = Peak()
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.ZeRO3Strategy(), precision=precision,
                        max_steps=WARMUP + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[peak])
    trainer.fit(module, Data(world_size * (WARMUP + steps), seq_len, VOCAB, global_batch=world_size))
    return {"peak_gib": (_status_kib("VmHWM") - peak.start_kib) / 2**20,
            "tokens_per_s": world_size * seq_len * peak.timed / (peak.t1 - peak.t0),
            "chunk": module.loss_chunk_tokens_in_use()}


def _predicted(seq_len: int, chunk: int | None, precision: str) -> tuple[float, float]:
    """The planner's peak of one rank and the loss's bytes in it (GiB)."""
    shape = ModelShape.from_llama_config(_config(seq_len))
    layout = planner.Layout(dp_shard=RANKS)
    work = planner.Workload(seq_len, RANKS, precision=precision, loss_chunk_tokens=chunk)
    return peak_memory(shape, layout, work) / GIB, activation_model(shape, layout, work).loss_bytes() / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="2048,4096,8192")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_at_scale.md"))
    options = parser.parse_args()
    default_chunk = default_loss_chunk_tokens(VOCAB)
    rows, started = [], time.perf_counter()
    for seq_len in [int(s) for s in options.seq_lens.split(",")]:
        measured = {}
        for label, chunk in (("whole", 0), ("chunked", None)):
            predicted, loss = _predicted(seq_len, chunk, options.precision)
            free = _available_gib()
            if RANKS * predicted > 0.85 * free:
                measured[label] = {"skipped": f"{RANKS} ranks x {predicted:.1f} GiB predicted > 85% of {free:.1f} GiB free",
                                   "predicted_gib": predicted, "loss_gib": loss}
                print(f"seq {seq_len} {label}: not run ({measured[label]['skipped']})", flush=True)
                continue
            load = ForeignLoad()
            load.start()
            results = run_ranks(_run, RANKS, seq_len, chunk, options.steps, options.precision)
            measured[label] = {"peak_gib": max(r["peak_gib"] for r in results), "tokens_per_s": results[0]["tokens_per_s"],
                               "chunk": results[0]["chunk"], "predicted_gib": predicted, "loss_gib": loss,
                               "foreign": load.stop()}
            print(f"seq {seq_len} {label}: {measured[label]}", flush=True)
        rows.append((seq_len, measured))
    wall = time.perf_counter() - started
    lines = [
        f"Peak memory per rank at a {VOCAB:,}-token vocabulary, written by benchmarks/memory_at_scale.py: Llama dim 128, "
        f"2 layers, ZeRO-3 over {RANKS} CPU ranks (gloo), precision {options.precision}, one sequence per rank, "
        f"{options.steps} timed steps after {WARMUP}. `loss_chunk_tokens=0` (the whole logits) against the default "
        f"({default_chunk:,} tokens a chunk). Measured peak: VmHWM less the resident set at Lightning's `setup`, the "
        "larger of the ranks. Predicted: the planner's peak of the rank (`planner.cost.peak_memory`), and in it the "
        "loss's logits and inputs (`ActivationModel.loss_bytes`).",
        f"Machine: {machine()}. Took {wall / 60:.1f} min. Command: `python benchmarks/memory_at_scale.py "
        f"{' '.join(sys.argv[1:])}`.",
        "",
        "| sequence | loss | predicted peak (GiB) | of it the loss (GiB) | measured peak (GiB) | measured / predicted | "
        "tokens/s | chunked / whole tokens/s | other processes |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seq_len, measured in rows:
        whole = measured["whole"]
        for label in ("whole", "chunked"):
            m = measured[label]
            name = f"chunked ({m['chunk']:,} tokens)" if m.get("chunk") else label
            if "skipped" in m:
                lines.append(f"| {seq_len:,} | {name} | {m['predicted_gib']:.2f} | {m['loss_gib']:.2f} | not run: "
                             f"{m['skipped']} | | | | |")
                continue
            ratio = (f"{m['tokens_per_s'] / whole['tokens_per_s']:.2f}"
                     if label == "chunked" and "tokens_per_s" in whole else "")
            lines.append(f"| {seq_len:,} | {name} | {m['predicted_gib']:.2f} | {m['loss_gib']:.2f} | {m['peak_gib']:.2f} | "
                         f"{m['peak_gib'] / m['predicted_gib']:.2f} | {m['tokens_per_s']:,.0f} | {ratio} | "
                         f"{100 * m['foreign']:.0f}% |")
    write_results("\n".join(lines) + "\n", options.out)


if __name__ == "__main__":
    main()
