"""`UltraScaleStrategy`: the N-D mesh Lightning strategy every ultrascale strategy derives from.

The strategy is a thin adapter: it turns Lightning's lifecycle into calls of
`ultrascale.parallel` (mesh, FSDP2 sharding, gradient sync, clipping, DCP checkpoints).
"""

from __future__ import annotations

import atexit
import os
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, TypedDict, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel
from typing_extensions import override

import lightning.pytorch as pl
from ultrascale.models.adapters import HF_EXPERT_PARALLEL_TYPES, ModelAdapter, get_adapter
from ultrascale.parallel.checkpoint import (
    PendingSave,
    async_save_sharded_checkpoint,
    check_checkpoint_dir,
    save_sharded_checkpoint,
)
from ultrascale.parallel.context import CONTEXT_PARALLEL_METHODS, ContextLayout, ContextParallel, ContextParallelMethod
from ultrascale.parallel.device import async_checkpoint_backend, process_group_backend, tune_cpu_allocator
from ultrascale.parallel.dims import ParallelDims, ParallelMesh, build_mesh
from ultrascale.parallel.expert import (
    ROUTER_LOAD_ATTRIBUTE,
    balance_ratio,
    iter_routers,
    router_loads,
    set_aux_grad_scale,
    step_expert_load,
    update_router_bias,
)
from ultrascale.parallel.fsdp import is_fsdp_sharded, reshard, set_gradient_sync
from ultrascale.parallel.grad import global_grad_norm
from ultrascale.parallel.init import broadcast_module_state, has_meta_tensors, materialize_meta_module
from ultrascale.parallel.loss import NUM_TOKENS_KEY
from ultrascale.parallel.parallelize import parallelize
from ultrascale.parallel.resume import load_training_state
from ultrascale.parallel.pipeline import (
    PipelineLayout,
    PipelineParts,
    PipelineRunner,
    check_schedule,
    split_model,
)
from ultrascale.parallel.tensor import maybe_loss_parallel, resolve_plan
from ultrascale.parallel.transforms import ModelTransform
from ultrascale.parallel.zero import (
    ZeroEngine,
    zero_engine_for,
)
from ultrascale.strategies._lightning_compat import (
    StrategyInternals,
    attach_device_mesh,
    check_lightning_internals,
    logging_as_hook,
    optimizers_to_device,
    step_logged,
)
from ultrascale.strategies.autoresume import AUTO
from ultrascale.strategies.launcher import LauncherName, make_launcher
from ultrascale.strategies.precision import SUPPORTED_PRECISION, UltraScalePrecision
from ultrascale.strategies.step import NonFinitePolicy, StepGuard, TokenNormalizedStep

PathLike = Union[str, Path]


class ProcessKnobs(TypedDict, total=False):
    """How the processes start and talk, and what a non-finite step does: taken by every ultrascale
    strategy (see `UltraScaleStrategy`)."""

    sync_module_states: bool
    launcher: LauncherName
    process_group_backend: Optional[str]
    timeout: Optional[timedelta]
    nonfinite: NonFinitePolicy
    max_nonfinite_skips: int
    async_checkpoint: bool


class ShardingKnobs(ProcessKnobs, total=False):
    """FSDP2 (ZeRO-3) knobs, plus the process knobs: the ZeRO-3, HSDP and TP strategies take them."""

    reshard_after_forward: bool
    meta_init: bool
    accumulate_unsharded_grads: bool


def checked_knobs(owner: str, knobs: dict[str, Any], allowed: type) -> dict[str, Any]:
    """`knobs` if each is one of the TypedDict `allowed`'s keys; TypeError naming the strangers
    (a `**knobs: Unpack[...]` signature is not enforced at run time)."""
    names = allowed.__required_keys__ | allowed.__optional_keys__  # type: ignore[attr-defined]
    unknown = sorted(set(knobs) - names)
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {unknown}; it takes {sorted(names)} besides its own")
    return knobs


class UltraScaleStrategy(StrategyInternals):
    """N-D parallel training on a `DeviceMesh` with axes `pp, dp_replicate, dp_shard, cp, tp`.

    Registered as ``"ultrascale_4d"``. Any `LightningModule` works unchanged: after
    `configure_model()` the strategy finds the model's transformer blocks (through the
    model adapter, or generically as the largest ModuleList of identical children) and
    shards them with FSDP2. A module that already parallelised itself in
    `configure_model()` (its parameters are DTensors) is left as it is.

    Args:
        data_parallel_replicate: replicas of the sharded model (HSDP's replicate axis); 1 means off.
        data_parallel_shard: ranks that shard parameters, gradients and optimizer state (ZeRO-3);
            -1 means "the rest of the world size".
        context_parallel: ranks that split the sequence of every batch (ring / all-gather attention);
            1 means off. Sequence lengths must be multiples of 2 * context_parallel (times
            tensor_parallel under sequence parallel). The built-in Llama and Hugging Face
            Llama/Mistral/Qwen2/Qwen3 are supported.
        context_parallel_method: "allgather" (one all-gather of K/V per layer; backward
            reduce-scatters dK/dV) or "ring" (K/V passed around the cp ring with P2P, overlapped
            with the block in hand; no rank holds the whole sequence's K/V). Default "ring": as fast
            as "allgather" in benchmarks/cp_scaling.py, with less memory per rank.
        context_parallel_load_balance: zig-zag layout (rank r holds chunks r and 2cp-1-r of 2cp),
            so every rank does the same causal attention work. False: contiguous chunks (the
            last rank then computes about 2cp-1 times the attention of the first).
        tensor_parallel: tensor-parallel degree (Megatron column/row splits on DTensor); 1 means off.
            The model needs a TP plan: the built-in Llama has one, a Hugging Face model runs the
            `base_model_tp_plan` its config ships, any other model passes `tp_plan`. On a
            Mixture-of-Experts model every expert is split on its intermediate width (expert tensor
            parallel: the router and the tokens stay whole on every tp rank).
        pipeline_parallel: pipeline ranks; 1 means off. The model is split by layers (the
            built-in Llama and Hugging Face Llama/Mistral/Qwen2/Qwen3 know how; a module of your
            own returns `ultrascale.parallel.pipeline.PipelineParts` from a `pipeline_parts()`
            method) and the batch runs through torch's schedule in the loss call: see
            `pipeline_loss`. Parameters keep their names, so checkpoints move between degrees.
        pipeline_schedule: torch's schedule: "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
            "InterleavedZeroBubble", "ZBVZeroBubble" or "DualPipeV".
        pipeline_microbatches: micro-batches each local batch is cut into (must divide its
            sequences). None: the number of stages (pipeline_parallel x virtual stages).
        pipeline_virtual_stages: stages per rank. None: 1 for GPipe/1F1B, 2 for the others
            (the V schedules need exactly 2).
        pipeline_layers: layers per stage, in model order (pipeline_parallel x virtual stages
            entries); None: balanced, the remainder going to the first stages.
        expert_parallel: ranks that split the experts of a Mixture-of-Experts model (the built-in Llama
            with `n_experts`, Hugging Face Mixtral/Qwen2-MoE/Qwen3-MoE); 1 means off. Borrows its
            ranks from dp_shard x cp (must divide it, and the experts per layer): tokens travel to
            their experts' ranks by all-to-all. Needs zero_stage=3; not with tensor_parallel yet
            (which on its own splits every expert's width instead).
        sequence_parallel: shard norms and the residual stream on the sequence dim between
            TP regions (activations 1/tp, same communication volume). None: on where the
            model's plan supports it (built-in Llama), off otherwise.
        loss_parallel: keep the logits vocab-sharded into the cross-entropy instead of
            all-gathering (B, T, V). None: on if the LightningModule sets
            `supports_loss_parallel = True` (its loss code accepts DTensor logits, as
            `LlamaLM`'s does), off otherwise.
        tp_plan: a tensor-parallel plan for models without an adapter: module path
            (wildcards allowed) -> `ParallelStyle` or a name in
            `ultrascale.parallel.tensor.STYLE_NAMES` ("colwise", "rowwise", ...).
        zero_stage: 3 = parameters, gradients and optimizer state sharded (FSDP2);
            2 = replicated parameters, sharded gradients and optimizer state;
            1 = replicated parameters and gradients, sharded optimizer state.
            Stages 1/2 need an elementwise optimizer (AdamW, SGD, ...) and no tensor parallel.
        zero_bucket_mb: ZeRO-1/2 gradient bucket size in MiB (one reduce-scatter per bucket;
            ZeRO-2 launches each as soon as its gradients are complete). None: 100 on GPU
            (the Playbook's figure), 4 on CPU.
        accumulate_grads_in_fp32: ZeRO-1/2 with bf16 parameters: accumulate gradients in fp32
            buffers (twice the gradient memory, no bf16 rounding across micro-batches).
        reshard_after_forward: free gathered parameters after each block's forward
            (ZeRO-3, least memory; one extra all-gather in backward). False keeps them
            until backward (ZeRO-2-like memory for parameters, less communication).
        accumulate_unsharded_grads: ZeRO-3 with gradient accumulation. False: reduce-scatter every
            micro-batch into the sharded gradients (ZeRO-3's memory, 4Ψ/N bytes of fp32 gradients
            per rank; k times the reduce-scatter traffic for k micro-batches). True: skip the
            reduce-scatter on all but the last micro-batch (one per step), at the price of every
            rank holding the whole model's unsharded fp32 gradients (4Ψ/(tp·pp) bytes: 32 GB for
            an 8B model), so only for models small next to the device. Pipeline schedules always
            reduce once per step.
        meta_init: build the model on the meta device in `configure_model()` and
            materialise each rank's shard after sharding (needed for models that do not
            fit on one device; weights then come from the model's `init_weights()`).
        sync_module_states: broadcast rank 0's initial weights before sharding, so that
            ranks that initialised differently cannot train diverging replicas.
        launcher: how processes are started: "subprocess" re-runs the script per rank
            (scripts, CLI), "fork" forks the current process (pytest, notebooks; CPU only),
            "auto" picks between them. Ignored when an external launcher (torchrun,
            SLURM) started the processes.
        process_group_backend: "gloo" / "nccl"; default: nccl on CUDA, gloo on CPU.
        timeout: collective timeout; a hang becomes an error after it.
        nonfinite: what a step whose loss or global gradient norm is NaN/inf does: "stop" raises
            FloatingPointError naming the step, rank, loss and norm; "skip" drops the step (no
            optimizer update; counted, warned and logged as `skipped_steps`) up to
            `max_nonfinite_skips`, then stops; "rollback" skips it too and restores the weights and
            optimizer state of the newest complete checkpoint (the step count, LR schedule and data go
            on, so the batches since that checkpoint are skipped; logged as `rollbacks`; counted
            against `max_nonfinite_skips`); "off" does not check (saves one host sync and,
            without clipping, one all-reduce per step). Loss spikes (robust z-score > 6 over the
            last 100 steps) are warned and logged as `loss_spikes` unless "off".
        max_nonfinite_skips: how many steps "skip" / "rollback" may drop in a run before it stops.
        async_checkpoint: write checkpoints saved during `fit` in a background thread (DCP `async_save`):
            the save returns once this rank's shards are copied to host memory and training goes on while
            they are written. A checkpoint is published under its name (and found by a resume or
            `latest_checkpoint`) only once every rank has written it: at the first step after that, at the
            next save, before a load or at the end of `fit`; removals `ModelCheckpoint` asks for wait until
            then. Costs one host copy of this rank's shards while writing, and two gloo process groups.
        auto_layout: choose the layout with `ultrascale plan`'s planner when the processes start:
            the fastest predicted layout that fits this world size, device memory, model and
            batch (see `ultrascale.strategies.auto_layout`), logged on rank 0. Degrees, `zero_stage`
            and pipeline knobs left at their defaults are searched; those set are kept. Needs a
            model the planner knows (built-in Llama, Hugging Face Llama-family / MoE) and a data
            module with `seq_len` and `global_batch_size`; otherwise it says so and keeps the
            defaults (ZeRO-3 over every rank). `strategy="ultrascale_4d"` turns it on.
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
        accumulate_grads_in_fp32: bool = False,
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
        async_checkpoint: bool = False,
    ) -> None:
        check_lightning_internals()
        super().__init__()
        self._degrees = {
            "dp_replicate": data_parallel_replicate,
            "dp_shard": data_parallel_shard,
            "cp": context_parallel,
            "tp": tensor_parallel,
            "pp": pipeline_parallel,
            "ep": expert_parallel,
        }
        if expert_parallel != 1 and zero_stage != 3:
            raise NotImplementedError(
                f"{type(self).__name__}(`expert_parallel={expert_parallel}`, `zero_stage={zero_stage}`): expert parallel "
                "runs with zero_stage=3 (FSDP shards the experts over the ranks that hold the same ones); ZeRO-1/2 "
                "would replicate every expert on every data rank"
            )
        if expert_parallel != 1 and tensor_parallel != 1:
            raise NotImplementedError(
                f"{type(self).__name__}(`expert_parallel={expert_parallel}`, `tensor_parallel={tensor_parallel}`): expert "
                "parallel with tensor parallel is not implemented yet: choose one (tensor_parallel alone splits every "
                "expert's intermediate width over the tp ranks, expert_parallel splits the experts over data ranks)"
            )
        if context_parallel_method not in CONTEXT_PARALLEL_METHODS:
            raise ValueError(
                f"{type(self).__name__}(`context_parallel_method={context_parallel_method!r}`): choose one of "
                f"{CONTEXT_PARALLEL_METHODS}"
            )
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"{type(self).__name__}(`zero_stage={zero_stage!r}`): choose 1, 2 or 3")
        if zero_stage != 3 and tensor_parallel != 1:
            raise NotImplementedError(
                f"{type(self).__name__}(`zero_stage={zero_stage}`, `tensor_parallel={tensor_parallel}`): ZeRO-1/2 over "
                "tensor-parallel (DTensor) parameters is not implemented yet; use `zero_stage=3` with tensor parallel."
            )
        try:
            check_schedule(pipeline_schedule, pipeline_virtual_stages, pipeline_microbatches)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
        if pipeline_parallel != 1 and loss_parallel:
            raise ValueError(
                f"{type(self).__name__}(`loss_parallel=True`, `pipeline_parallel={pipeline_parallel}`): the last pipeline "
                "stage computes the loss on replicated logits; leave loss_parallel unset"
            )
        if zero_bucket_mb is not None and zero_bucket_mb <= 0:
            raise ValueError(f"{type(self).__name__}(`zero_bucket_mb={zero_bucket_mb}`): must be positive")
        if launcher not in ("auto", "subprocess", "fork"):
            raise ValueError(f"{type(self).__name__}(`launcher={launcher!r}`): choose 'auto', 'subprocess' or 'fork'")
        self.context_parallel_method = context_parallel_method
        self.pipeline_schedule = pipeline_schedule
        self.pipeline_microbatches = pipeline_microbatches
        self.pipeline_virtual_stages = pipeline_virtual_stages
        self.pipeline_layers = list(pipeline_layers) if pipeline_layers is not None else None
        self._pipeline: Optional[PipelineRunner] = None
        self._pipeline_layout: Optional[PipelineLayout] = None
        self._stashed_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pipeline_ran = False
        self.context_parallel_load_balance = context_parallel_load_balance
        self._context_parallel: Optional[ContextParallel] = None
        self.zero_stage = zero_stage
        self.zero_bucket_mb = zero_bucket_mb
        self.accumulate_grads_in_fp32 = accumulate_grads_in_fp32
        self._zero_engines: list[ZeroEngine] = []
        self._routers: list[torch.nn.Module] = []  # MoE routers of this rank's layers
        self._moe_shape: Optional[tuple[int, int]] = None  # (MoE layers, experts) of the whole model: same on every rank
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.tp_plan = resolve_plan(tp_plan) if tp_plan is not None else None
        self._loss_parallel_active = False
        self._sequence_parallel_active: Optional[bool] = None  # known once the TP plan is chosen
        self._token_step = TokenNormalizedStep()
        self._guard = StepGuard(nonfinite, max_nonfinite_skips)
        self._rollbacks = 0
        if not isinstance(async_checkpoint, bool):
            raise TypeError(f"{type(self).__name__}(`async_checkpoint={async_checkpoint!r}`): True or False")
        self.async_checkpoint = async_checkpoint
        self._async_open = False  # async saves only inside fit, where teardown publishes the last one
        self._pending_save: Optional[PendingSave] = None
        self._deferred_removals: list[Path] = []
        self._checkpoint_groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]] = None  # (save, poll)
        self._skip_update = False
        self._step_calls_module: dict[str, bool] = {}  # per step hook: does it call `self(...)` itself?
        self.reshard_after_forward = reshard_after_forward
        self.accumulate_unsharded_grads = accumulate_unsharded_grads
        self.meta_init = meta_init
        self.sync_module_states = sync_module_states
        self._launcher_name = launcher
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._parallel_dims: Optional[ParallelDims] = None
        self._parallel_mesh: Optional[ParallelMesh] = None
        self.num_nodes = 1
        self.auto_layout = auto_layout
        # What the user set away from the defaults stays fixed in the auto search.
        self._auto_fixed = {
            key: value for key, value, default in (
                ("dp_replicate", data_parallel_replicate, 1), ("dp_shard", data_parallel_shard, -1),
                ("cp", context_parallel, 1), ("tp", tensor_parallel, 1), ("pp", pipeline_parallel, 1),
                ("ep", expert_parallel, 1), ("zero_stage", zero_stage, 3),
                ("virtual_stages", pipeline_virtual_stages, None), ("accumulate_unsharded_grads", accumulate_unsharded_grads, False),
            ) if value != default
        }
        self._auto_transforms: list[ModelTransform] = []
        self.chosen_layout: Optional[Any] = None
        """Under `auto_layout`, the planner's row that was applied (`ultrascale.planner.PlanRow`)."""

    @classmethod
    def from_accelerate(cls, parallelism_config: Any, **knobs: Any) -> "UltraScaleStrategy":
        """The strategy for an accelerate `ParallelismConfig` (or a mapping with its field names): its
        dp_replicate / dp_shard / tp / cp sizes become the degrees, cp's communication strategy the
        context-parallel method; what ultrascale does not run (Ulysses `sp_size`, async TP) is refused.
        Other knobs (`zero_stage`, `pipeline_parallel`, ...) pass through `knobs`."""
        from ultrascale.strategies.accelerate_interop import knobs_from_accelerate

        mapped = knobs_from_accelerate(parallelism_config, owner=cls.__name__)
        clash = sorted(set(mapped) & set(knobs))
        if clash:
            raise ValueError(f"{cls.__name__}.from_accelerate: {clash} come from the ParallelismConfig; do not pass them too")
        return cls(**mapped, **knobs)

    # ------------------------------------------------------------------ layout
    def resolve_dims(self, world_size: int) -> ParallelDims:
        """The degrees of this strategy resolved for `world_size` (ValueError if they do not fit)."""
        try:
            return ParallelDims.resolve(world_size, **self._degrees)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: invalid layout for {world_size} processes: {error}") from None

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            self._parallel_dims = self.resolve_dims(self.num_nodes * self.num_processes)
        return self._parallel_dims

    @property
    def parallel_mesh(self) -> ParallelMesh:
        """All meshes of the run by axis name: `pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp`."""
        if self._parallel_mesh is None:
            raise RuntimeError("the device mesh exists only after the processes have been initialised")
        return self._parallel_mesh

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
        if precision_plugin is None or isinstance(precision_plugin, UltraScalePrecision):
            self.stored_precision_plugin = precision_plugin
            return
        name = getattr(precision_plugin, "precision", None)
        # Only Lightning's generic plugins are translated; a specialised one (double,
        # bitsandbytes, transformer-engine, a user's own) is rejected, not silently replaced.
        if type(precision_plugin) not in (Precision, MixedPrecision, HalfPrecision) or name not in SUPPORTED_PRECISION:
            raise ValueError(
                f"{type(self).__name__} supports `precision` in {SUPPORTED_PRECISION} (FSDP2 mixed precision), "
                f"got {type(precision_plugin).__name__}(precision={name!r})"
            )
        self.stored_precision_plugin = UltraScalePrecision(name)

    # ------------------------------------------------------------------ processes
    @override
    def create_launcher(self) -> Any:
        assert self.cluster_environment is not None
        # Validate the layout here, at Trainer construction, before any process is started.
        self._parallel_dims = self.resolve_dims(self.num_nodes * self.num_processes)
        if self.cluster_environment.creates_processes_externally:
            return None
        return make_launcher(self._launcher_name, self, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        trainer = _trainer_of(self.lightning_module)
        if self._guard.policy == "rollback" and trainer is not None and trainer.checkpoint_callback is None:
            raise ValueError(
                f"{type(self).__name__}(`nonfinite='rollback'`) rolls back to the newest checkpoint, and this Trainer "
                "writes none: add a ModelCheckpoint(every_n_train_steps=...) callback, or use nonfinite='skip'"
            )
        if self.auto_layout and self.chosen_layout is None:
            self._choose_auto_layout()
        dims = self.resolve_dims(self.world_size)
        self._parallel_dims = dims
        if self.sequence_parallel is not None or not dims.tp_enabled:
            # Known before the model exists: check the data module's sequence length before any process group.
            self._check_datamodule_seq_len(sequence_parallel=bool(self.sequence_parallel) and dims.tp_enabled)
        if dims.pp_enabled:
            self._check_pipeline_early()
        if dims.ep_enabled:
            self._check_experts_early()
        self._process_group_backend = self._process_group_backend or process_group_backend(self.root_device)
        if self.root_device.type == "cpu":
            tune_cpu_allocator()
        self._init_process_group()
        self._parallel_mesh = build_mesh(dims, self.root_device.type)
        if dims.cp_enabled:
            self._context_parallel = ContextParallel(
                self._parallel_mesh["cp"], self.context_parallel_method, self.context_parallel_load_balance
            )
        rank_zero_info(f"ultrascale mesh: {dims.describe()}")
        assert self.lightning_module is not None
        attach_device_mesh(self.lightning_module, self.device_mesh)

    def _choose_auto_layout(self) -> None:
        """Apply the planner's best layout (same inputs on every rank: same choice, no collective)."""
        from ultrascale.strategies.auto_layout import auto_layout_inputs, choose_layout

        name = type(self).__name__
        module = self.lightning_module
        trainer = _trainer_of(module)
        inputs, why = auto_layout_inputs(module, trainer, self.root_device, self.world_size, self.num_processes,
                                         str(getattr(self.precision_plugin, "precision", "32-true")))
        if inputs is None:
            rank_zero_warn(f"{name}(auto_layout=True): the planner cannot price this run ({why}); keeping the set "
                           f"degrees {self._degrees} (ZeRO-3 over the rest). Give the layout yourself to choose another.")
            self.chosen_layout = False
            return
        try:
            row = choose_layout(inputs, self._auto_fixed)
        except ValueError as error:
            raise ValueError(f"{name}(auto_layout=True): {error}") from None
        lay = row.layout
        self._degrees = {"dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp,
                         "pp": lay.pp, "ep": lay.ep}
        self.zero_stage = lay.zero_stage
        self.accumulate_unsharded_grads = lay.accumulate_unsharded_grads
        if lay.pp > 1:
            self.pipeline_schedule = lay.schedule or self.pipeline_schedule
            self.pipeline_virtual_stages = lay.virtual_stages
            if self.pipeline_microbatches is None:
                self.pipeline_microbatches = lay.grad_accumulation
        from ultrascale.callbacks.activation_checkpointing import ActivationCheckpointing

        if lay.recompute != "none" and not any(
                isinstance(callback, ActivationCheckpointing) for callback in (trainer.callbacks if trainer is not None else [])):
            self._auto_transforms = [ActivationCheckpointing(mode=lay.recompute)]  # its transform, not registered as a callback
        self.chosen_layout = row
        memory, step = row.memory, row.step_time
        rank_zero_info(
            f"ultrascale_4d auto layout for {inputs.describe()}: {lay.describe()} "
            f"(predicted {memory['total'] / 2**30:.2f} GiB per device, step {step['total']:.3g} s)"
        )

    def _init_process_group(self) -> None:
        if dist.is_initialized():  # an outer launcher or a previous fit created it
            return
        environment = self.cluster_environment
        assert environment is not None and self._process_group_backend is not None
        # env:// rendezvous at the address the cluster environment (torchrun, SLURM, Lightning's launcher) names.
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        store = None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            # torchrun keeps one agent store for all restart attempts and torch adds no per-attempt prefix
            # (torch 2.13 `_create_c10d_store`): a restarted rank that starts before its peers reads the
            # process-group keys of the killed attempt and dials dead addresses ("connectFullMesh failed ...
            # Connection refused", pytorch/pytorch#167288).
            store = dist.PrefixStore(
                f"ultrascale/attempt_{attempt}",
                dist.TCPStore(environment.main_address, environment.main_port, environment.world_size(),
                              is_master=False, timeout=self._timeout or default_pg_timeout),
            )
        dist.init_process_group(
            self._process_group_backend,
            store=store,
            rank=environment.global_rank(),
            world_size=environment.world_size(),
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )
        if self._process_group_backend == "nccl":
            # NCCL warns at exit about a process group that was never destroyed.
            atexit.register(_destroy_process_group)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Materialisation happens in `setup()`, after sharding, so no rank ever holds the full model.
        # A module that loads its weights after sharding (HFCausalLM) asks for meta itself.
        prefers_meta = bool(getattr(self.lightning_module, "prefers_meta_init", False))
        device = torch.device("meta") if (self.meta_init or empty_init or prefers_meta) else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.model
        if not _is_parallelized(module):
            self._parallelize(module)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            if self.zero_stage in (1, 2):
                for engine in self._zero_engines:  # a second fit: the old engines' hooks must go
                    engine.close()
                self._zero_engines = [self._make_zero_engine(optimizer) for optimizer in self.optimizers]
        self.setup_precision_plugin()
        precision = self.precision_plugin
        if isinstance(precision, UltraScalePrecision) and self.parallel_dims.pp_enabled:
            precision.norm_group = self.parallel_mesh["pp"].get_group()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        self._async_open = trainer.state.fn == TrainerFn.FITTING

    def _check_pipeline_early(self) -> None:
        """What the module's config and the data module declare, checked before any process group:
        the layout against the layer count, tied embeddings, micro-batches against the local batch.
        (The layout is checked again against the built model in `setup`.)"""
        module = self.lightning_module
        config = getattr(module, "config", None)
        if getattr(config, "tie_embeddings", False) or getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                f"{type(self).__name__}(pipeline_parallel={self.parallel_dims.pp}): {type(module).__name__} ties its input "
                "embedding to its output head, which live on the first and the last stage; untie them "
                "(`tie_embeddings=False` / `tie_word_embeddings=False`)"
            )
        declared = _declared_layers(module)
        layout = self._build_pipeline_layout(declared) if declared is not None else None
        datamodule = getattr(_trainer_of(module), "datamodule", None)
        global_batch = getattr(datamodule, "global_batch_size", None)
        if layout is not None and isinstance(global_batch, int) and global_batch % self.parallel_dims.dp == 0:
            local = global_batch // self.parallel_dims.dp
            if local % layout.microbatches:
                raise ValueError(
                    f"{type(self).__name__}: {type(datamodule).__name__}(global_batch_size={global_batch}) gives each of the "
                    f"{self.parallel_dims.dp} data-parallel ranks {local} sequences, which pipeline_microbatches="
                    f"{layout.microbatches} does not divide; pick a global batch size that is a multiple of "
                    f"{layout.microbatches * self.parallel_dims.dp}"
                )

    def check_before_launch(self) -> None:
        """The model's config against the layout in the launching process, before any rank starts, so that
        a wrong layout gives one error naming the user's class rather than one per rank (the launchers call
        it; under torchrun / SLURM every rank runs it, before its process group). The data module is not
        attached yet: what depends on it is checked on each rank in `setup_environment`."""
        module = self.lightning_module
        if module is None or self.auto_layout:  # the auto layout is chosen (and checked) on each rank
            return
        dims = self.parallel_dims
        if dims.pp_enabled:
            self._check_pipeline_early()
        if dims.ep_enabled:
            self._check_experts_early()
        if dims.tp_enabled:
            self._check_tensor_parallel_early(module)

    def _check_tensor_parallel_early(self, module: "pl.LightningModule") -> None:
        """Whole heads per rank, and a plan to split by, from what the module's config declares."""
        config = getattr(module, "config", None)
        if config is None:
            return  # a module of its own: its plan and sizes are checked on the built model in `setup`
        config = getattr(config, "text_config", None) or config
        tp, name = self.parallel_dims.tp, _class_name(module)
        heads = getattr(config, "n_heads", None) or getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "n_kv_heads", None) or getattr(config, "num_key_value_heads", None) or heads
        if isinstance(heads, int) and isinstance(kv_heads, int):
            from ultrascale.parallel.tensor import check_tp_divides

            try:
                check_tp_divides(tp, {"attention heads": heads, "key/value heads": kv_heads}, f"{name} ({type(config).__name__})")
            except ValueError as error:
                raise ValueError(f"{type(self).__name__}: {error}") from None
        model_type = getattr(config, "model_type", None)
        if model_type is not None and self.tp_plan is None and not getattr(config, "base_model_tp_plan", None):
            architecture = (getattr(config, "architectures", None) or [model_type])[0]
            raise ValueError(
                f"{type(self).__name__}(tensor_parallel={tp}): {name} is a Hugging Face {architecture} whose config ships no "
                "tensor-parallel plan (`base_model_tp_plan`); give one as `UltraScaleStrategy(tp_plan={module path: style})`"
            )

    def _check_experts_early(self) -> None:
        """Expert parallel against what the module's config declares, before any process group."""
        module = self.lightning_module
        config = getattr(module, "config", None)
        if config is None:
            return  # a module of its own: checked against the built model in `setup`
        ep = self.parallel_dims.ep
        name = f"{type(module).__name__} ({type(config).__name__})"
        model_type = getattr(config, "model_type", None)
        if model_type is not None and model_type not in HF_EXPERT_PARALLEL_TYPES:
            raise ValueError(
                f"{type(self).__name__}(expert_parallel={ep}): {name} is a Hugging Face '{model_type}' model; ultrascale "
                f"splits the experts of Hugging Face {'/'.join(HF_EXPERT_PARALLEL_TYPES)} and of the built-in MoE Llama"
            )
        experts = _declared_experts(config)
        if experts is not None:
            ModelAdapter(name=name, blocks=(), num_experts=experts, enable_expert_parallel=lambda ep: None).check_expert_parallel(ep)

    def _build_pipeline_layout(self, n_layers: int) -> PipelineLayout:
        try:
            self._pipeline_layout = PipelineLayout.build(
                n_layers=n_layers,
                pp=self.parallel_dims.pp,
                schedule=self.pipeline_schedule,
                virtual_stages=self.pipeline_virtual_stages,
                microbatches=self.pipeline_microbatches,
                layers_per_stage=self.pipeline_layers,
            )
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
        return self._pipeline_layout

    def check_model(self, module: torch.nn.Module) -> "ModelChecks":
        """What `setup` checks on the built model (real or meta) before any weight is communicated, for the
        resolved degrees: context / expert / pipeline / tensor parallel support and sizes, the pipeline's
        stages and schedule, the TP plan (and so sequence and loss parallel). `ultrascale plan --recipe`
        runs the same on a meta-built model. ValueError naming the knob and the model on the first problem."""
        adapter = get_adapter(module)
        dims = self.parallel_dims
        if dims.cp_enabled:
            adapter.check_context_parallel(dims.cp)
        if dims.ep_enabled:
            adapter.check_expert_parallel(dims.ep)
        pipeline = None
        if dims.pp_enabled:
            parts = self._pipeline_parts(module, adapter)
            pipeline = (parts, self._build_pipeline_layout(len(parts.layer_list())))
        tp_plan = self._tensor_parallel_plan(module, adapter) if dims.tp_enabled else None
        return ModelChecks(adapter, pipeline, tp_plan)

    def _pipeline_parts(self, module: torch.nn.Module, adapter: ModelAdapter) -> PipelineParts:
        own = getattr(module, "pipeline_parts", None)
        parts = own() if callable(own) else (adapter.pipeline_parts() if adapter.pipeline_parts is not None else None)
        if parts is None:
            raise ValueError(
                f"pipeline parallel has no stage split for {adapter.name}: ultrascale splits the built-in Llama and "
                "Hugging Face Llama/Mistral/Qwen2/Qwen3 models. For a model of your own, define `pipeline_parts(self)` on "
                "the LightningModule returning `ultrascale.parallel.pipeline.PipelineParts(root=..., embed=..., "
                "layers=..., norm=..., head=..., run=..., loss=...)` and compute the loss with "
                "`self.trainer.strategy.pipeline_loss(batch)` in the steps"
            )
        parts.check(adapter.name)
        return parts

    def _parallelize(self, module: torch.nn.Module) -> None:
        dims = self.parallel_dims
        loads = router_loads(module)  # before any pipeline split: the whole model's routers
        self._moe_shape = (1 + max(load.layer for load in loads), max(load.n_experts for load in loads)) if loads else None
        checked = self.check_model(module)
        adapter, pipeline, tp_plan = checked.adapter, checked.pipeline, checked.tp_plan
        self._sequence_parallel_active = checked.sequence_parallel
        self._check_datamodule_seq_len(sequence_parallel=self._sequence_parallel_active)  # before any weight moves
        if not adapter.blocks:
            rank_zero_info(
                f"{type(self).__name__}: no repeated blocks (a ModuleList of identical layers) found in "
                f"{type(module).__name__}; sharding it as one FSDP unit per top-level child"
            )
        if pipeline is not None:  # before weights move: the parts other ranks hold never reach this device
            split_model(*pipeline, self.parallel_mesh["pp"].get_local_rank())
        meta = has_meta_tensors(module)
        if not meta:
            # Real weights move to this rank's device first: NCCL broadcasts only device tensors,
            # and sharding then happens where the shards will live.
            module.to(self.root_device)
        if self.sync_module_states and not meta:
            if dims.pp_enabled:  # each stage's ranks agree on that stage's weights
                stage_group = self.parallel_mesh["stage"].get_group()
                broadcast_module_state(module, src=dist.get_global_rank(stage_group, 0), group=stage_group)
            else:
                broadcast_module_state(module)
        precision = self.precision_plugin
        assert isinstance(precision, UltraScalePrecision)
        precision.convert_module(module)
        stages = parallelize(
            module,
            self.parallel_mesh,
            blocks=adapter.blocks,
            tp_plan=tp_plan,
            transforms=self._model_transforms(),
            mp_policy=precision.mixed_precision_policy(),
            reshard_after_forward=self.reshard_after_forward,
            shard_parameters=self.zero_stage == 3,
            context_parallel=self._context_parallel,
            enable_context_parallel=adapter.enable_context_parallel,
            pipeline=pipeline,
            enable_expert_parallel=adapter.enable_expert_parallel,
            experts=adapter.experts,
        )
        self._routers = list(iter_routers(module))
        if meta:
            materialize_meta_module(module, self.root_device)
        if pipeline is not None:
            self._pipeline = PipelineRunner(
                stages, pipeline[1], self.parallel_mesh["pp"].get_group(), self.root_device, loss=pipeline[0].loss
            )
            rank_zero_info(f"pipeline parallel: {pipeline[1].describe()}")

    def _make_zero_engine(self, optimizer: torch.optim.Optimizer) -> ZeroEngine:
        precision = self.precision_plugin
        assert isinstance(precision, UltraScalePrecision) and self.model is not None
        bucket_mb = self.zero_bucket_mb or (100.0 if self.root_device.type == "cuda" else 4.0)
        return ZeroEngine(
            self.model,
            optimizer,
            stage=self.zero_stage,
            dp_mesh=self.parallel_mesh.fsdp,
            bucket_bytes=int(bucket_mb * 2**20),
            # bf16-mixed: bf16 weights for compute, the optimizer keeps fp32 masters of its slices.
            compute_dtype=torch.bfloat16 if precision.precision == "bf16-mixed" else None,
            accumulate_dtype=torch.float32 if self.accumulate_grads_in_fp32 else None,
            norm_group=self.parallel_mesh["pp"].get_group() if self.parallel_dims.pp_enabled else None,
        )

    def _model_transforms(self) -> list[ModelTransform]:
        """Callbacks that rewrite the model (activation checkpointing, FP8) run inside `parallelize`."""
        trainer = _trainer_of(self.lightning_module)
        callbacks = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, ModelTransform)]
        return [*self._auto_transforms, *callbacks]

    def _tensor_parallel_plan(self, module: torch.nn.Module, adapter: ModelAdapter) -> dict[str, Any]:
        """Pick the plan (checked before any weight is communicated) and decide loss parallel."""
        wants_loss_parallel = self.loss_parallel
        if wants_loss_parallel is None:
            # Under PP the last stage's logits leave the stage module: they must be plain tensors.
            wants_loss_parallel = bool(getattr(module, "supports_loss_parallel", False)) and not self.parallel_dims.pp_enabled
        if self.tp_plan is not None:
            self._loss_parallel_active = bool(self.loss_parallel)
            return self.tp_plan
        sequence_parallel = self.sequence_parallel
        if sequence_parallel is None:
            sequence_parallel = adapter.supports_sequence_parallel
        adapter.check_tensor_parallel(self.parallel_dims.tp, sequence_parallel=sequence_parallel)
        assert adapter.tp_plan is not None
        self._loss_parallel_active = wants_loss_parallel
        rank_zero_info(
            f"tensor parallel {self.parallel_dims.tp} on {adapter.name}: sequence_parallel={sequence_parallel}, "
            f"loss_parallel={wants_loss_parallel}"
        )
        return adapter.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=wants_loss_parallel)

    # ------------------------------------------------------------------ pipeline parallel
    @property
    def pipeline_active(self) -> bool:
        """Whether the model runs as a pipeline: steps then get their loss from `pipeline_loss`."""
        return self._pipeline is not None

    @property
    def pipeline_layout(self) -> Optional[PipelineLayout]:
        """Under pipeline parallel, the stages' layers, the schedule and its micro-batches; None otherwise."""
        return self._pipeline_layout if self._pipeline is not None else None

    def pipeline_loss(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the batch ``{"input_ids", "labels"[, "position_ids"]}`` through the pipeline and return
        ``{"loss": mean over its valid tokens, "num_tokens": n}``, the same on every pipeline rank.

        In training (module in train mode, gradients enabled) this is the whole forward and backward
        of the batch: torch's schedule runs every micro-batch, the backward of each on its token-loss
        sum / accumulate_grad_batches; the returned loss carries no graph, and the gradients wait
        for Lightning's backward call (which then runs no autograd). Elsewhere it is forward only.
        """
        if self._pipeline is None:
            raise RuntimeError(f"{type(self).__name__}.pipeline_loss: pipeline parallel is not active (pipeline_parallel=1)")
        module = self.lightning_module
        assert module is not None
        train = module.training and torch.is_grad_enabled()
        divisor = module.trainer.accumulate_grad_batches if train else 1
        earlier = self._take_gradients() if train else []
        # ZeRO-1/2 reduce once per step under PP: each micro-batch's backward is its own autograd call,
        # and the zero-bubble schedules assign weight gradients, which no hook sees, after it.
        syncs = [engine.require_backward_grad_sync for engine in self._zero_engines]
        for engine in self._zero_engines:
            engine.require_backward_grad_sync = False
        try:
            loss_sum, num_tokens = self._pipeline.step(
                batch["input_ids"], batch["labels"], batch.get("position_ids"), train=train, loss_scale=1.0 / divisor
            )
        finally:
            for engine, sync in zip(self._zero_engines, syncs):
                engine.require_backward_grad_sync = sync
        if train:
            for engine in self._zero_engines:
                engine.absorb_assigned_grads()
            # What autograd would do in Lightning's backward: this batch's gradients are added to whatever
            # the parameters hold then (nothing, if Lightning zeroes them between the step and backward).
            self._stashed_grads = self._take_gradients()
            for p, grad in earlier:
                p.grad = grad
            self._pipeline_ran = True
        return {"loss": (loss_sum / num_tokens.clamp(min=1)).float(), NUM_TOKENS_KEY: num_tokens}

    def _take_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every parameter's gradient, which the parameter then no longer holds. The schedule computes
        gradients inside `training_step`, but Lightning zeroes them between `training_step` and
        `backward` (on an accumulation window's first micro-batch): they wait aside until `backward`."""
        assert self.model is not None
        taken = []
        for p in self.model.parameters():
            if p.grad is not None:
                taken.append((p, p.grad))
                p.grad = None
        return taken

    def _restore_gradients(self) -> None:
        for p, grad in self._stashed_grads:
            if p.grad is None:
                p.grad = grad
            elif p.grad is not grad:
                p.grad += grad
        self._stashed_grads = []

    # ------------------------------------------------------------------ the step
    # Loss parallel must be active around the loss (inside the step) and around backward.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._pipeline_ran = False
        if self._moe_shape is not None:
            # MoE balance terms join backward on the scale of the loss sum (`TokenNormalizedStep`): 1 / k.
            set_aux_grad_scale(self._routers, 1.0 / self.lightning_module.trainer.accumulate_grad_batches)
        with maybe_loss_parallel(self._loss_parallel_active):
            output = self._call_step("training_step", *args, **kwargs)
        module = self.lightning_module
        if self._pipeline is not None and output is not None and not self._pipeline_ran:
            raise RuntimeError(
                f"{_class_name(module)}.training_step did not run the pipeline: under pipeline parallel the model is split "
                "over ranks, so the step must get its loss from `self.trainer.strategy.pipeline_loss(batch)` (ultrascale's "
                "CausalLMModule does) instead of calling the model"
            )
        if module is not None and not module.automatic_optimization and isinstance(output, Mapping) and NUM_TOKENS_KEY in output:
            raise ValueError(
                f"{type(self).__name__}: `{NUM_TOKENS_KEY}` in a training_step output is understood with automatic "
                "optimization only; under manual optimization normalise the loss yourself before `manual_backward`"
            )
        self._token_step.observe(output)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with maybe_loss_parallel(self._loss_parallel_active):
            return self._call_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with maybe_loss_parallel(self._loss_parallel_active):
            return self._call_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: predict under pipeline parallel is not implemented (the logits exist on the last "
                "stage only); predict with pipeline_parallel=1 from the same checkpoint"
            )
        return self._call_step("predict_step", *args, **kwargs)

    def _call_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `LightningModule.<name>` inside the module's own `__call__` when it is FSDP's root unit,
        so the root's hooks (all-gather of embeddings/norm/head, the backward's final reduction)
        fire whether the step calls `self(...)` or `self.model(...)` (Lightning's forward redirection)."""
        module = self.lightning_module
        assert module is not None
        context = {
            "training_step": self.precision_plugin.train_step_context,
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }[name]
        with context():
            if not isinstance(module, FSDPModule) or self._step_calls_module.get(name, False):
                return getattr(module, name)(*args, **kwargs)
            if name in self._step_calls_module:  # known: the step reaches the model another way
                return self.call_inside_module(module, name, *args, **kwargs)
            # First call: a step that calls `self(...)` enters the root itself. Entering it around the
            # step as well would make the outer exit reshard the root (one more all-gather per step),
            # so such steps are called directly from then on.
            entries: list[int] = []
            handle = module.register_forward_pre_hook(lambda *_: entries.append(1))
            try:
                output = self.call_inside_module(module, name, *args, **kwargs)
            finally:
                handle.remove()
            self._step_calls_module[name] = len(entries) > 1
            return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline is not None:
            # The schedule ran forward and backward inside `pipeline_loss`; the module's backward hooks still run.
            module = self.lightning_module
            assert module is not None
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._restore_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss
        if self._routers and self._token_step.micro_batch_tokens is None:
            # A plain (mean) loss: the balance terms become a mean over this micro-batch's routed tokens.
            tokens = max(1, getattr(self._routers[0], ROUTER_LOAD_ATTRIBUTE).tokens)
            set_aux_grad_scale(self._routers, 1.0 / (self.lightning_module.trainer.accumulate_grad_batches * tokens))
        closure_loss = self._token_step.backward_loss(closure_loss)
        with maybe_loss_parallel(self._loss_parallel_active):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Any,
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """One step, in this order: the last micro-batch's forward and backward (Lightning's closure),
        the step's gradient reduction finished (ZeRO-1/2) and normalised once, then Lightning's
        `on_before_optimizer_step` hooks and clipping, then the optimizer."""

        def closure_then_normalise() -> Any:
            result = closure()
            self._finish_gradients(optimizer)
            return result

        if self._guard.policy not in ("skip", "rollback"):
            return super().optimizer_step(optimizer, closure_then_normalise, model, **kwargs)
        # "skip" and "rollback" decide before the optimizer runs: the closure runs first, then the step (or none).
        result = closure_then_normalise()
        if not self._skip_update:
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        self._skip_update = False
        self.precision_plugin.step_grad_norm = None  # type: ignore[attr-defined]
        engine = zero_engine_for(optimizer)
        if engine is not None:
            engine.discard_step()
        optimizer.zero_grad(set_to_none=True)
        if self._guard.policy == "rollback":
            self._roll_back()
        return result

    def _roll_back(self) -> None:
        """`nonfinite="rollback"`: weights and optimizer state back to the newest complete checkpoint.

        The step counter, the learning-rate schedule and the data go on: the batches between that
        checkpoint and the bad step, the bad one included, are not seen again (PaLM's remedy for
        loss spikes: restart from an earlier checkpoint and skip the batches that led there)."""
        from ultrascale.strategies.autoresume import latest_checkpoint

        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        found = latest_checkpoint(trainer)
        chosen = self.broadcast(found or "")  # rank 0's view of the folder decides for every rank
        step = trainer.global_step
        if not chosen:
            raise FloatingPointError(
                f"non-finite step {step} (rank {self.global_rank}) and nonfinite='rollback', but there is no complete "
                "checkpoint to roll back to yet; save checkpoints (ModelCheckpoint(every_n_train_steps=...)) or use "
                "nonfinite='skip'"
            )
        meta = self.load_checkpoint(chosen)
        restored = int(meta.get("global_step", -1)) if isinstance(meta, Mapping) else -1
        self._rollbacks += 1
        rank_zero_warn(
            f"ultrascale: non-finite step {step}: weights and optimizer state rolled back to {chosen} (step {restored}); "
            f"the batches since then are skipped ({self._guard.skipped} of at most {self._guard.max_skips}; "
            "nonfinite='rollback')"
        )
        with logging_as_hook(module, "on_before_optimizer_step"):
            module.log("rollbacks", float(self._rollbacks), sync_dist=False)

    def _finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        engine = zero_engine_for(optimizer)
        if engine is not None:
            engine.reduce_gradients()
            grads: list[Optional[torch.Tensor]] = list(engine.grad_shards())
        else:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        module = self.lightning_module
        assert module is not None
        automatic = module.automatic_optimization
        loss = self._token_step.finish(
            grads,
            group=self.parallel_mesh["dp_cp"].get_group(),
            data_ranks=self.parallel_dims.dp_cp,
            loss_divisor=module.trainer.accumulate_grad_batches if automatic else 1,
        )
        self._guard_step(module, optimizer, grads, loss)
        if self._moe_shape is not None:  # every rank joins the all-reduce, also a pipeline stage without MoE layers
            self._expert_load_step(module)
        if loss is not None:
            if step_logged(module.trainer, "training_step.train_loss"):
                raise ValueError(
                    f"{_class_name(module)}.training_step logs `train_loss` and returns `{NUM_TOKENS_KEY}`: "
                    f"{type(self).__name__} logs the exact `train_loss` of every optimizer step (the global token "
                    "mean) itself; remove the `self.log('train_loss', ...)` or log your value under another name"
                )
            # Lightning allows per-step logging from `on_before_optimizer_step`, which runs right
            # after this; the value is already global, so no sync.
            with logging_as_hook(module, "on_before_optimizer_step"):
                module.log("train_loss", loss, prog_bar=True, sync_dist=False)

    def _expert_load_step(self, module: "pl.LightningModule") -> None:
        """MoE: the step's token counts per layer and expert over all ranks (one all-reduce), the
        aux-loss-free bias update from them, and the logged load: `moe/aux_loss` (the balance terms
        added to the loss, over the step's valid tokens), `moe/balance` (max / mean tokens per expert,
        averaged over layers; 1 = even), `moe/expert_tokens/<i>` (summed over layers), `moe/dropped`."""
        assert self._moe_shape is not None
        counts, aux, dropped = step_expert_load(
            [getattr(r, ROUTER_LOAD_ATTRIBUTE) for r in self._routers], *self._moe_shape, self.root_device,
            group=dist.group.WORLD, copies=self.parallel_dims.tp,  # tp ranks route the same tokens: counted tp times
        )
        update_router_bias(self._routers, counts)
        moe_layers = counts[counts.sum(-1) > 0]
        metrics = {
            "moe/aux_loss": aux / self._token_step.step_tokens.clamp(min=1),
            "moe/balance": balance_ratio(moe_layers).mean() if len(moe_layers) else counts.new_zeros(()),
            "moe/dropped": dropped,
            **{f"moe/expert_tokens/{i}": count for i, count in enumerate(counts.sum(0))},
        }
        with logging_as_hook(module, "on_before_optimizer_step"):
            for name, value in metrics.items():
                module.log(name, value.float(), sync_dist=False, prog_bar=name == "moe/balance")

    def _guard_step(self, module: "pl.LightningModule", optimizer: torch.optim.Optimizer,
                    grads: list[Optional[torch.Tensor]], loss: Optional[torch.Tensor]) -> None:
        """Non-finite loss / global gradient norm on this step: stop or skip (`nonfinite`); spikes noted."""
        if self._guard.policy == "off":
            return
        engine = zero_engine_for(optimizer)
        present = [g for g in grads if g is not None]
        if engine is not None:
            norm = engine.grad_norm()
        else:
            pp_group = self.parallel_mesh["pp"].get_group() if self.parallel_dims.pp_enabled else None
            norm = global_grad_norm(present, across=pp_group) if present or pp_group else torch.zeros((), device=self.root_device)
        precision = self.precision_plugin
        if isinstance(precision, UltraScalePrecision):
            precision.step_grad_norm = norm  # clipping reuses it: no second reduction
        numbers = torch.stack([norm.float(), (loss if loss is not None else norm).float().to(norm.device)]).tolist()
        grad_norm, loss_value = numbers[0], (numbers[1] if loss is not None else None)
        step = module.trainer.global_step
        with logging_as_hook(module, "on_before_optimizer_step"):
            if not self._guard.check(step=step, rank=self.global_rank, loss=loss_value, grad_norm=grad_norm):
                self._skip_update = True
                rank_zero_warn(
                    f"ultrascale: skipping step {step}: loss {loss_value}, global gradient norm {grad_norm} "
                    f"({self._guard.skipped} of at most {self._guard.max_skips} skipped; nonfinite='{self._guard.policy}')"
                )
                module.log("skipped_steps", float(self._guard.skipped), sync_dist=False)
            z = self._guard.spike(loss_value)
            if z is not None:
                rank_zero_warn(f"ultrascale: loss spike at step {step}: loss {loss_value:.4g}, robust z-score {z:.1f}")
                module.log("loss_spikes", float(self._guard.spikes), sync_dist=False)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, check its sequence length against the layout and, under context parallel,
        cut it to this rank's tokens: every step and callback (MFU, ...) then sees the local batch."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        tokens = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            self.parallel_dims.check_seq_len(tokens.shape[1], sequence_parallel=bool(self._sequence_parallel_active))
        if self._context_parallel is not None:
            batch = self._context_parallel.shard_batch(batch)
        return batch

    def _check_datamodule_seq_len(self, *, sequence_parallel: bool) -> None:
        trainer = _trainer_of(self.lightning_module)
        datamodule = getattr(trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        if isinstance(seq_len, int):
            where = f"{type(datamodule).__name__}(seq_len={seq_len})"
            self.parallel_dims.check_seq_len(seq_len, sequence_parallel=sequence_parallel, where=where)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean"
    ) -> torch.Tensor:
        """In place over `group` (default: all ranks), as Lightning's strategies do; "mean"/"avg" is a sum
        divided by the group size (gloo has no AVG)."""
        if isinstance(tensor, DTensor):  # e.g. a loss computed under loss parallel
            tensor = tensor.full_tensor()
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if reduce_op is None or mean:
            op = dist.ReduceOp.SUM
        else:
            op = getattr(dist.ReduceOp, reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if not mean:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: ZeRO-1/2 engines defer their reduction;
        FSDP skips its reduce-scatter only under `accumulate_unsharded_grads` (Lightning's own
        implementation only knows DDP's `no_sync`).

        FSDP2 without gradient sync accumulates each parameter's *unsharded* gradient until the
        last micro-batch, so by default FSDP keeps reducing every micro-batch into its shards:
        ZeRO-3's memory is the point of ZeRO-3.
        """
        module = self.model
        fsdp = module is not None and is_fsdp_sharded(module) and self.accumulate_unsharded_grads
        if fsdp:
            set_gradient_sync(module, False)
        for engine in self._zero_engines:
            engine.require_backward_grad_sync = False
        try:
            yield
        finally:
            if fsdp:
                set_gradient_sync(module, True)
            for engine in self._zero_engines:
                engine.require_backward_grad_sync = True

    # Evaluation runs forward without backward: give back the memory of the units that stay
    # gathered between forward and backward.
    @override
    def on_validation_end(self) -> None:
        if self.model is not None:
            reshard(self.model)

    @override
    def on_test_end(self) -> None:
        self.on_validation_end()

    @override
    def on_predict_end(self) -> None:
        self.on_validation_end()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        reshard(self.model)  # a checkpoint written from on_validation_end runs before the strategy hook
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        engine = zero_engine_for(optimizer)
        if engine is not None:
            return engine.sharded_state_dict()
        return get_optimizer_state_dict(self.model, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Model state is loaded (and resharded) by DCP in `load_checkpoint`.
        pass

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Optimizer state is loaded (and resharded) by DCP in `load_checkpoint`.
        pass

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(`storage_options=...`) is not supported")
        path = Path(self.broadcast(str(filepath)))
        tensors = {
            "state_dict": checkpoint.pop("state_dict"),
            **{f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))},
        }
        checkpoint["ultrascale"] = {
            "parallel_dims": self.parallel_dims.__dict__,
            "num_optimizers": len(tensors) - 1,
            "zero_stage": self.zero_stage,
        }
        self.finish_checkpoint()  # one save in flight at a time: DCP's background collectives share one group
        if self.async_checkpoint and self._async_open:
            if self._checkpoint_groups is None:
                backend = async_checkpoint_backend()
                self._checkpoint_groups = (dist.new_group(backend=backend), dist.new_group(backend=backend))
            self._pending_save = async_save_sharded_checkpoint(tensors, checkpoint, path, group=self._checkpoint_groups[0])
        else:
            save_sharded_checkpoint(tensors, checkpoint, path)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Publish a finished asynchronous save at the next step, not at the next save: a job killed in
        # between then resumes from it rather than from the one before.
        if self._pending_save is not None and self._checkpoint_groups is not None:
            if self._pending_save.done_everywhere(self._checkpoint_groups[1]):
                self.finish_checkpoint()

    def finish_checkpoint(self) -> Optional[Path]:
        """Publish the asynchronous save in flight, once every rank has written its shards (then apply the
        removals that waited for it); returns its path, or None if none was in flight. Every rank calls it."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return None
        removals, self._deferred_removals = self._deferred_removals, []
        path = pending.finish()
        for removal in removals:
            self.remove_checkpoint(removal)
        return path

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a sharded checkpoint, resharded to this run's layout: any world size, ZeRO family,
        TP / CP layout or pipeline degree (`ultrascale.parallel.resume.load_training_state`)."""
        if str(checkpoint_path) == AUTO:  # every rank gets the same value: all raise, before any collective
            raise ValueError(
                f"{type(self).__name__}: `ckpt_path='auto'` is resolved by the `ultrascale` CLI; with the Trainer API pass "
                "`ckpt_path=ultrascale.latest_checkpoint(trainer)` (None, a fresh start, when there is no checkpoint yet)"
            )
        self.finish_checkpoint()
        chosen = self.broadcast(str(checkpoint_path))
        if chosen != str(checkpoint_path):
            warnings.warn(
                f"rank {self.global_rank} was asked to resume from {checkpoint_path}, rank 0 from {chosen}: every rank "
                f"loads {chosen}. Do the ranks see the same checkpoint folder?"
            )
        path = check_checkpoint_dir(chosen)
        assert self.model is not None and self.lightning_module is not None
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        return load_training_state(
            path, self.model, optimizers, strict=self.lightning_module.strict_loading, zero_stage=self.zero_stage
        )

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        if self._pending_save is not None:
            # ModelCheckpoint drops the previous top-k / last checkpoint right after saving the next one; while
            # that one is still being written, the previous one is the newest complete checkpoint: kept until then.
            self._deferred_removals.append(Path(filepath))
            return
        if self.is_global_zero:
            import shutil

            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self._async_open = False
        trainer = _trainer_of(self.lightning_module)
        if self._pending_save is not None and trainer is not None and trainer.interrupted:
            # A failed or killed peer would never join the collectives of publishing: leave the write unpublished
            # (the previous checkpoint stays the newest; the next save in the folder removes the leftover).
            rank_zero_warn(f"ultrascale: the asynchronous save of {self._pending_save.path} was not published: "
                           "the run was interrupted while it was being written")
            self._pending_save, self._deferred_removals = None, []
        self.finish_checkpoint()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _declared_layers(module: Optional["pl.LightningModule"]) -> Optional[int]:
    """The layer count a module's config declares before the model is built (`LlamaLM.config.n_layers`,
    `HFCausalLM.config.num_hidden_layers`), so a pipeline layout is checked before any process group."""
    config = getattr(module, "config", None)
    for name in ("n_layers", "num_hidden_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class ModelChecks:
    """What `UltraScaleStrategy.check_model` found: the model's adapter, the pipeline split (parts and
    layout) under pp, the TP plan under tp."""

    adapter: ModelAdapter
    pipeline: Optional[tuple[PipelineParts, PipelineLayout]]
    tp_plan: Optional[dict[str, Any]]

    @property
    def sequence_parallel(self) -> bool:
        """Whether the TP plan shards the sequence between blocks."""
        return self.tp_plan is not None and any(isinstance(style, SequenceParallel) for style in self.tp_plan.values())


def _declared_experts(config: Any) -> Optional[int]:
    """Routed experts per layer a module's config declares (`LlamaConfig.n_experts`, HF `num_local_experts` /
    `num_experts`); None if it declares none of them."""
    for name in ("n_experts", "num_local_experts", "num_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _trainer_of(module: Optional["pl.LightningModule"]) -> Optional["pl.Trainer"]:
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # not attached to a Trainer
        return None


def _class_name(module: torch.nn.Module) -> str:
    """The user's class name, also after `fully_shard` turned `LlamaLM` into `FSDPLlamaLM`."""
    name = type(module).__name__
    return name[len("FSDP"):] if isinstance(module, FSDPModule) and name.startswith("FSDP") else name


def _is_parallelized(module: torch.nn.Module) -> bool:
    return is_fsdp_sharded(module) or any(isinstance(p, DTensor) for p in module.parameters())

