"""A planned layout written as a LightningCLI recipe (`ultrascale plan --emit-recipe`)."""

from __future__ import annotations

from typing import Any, Optional

from ultrascale.estimate import ModelShape
from ultrascale.hardware import GIB, Cluster
from ultrascale.planner.cost import PlanRow, Workload, matmul_gains
from ultrascale.planner.layouts import Layout, runs_as

__all__ = ["batch_knobs", "checkpointing_args", "recipe_yaml", "strategy_knobs"]


def strategy_knobs(layout: Layout) -> dict[str, Any]:
    """`UltraScaleStrategy`'s arguments for the planner's `layout` (degrees, ZeRO stage, pipeline schedule and its
    micro-batches, CP method); the batch split is the Trainer's and the data's (`batch_knobs`)."""
    lay = runs_as(layout)  # ZeRO-0: unsharded HSDP
    init: dict[str, Any] = {
        "data_parallel_replicate": lay.dp_replicate, "data_parallel_shard": lay.dp_shard, "context_parallel": lay.cp,
        "tensor_parallel": lay.tp, "pipeline_parallel": lay.pp, "expert_parallel": lay.ep, "zero_stage": lay.zero_stage,
    }
    if lay.pp > 1:
        init.update(pipeline_schedule=lay.schedule, pipeline_microbatches=lay.grad_accumulation)
        if lay.virtual_stages > 1:
            init["pipeline_virtual_stages"] = lay.virtual_stages
        if lay.pipeline_layers is not None:
            init["pipeline_layers"] = list(lay.pipeline_layers)
    if lay.cp > 1:
        init["context_parallel_method"] = lay.cp_method
        if lay.cp_method == "usp":
            init["context_parallel_ulysses"] = lay.cp_ulysses
    if lay.accumulate_unsharded_grads:
        init["accumulate_unsharded_grads"] = True
    if lay.accumulate_grads_in_fp32 is not None and lay.zero_stage in (1, 2):
        init["accumulate_grads_in_fp32"] = lay.accumulate_grads_in_fp32
    return init


def batch_knobs(layout: Layout) -> tuple[int, int]:
    """(the data's `global_batch_size`, the Trainer's `accumulate_grad_batches`) that make `layout`'s split of the
    batch: per Lightning step every data-parallel rank takes micro_batch sequences (under pipeline parallel, all of
    its pipeline micro-batches at once)."""
    lay = runs_as(layout)
    if lay.pp > 1:
        return lay.micro_batch * lay.grad_accumulation * lay.dp, 1
    return lay.micro_batch * lay.dp, lay.grad_accumulation


def checkpointing_args(layout: Layout, cluster: Cluster) -> Optional[dict[str, Any]]:
    """`ActivationCheckpointing`'s init_args that run `layout`'s recompute (None: nothing recomputed): its mode, or
    under a budget the memory it was chosen for, the GPU's planned-for GiB (the run chooses the same blocks)."""
    if layout.recompute == "none":
        return None
    if layout.recompute == "budget":
        return {"memory_budget_gib": round(cluster.usable_bytes / GIB, 3)}
    return {"mode": layout.recompute}


def recipe_yaml(row: PlanRow, model: str, shape: ModelShape, cluster: Cluster, work: Workload) -> str:
    """A LightningCLI recipe running `row`'s layout (`ultrascale fit --config PATH` under torchrun / SLURM)."""
    lay = runs_as(row.layout)  # ZeRO-0: unsharded HSDP
    nodes = max(cluster.gpus // cluster.gpus_per_node, 1)
    devices = min(cluster.gpus, cluster.gpus_per_node)
    init = {**strategy_knobs(row.layout), "meta_init": True}
    if work.compiled:  # priced compiled (`plan --compile`): the recipe compiles each block
        init["compile"] = True
    strategy = "\n".join(f"      {key}: {value}" for key, value in init.items())
    callbacks = ""
    checkpointing = checkpointing_args(lay, cluster)
    if checkpointing is not None:
        callbacks = ("    - class_path: ultrascale.callbacks.ActivationCheckpointing\n      init_args:\n"
                     + "".join(f"        {key}: {value}\n" for key, value in checkpointing.items()))
    if work.float8:  # priced with Float8 matmuls (`plan --fp8`)
        callbacks += "    - class_path: ultrascale.callbacks.Float8Training\n"
    if shape.builtin:
        model_block = f"  class_path: ultrascale.models.LlamaLM\n  init_args:\n    preset: {model}\n    max_seq_len: {work.seq_len}\n"
    else:
        model_block = (f"  class_path: ultrascale.models.hf.HFCausalLM\n  init_args:\n    pretrained_path: {model}\n"
                       "    attn_implementation: sdpa\n")
    global_batch_size, accumulate = batch_knobs(row.layout)
    mem, t = row.memory, row.step_time
    compile_gain, float8_gain = matmul_gains()
    compiled = f"; each block compiled (compute outside attention priced / {compile_gain:.3f})" if work.compiled else ""
    if work.float8:
        compiled += f", Float8 matmuls (/ {float8_gain:.3f})"
    return f"""# Written by `ultrascale plan`: {shape.name} on {cluster.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node).
# Layout: {lay.describe()}{compiled}
# Predicted per GPU: {mem['total'] / GIB:.1f} GiB, step {t['total']:.2f} s, {row.tokens_per_s_per_gpu:,.0f} tokens/s, MFU {row.mfu:.1%}.
# Launch on every node (torchrun sets the ranks; SLURM's srun works the same way):
#   torchrun --nnodes {nodes} --nproc-per-node {devices} --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 \\
#       -m ultrascale.cli fit --config THIS_FILE
# Replace the data section with your corpus (`dataset_path`, `tokenizer_path`).
seed_everything: 1234
trainer:
  accelerator: gpu
  devices: {devices}
  num_nodes: {nodes}
  precision: {work.precision}
  max_steps: 1000
  accumulate_grad_batches: {accumulate}
  gradient_clip_val: 1.0
  log_every_n_steps: 10
  strategy:
    class_path: ultrascale.UltraScaleStrategy
    init_args:
{strategy}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        save_last: true
        every_n_train_steps: 500
{callbacks}model:
{model_block}data:
  class_path: ultrascale.data.CausalLMDataModule
  init_args:
    data_path: stdlib
    seq_len: {work.seq_len}
    global_batch_size: {global_batch_size}
"""
