"""Loading a Hugging Face checkpoint sharded (ZeRO-3) on 1, 2, 4 ranks vs `from_pretrained` on one process.

ultrascale builds the model on the meta device, shards it, and each rank reads only the
slices of the safetensors it owns, so the peak memory a rank adds while loading should
fall roughly as 1/N. Measured per rank: wall time of build + shard + load + one read of
every weight (transformers memory-maps safetensors, so weights only become resident when
used), and the peak RSS increase over the process's RSS before loading (ru_maxrss - RSS at start).

    python benchmarks/hf_load.py [--hidden 768] [--layers 12] [--vocab 16384]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import write_results  # noqa: E402

from ultrascale.launch import init_gloo, run_ranks  # noqa: E402
from ultrascale.models.adapters import get_adapter  # noqa: E402
from ultrascale.models.hf import load_hf_weights, recompute_nonpersistent_buffers  # noqa: E402
from ultrascale.parallel.dims import ParallelDims, build_mesh  # noqa: E402
from ultrascale.parallel.parallelize import parallelize  # noqa: E402


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load_sharded(rank: int, world_size: int, path: str) -> dict:
    import transformers

    torch.set_num_threads(1)
    init_gloo(rank, world_size)
    mesh = build_mesh(ParallelDims.resolve(world_size), "cpu")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    start_rss, start = _rss_mib(), time.perf_counter()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    parallelize(model, mesh, blocks=get_adapter(model).blocks)
    model.to_empty(device="cpu")
    recompute_nonpersistent_buffers(model)
    load_hf_weights(model, path)
    _touch(model)
    return {"seconds": time.perf_counter() - start, "peak_added_mib": _peak_mib() - start_rss}


def _from_pretrained(rank: int, world_size: int, path: str) -> dict:
    import transformers

    torch.set_num_threads(1)
    start_rss, start = _rss_mib(), time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    _touch(model)
    return {"seconds": time.perf_counter() - start, "peak_added_mib": _peak_mib() - start_rss}


def _touch(model: torch.nn.Module) -> float:
    """Read every weight once: memory-mapped safetensors only become resident when used."""
    with torch.no_grad():
        return float(sum(float((p.to_local() if hasattr(p, "to_local") else p).sum()) for p in model.parameters()))


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_load.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size="200MB")
        del model
        size_mib = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20
        rows = [("from_pretrained, 1 process", run_ranks(_from_pretrained, 1, folder))]
        for world in (1, 2, 4):
            rows.append((f"ultrascale ZeRO-3, {world} rank{'s' if world > 1 else ''}", run_ranks(_load_sharded, world, folder)))
    lines = [
        f"Llama {params / 1e6:.0f}M parameters, fp32 safetensors {size_mib:.0f} MiB; CPU; per rank (max over ranks)",
        "",
        "| load | seconds | peak RSS added per rank (MiB) | vs checkpoint size |",
        "|---|---:|---:|---:|",
    ]
    for name, per_rank in rows:
        seconds = max(r["seconds"] for r in per_rank)
        peak = max(r["peak_added_mib"] for r in per_rank)
        lines.append(f"| {name} | {seconds:.2f} | {peak:.0f} | {peak / size_mib:.2f} |")
    text = "\n".join(lines) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    main()
