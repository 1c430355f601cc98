"""A measured second opinion on a layout's memory per GPU, for models far larger than this machine.

`measure_layout` runs one training step of the real model on fake tensors at the real world size
and reports the peak memory of rank 0, by category, from torch's memory trackers
(`torch.distributed._tools`). Nothing of the model's size is allocated: Llama-3 8B at world 8 takes
about 20 s and under 0.5 GiB of host memory, 70B at world 64 about a minute.

The child process (a fork of the caller; the fake process group and the fake mode are process-wide) does what
`UltraScaleStrategy._parallelize` and a training step do, without Lightning:

1. joins a *fake* process group (`FakeStore` + backend "fake") as rank 0 of `world` ranks: every
   collective returns at once, with the right shapes, and builds the mesh (`build_mesh`);
2. builds the model (a built-in Llama preset, or a Hugging Face folder's config.json) on the meta
   device (fake tensors if it ties its embedding and head) in the precision's parameter dtype;
3. checks and applies `ultrascale.parallel.parallelize` with the model's adapter: the pipeline split
   (1F1B, rank 0 holds stage 0), the adapter's TP plan (sequence parallel where the adapter supports
   it, loss parallel without PP), context parallel (ring attention, load-balanced layout),
   activation checkpointing of every block (`ultrascale.callbacks.activation_checkpointing.apply_ac`),
   FSDP with the precision's `MixedPrecisionPolicy` (ZeRO-3) or replicated parameters and
   `ultrascale.parallel.zero.ZeroEngine` (ZeRO-1/2, 100 MiB buckets as on GPUs);
4. materialises the weights as fake tensors (`to_empty`; values do not change memory);
5. runs one untracked step (forward on random token ids (micro_batch, seq_len / cp), token-sum
   cross-entropy (`cross_entropy_sum`), backward, AdamW as `adamw_warmup_cosine` builds it:
   `estimate.ADAMW_KERNEL`), so that the optimizer state exists as in every later step;
6. runs the next step under `FSDPMemTracker` (ZeRO-3) or `MemTracker` (ZeRO-1/2) and reports its peak:
   the larger of the forward/backward peak and the optimizer step's own peak (both are returned).
   With `grad_accumulation` > 1 a step is that many micro-batches, as the strategy's
   `block_backward_sync` runs them: ZeRO-1/2 reduce after the last; FSDP reduce-scatters every
   micro-batch unless `accumulate_unsharded_grads` (then it holds whole fp32 gradients until the last).

Under pipeline parallel torch's `Schedule1F1B` cannot run on fake tensors (its P2P warm-up reads a
received value), so its order on the first stage is replayed: min(pp, micro-batches) forwards in
flight before the first backward, FSDP's gradient reduction once after the last (`_first_stage_1f1b`).

What is measured is what the trackers see: every tensor of the step at its exact size, without
the CUDA caching allocator's rounding and fragmentation, CUDA/NCCL workspaces or the CUDA context
(about 1-3 GiB on a real GPU). Not measured (NotImplementedError): expert parallel (ep > 1: its
all-to-all sizes come from the routing, i.e. from values), and anything else whose shapes depend on
tensor values (an MoE with a capacity factor).

    python -m ultrascale.measure '{"model": "llama3_8b", "world": 8, "seq_len": 8192, "recompute": "full"}'
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from ultrascale.parallel.rules import (  # the first two re-exported (`__all__`)
    PRECISIONS,
    RECOMPUTE_MODES,
    choice_problems,
    not_built,
    positive_int_problems,
    raise_first,
)

__all__ = ["CATEGORIES", "PRECISIONS", "RECOMPUTE_MODES", "measure_layout"]

GIB = 2**30

CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "other")
"""Keys of the returned `breakdown_gib` (the trackers' own categories are in `tracker_gib`)."""

_RESULT_PREFIX = "ULTRASCALE_MEASURE_RESULT "
_ERROR_PREFIX = "ULTRASCALE_MEASURE_ERROR "

# The trackers' categories (the `.value` of `_FSDPRefType` / `_MemRefType`) -> ours.
_CATEGORY_OF = {
    # FSDPMemTracker
    "Sharded Param": "params",
    "Sharded Grad": "grads",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "other",  # created during backward: activation gradients, the loss's softmax gradient
    "Unsharded Param": "other",  # FSDP's gathered (compute-dtype) copies
    "Unsharded Grad": "other",
    "All Gather": "other",
    "Reduce Scatter": "other",
    "Buffer": "other",
    # MemTracker
    "Parameter": "params",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Other": "optimizer",  # only what `track_external` registers: ZeRO-1/2's fp32 master slices
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
    pipeline_microbatches: int | None = None,
    timeout_s: float = 900,
    grad_accumulation: int = 1,
    accumulate_unsharded_grads: bool = False,
    accumulate_grads_in_fp32: bool | None = None,
    loss_chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """Peak memory of rank 0 for one training step of this layout, measured on fake tensors.

    Args:
        model: a built-in Llama preset (`ultrascale.models.llama.LLAMA_PRESETS`, e.g. "llama3_8b")
            or a Hugging Face folder with a config.json (no weights are read).
        world: number of ranks (GPUs); the degrees below are resolved against it (`ParallelDims.resolve`,
            one of pp/dp_replicate/dp_shard/cp/tp may be -1).
        zero_stage: 3 = FSDP (parameters, gradients and optimizer state sharded over dp_shard x cp);
            1/2 = replicated parameters with `ZeroEngine` (optimizer state, ZeRO-2 also gradients, sharded).
        precision: "bf16-mixed" (fp32 master weights, bf16 compute), "32-true" or "bf16-true".
        seq_len: tokens per sequence (the whole sequence; context parallel gives each rank seq_len / cp).
        micro_batch: sequences per forward (per pipeline micro-batch under PP).
        recompute: activation checkpointing of every block: "none", "selective" or "full".
        pipeline_microbatches: micro-batches per step under PP (default: pp); the 1F1B schedule's first
            stage holds min(pp, this) of them at its peak.
        timeout_s: the child process is killed after this many seconds (RuntimeError).
        grad_accumulation: micro-batches per optimizer step without PP, as the strategy runs them
            (`block_backward_sync`): ZeRO-1/2 accumulate in their buckets and reduce after the last; FSDP
            reduce-scatters every micro-batch into its shards. Under PP use `pipeline_microbatches`.
        accumulate_unsharded_grads: the strategy's knob of that name: FSDP skips the reduce-scatter on all
            but the last micro-batch and so accumulates whole gradients in its reduce dtype.
        accumulate_grads_in_fp32: ZeRO-1/2's knob of that name (None: fp32 gradients under bf16-mixed).
        loss_chunk_tokens: the models' knob of that name: the head and the loss fused in chunks as `LlamaLM` and
            `HFCausalLM` run them (None: their default, `parallel.loss.loss_chunk_tokens_of`; 0: the whole logits).

    Returns:
        ``{"peak_gib": the peak of the step, "breakdown_gib": {"params", "grads", "optimizer", "activations",
        "other"} at that peak (they sum to peak_gib), "tracker_gib": the tracker's own categories there,
        "peak_phase": "forward/backward" or "optimizer step", "phases": {phase: {"peak_gib", "breakdown_gib",
        "tracker_gib"}} for both, "rank": 0, "layout": the resolved degrees and settings (under PP also the
        pipeline layout), "describe": the mesh in words, "tracker": "FSDPMemTracker" (ZeRO-3) or
        "MemTracker" (ZeRO-1/2), "params_per_rank": parameter elements rank 0 holds, "seconds": wall time}``.

        Categories: params = the parameters rank 0 keeps (FSDP's sharded fp32 masters; ZeRO-1/2's
        replicated compute-dtype weights); grads = their gradients (FSDP's sharded ones; ZeRO-1/2's
        bucket gradients); optimizer = AdamW's moments and the step's temporaries (plus ZeRO-1/2's fp32
        master slices under bf16-mixed, the Playbook's 12 bytes); activations = what the forward
        allocated and still holds (saved tensors, logits, inputs); other = the rest: temporaries of the
        backward (activation gradients, the loss's logit gradients) and FSDP's gathered compute-dtype
        parameters, unsharded gradients and collective buffers.

    Raises:
        ValueError: invalid degrees, precision, recompute mode, or a sequence length the layout cannot split.
        NotImplementedError: a combination this measurement does not run (never a silent substitute).
        RuntimeError: the child process failed or timed out (with the end of its output).
    """
    request = {
        "model": str(model), "world": world, "pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp,
        "tp": tp, "ep": ep, "zero_stage": zero_stage, "precision": precision, "seq_len": seq_len,
        "micro_batch": micro_batch, "recompute": recompute, "pipeline_microbatches": pipeline_microbatches,
        "grad_accumulation": grad_accumulation, "accumulate_unsharded_grads": accumulate_unsharded_grads,
        "accumulate_grads_in_fp32": accumulate_grads_in_fp32, "loss_chunk_tokens": loss_chunk_tokens,
    }
    _check_request(request)
    started = time.perf_counter()
    returncode, output = _run_child(request, timeout_s)
    if returncode is None:
        raise RuntimeError(
            f"measure_layout({model!r}, world={world}): the measurement did not finish within timeout_s={timeout_s} s; "
            f"its last output:\n{_tail(output)}"
        )
    for line in reversed(output.splitlines()):
        if line.startswith(_ERROR_PREFIX):
            error = json.loads(line[len(_ERROR_PREFIX):])
            kind = {"NotImplementedError": NotImplementedError, "ValueError": ValueError}.get(error["type"], RuntimeError)
            message = error["message"]
            raise kind(message if message.startswith("measure_layout") else f"measure_layout: {message}")
        if line.startswith(_RESULT_PREFIX) and returncode == 0:
            result = json.loads(line[len(_RESULT_PREFIX):])
            result["seconds"] = time.perf_counter() - started
            return result
    raise RuntimeError(
        f"measure_layout({model!r}, world={world}) failed in its child process (exit code {returncode}):\n{_tail(output)}"
    )


def _run_child(request: dict[str, Any], timeout_s: float) -> tuple[int | None, str]:
    """`_main` on `request` in a child process: (its exit code, None past `timeout_s`; its output).

    A fork of this process where it has no process group (it has imported all the child needs: a fresh
    interpreter spends about 7 s of CPU importing Lightning, whose torchmetrics imports scipy and transformers);
    otherwise a fresh interpreter, since a forked child would inherit the caller's process group."""
    import tempfile

    import torch.distributed as dist

    from ultrascale.launch import die_with_parent, one_thread_after_fork

    with tempfile.TemporaryFile("w+") as log:
        if dist.is_available() and dist.is_initialized():
            package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)  # this ultrascale
            env.setdefault("OMP_NUM_THREADS", "1")
            command = [sys.executable, "-m", "ultrascale.measure", json.dumps(request)]
            try:
                returncode: int | None = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                                        env=env, check=False).returncode
            except subprocess.TimeoutExpired:
                returncode = None
        else:
            parent = os.getpid()

            def child() -> None:
                die_with_parent(parent)
                one_thread_after_fork()
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # not a capture the caller installed
                code = 1
                try:
                    code = _main([json.dumps(request)])
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)  # no atexit handlers, no pytest teardown of the parent's copy

            # os.fork, not multiprocessing: a daemonic caller (a multiprocessing.Pool worker) may not have children there.
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    child()
                finally:
                    os._exit(1)
            returncode = None
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    returncode = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        log.seek(0)
        return returncode, log.read()


def _tail(text: Any, lines: int = 25) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").strip().splitlines()[-lines:])


def _check_request(r: dict[str, Any]) -> None:
    """ValueError / NotImplementedError for what can be refused without building anything."""
    raise_first(choice_problems("precision", r["precision"], PRECISIONS)
                + choice_problems("recompute", r["recompute"], RECOMPUTE_MODES), "measure_layout")
    raise_first(positive_int_problems(**{name: r[name] for name in ("seq_len", "micro_batch", "grad_accumulation")}),
                "measure_layout")
    from ultrascale.models.llama import LLAMA_PRESETS

    if r["model"] not in LLAMA_PRESETS and not os.path.isfile(os.path.join(r["model"], "config.json")):
        raise ValueError(f"measure_layout: model={r['model']!r} is neither a built-in Llama preset "
                         f"({', '.join(LLAMA_PRESETS)}) nor a folder with a Hugging Face config.json")
    dims = _resolve(r)
    if dims.ep_enabled:
        raise not_built(
            "measure_expert_parallel",
            f"measure_layout: expert parallel (ep={dims.ep}) is not measured: the all-to-all sizes of its token dispatch "
            "come from the routing decisions (token counts per expert read on the host), and fake tensors have no values; "
            "MoE models are measured with ep=1"
        )
    if dims.pp_enabled and r["grad_accumulation"] != 1:
        raise not_built(
            "measure_pipeline_accumulation",
            f"measure_layout: grad_accumulation={r['grad_accumulation']} with pipeline parallel (pp={dims.pp}) is not "
            "measured; give the pipeline's micro-batches as `pipeline_microbatches`"
        )


def _knobs(r: dict[str, Any]) -> Any:
    from ultrascale.parallel.rules import LayoutKnobs

    return LayoutKnobs(dp_replicate=r["dp_replicate"], dp_shard=r["dp_shard"], cp=r["cp"], tp=r["tp"], pp=r["pp"],
                       ep=r["ep"], zero_stage=r["zero_stage"], pipeline_schedule="1F1B",
                       pipeline_microbatches=r["pipeline_microbatches"],
                       accumulate_unsharded_grads=r["accumulate_unsharded_grads"])


def _resolve(r: dict[str, Any]) -> Any:
    """The request's degrees, checked by the rulebook as the strategy checks its knobs (`ParallelDims`)."""
    from ultrascale.parallel.rules import knob_problems, resolve

    knobs = _knobs(r)
    raise_first(knob_problems(knobs), "measure_layout")
    dims, problems = resolve(knobs, r["world"])
    raise_first(problems, "measure_layout")
    return dims


# --------------------------------------------------------------------------- child process


def _build(model: str, seq_len: int, fake_mode: Any) -> tuple[Any, int, bool]:
    """(the model, its vocabulary size, whether it is on the meta device).

    On the meta device, as the strategy builds models whose weights are loaded after sharding;
    a model that ties its input embedding to its head is built on fake tensors instead: `to_empty`
    would untie meta weights (the strategy re-ties them in `materialize_meta_module`), and the
    training step's memory is that of one shared weight either way."""
    import torch

    from ultrascale.models.llama import LLAMA_PRESETS, Llama, LlamaConfig

    if model in LLAMA_PRESETS:
        config = LlamaConfig.from_preset(model)
        if seq_len > config.max_seq_len:  # RoPE tables only: no parameter depends on it
            config = LlamaConfig.from_preset(model, max_seq_len=seq_len)
        meta = not config.tie_embeddings
        with torch.device("meta") if meta else fake_mode:
            return Llama(config), config.vocab_size, meta
    import transformers

    from ultrascale.models.adapters import hf_num_experts

    config = transformers.AutoConfig.from_pretrained(model, local_files_only=True)
    meta = not bool(getattr(config, "tie_word_embeddings", False))
    with torch.device("meta") if meta else fake_mode:
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if hf_num_experts(config):  # as HFCausalLM.configure_model: ultrascale's routing (and its balance loss)
        from ultrascale.models.moe import attach_hf_routing

        attach_hf_routing(hf, aux_loss_coef=0.0, z_loss_coef=0.0)
    return hf, config.vocab_size, meta


def _convert(module: Any, dtype: Any) -> None:
    """`UltraScalePrecision.convert_module` (`module.to(dtype)`) in place, which keeps tied weights tied."""
    import torch

    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen and tensor.is_floating_point() and tensor.dtype != dtype:
            with torch.no_grad():
                tensor.data = tensor.data.to(dtype)
        seen.add(id(tensor))


def _logits(module: Any, input_ids: Any, position_ids: Any) -> Any:
    from ultrascale.models.llama import Llama

    if isinstance(module, Llama):
        return module(input_ids, position_ids)
    return module(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits  # as HFCausalLM.forward


def _child(r: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=r["world"])
    try:
        return _measure(r)
    finally:
        dist.destroy_process_group()


def _measure(r: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ultrascale.estimate import ADAMW_KERNEL
    from ultrascale.models.adapters import plan_model
    from ultrascale.models.head_loss import fused_head_loss_sum, fuses_head_and_loss
    from ultrascale.parallel.context import ContextParallel
    from ultrascale.parallel.dims import build_mesh
    from ultrascale.parallel.fsdp import set_gradient_sync
    from ultrascale.parallel.loss import cross_entropy_sum, loss_chunk_tokens_of
    from ultrascale.parallel.parallelize import parallelize
    from ultrascale.parallel.rules import batch_problems, raise_first
    from ultrascale.parallel.tensor import maybe_loss_parallel
    from ultrascale.parallel.zero import ZeroEngine, zero12_dtypes

    _check_request(r)
    dims = _resolve(r)
    mesh = build_mesh(dims, "cpu")  # outside fake mode: the mesh holds real rank tensors
    precision, zero_stage, fsdp = r["precision"], r["zero_stage"], r["zero_stage"] == 3
    state_mesh = mesh.zero_state_mesh if dims.tp_enabled and not fsdp else None  # a mesh too, built outside fake mode
    batch, seq_len = r["micro_batch"], r["seq_len"]

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # the DeviceMesh keeps real rank tensors
    module, vocab, meta = _build(r["model"], seq_len, fake_mode)
    with contextlib.nullcontext() if meta else fake_mode:
        _convert(module, torch.bfloat16 if precision == "bf16-true" else torch.float32)
    # What the strategy's `check_model` runs: the rulebook's checks, then the pipeline split (1F1B, rank 0 holds
    # stage 0), the adapter's TP plan (sequence parallel where it supports it, loss parallel without PP).
    checked = plan_model(module, dims, _knobs(r), loss_parallel_default=True, owner="measure_layout")
    adapter, pipeline, tp_plan = checked.adapter, checked.pipeline, checked.tp_plan
    sequence_parallel, loss_parallel = checked.sequence_parallel, checked.loss_parallel
    raise_first(batch_problems(dims, seq_len=seq_len, sequence_parallel=sequence_parallel), "measure_layout")
    context_parallel = ContextParallel(mesh["cp"], "ring", load_balance=True) if dims.cp_enabled else None
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16-mixed"
              else MixedPrecisionPolicy())  # UltraScalePrecision.mixed_precision_policy
    from ultrascale.callbacks.activation_checkpointing import ActivationCheckpointing

    transforms = [ActivationCheckpointing(mode=r["recompute"])] if r["recompute"] != "none" else []
    # Outside the fake mode (fake weights still compute as fake tensors): FSDP x TP builds a new
    # DeviceMesh, which reads its rank's coordinates from a real tensor.
    stages = parallelize(
        module, mesh, blocks=adapter.blocks, tp_plan=tp_plan, transforms=transforms, mp_policy=policy,
        reshard_after_forward=True, shard_parameters=fsdp, context_parallel=context_parallel,
        enable_context_parallel=adapter.enable_context_parallel, pipeline=pipeline,
        enable_expert_parallel=adapter.enable_expert_parallel, experts=adapter.experts,
    )

    with fake_mode:
        if meta:
            # `materialize_meta_module` without its initialisation: values do not change memory, and
            # `Llama.init_weights` cannot run on a pipeline-split model (its gaps have no weights).
            module.to_empty(device=torch.device("cpu"))
        params = [p for p in module.parameters() if p.requires_grad]
        params_per_rank = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        # As `ultrascale.models.lm.adamw_warmup_cosine` builds it (the request key "adamw_kernel", a `torch.optim.AdamW`
        # keyword dict, is for measuring another: `benchmarks/` and the cost model's step-temporary figure).
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **r.get("adamw_kernel", ADAMW_KERNEL))
        engine = None
        if not fsdp:
            compute_dtype, accumulate_dtype = zero12_dtypes(precision, r.get("accumulate_grads_in_fp32"))
            engine = ZeroEngine(module, optimizer, stage=zero_stage, dp_mesh=mesh.fsdp, bucket_bytes=100 * 2**20,
                                compute_dtype=compute_dtype, accumulate_dtype=accumulate_dtype, state_mesh=state_mesh)
        microbatches = pipeline[1].microbatches if pipeline is not None else 1
        loss_chunk = loss_chunk_tokens_of(r.get("loss_chunk_tokens"), vocab,
                                          built=pipeline is None and fuses_head_and_loss(module))
        sequence_mesh = mesh["tp"] if sequence_parallel and dims.tp_enabled else None
        accumulation = r["grad_accumulation"]
        input_ids = torch.randint(0, vocab, (batch * microbatches, seq_len))
        labels = torch.randint(0, vocab, (batch * microbatches, seq_len))

        def forward_backward(tracker: Any = None) -> None:
            step_batch = {"input_ids": input_ids, "labels": labels}
            if context_parallel is not None:
                step_batch = context_parallel.shard_batch(step_batch)  # (B, T / cp) tokens and their positions
            if stages:
                _first_stage_1f1b(stages, pipeline[1], step_batch, engine, tracker)
                return
            for i in range(accumulation):  # the strategy's `block_backward_sync` on all but the last
                sync = i == accumulation - 1
                if fsdp:
                    set_gradient_sync(module, sync or not r["accumulate_unsharded_grads"])
                deferred = engine.no_sync() if engine is not None and not sync else contextlib.nullcontext()
                if tracker is not None and i > 0:  # the trackers refuse a second root forward otherwise
                    tracker.reset_mod_stats()
                with deferred, maybe_loss_parallel(loss_parallel):
                    if loss_chunk:  # as LlamaLM / HFCausalLM run it
                        loss_sum, _ = fused_head_loss_sum(module, step_batch["input_ids"], step_batch.get("position_ids"),
                                                          step_batch["labels"], loss_chunk, sequence_mesh)
                    else:
                        logits = _logits(module, step_batch["input_ids"], step_batch.get("position_ids"))
                        loss_sum, _ = cross_entropy_sum(logits, step_batch["labels"])
                        del logits
                    loss_sum.backward()
                    del loss_sum

        def optimizer_step() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        forward_backward()  # the first step creates the optimizer state that every later step finds
        optimizer_step()

        use_fsdp_tracker = fsdp
        if use_fsdp_tracker:
            tracker: Any = FSDPMemTracker(stages[0] if stages else module, optimizer)
            tracker.track_inputs((input_ids, labels))
        else:
            tracker = MemTracker()
            external: list[Any] = [module, optimizer]
            if engine is not None:  # the fp32 master slices under bf16-mixed (the tracker's "Other")
                external += [b.master for b in engine.buckets if not b.master_is_view]
            tracker.track_external(*external)
            if engine is not None:  # ZeRO-1's bucket gradients, kept (zeroed) between steps
                for bucket in engine.buckets:
                    if bucket.grad_buffer is not None:
                        tracker._update_and_maybe_create_winfos(bucket.grad_buffer, _mem_ref_type("GRAD"))
            tracker._update_and_maybe_create_winfos(input_ids, _mem_ref_type("ACT"))
            tracker._update_and_maybe_create_winfos(labels, _mem_ref_type("ACT"))
        with tracker:
            forward_backward(tracker)
            peaks = {"forward/backward": tracker.get_tracker_snapshot("peak")}
            _restart_peak(tracker)  # the step's own peak, from what the backward left
            optimizer_step()
            peaks["optimizer step"] = tracker.get_tracker_snapshot("peak")
    phases = {phase: _summarise(snapshot) for phase, snapshot in peaks.items()}
    phase = max(phases, key=lambda name: phases[name]["peak_gib"])
    layout: dict[str, Any] = {axis: getattr(dims, axis) for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
    layout.update(world=dims.world_size, zero_stage=zero_stage, precision=precision, seq_len=seq_len, micro_batch=batch,
                  grad_accumulation=accumulation, recompute=r["recompute"], sequence_parallel=sequence_parallel,
                  loss_parallel=loss_parallel)
    if pipeline is not None:
        layout.update(pipeline=pipeline[1].describe(), pipeline_microbatches=pipeline[1].microbatches,
                      stage_layers=list(pipeline[1].layers_of(0)))
    return {
        **phases[phase],
        "peak_phase": phase,
        "phases": phases,
        "rank": 0,
        "layout": layout,
        "describe": dims.describe(),
        "tracker": "FSDPMemTracker" if use_fsdp_tracker else "MemTracker",
        "params_per_rank": params_per_rank,
    }


def _first_stage_1f1b(stages: Any, layout: Any, batch: dict[str, Any], engine: Any, tracker: Any = None) -> None:
    """Rank 0's part of one 1F1B step: stage 0 of `layout` over `layout.microbatches` micro-batches.

    torch's `Schedule1F1B` cannot run on fake tensors (its P2P warm-up reads a received value), so its
    order on the first stage is replayed here: min(m, pp) forwards before the first backward, then one
    backward and one forward at a time; each backward receives a gradient shaped like the stage's
    output (the next stage's, which the fake group never sends). FSDP is handled as the schedule
    handles it: no reduction nor resharding until all micro-batches ran, then every unit's
    post-backward (`_PipelineStageBase.perform_reduce_grad`); ZeRO-1/2 reduce at the step. `tracker`'s
    per-module statistics are reset before each micro-batch's forward (its peak is kept).
    """
    import torch
    from torch.distributed.fsdp import FSDPModule, fully_shard

    (stage,) = stages  # 1F1B: one stage per rank
    if stage.stage != 0 or stage.stage == layout.num_stages - 1:
        raise RuntimeError("measure_layout measures the first pipeline stage only (rank 0)")
    m = layout.microbatches
    ids = batch["input_ids"].chunk(m)
    positions = batch.get("position_ids")
    if positions is not None:  # context parallel: this rank's tokens' positions
        positions = positions.chunk(m)
    else:
        # The Llama's (T,) form: a (B, T) one makes it look for packed documents in the values (data-dependent).
        from ultrascale.models.llama import Llama

        whole = torch.arange(ids[0].shape[1])
        llama = isinstance(stage._parts.root, Llama)
        positions = [whole if llama else whole.expand(chunk.shape) for chunk in ids]
    fsdp = isinstance(stage, FSDPModule)
    if fsdp:
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)
    in_flight: list[Any] = []

    def forward(i: int) -> None:
        if tracker is not None:  # the trackers refuse a second forward of their root otherwise; the peak stays
            tracker.reset_mod_stats()
        in_flight.append(stage(ids[i], positions[i]))

    def backward() -> None:
        output = in_flight.pop(0)
        output.backward(torch.empty_like(output))
        del output

    warmup = min(m, layout.num_stages)
    with engine.no_sync() if engine is not None else contextlib.nullcontext():  # one reduction per step
        for i in range(warmup):
            forward(i)
        for i in range(warmup, m):
            backward()
            forward(i)
        while in_flight:
            backward()
    if fsdp:  # the schedule's REDUCE_GRAD action
        stage.set_is_last_backward(True)
        stage.set_reshard_after_backward(True)
        stage.set_requires_gradient_sync(True)
        state = fully_shard.state(stage)
        for unit in state._state_ctx.all_states:
            for group in unit._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
    if engine is not None:
        engine.absorb_assigned_grads()


def _restart_peak(tracker: Any) -> None:
    """Make the tracker's peak the current memory (MemTracker keeps it in these two fields in torch 2.13)."""
    current = tracker.get_tracker_snapshot("current")
    tracker._peak_mem_snap = current
    tracker._peak_mem = {device: snapshot.get("Total", 0) for device, snapshot in current.items()}


def _summarise(snapshot: dict[Any, dict[Any, int]]) -> dict[str, Any]:
    """{"peak_gib", "breakdown_gib" (our categories), "tracker_gib" (the tracker's)} of a peak snapshot."""
    tracker_bytes: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for kind, value in device_snapshot.items():
            name = getattr(kind, "value", kind)
            tracker_bytes[name] = tracker_bytes.get(name, 0) + int(value)
    total = tracker_bytes.pop("Total", 0)
    breakdown = dict.fromkeys(CATEGORIES, 0.0)
    for name, value in tracker_bytes.items():
        breakdown[_CATEGORY_OF.get(name, "other")] += value / GIB
    return {"peak_gib": total / GIB, "breakdown_gib": breakdown,
            "tracker_gib": {name: value / GIB for name, value in tracker_bytes.items() if value}}


def _mem_ref_type(name: str) -> Any:
    from torch.distributed._tools.mem_tracker import _MemRefType

    return getattr(_MemRefType, name)


def _last_project_frame(tb: Any) -> str:
    """'file:line (function)' of the innermost traceback frame inside ultrascale."""
    import traceback

    frames = [f for f in traceback.extract_tb(tb) if os.sep + "ultrascale" + os.sep in f.filename]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def _describe_request(r: dict[str, Any]) -> str:
    keys = ("world", "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "zero_stage")
    return f"{r['model']}, " + ", ".join(f"{key}={r[key]}" for key in keys)


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ultrascale.measure '<json request>'  (the keyword arguments of measure_layout)",
              file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore")  # DTensor random ops on a CPU mesh, deprecations: noise on the parent's stderr
    request = json.loads(argv[0])
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    defaults = {"pp": 1, "dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "ep": 1, "zero_stage": 3,
                "precision": "bf16-mixed", "seq_len": 4096, "micro_batch": 1, "recompute": "none",
                "pipeline_microbatches": None, "grad_accumulation": 1, "accumulate_unsharded_grads": False}
    request = {**defaults, **request}

    try:
        result = _child(request)
    except (NotImplementedError, ValueError) as error:
        import traceback

        traceback.print_exc()  # on stderr, for whoever reads it; the parent raises the message
        print(_ERROR_PREFIX + json.dumps({"type": type(error).__name__, "message": str(error)}), flush=True)
        return 3
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        # Fake tensors have shapes but no values: a step whose shapes depend on values (expert token
        # counts, dropped tokens, packed-document masks) cannot run on them.
        where = _last_project_frame(error.__traceback__)
        message = (f"this layout ({_describe_request(request)}) is not measured: its step reads tensor values to decide a "
                   f"shape ({type(error).__name__}: {error}{', at ' + where if where else ''}), and fake tensors have none")
        print(_ERROR_PREFIX + json.dumps({"type": "NotImplementedError", "message": message}), flush=True)
        return 3
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
