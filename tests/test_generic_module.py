"""A LightningModule ultrascale has never seen (plain torch, no adapter, parameters of its own) trains
under ultrascale_zero3 with the public loss opt-in and matches a single-process run on masked data."""

import lightning as L
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
