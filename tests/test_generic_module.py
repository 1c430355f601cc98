"""A LightningModule ultrascale has never seen (plain torch, no adapter, parameters of its own) trains
under ultrascale_zero3 with the public loss opt-in and matches a single-process run on masked data."""

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 16, 8, 10


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class PlainTransformerLM(L.LightningModule):
    """What a user might already have: parameters built in __init__, layers as direct children."""

    def __init__(self, dim: int = 32, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(123)
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(1))  # a parameter of the LightningModule itself

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) * self.logit_scale

    def training_step(self, batch, batch_idx):
        return ultrascale.token_loss(self(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)


def _worker(rank, world_size, strategy):
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = parity_trainer(world_size, strategy, recorder, STEPS)
    model = PlainTransformerLM()
    trainer.fit(model, ParityData(data(), GLOBAL_BATCH))
    from torch.distributed.fsdp import FSDPModule

    units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    return {**recorder.result(), "units": units}


def data() -> TokenDataset:
    return TokenDataset(STEPS * GLOBAL_BATCH, SEQ, VOCAB, masked=True)


def test_unknown_lightning_module_matches_single_process():
    reference = reference_run(PlainTransformerLM(), data(), global_batch=GLOBAL_BATCH, steps=STEPS)
    results = run_ranks(_worker, 2, "ultrascale_zero3")
    # One FSDP unit per block found generically; the LightningModule itself is the root unit (embed, norm, head).
    assert results[0]["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]
    losses = step_losses(results)
    assert_parity(results[0], reference, losses)
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- docs/bring-your-own-model.md's example

def _page_module() -> type:
    """`MyLM` as docs/bring-your-own-model.md defines it (its first Python block, run as a reader would), with
    AdamW's eps at 1e-6 as in every parity test here: Adam's first step divides each gradient by its own size, so
    an element whose gradient is at rounding level (~1e-9) would move by a full step in one layout and not in
    another."""
    from tests.test_docs import DOCS, _blocks

    namespace: dict = {}
    exec(compile(_blocks(DOCS / "bring-your-own-model.md", "python")[0].code, "bring-your-own-model.md", "exec"), namespace)

    class PageLM(namespace["MyLM"]):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            for group in optimizer.param_groups:
                group["eps"] = 1e-6
            return optimizer

    return PageLM


def _page_plan() -> dict:
    """The `plan = {...}` the page's second Python block gives `TensorParallelStrategy`."""
    import ast

    from tests.test_docs import DOCS, _blocks

    tree = ast.parse(_blocks(DOCS / "bring-your-own-model.md", "python")[1].code)
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "plan"]
    return ast.literal_eval(value)


PAGE_PLAN = _page_plan()


def _page_worker(rank, world_size, knobs):
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**knobs), recorder, STEPS)
    torch.manual_seed(7)
    trainer.fit(_page_module()(), ParityData(page_data(), GLOBAL_BATCH))
    return recorder.result()


def page_data() -> TokenDataset:
    return TokenDataset(STEPS * GLOBAL_BATCH, SEQ, 258, masked=True)


@pytest.mark.parametrize("knobs", [
    {"tensor_parallel": 2, "data_parallel_shard": 1, "tp_plan": PAGE_PLAN},
    {"pipeline_parallel": 2, "pipeline_microbatches": 4, "data_parallel_shard": 1},
], ids=["tp2", "pp2"])
def test_the_docs_example_module_matches_one_process(knobs):
    torch.manual_seed(7)
    reference = reference_run(_page_module()(), page_data(), global_batch=GLOBAL_BATCH, steps=STEPS)
    results = run_ranks(_page_worker, 2, knobs)
    if "pipeline_parallel" in knobs:
        from tests._parity import merge_stages

        assert_parity(merge_stages(results), reference, step_losses(results))
    else:
        assert_parity(results[0], reference, step_losses(results))


# --------------------------------------------------------------------------- a plan that leaves out a split module


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a


class ScaledMLPLM(PlainTransformerLM):
    """A learned scale between a column- and a row-parallel layer: under tp it sees each rank's half of the features."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(5)
        self.embed, self.up, self.scale = nn.Embedding(VOCAB, 16), nn.Linear(16, 32), Scale()
        self.down, self.head = nn.Linear(32, 16), nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.down(self.scale(F.gelu(self.up(x)))))


SPLIT = {"up": "colwise", "down": "rowwise"}


def _scaled_worker(rank, world_size, plan, zero_stage=3):
    recorder = Recorder()
    strategy = ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=world_size // 2, tp_plan=plan,
                                             zero_stage=zero_stage)
    trainer = parity_trainer(world_size, strategy, recorder, STEPS)
    try:
        trainer.fit(ScaledMLPLM(), ParityData(data(), GLOBAL_BATCH))
    except ValueError as error:
        return str(error)
    return recorder.result()


def test_a_plan_that_leaves_a_split_module_out_is_stopped_at_the_first_step():
    """Each tp rank gets its half of the scale's gradient: stopped, named, before the optimizer steps on it; with the
    entry the message asks for, the run matches one process."""
    for message in run_ranks(_scaled_worker, 2, SPLIT):
        assert isinstance(message, str) and "the gradients of ['scale.a'] differ between the tp ranks" in message
        assert "'replicated_with_grad_allreduce'" in message
    results = run_ranks(_scaled_worker, 2, {**SPLIT, "scale": "replicated_with_grad_allreduce"})
    reference = reference_run(ScaledMLPLM(), data(), global_batch=GLOBAL_BATCH, steps=STEPS)
    assert_parity(results[0], reference, step_losses(results))


def _resume_worker(rank, world_size, plan, ckpt_dir, resume):
    from lightning.pytorch.callbacks import ModelCheckpoint

    saving = [] if resume else [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_last=True)]
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=4 if resume else 2, logger=False,
                        strategy=ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=1, tp_plan=plan),
                        enable_checkpointing=not resume, callbacks=saving, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(ScaledMLPLM(), ParityData(data(), GLOBAL_BATCH), ckpt_path=f"{ckpt_dir}/last.ckpt" if resume else None)
    except ValueError as error:
        return str(error)
    return trainer.global_step


def test_a_resumed_fit_is_checked_at_its_own_first_step(tmp_path):
    """The check runs at the first step of every fit, not at global step 0 only: a run resumed at step 2 with the
    plan that leaves the scale out is stopped too."""
    assert run_ranks(_resume_worker, 2, {**SPLIT, "scale": "replicated_with_grad_allreduce"}, str(tmp_path), False) == [2, 2]
    for message in run_ranks(_resume_worker, 2, SPLIT, str(tmp_path), True):
        assert isinstance(message, str) and "the gradients of ['scale.a'] differ between the tp ranks" in message


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_under_zero12_the_first_step_check_reads_the_reduced_slices(zero_stage):
    """ZeRO-1/2 let the parameters' `.grad` go once a bucket is reduced: the check sums each parameter's parts of
    the dp ranks' slices, so every rank of dp 2 x tp 2 is stopped, naming the scale, whichever slice holds it."""
    for message in run_ranks(_scaled_worker, 4, SPLIT, zero_stage):
        assert isinstance(message, str) and "the gradients of ['scale.a'] differ between the tp ranks" in message
