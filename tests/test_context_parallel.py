"""Context parallel: the sequence of every batch split over cp ranks (ultrascale.parallel.context).

Attention alone is compared with full causal SDPA (float64 reference, fp32 under test) for both
exchange methods, cp 2 and 4, with and without the zig-zag layout and with packed-document masks.
Whole models train on prompt-masked data against the inline single-process reference of
tests/_parity.py: first-step loss and every gradient, the weights after step 1, 10-step curve.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import ultrascale
from tests._dist import init_gloo, run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from ultrascale.models.lm import LlamaLM
from ultrascale.parallel.context import ContextLayout, ContextParallel, document_ids

# ----------------------------------------------------------------------------- attention alone

B, H, H_KV, D = 2, 4, 2, 8


def _packed_positions(seq_len: int) -> torch.Tensor:
    """Two rows of packed documents whose boundaries fall inside chunks, unevenly."""
    first = torch.cat([torch.arange(5), torch.arange(seq_len - 5)])
    second = torch.cat([torch.arange(seq_len // 2 + 3), torch.arange(3), torch.arange(seq_len // 2 - 6)])
    return torch.stack([first, second])


def _reference_attention(q, k, v, positions):
    if positions is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    documents = document_ids(positions)
    seq_len = positions.shape[1]
    allowed = (documents[:, :, None] == documents[:, None, :]) & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=True)


def _attention_worker(rank, world_size, method, load_balance, packed):
    torch.set_num_threads(1)
    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    seq_len = 8 * world_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_KV, seq_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64)
    positions = _packed_positions(seq_len) if packed else None
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = _reference_attention(*full, positions)
    expected.backward(grad_out)

    cp = ContextParallel(mesh, method, load_balance)
    batch = {"input_ids": torch.zeros(B, seq_len, dtype=torch.long)}
    if positions is not None:
        batch["position_ids"] = positions
    cp.shard_batch(batch)
    mine = cp.layout.token_index(rank)
    local = [x.float()[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    out = cp.attention(*local)
    out.backward(grad_out.float()[:, :, mine])
    errors = {"out": (out.double() - expected[:, :, mine]).abs().max().item()}
    for name, a, b in zip("qkv", local, full):
        errors[f"d{name}"] = (a.grad.double() - b.grad[:, :, mine]).abs().max().item()
    return errors, cp.attention_work


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("load_balance", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("method", ["allgather", "ring"])
@pytest.mark.parametrize("world", [2, 4])
def test_attention_matches_full_causal_sdpa(world, method, load_balance, packed):
    results = run_ranks(_attention_worker, world, method, load_balance, packed)
    for rank, (errors, _) in enumerate(results):
        assert max(errors.values()) < 2e-6, f"rank {rank}: {errors}"


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_balances_attention_work(world):
    """Counted query-key pairs per rank: equal with zig-zag; without it the last rank computes
    (2cp-1)x the first (contiguous chunks r: r full blocks + one causal triangle)."""
    balanced = [work for _, work in run_ranks(_attention_worker, world, "ring", True, False)]
    contiguous = [work for _, work in run_ranks(_attention_worker, world, "ring", False, False)]
    assert len(set(balanced)) == 1
    assert contiguous == sorted(contiguous) and contiguous[-1] > 2 * contiguous[0]
    # Both compute the causal half of the T x T scores (plus the diagonals), none of the masked half.
    seq_len = 8 * world
    assert sum(balanced) == sum(contiguous) < seq_len * seq_len


def test_layout_zigzag_chunks():
    layout = ContextLayout(seq_len=16, cp=2, load_balance=True)
    assert layout.chunks_of(0) == (0, 3) and layout.chunks_of(1) == (1, 2)
    assert layout.token_index(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.token_index(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="multiple of 4"):
        ContextLayout(seq_len=18, cp=2, load_balance=True)


# ----------------------------------------------------------------------------- whole model

SEQ, MICRO_BATCH, STEPS = 32, 4, 10


def masked_data(seed: int = 5, vocab: int = 512) -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH, SEQ, vocab, seed=seed, masked=True, empty_rows=[6])


def make_llama() -> LlamaLM:
    return LlamaLM(preset="tiny", learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)


def _train_llama(rank, world_size, make_strategy):
    recorder = Recorder()
    trainer = parity_trainer(world_size, make_strategy(), recorder, STEPS)
    trainer.fit(make_llama(), ParityData(masked_data(), MICRO_BATCH))
    return recorder.result()


LLAMA_LAYOUTS = {
    "cp2-allgather": (2, lambda: ultrascale.ContextParallelStrategy(context_parallel=2)),
    "cp2-ring": (2, lambda: ultrascale.ContextParallelStrategy(context_parallel=2, context_parallel_method="ring")),
    "dp2xcp2": (4, lambda: ultrascale.UltraScaleStrategy(data_parallel_shard=2, context_parallel=2, context_parallel_method="ring")),
    "cp2xtp2": (4, lambda: ultrascale.ContextParallelStrategy(context_parallel=2, tensor_parallel=2)),
}


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_parity(layout):
    world, make_strategy = LLAMA_LAYOUTS[layout]
    reference = reference_run(make_llama(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train_llama, world, make_strategy)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    assert_parity(results[0], reference, losses)
