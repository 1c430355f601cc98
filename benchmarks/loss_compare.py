"""The same model, data and seed under several layouts of one world size: the loss curves side by side.

As torchtitan compares layouts (its `scripts/loss_compare.py`): a change of layout must not change
the numbers. Each layout runs the tiny parity Llama (4 layers, dim 32, GQA) for `--steps`
optimizer steps on prompt-masked random tokens (valid-token counts differ per row, rank and
micro-batch) on `--world` forked CPU ranks with gloo, and logs the step's token-mean loss. A
plain-torch single-process run of the same model and batches (the loss written inline) is the
first column. The table gives every layout's curve and its largest distance from that
reference; the script exits 1 if any is above `--tolerance` (fp32: 1e-4).

    python benchmarks/loss_compare.py [--world 8] [--steps 5] [--out benchmarks/results/loss_compare.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results  # noqa: E402

# The layouts of world 8 (every one uses all ranks): what each parallelism family looks like at that size.
LAYOUTS: dict[str, dict] = {
    "ZeRO-3 dp8": {"data_parallel_shard": 8},
    "HSDP 2x2 x tp2": {"data_parallel_replicate": 2, "data_parallel_shard": 2, "tensor_parallel": 2},
    "dp2 x cp2 x tp2 (ZeRO-3)": {"data_parallel_shard": 2, "context_parallel": 2, "tensor_parallel": 2},
    "pp2 x dp2 x tp2 (1F1B)": {"pipeline_parallel": 2, "data_parallel_shard": 2, "tensor_parallel": 2,
                               "pipeline_microbatches": 2},
    "pp2 x dp4 ZeRO-1 (Interleaved1F1B)": {"pipeline_parallel": 2, "data_parallel_shard": 4, "zero_stage": 1,
                                           "pipeline_schedule": "Interleaved1F1B", "pipeline_microbatches": 2},
}
GLOBAL_BATCH = 8  # sequences per step: 2 per data rank at dp 4, 4 at dp 2, 1 at dp 8


def _train(rank: int, world_size: int, knobs: dict, steps: int) -> list[float]:
    import ultrascale
    from tests._parity import ParityData, Recorder, parity_trainer
    from tests.test_pipeline_parallel import make_llama, masked_data

    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**knobs), recorder, steps)
    trainer.fit(make_llama(), ParityData(masked_data(), GLOBAL_BATCH))
    return recorder.result()["losses"]


def compare(world: int, steps: int, layouts: dict[str, dict]) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
    """(reference curve, {layout: curve}, {layout: seconds})."""
    from tests._parity import reference_run
    from tests.test_pipeline_parallel import make_llama, masked_data
    from ultrascale.launch import run_ranks

    reference = reference_run(make_llama(), masked_data(), global_batch=GLOBAL_BATCH, steps=steps)["losses"]
    curves, seconds = {}, {}
    for name, knobs in layouts.items():
        started = time.perf_counter()
        results = run_ranks(_train, world, knobs, steps)
        seconds[name] = time.perf_counter() - started
        for rank, losses in enumerate(results[1:], start=1):
            if losses != results[0]:
                raise RuntimeError(f"{name}: rank {rank} logged other losses than rank 0")
        curves[name] = results[0]
    return reference, curves, seconds


def table(reference: list[float], curves: dict[str, list[float]], seconds: dict[str, float], world: int) -> list[str]:
    names = list(curves)
    lines = [
        f"Loss per optimizer step, tiny Llama on masked data, {GLOBAL_BATCH} sequences per step, world {world} (CPU, gloo, fp32); "
        "reference = one process, plain torch.",
        "",
        "| step | reference | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for step, value in enumerate(reference):
        lines.append(f"| {step + 1} | {value:.6f} | " + " | ".join(f"{curves[n][step]:.6f}" for n in names) + " |")
    lines.append("| max \\|Δ\\| vs reference | | " + " | ".join(
        f"{max(abs(a - b) for a, b in zip(curves[n], reference)):.1e}" for n in names) + " |")
    lines.append("| wall s (fork + fit) | | " + " | ".join(f"{seconds[n]:.1f}" for n in names) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "loss_compare.md"))
    options = parser.parse_args()
    reference, curves, seconds = compare(options.world, options.steps, LAYOUTS)
    write_results("\n".join(table(reference, curves, seconds, options.world)), options.out)
    worst = max(max(abs(a - b) for a, b in zip(curve, reference)) for curve in curves.values())
    if worst > options.tolerance:
        print(f"FAILED: a layout's curve is {worst:.2e} from the reference (tolerance {options.tolerance:g})")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
