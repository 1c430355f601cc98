"""`UltraScaleStrategy`: the N-D mesh Lightning strategy every ultrascale strategy derives from.

The strategy is a thin adapter: it turns Lightning's lifecycle into calls of
`ultrascale.parallel` (mesh, FSDP2 sharding, gradient sync, clipping, DCP checkpoints).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from ultrascale.contract import check_module, prefers_meta_init
from ultrascale.parallel.compile import block_compiler
from ultrascale.parallel.context import ContextLayout, ContextParallel, ContextParallelMethod
from ultrascale.parallel.device import (
    enable_symmetric_memory,
    process_group_backend,
    symmetric_memory_available,
    tune_cpu_allocator,
)
from ultrascale.parallel.dims import ParallelDims, ParallelMesh, build_mesh
from ultrascale.parallel.fsdp import reshard
from ultrascale.parallel.manifest import VERIFY_LEVELS, VerifyLevel
from ultrascale.parallel.optimizers import check_optimizer_on_slices
from ultrascale.parallel.pipeline import PipelineLayout, PipelineRunner, TiedStageWeights
from ultrascale.parallel.rules import LayoutKnobs, async_tensor_parallel_problems, knob_problems, raise_first
from ultrascale.parallel.tensor import has_tensor_parallel_dropout
from ultrascale.parallel.tensor_styles import resolve_plan
from ultrascale.parallel.transforms import ModelTransform
from ultrascale.parallel.zero import ZeroEngine, engine_for
from ultrascale.planner.calibration import load_calibration
from ultrascale.strategies import collectives, model_setup, process_group
from ultrascale.strategies._lightning_compat import StrategyInternals, attach_device_mesh, check_lightning_internals, optimizers_to_device
from ultrascale.strategies.auto_layout import apply_auto_layout, choose_budget_blocks, fixed_knobs
from ultrascale.strategies.checkpoint_io import AsyncCheckpointPublisher, CheckpointHooks
from ultrascale.strategies.launcher import LauncherName, make_launcher
from ultrascale.strategies.layout_checks import LayoutChecks, trainer_of
from ultrascale.strategies.pipeline_step import PipelineGradientStash
from ultrascale.strategies.precision import UltraScalePrecision, translate_precision_plugin
from ultrascale.strategies.process_group import ProcessConfig, ProcessKnobs, ShardingKnobs, checked_knobs
from ultrascale.strategies.step import NonFinitePolicy, StepGroups, StepRunner
from ultrascale.strategies.step_hooks import StepCaller, StepHooks

PathLike = Union[str, Path]

__all__ = ["ProcessKnobs", "ShardingKnobs", "UltraScaleStrategy", "checked_knobs"]  # the knobs' TypedDicts: the subclasses import them here


class UltraScaleStrategy(StepHooks, CheckpointHooks, LayoutChecks, StrategyInternals):
    """N-D parallel training on a `DeviceMesh` with axes `pp, dp_replicate, dp_shard, cp, tp`.

    Registered as ``"ultrascale_4d"``. Any `LightningModule` works unchanged: after `configure_model()` the strategy finds
    the model's transformer blocks (through the model adapter, or generically as the largest ModuleList of identical
    children) and shards them with FSDP2. A module that already parallelised itself in `configure_model()` (its
    parameters are DTensors) is left as it is.

    Args:
        data_parallel_replicate: replicas of the sharded model (HSDP's replicate axis); 1 means off.
        data_parallel_shard: ranks that shard parameters, gradients and optimizer state (ZeRO-3); -1 means "the rest of the world
            size".
        context_parallel: ranks that split the sequence of every batch; 1 means off. Sequence lengths must be multiples of 2 * cp
            (times tensor_parallel under sequence parallel). The built-in Llama and HF decoders whose attention runs through the
            AttentionInterface are supported.
        context_parallel_method: "ring" (default: K/V passed around the cp ring with P2P, overlapped with the block in hand),
            "allgather" (one all-gather of K/V per layer), "alltoall" (Ulysses: all-to-alls trade heads for sequence around
            SDPA; the query heads per tp rank must divide by cp) or "usp" (both: Ulysses inside groups of
            `context_parallel_ulysses` neighbouring cp ranks, the ring across them). docs/strategies.md compares them.
        context_parallel_ulysses: USP's Ulysses degree (method "usp" only): it divides cp, is 2 or more and smaller than
            cp, and the query heads per tp rank divide by it.
        context_parallel_load_balance: zig-zag layout (rank r holds chunks r and 2cp-1-r of 2cp), so every rank does the same causal
            attention work. False: contiguous chunks (the last rank then computes about 2cp-1 times the attention of the first).
        tensor_parallel: tensor-parallel degree (Megatron column/row splits on DTensor); 1 means off. The model needs a TP plan: the
            built-in Llama has one, a Hugging Face model runs the `base_model_tp_plan` its config ships, any other model passes
            `tp_plan`. On a Mixture-of-Experts model every expert is split on its intermediate width (expert tensor parallel: the
            router and the tokens stay whole on every tp rank).
        pipeline_parallel: pipeline ranks; 1 means off. The model is split by layers (the built-in Llama and Hugging Face
            models with a `base_model_pp_plan` know how; a module of your own returns `ultrascale.parallel.pipeline.PipelineParts` from a
            `pipeline_parts()` method) and the batch runs through torch's schedule in the loss call: see `pipeline_loss`. Parameters
            keep their names, so checkpoints move between degrees.
        pipeline_schedule: torch's schedule: "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
            "ZBVZeroBubble" or "DualPipeV".
        pipeline_microbatches: micro-batches each local batch is cut into (must divide its sequences). None: the number of stages
            (pipeline_parallel x virtual stages).
        pipeline_virtual_stages: stages per rank. None: 1 for GPipe/1F1B, 2 for the others (the V schedules need exactly 2).
        pipeline_layers: layers per stage, in model order (pipeline_parallel x virtual stages entries); None: balanced, the
            remainder going to the first stages.
        expert_parallel: ranks that split the experts of a Mixture-of-Experts model (the built-in Llama with `n_experts`, Hugging
            Face Mixtral/Qwen2-MoE/Qwen3-MoE); 1 means off. Borrows its ranks from dp_shard x cp (must divide it, and the experts
            per layer): tokens travel to their experts' ranks by all-to-all. With tensor_parallel each expert stays whole on its
            ep rank (EP x TP); tensor_parallel alone splits every expert's width instead.
        sequence_parallel: shard norms and the residual stream on the sequence dim between TP regions (activations 1/tp, same
            communication volume). None: on where the model's plan supports it (built-in Llama), off otherwise; True also runs it
            on Hugging Face decoders, dense and MoE (`ultrascale.models.hf_sequence_parallel`).
        loss_parallel: keep the logits vocab-sharded into the cross-entropy instead of all-gathering (B, T, V). None: on if the
            LightningModule sets `supports_loss_parallel = True` (its loss code accepts DTensor logits, as `LlamaLM`'s does), off
            otherwise.
        tp_plan: a tensor-parallel plan for models without an adapter: module path (wildcards allowed) -> `ParallelStyle` or a name
            in `ultrascale.parallel.tensor_styles.STYLE_NAMES` ("colwise", "rowwise", ...).
        zero_stage: 3 = parameters, gradients and optimizer state sharded (FSDP2); 2 = replicated parameters, sharded gradients and
            optimizer state; 1 = replicated parameters and gradients, sharded optimizer state. Stages 1/2 need an elementwise
            optimizer (AdamW, SGD, ...); with tensor parallel they shard each rank's tp shards (Megatron's distributed optimizer).
        zero_bucket_mb: ZeRO-1/2 gradient bucket size in MiB (one reduce-scatter per bucket, launched in the step's last backward as
            soon as its gradients are complete). None: 100 on GPU (the Playbook's figure), 4 on CPU.
        accumulate_grads_in_fp32: ZeRO-1/2 with bf16 parameters: accumulate and reduce gradients in fp32 buffers (no bf16 rounding
            across micro-batches and ranks; twice the gradient memory of bf16). None: fp32 under bf16-mixed (as ZeRO-3 reduces,
            and Megatron's distributed optimizer), the weights' dtype under bf16-true.
        reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3, least memory; one extra all-gather in
            backward). False keeps them until backward (ZeRO-2-like memory for parameters, less communication).
        accumulate_unsharded_grads: ZeRO-3 with gradient accumulation. False: reduce-scatter every micro-batch into the sharded
            gradients (ZeRO-3's memory, 4Ψ/N bytes of fp32 gradients per rank; k times the reduce-scatter traffic for k
            micro-batches). True: skip the reduce-scatter on all but the last micro-batch (one per step), at the price of every rank
            holding the whole model's unsharded fp32 gradients (4Ψ/(tp·pp) bytes: 32 GB for an 8B model), so only for models small
            next to the device. Pipeline schedules always reduce once per step.
        meta_init: build the model on the meta device in `configure_model()` and materialise each rank's shard after sharding
            (needed for models that do not fit on one device; weights then come from the model's `init_weights()`).
        sync_module_states: broadcast rank 0's initial weights before sharding, so that ranks that initialised differently cannot
            train diverging replicas.
        launcher: how processes are started: "subprocess" re-runs the script per rank (scripts, CLI), "fork" forks the current
            process (pytest, notebooks; CPU only), "auto" picks between them. Ignored when an external launcher (torchrun, SLURM)
            started the processes.
        process_group_backend: "gloo" / "nccl"; default: nccl on CUDA, gloo on CPU.
        timeout: collective timeout; a hang becomes an error after it.
        nonfinite: what a step whose loss or global gradient norm is NaN/inf does: "stop" raises FloatingPointError naming the step,
            rank, loss and norm; "skip" drops the step (no optimizer update; counted, warned and logged as `skipped_steps`) up to
            `max_nonfinite_skips`, then stops; "rollback" skips it too and restores the weights and optimizer state of the newest
            complete checkpoint (the step count, LR schedule and data go on, so the batches since that checkpoint are skipped;
            logged as `rollbacks`; counted against `max_nonfinite_skips`); "off" does not check (saves one host sync and, without
            clipping, one all-reduce per step). Loss spikes (robust z-score > 6 over the last 100 steps) are warned and logged as
            `loss_spikes` unless "off".
        max_nonfinite_skips: how many steps "skip" / "rollback" may drop in a run before it stops.
        async_checkpoint: write checkpoints saved during `fit` in a background thread (DCP `async_save`): the save returns once this
            rank's shards are copied to host memory and training goes on while they are written. A checkpoint is published under its
            name (and found by a resume or `latest_checkpoint`) only once every rank has written it: at the first step after that,
            at the next save, before a load or at the end of `fit`; removals `ModelCheckpoint` asks for wait until then. Costs one
            host copy of this rank's shards while writing, and two gloo process groups.
        tune_cpu_allocator: on CPU, glibc keeps freed heap memory instead of returning each step's freed activations to
            the OS and faulting them in again (`ultrascale.parallel.device.tune_cpu_allocator`, priced by
            `benchmarks/overhead.py`). glibc cannot be set back, so this changes the process for good: off by default.
        checkpoint_verify: what a resume checks before it loads a checkpoint against the manifest its save wrote
            (`ultrascale.parallel.manifest`): "checksum" (every file's size and CRC-32, read by the ranks in parallel; a damaged
            checkpoint is refused naming its files, and `--ckpt_path auto` / `latest_checkpoint` take the newest one that
            verifies), "size" (sizes only: a stat per file, for very large checkpoints) or "off".
        auto_layout: choose the layout with `ultrascale plan`'s planner when the processes start: the fastest predicted layout that
            fits this world size, device memory, model and batch (see `ultrascale.strategies.auto_layout`), logged on rank 0.
            Degrees, `zero_stage` and pipeline knobs left at their defaults are searched; those set are kept. Needs a model the
            planner knows (built-in Llama, Hugging Face Llama-family / MoE) and a data module with `seq_len` and
            `global_batch_size`; otherwise it says so and keeps the defaults (ZeRO-3 over every rank). `strategy="ultrascale_4d"`
            turns it on.
        planner_calibration: a file `ultrascale tune --calibrate FILE` wrote on these machines: the auto layout divides each
            layout's predicted times by its family's measured / predicted tokens/s (`ultrascale.planner.calibration`). Needs
            `auto_layout`; checked when the strategy is made, and against the GPU when the processes start.
        compile: `torch.compile` each transformer block after TP, expert dispatch, context parallel, activation checkpointing
            and FP8, before FSDP / ZeRO (torchtitan's order; `ultrascale.parallel.compile`). The first step's compile time is
            logged and later recompilations as `compile/recompiles`.
        compile_backend: "inductor" (generated kernels), "aot_eager" (the same capture with eager kernels) or "eager".
        async_tensor_parallel: overlap sequence parallel's all-gathers and reduce-scatters with TP's matmuls (inductor's
            micro-pipeline pass over the compiled blocks, torch's symmetric-memory kernels: torchtitan's async TP). Needs
            `compile=True` with inductor, tensor and sequence parallel, CUDA.
    """

    strategy_name = "ultrascale_4d"

    normalizes_token_loss = True
    """A `training_step` output ``{"loss": mean, "num_tokens": n}`` gets the exact global token mean
    (gradient and the logged ``train_loss``); see `ultrascale.strategies.step`."""

    def __init__(
        self,
        data_parallel_replicate: int = 1,
        data_parallel_shard: int = -1,
        context_parallel: int = 1,
        context_parallel_method: ContextParallelMethod = "ring",
        context_parallel_load_balance: bool = True,
        context_parallel_ulysses: Optional[int] = None,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: Optional[int] = None,
        pipeline_virtual_stages: Optional[int] = None,
        pipeline_layers: Optional[list[int]] = None,
        expert_parallel: int = 1,
        sequence_parallel: Optional[bool] = None,
        loss_parallel: Optional[bool] = None,
        tp_plan: Optional[dict[str, Any]] = None,
        zero_stage: int = 3,
        zero_bucket_mb: Optional[float] = None,
        accumulate_grads_in_fp32: Optional[bool] = None,
        reshard_after_forward: bool = True,
        accumulate_unsharded_grads: bool = False,
        meta_init: bool = False,
        sync_module_states: bool = True,
        launcher: LauncherName = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        nonfinite: NonFinitePolicy = "stop",
        max_nonfinite_skips: int = 10,
        auto_layout: bool = False,
        planner_calibration: Optional[str] = None,
        async_checkpoint: bool = False,
        checkpoint_verify: VerifyLevel = "checksum",
        tune_cpu_allocator: bool = False,
        compile: bool = False,
        compile_backend: str = "inductor",
        async_tensor_parallel: bool = False,
    ) -> None:
        check_lightning_internals()
        super().__init__()
        self._degrees = {"dp_replicate": data_parallel_replicate, "dp_shard": data_parallel_shard, "cp": context_parallel,
                         "tp": tensor_parallel, "pp": pipeline_parallel, "ep": expert_parallel}
        raise_first(knob_problems(LayoutKnobs(
            **self._degrees, zero_stage=zero_stage, context_parallel_method=context_parallel_method,
            context_parallel_ulysses=context_parallel_ulysses, pipeline_schedule=pipeline_schedule,
            pipeline_virtual_stages=pipeline_virtual_stages,
            pipeline_microbatches=pipeline_microbatches, loss_parallel=loss_parallel,
            accumulate_unsharded_grads=accumulate_unsharded_grads, zero_bucket_mb=zero_bucket_mb,
        )), type(self).__name__)
        self.process_config = ProcessConfig(type(self).__name__, launcher, process_group_backend, timeout, nonfinite,
                                            max_nonfinite_skips, async_checkpoint, tune_cpu_allocator)
        self.context_parallel_method = context_parallel_method
        self.context_parallel_ulysses = context_parallel_ulysses
        self.pipeline_schedule = pipeline_schedule
        self.pipeline_microbatches = pipeline_microbatches
        self.pipeline_virtual_stages = pipeline_virtual_stages
        self.pipeline_layers = list(pipeline_layers) if pipeline_layers is not None else None
        self._pipeline: Optional[PipelineRunner] = None
        self._pipeline_layout: Optional[PipelineLayout] = None
        self._pipeline_grads = PipelineGradientStash()
        self._tied_weights: Optional[TiedStageWeights] = None  # pipeline parallel with tied embeddings: this rank's end
        self.context_parallel_load_balance = context_parallel_load_balance
        self._context_parallel: Optional[ContextParallel] = None
        self.zero_stage = zero_stage
        self.zero_bucket_mb = zero_bucket_mb
        self.accumulate_grads_in_fp32 = accumulate_grads_in_fp32
        self._zero_engines: list[ZeroEngine] = []
        self._tensor_parallel_checked: set[int] = set()
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.tp_plan = resolve_plan(tp_plan) if tp_plan is not None else None
        self._loss_parallel_active = False
        self._sequence_parallel_active: Optional[bool] = None  # known once the TP plan is chosen
        self._tensor_parallel_dropout = False  # LoRA dropout on tp layers: the tp ranks' generators agree each step
        self._step = StepRunner(nonfinite, max_nonfinite_skips)
        self._step_groups: Optional[StepGroups] = None  # known once the mesh exists
        self.async_tensor_parallel = async_tensor_parallel
        self._rollbacks = 0
        if checkpoint_verify not in VERIFY_LEVELS:
            raise ValueError(f"{type(self).__name__}(`checkpoint_verify={checkpoint_verify!r}`): choose one of {VERIFY_LEVELS}")
        self.checkpoint_verify = checkpoint_verify
        self.checkpoint_publisher = AsyncCheckpointPublisher(async_checkpoint)
        """Writes this strategy's checkpoints (in the background under `async_checkpoint`) and publishes them."""
        self._step_caller = StepCaller()  # remembers, per step hook, whether it calls `self(...)` itself
        self.reshard_after_forward = reshard_after_forward
        self.accumulate_unsharded_grads = accumulate_unsharded_grads
        self.meta_init = meta_init
        self.sync_module_states = sync_module_states
        self._process_group_backend = process_group_backend
        self._parallel_dims: Optional[ParallelDims] = None
        self._parallel_mesh: Optional[ParallelMesh] = None
        self.num_nodes = 1
        self.auto_layout = auto_layout
        if planner_calibration is not None:
            if not auto_layout:
                raise ValueError(f"{type(self).__name__}(`planner_calibration={planner_calibration!r}`) corrects the auto layout's "
                                 "predictions: pass `auto_layout=True` (or strategy='ultrascale_4d'), or drop it")
            load_calibration(planner_calibration)  # readable and well-formed, before any process starts
        self.planner_calibration = planner_calibration
        # What the user set away from the defaults stays fixed in the auto search.
        self._auto_fixed = fixed_knobs(
            dp_replicate=(data_parallel_replicate, 1), dp_shard=(data_parallel_shard, -1), cp=(context_parallel, 1),
            tp=(tensor_parallel, 1), pp=(pipeline_parallel, 1), ep=(expert_parallel, 1), zero_stage=(zero_stage, 3),
            virtual_stages=(pipeline_virtual_stages, None), accumulate_unsharded_grads=(accumulate_unsharded_grads, False),
            pipeline_schedule=(pipeline_schedule, "1F1B"), cp_method=(context_parallel_method, "ring"),
            cp_ulysses=(context_parallel_ulysses, None),
            pipeline_layers=(tuple(pipeline_layers) if pipeline_layers is not None else None, None),
        )
        self._auto_transforms: list[ModelTransform] = []
        self.compile, self.compile_backend = compile, compile_backend
        self._compiler = block_compiler(compile, compile_backend, type(self).__name__, pipeline=(pipeline_parallel, pipeline_schedule),
                                        async_tensor_parallel=async_tensor_parallel)
        self.chosen_layout: Optional[Any] = None
        """Under `auto_layout`, the planner's row that was applied (`ultrascale.planner.PlanRow`)."""

    @classmethod
    def from_accelerate(cls, parallelism_config: Any, **knobs: Any) -> "UltraScaleStrategy":
        """The strategy for an accelerate `ParallelismConfig` (or a mapping with its field names): its
        dp_replicate / dp_shard / tp / cp sizes become the degrees, cp's communication strategy the
        context-parallel method, `sp_size` Ulysses (USP with `cp_size`), `enable_async_tp` `async_tensor_parallel`;
        what ultrascale does not run (a Ulysses kernel other than SDPA) is refused. Other knobs (`zero_stage`,
        `pipeline_parallel`, `compile`, ...) pass through `knobs`."""
        from ultrascale.strategies.accelerate_interop import knobs_from_accelerate

        return cls(**knobs_from_accelerate(parallelism_config, owner=cls.__name__, other_knobs=knobs), **knobs)

    # ------------------------------------------------------------------ layout
    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            self._parallel_dims = self.resolve_dims(self.num_nodes * self.num_processes)
        return self._parallel_dims

    @property
    def zero_engines(self) -> tuple[ZeroEngine, ...]:
        """The ZeRO-1/2 engines of this strategy's optimizers (empty under ZeRO-3); kept after `fit` for a save."""
        return tuple(self._zero_engines)

    @property
    def parallel_mesh(self) -> ParallelMesh:
        """All meshes of the run by axis name: `pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp`."""
        if self._parallel_mesh is None:
            raise RuntimeError("the device mesh exists only after the processes have been initialised")
        return self._parallel_mesh

    @property
    def sequence_parallel_mesh(self) -> Optional[DeviceMesh]:
        """Under sequence parallel, the tp mesh over whose ranks the residual stream is cut on the sequence (dim 1):
        a plain tensor between the blocks is this rank's slice. None otherwise."""
        return self.parallel_mesh["tp"] if self._sequence_parallel_active and self.parallel_dims.tp_enabled else None

    @property
    def context_layout(self) -> Optional[ContextLayout]:
        """Under context parallel, which tokens of the current batch this rank holds
        (`layout.token_index(cp_rank)`): steps, callbacks and predictions see only those. None otherwise."""
        return self._context_parallel.layout if self._context_parallel is not None else None

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 5-D world mesh (also `LightningModule.device_mesh`)."""
        return self.parallel_mesh.world

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only the dp axes see different batches; tp/pp ranks of one dp rank need the same
        # batch and cp ranks split the same batch along the sequence.
        dp_mesh = self.parallel_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def batch_length_rule(self) -> tuple[int, str]:
        """``(multiple, shapes)`` for a data module that pads each batch to its longest sequence: the length must be
        a multiple of `multiple` (what the layout splits it by, `ParallelDims.seq_len_divisor`); `shapes` is
        "any", "buckets" (`compile=True`: a compiled block recompiles for each new length, so lengths are rounded
        up to `multiple` x a power of two, a few shapes) or "static" (pipeline stages keep the shapes of their
        first step: `seq_len` always)."""
        dims = self.parallel_dims
        multiple = dims.seq_len_divisor(sequence_parallel=self.sequence_parallel and dims.tp > 1,
                                        load_balance=self.context_parallel_load_balance)
        return multiple, "static" if dims.pp > 1 else "buckets" if self.compile else "any"

    @property
    def is_distributed(self) -> bool:
        # Lightning only injects its DistributedSampler for strategies that say so.
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> Precision:
        stored = self.stored_precision_plugin
        return stored if stored is not None else UltraScalePrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self.stored_precision_plugin = translate_precision_plugin(precision_plugin, type(self).__name__)

    # ------------------------------------------------------------------ processes
    @override
    def create_launcher(self) -> Any:
        assert self.cluster_environment is not None
        # Validate the layout here, at Trainer construction, before any process is started.
        self._parallel_dims = self.resolve_dims(self.num_nodes * self.num_processes)
        if self.cluster_environment.creates_processes_externally:
            return None
        return make_launcher(self.process_config.launcher, self, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        process_group.set_world_ranks(self.cluster_environment, node_rank=self.node_rank, local_rank=self.local_rank,
                        num_processes=self.num_processes, num_nodes=self.num_nodes)
        module = self.lightning_module
        check_module(module, type(self).__name__)  # before any collective
        trainer = trainer_of(module)
        if self.process_config.nonfinite == "rollback" and trainer is not None and trainer.checkpoint_callback is None:
            raise ValueError(
                f"{type(self).__name__}(`nonfinite='rollback'`) rolls back to the newest checkpoint, and this Trainer "
                "writes none: add a ModelCheckpoint(every_n_train_steps=...) callback, or use nonfinite='skip'"
            )
        if self.auto_layout and self.chosen_layout is None:
            self._choose_auto_layout()
        dims = self.resolve_dims(self.world_size)
        self._parallel_dims = dims
        self._check_declared_model(with_data=True)  # before any process group
        self._process_group_backend = self._process_group_backend or process_group_backend(self.root_device)
        if self.root_device.type == "cpu" and self.process_config.tune_cpu_allocator:
            tune_cpu_allocator()
        assert self.cluster_environment is not None
        process_group.init_process_group(self.cluster_environment, self._process_group_backend, timeout=self.process_config.timeout,
                           device=self.root_device)
        self._parallel_mesh = mesh = build_mesh(dims, self.root_device.type)
        self._step_groups = StepGroups(
            data=mesh["dp_cp"].get_group(), data_ranks=dims.dp_cp, device=self.root_device,
            stages=mesh["pp"].get_group() if dims.pp_enabled else None,
            experts=dist.group.WORLD, expert_copies=dims.tp,  # tp ranks route the same tokens: counted tp times
            tensor=mesh["tp"].get_group() if dims.tp_enabled else None,
        )
        if dims.cp_enabled:
            self._context_parallel = ContextParallel(
                self._parallel_mesh["cp"], self.context_parallel_method, self.context_parallel_load_balance,
                self.context_parallel_ulysses,
            )
        rank_zero_info(f"ultrascale mesh: {dims.describe()}")
        assert self.lightning_module is not None
        attach_device_mesh(self.lightning_module, self.device_mesh)

    def _choose_auto_layout(self) -> None:
        """Apply the planner's best layout (`ultrascale.strategies.auto_layout.apply_auto_layout`)."""
        module = self.lightning_module
        chosen = apply_auto_layout(
            module, trainer_of(module), device=self.root_device, world_size=self.world_size, ranks_per_node=self.num_processes,
            precision=str(getattr(self.precision_plugin, "precision", "32-true")), degrees=self._degrees, fixed=self._auto_fixed,
            pipeline_schedule=self.pipeline_schedule, pipeline_virtual_stages=self.pipeline_virtual_stages,
            pipeline_microbatches=self.pipeline_microbatches, owner=type(self).__name__, compiled=self.compile,
            calibration=self.planner_calibration)
        if chosen is None:
            self.chosen_layout = False
            return
        self._degrees, self.zero_stage = chosen.degrees, chosen.zero_stage
        self.accumulate_unsharded_grads = chosen.accumulate_unsharded_grads
        self.pipeline_schedule, self.pipeline_virtual_stages = chosen.pipeline_schedule, chosen.pipeline_virtual_stages
        self.pipeline_microbatches, self.chosen_layout = chosen.pipeline_microbatches, chosen.row
        self.context_parallel_method, self.context_parallel_ulysses = chosen.context_parallel_method, chosen.context_parallel_ulysses
        if chosen.degrees["pp"] > 1:
            self.pipeline_layers = chosen.pipeline_layers
        self._auto_transforms = chosen.transforms or self._auto_transforms

    # ------------------------------------------------------------------ model
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Materialisation happens in `setup()`, after sharding, so no rank ever holds the full model.
        # A module that loads its weights after sharding (HFCausalLM) asks for meta itself.
        meta = self.meta_init or empty_init or prefers_meta_init(self.lightning_module)
        device = torch.device("meta") if meta else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.model
        if not model_setup.is_parallelized(module):
            self._parallelize(module)
        elif self._compiler is not None:  # parallelised by an earlier fit, whose teardown put the blocks back
            if self.async_tensor_parallel:  # the new fit's tp group (sequence parallel was checked when it was planned)
                self._enable_async_tensor_parallel(self._sequence_parallel_active is not False)
            self._compiler.compile_again(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._tensor_parallel_checked = set()  # every fit's first step, a resumed one's too
            self.reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            if self.zero_stage not in (1, 2):  # ZeRO-1/2's engine refuses them itself, for its own slices
                names = {id(p): n for n, p in module.named_parameters()}
                for optimizer in self.optimizers:
                    check_optimizer_on_slices(optimizer, names, f"{type(self).__name__} ({self.parallel_dims.describe()})")
            if self._tied_weights is not None:  # the head's copies of tied weights follow their weight, not a step
                for optimizer in self.optimizers:
                    self._tied_weights.leave_out_of(optimizer)
            if self.zero_stage in (1, 2):
                for engine in self._zero_engines:  # a second fit: the old engines' hooks must go
                    engine.detach()
                self._zero_engines = [self._make_zero_engine(optimizer) for optimizer in self.optimizers]
        self.setup_precision_plugin()
        precision = self.precision_plugin
        if isinstance(precision, UltraScalePrecision):
            tied = self._tied_weights
            precision.clip_across(self._step_groups.stages if self._step_groups is not None else None,
                                  not_counted=tied.not_counted if tied is not None else lambda: (),
                                  step_norm=self._step.take_grad_norm,
                                  engine_of=lambda optimizer: engine_for(optimizer, self._zero_engines))
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        self.checkpoint_publisher.open(fitting=trainer.state.fn == TrainerFn.FITTING)

    def _parallelize(self, module: torch.nn.Module) -> None:
        shape = model_setup.moe_shape(module)  # before any pipeline split: the whole model's routers
        checked = self.check_model(module)
        self._sequence_parallel_active = checked.sequence_parallel
        self._loss_parallel_active = checked.loss_parallel
        self._pipeline_layout = checked.pipeline[1] if checked.pipeline is not None else None
        self._check_data(sequence_parallel=checked.sequence_parallel,  # before any weight moves
                         microbatches=self._pipeline_layout.microbatches if self._pipeline_layout is not None else None)
        if self.async_tensor_parallel:
            self._enable_async_tensor_parallel(checked.sequence_parallel)
        precision = self.precision_plugin
        assert isinstance(precision, UltraScalePrecision)
        trainer = trainer_of(self.lightning_module)
        transforms = model_setup.model_transforms(trainer, self._auto_transforms, self._compiler)
        choose_budget_blocks(transforms, self.lightning_module, trainer, self, device=self.root_device,
                             world_size=self.world_size, ranks_per_node=self.num_processes,
                             precision=str(getattr(precision, "precision", "32-true")), owner=type(self).__name__)
        sharded = model_setup.shard_model(
            module, checked, self.parallel_mesh, self.parallel_dims, device=self.root_device, precision=precision,
            transforms=transforms,
            context_parallel=self._context_parallel,
            reshard_after_forward=self.reshard_after_forward, zero_stage=self.zero_stage,
            sync_module_states=self.sync_module_states, owner=type(self).__name__)
        self._step.use_routers(sharded.routers, shape)
        self._step.use_tied_weights(sharded.tied)
        self._tied_weights = sharded.tied
        self._pipeline = sharded.pipeline
        self._tensor_parallel_dropout = has_tensor_parallel_dropout(module)
        if self._compiler is not None:
            self._compiler.stats.start()

    def _enable_async_tensor_parallel(self, sequence_parallel: bool) -> None:
        """Async TP's checks (`async_tensor_parallel_problems`), then symmetric memory for the tp group, before the
        blocks compile."""
        dims, device = self.parallel_dims, self.root_device
        raise_first(async_tensor_parallel_problems(dims.tp, sequence_parallel, device.type, symmetric_memory_available(device)),
                    type(self).__name__)
        enable_symmetric_memory(self.parallel_mesh["tp"].get_group())

    def _make_zero_engine(self, optimizer: torch.optim.Optimizer) -> ZeroEngine:
        precision = self.precision_plugin
        assert isinstance(precision, UltraScalePrecision) and self.model is not None
        return model_setup.make_zero_engine(self.model, optimizer, stage=self.zero_stage, mesh=self.parallel_mesh, dims=self.parallel_dims,
                                device=self.root_device, precision=precision, bucket_mb=self.zero_bucket_mb,
                                accumulate_in_fp32=self.accumulate_grads_in_fp32, tied=self._tied_weights)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized():  # `root_device` exists only once the devices are known
            collectives.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return collectives.broadcast_object(obj, src)

    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean"
    ) -> torch.Tensor:
        """In place over `group` (default: all ranks), as Lightning's strategies do; "mean"/"avg" is a sum
        divided by the group size (gloo has no AVG)."""
        return collectives.reduce(tensor, group, reduce_op)

    # Evaluation runs forward without backward: give back the memory of the units that stay
    # gathered between forward and backward.
    @override
    def on_validation_end(self) -> None:
        if self.model is not None:
            reshard(self.model)

    on_test_end = on_predict_end = on_validation_end

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        trainer = trainer_of(self.lightning_module)
        self.checkpoint_publisher.teardown(interrupted=trainer is not None and trainer.interrupted)
        self.finish_checkpoint()
        if self._compiler is not None:
            self._compiler.restore()
        for engine in self._zero_engines:  # kept for the optimizer's state dict (a save after fit); hooks and step go
            engine.detach()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
