"""The training side of the causal LMs: the LR schedule, the optimizer and the LightningModules.

`CausalLMModule` holds the steps shared by `LlamaLM` (the built-in `Llama`) and
`HFCausalLM` (Hugging Face checkpoints, `ultrascale.models.hf`). The loss itself is a
plain function apart from any module (`ultrascale.parallel.loss.token_loss` /
`cross_entropy_sum`), so a pipeline's last stage can compute it without the module.
"""

import dataclasses
import functools
import math
from typing import Any, Dict, Optional, Tuple

import lightning
import torch
from torchmetrics.aggregation import MeanMetric

from ultrascale.contract import attached_strategy, normalizes_token_loss, pipeline_active
from ultrascale.estimate import ADAMW_KERNEL
from ultrascale.models.head_loss import fused_head_loss_sum
from ultrascale.models.llama import Llama, LlamaConfig
from ultrascale.parallel.expert import iter_routers, scale_balance_terms
from ultrascale.parallel.loss import TokenNormalizedStep, loss_chunk_tokens_of, token_loss, token_mean
from ultrascale.parallel.rules import not_built

__all__ = ["CausalLMModule", "LlamaLM", "adamw_warmup_cosine", "check_loss_chunk_tokens", "warmup_cosine"]


def check_loss_chunk_tokens(value: Optional[int], owner: str) -> None:
    """`loss_chunk_tokens` is None, 0 or a positive count."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{owner}: `loss_chunk_tokens={value!r}` must be a positive number of tokens, 0 (off) or "
                         "None (the default for the vocabulary)")

def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1 over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``.

    Warm-up is ``(step + 1) / warmup_steps`` so the first step already learns; after
    ``max_steps`` the multiplier stays at ``min_lr_ratio``.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_cosine: `warmup_steps={warmup_steps}` must be >= 0.")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"warmup_cosine: `min_lr_ratio={min_lr_ratio}` must be in [0, 1].")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_warmup_cosine(module: lightning.LightningModule) -> Dict[str, Any]:
    """AdamW with linear warm-up then cosine decay, configured from the module's hparams
    (learning_rate, weight_decay, betas, eps, warmup_steps, max_steps, min_lr_ratio)."""
    hp = module.hparams
    params = [p for p in module.parameters() if p.requires_grad]
    # Decay matrices (embeddings, linears) only: decaying norm gains towards 0 just fights the normalisation.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": hp.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps, **ADAMW_KERNEL)
    max_steps = hp.max_steps if hp.max_steps is not None else module.trainer.estimated_stepping_batches
    if not math.isfinite(max_steps):
        raise ValueError(
            f"{type(module).__name__}: cannot size the cosine schedule from an unbounded trainer; "
            f"set `max_steps` on the module or the Trainer."
        )
    lr_lambda = functools.partial(
        warmup_cosine, warmup_steps=hp.warmup_steps, max_steps=int(max_steps), min_lr_ratio=hp.min_lr_ratio
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CausalLMModule(lightning.LightningModule):
    """Training and validation steps shared by ultrascale's causal-LM modules.

    Subclasses define ``forward(input_ids, position_ids=None) -> logits`` and the hparams
    `adamw_warmup_cosine` reads. Batches are ``{"input_ids", "labels"[, "position_ids"]}``.

    The loss of an optimizer step is ``sum(token losses) / valid tokens of the global batch``:
    steps return ``{"loss", "num_tokens"}`` (`ultrascale.token_loss`). Under ultrascale
    strategies, and Lightning's one-device strategy and DDP, the gradient and the logged
    ``train_loss`` are exactly that; ``val_loss`` is the
    token mean over the whole validation set (sum and count reduced over all ranks).
    """

    supports_loss_parallel = True
    """`batch_loss` accepts vocab-sharded DTensor logits, so strategies may keep them sharded."""

    attends_within_documents = True
    """``position_ids`` restarting at 0 start documents that attend to themselves alone (both models)."""

    def __init__(self) -> None:
        super().__init__()
        # Weighted by each batch's valid tokens, synced as (sum, count) over all ranks at epoch end.
        self.val_token_mean = MeanMetric()

    def batch_loss(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``{"loss": mean over the batch's valid tokens, "num_tokens": their number}``.

        Under pipeline parallel the model is split over ranks: the strategy runs the batch through
        the pipeline (in training, forward and backward of every micro-batch) and returns the same."""
        strategy = attached_strategy(self)
        if pipeline_active(strategy):
            self.loss_chunk_tokens_in_use(pipeline=True)  # an explicit chunk is refused: not built under pp
            return strategy.pipeline_loss(batch)
        if self.loss_chunk_tokens_in_use():
            # Inside forward: under ZeRO-3 the module is FSDP's root, whose hooks gather the head for the call.
            return self(batch["input_ids"], batch.get("position_ids"), labels=batch["labels"])
        return token_loss(self(batch["input_ids"], batch.get("position_ids")), batch["labels"])

    def loss_chunk_tokens_in_use(self, pipeline: bool = False) -> int:
        """The tokens per chunk of the fused head and loss (`parallel.loss.chunked_cross_entropy_sum`), 0 for the
        whole micro-batch's logits at once. From the `loss_chunk_tokens` hparam of a module that
        `fuses_head_and_loss`: None (the default) is `default_loss_chunk_tokens` of the vocabulary where the chunked
        loss is built (`chunked_loss_refusal` says where not, and there it is off); 0 is off; a count is refused
        where it is not built. Any other module computes the whole logits."""
        if not self.fuses_head_and_loss:
            return 0
        chosen = self.hparams.get("loss_chunk_tokens")
        if chosen == 0:
            return 0
        refusal = (("chunked_loss_pipeline", "pipeline parallel computes the loss on its last stage from the whole "
                    "logits") if pipeline else self.chunked_loss_refusal())
        if refusal is not None and chosen is not None:
            key, reason = refusal
            raise not_built(key, f"{type(self).__name__}: `loss_chunk_tokens={chosen}`: {reason} (not built "
                                 "yet); set `loss_chunk_tokens: 0` (the whole logits) or leave it unset")
        return loss_chunk_tokens_of(chosen, self.vocab_size_of_head(), built=refusal is None)

    fuses_head_and_loss = False
    """Whether `forward(input_ids, position_ids, labels=...)` returns the chunked loss (`LlamaLM`, `HFCausalLM`)."""

    def chunked_loss_refusal(self) -> Optional[Tuple[str, str]]:
        """``(NOT_BUILT key, why)`` where this model cannot fuse its head with the loss; None where it can."""
        return None

    def vocab_size_of_head(self) -> int:
        """The head's output width (the logits' last dimension)."""
        raise NotImplementedError

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> Dict[str, torch.Tensor]:
        out = self.batch_loss(batch)
        exact = self._token_mean_under_lightning()
        if exact is not None:
            exact.observe(out)  # `backward` differentiates the token sum; what callbacks see stays the mean
            # Lightning steps the optimizer after every k-th micro-batch and the epoch's last (its public counts).
            trainer = self.trainer
            self._steps_after_this = ((batch_idx + 1) % trainer.accumulate_grad_batches == 0
                                      or batch_idx + 1 == trainer.num_training_batches)
            return out
        if not normalizes_token_loss(self.trainer.strategy):
            # Lightning's own strategies: the micro-batch mean, averaged over ranks (exact only
            # when every rank holds the same number of valid tokens).
            self.log("train_loss", out["loss"], prog_bar=True, sync_dist=True)
            # MoE balance terms are token sums: on this mean's scale they are divided by the same valid tokens.
            routers = self._moe_routers()
            if routers:
                scale_balance_terms(routers, self.trainer.accumulate_grad_batches, mean_over=int(out["num_tokens"]))
        return out

    def _token_mean_under_lightning(self) -> Any:
        """The step's exact token mean under Lightning's one-device strategy and DDP (`TokenNormalizedStep`, the
        rule ultrascale's strategies apply; None where they apply it, and for Lightning's other strategies and MoE
        modules, which keep the mean of the micro-batch means). With `k` micro-batches, `backward` differentiates
        each one's token sum (Lightning divided it by k); DDP averages the gradients over the W ranks; `on_after_backward` of the step's
        last micro-batch multiplies them by k * W / N, N the step's valid tokens over all ranks: grad(sum of token
        losses / N)."""
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        strategy = self.trainer.strategy
        if normalizes_token_loss(strategy) or type(strategy) not in (SingleDeviceStrategy, DDPStrategy) or self._moe_routers():
            return None
        if getattr(self, "_lightning_step", None) is None:
            self._lightning_step = TokenNormalizedStep()
        return self._lightning_step

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        exact = self._token_mean_under_lightning()
        super().backward(exact.backward_loss(loss) if exact is not None else loss, *args, **kwargs)

    def on_after_backward(self) -> None:
        """The last micro-batch's backward: normalise the step's gradients here, so every callback's
        `on_before_optimizer_step` and clipping see them normalised (as under ultrascale's strategies)."""
        exact = self._token_mean_under_lightning()
        if exact is None or not getattr(self, "_steps_after_this", False):
            return
        world = self.trainer.world_size
        loss = exact.finish((p.grad for p in self.parameters()), group=torch.distributed.group.WORLD if world > 1 else None,
                            data_ranks=world, loss_divisor=self.trainer.accumulate_grad_batches * world)
        if loss is not None:
            self.log("train_loss", loss, prog_bar=True)

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> Dict[str, torch.Tensor]:
        out = self.batch_loss(batch)
        self.val_token_mean.update(out["loss"], weight=out["num_tokens"])
        self.log("val_loss", self.val_token_mean, prog_bar=True, on_step=False, on_epoch=True)
        return out

    def predict_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The logits (B, T, V) of ``{"input_ids"[, "position_ids"]}``; under pipeline parallel the strategy runs the
        batch through the pipeline and every rank returns them."""
        strategy = attached_strategy(self)
        if pipeline_active(strategy):
            return strategy.pipeline_logits(batch)
        return self(batch["input_ids"], batch.get("position_ids"))

    def _moe_routers(self) -> list:
        """The MoE routers, found once (the model is built by then): not a module walk per step."""
        if getattr(self, "_routers_found", None) is None:
            self._routers_found = list(iter_routers(self))
        return self._routers_found

    def configure_optimizers(self) -> Dict[str, Any]:
        return adamw_warmup_cosine(self)


class LlamaLM(CausalLMModule):
    """Causal-LM training of ``Llama`` on batches ``{"input_ids": (B, T), "labels": (B, T)}``.

    ``labels`` are already shifted (``labels[t]`` is the target for ``input_ids[t]``)
    and ``-100`` marks ignored positions. The model is built in ``configure_model``,
    from ``init_seed`` alone, so every rank and a single-process reference start equal.
    """

    def __init__(
        self,
        config: Optional[LlamaConfig] = None,
        preset: str = "tiny",
        vocab_size: Optional[int] = None,
        max_seq_len: Optional[int] = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: Tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 10,
        max_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
        init_seed: int = 0,
        loss_chunk_tokens: Optional[int] = None,
    ) -> None:
        """
        Args:
            config: Full model config; when ``None`` the ``preset`` is used.
            preset: Name in ``LLAMA_PRESETS``, used only when ``config`` is ``None``.
            vocab_size: Overrides the config's vocabulary size (e.g. to match a tokenizer).
            max_seq_len: Overrides the config's maximum sequence length.
            learning_rate: Peak AdamW learning rate, reached at the end of warm-up.
            weight_decay: AdamW decoupled weight decay for matrices (norm weights get none).
            betas: AdamW ``(beta1, beta2)``.
            eps: AdamW's denominator term ``eps`` in ``m / (sqrt(v) + eps)``.
            warmup_steps: Optimizer steps of linear warm-up.
            max_steps: Step at which the cosine reaches ``min_lr_ratio``; ``None`` uses the
                trainer's ``estimated_stepping_batches``.
            min_lr_ratio: Final learning rate as a fraction of ``learning_rate``.
            init_seed: Seed of the weight init, independent of the global RNG state.
            loss_chunk_tokens: The head and the loss fused over chunks of this many tokens, so the logits of
                no more than one chunk exist at once (`ultrascale.chunked_token_loss`); 0: the whole
                micro-batch's logits; None: `default_loss_chunk_tokens` of the vocabulary (off under
                pipeline parallel, where it is not built yet).
        """
        check_loss_chunk_tokens(loss_chunk_tokens, "LlamaLM")
        super().__init__()
        self.save_hyperparameters()
        overrides = {k: v for k, v in (("vocab_size", vocab_size), ("max_seq_len", max_seq_len)) if v is not None}
        if config is None:
            config = LlamaConfig.from_preset(preset, **overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.model: Optional[Llama] = None

    def configure_model(self) -> None:
        """Build ``Llama`` (idempotent); on the meta device only shapes exist until ``init_weights``."""
        if self.model is not None:
            return
        # fork_rng so building the model neither reads nor advances the caller's RNG.
        with torch.random.fork_rng(devices=self._rng_devices()):
            self.model = Llama(self.config)
        self.init_weights()

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        # `export-hf` rebuilds the model's shape from this (`ultrascale.models.llama_hf`).
        checkpoint["llama_config"] = dataclasses.asdict(self.config)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Seed with ``init_seed`` and initialise the model, leaving the global RNG untouched.

        Call after materialising a meta-built model (``to_empty``); gives the same
        weights as a model built directly on a device, since only ``init_weights`` draws.
        """
        if self.model is None:
            raise ValueError(f"{type(self).__name__}.init_weights: call `configure_model()` first.")
        with torch.random.fork_rng(devices=self._rng_devices()):
            torch.manual_seed(self.hparams.init_seed)
            self.model.init_weights()

    @staticmethod
    def _rng_devices() -> list:
        # Fork only the current CUDA device's RNG: forking every device warns and costs time.
        return [torch.cuda.current_device()] if torch.cuda.is_available() else []

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> Any:
        """``input_ids`` ``(B, T)`` -> logits ``(B, T, vocab_size)``; ``position_ids`` ``(B, T)``
        restarting at 0 per packed document keep the documents apart (see ``Llama.forward``). With `labels`:
        ``{"loss", "num_tokens"}`` of the head and the loss fused in chunks of `loss_chunk_tokens_in_use`
        (`ultrascale.chunked_token_loss`), never the whole logits."""
        if self.model is None:
            raise ValueError(f"{type(self).__name__}: the model is built in `configure_model()`; call it first.")
        chunk = self.loss_chunk_tokens_in_use() if labels is not None else 0
        if not chunk:
            logits = self.model(input_ids, position_ids)
            return logits if labels is None else token_loss(logits, labels)
        return token_mean(*fused_head_loss_sum(self.model, input_ids, position_ids, labels, chunk))

    fuses_head_and_loss = True

    def vocab_size_of_head(self) -> int:
        return self.config.vocab_size

    def num_params(self, exclude_embedding: bool = False) -> int:
        """See ``Llama.num_params``; uses a meta-device copy when the model is not built yet."""
        return self._model_or_meta().num_params(exclude_embedding)

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """See ``Llama.flops_per_token``; ``seq_len`` defaults to the config's ``max_seq_len``."""
        return self._model_or_meta().flops_per_token(seq_len if seq_len is not None else self.config.max_seq_len)

    def _model_or_meta(self) -> Llama:
        if self.model is not None:
            return self.model
        with torch.device("meta"):
            return Llama(self.config)
