"""Soak test: a long ZeRO-3 run must keep its memory flat and leave nothing behind.

One `Trainer(strategy=ZeRO3Strategy(launcher="fork"), devices=2)` fit of the built-in `LlamaLM`
(preset "tiny", byte vocabulary) on the Python standard library's source
(`CausalLMDataModule(data_path="stdlib")`, a corpus small enough that the run goes through several
epochs: the data loaders are rebuilt each time), gloo on CPU, for --steps optimizer steps, with

- `ModelCheckpoint(every_n_train_steps=--ckpt-every, monitor="train_loss", save_top_k=--top-k,
  save_last=True)`: a sharded (DCP) checkpoint directory per save, the worse ones deleted;
- validation every --val-every steps (`val_check_interval`, `limit_val_batches=--val-batches`);
- Lightning's default logger (TensorBoard, or CSV without it) writing into the run's folder.

A callback samples each rank every --sample-every steps (at the start of the step, so that the
previous step's checkpoint and validation are done), and once more at the end of training:

- resident memory (VmRSS, its anonymous part RssAnon and its file-backed part, /proc/self/status);
- glibc malloc, all arenas (`malloc_info`): bytes in use (handed out, not freed) and bytes held from
  the system. On CPU the strategy keeps freed heap memory in the process (`tune_cpu_allocator`), so
  RSS follows the heap's high-water mark; a leak shows in "in use";
- threads, open file descriptors (/proc/self/fd), Python objects tracked by the garbage collector
  (and, from the warm-up end to the end, their change by type);
- child processes of the rank (psutil, recursive), the checkpoint folder's entries (rank 0).

Reported: the samples per rank; least-squares slopes per 1,000 steps (RSS, RssAnon, malloc in use and
held) over the samples after warm-up (--warmup-steps: the samples before the first checkpoint and
the first validation have run are left out, as those allocate once: DCP's buffers, the validation
loader, the optimizer state), with the standard error, the residuals' spread, the RSS slope over the
second half and the RSS jumps between samples; what the run left behind (child processes of this
process, its file descriptors and threads before `fit`, right after it and once the Trainer is
garbage; files in the run's private TMPDIR; `.<name>.tmp-*` / `.<name>.old-*` directories in the
checkpoint folder); and checkpoint retention: the directories left must be exactly the `save_top_k`
best by the `train_loss` each save saw (replayed from the losses the callback recorded, Lightning's
rule: strictly better than the worst kept) plus `last.ckpt`. The script exits non-zero if retention
or leftovers are wrong. About 2.5 minutes with the defaults on 2 cores.

With --tracemalloc, each rank also traces Python allocations from the warm-up end and prints the 15
largest growths between then and the end (slow: for investigating growth).

    python benchmarks/soak.py [--steps 2000] [--ckpt-every 100] [--val-every 200] [--sample-every 100]
        [--warmup-steps 200] [--top-k 2] [--seq-len 128] [--global-batch 8] [--max-tokens 400000]
        [--val-batches 4] [--tracemalloc] [--keep]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from _common import load_average, machine, write_results  # noqa: E402

import ultrascale  # noqa: E402
from ultrascale.data import CausalLMDataModule  # noqa: E402
from ultrascale.models import LlamaLM  # noqa: E402

KiB_PER_MiB = 1024
LEFTOVER = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{12}$")


# ----------------------------------------------------------------------------- what a process holds


def _status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                fields[key] = int(value.split()[0])
    return fields


def _fd_targets(pid: int | str = "self") -> list[str]:
    """What each open file descriptor of the process points to (the listing's own fd included)."""
    folder = f"/proc/{pid}/fd"
    targets = []
    for fd in os.listdir(folder):
        try:
            targets.append(os.readlink(f"{folder}/{fd}"))
        except OSError:  # closed meanwhile (the listing's own)
            continue
    return sorted(targets)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _malloc_kib() -> tuple[int, int]:
    """(bytes glibc's malloc has handed out and not got back, bytes it holds from the system), in KiB, all
    arenas (`malloc_info`, written to memory: no file descriptor). RSS follows the second: freed memory
    stays in the heap (the strategy's `tune_cpu_allocator`); a leak shows in the first."""
    libc = _libc()
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(ctypes.cast(buf, ctypes.c_void_p))
    totals = text.rsplit("</heap>", 1)[-1]
    value = {k: int(v) for k, v in re.findall(r'<(?:total|system) type="(\w+)" count="\d+" size="(\d+)"', totals)}
    value.update({k: int(v) for k, v in re.findall(r'<system type="(\w+)" size="(\d+)"', totals)})
    held = value["current"] + value["mmap"]
    return (held - value["fast"] - value["rest"]) // 1024, held // 1024


def _type_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        cls = type(obj)
        name = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls.__name__)}"
        counts[name] = counts.get(name, 0) + 1
    return counts


def _generic(target: str) -> str:
    """An fd target without the inode number that makes every pipe / socket unique."""
    return re.sub(r"\[\d+\]", "[...]", target)


def _diff(before: list[str], after: list[str]) -> dict[str, int]:
    """Net change of the fd targets by kind (pipe:[...], socket:[...], a path)."""
    counts: dict[str, int] = {}
    for target in after:
        counts[_generic(target)] = counts.get(_generic(target), 0) + 1
    for target in before:
        counts[_generic(target)] = counts.get(_generic(target), 0) - 1
    return {k: v for k, v in sorted(counts.items()) if v}


# ----------------------------------------------------------------------------- the sampling callback


class Sampler(L.Callback):
    """Samples its rank every `every` steps and at the end of training; writes them to `out/rank<r>.json`."""

    def __init__(self, out: Path, ckpt_dir: Path, every: int, ckpt_every: int, warmup: int, trace: bool) -> None:
        self.out, self.ckpt_dir, self.every, self.ckpt_every, self.warmup = out, ckpt_dir, every, ckpt_every, warmup
        self.trace_from = warmup if trace else None
        self.samples: list[dict] = []
        self.saves: list[dict] = []  # (step, epoch, train_loss) each checkpoint save saw
        self.fds_first: list[str] = []
        self.fds_last: list[str] = []
        self.t0 = 0.0
        self.trace_start: tracemalloc.Snapshot | None = None
        self.trace_top: list[str] = []
        self.types_first: dict[str, int] = {}
        self.types_growth: list[tuple[str, int]] = []

    def on_train_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            self._sample(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # ModelCheckpoint runs after every other callback: this sees what its save will see.
        if trainer.global_step % self.ckpt_every == 0 and trainer.is_global_zero:
            loss = trainer.callback_metrics.get("train_loss")
            self.saves.append({"step": trainer.global_step, "epoch": trainer.current_epoch,
                               "train_loss": None if loss is None else float(loss)})

    def on_train_end(self, trainer, pl_module):
        self._sample(trainer)
        if self.types_first:
            last = _type_counts()
            growth = {k: last.get(k, 0) - self.types_first.get(k, 0) for k in set(last) | set(self.types_first)}
            self.types_growth = sorted(((k, v) for k, v in growth.items() if v), key=lambda kv: -abs(kv[1]))[:8]
        if self.trace_start is not None:
            stats = tracemalloc.take_snapshot().compare_to(self.trace_start, "lineno")
            self.trace_top = [str(s) for s in stats[:15]]
            tracemalloc.stop()
        if trainer.is_global_zero:
            callback = trainer.checkpoint_callback
            self.best_k = {Path(k).name: float(v) for k, v in callback.best_k_models.items()}
            self.last = Path(callback.last_model_path).name
        self._write(trainer)

    def _sample(self, trainer) -> None:
        step = trainer.global_step
        if self.trace_from is not None and step == self.trace_from:
            tracemalloc.start(10)
        status = _status()
        fds = _fd_targets()
        in_use, held = _malloc_kib()
        entries = sorted(os.listdir(self.ckpt_dir)) if trainer.is_global_zero and self.ckpt_dir.is_dir() else []
        sample = {
            "step": step,
            "wall_s": time.perf_counter() - self.t0,
            "rss_kib": status["VmRSS"],
            "anon_kib": status["RssAnon"],
            "file_kib": status["RssFile"],
            "malloc_in_use_kib": in_use,
            "malloc_held_kib": held,
            "threads": status["Threads"],
            "fds": len(fds),
            "py_objects": len(gc.get_objects()),
            "children": len(psutil.Process().children(recursive=True)),
            "ckpt_entries": entries,
        }
        if step == self.warmup:
            self.types_first = _type_counts()
        if self.trace_from is not None and step == self.trace_from:
            self.trace_start = tracemalloc.take_snapshot()
        if not self.fds_first:
            self.fds_first = fds
        self.fds_last = fds
        self.samples.append(sample)
        self._write(trainer)

    def _write(self, trainer) -> None:
        data = {"rank": trainer.global_rank, "pid": os.getpid(), "samples": self.samples, "saves": self.saves,
                "fds_first": self.fds_first, "fds_last": self.fds_last, "trace_top": self.trace_top,
                "types_growth": self.types_growth,
                "best_k": getattr(self, "best_k", None), "last": getattr(self, "last", None)}
        tmp = self.out / f".rank{trainer.global_rank}.json"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.out / f"rank{trainer.global_rank}.json")


# ----------------------------------------------------------------------------- analysis


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares slope, its standard error, and the residuals' max - min."""
    slope, intercept = statistics.linear_regression(xs, ys)
    residuals = [y - (slope * x + intercept) for x, y in zip(xs, ys)]
    n, mean_x = len(xs), statistics.fmean(xs)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    stderr = math.sqrt(sum(r * r for r in residuals) / (n - 2) / sxx) if n > 2 and sxx > 0 else float("nan")
    return slope, stderr, max(residuals) - min(residuals)


def expected_retention(saves: list[dict], top_k: int) -> set[str]:
    """The checkpoints ModelCheckpoint(save_top_k, mode="min", save_last=True) should leave: replays its
    rule (a save enters the top k while it has room, then only when strictly better than the worst kept)."""
    kept: dict[str, float] = {}
    for save in saves:
        name, loss = f"epoch={save['epoch']}-step={save['step']}.ckpt", save["train_loss"]
        if len(kept) < top_k:
            kept[name] = loss
        elif loss < max(kept.values()):
            worst = max(kept, key=kept.get)  # ties: the first of the worst, as max() in Lightning
            del kept[worst]
            kept[name] = loss
    return set(kept) | {"last.ckpt"}


def _children() -> list[str]:
    return [f"{p.pid} {p.name()} ({p.status()})" for p in psutil.Process().children(recursive=True)]


def _mib(kib: float) -> str:
    return f"{kib / KiB_PER_MiB:.1f}"


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--val-every", type=int, default=200)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--warmup-steps", type=int, default=200,
                        help="samples before this step are left out of the slope")
    parser.add_argument("--top-k", type=int, default=2, help="ModelCheckpoint(save_top_k)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400_000, help="corpus size: sets the epoch length")
    parser.add_argument("--val-batches", type=int, default=4, help="limit_val_batches")
    parser.add_argument("--tracemalloc", action="store_true", help="diff Python allocations per rank, warm-up end to end (slow)")
    parser.add_argument("--keep", action="store_true", help="keep the run folder (checkpoints, logs)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.md"))
    args = parser.parse_args()
    if args.warmup_steps % args.sample_every or args.steps <= args.warmup_steps + 2 * args.sample_every:
        parser.error("--warmup-steps must be a multiple of --sample-every, with 3 or more samples after it")

    root = Path(tempfile.mkdtemp(prefix="ultrascale-soak-"))
    ckpt_dir, run_tmp, samples_dir, logs = root / "checkpoints", root / "tmp", root / "samples", root / "logs"
    for folder in (run_tmp, samples_dir, logs):
        folder.mkdir()
    # Whatever the run creates through `tempfile` goes here, so that leftovers can be told apart.
    os.environ["TMPDIR"] = tempfile.tempdir = str(run_tmp)

    gc.collect()
    me = psutil.Process()
    before = {"fds": _fd_targets(), "threads": me.num_threads(), "children": _children()}
    load_before = load_average()
    try:
        parent = _fit(args, ckpt_dir, samples_dir, logs)
    except BaseException:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        raise
    # The Trainer is gone now (it lived in `_fit`'s frame): what is still open was left behind.
    gc.collect()
    gone = {"fds": _fd_targets(), "threads": me.num_threads(), "children": _children(),
            "py_threads": [t.name for t in threading.enumerate()]}
    tmp_left = sorted(str(p.relative_to(run_tmp)) for p in run_tmp.rglob("*"))
    ckpt_final = sorted(os.listdir(ckpt_dir))
    hidden_left = [name for name in ckpt_final if name.startswith(".")]
    ranks = [json.loads((samples_dir / f"rank{r}.json").read_text()) for r in range(2)]
    expected = expected_retention(ranks[0]["saves"], args.top_k)
    visible = {name for name in ckpt_final if not name.startswith(".")}
    incomplete = sorted(name for name in visible if not ((ckpt_dir / name / ".metadata").is_file()
                                                          and (ckpt_dir / name / "meta.pt").is_file()))
    text, ok = _report(args, ranks, before, parent, gone, tmp_left, hidden_left, visible, expected, incomplete,
                       load_before)
    write_results(text, args.out)
    if args.keep:
        print(f"run folder kept: {root}")
    else:
        shutil.rmtree(root)
    if not ok:
        raise SystemExit("leftovers or wrong checkpoint retention: see the report")


def _fit(args, ckpt_dir: Path, samples_dir: Path, logs: Path) -> dict:
    """The fit; returns this process's state right after it (the Trainer still alive)."""
    L.seed_everything(1234, verbose=False)
    sampler = Sampler(samples_dir, ckpt_dir, args.sample_every, args.ckpt_every, args.warmup_steps, args.tracemalloc)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, monitor="train_loss",
                                 mode="min", save_top_k=args.top_k, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ultrascale.ZeRO3Strategy(launcher="fork"), precision="32-true",
        max_steps=args.steps, val_check_interval=args.val_every, check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches, gradient_clip_val=1.0, default_root_dir=logs,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[sampler, checkpoint],
    )
    model = LlamaLM(preset="tiny", vocab_size=258, max_seq_len=args.seq_len, learning_rate=3e-3,
                    warmup_steps=20, max_steps=args.steps)
    data = CausalLMDataModule(data_path="stdlib", seq_len=args.seq_len, global_batch_size=args.global_batch,
                              max_tokens=args.max_tokens, val_fraction=0.02)
    wall0 = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - wall0
    return {"wall_s": wall, "fds": _fd_targets(), "threads": psutil.Process().num_threads(), "children": _children(),
            "logger": type(trainer.logger).__name__}


def _report(args, ranks, before, parent, gone, tmp_left, hidden_left, visible, expected, incomplete,
            load_before) -> tuple[str, bool]:
    samples = [r["samples"] for r in ranks]
    steps = [s["step"] for s in samples[0]]
    rows = [
        "| step | wall s | RSS r0 (MiB) | RSS r1 (MiB) | malloc in use r0 / r1 (MiB) | fds r0 / r1 | threads r0 / r1 "
        "| Python objects r0 / r1 | children r0 / r1 | checkpoint folder (rank 0) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, step in enumerate(steps):
        a, b = samples[0][i], samples[1][i]
        entries = a["ckpt_entries"]
        shown = ", ".join(e.replace(".ckpt", "") for e in entries) if entries else "(empty)"
        mark = "" if step >= args.warmup_steps else " (warm-up)"
        rows.append(
            f"| {step}{mark} | {a['wall_s']:.0f} | {_mib(a['rss_kib'])} | {_mib(b['rss_kib'])} "
            f"| {_mib(a['malloc_in_use_kib'])} / {_mib(b['malloc_in_use_kib'])} | {a['fds']} / {b['fds']} "
            f"| {a['threads']} / {b['threads']} | {a['py_objects']:,} / {b['py_objects']:,} "
            f"| {a['children']} / {b['children']} | {shown} |"
        )

    after_warmup = [[s for s in rank_samples if s["step"] >= args.warmup_steps] for rank_samples in samples]
    half = args.steps // 2

    def slope(r: int, key: str, start: int = args.warmup_steps) -> tuple[float, float, float]:
        kept = [s for s in after_warmup[r] if s["step"] >= start]
        return fit_line([s["step"] / 1000 for s in kept], [s[key] / KiB_PER_MiB for s in kept])

    slope_rows = [
        f"| rank | RSS at step {args.warmup_steps} → end (MiB) | RSS slope (MiB / 1,000 steps) ± std. error "
        "| residuals max-min (MiB) | RssAnon slope | malloc in use slope ± std. error | malloc held slope "
        f"| RSS slope from step {half} | fds first / last | threads first / last |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fits = []
    for r, rank_samples in enumerate(samples):
        rss, anon, in_use, held = (slope(r, k) for k in ("rss_kib", "anon_kib", "malloc_in_use_kib", "malloc_held_kib"))
        late = slope(r, "rss_kib", half)
        fits.append({"rss": rss, "in_use": in_use, "late": late})
        slope_rows.append(
            f"| {r} | {_mib(after_warmup[r][0]['rss_kib'])} → {_mib(rank_samples[-1]['rss_kib'])} "
            f"| {rss[0]:+.2f} ± {rss[1]:.2f} | {rss[2]:.2f} | {anon[0]:+.2f} | {in_use[0]:+.2f} ± {in_use[1]:.2f} "
            f"| {held[0]:+.2f} | {late[0]:+.2f} ± {late[1]:.2f} | {rank_samples[0]['fds']} / {rank_samples[-1]['fds']} "
            f"| {rank_samples[0]['threads']} / {rank_samples[-1]['threads']} |"
        )
    fd_growth = [_diff(r["fds_first"], r["fds_last"]) for r in ranks]
    type_growth = [", ".join(f"{k.rsplit('.', 1)[-1]} {v:+d}" for k, v in r["types_growth"]) or "none" for r in ranks]

    def fds(state: dict) -> str:
        change = _diff(before["fds"], state["fds"])
        return f"{len(state['fds'])}" + (f" ({', '.join(f'{k} {v:+d}' for k, v in change.items())})" if change else "")

    def children(state: dict) -> str:
        return f"{len(state['children'])}" + (f" ({', '.join(state['children'])})" if state["children"] else "")

    leftover_rows = [
        "| this process (the launcher) | before `fit` | right after `fit` (Trainer alive) | Trainer gone (`gc.collect()`) |",
        "|---|---:|---:|---:|",
        f"| child processes (any state, zombies included) | {children(before)} | {children(parent)} | {children(gone)} |",
        f"| open file descriptors | {fds(before)} | {fds(parent)} | {fds(gone)} |",
        f"| threads | {before['threads']} | {parent['threads']} | {gone['threads']} (Python: {', '.join(gone['py_threads'])}) |",
    ]
    files_rows = [
        "| files left behind | count |",
        "|---|---:|",
        f"| in the run's private TMPDIR | {len(tmp_left)}{' (' + ', '.join(tmp_left[:10]) + ')' if tmp_left else ''} |",
        f"| `.<name>.tmp-*` / `.<name>.old-*` (any hidden entry) in the checkpoint folder | {len(hidden_left)}"
        f"{' (' + ', '.join(hidden_left) + ')' if hidden_left else ''} |",
        f"| hidden entries in the checkpoint folder at any sample | "
        f"{sum(e.startswith('.') for s in samples[0] for e in s['ckpt_entries'])} |",
        f"| checkpoint directories missing `.metadata` or `meta.pt` | {len(incomplete)} |",
    ]
    retention_rows = [
        f"| checkpoint folder after `fit` | expected: the {args.top_k} best by train_loss + last | "
        "ModelCheckpoint.best_k_models (rank 0) |",
        "|---|---|---|",
        f"| {', '.join(sorted(visible))} | {', '.join(sorted(expected))} | "
        + ", ".join(f"{k} ({v:.4f})" for k, v in sorted((ranks[0]["best_k"] or {}).items())) + " |",
    ]
    saves_line = ", ".join(f"{s['step']}: {s['train_loss']:.4f}" for s in ranks[0]["saves"])

    ok_retention = visible == expected and not incomplete
    ok_leftovers = not (hidden_left or tmp_left or gone["children"] or parent["children"]
                        or _diff(before["fds"], gone["fds"]))
    epochs = max(s["epoch"] for s in ranks[0]["saves"]) + 1 if ranks[0]["saves"] else 1
    command = "python benchmarks/soak.py " + " ".join([
        f"--steps {args.steps}", f"--ckpt-every {args.ckpt_every}", f"--val-every {args.val_every}",
        f"--sample-every {args.sample_every}", f"--warmup-steps {args.warmup_steps}", f"--top-k {args.top_k}",
        f"--seq-len {args.seq_len}", f"--global-batch {args.global_batch}", f"--max-tokens {args.max_tokens}",
        f"--val-batches {args.val_batches}", *(["--tracemalloc"] if args.tracemalloc else []),
    ])
    wall = parent["wall_s"]
    verdict = []
    for r, fit in enumerate(fits):
        in_use, rss, late = fit["in_use"], fit["rss"], fit["late"]
        flat = abs(in_use[0]) <= max(0.25, 3 * in_use[1])
        kept = after_warmup[r]
        jumps = [
            f"step {b['step']} {(b['rss_kib'] - a['rss_kib']) / KiB_PER_MiB:+.1f} (anon "
            f"{(b['anon_kib'] - a['anon_kib']) / KiB_PER_MiB:+.1f}, malloc held "
            f"{(b['malloc_held_kib'] - a['malloc_held_kib']) / KiB_PER_MiB:+.1f}, files "
            f"{(b['file_kib'] - a['file_kib']) / KiB_PER_MiB:+.1f})"
            for a, b in zip(kept, kept[1:]) if b["rss_kib"] - a["rss_kib"] > KiB_PER_MiB // 2
        ]
        rest = (kept[-1]["rss_kib"] - kept[0]["rss_kib"]) / KiB_PER_MiB - sum(
            (b["rss_kib"] - a["rss_kib"]) / KiB_PER_MiB for a, b in zip(kept, kept[1:]) if b["rss_kib"] - a["rss_kib"] > KiB_PER_MiB // 2)
        verdict.append(
            f"**Rank {r}: live heap {'flat' if flat else 'GROWING'}** (malloc in use {in_use[0]:+.2f} ± {in_use[1]:.2f} "
            f"MiB per 1,000 steps; flat: within 0.25 MiB or 3 standard errors). RSS {rss[0]:+.2f} ± {rss[1]:.2f} MiB per "
            f"1,000 steps from step {args.warmup_steps}, {late[0]:+.2f} ± {late[1]:.2f} from step {half}; of its "
            f"{(kept[-1]['rss_kib'] - kept[0]['rss_kib']) / KiB_PER_MiB:+.1f} MiB, "
            + (f"the jumps over 0.5 MiB between samples (MiB): {'; '.join(jumps)}; the other {len(kept) - 1 - len(jumps)} "
               f"intervals together {rest:+.1f} MiB." if jumps else "no jump between samples exceeds 0.5 MiB.")
        )
    lines = [
        "# Soak: 2 ZeRO-3 ranks with checkpoints and validation: memory, handles, processes, retention",
        "",
        f"`{command}`",
        "",
        f"`Trainer(accelerator=\"cpu\", devices=2, strategy=ZeRO3Strategy(launcher=\"fork\"), max_steps={args.steps}, "
        f"val_check_interval={args.val_every}, limit_val_batches={args.val_batches}, gradient_clip_val=1)`, logger "
        f"{parent['logger']} (the default), `ModelCheckpoint(every_n_train_steps={args.ckpt_every}, "
        f"monitor=\"train_loss\", save_top_k={args.top_k}, save_last=True)`; LlamaLM preset=tiny (vocab 258), seq "
        f"{args.seq_len}, global batch {args.global_batch}, fp32, gloo; CausalLMDataModule(stdlib, "
        f"max_tokens={args.max_tokens:,}): {epochs} epochs in {args.steps} steps. Wall time of `fit`: {wall:.0f} s "
        f"({1000 * wall / args.steps:.0f} ms per step, checkpoints and validation included).",
        "",
        f"Machine: {machine()}; load average {load_before} before, {load_average()} after. "
        f"torch {torch.__version__}, lightning {L.__version__}, Python {platform.python_version()}.",
        "",
        f"Each rank is sampled every {args.sample_every} steps at the start of the step (the previous step's "
        "checkpoint and validation done) and at the end of training. RSS: VmRSS. malloc in use: bytes glibc's "
        "malloc has handed out and not got back, all arenas (`malloc_info`); malloc held: what it holds from the "
        "system. On CPU the strategy keeps freed heap memory in the process (`tune_cpu_allocator`), so RSS is "
        "the heap's high-water mark and a leak shows in \"in use\". fds: open file descriptors. Python objects: "
        "`len(gc.get_objects())`. children: child processes of the rank.",
        "",
        *rows,
        "",
        f"Slopes: least squares over the {len(after_warmup[0])} samples from step {args.warmup_steps} on. The "
        f"samples before are warm-up: until step {args.warmup_steps} the first checkpoint (step {args.ckpt_every}), "
        f"the first validation (step {args.val_every}) and the optimizer state (step 1) allocate for the first time. "
        f"std. error: of the slope, from the residuals; the last slope column uses the samples from step {half} on.",
        "",
        *slope_rows,
        "",
        "Open file descriptors, last sample against the first, per rank (net change by kind): "
        + "; ".join(f"rank {r}: {', '.join(f'{k} {v:+d}' for k, v in d.items()) or 'none'}" for r, d in enumerate(fd_growth))
        + f". Python objects by type, end against step {args.warmup_steps}, largest changes: "
        + "; ".join(f"rank {r}: {g}" for r, g in enumerate(type_growth))
        + f" (the sampler's own records add one dict and one list per sample: {len(after_warmup[0]) - 1} of each).",
        "",
        *leftover_rows,
        "",
        *files_rows,
        "",
        *retention_rows,
        "",
        f"train_loss each save saw (step: loss): {saves_line}.",
        "",
        "\n\n".join(verdict),
        "",
        f"**Leftovers: {'none' if ok_leftovers else 'FOUND'}. Retention: {'as asked' if ok_retention else 'WRONG'}.**",
        "",
    ]
    if any(r["trace_top"] for r in ranks):
        for r, rank in enumerate(ranks):
            lines += [f"tracemalloc, rank {r}, largest growths from step {args.warmup_steps} to the end:", "", "```",
                      *rank["trace_top"], "```", ""]
    return "\n".join(lines), ok_retention and ok_leftovers


if __name__ == "__main__":
    main()
