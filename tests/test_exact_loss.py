"""The loss of an optimizer step is sum(token losses) / valid tokens of the whole global batch,
for every layout and any gradient accumulation, on prompt-masked data whose valid-token counts
differ between rows, ranks and micro-batches (one rank's micro-batch has none at all).

Each case is compared with an inline single-process reference (tests/_parity.py) that runs the
whole global batch of a step at once: first-step loss and every gradient within fp32 tolerance,
the weights after step 1 and the 10-step curve of the logged `train_loss`.
"""

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import ultrascale
from tests._dist import counting_calls, init_gloo, run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    assert_parity,
    inline_token_loss,
    parity_trainer,
    reference_run,
    step_losses,
)
from ultrascale.models.llama import Llama, LlamaConfig
from ultrascale.models.lm import LlamaLM

SEQ, MICRO_BATCH, STEPS = 32, 8, 10
# Rows 12..15 are the last dp ranks' share of loader batch 1: a micro-batch with no valid token
# (in step 1 without accumulation, in step 0's second micro-batch with accumulation 2).
EMPTY_ROWS = range(12, 16)


def masked_data(accumulate: int, vocab: int = 512, seed: int = 3) -> TokenDataset:
    return TokenDataset(STEPS * accumulate * MICRO_BATCH, SEQ, vocab, seed=seed, masked=True, empty_rows=EMPTY_ROWS)


def test_masked_data_is_uneven():
    """The premise of every case here: valid-token counts differ between the ranks' micro-batches."""
    data = masked_data(2)
    counts = (data.labels != -100).reshape(-1, 4, SEQ).sum(dim=(1, 2))  # per 4-row slice (a rank's micro-batch at dp=2)
    assert counts[3] == 0 and len(set(counts.tolist())) > 10


def make_llama() -> LlamaLM:
    return LlamaLM(preset="tiny", learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def _train_llama(rank, world_size, make_strategy, accumulate, clip):
    recorder = Recorder()
    trainer = parity_trainer(world_size, make_strategy(), recorder, STEPS, accumulate_grad_batches=accumulate,
                             gradient_clip_val=clip)
    trainer.fit(make_llama(), ParityData(masked_data(accumulate), MICRO_BATCH))
    return recorder.result()


LAYOUTS = {
    "zero1": (2, lambda: ultrascale.ZeRO1Strategy(zero_bucket_mb=0.05)),
    "zero2": (2, lambda: ultrascale.ZeRO2Strategy(zero_bucket_mb=0.05)),
    "zero3": (2, lambda: ultrascale.ZeRO3Strategy()),
    "hsdp2x2": (4, lambda: ultrascale.HSDPStrategy(data_parallel_replicate=2)),
    "tp2xdp2": (4, lambda: ultrascale.UltraScaleStrategy(data_parallel_shard=2, tensor_parallel=2)),
    "tp2xdp2-zero1": (4, lambda: ultrascale.UltraScaleStrategy(data_parallel_shard=2, tensor_parallel=2, zero_stage=1,
                                                               zero_bucket_mb=0.05)),
    "tp2xdp2-zero2": (4, lambda: ultrascale.UltraScaleStrategy(data_parallel_shard=2, tensor_parallel=2, zero_stage=2,
                                                               zero_bucket_mb=0.05)),
}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masked_labels_match_the_global_token_mean(layout, accumulate):
    world, make_strategy = LAYOUTS[layout]
    clip = 0.5 if accumulate == 2 else None  # clipping must see the normalised gradient
    reference = reference_run(make_llama(), masked_data(accumulate), global_batch=MICRO_BATCH, steps=STEPS,
                              accumulate=accumulate, clip=clip)
    if clip is not None:
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference["grads"].values()]))
        assert norm > clip  # clipping really happens
    results = run_ranks(_train_llama, world, make_strategy, accumulate, clip)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    assert_parity(results[0], reference, losses)


# ----------------------------------------------------------------------------- a user's own module

VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 4, d // 4).transpose(1, 2) for z in self.qkv(self.norm(x)).split(d, dim=-1))  # (B, 4, T, D/4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class TiedUserLM(L.LightningModule):
    """What a user might write: layers as direct children, the head tied to the embedding, and the
    documented opt-in `ultrascale.token_loss` (or, with `plain_mean`, a plain mean loss)."""

    def __init__(self, plain_mean: bool = False) -> None:
        super().__init__()
        torch.manual_seed(123)
        self.plain_mean = plain_mean
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"])
        if self.plain_mean:
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            loss = loss / (batch["labels"] != -100).sum()
            self.log("train_loss", loss, sync_dist=True)
            return loss
        return ultrascale.token_loss(logits, batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)


def user_data(accumulate: int, empty_rows=EMPTY_ROWS) -> TokenDataset:
    return TokenDataset(STEPS * accumulate * MICRO_BATCH, SEQ, VOCAB, seed=4, masked=True, empty_rows=empty_rows)


def _train_user(rank, world_size, strategy, accumulate, plain_mean=False, empty_rows=EMPTY_ROWS):
    recorder = Recorder()
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, accumulate_grad_batches=accumulate)
    model = TiedUserLM(plain_mean)
    trainer.fit(model, ParityData(user_data(accumulate, empty_rows), MICRO_BATCH))
    return {**recorder.result(), "tied": model.head.weight is model.emb.weight}


USER_LAYOUTS = {
    "zero1": (2, "ultrascale_zero1", 2),
    "zero2": (2, "ultrascale_zero2", 2),
    "zero3": (2, "ultrascale_zero3", 2),
    "hsdp2x2": (4, "ultrascale_hsdp", 1),
}


@pytest.mark.parametrize("layout", list(USER_LAYOUTS))
def test_users_own_tied_module_with_token_loss(layout):
    """Tied embedding and head as direct children stay one weight under every ZeRO stage, and the
    public opt-in gives the exact global token mean."""
    world, strategy, accumulate = USER_LAYOUTS[layout]
    reference = reference_run(TiedUserLM(), user_data(accumulate), global_batch=MICRO_BATCH, steps=STEPS,
                              accumulate=accumulate)
    results = run_ranks(_train_user, world, strategy, accumulate)
    assert results[0]["tied"]
    assert "head.weight" not in results[0]["grads"]  # one parameter, one gradient (named after the embedding)
    assert_parity(results[0], reference, step_losses(results))


class CallsChildrenDirectly(TiedUserLM):
    """A step that never calls `self(...)`: the strategy enters the root unit around it."""

    def training_step(self, batch, batch_idx):
        x = self.emb(batch["input_ids"])
        for block in self.blocks:
            x = block(x)
        return ultrascale.token_loss(self.head(self.norm(x)), batch["labels"])


def _train_children(rank, world_size):
    recorder = Recorder()
    trainer = parity_trainer(world_size, "ultrascale_zero3", recorder, STEPS)
    trainer.fit(CallsChildrenDirectly(), ParityData(user_data(1), MICRO_BATCH))
    return recorder.result()


def test_step_that_does_not_call_the_module_itself():
    reference = reference_run(TiedUserLM(), user_data(1), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train_children, 2)
    assert_parity(results[0], reference, step_losses(results))


def test_plain_mean_module_keeps_the_mean_of_rank_means():
    """A module that returns a plain mean is averaged as before: the gradient is that of the mean over
    ranks and micro-batches of each one's own token mean (what docs/exact-loss.md describes)."""
    accumulate, world = 2, 2
    data = user_data(accumulate, empty_rows=())  # a plain mean of an empty micro-batch is 0/0
    reference = TiedUserLM()
    rows = MICRO_BATCH // world
    batch = data[0 : MICRO_BATCH * accumulate]
    means = [
        inline_token_loss(reference(batch["input_ids"][i : i + rows]), batch["labels"][i : i + rows])
        for i in range(0, MICRO_BATCH * accumulate, rows)
    ]  # one per (micro-batch, rank)
    torch.stack(means).mean().backward()
    grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    results = run_ranks(_train_user, world, "ultrascale_zero3", accumulate, True, ())
    for name, grad in grads.items():
        assert_close(results[0]["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    exact = reference_run(TiedUserLM(), data, global_batch=MICRO_BATCH, steps=1, accumulate=accumulate)["grads"]
    assert not torch.allclose(exact["emb.weight"], grads["emb.weight"], rtol=1e-3, atol=1e-5)  # masking matters here


class LogsItsOwnTrainLoss(TiedUserLM):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])  # the micro-batch mean: it would hide the exact value
        return out


def _refused(rank, world_size, module_class):
    trainer = parity_trainer(world_size, "ultrascale_zero3", Recorder(), 1)
    try:
        trainer.fit(module_class(), ParityData(user_data(1), MICRO_BATCH))
    except ValueError as error:
        return str(error)
    return None


def test_logging_train_loss_beside_the_token_count_is_refused():
    for message in run_ranks(_refused, 2, LogsItsOwnTrainLoss):
        assert message is not None and message.startswith("LogsItsOwnTrainLoss.training_step logs `train_loss` and returns")


class ManualOptimization(TiedUserLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        out = ultrascale.token_loss(self(batch["input_ids"]), batch["labels"])
        self.manual_backward(out["loss"])
        self.optimizers().step()
        return out


def test_token_count_under_manual_optimization_is_refused():
    for message in run_ranks(_refused, 2, ManualOptimization):
        assert message is not None and "understood with automatic optimization only" in message


# ----------------------------------------------------------------------------- validation loss


def _validate(rank, world_size):
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ultrascale_zero3", logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # Lightning's DistributedSampler deals the 40 rows out to the 2 ranks: 5 batches each, uneven token counts.
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(masked_data(1), range(40)), batch_size=4)
    metrics = trainer.validate(make_llama(), loader)
    return metrics[0]["val_loss"]


def test_val_loss_is_the_token_mean_over_all_ranks():
    data = masked_data(1)
    model = make_llama()
    model.configure_model()
    with torch.no_grad():
        expected = float(inline_token_loss(model(data[0:40]["input_ids"]), data[0:40]["labels"]))
    values = run_ranks(_validate, 2)
    assert values[0] == values[1]
    assert_close(values[0], expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- several backward passes per step


def _zero_three_backwards(rank, world_size, stage):
    from torch.distributed.device_mesh import init_device_mesh

    from ultrascale.parallel import zero as zero_module
    from ultrascale.parallel.loss import StepTokens, cross_entropy_sum, scale_gradients

    init_gloo(rank, world_size)
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    engine = zero_module.ZeroEngine(model, optimizer, stage=stage, dp_mesh=init_device_mesh("cpu", (world_size,)),
                                    bucket_bytes=50_000)
    data, tokens = masked_data(1), StepTokens()
    rows = MICRO_BATCH // world_size
    with counting_calls(zero_module, "_reduce_scatter") as calls:
        for micro in range(3):  # three synchronised backward passes make one step (as a pipeline schedule does)
            batch = data[micro * MICRO_BATCH + rank * rows : micro * MICRO_BATCH + (rank + 1) * rows]
            loss_sum, count = cross_entropy_sum(model(batch["input_ids"]), batch["labels"])
            loss_sum.backward()
            tokens.add(loss_sum, count)
        engine.reduce_gradients()
    _, num_tokens = tokens.reduce(dist.group.WORLD)
    scale_gradients(engine.grad_shards(), 1.0 / num_tokens)
    grads = engine.full_gradients()
    optimizer.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buckets": len(engine.buckets), "reduce_scatters": calls["_reduce_scatter"]}


def _tiny_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_preset("tiny"))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_with_three_backward_passes_per_step(stage):
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    batch = masked_data(1)[0 : 3 * MICRO_BATCH]
    inline_token_loss(model(batch["input_ids"]), batch["labels"]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    results = run_ranks(_zero_three_backwards, 2, stage)
    for result in results:
        for name, grad in grads.items():
            assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
        for name, param in model.named_parameters():
            assert_close(result["params"][name], param.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # Each synchronised backward is reduced as it ends (inside it, overlapping): three per bucket, either stage.
    assert results[0]["reduce_scatters"] == results[0]["buckets"] * 3


# ----------------------------------------------------------------------------- sequence length vs sequence parallel


def _odd_sequence(rank, world_size, sequence_parallel):
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        strategy=ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=1,
                                                               sequence_parallel=sequence_parallel))
    data = ParityData(TokenDataset(8, 31, 512), 4)
    data.seq_len = 31  # what ultrascale's data modules expose
    # Weights are broadcast, then gathered by FSDP, then TP runs in forward: none may happen before the check.
    names = ("broadcast", "all_gather_single", "all_gather_into_tensor", "all_reduce", "reduce_scatter_single")
    with counting_calls(dist, *names) as calls:
        try:
            trainer.fit(make_llama(), data)
        except ValueError as error:
            return {"error": str(error), "initialized": dist.is_initialized(), "collectives": sum(calls.values())}
    return {"error": None, "collectives": sum(calls.values())}


@pytest.mark.parametrize("sequence_parallel", [True, None])
def test_sequence_length_not_divisible_by_tp_fails_before_any_collective(sequence_parallel):
    results = run_ranks(_odd_sequence, 2, sequence_parallel)
    for result in results:
        assert result["error"] is not None
        assert "sequence length 31 of ParityData(seq_len=31) must be a multiple of 2" in result["error"]
        assert "use 30 or 32" in result["error"]
        assert result["collectives"] == 0  # not a single activation or weight was communicated
    if sequence_parallel:  # the knob was explicit: refused before the process group even exists
        assert not results[0]["initialized"]


def _odd_batch(rank, world_size):
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        strategy=ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=1))
    try:
        trainer.fit(make_llama(), ParityData(TokenDataset(8, 31, 512), 4))  # a data module without `seq_len`
    except ValueError as error:
        return str(error)
    return None


def test_odd_batch_from_any_data_module_is_refused_before_forward():
    for message in run_ranks(_odd_batch, 2):
        assert message is not None and "sequence length 31 of the batch must be a multiple of 2" in message
