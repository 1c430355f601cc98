"""One optimizer step, one loss: token-weighted normalisation over the whole global batch.

The loss of a step is

    L = sum over the valid tokens t of the global batch of CE(t)  /  N,    N = #(labels != -100)

where the global batch spans every dp and cp rank, every accumulation micro-batch and every
pipeline micro-batch. Averaging per-rank or per-micro-batch means instead weighs a token on a
rank with few valid tokens more than one on a rank with many (prompt-masked fine-tuning data),
and is only right when every micro-batch holds the same number of valid tokens.

How it is computed without knowing N in advance (no look-ahead over micro-batches):

    1. each backward runs on the *sum* of its token losses S_m (times a constant c);
    2. every gradient reduction sums (FSDP, HSDP and ZeRO-1/2 are set to SUM, never AVG),
       so after the last backward each gradient shard holds  c * grad(sum_m S_m);
    3. once per step `StepTokens.reduce` all-reduces (sum S, N) over the ranks that hold
       different tokens (dp_replicate x dp_shard x cp), and every gradient is multiplied
       by 1 / (c * N).

Gradients are linear in the loss, so scaling after the reduction equals dividing every token's
loss by N before it. N is reduced in float64: float32 counts are exact only up to 2**24 tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ultrascale.parallel.numerics import accumulation_dtype, upcast

IGNORE_INDEX = -100
"""Label value that marks a position without a target (prompt tokens, padding)."""

NUM_TOKENS_KEY = "num_tokens"
"""Key of the valid-token count in a step output ``{"loss": mean, "num_tokens": n}``."""


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of next-token cross-entropy over the valid labels, number of valid labels)``.

    ``logits`` ``(..., V)`` may be vocab-sharded DTensors (loss parallel): the replicated
    DTensor sum comes back as a plain tensor (``to_local`` keeps the graph). The sum is taken
    in fp32 (fp64 for fp64 logits, ``numerics.upcast``): a bf16 log-softmax over a large vocabulary is lossy. Labels are already shifted
    (``labels[t]`` is the target of position t). No valid label gives ``(0, 0)``, never NaN.
    """
    loss_sum = F.cross_entropy(upcast(logits).flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    if isinstance(loss_sum, DTensor):
        loss_sum = loss_sum.to_local()
    return loss_sum, (labels != ignore_index).sum()


def token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """What a LightningModule returns from ``training_step`` / ``validation_step`` to get the exact loss.

    ``{"loss": mean cross-entropy over this micro-batch's valid tokens (0 when there are none),
    "num_tokens": their number}``. Under any Lightning strategy the ``"loss"`` is an ordinary
    mean; ultrascale strategies read ``"num_tokens"`` and turn the step's gradient into that of
    ``sum(token losses) / (valid tokens of the whole global batch)``.
    """
    loss_sum, count = cross_entropy_sum(logits, labels, ignore_index)
    return {"loss": loss_sum / count.clamp(min=1), NUM_TOKENS_KEY: count}


def content_lengths(position_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B,)`` positions of each row that are not padding. ultrascale's blocks pad a row after its last example
    with a document of its own: positions counting from 0 again, no target. So the padding is the suffix from the
    row's last ``position_ids == 0`` when nothing in it is a target; a row whose last document has a target (or
    that is one document from position 0) is all content."""
    T = position_ids.shape[1]
    steps = torch.arange(T, device=position_ids.device)
    last_start = torch.where(position_ids == 0, steps, 0).amax(dim=1)  # (B,)
    tail_learned = ((labels != IGNORE_INDEX) & (steps >= last_start[:, None])).any(dim=1)  # (B,)
    return torch.where(tail_learned | (last_start == 0), T, last_start)


def batch_token_counts(batch: object) -> torch.Tensor | None:
    """``[positions, content, targets, attended]`` (float64, on the batch's device: no host sync) of a
    ``{"input_ids", ...}`` batch: every position computed; those that are not padding (an ``attention_mask``'s
    ones, else :func:`content_lengths` from ``position_ids`` and ``labels``, else all); those with a loss
    (``labels != -100``, else the content); and sum over the content's documents of their squared lengths, so
    ``attended / content`` is the length a token's attention spans on average (a document starts at each
    ``position_ids == 0``; without them a row is one document). None for another batch."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    B, T = ids.shape
    positions = torch.tensor(ids.numel(), dtype=torch.float64, device=ids.device)
    labels, mask, where = batch.get("labels"), batch.get("attention_mask"), batch.get("position_ids")
    steps = torch.arange(T, device=ids.device)
    if isinstance(mask, torch.Tensor):
        in_content = mask.bool()
    elif isinstance(where, torch.Tensor) and isinstance(labels, torch.Tensor):
        in_content = steps < content_lengths(where, labels)[:, None]
    else:
        in_content = torch.ones(B, T, dtype=torch.bool, device=ids.device)
    content = in_content.sum().to(torch.float64)
    targets = (labels != IGNORE_INDEX).sum().to(torch.float64) if isinstance(labels, torch.Tensor) else content
    if isinstance(where, torch.Tensor):
        # A row holds at most T documents: ids 0..T, offset by T + 1 per row so no two rows share one.
        document = (where == 0).cumsum(dim=1) + (T + 1) * torch.arange(B, device=ids.device)[:, None]
        length_at = torch.bincount(document.reshape(-1), minlength=B * (T + 1))[document]  # (B, T): its document's length
    else:
        length_at = torch.full((B, T), T, device=ids.device)
    attended = (length_at * in_content).sum().to(torch.float64)
    return torch.stack([positions, content, targets, attended])


class StepTokens:
    """This rank's sum of token losses and count of valid tokens over the micro-batches of one step."""

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.num_tokens: torch.Tensor | None = None

    def add(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> None:
        loss_sum, num_tokens = loss_sum.detach().double(), num_tokens.detach().double()
        if self.loss_sum is None or self.num_tokens is None:
            self.loss_sum, self.num_tokens = loss_sum, num_tokens
        else:
            self.loss_sum, self.num_tokens = self.loss_sum + loss_sum, self.num_tokens + num_tokens

    @property
    def empty(self) -> bool:
        return self.num_tokens is None

    def reduce(self, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss sum, valid tokens)`` of the whole global batch (float64, the same on every rank of
        `group`), then starts a new step. One all-reduce of two numbers; `group` None: this process only."""
        if self.loss_sum is None or self.num_tokens is None:
            raise RuntimeError("StepTokens.reduce: no micro-batch was added in this step")
        totals = torch.stack([self.loss_sum, self.num_tokens])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        self.loss_sum = self.num_tokens = None
        return totals[0], totals[1]


@torch.no_grad()
def scale_gradients(grads: Iterable[torch.Tensor | None], factor: float | torch.Tensor) -> None:
    """Multiply every gradient (or gradient shard, DTensor or plain) by ``factor`` in place.

    Exact for every placement: scaling commutes with Shard, Replicate and Partial(sum).
    A tensor factor stays on the device (no host sync).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), tensors in groups.items():
        # An fp64 gradient takes the factor unrounded (k / N in fp32 is off by up to 6e-8 of every gradient).
        scale = factor.to(device=device, dtype=accumulation_dtype(dtype)) if isinstance(factor, torch.Tensor) else factor
        torch._foreach_mul_(tensors, scale)


__all__ = ["IGNORE_INDEX", "NUM_TOKENS_KEY", "StepTokens", "cross_entropy_sum", "scale_gradients", "token_loss"]


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
