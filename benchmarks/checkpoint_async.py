"""Step time of a checkpoint save, synchronous vs `async_checkpoint=True` vs synchronous without the manifest, in one run.

Tiny `LlamaLM`, ZeRO-3 over 2 CPU ranks (gloo), a `ModelCheckpoint` every 5 steps, 41 steps;
the three modes alternate twice. For each run: the median plain step, the median step
that saves, the median time blocked inside `save_checkpoint` (and, for async, how much of
it waited for or published the previous save), and the median time of the manifest (each rank
checksums its share of the files, rank 0 writes `manifest.json`; "no manifest" skips it). Its table
is benchmarks/results/checkpoint_async.md.

    python benchmarks/checkpoint_async.py [--preset tiny] [--out benchmarks/results/checkpoint_async.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average, machine, write_results  # noqa: E402

STEPS, EVERY = 41, 5


def _job(rank: int, world_size: int, mode: str, folder: str, preset: str) -> tuple:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import ultrascale
    from ultrascale.data import CausalLMDataModule
    from ultrascale.models.lm import LlamaLM

    class StepTimes(L.Callback):
        def __init__(self) -> None:
            self.last, self.times = None, {}

        def on_train_batch_end(self, trainer, *args) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.times[trainer.global_step] = now - self.last
            self.last = now

    import ultrascale.parallel.checkpoint as checkpoint

    spent: dict[str, list[float]] = {"save": [], "finish": [], "manifest": []}
    cls = ultrascale.UltraScaleStrategy

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if name != "finish" or out is not None:  # finish_checkpoint returns the path it published, if any
                spent[name].append(time.perf_counter() - start)
            return out
        return run

    cls.save_checkpoint = timed("save", cls.save_checkpoint)
    cls.finish_checkpoint = timed("finish", cls.finish_checkpoint)
    checkpoint.write_manifest = timed("manifest", checkpoint.write_manifest if mode != "no manifest" else lambda *a, **k: None)
    async_checkpoint = mode == "async"
    timer = StepTimes()
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.ZeRO3Strategy(async_checkpoint=async_checkpoint),
                        max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=EVERY, save_top_k=-1), timer])
    model = LlamaLM(preset=preset, vocab_size=258, learning_rate=1e-3, max_steps=STEPS)
    trainer.fit(model, CausalLMDataModule(seq_len=64, global_batch_size=8, max_tokens=200_000, val_fraction=0.0, seed=1))
    size = sum(f.stat().st_size for f in next(Path(folder).glob("*.ckpt")).iterdir())
    return timer.times, sum(p.numel() for p in model.parameters()), spent, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "checkpoint_async.md"))
    options = parser.parse_args()
    from ultrascale.launch import run_ranks

    lines = [f"{machine()}; load average {load_average()}", "",
             "| run | parameters per rank | checkpoint MB | plain step ms | step that saves ms | blocked in save_checkpoint ms "
             "| of it: previous save ms | of it: manifest ms |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in ("sync", "async", "no manifest") * 2:
        with tempfile.TemporaryDirectory() as folder:
            times, params, spent, size = run_ranks(_job, 2, mode, folder, options.preset)[0]
        saving = [t for s, t in times.items() if s % EVERY == 1 and s > 5]  # the step whose end saved
        plain = [t for s, t in times.items() if s % EVERY not in (0, 1) and s > 5]
        previous = statistics.median(spent["finish"]) * 1e3 if spent["finish"] else 0.0
        manifest = statistics.median(spent["manifest"]) * 1e3 if mode != "no manifest" else 0.0
        lines.append(f"| {mode} | {params:,} | {size / 1e6:.2f} | {statistics.median(plain) * 1e3:.1f} | "
                     f"{statistics.median(saving) * 1e3:.1f} | {statistics.median(spent['save']) * 1e3:.1f} | {previous:.1f} "
                     f"| {manifest:.1f} |")
    write_results("\n".join(lines), options.out)


if __name__ == "__main__":
    main()
