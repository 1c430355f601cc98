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

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

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
    return token_mean(*cross_entropy_sum(logits, labels, ignore_index))


def token_mean(loss_sum: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"loss": loss_sum / count (0 when count is 0), "num_tokens": count}``: what `token_loss` returns, from the
    sum and the count."""
    return {"loss": loss_sum / count.clamp(min=1), NUM_TOKENS_KEY: count}


LOSS_CHUNK_LOGITS = 2**27
"""The logits one chunk of `chunked_cross_entropy_sum` holds by default (`default_loss_chunk_tokens`): 128M, 512 MiB
in fp32, and its gradient as much again in backward. At a 152k vocabulary that is 883 tokens, where a sequence of
8,192 keeps 8,192 x 151,936 x 4 bytes = 5.0 GB of logits."""

MIN_LOSS_CHUNK_TOKENS = 1024
"""The fewest tokens a default chunk holds: the head's matmul stays (1,024 x dim) @ (dim x V), wide enough to run
at the matmul's speed, however large the vocabulary."""


def default_loss_chunk_tokens(vocab_size: int) -> int:
    """``max(MIN_LOSS_CHUNK_TOKENS, LOSS_CHUNK_LOGITS // vocab_size)``: 1,024 tokens at 128k-262k vocabularies, 4,096
    at 32k; a micro-batch of fewer tokens is one chunk, computed as without chunking."""
    return max(MIN_LOSS_CHUNK_TOKENS, LOSS_CHUNK_LOGITS // max(1, vocab_size))


def loss_chunk_tokens_of(chosen: Optional[int], vocab_size: int, built: bool) -> int:
    """The tokens per chunk a model's fused head and loss run with, 0 for the whole logits: `chosen` (the
    `loss_chunk_tokens` knob) where it is a count and the chunked loss is `built` for the model and layout; None,
    `default_loss_chunk_tokens` where built and 0 elsewhere; 0, 0. A count where it is not built is the caller's
    to refuse by name (`CausalLMModule.loss_chunk_tokens_in_use`); here it is 0."""
    if chosen == 0 or not built:
        return 0
    return int(chosen) if chosen is not None else default_loss_chunk_tokens(vocab_size)


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    head: torch.nn.Module | torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy_sum` of ``logits_fn(head(hidden))`` without the logits of more than `chunk_tokens` tokens at
    once: the sequence is cut into chunks of ``chunk_tokens // B`` positions; each chunk's logits are computed,
    reduced to its token sum and, when a gradient is wanted, differentiated on the spot (`_HeadLossInForward`), so
    backward has nothing left to do but scale. Peak extra memory is one chunk's logits and their gradient instead
    of the micro-batch's, and a gradient of the head's trainable parameters held from forward to backward; the
    head's matmuls are those of the whole logits' loss (forward, the input's gradient, the weight's), none rerun.

    `hidden` ``(B, T, dim)``: the final norm's output. `head`: the output projection, a module (its hooks run: a
    tensor-parallel plan, FP8, LoRA) or its weight ``(V, dim)`` (``F.linear``); its parameters that require a
    gradient get it. `logits_fn`: what the model does to the logits after the head (soft-capping, a scale), or
    None; it must hold no parameters of its own (they would get no gradient). Under loss parallel the head's
    vocab-sharded DTensor logits go into the cross-entropy as in `token_loss`; a sequence-parallel DTensor
    `hidden` is gathered once first (the head gathers it anyway). A micro-batch of at most `chunk_tokens` tokens
    is one chunk, computed as without chunking. Returns ``(sum of the valid tokens' losses, their number)``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunked_cross_entropy_sum: `chunk_tokens={chunk_tokens}` must be >= 1")
    if isinstance(head, torch.nn.Module):
        project, params = head, [p for p in head.parameters() if p.requires_grad]
    elif isinstance(head, torch.Tensor):
        project, params = functools.partial(F.linear, weight=head), [head] if head.requires_grad else []
    else:
        raise TypeError(f"chunked_cross_entropy_sum: `head` is the output projection, an nn.Module or its weight "
                        f"tensor, not {type(head).__name__} (a plain function's parameters could not be found)")

    def chunk_sum(states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = project(states)
        return cross_entropy_sum(logits if logits_fn is None else logits_fn(logits), targets, ignore_index)[0]

    count = (labels != ignore_index).sum()
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    rows, positions = labels.shape[0], labels.shape[1]
    if rows * positions <= chunk_tokens:
        return chunk_sum(hidden, labels), count
    width = max(1, chunk_tokens // rows)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or params):
        with torch.no_grad():
            return sum(chunk_sum(states, targets) for states, targets in
                       zip(hidden.split(width, dim=1), labels.split(width, dim=1))), count
    return _HeadLossInForward.apply(chunk_sum, labels, width, hidden, *params), count


class _HeadLossInForward(torch.autograd.Function):
    """The chunked loss's sum, each chunk differentiated in forward (`torch.autograd.grad` of its token sum with
    respect to its hidden states and the head's parameters) and its logits dropped. The loss is linear in its
    incoming gradient g, so backward returns g x the stored gradients: the input's ``(B, T, dim)``, the head's
    parameters' summed over the chunks (Liger's fused linear cross-entropy does the same, with its own kernels)."""

    @staticmethod
    def forward(ctx: Any, chunk_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], labels: torch.Tensor,
                width: int, hidden: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor | None = None
        hidden_grads: list[torch.Tensor] = []
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        for states, targets in zip(hidden.split(width, dim=1), labels.split(width, dim=1)):
            with torch.enable_grad():
                states = states.detach().requires_grad_(hidden.requires_grad)
                # The head sees a view, not the leaf: hooks that ask autograd whether it will reach their tensors
                # (`register_multi_grad_hook`: torch's ModTracker and MemTracker) cannot ask of a leaf inside
                # `autograd.grad`.
                part = chunk_sum(states.view_as(states), targets)
                wanted = ([states] if hidden.requires_grad else []) + list(params)
                grads = list(torch.autograd.grad(part, wanted, allow_unused=True))
            if hidden.requires_grad:
                hidden_grads.append(grads.pop(0))
            param_grads = [g if acc is None else (acc if g is None else acc + g) for acc, g in zip(param_grads, grads)]
            total = part.detach() if total is None else total + part.detach()
        ctx.hidden_grad = torch.cat(hidden_grads, dim=1) if hidden_grads else None
        ctx.param_grads = param_grads
        assert total is not None
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        hidden_grad, param_grads = ctx.hidden_grad, ctx.param_grads
        ctx.hidden_grad = ctx.param_grads = None
        return (None, None, None, _scaled(hidden_grad, grad_total), *(_scaled(g, grad_total) for g in param_grads))


def _scaled(grad: Optional[torch.Tensor], factor: torch.Tensor) -> Optional[torch.Tensor]:
    """``factor * grad``; a DTensor gradient keeps its placements (`factor` is this rank's plain scalar)."""
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        return DTensor.from_local(grad.to_local() * factor.to(grad.dtype), grad.device_mesh, grad.placements,
                                  run_check=False, shape=grad.shape, stride=grad.stride())
    return grad * factor.to(grad.dtype)


def chunked_token_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module | torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: Optional[int] = None,
    logits_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """`token_loss` from the hidden states and the head, chunked (`chunked_cross_entropy_sum`): the same
    ``{"loss", "num_tokens"}``, the same exact token mean under ultrascale's strategies, without the whole
    micro-batch's logits. `chunk_tokens` None: `default_loss_chunk_tokens` of the head's vocabulary (the
    logits' last dimension; a module's ``out_features`` or its weight's first)."""
    if chunk_tokens is None:
        weight = head if isinstance(head, torch.Tensor) else getattr(head, "weight", None)
        vocab = getattr(head, "out_features", None) or (weight.shape[0] if weight is not None else None)
        if vocab is None:
            raise ValueError("chunked_token_loss: pass `chunk_tokens` (the head has neither `out_features` nor `weight`)")
        chunk_tokens = default_loss_chunk_tokens(int(vocab))
    return token_mean(*chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens, logits_fn, ignore_index))


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


__all__ = ["IGNORE_INDEX", "NUM_TOKENS_KEY", "StepTokens", "chunked_cross_entropy_sum", "chunked_token_loss",
           "cross_entropy_sum", "default_loss_chunk_tokens", "loss_chunk_tokens_of", "scale_gradients",
           "token_loss", "token_mean"]


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
