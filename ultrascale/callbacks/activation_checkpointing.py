"""Activation checkpointing: recompute parts of the forward in backward instead of storing them.

Policies are small objects with one overridable hook each (the shape of torchtitan's
`FullAC` / `SelectiveAC.get_save_ops`); `ActivationCheckpointing` is the Lightning
callback that picks one from its `mode` and applies it through the model adapter's block
list, before FSDP sharding.

Every checkpointed region is wrapped with torch's `checkpoint_wrapper` (non-reentrant
`torch.utils.checkpoint`) and put back in its parent's place. The wrapper adds
`_checkpoint_wrapped_module.` to parameter *names*, but strips it from `state_dict()`
keys and from DCP's fully qualified names, so checkpoints saved with and without AC are
interchangeable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ultrascale.callbacks._common import ModelTransformCallback

__all__ = [
    "AC_MODES",
    "ACPolicy",
    "ActivationCheckpointing",
    "AttentionAC",
    "BlockModesAC",
    "EveryKAC",
    "FullAC",
    "RecomputeSummary",
    "SelectiveAC",
    "apply_ac",
]

ACMode = Literal["full", "every_k", "selective", "attention"]
AC_MODES: tuple[str, ...] = ("full", "every_k", "selective", "attention")

# Names of a block's self-attention submodule in the built-in Llama and in Hugging Face
# decoder layers (Llama/Mistral/Qwen: `self_attn`; GPT-2: `attn`; Falcon/Bloom: `self_attention`).
ATTENTION_NAMES: tuple[str, ...] = ("attention", "self_attn", "attn", "self_attention")


def _flash_attn_ops() -> set[Any]:
    """flash-attn 2's forward ops (its torch custom ops, registered when the package is imported), where it is
    installed: the kernel `attention_backend` picks on CUDA in bf16/fp16, whose output must be kept like SDPA's."""
    from ultrascale.parallel.device import flash_attn_installed

    if not flash_attn_installed():
        return set()
    import flash_attn  # noqa: F401  (registers torch.ops.flash_attn)

    namespace = getattr(torch.ops, "flash_attn", None)
    return {getattr(namespace, name).default for name in ("_flash_attn_forward", "_flash_attn_varlen_forward")
            if namespace is not None and hasattr(namespace, name)}


def _aten_ops(*names: str) -> set[Any]:
    """The aten overloads among `names` that this torch build has (SDPA variants differ per build)."""
    ops = set()
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is not None and hasattr(packet, overload or "default"):
            ops.add(getattr(packet, overload or "default"))
    return ops


@dataclass(frozen=True)
class RecomputeSummary:
    """What the checkpointed regions re-run in backward, for the HFU count (see `estimate.recompute_flops_per_token`)."""

    regions: int
    """Number of wrapped regions."""
    matmul_params: int
    """Matmul weights inside regions whose matmuls are recomputed (0 under selective AC)."""
    attention_layers: int
    """Attention cores inside regions whose attention is recomputed (0 under selective AC)."""


class ACPolicy:
    """Base policy: which region of each block to checkpoint, and how to recompute it.

    `select(index, block)` returns the module to checkpoint (the block, one of its
    submodules) or None; `context_fn()` returns torch's checkpoint `context_fn` (None =
    recompute everything in the region). Subclasses override exactly one of them.
    """

    recomputes_matmuls: bool = True
    """Whether the regions' matmuls and attention run again in backward (False for selective AC)."""

    def select(self, index: int, block: nn.Module) -> Optional[nn.Module]:
        return block

    def context_fn(self) -> Optional[Callable[[], Any]]:
        return None

    def policy_of(self, index: int) -> "ACPolicy":
        """The policy of block `index` (itself; `BlockModesAC` gives each block its own)."""
        return self


class FullAC(ACPolicy):
    """Checkpoint every block whole: only each block's input is kept; backward re-runs its forward."""


class EveryKAC(ACPolicy):
    """Checkpoint the k-th, 2k-th, ... block (1-based), keeping the others' activations.

    The memory/compute trade-off between none and full (Playbook "activation
    recomputation"; YaFSDP checkpoints a fraction of the layers the same way).
    """

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"EveryKAC: `k={k!r}` must be an integer >= 1 (1 = every block, 2 = every second block, ...)")
        self.k = k

    def select(self, index: int, block: nn.Module) -> Optional[nn.Module]:
        return block if (index + 1) % self.k == 0 else None


class AttentionAC(ACPolicy):
    """Checkpoint only each block's self-attention submodule (projections, RoPE and the attention core).

    The MLP keeps its activations. The submodule is found by `attention_name` or, if None,
    the first child named one of `ATTENTION_NAMES`.
    """

    def __init__(self, attention_name: Optional[str] = None) -> None:
        self.attention_name = attention_name

    def select(self, index: int, block: nn.Module) -> Optional[nn.Module]:
        names = (self.attention_name,) if self.attention_name else ATTENTION_NAMES
        for name in names:
            sub = block.get_submodule(name) if _has_submodule(block, name) else None
            if sub is not None:
                return sub
        raise ValueError(
            f"ActivationCheckpointing(mode='attention'): block {index} ({type(block).__name__}) has no attention "
            f"submodule named {' / '.join(names)}; set `attention_module=` to its path inside the block "
            f"(children: {', '.join(n for n, _ in block.named_children())})"
        )


class SelectiveAC(ACPolicy):
    """Op-level AC: save the outputs of the expensive ops (matmuls, attention), recompute the rest.

    Norms, activations, RoPE and elementwise ops are recomputed: they cost little compute
    but their outputs are as large as a matmul's (Korthikanti et al. 2022; torchtitan
    `op_sac`). Override `get_save_ops` to change what is kept.
    """

    recomputes_matmuls = False

    def get_save_ops(self) -> set[Any]:
        """aten ops whose outputs are kept for backward."""
        return _aten_ops(
            "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm",  # _grouped_mm: MoE experts
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_flash_attention_forward", "_efficient_attention_forward",
        ) | _flash_attn_ops()  # fmt: skip

    def context_fn(self) -> Callable[[], Any]:
        save = frozenset(self.get_save_ops())

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        # A fresh pair of contexts per checkpoint call, as torch requires.
        return functools.partial(create_selective_checkpoint_contexts, policy)


class NoAC(ACPolicy):
    """Keep every activation of the block."""

    recomputes_matmuls = False

    def select(self, index: int, block: nn.Module) -> Optional[nn.Module]:
        return None


BLOCK_MODES: dict[str, Callable[[], ACPolicy]] = {"full": FullAC, "selective": SelectiveAC, "none": NoAC}
"""The modes a block can get from a memory budget (`rules.RECOMPUTE_MODES`, as the planner prices them)."""


class BlockModesAC(ACPolicy):
    """One mode of `BLOCK_MODES` per block, in block order (what `memory_budget_gib` chose)."""

    def __init__(self, modes: Sequence[str]) -> None:
        unknown = sorted(set(modes) - set(BLOCK_MODES))
        if unknown:
            raise ValueError(f"BlockModesAC: unknown modes {unknown}; each block takes one of {', '.join(BLOCK_MODES)}")
        self.modes = tuple(modes)
        self._policies = {mode: BLOCK_MODES[mode]() for mode in set(modes)}

    def policy_of(self, index: int) -> ACPolicy:
        if index >= len(self.modes):
            raise ValueError(f"BlockModesAC: {len(self.modes)} modes for at least {index + 1} blocks")
        return self._policies[self.modes[index]]

    def select(self, index: int, block: nn.Module) -> Optional[nn.Module]:
        return self.policy_of(index).select(index, block)


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _parents(root: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    return {id(child): (parent, name) for parent in root.modules() for name, child in parent.named_children()}


def _count_attention_cores(module: nn.Module) -> int:
    """Innermost modules whose class name ends in 'Attention' (Llama's `ScaledDotProductAttention`, HF `*Attention`)."""
    named = [m for m in module.modules() if type(m).__name__.endswith("Attention")]
    return sum(1 for m in named if not any(o is not m and type(o).__name__.endswith("Attention") for o in m.modules()))


def apply_ac(root: nn.Module, blocks: Sequence[nn.Module], policy: ACPolicy) -> RecomputeSummary:
    """Wrap the regions `policy` selects in each of `blocks` with a checkpoint wrapper, in place.

    Regions already inside a `CheckpointWrapper` are left alone, so applying twice is a no-op.
    """
    from ultrascale.estimate import matmul_params

    parents = _parents(root)
    context_fns: dict[int, Optional[Callable[[], Any]]] = {}
    regions = params = attention = 0
    for index, block in enumerate(blocks):
        block_policy = policy.policy_of(index)
        region = block_policy.select(index, block)
        if region is None:
            continue
        if id(region) not in parents:
            raise ValueError(
                f"ActivationCheckpointing: block {index} ({type(region).__name__}) is not a submodule of {type(root).__name__}")
        parent, name = parents[id(region)]
        if isinstance(parent, CheckpointWrapper) or isinstance(region, CheckpointWrapper):
            continue
        if id(block_policy) not in context_fns:
            context_fns[id(block_policy)] = block_policy.context_fn()
        context_fn = context_fns[id(block_policy)]
        kwargs = {"context_fn": context_fn} if context_fn is not None else {}
        setattr(parent, name, checkpoint_wrapper(region, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs))
        regions += 1
        if block_policy.recomputes_matmuls:
            params += matmul_params(region)
            attention += _count_attention_cores(region)
    return RecomputeSummary(regions=regions, matmul_params=params, attention_layers=attention)


def make_policy(mode: str, *, every_k: int = 2, attention_module: Optional[str] = None) -> ACPolicy:
    """The policy for a callback `mode` (validated here, with the valid values in the message)."""
    if mode == "full":
        return FullAC()
    if mode == "every_k":
        return EveryKAC(every_k)
    if mode == "selective":
        return SelectiveAC()
    if mode == "attention":
        return AttentionAC(attention_module)
    raise ValueError(f"ActivationCheckpointing: unknown `mode={mode!r}`; valid modes: {', '.join(AC_MODES)}")


class ActivationCheckpointing(ModelTransformCallback):
    """Activation checkpointing for any strategy: recompute activations in backward to save memory.

    Under ultrascale strategies it is applied inside `parallelize` (after TP, before
    FSDP); under Lightning's own strategies at `setup`/`on_fit_start`.

    Example::

        trainer = L.Trainer(strategy="ultrascale_zero3", callbacks=[ActivationCheckpointing(mode="selective")])
        # or: per block the cheapest of none / selective / full that keeps each rank under 60 GiB
        trainer = L.Trainer(strategy="ultrascale_zero3", callbacks=[ActivationCheckpointing(memory_budget_gib=60)])
    """

    _marker = "_ultrascale_activation_checkpointing"

    def __init__(
        self,
        mode: Optional[ACMode] = None,
        every_k: int = 2,
        attention_module: Optional[str] = None,
        policy: Optional[ACPolicy] = None,
        memory_budget_gib: Optional[float] = None,
    ) -> None:
        """
        Args:
            mode: `full` (the default) = every block whole; `every_k` = every k-th block whole; `selective` =
                op-level, keep matmul/attention outputs and recompute the rest; `attention` =
                only each block's self-attention submodule.
            every_k: for `mode="every_k"`: checkpoint blocks k, 2k, ... (1-based); must be >= 1.
            attention_module: for `mode="attention"`: path of the attention submodule inside a block;
                None tries `attention`, `self_attn`, `attn`, `self_attention`.
            policy: a custom `ACPolicy` instance (e.g. a `SelectiveAC` subclass overriding
                `get_save_ops`); overrides `mode`.
            memory_budget_gib: instead of `mode`: the GiB one rank may hold at its peak (weights, gradients,
                optimizer state, activations, buffers, as the planner prices them: `torch.cuda.max_memory_allocated`
                on a GPU). Per block the cheapest of none / selective / full that fits
                (`planner.cost.cheapest_recompute`): the first blocks full, the next selective, the last ones
                keep everything. Under an ultrascale strategy without pipeline parallel; refused by name where even
                every block full does not fit.
        """
        super().__init__()
        if not isinstance(every_k, int) or isinstance(every_k, bool) or every_k < 1:
            raise ValueError(f"ActivationCheckpointing: `every_k={every_k!r}` must be an integer >= 1")
        if memory_budget_gib is not None:
            if isinstance(memory_budget_gib, bool) or not isinstance(memory_budget_gib, (int, float)) or not memory_budget_gib > 0:
                raise ValueError(f"ActivationCheckpointing: `memory_budget_gib={memory_budget_gib!r}` must be a positive "
                                 "number of GiB per rank")
            if mode is not None or policy is not None:
                raise ValueError(f"ActivationCheckpointing: give `memory_budget_gib={memory_budget_gib}` or "
                                 f"`{'mode' if mode is not None else 'policy'}`, not both: the budget chooses each block's mode")
        self.mode = mode or ("budget" if memory_budget_gib is not None else "full")
        self.memory_budget_gib = memory_budget_gib
        self.policy: Optional[ACPolicy] = policy if policy is not None or memory_budget_gib is not None else make_policy(
            self.mode, every_k=every_k, attention_module=attention_module)
        self.block_modes: Optional[tuple[str, ...]] = None
        """Under `memory_budget_gib`: each block's mode, in block order (set when the strategy prices the run)."""
        self.predicted_peak_gib: Optional[float] = None
        """Under `memory_budget_gib`: the planner's peak of a rank with `block_modes`."""
        self.summary: Optional[RecomputeSummary] = None
        """What was wrapped (set when the model is transformed); the MFU monitor reads it for HFU."""

    def choose_blocks(self, shape: Any, layout: Any, cluster: Any, work: Any, hf_config: Any = None) -> tuple[str, ...]:
        """Each block's mode for `memory_budget_gib` on this run (the planner's `ModelShape`, `Layout` with
        recompute="budget", `Cluster` and `Workload`, as the strategy sees the run); ValueError naming the knob
        where nothing fits."""
        from ultrascale.hardware import GIB
        from ultrascale.planner.cost import cheapest_recompute, evaluate

        assert self.memory_budget_gib is not None
        budget = self.memory_budget_gib * GIB
        chosen, fits = cheapest_recompute(shape, layout, cluster, work, budget, hf_config)
        row = evaluate(shape, chosen, cluster, work, hf_config, problems=[])
        if not fits:
            held = row.memory["total"] - row.memory["activations"]
            parts = ", ".join(f"{name} {row.memory[name] / GIB:.3g}" for name in ("params", "grads", "optimizer", "buffers"))
            if budget < held:
                why = f"a rank holds {held / GIB:.3g} GiB besides activations ({parts} GiB)"
            else:
                why = f"even every block run full peaks at {row.memory['total'] / GIB:.3g} GiB a rank"
            where = layout.describe().replace(", recompute=budget", "")
            raise ValueError(f"ActivationCheckpointing(`memory_budget_gib={self.memory_budget_gib}`): {why} under "
                             f"{where}: raise the budget or shard more")
        full, selective, none = chosen.recompute_blocks
        self.block_modes = ("full",) * full + ("selective",) * selective + ("none",) * none
        self.predicted_peak_gib = row.memory["total"] / GIB
        self.policy = BlockModesAC(self.block_modes)
        return self.block_modes

    def describe_blocks(self) -> str:
        """Which blocks got what, for the log: "blocks 0-3 full, 4-9 selective, 10-15 none"."""
        modes = self.block_modes or ()
        runs, start = [], 0
        for index in range(1, len(modes) + 1):
            if index == len(modes) or modes[index] != modes[start]:
                runs.append(f"{start}-{index - 1} {modes[start]}" if index - 1 > start else f"{start} {modes[start]}")
                start = index
        return "blocks " + ", ".join(runs)

    def _apply(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        if not blocks:
            raise ValueError(
                f"ActivationCheckpointing: no transformer blocks found in {type(module).__name__} (a ModuleList of "
                "identical layers); activation checkpointing needs them to choose what to recompute"
            )
        if self.policy is None:
            raise ValueError(
                f"ActivationCheckpointing(`memory_budget_gib={self.memory_budget_gib}`) needs an ultrascale strategy "
                "(ultrascale_zero3, ultrascale_4d, ...), which prices a rank's memory from its layout; under "
                f"{type(module).__name__}'s strategy give `mode` instead")
        self.summary = apply_ac(module, blocks, self.policy)
