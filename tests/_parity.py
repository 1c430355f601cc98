"""Shared pieces of the parity tests: masked data, a plain-torch reference loop, a recorder.

The reference never touches ultrascale's loss or strategies: one process, a plain PyTorch loop
that runs the model's forward on the whole global batch of each optimizer step (all dp ranks
and all accumulation micro-batches at once) and writes the loss inline:

    loss = sum of token cross-entropies over the labels != -100  /  number of those labels

so a per-rank or per-micro-batch mean anywhere in the code under test shows up as a mismatch,
given data whose valid-token counts differ between rows, ranks and micro-batches.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from ultrascale.data import ResumableBlockSampler
from ultrascale.parallel.zero import engine_for


class TokenDataset(Dataset):
    """Random token blocks with shifted labels; the same on every rank for a given seed.

    `masked`: each row's labels are -100 on a random-length prefix (a prompt), so rows, ranks and
    micro-batches hold different numbers of valid tokens. `empty_rows`: rows with no valid label.
    """

    def __init__(
        self, n: int, seq_len: int, vocab_size: int, seed: int = 0, masked: bool = False, empty_rows: Iterable[int] = (),
        packed: bool = False,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
        self.labels = self.blocks[:, 1:].clone()
        if masked:
            prompt = torch.randint(0, seq_len, (n,), generator=g)  # 0 .. seq_len-1 masked positions per row
            self.labels[torch.arange(seq_len) < prompt[:, None]] = -100
        for row in empty_rows:
            self.labels[row] = -100
        self.positions = None
        if packed:  # 1-3 documents per row, boundaries anywhere: positions restart at 0 per document
            self.positions = torch.empty(n, seq_len, dtype=torch.long)
            for row in range(n):
                cuts = sorted(torch.randint(1, seq_len, (int(torch.randint(0, 3, (), generator=g)),), generator=g).tolist())
                position = torch.arange(seq_len)
                for cut in cuts:
                    position[cut:] = torch.arange(seq_len - cut)
                self.positions[row] = position

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.blocks[i, :-1], "labels": self.labels[i]}
        if self.positions is not None:
            item["position_ids"] = self.positions[i]
        return item


class ParityData(L.LightningDataModule):
    """Global batch b = samples [b*G, (b+1)*G) in order; dp rank r gets its contiguous slice.

    (Lightning's automatic DistributedSampler always shuffles training data, so the
    parity tests use ultrascale's sampler without shuffling instead.)
    """

    def __init__(self, dataset: Dataset, global_batch: int) -> None:
        super().__init__()
        self.dataset, self.global_batch = dataset, global_batch

    def train_dataloader(self) -> DataLoader:
        layout = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = ResumableBlockSampler(self.dataset, self.global_batch, shuffle=False, **layout)
        return DataLoader(self.dataset, batch_size=sampler.local_batch_size, sampler=sampler, drop_last=True)


def wide(t: torch.Tensor) -> torch.Tensor:
    """fp32, or fp64 kept (a `precision="64-true"` run's numbers, compared to ~1e-12)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def full(t: torch.Tensor) -> torch.Tensor:
    return wide((t.full_tensor() if isinstance(t, DTensor) else t).detach()).clone().cpu()


class _StepLogger(Logger):
    """Keeps what Lightning logs, per optimizer step, on every rank (built-in loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "parity"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.steps.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items()})


class Recorder(L.Callback):
    """The logged `train_loss` of every optimizer step, the gradients the optimizer sees at the first
    step (after normalisation, before clipping) and the weights after it.

    Pass `recorder.logger` as the Trainer's logger with `log_every_n_steps=1` (see `parity_trainer`).
    """

    def __init__(self) -> None:
        self.logger = _StepLogger()
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.first_params: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_grads is not None and self.first_params is None and trainer.global_step == 1:
            self.first_params = {n: full(p) for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.first_grads is None:
            engine = engine_for(optimizer, getattr(trainer.strategy, "zero_engines", ()))
            if engine is not None:  # ZeRO-1/2: the reduced gradients are sharded slices of flat buckets
                self.first_grads = {n: wide(g) for n, g in engine.full_gradients().items()}
            else:
                self.first_grads = {n: full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}

    @property
    def losses(self) -> list[float]:
        return [metrics["train_loss"] for _, metrics in sorted(self.logger.steps.items()) if "train_loss" in metrics]

    @property
    def grad_norms(self) -> list[float]:
        """The logged global gradient norm of every step (before clipping); empty under `nonfinite="off"`."""
        return [metrics["grad_norm"] for _, metrics in sorted(self.logger.steps.items()) if "grad_norm" in metrics]

    def result(self) -> dict[str, Any]:
        return {"losses": self.losses, "grads": self.first_grads, "params": self.first_params,
                "grad_norms": self.grad_norms}


def parity_trainer(world_size: int, strategy: Any, recorder: Recorder, steps: int, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer that logs every step into `recorder` and does nothing else on the side."""
    return L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=recorder.logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder, *kwargs.pop("callbacks", [])], **kwargs,
    )


def step_losses(results: list[dict[str, Any]]) -> list[float]:
    """The logged per-step losses, which every rank must have logged identically."""
    for rank, result in enumerate(results[1:], start=1):
        assert result["losses"] == results[0]["losses"], f"rank {rank} logged other losses than rank 0"
    return results[0]["losses"]


def inline_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The definition, written out: sum of token cross-entropies over valid labels / their number."""
    valid = labels != -100
    log_probs = F.log_softmax(wide(logits), dim=-1)  # (B, T, V)
    token_losses = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (token_losses * valid).sum() / valid.sum().clamp(min=1)


def grad_norm(params: Any) -> float:
    """The global L2 norm of `params`' gradients, what the strategies log as `grad_norm` (before clipping)."""
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def reference_run(
    module: L.LightningModule,
    dataset: Dataset,
    *,
    global_batch: int,
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    backward_on_sums: bool = False,
) -> dict[str, Any]:
    """Single-process training of `module`'s model: one forward and backward per step over the whole
    global batch (`accumulate` micro-batches of `global_batch` rows), loss written inline.

    `backward_on_sums`: instead, one backward per micro-batch of its token sum / `accumulate`, and the summed
    gradients scaled by `accumulate` / (the step's valid tokens) after, the order the strategies take. The same
    gradient; for an fp64 comparison the same numbers too, where the model computes in fp32 inside (transformers'
    norms cast to fp32: their backward rounds the incoming gradient, whose mantissas depend on where 1/N was
    applied)."""
    module = copy.deepcopy(module)
    module.configure_model()
    configured = module.configure_optimizers()
    scheduler = None
    if isinstance(configured, dict):
        optimizer = configured["optimizer"]
        scheduler = configured.get("lr_scheduler", {}).get("scheduler")
    else:
        optimizer = configured
    batches = iter(DataLoader(dataset, batch_size=global_batch * accumulate, shuffle=False, drop_last=True))
    losses: list[float] = []
    norms: list[float] = []
    out: dict[str, Any] = {"grads": None, "params": None}
    for step in range(steps):
        batch = next(batches)
        if backward_on_sums:
            valid = int((batch["labels"] != -100).sum())
            total = 0.0
            for rows in range(0, global_batch * accumulate, global_batch):
                micro = {key: value[rows : rows + global_batch] for key, value in batch.items()}
                positions = (micro["position_ids"],) if "position_ids" in micro else ()
                count = int((micro["labels"] != -100).sum())
                token_sum = inline_token_loss(module(micro["input_ids"], *positions), micro["labels"]) * count
                (token_sum / accumulate).backward()
                total += float(token_sum.detach())
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(accumulate / max(valid, 1))
            losses.append(total / max(valid, 1))
        else:
            positions = (batch["position_ids"],) if "position_ids" in batch else ()  # packed documents
            loss = inline_token_loss(module(batch["input_ids"], *positions), batch["labels"])
            loss.backward()
            losses.append(float(loss.detach()))
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        norms.append(grad_norm(module.parameters()))
        if clip is not None and clip_algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if step == 0:
            out["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["losses"] = losses
    out["grad_norms"] = norms
    out["final_params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return out


def merge_stages(results: list[dict[str, Any]], strip: str = "") -> dict[str, Any]:
    """Each rank records the gradients and weights of the parameters it holds; together they are the model's.
    A parameter several ranks hold (a tied weight's two pipeline ends) must be recorded equal on each, and so must
    the logged gradient norms (one global number a step).
    `strip`: a wrapper's name part to drop (activation checkpointing's)."""
    from torch.testing import assert_close

    merged: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "params": {}}
    for result in results:
        for key in merged:
            for name, value in result[key].items():
                name = name.replace(strip, "") if strip else name
                if name in merged[key]:
                    assert_close(value, merged[key][name], rtol=0, atol=0, msg=lambda m: f"{key} {name} differs: {m}")
                merged[key][name] = value
    norms = [result.get("grad_norms") for result in results]
    assert all(n == norms[0] for n in norms), f"ranks logged different gradient norms: {norms}"
    return {**merged, "grad_norms": norms[0]}


def assert_parity(result: dict[str, Any], reference: dict[str, Any], losses: list[float], param_atol: float = 5e-5) -> None:
    """fp32 parity: first-step loss and every gradient, weights after step 1, the whole loss curve, and the logged
    global gradient norm of every step (where the run logged it: not under `nonfinite="off"`). The norm is compared
    on its own because a clip's coefficient hardly shows in Adam's update: an EP run whose norm missed the experts
    passed every other check here."""
    from torch.testing import assert_close

    if result.get("grad_norms"):
        norms, expected = torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"])
        assert len(norms) == len(expected), f"{len(norms)} logged gradient norms, {len(expected)} steps"
        assert_close(norms[0], expected[0], rtol=1e-5, atol=0, msg=lambda m: f"first step's gradient norm: {m}")
        assert_close(norms, expected, rtol=1e-3, atol=0, msg=lambda m: f"gradient norms: {m}")

    assert len(losses) == len(reference["losses"]), f"{len(losses)} logged step losses, {len(reference['losses'])} steps"
    assert_close(losses[0], reference["losses"][0], rtol=1e-5, atol=1e-6)
    assert set(result["grads"]) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    for name, param in reference["params"].items():
        # Adam's first update is lr * g / (|g| + eps), whose slope lr/eps at g ~ 0 amplifies the
        # reduction-order noise of tiny gradients; the parity modules use eps = 1e-6 (lr/eps = 3e3),
        # so 5e-5 is 1.7% of one update (lr = 3e-3) while a wrong gradient moves a weight by ~lr.
        # Measured too tight: 1e-5 (one element of 1024 off by 1.4e-5 when the reference summed on one
        # thread, within it on two) and 3e-5 (one of 2048 off by 3.03e-5 under CP with packed documents
        # on an AVX-512 CPU, whose kernels sum in another order than AVX2's).
        assert_close(result["params"][name], param, rtol=1e-5, atol=param_atol, msg=lambda m: f"param {name}: {m}")
    assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=0, atol=1e-4)


def make_hf_checkpoint(folder: Any, arch: str, *, vocab_size: int, hidden_size: int = 64, layers: int = 2,
                       **overrides: Any) -> str:
    """A tiny, untied Hugging Face checkpoint of `arch` ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2",
    "gemma3" (text-only Gemma3ForCausalLM), "granite_swa" (per-head attention sinks), and the MoE "mixtral", "qwen3_moe",
    "qwen2_moe" (with a gated shared expert) with 4 experts, 2 per token) saved
    to `folder`, with weights perturbed away from their init (so every parameter matters).
    `overrides` are further config fields (e.g. `head_dim=16`)."""
    import transformers

    config_class = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                    "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
                    "phi3": transformers.Phi3Config, "olmo2": transformers.Olmo2Config,
                    "gemma3": transformers.Gemma3TextConfig,
                    "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
                    "qwen2_moe": transformers.Qwen2MoeConfig, "granite_swa": transformers.GraniteSWAConfig}[arch]
    extra: dict[str, Any] = {"sliding_window": None} if arch in ("mistral", "mixtral") else {}
    if arch in ("phi3", "olmo2", "gemma3", "granite_swa"):  # their default special tokens lie outside a tiny vocabulary
        extra.update(pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if arch == "mixtral":  # 4 experts, 2 per token
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size, norm_topk_prob=True,
                     shared_expert_intermediate_size=hidden_size, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen3_moe":
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])
    config = config_class(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, tie_word_embeddings=False, **{**extra, **overrides})
    return save_perturbed_hf(config, folder)


def save_perturbed_hf(config: Any, folder: Any, auto_class: str = "AutoModelForCausalLM") -> str:
    """The model of a Hugging Face `config` with every weight moved off its init (norms at 1 and biases at 0 would
    hide mistakes), seeded, saved to `folder` with `save_pretrained`."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, auto_class).from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder)
    return str(folder)


def save_perturbed_multimodal(config: Any, folder: Any) -> str:
    """`save_perturbed_hf` of a multimodal (image-text-to-text) model: the composite checkpoint as the Hub ships Gemma 3,
    Llama 4 and Qwen 3.5, the language model's keys beside the vision tower's."""
    return save_perturbed_hf(config, folder, "AutoModelForImageTextToText")


def make_hf(path: str, export_dir: Optional[str] = None, **kwargs: Any) -> L.LightningModule:
    """`HFCausalLM` with the parity tests' optimizer settings (constant LR 3e-3 after one warm-up step, eps 1e-6)."""
    from ultrascale.models.hf import HFCausalLM

    return HFCausalLM(path, learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6,
                      export_dir=export_dir, **kwargs)


class BatchesSeen(L.LightningModule):
    """Trains nothing (lr 0) and keeps the `key` tensor of every batch it is given: what a resume must replay."""

    def __init__(self, key: str = "input_ids") -> None:
        super().__init__()
        self.key = key
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[self.key].clone())
        return self.w * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

