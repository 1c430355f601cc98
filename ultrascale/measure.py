"""A measured second opinion on a layout's memory per GPU, for models far larger than this machine.

`measure_layout` builds the real model (a built-in Llama preset or a Hugging Face config)
under `FakeTensorMode`, so no weight is allocated, joins a fake process group at the real
world size (every collective returns at once with the right shapes), applies ultrascale's
own parallelisation (`ultrascale.parallel.parallelize`, as the strategy does: the adapter's
TP plan with sequence and loss parallel, activation checkpointing, FSDP with the precision's
mixed-precision policy, or ZeRO-1/2's engine), runs one training step (forward, token-sum cross-entropy, backward,
AdamW) to allocate the optimizer state, and the next forward and backward under torch's
`FSDPMemTracker`. The peak of rank 0, by category, is the measurement; the optimizer step's
own moment (states + foreach temporaries) is not measured (see `_child`). It runs in a child process: the fake process group and fake mode are
process-wide.

    python -m ultrascale.measure '{"model": "llama3_8b", "world": 8, "seq_len": 8192}'

Measured here: ZeRO-3 (FSDP, `FSDPMemTracker`) and ZeRO-1/2 (ultrascale's `ZeroEngine`,
`MemTracker`) with dp_shard, dp_replicate (HSDP), cp (ring attention) and tp; pp and ep raise
NotImplementedError rather than measure something else.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Optional

__all__ = ["measure_layout"]

GIB = 2**30

# FSDPMemTracker's categories -> the planner's.
_CATEGORIES = {
    "SHARDED_PARAM": "params", "SHARDED_GRAD": "grads", "OPT": "optimizer",
    "ACT": "activations", "TEMP": "activations", "INP": "activations",
    "UNSHARDED_PARAM": "buffers", "UNSHARDED_GRAD": "buffers", "ALL_GATHER": "buffers", "REDUCE_SCATTER": "buffers",
    "BUFFER": "buffers", "PARAM": "params", "GRAD": "grads", "OTH": "buffers",  # the last three: MemTracker (ZeRO-1/2)
}


def measure_layout(
    model: str,
    *,
    world: int,
    pp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    cp: int = 1,
    tp: int = 1,
    ep: int = 1,
    zero_stage: int = 3,
    precision: str = "bf16-mixed",
    seq_len: int = 4096,
    micro_batch: int = 1,
    recompute: str = "none",
    pipeline_microbatches: Optional[int] = None,
    timeout_s: float = 900,
) -> dict[str, Any]:
    """Peak memory of rank 0 for this layout, measured on fake tensors in a child process.

    `model`: a built-in Llama preset name or a Hugging Face folder with config.json. Returns
    {"peak_gib", "breakdown_gib": {params, grads, optimizer, activations, buffers}, "tracker",
    "layout", "seconds"}. Raises NotImplementedError for what is not measured (see the module
    docstring) and RuntimeError, with the child's last output, if the child fails."""
    _check_supported(pp=pp, cp=cp, ep=ep, zero_stage=zero_stage, recompute=recompute, precision=precision)
    request = dict(model=model, world=world, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep,
                   zero_stage=zero_stage, precision=precision, seq_len=seq_len, micro_batch=micro_batch,
                   recompute=recompute, pipeline_microbatches=pipeline_microbatches)
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "ultrascale.measure", json.dumps(request)], capture_output=True,
                           text=True, timeout=timeout_s)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        tail = "\n".join((child.stderr or child.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"measure_layout({model!r}, world={world}) failed in its child process:\n{tail}")
    result = json.loads(lines[-1])
    result["seconds"] = time.perf_counter() - started
    return result


def _check_supported(*, pp: int, cp: int, ep: int, zero_stage: int, recompute: str, precision: str) -> None:
    missing = [name for name, on in (("pipeline parallel", pp > 1), ("expert parallel", ep > 1)) if on]
    if missing:
        raise NotImplementedError(
            f"measure_layout: {', '.join(missing)} is not measured yet (measured: ZeRO-1/2/3 with dp_shard, "
            "dp_replicate, cp and tp); use the planner's formulas for this layout"
        )
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"measure_layout: recompute={recompute!r}; choose none, selective or full")
    if precision not in ("bf16-mixed", "32-true", "bf16-true"):
        raise ValueError(f"measure_layout: precision={precision!r}; choose bf16-mixed, 32-true or bf16-true")


def _build(model: str, seq_len: int) -> Any:
    from ultrascale.models.llama import LLAMA_PRESETS, Llama, LlamaConfig

    if model in LLAMA_PRESETS:
        config = LlamaConfig.from_preset(model)
        if seq_len > config.max_seq_len:
            config = LlamaConfig.from_preset(model, max_seq_len=seq_len)
        return Llama(config), config.vocab_size
    import transformers

    config = transformers.AutoConfig.from_pretrained(model, local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return hf, config.vocab_size


def _child(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultrascale.models.adapters import get_adapter
    from ultrascale.parallel.context import ContextParallel
    from ultrascale.parallel.dims import ParallelDims, build_mesh
    from ultrascale.parallel.init import materialize_meta_module
    from ultrascale.parallel.parallelize import parallelize
    from ultrascale.parallel.tensor import maybe_loss_parallel
    from ultrascale.parallel.zero import ZeroEngine

    r = request
    _check_supported(pp=r["pp"], cp=r["cp"], ep=r["ep"], zero_stage=r["zero_stage"], recompute=r["recompute"],
                     precision=r["precision"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=r["world"])
    dims = ParallelDims.resolve(r["world"], dp_replicate=r["dp_replicate"], dp_shard=r["dp_shard"], cp=r["cp"], tp=r["tp"],
                                pp=r["pp"], ep=r["ep"])
    mesh = build_mesh(dims, "cpu")  # outside fake mode: building the mesh reads real rank tensors
    transforms = []
    if r["recompute"] != "none":
        from ultrascale.callbacks import ActivationCheckpointing

        transforms.append(ActivationCheckpointing(mode=r["recompute"]))
    policy = {
        "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "32-true": MixedPrecisionPolicy(),
        "bf16-true": MixedPrecisionPolicy(),
    }[r["precision"]]
    # Built and parallelised on the meta device (FSDP reads the real mesh there), then allocated
    # as fake tensors: shapes, dtypes and placements are the real run's, the bytes never exist.
    with torch.device("meta"):
        module, vocab = _build(r["model"], r["seq_len"])
    if r["precision"] == "bf16-true":
        module.to(torch.bfloat16)
    adapter = get_adapter(module)
    tp_plan, loss_parallel = None, False
    if dims.tp_enabled:
        adapter.check_tensor_parallel(dims.tp, sequence_parallel=adapter.supports_sequence_parallel)
        loss_parallel = True
        tp_plan = adapter.tp_plan(sequence_parallel=adapter.supports_sequence_parallel, loss_parallel=True)
    context_parallel = None
    if dims.cp_enabled:
        adapter.check_context_parallel(dims.cp)
        context_parallel = ContextParallel(mesh["cp"], "ring", load_balance=True)
        # The layout of this rank's tokens, set as the strategy sets it for every batch. Positions
        # only steer RoPE, not memory: the fake step runs the local tokens at positions 0..s/cp.
        context_parallel.shard_batch({"input_ids": torch.zeros((r["micro_batch"], r["seq_len"]), dtype=torch.long)})
    fsdp = r["zero_stage"] == 3
    parallelize(module, mesh, blocks=adapter.blocks, tp_plan=tp_plan, transforms=transforms, mp_policy=policy,
                context_parallel=context_parallel, enable_context_parallel=adapter.enable_context_parallel,
                shard_parameters=fsdp)
    with FakeTensorMode(allow_non_fake_inputs=True):  # the DeviceMesh holds a real rank tensor
        materialize_meta_module(module, torch.device("cpu"))
        # foreach=False: under fake tensors the tracker keeps foreach Adam's temporaries alive (it
        # reported 101 GiB of optimizer memory for the 8B preset at world 8). The optimizer step's
        # own peak (states + one shard-sized temporary of foreach Adam) is left to the formulas.
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=False, foreach=False)
        masters: list[Any] = []
        if not fsdp:  # ZeRO-1/2: bf16 weights for compute, fp32 master slices in the optimizer (as the strategy)
            engine = ZeroEngine(module, optimizer, stage=r["zero_stage"], dp_mesh=mesh.fsdp, bucket_bytes=100 * 2**20,
                       compute_dtype=torch.bfloat16 if r["precision"] == "bf16-mixed" else None)
            masters = [bucket.master for bucket in engine.buckets]
        tokens = torch.randint(0, vocab, (r["micro_batch"], r["seq_len"] // dims.cp))

        def forward_backward() -> None:
            output = module(tokens)
            logits = output.logits if hasattr(output, "logits") else output
            with maybe_loss_parallel(loss_parallel):
                F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="sum").backward()

        forward_backward()  # a first step allocates the optimizer state, as every later step finds it
        optimizer.step()
        optimizer.zero_grad()
        if fsdp:
            tracker = FSDPMemTracker(module, optimizer)
            tracker.track_inputs((tokens,))
        else:
            tracker = MemTracker()
            tracker.track_external(module, optimizer, *masters)  # the masters count as "other" (OTH)
        with tracker:
            forward_backward()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    breakdown = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "buffers": 0.0}
    categories = _CATEGORIES if fsdp else {**_CATEGORIES, "OTH": "optimizer"}  # ZeRO-1/2's fp32 master slices
    for kind, value in peak.items():
        name = str(kind).split(".")[-1]
        if name in categories:
            breakdown[categories[name]] += value / GIB
    return {
        "peak_gib": peak["Total"] / GIB,
        "breakdown_gib": breakdown,
        "tracker": "FSDPMemTracker" if fsdp else "MemTracker",
        "rank": 0,
        "layout": dims.describe(),
    }


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
