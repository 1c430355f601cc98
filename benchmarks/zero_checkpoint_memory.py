"""Host memory a ZeRO-1/2 checkpoint costs to save and to load, per rank, against the rank's optimizer state.

A ZeRO-1/2 rank holds its slice of every bucket; the checkpoint holds each parameter's state split
like DTensor Shard(0) over the same ranks (so it loads at any world size). Saving re-lays the slices
out, loading lays them back. What that costs on top of the training state, per rank, is

    extra = (peak resident memory while saving, or loading) - (resident memory just before)

and the target (issue 48) is extra <= 2 x the rank's optimizer state (fp32 master + Adam's two moments
under bf16 compute: 12 bytes per parameter / N): one copy is unavoidable (the state in the checkpoint's
layout, which DCP writes from or reads into), the rest is the re-layout's working memory.

Each (ranks, stage) runs in fresh processes (a fork per rank, gloo), with glibc returning freed memory
at once (mmap threshold 64 KiB), so resident memory follows the live tensors. The save and the load are
the library's own: `save_sharded_checkpoint` of the model and `ZeroEngine.sharded_state_dict`, and
`resume.load_training_state` into a fresh engine. The loaded state is checked against the saved one.

    python benchmarks/zero_checkpoint_memory.py [--ranks 2 4] [--dim 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import write_results  # noqa: E402
from ultrascale.launch import init_gloo, run_ranks  # noqa: E402

MIB = 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


class PeakResident:
    """Samples this process's resident memory every millisecond while the block runs."""

    def __enter__(self) -> "PeakResident":
        gc.collect()
        self.before = self.peak = _resident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _resident())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _resident())

    @property
    def extra(self) -> int:
        return self.peak - self.before


def _model(dim: int, layers: int) -> torch.nn.Module:
    from ultrascale.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=8192, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                         ffn_hidden_dim=dim * 11 // 4, max_seq_len=64)
    torch.manual_seed(0)
    return Llama(config)


def _engine(model, stage, mesh, bucket_mb):
    from ultrascale.parallel.zero import ZeroEngine, zero12_dtypes

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compute_dtype, accumulate_dtype = zero12_dtypes("bf16-mixed")  # the strategy's engine under bf16-mixed
    engine = ZeroEngine(model, optimizer, stage=stage, dp_mesh=mesh, bucket_bytes=int(bucket_mb * MIB),
                        compute_dtype=compute_dtype, accumulate_dtype=accumulate_dtype)
    return optimizer, engine


def _state_bytes(engine) -> int:
    """The rank's optimizer state: every state tensor of its slices, plus the fp32 masters when they are copies."""
    total = sum(v.numel() * v.element_size() for b in engine.buckets
                for v in engine.optimizer.state.get(b.master, {}).values() if isinstance(v, torch.Tensor) and v.dim())
    if engine.has_master_copies:
        total += sum(b.master.numel() * b.master.element_size() for b in engine.buckets)
    return total


def _measure(rank, world_size, stage, dim, layers, bucket_mb, folder):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.parallel.checkpoint import save_sharded_checkpoint
    from ultrascale.parallel.resume import load_training_state

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: large blocks are mapped and unmapped at once
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD: the heap top goes back as soon as it is free
    init_gloo(rank, world_size)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard_cp",))
    model = _model(dim, layers)
    optimizer, engine = _engine(model, stage, mesh, bucket_mb)
    torch.manual_seed(rank)  # one step on made-up gradients: the moments become non-zero
    sum((p * torch.randn_like(p)).sum() for p in model.parameters()).backward()
    optimizer.step()
    state = _state_bytes(engine)
    path = Path(folder) / "checkpoint"
    with PeakResident() as saving:
        tensors = {"state_dict": get_model_state_dict(model), "optimizer_0": engine.sharded_state_dict()}
        save_sharded_checkpoint(tensors, {}, path)
        del tensors
    saved = {id(b): {k: v.clone() for k, v in optimizer.state[b.master].items()} for b in engine.buckets}
    masters = [b.master.detach().clone() for b in engine.buckets]
    fresh_model = _model(dim, layers)
    fresh_optimizer, fresh_engine = _engine(fresh_model, stage, mesh, bucket_mb)
    fresh_engine.init_state()
    with PeakResident() as loading:
        load_training_state(path, fresh_model, [fresh_optimizer], zero_stage=stage, engines=[fresh_engine])
    for old, new, master in zip(engine.buckets, fresh_engine.buckets, masters):  # the load is exact
        torch.testing.assert_close(new.master.detach(), master, rtol=0, atol=0)
        for key, value in saved[id(old)].items():
            torch.testing.assert_close(fresh_optimizer.state[new.master][key], value, rtol=0, atol=0)
    return {"state": state, "save": saving.extra, "load": loading.extra,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--label", default="", help="a name for this code's column (e.g. 'before')")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_checkpoint_memory.md"))
    args = parser.parse_args()
    rows = []
    params = 0
    for ranks in args.ranks:
        for stage in args.stages:
            with tempfile.TemporaryDirectory() as folder:
                results = run_ranks(_measure, ranks, stage, args.dim, args.layers, args.bucket_mb, folder, timeout=900)
            params = results[0]["params"]
            worst = max(results, key=lambda r: max(r["save"], r["load"]) / r["state"])
            rows.append(f"| {ranks} | ZeRO-{stage} | {worst['state'] / MIB:,.1f} | {worst['save'] / MIB:,.1f} | "
                        f"{worst['save'] / worst['state']:.2f}x | {worst['load'] / MIB:,.1f} | "
                        f"{worst['load'] / worst['state']:.2f}x |")
    label = f" ({args.label})" if args.label else ""
    text = (
        f"Llama dim {args.dim}, {args.layers} layers, vocab 8192 (Ψ = {params / 1e6:.1f}M), AdamW, bf16 compute with fp32 "
        f"masters, buckets of {args.bucket_mb:g} MiB, gloo on CPU; the rank with the highest ratio; torch "
        f"{torch.__version__}{label}\n\n"
        "| dp ranks | stage | optimizer state / rank (MiB) | extra to save (MiB) | save / state | extra to load (MiB) "
        "| load / state |\n|---:|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    write_results(text, args.out)


if __name__ == "__main__":
    main()
