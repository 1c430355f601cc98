"""Tensor parallel vs tensor + sequence parallel: communication and activation memory per layer.

Measured on the built-in Llama under ultrascale's TP plan (gloo, CPU ranks), beside the
Ultra-Scale Playbook's figures:

- communication: per layer, one forward + backward moves 4 all-reduces of b*s*h elements
  under TP, or 4 all-gathers + 4 reduce-scatters under TP+SP. A ring all-reduce sends
  2(N-1)/N of the message per rank and an all-gather or reduce-scatter sends (N-1)/N, so
  both move the same volume, 8(N-1)/N * b*s*h*bytes, and SP uses twice as many collectives.
- activations: SP keeps the norm regions' activations (residual stream, RMSNorm inputs
  and outputs) at b*s*h/tp per rank instead of b*s*h. DTensor's column-parallel linears
  still save their all-gathered input at full b*s*h for backward (Megatron-SP saves the
  shard and gathers it again in backward), so only the norm regions shrink here.

Per-layer figures are the difference between a 4-layer and a 2-layer model divided by 2,
so the embedding and head do not enter them. Collectives are counted with a
TorchDispatchMode on torch's functional collectives (what DTensor issues).

    python benchmarks/tp_comm.py [--tp 2] [--batch 4] [--seq 128] [--dim 256]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from _common import write_results  # noqa: E402

from ultrascale.launch import init_gloo, run_ranks  # noqa: E402
from ultrascale.models.llama import Llama, LlamaConfig  # noqa: E402
from ultrascale.models.tp_plans import llama_tp_plan  # noqa: E402
from ultrascale.parallel.dims import ParallelDims, build_mesh  # noqa: E402
from ultrascale.parallel.tensor import apply_tp, maybe_loss_parallel  # noqa: E402

COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


class CountCollectives(TorchDispatchMode):
    """Counts functional collectives and the bytes each rank sends on a ring of size n."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.n = group_size
        self.calls: Counter[str] = Counter()
        self.message_bytes: Counter[str] = Counter()
        self.sent_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = COLLECTIVES.get(func._opname) if func.namespace == "_c10d_functional" else None
        if name is not None:
            local = args[0]
            full = local.numel() * local.element_size() * (self.n if name == "all_gather" else 1)
            self.calls[name] += 1
            self.message_bytes[name] += full
            # Ring algorithm: all-reduce = reduce-scatter + all-gather.
            self.sent_bytes += full * (self.n - 1) / self.n * (2 if name == "all_reduce" else 1)
        return out


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without a real storage (e.g. DTensor wrappers) are never weights
        return -1


def saved_activation_bytes(model: torch.nn.Module, fn) -> int:
    """Bytes of the tensors autograd saves for backward, weights excluded (they are model state)."""
    weights = {_storage(p) for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        if _storage(t) not in weights:
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def measure(rank: int, world_size: int, layers: int, sequence_parallel: bool, args) -> dict:
    import torch.distributed as dist

    if not dist.is_initialized():
        init_gloo(rank, world_size)
    mesh = build_mesh(ParallelDims.resolve(world_size, dp_shard=1, tp=world_size), "cpu")
    config = LlamaConfig(vocab_size=512, dim=args.dim, n_layers=layers, n_heads=8, n_kv_heads=8,
                         ffn_hidden_dim=4 * args.dim, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Llama(config)
    apply_tp(model, mesh["tp"], llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=True))
    tokens = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        with maybe_loss_parallel(True):
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()

    activations = saved_activation_bytes(model, lambda: model(tokens).sum())
    counter = CountCollectives(world_size)
    with counter:
        step()
    return {"calls": dict(counter.calls), "sent": counter.sent_bytes, "activations": activations}


def _all(rank, world_size, args):
    return {
        (layers, sp): measure(rank, world_size, layers, sp, args) for layers in (2, 4) for sp in (False, True)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp_comm.md"))
    args = parser.parse_args()
    result = run_ranks(_all, args.tp, args)[0]
    n, bsh_bytes = args.tp, args.batch * args.seq * args.dim * 4  # fp32
    rows = []
    for sp in (False, True):
        per_layer = {key: (result[(4, sp)][key] - result[(2, sp)][key]) / 2 for key in ("sent", "activations")}
        calls = Counter(result[(4, sp)]["calls"])
        calls.subtract(result[(2, sp)]["calls"])
        calls_text = ", ".join(f"{v // 2} {k}" for k, v in sorted(calls.items()) if v)
        rows.append((sp, per_layer, calls_text))
    theory = 8 * (n - 1) / n * bsh_bytes
    lines = [
        f"Llama block dim {args.dim}, batch {args.batch}, seq {args.seq}, fp32, tp={n} (gloo); per layer, forward + backward, per rank",
        "",
        "| layout | collectives per layer | bytes sent per layer | Playbook 8(N-1)/N·bsh | saved activations per layer | in b·s·h |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for sp, per_layer, calls_text in rows:
        lines.append(
            f"| {'TP+SP' if sp else 'TP'} | {calls_text} | {per_layer['sent'] / 2**20:.2f} MiB | {theory / 2**20:.2f} MiB | "
            f"{per_layer['activations'] / 2**20:.2f} MiB | {per_layer['activations'] / bsh_bytes:.2f} |"
        )
    tp_row, sp_row = rows[0][1], rows[1][1]
    lines += [
        "",
        f"Communication SP / TP: {sp_row['sent'] / tp_row['sent']:.3f} (Playbook: 1.0). "
        f"Saved activations SP / TP: {sp_row['activations'] / tp_row['activations']:.3f}; "
        f"SP saves {(tp_row['activations'] - sp_row['activations']) / bsh_bytes:.2f} b·s·h per layer: "
        f"{(tp_row['activations'] - sp_row['activations']) / bsh_bytes * n / (n - 1):.2f} b·s·h of norm-region "
        f"activations shrink to 1/{n}.",
    ]
    text = "\n".join(lines) + "\n"
    write_results(text, args.out)


if __name__ == "__main__":
    main()
