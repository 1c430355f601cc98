"""Tensor-parallel plans: model knowledge, kept with the models.

A plan is a literal dict `{module path (fnmatch wildcards allowed): ParallelStyle}`, applied
by `ultrascale.parallel.tensor.apply_tp`. See that module for the per-block picture and for
the style names (`STYLE_NAMES`) that user and Hugging Face plans use.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ultrascale.parallel.tensor_styles import ExpertTensorParallel


def llama_tp_plan(
    *, sequence_parallel: bool, loss_parallel: bool, prefix: str = "", experts: bool = False, shared_experts: bool = False
) -> dict[str, ParallelStyle]:
    """The built-in Llama's plan, one block's layout readable in one place.

    `prefix` is the Llama module's path inside the module being parallelised (e.g. "model.").
    `experts`: the blocks' feed-forward is the Mixture-of-Experts `MoE` (router replicated, every
    expert split on its intermediate width: `ExpertTensorParallel`), with `shared_experts` beside it.
    """
    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        # Vocab-parallel embedding: each rank owns vocab/tp rows; partial lookups are summed
        # (all-reduce) or, with SP, summed and split along T in one reduce-scatter.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Column-parallel head: logits (B, T, V/tp). With loss parallel they stay sharded
        # (DTensor Shard(-1)) into the cross-entropy; otherwise they are all-gathered.
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        # cos/sin (the 2nd and 3rd inputs) are full-length plain tensors on every rank.
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if experts:
        # The router runs whole on every tp rank (same tokens, same weights): plain local tensors in and
        # out of the MoE block; its output is replicated (each expert part all-reduced) and, under SP,
        # each rank keeps its slice of the sequence (no communication; all-gathered in backward).
        for path in ("layers.*.feed_forward.w1", "layers.*.feed_forward.w3", "layers.*.feed_forward.w2"):
            del plan[path]
        plan["layers.*.feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True,
        )
        plan["layers.*.feed_forward.experts"] = ExpertTensorParallel()
        if shared_experts:
            plan["layers.*.feed_forward.shared_experts.w1"] = ColwiseParallel()
            plan["layers.*.feed_forward.shared_experts.w3"] = ColwiseParallel()
            plan["layers.*.feed_forward.shared_experts.w2"] = RowwiseParallel()
    if sequence_parallel:
        # RMSNorm weights become Replicate DTensors: their per-rank gradients (from 1/tp of
        # the tokens each) are summed across TP ranks by DTensor's backward.
        plan.update({"norm": SequenceParallel(), "layers.*.attention_norm": SequenceParallel(), "layers.*.ffn_norm": SequenceParallel()})
    return {prefix + path: style for path, style in plan.items()}


def hf_base_tp_plan(config: object) -> dict[str, str]:
    """A Hugging Face config's `base_model_tp_plan`, with the query projection of multi-head latent attention
    without a query LoRA: where `q_lora_rank` is None the layer builds `q_proj` in place of `q_a_proj`/`q_b_proj`,
    and GLM-4.7-Flash's and LongCat-Flash's plans name `q_b_proj` alone (DeepSeek-V2's and MiniCPM3's name both),
    so the heads the other projections split stayed whole on every rank (a shape error at the first forward)."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if getattr(config, "q_lora_rank", 0) is None:
        for key, style in list(plan.items()):
            if key.endswith(".q_b_proj"):
                plan.setdefault(key[: -len("q_b_proj")] + "q_proj", style)
    return plan
