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
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from ultrascale.parallel.loss import NUM_TOKENS_KEY, StepTokens, scale_gradients


class TokenNormalizedStep:
    """Per-step bookkeeping of one rank: the micro-batches' token counts and loss sums."""

    def __init__(self) -> None:
        self._tokens = StepTokens()
        self._micro_batch_tokens: Optional[torch.Tensor] = None
        self._plain_micro_batches = 0
        self.step_tokens = torch.zeros((), dtype=torch.float64)
        """Valid tokens of the whole global batch of the last finished step (what the loss sum was divided by)."""

    @property
    def micro_batch_tokens(self) -> Optional[torch.Tensor]:
        """The valid tokens of the current micro-batch; None for a plain-loss micro-batch."""
        return self._micro_batch_tokens

    def observe(self, output: Any) -> None:
        """Called with each `training_step` output, before its backward."""
        if isinstance(output, Mapping) and NUM_TOKENS_KEY in output:
            loss = output.get("loss")
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(
                    f"training_step returned `{NUM_TOKENS_KEY}` with `loss={loss!r}`: the loss must be a scalar tensor, "
                    f"the mean over the `{NUM_TOKENS_KEY}` valid tokens (see `ultrascale.token_loss`)"
                )
            count = torch.as_tensor(output[NUM_TOKENS_KEY], device=loss.device)
            self._tokens.add(loss.detach() * count, count)
            self._micro_batch_tokens = count
        else:
            self._micro_batch_tokens = None
            if output is not None:
                self._plain_micro_batches += 1
        if self._plain_micro_batches and not self._tokens.empty:
            raise ValueError(
                f"training_step returned `{NUM_TOKENS_KEY}` for some micro-batches of this optimizer step and a plain loss "
                f"for others; return `{{'loss': ..., '{NUM_TOKENS_KEY}': ...}}` always (or never)"
            )

    def backward_loss(self, closure_loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate: the micro-batch's token sum (over k) instead of its mean (over k)."""
        if self._micro_batch_tokens is None:
            return closure_loss
        return closure_loss * self._micro_batch_tokens.to(closure_loss.dtype)

    def finish(
        self,
        grads: Iterable[Optional[torch.Tensor]],
        *,
        group: Optional[dist.ProcessGroup],
        data_ranks: int,
        loss_divisor: int,
    ) -> Optional[torch.Tensor]:
        """Normalise the step's summed gradients (before clipping and the optimizer) and start a new step.

        `group`: the ranks that hold different tokens (dp x cp); `data_ranks`: its size;
        `loss_divisor`: what Lightning divided each micro-batch's loss by. Returns the step's
        global token-mean loss (fp32, the same on every rank), or None for plain-loss modules.
        """
        self._micro_batch_tokens = None
        self._plain_micro_batches = 0
        if self._tokens.empty:
            if data_ranks > 1:
                scale_gradients(grads, 1.0 / data_ranks)
            return None
        loss_sum, num_tokens = self._tokens.reduce(group)
        # No valid token in the whole step: every gradient is zero; keep it so (no 0/0).
        num_tokens = num_tokens.clamp(min=1)
        self.step_tokens = num_tokens
        scale_gradients(grads, loss_divisor / num_tokens)
        return (loss_sum / num_tokens).float()


NonFinitePolicy = Literal["stop", "skip", "rollback", "off"]


class StepGuard:
    """Catches a non-finite step on the step it happens, and notes loss spikes.

    Every rank calls `check` with the same global numbers (the step's token-mean loss and the
    global gradient norm), so every rank takes the same decision and no collective is left
    waiting. A spike is a loss whose robust z-score over the last `window` steps,
    0.6745 * (loss - median) / MAD (Iglewicz & Hoaglin), exceeds `spike_threshold`.
    """

    def __init__(self, policy: NonFinitePolicy = "stop", max_skips: int = 10, window: int = 100,
                 spike_threshold: float = 6.0) -> None:
        if policy not in ("stop", "skip", "rollback", "off"):
            raise ValueError(f"`nonfinite={policy!r}`: choose 'stop', 'skip', 'rollback' or 'off'")
        if max_skips < 0:
            raise ValueError(f"`max_nonfinite_skips={max_skips}` must be >= 0")
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
