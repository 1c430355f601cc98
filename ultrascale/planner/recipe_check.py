"""`ultrascale plan --recipe`'s check: a LightningCLI recipe parsed as `ultrascale fit --config` would, its model
built on the meta device, its strategy's checks run at its world size, and its fixed layout priced (`check_recipe`).

The command itself (`plan_recipe_main`) is in `ultrascale.planner.app`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L

from ultrascale.estimate import ModelShape
from ultrascale.hardware import FLOAT8_SPEEDUP, GPU_SPECS, Cluster, GpuSpec
from ultrascale.models.adapters import model_shape
from ultrascale.parallel.dims import ParallelDims, context_chunks
from ultrascale.parallel.rules import CHECKING_PRECISION, PRECISIONS, batch_problems, choice_problems, raise_first
from ultrascale.planner.calibration import calibrated, load_calibration
from ultrascale.planner.cost import PlanRow, Workload, evaluate, matmul_gains
from ultrascale.planner.layouts import layout_of_strategy
from ultrascale.planner.report import compile_assumption, explain
from ultrascale.recipe_cli import UltraScaleCLI


def priced_cluster(spec: GpuSpec, gpus: int, gpus_per_node: int, efficiency: Optional[float],
                   calibration: Optional[str] = None, devices: str = "cuda") -> Cluster:
    """The cluster a plan is priced for; `efficiency` (`--efficiency`) None keeps the GPU's; `calibration`
    (`--calibration FILE`, `planner_calibration=`) this machine's ratios per layout family (ValueError if unusable)."""
    cluster = Cluster(spec, gpus, gpus_per_node, efficiency)
    return calibrated(cluster, load_calibration(calibration, spec.name, devices)) if calibration else cluster


_AXIS_KNOBS = {"pp": "pipeline_parallel", "dp_replicate": "data_parallel_replicate", "dp_shard": "data_parallel_shard",
               "cp": "context_parallel", "tp": "tensor_parallel", "ep": "expert_parallel"}
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "None": "32-true"}


class _RecipeCLI(UltraScaleCLI):
    """Parses a recipe and instantiates its classes exactly as `ultrascale fit --config` does, but builds no
    Trainer: a GPU recipe's Trainer would look for its GPUs, and the check runs on any laptop."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        return None


@dataclass
class RecipePlan:
    """What `ultrascale plan --recipe` found: the recipe's objects, its layout resolved for the world size,
    the checks it passed and the planner's price of that fixed layout."""

    path: str
    module: L.LightningModule
    """The recipe's LightningModule with its network built on the meta device (no weights)."""
    strategy: Any
    dims: ParallelDims
    """The strategy's degrees at `world` ranks."""
    world: int
    shape: ModelShape
    """What the planner prices."""
    cluster: Cluster
    work: Workload
    row: PlanRow
    """The planner's price of the recipe's layout."""
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    devices: str = "cuda"
    """What the recipe runs on: "cuda", or "cpu" (priced as if on `cluster.gpu`, for scale)."""
    datamodule: Optional[L.LightningDataModule] = None
    """The recipe's data module, as parsed (nothing read yet)."""

    @property
    def fits(self) -> bool:
        return bool(self.row.fits)


def parse_recipe(path: str, overrides: Sequence[str]) -> _RecipeCLI:
    import logging
    import warnings

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # "Seed set to ..." is noise in a plan
    try:
        with warnings.catch_warnings():
            # `args=` given while `ultrascale plan ...` is in sys.argv: intended here.
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            return _RecipeCLI(args=["--config", str(path), *overrides], run=False)
    finally:
        seed_log.setLevel(level)


def _parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _device_count(devices: Any, gpus_per_node: Optional[int]) -> int:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.strip().isdigit() and int(devices) > 0:
        return int(devices)
    if isinstance(devices, (list, tuple)) and devices:
        return len(devices)
    if gpus_per_node:
        return gpus_per_node
    raise ValueError(f"`trainer.devices={devices!r}` is not a device count: write the number of devices per node in the "
                     "recipe, or pass --gpus-per-node")


def _recipe_strategy(value: Any) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    from ultrascale.strategies import UltraScaleStrategy

    name = value
    if isinstance(value, str) and value in StrategyRegistry:
        value = StrategyRegistry.get(value)
    if not isinstance(value, UltraScaleStrategy):
        shown = name if isinstance(name, str) else type(name).__name__
        raise ValueError(f"`trainer.strategy={shown!r}`: `ultrascale plan --recipe` checks ultrascale strategies (a name "
                         "such as `ultrascale_zero3`, or `class_path: ultrascale.UltraScaleStrategy` with its degrees)")
    return value


def _recompute_mode(callbacks: list[Any], notes: list[str]) -> str:
    """The planner's recompute mode for the recipe's ActivationCheckpointing callback ("none" without one)."""
    from ultrascale.callbacks import ActivationCheckpointing

    modes = [cb for cb in callbacks if isinstance(cb, ActivationCheckpointing)]
    if not modes:
        return "none"
    callback = modes[-1]
    if callback.memory_budget_gib is not None:
        return "budget"
    if callback.mode in ("full", "selective") and type(callback.policy).__name__ in ("FullAC", "SelectiveAC"):
        return callback.mode
    notes.append(f"ActivationCheckpointing(mode={callback.mode!r}, policy {type(callback.policy).__name__}) is priced as "
                 "no recomputation: an upper bound on the activations")
    return "none"


def check_recipe(path: str, overrides: Sequence[str] = (), *, gpus: Optional[int] = None, gpu: str = "h100",
                 gpus_per_node: Optional[int] = None, spec: Optional[GpuSpec] = None, efficiency: Optional[float] = None,
                 eager_attention: bool = False, calibration: Optional[str] = None) -> RecipePlan:
    """Check a recipe for its cluster without running it: parse it as `ultrascale fit --config` would (the
    strategy's constructor validates its knobs), build the model's network on the meta device (no weight
    is allocated), resolve the strategy's degrees for `gpus` ranks (default: trainer.num_nodes x
    trainer.devices), run the model checks the strategy runs before any collective (TP/CP/EP/PP support
    and divisibility, the pipeline's stages and micro-batches, sequence length, batch split), then price
    that fixed layout with the planner. ValueError (the strategy's own messages) if the layout is invalid.

    `overrides` are LightningCLI arguments applied over the recipe (e.g. `--model.pretrained_path DIR`)."""
    import itertools

    import torch

    from ultrascale.models.llama import LlamaConfig

    cli = parse_recipe(path, overrides)
    trainer_args = cli.config_init["trainer"]
    module, datamodule = cli.model, cli.datamodule
    strategy = _recipe_strategy(trainer_args.get("strategy"))
    checks: list[str] = []
    notes: list[str] = []

    nodes = int(trainer_args.get("num_nodes") or 1)
    devices = _device_count(trainer_args.get("devices"), gpus_per_node)
    per_node = gpus_per_node or devices
    world = gpus or nodes * devices
    # Degrees given as "auto" resolve from the devices of one node, as under a Trainer.
    strategy.parallel_devices = [torch.device("cpu")] * per_node
    strategy.num_nodes = max(world // per_node, 1)
    try:
        dims = strategy.resolve_dims(world)
    except ValueError as error:
        knobs = ", ".join(f"{axis} = {knob}" for axis, knob in _AXIS_KNOBS.items())
        source = f"--gpus {world}" if gpus else f"trainer.num_nodes {nodes} x trainer.devices {devices}"
        raise ValueError(f"{error} (world size {world} from {source}; strategy knobs: {knobs})") from None
    checks.append(f"mesh {dims.describe()}")

    precision = str(trainer_args.get("precision"))
    precision = _PRECISION_ALIASES.get(precision, precision)
    if precision == CHECKING_PRECISION:
        raise ValueError(f"`trainer.precision={precision!r}` checks a layout against one process and is not priced (no GPU "
                         f"trains in fp64): plan the recipe in one of {', '.join(PRECISIONS)}")
    raise_first(choice_problems("trainer.precision", precision, PRECISIONS))

    seq_len = getattr(datamodule, "seq_len", None)
    global_batch = getattr(datamodule, "global_batch_size", None)
    if not isinstance(seq_len, int) or not isinstance(global_batch, int):
        raise ValueError(f"{type(datamodule).__name__} has no integer `seq_len` and `global_batch_size`: the plan needs "
                         "both (ultrascale.data's data modules have them)")
    accumulate = int(trainer_args.get("accumulate_grad_batches") or 1)

    # The network on the meta device: shapes only. `configure_model` is where ultrascale's modules build it,
    # as under `meta_init=True`; anything a module builds in its constructor is counted below.
    with torch.device("meta"):
        module.configure_model()
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    allocated = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
    num_params = sum(p.numel() for p in module.parameters())
    checks.append(f"model built on the meta device: {_parameters(num_params)} parameters, "
                  f"{allocated / 2**20:.1f} MiB of real tensors")

    if (getattr(module, "hparams", None) or {}).get("lora") is not None:
        notes.append("LoRA: only the adapters train, but the layout is priced as full fine-tuning (the frozen base's "
                     "gradients and optimizer state are counted, so memory is over-estimated)")
    config = getattr(module, "config", None)
    hparams = getattr(module, "hparams", {})
    preset = hparams.get("preset") if isinstance(config, LlamaConfig) and hparams.get("config") is None else None
    try:
        shape = model_shape(module, name=f"Llama {preset}" if preset else None)
    except ValueError as error:
        raise ValueError(f"{type(module).__name__}: `ultrascale plan --recipe` prices the built-in Llama (LlamaLM) and "
                         f"Hugging Face models (HFCausalLM): {error}") from None
    hf_config = None if shape.builtin else shape.config
    # HF RoPE extends past max_position_embeddings: only the built-in Llama's table is a limit.
    max_positions, vocab = (config.max_seq_len, config.vocab_size) if shape.builtin else (None, hf_config.vocab_size)

    # The strategy's own checks (`UltraScaleStrategy.check_model`, what `setup` runs), on the meta-built model.
    owner = type(strategy).__name__
    checked = strategy.check_model(module, dims=dims)  # the degrees for this world, not the Trainer's
    adapter, sequence_parallel = checked.adapter, checked.sequence_parallel
    pipeline = checked.pipeline[1] if checked.pipeline is not None else None
    if dims.cp_enabled:
        checks.append(f"context parallel cp={dims.cp}: {strategy.context_parallel_method} attention on {adapter.name}")
    if dims.ep_enabled:
        checks.append(f"expert parallel ep={dims.ep}: {adapter.num_experts // dims.ep} of {adapter.num_experts} experts "
                      f"per rank, within dp_shard x cp = {dims.dp_shard_cp}")
    if pipeline is not None:
        checks.append(f"pipeline {pipeline.describe()}")
    if dims.tp_enabled:
        sizes = ", ".join(f"{name}={size}" for name, size in adapter.tp_sizes.items())
        experts = f"; each of the {adapter.num_experts} experts split on its width" if adapter.num_experts else ""
        checks.append(f"tensor parallel tp={dims.tp} divides {sizes} (sequence parallel {'on' if sequence_parallel else 'off'}"
                      f"{experts})")
    where = f"{type(datamodule).__name__}(seq_len={seq_len})"
    raise_first(batch_problems(dims, seq_len=seq_len, global_batch=global_batch,
                               sequence_parallel=sequence_parallel, where=type(datamodule).__name__,
                               microbatches=pipeline.microbatches if pipeline is not None else None), owner)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"{where} is longer than the model's RoPE table (max_seq_len={max_positions}): set "
                         f"`model.init_args.max_seq_len` to at least {seq_len}")
    local = global_batch // dims.dp
    splits = []
    if dims.cp > 1:
        splits.append(f"{context_chunks(dims.cp, load_balance=True)} context-parallel chunks")
    if sequence_parallel and dims.tp > 1:
        splits.append(f"tp={dims.tp} (sequence parallel)")
    checks.append(f"seq_len {seq_len}{' splits into ' + ' x '.join(splits) if splits else ''}"
                  f"{f', within max_seq_len {max_positions}' if max_positions else ''}; global_batch_size {global_batch} = "
                  f"{local} per data-parallel rank per micro-step")
    try:
        data_vocab = datamodule.vocab_size
    except (AttributeError, ValueError):  # a tokenizer that comes from the Trainer's module (InstructionDataModule)
        data_vocab = None
    if isinstance(data_vocab, int) and data_vocab > vocab:
        raise ValueError(f"the tokenizer of {type(datamodule).__name__} has {data_vocab} ids but the model only {vocab} "
                         "embeddings: set the model's `vocab_size` (or the data's `tokenizer_path`)")

    recompute = _recompute_mode(trainer_args.get("callbacks") or [], notes)
    if pipeline is not None:
        micro_batch, grad_accumulation = local // pipeline.microbatches, pipeline.microbatches * accumulate
        if accumulate > 1:
            notes.append(f"accumulate_grad_batches={accumulate} under pipeline parallel is priced as {grad_accumulation} "
                         "micro-batches in one schedule: the real run drains the pipeline once more per accumulation step")
    else:
        micro_batch, grad_accumulation = local, accumulate
    layout = layout_of_strategy(strategy, dims, micro_batch=micro_batch, grad_accumulation=grad_accumulation,
                                recompute=recompute, pipeline=pipeline)
    devices = "cpu" if str(trainer_args.get("accelerator")) == "cpu" else "cuda"
    cluster = priced_cluster(spec or GPU_SPECS[gpu], world, per_node, efficiency, calibration, devices)
    # The strategy's `compile` knob: each block compiled, priced with the published speed-up (`COMPILE_SPEEDUP`).
    from ultrascale.callbacks import Float8Training

    compiled = bool(getattr(strategy, "compile", False))
    float8 = any(isinstance(cb, Float8Training) for cb in trainer_args.get("callbacks") or [])
    if float8 and not compiled:
        notes.append("Float8Training without the strategy's `compile`: priced as bf16 (Float8's published gain is compiled)")
    elif float8:
        notes.append(f"Float8Training: compute outside attention / {matmul_gains()[1]:.3f} on top of compile (torchtitan's "
                     f"published {FLOAT8_SPEEDUP:.3f}); memory as bf16")
    work = Workload(seq_len, global_batch * accumulate, precision, attention_scores_saved=eager_attention,
                    compiled=compiled, float8=float8 and compiled, loss_chunk_tokens=hparams.get("loss_chunk_tokens"))
    budgeted = [cb for cb in trainer_args.get("callbacks") or [] if getattr(cb, "memory_budget_gib", None) is not None]
    if recompute == "budget" and pipeline is None:  # the blocks the run will choose for its budget, and its refusal
        modes = budgeted[-1].choose_blocks(shape, layout, cluster, work, hf_config)
        layout = dataclasses.replace(layout, recompute_blocks=tuple(modes.count(mode) for mode in ("full", "selective", "none")))
        notes.append(f"ActivationCheckpointing(memory_budget_gib={budgeted[-1].memory_budget_gib}): "
                     f"{budgeted[-1].describe_blocks()}")
    row = evaluate(shape, layout, cluster, work, hf_config)
    if row.problems:  # the planner's copy of the strategy's remaining rules (TP inside a node, ZeRO-1/2 limits, ...)
        raise ValueError(f"{owner} layout {layout.describe()}: " + "; ".join(row.problems))
    if str(trainer_args.get("accelerator")) == "cpu":
        notes.append(f"a CPU recipe: priced as if on {cluster.gpu.name}, for scale")
    return RecipePlan(str(path), module, strategy, dims, world, shape, cluster, work, row, checks, notes, devices,
                      datamodule)


def format_recipe_plan(plan: RecipePlan) -> list[str]:
    lay, work, cluster = plan.row.layout, plan.work, plan.cluster
    lines = [
        f"recipe     {plan.path}: {type(plan.module).__name__}, {type(plan.strategy).__name__} on {plan.world} ranks",
        f"model      {plan.shape.name}: {_parameters(plan.shape.num_params)} parameters, "
        f"{plan.shape.flops_per_token(work.seq_len) / 1e9:.1f} GFLOPs per token",
        f"cluster    {cluster.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node), {cluster.gpu.memory_gib:g} GiB "
        f"each ({cluster.memory_headroom:.0%} planned for){compile_assumption(work)}",
        f"batch      {work.global_batch} sequences x {work.seq_len} tokens = {work.tokens:,} tokens per optimizer step "
        f"({lay.dp} data-parallel ranks x micro-batch {lay.micro_batch} x {lay.grad_accumulation} "
        f"{'pipeline micro-batches' if lay.pp > 1 else 'accumulation steps'}); {work.precision}",
    ]
    lines += [f"checked    {check}" for check in plan.checks]
    lines += ["layout     " + lay.describe()]
    lines += explain(plan.row, cluster)
    lines += [f"note       {note}" for note in [*plan.notes, *plan.row.notes]]
    return lines

__all__ = ["RecipePlan", "check_recipe", "format_recipe_plan", "parse_recipe", "priced_cluster"]
