"""The one-loss-per-step rule inside Lightning's automatic optimization.

A LightningModule opts in by returning ``{"loss": mean over its valid tokens, "num_tokens": n}``
from ``training_step`` (``ultrascale.token_loss`` builds it). Lightning divides every
micro-batch's loss by ``accumulate_grad_batches = k`` before backward; this class turns the
step into the exact global token mean (see `ultrascale.parallel.loss`):

    backward(loss / k * n)       = backward(S_m / k)        S_m: the micro-batch's loss sum
    reductions (FSDP, ZeRO, HSDP) sum over the dp x cp ranks  ->  grad = (1/k) * grad(sum S)
    at the step:  N = all-reduce(sum n),  grad *= k / N       ->  grad(sum S / N)

A module that returns a plain loss (a mean per micro-batch) keeps the familiar semantics:
its summed gradients are divided by the number of dp x cp ranks, i.e. the mean of the rank
means, which equals the global token mean only when every rank and micro-batch holds the same
number of valid tokens.

`StepRunner` holds everything around one optimizer step of one rank (this normalisation, the
non-finite guard, the MoE load statistics and the balance terms' gradient scale); its `finish`
returns the step as a frozen `StepResult`, which the strategy logs and hands to clipping.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from ultrascale.parallel.expert import (
    ROUTER_LOAD_ATTRIBUTE,
    balance_ratio,
    scale_balance_terms,
    step_expert_load,
    update_router_bias,
)
from ultrascale.parallel.grad import global_grad_norm
from ultrascale.parallel.loss import TokenNormalizedStep
from ultrascale.parallel.pipeline import TiedStageWeights
from ultrascale.parallel.rules import Problem, raise_first
from ultrascale.parallel.zero import ZeroEngine

NonFinitePolicy = Literal["stop", "skip", "rollback", "off"]
NONFINITE_POLICIES: tuple[str, ...] = ("stop", "skip", "rollback", "off")


def nonfinite_problems(policy: Any, max_skips: Any) -> list[Problem]:
    """The one check of the non-finite knobs (asked by the strategies' `ProcessConfig` and by `StepGuard`)."""
    problems = []
    if policy not in NONFINITE_POLICIES:
        problems.append(Problem("choose 'stop', 'skip', 'rollback' or 'off'", (f"nonfinite={policy!r}",)))
    if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 0:
        problems.append(Problem("must be >= 0 (an int)", (f"max_nonfinite_skips={max_skips!r}",)))
    return problems


class StepGuard:
    """Catches a non-finite step on the step it happens, and notes loss spikes.

    Every rank calls `check` with the same global numbers (the step's token-mean loss and the
    global gradient norm), so every rank takes the same decision and no collective is left
    waiting. A spike is a loss whose robust z-score over the last `window` steps,
    0.6745 * (loss - median) / MAD (Iglewicz & Hoaglin), exceeds `spike_threshold`.
    """

    def __init__(self, policy: NonFinitePolicy = "stop", max_skips: int = 10, window: int = 100,
                 spike_threshold: float = 6.0) -> None:
        raise_first(nonfinite_problems(policy, max_skips))
        self.policy = policy
        self.max_skips = max_skips
        self.skipped = 0
        self.spikes = 0
        self._losses: deque[float] = deque(maxlen=window)
        self.spike_threshold = spike_threshold

    def check(self, *, step: int, rank: int, loss: Optional[float], grad_norm: float) -> bool:
        """True if the optimizer may step. Raises FloatingPointError under "stop", or under "skip"
        once more than `max_skips` steps were skipped."""
        finite = math.isfinite(grad_norm) and (loss is None or math.isfinite(loss))
        if finite:
            return True
        what = f"loss {loss}, global gradient norm {grad_norm}" if loss is not None else f"global gradient norm {grad_norm}"
        if self.policy in ("skip", "rollback") and self.skipped < self.max_skips:
            self.skipped += 1
            return False
        reason = (
            f"{self.skipped} step(s) were {'skipped' if self.policy == 'skip' else 'rolled back'} already, the limit "
            f"(max_nonfinite_skips={self.max_skips})" if self.policy in ("skip", "rollback") else "nonfinite='stop'"
        )
        raise FloatingPointError(
            f"non-finite step {step} (rank {rank}): {what}; stopped ({reason}). Look at this step's batch and the "
            "learning rate; `nonfinite='skip'` skips such steps instead (no optimizer update), up to max_nonfinite_skips."
        )

    def spike(self, loss: Optional[float]) -> Optional[float]:
        """The loss's robust z-score if it is a spike against the window (then counted), else None."""
        if loss is None or not math.isfinite(loss):
            return None
        history = sorted(self._losses)
        self._losses.append(loss)
        if len(history) < 10:
            return None
        median = history[len(history) // 2]
        mad = sorted(abs(x - median) for x in history)[len(history) // 2]
        if mad <= 0:
            return None
        z = 0.6745 * (loss - median) / mad
        if z <= self.spike_threshold:
            return None
        self.spikes += 1
        return z


@dataclass(frozen=True)
class StepGroups:
    """Where one step's numbers are reduced; fixed once the mesh exists."""

    data: Optional[dist.ProcessGroup]
    """The ranks that hold different tokens (dp x cp): the step's token count and loss sum."""
    data_ranks: int
    """The size of `data`."""
    device: torch.device
    """This rank's device (a norm of no gradient is a zero there)."""
    stages: Optional[dist.ProcessGroup] = None
    """Under pipeline parallel, the ranks holding the other stages: their gradients count in the norm."""
    experts: Optional[dist.ProcessGroup] = None
    """The ranks whose MoE loads are summed: all of them (every data rank and pipeline stage)."""
    expert_copies: int = 1
    """How many ranks of `experts` route each token (tensor parallel: every tp rank)."""
    tensor: Optional[dist.ProcessGroup] = None
    """Under tensor parallel, the ranks that split each layer: what they all hold whole must get one gradient."""


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, the same on every rank."""

    step: int
    """The optimizer step (`trainer.global_step`) it was."""
    loss: Optional[torch.Tensor] = None
    """The exact global token-mean loss (fp32); None for a module that returns a plain loss."""
    tokens: Optional[torch.Tensor] = None
    """Valid tokens of the whole global batch; None for a plain loss."""
    grad_norm: Optional[torch.Tensor] = None
    """Global L2 norm of the normalised gradients (clipping reuses it); None under `nonfinite="off"`."""
    loss_value: Optional[float] = None
    """`loss` on the host (None for a plain loss or under "off")."""
    grad_norm_value: Optional[float] = None
    """`grad_norm` on the host."""
    skipped: bool = False
    """The optimizer must not step: the step was non-finite under "skip" / "rollback"."""
    skipped_steps: int = 0
    """Steps skipped in this run so far, this one included."""
    spike: Optional[float] = None
    """The loss's robust z-score if it is a spike, else None."""
    loss_spikes: int = 0
    """Loss spikes in this run so far, this one included."""
    moe: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """MoE statistics by log name (`moe/aux_loss`, `moe/balance`, `moe/dropped`, `moe/expert_tokens/<i>`);
    empty without MoE."""


class StepRunner:
    """Everything around one optimizer step of one rank.

    Per micro-batch: `start_micro_batch` before `training_step`, `observe` on its output,
    `backward_loss` for the loss its backward differentiates. Per optimizer step, once the last
    backward ran: `finish` (normalise, check, MoE statistics) returns the `StepResult`, and
    `discard` drops a skipped step's gradients. Every rank calls `finish` (it has collectives)
    and takes the same decision from the same global numbers.
    """

    def __init__(self, nonfinite: NonFinitePolicy = "stop", max_nonfinite_skips: int = 10) -> None:
        self.tokens = TokenNormalizedStep()
        self.guard = StepGuard(nonfinite, max_nonfinite_skips)
        self._routers: list[torch.nn.Module] = []  # MoE routers of this rank's layers
        self._moe_shape: Optional[tuple[int, int]] = None  # (MoE layers, experts) of the whole model: same on every rank
        self._tied: Optional[TiedStageWeights] = None
        self._unclipped_norm: Optional[torch.Tensor] = None

    def use_routers(self, routers: Sequence[torch.nn.Module], moe_shape: Optional[tuple[int, int]]) -> None:
        """The MoE routers of this rank's layers and the (MoE layers, experts) of the whole model (None: no MoE)."""
        self._routers = list(routers)
        self._moe_shape = moe_shape

    def use_tied_weights(self, tied: Optional[TiedStageWeights]) -> None:
        """Under pipeline parallel with tied embeddings, this rank's end of the tie (None elsewhere): `finish`
        sums the two ends' gradients and counts them once."""
        self._tied = tied

    def start_micro_batch(self, accumulate: int) -> None:
        # A norm is only the step's between `finish` and its update: a manual-optimization step that clips before
        # its own `finish` must not get the previous step's.
        self._unclipped_norm = None
        if self._moe_shape is not None:
            scale_balance_terms(self._routers, accumulate)  # the token-normalised scale until `backward_loss` says otherwise

    def observe(self, output: Any) -> None:
        self.tokens.observe(output)

    def backward_loss(self, closure_loss: torch.Tensor, accumulate: int) -> torch.Tensor:
        """The loss Lightning's backward differentiates (see `TokenNormalizedStep.backward_loss`)."""
        if self._routers and self.tokens.micro_batch_tokens is None:
            # A plain (mean) loss: the balance terms become a mean over this micro-batch's routed tokens.
            scale_balance_terms(self._routers, accumulate, mean_over=getattr(self._routers[0], ROUTER_LOAD_ATTRIBUTE).tokens)
        return self.tokens.backward_loss(closure_loss)

    def finish(self, optimizer: torch.optim.Optimizer, engine: Optional[ZeroEngine], groups: StepGroups, *,
               loss_divisor: int, step: int, rank: int) -> StepResult:
        """The step's gradients reduced (ZeRO-1/2) and normalised once, checked, and the MoE loads counted.

        `loss_divisor`: what Lightning divided each micro-batch's loss by (`accumulate_grad_batches`
        under automatic optimisation, else 1). Raises FloatingPointError where `nonfinite` says to stop."""
        if self._tied is not None and engine is None:  # ZeRO-1/2: the engine sums the tie on its reduced slices
            self._tied.sync_gradients()
        if engine is not None:
            engine.reduce_gradients()
            grads: list[Optional[torch.Tensor]] = list(engine.grad_shards())
        else:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        loss = self.tokens.finish(grads, group=groups.data, data_ranks=groups.data_ranks, loss_divisor=loss_divisor)
        checked: dict[str, Any] = {}
        if self.guard.policy != "off":
            if engine is not None:
                norm = engine.grad_norm()
            else:
                elsewhere = {id(g) for g in self._tied.not_counted()} if self._tied is not None else set()
                present = [g for g in grads if g is not None and id(g) not in elsewhere]
                stages = groups.stages
                norm = global_grad_norm(present, across=stages) if present or stages else torch.zeros((), device=groups.device)
            # One host sync for both numbers.
            numbers = torch.stack([norm.float(), (loss if loss is not None else norm).float().to(norm.device)]).tolist()
            grad_norm, loss_value = numbers[0], (numbers[1] if loss is not None else None)
            ok = self.guard.check(step=step, rank=rank, loss=loss_value, grad_norm=grad_norm)
            checked = dict(grad_norm=norm, grad_norm_value=grad_norm, loss_value=loss_value, skipped=not ok,
                           spike=self.guard.spike(loss_value))
        # Every rank joins the loads' all-reduce, also a pipeline stage without MoE layers.
        moe = self._expert_load(groups) if self._moe_shape is not None else {}
        self._unclipped_norm = checked.get("grad_norm")
        return StepResult(step=step, loss=loss, tokens=self.tokens.step_tokens if loss is not None else None,
                          skipped_steps=self.guard.skipped, loss_spikes=self.guard.spikes, moe=moe, **checked)

    def take_grad_norm(self) -> Optional[torch.Tensor]:
        """This step's global gradient norm once `finish` has run (None before it, or under `nonfinite="off"`), once:
        clipping reuses it, and after clipping the gradients' norm is no longer that one."""
        norm, self._unclipped_norm = self._unclipped_norm, None
        return norm

    def discard(self, optimizer: torch.optim.Optimizer, engine: Optional[ZeroEngine]) -> None:
        """Drop a skipped step's gradients: the optimizer does not step on them, nor on the next ones."""
        if engine is not None:
            engine.discard_step()
        optimizer.zero_grad(set_to_none=True)

    def _expert_load(self, groups: StepGroups) -> dict[str, torch.Tensor]:
        """The step's token counts per layer and expert over all ranks (one all-reduce), the
        aux-loss-free bias update from them, and the statistics: `moe/aux_loss` (the balance terms
        added to the loss, over the step's valid tokens), `moe/balance` (max / mean tokens per expert,
        averaged over layers; 1 = even), `moe/expert_tokens/<i>` (summed over layers), `moe/dropped`."""
        assert self._moe_shape is not None
        counts, aux, dropped = step_expert_load(
            [getattr(r, ROUTER_LOAD_ATTRIBUTE) for r in self._routers], *self._moe_shape, groups.device,
            group=groups.experts, copies=groups.expert_copies,
        )
        update_router_bias(self._routers, counts)
        moe_layers = counts[counts.sum(-1) > 0]
        return {
            "moe/aux_loss": aux / self.tokens.step_tokens.clamp(min=1),
            "moe/balance": balance_ratio(moe_layers).mean() if len(moe_layers) else counts.new_zeros(()),
            "moe/dropped": dropped,
            **{f"moe/expert_tokens/{i}": count for i, count in enumerate(counts.sum(0))},
        }
