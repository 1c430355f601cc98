"""Context parallel: the sequence of every batch split over cp ranks (ultrascale.parallel.context).

Attention alone is compared with full causal SDPA (float64 reference, fp32 under test) for the three
methods (all-gather, ring, all-to-all), cp 2 and 4, with and without the zig-zag layout and with packed-document masks.
Whole models train on prompt-masked data against the inline single-process reference of
tests/_parity.py: first-step loss and every gradient, the weights after step 1, 10-step curve.
"""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing import assert_close

import ultrascale
from tests._dist import init_gloo, run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    assert_parity,
    make_hf,
    make_hf_checkpoint,
    parity_trainer,
    reference_run,
    step_losses,
)
from ultrascale.models.lm import LlamaLM
from ultrascale.parallel.context import ContextLayout, ContextParallel, document_ids
from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import batch_problems

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


def _ulysses(method):
    return 2 if method == "usp" else None  # USP at cp 4: 2 ring x 2 Ulysses


METHODS_OF_WORLD = {2: ("allgather", "ring", "alltoall"), 4: ("allgather", "ring", "alltoall", "usp")}


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

    cp = ContextParallel(mesh, method, load_balance, ulysses=_ulysses(method))
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
@pytest.mark.parametrize("world,method", [(w, m) for w, methods in METHODS_OF_WORLD.items() for m in methods])
def test_attention_matches_full_causal_sdpa(world, method, load_balance, packed):
    results = run_ranks(_attention_worker, world, method, load_balance, packed)
    for rank, (errors, _) in enumerate(results):
        assert max(errors.values()) < 2e-6, f"rank {rank}: {errors}"


def _variant_reference(q, k, v, positions, window, softcap, sinks, scale):
    """The attention of the models that vary it, written out in float64: causal, same document, a key fewer than
    `window` tokens back, scores soft-capped c·tanh(S/c), one sink logit per head taking probability mass."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    t = q.shape[2]
    position = torch.arange(t)
    allowed = (position[:, None] >= position[None, :]).expand(q.shape[0], t, t)
    if positions is not None:
        documents = document_ids(positions)
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    if window is not None:
        allowed = allowed & ((position[:, None] - position[None, :]) < window)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, t, 1)], -1)
    probs = torch.softmax(scores, -1)
    return probs[..., :t] @ v


def _variant_worker(rank, world_size, method, packed, window, softcap, use_sinks, v_dim):
    torch.set_num_threads(1)
    init_gloo(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    seq_len = 8 * world_size
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, seq_len, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_KV, seq_len, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_KV, seq_len, v_dim, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, generator=g, dtype=torch.float64) if use_sinks else None
    grad_out = torch.randn(B, H, seq_len, v_dim, generator=g, dtype=torch.float64)
    positions = _packed_positions(seq_len) if packed else None
    scale = 0.3  # not 1/sqrt(D): the custom query scaling of Gemma / MLA models
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    full_sinks = sinks.clone().requires_grad_() if use_sinks else None
    expected = _variant_reference(*full, positions, window, softcap, full_sinks, scale)
    expected.backward(grad_out)

    cp = ContextParallel(mesh, method, True, ulysses=_ulysses(method))
    batch = {"input_ids": torch.zeros(B, seq_len, dtype=torch.long)}
    if positions is not None:
        batch["position_ids"] = positions
    cp.shard_batch(batch)
    mine = cp.layout.token_index(rank)
    local = [x.float()[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    local_sinks = sinks.float().clone().requires_grad_() if use_sinks else None
    out = cp.attention(*local, scale=scale, window=window, softcap=softcap, sinks=local_sinks)
    out.backward(grad_out.float()[:, :, mine])
    errors = {"out": (out.double() - expected[:, :, mine]).abs().max().item()}
    for name, a, b in zip("qkv", local, full):
        errors[f"d{name}"] = (a.grad.double() - b.grad[:, :, mine]).abs().max().item()
    if use_sinks:  # each rank's share of the sinks' gradient sums to the whole
        total = local_sinks.grad.clone()
        torch.distributed.all_reduce(total)
        errors["dsinks"] = (total.double() - full_sinks.grad).abs().max().item()
    return errors


VARIANTS = {  # name: (methods, window, softcap, sinks, v head size)
    "sliding-window": (("allgather", "ring", "alltoall", "usp"), 5, None, False, D),
    "window-wider-than-sequence": (("ring", "alltoall"), 1000, None, False, D),
    "mla-head-sizes": (("allgather", "ring", "alltoall"), None, None, False, D // 2),
    "softcap+window": (("allgather", "ring", "alltoall"), 6, 2.0, False, D),
    "sinks+window": (("allgather", "ring", "alltoall", "usp"), 6, None, True, D),
    "softcap+sinks+mla": (("ring", "alltoall", "usp"), None, 2.0, True, D // 2),
}
"""USP (world 4 only: 2 ring x 2 Ulysses) where its Ulysses half moves what the ring reads: the window's global
positions, each rank's heads' sinks, V's head size."""


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world", [2, 4])
def test_attention_variants_match_the_written_out_attention(world, variant, packed):
    """Sliding windows, other query scales, V narrower than Q/K (multi-head latent attention), soft-capping and
    sinks, with and without packed documents, against the attention written out in float64."""
    methods, window, softcap, sinks, v_dim = VARIANTS[variant]
    for method in (m for m in methods if m in METHODS_OF_WORLD[world]):
        results = run_ranks(_variant_worker, world, method, packed, window, softcap, sinks, v_dim)
        for rank, errors in enumerate(results):
            assert max(errors.values()) < 2e-6, f"{method} rank {rank}: {errors}"


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


def test_the_layout_and_the_strategys_batch_check_share_one_rule():
    """`ContextLayout` (a raw loop's cut) and `batch_problems` (the strategy's check before any collective) accept and
    refuse the same lengths, with and without load balance."""
    dims = ParallelDims.resolve(4, dp_shard=1, cp=4)
    for load_balance in (True, False):
        for seq_len in range(4, 41):
            try:
                ContextLayout(seq_len=seq_len, cp=4, load_balance=load_balance)
                layout_error = None
            except ValueError as error:
                layout_error = str(error)
            problems = batch_problems(dims, seq_len=seq_len, load_balance=load_balance)
            assert (layout_error is None) == (not problems), (seq_len, load_balance)
            assert (seq_len % (8 if load_balance else 4) == 0) == (layout_error is None)
    assert "cp=4 chunks" in batch_problems(dims, seq_len=18, load_balance=False)[0].message


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
    "cp2-allgather": (2, lambda: ultrascale.ContextParallelStrategy(context_parallel=2, context_parallel_method="allgather")),
    "cp2-ring": (2, lambda: ultrascale.ContextParallelStrategy(context_parallel=2)),  # the default method
    "dp2xcp2": (4, lambda: ultrascale.UltraScaleStrategy(data_parallel_shard=2, context_parallel=2)),
    "cp2xtp2": (4, lambda: ultrascale.ContextParallelStrategy(context_parallel=2, tensor_parallel=2)),
    # Ulysses. tiny has 4 query / 2 kv heads: under tp2 each cp rank gets 1 query head of the 2 and the one kv head
    # is repeated to split over cp.
    "cp2-alltoall": (2, lambda: ultrascale.ContextParallelStrategy(context_parallel=2, context_parallel_method="alltoall")),
    "dp2xcp2-alltoall": (4, lambda: ultrascale.UltraScaleStrategy(data_parallel_shard=2, context_parallel=2,
                                                                  context_parallel_method="alltoall")),
    # ... and ZeRO-1 over the two cp ranks of each tp group (they hold the same weights).
    "cp2xtp2-alltoall-zero1": (4, lambda: ultrascale.UltraScaleStrategy(
        context_parallel=2, tensor_parallel=2, data_parallel_shard=1, context_parallel_method="alltoall", zero_stage=1,
        zero_bucket_mb=0.05)),
    "accelerate-sp2": (2, lambda: ultrascale.UltraScaleStrategy.from_accelerate({"dp_shard_size": 1, "sp_size": 2})),
}


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_parity(layout):
    world, make_strategy = LLAMA_LAYOUTS[layout]
    reference = reference_run(make_llama(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train_llama, world, make_strategy)
    losses = step_losses(results)
    assert all(math.isfinite(v) for v in losses)
    assert_parity(results[0], reference, losses)


def _train_packed(rank, world_size, method):
    recorder = Recorder()
    strategy = ultrascale.ContextParallelStrategy(context_parallel=world_size, context_parallel_method=method,
                                                  context_parallel_ulysses=_ulysses(method))
    trainer = parity_trainer(world_size, strategy, recorder, STEPS)
    trainer.fit(make_llama(), ParityData(packed_data(), MICRO_BATCH))
    return recorder.result()


def packed_data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH, SEQ, 512, seed=6, masked=True, packed=True)


@pytest.mark.parametrize("method", ["allgather", "ring", "alltoall", "usp"])
def test_llama_packed_documents_parity(method):
    """Packed documents (position_ids restarting at 0 inside chunks): the document masks are read from
    the whole sequence before it is cut; the reference runs the whole sequence with its own mask. USP runs cp 4 as
    2 ring x 2 Ulysses (8 chunks of 4 tokens, each Ulysses group's 4 chunks in sequence order on the ring)."""
    data = packed_data()
    assert (data.positions[:, 1:] == 0).any(dim=1).sum() > len(data) // 2  # most rows hold several documents
    reference = reference_run(make_llama(), data, global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train_packed, 4 if method == "usp" else 2, method)
    assert_parity(results[0], reference, step_losses(results))


# ----------------------------------------------------------------------------- Hugging Face checkpoints

HF_VOCAB = 128


def hf_data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH, SEQ, HF_VOCAB, seed=7, masked=True, empty_rows=[5])


def _train_hf(rank, world_size, path, strategy_kwargs, export_dir):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    module = make_hf(path, export_dir)
    trainer.fit(module, ParityData(hf_data(), MICRO_BATCH))
    return {**recorder.result(), "attn": module.model.config._attn_implementation}


# Qwen3 and Llama at cp2 (ring and all-to-all, with accumulation) are cells of tests/test_hf_matrix.py; these add
# Qwen2's and Mistral's attention and the world-4 combinations.
HF_LAYOUTS = {
    "qwen2-cp2": ("qwen2", 2, {"context_parallel": 2}),
    "qwen2-dp2xcp2": ("qwen2", 4, {"context_parallel": 2, "data_parallel_shard": 2, "context_parallel_method": "allgather"}),
    "mistral-cp2": ("mistral", 2, {"context_parallel": 2}),
    "llama-cp2xtp2": ("llama", 4, {"context_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 1,
                                   "context_parallel_method": "allgather"}),
    "qwen2-cp2-alltoall": ("qwen2", 2, {"context_parallel": 2, "context_parallel_method": "alltoall"}),
    "llama-dp2xcp2-alltoall": ("llama", 4, {"context_parallel": 2, "data_parallel_shard": 2,
                                            "context_parallel_method": "alltoall"}),
    "qwen2-cp2xtp2-alltoall": ("qwen2", 4, {"context_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 1,
                                            "context_parallel_method": "alltoall"}),
}


@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_hf_parity_and_export(tmp_path, layout):
    import transformers

    arch, world, kwargs = HF_LAYOUTS[layout]
    path = make_hf_checkpoint(tmp_path / "source", arch, vocab_size=HF_VOCAB)
    reference = reference_run(make_hf(path), hf_data(), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_train_hf, world, path, kwargs, str(tmp_path / "exported"))
    assert results[0]["attn"] == "ultrascale_context_parallel"  # HF's own modelling code, our attention function
    # Weights after step 1 within 3e-5 = 1% of one Adam update (lr 3e-3) instead of the harness's 1e-5:
    # Qwen3's embedding has entries whose gradient is ~1e-8, where Adam's first update (slope lr/eps =
    # 3e3) turns summation-order noise into 1.6e-5 (the same with both methods); gradients match to 1e-6.
    assert_parity(results[0], reference, step_losses(results))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    assert exported.config._attn_implementation != "ultrascale_context_parallel"  # a plain HF folder again
    final = {name[len("model."):]: value for name, value in reference["final_params"].items()}
    state = exported.state_dict()
    assert set(state) == set(final)
    for name, value in final.items():
        # Ten Adam steps of one-process vs cp reduction order: far below one update (lr 3e-3).
        assert_close(state[name], value, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- with other features


def _train_llama_with(rank, world_size, strategy, callbacks, precision):
    recorder = Recorder()
    trainer = parity_trainer(world_size, strategy, recorder, STEPS, callbacks=callbacks, precision=precision)
    trainer.fit(make_llama(), ParityData(masked_data(), MICRO_BATCH))
    return recorder.result()


def test_activation_checkpointing_recomputes_with_the_same_layout():
    """Full activation checkpointing reruns attention in backward: it must see the batch's layout."""
    from ultrascale.callbacks import ActivationCheckpointing

    reference = reference_run(make_llama(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    strategy = ultrascale.ContextParallelStrategy(context_parallel=2, context_parallel_method="ring")
    results = run_ranks(_train_llama_with, 2, strategy, [ActivationCheckpointing(mode="full")], "32-true")
    wrapped = "_checkpoint_wrapped_module."  # named_parameters shows the wrapper; state dicts do not
    result = {key: {n.replace(wrapped, ""): t for n, t in results[0][key].items()} for key in ("grads", "params")}
    assert_parity(result, reference, step_losses(results))


def test_bf16_mixed_trains_close_to_fp32():
    reference = reference_run(make_llama(), masked_data(), global_batch=MICRO_BATCH, steps=STEPS)
    strategy = ultrascale.ContextParallelStrategy(context_parallel=2)
    results = run_ranks(_train_llama_with, 2, strategy, [], "bf16-mixed")
    assert_close(torch.tensor(step_losses(results)), torch.tensor(reference["losses"]), rtol=0, atol=2e-2)


# ----------------------------------------------------------------------------- bad input


def _odd_sequence(rank, world_size, seq_len, where):
    import lightning as L
    import torch.distributed as dist

    from tests._dist import counting_calls

    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        strategy=ultrascale.ContextParallelStrategy(context_parallel=2))
    data = ParityData(TokenDataset(8, seq_len, 512), 4)
    if where == "datamodule":
        data.seq_len = seq_len  # what ultrascale's data modules expose
    names = ("broadcast", "all_gather_single", "all_gather_into_tensor", "all_reduce", "batch_isend_irecv")
    with counting_calls(dist, *names) as calls:
        try:
            trainer.fit(make_llama(), data)
        except ValueError as error:
            cp = trainer.strategy._context_parallel
            return {"error": str(error), "initialized": dist.is_initialized(), "collectives": sum(calls.values()),
                    "attention_work": cp.attention_work if cp is not None else None}
    return {"error": None}


@pytest.mark.parametrize("where", ["datamodule", "batch"])
def test_sequence_not_dividing_2cp_fails_before_any_collective(where):
    """Known from the data module: refused before the process group exists. Known only from the
    first batch: refused before the batch's tokens are exchanged."""
    results = run_ranks(_odd_sequence, 2, 30, where)
    for result in results:
        assert result["error"] is not None and "sequence length 30" in result["error"]
        assert "2*cp=4 load-balanced chunks" in result["error"] and "use 28 or 32" in result["error"]
        if where == "datamodule":
            assert not result["initialized"] and result["collectives"] == 0
        else:  # weights were broadcast at setup, but attention never ran: no K/V was exchanged
            assert result["attention_work"] == 0


def test_unsupported_models_are_refused_by_name():
    import transformers

    from tests._rules import check_layout

    generic = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))
    with pytest.raises(ValueError, match="context parallel \\(cp=2\\) has no attention hook for generic.*AttentionInterface"):
        check_layout(generic, cp=2)
    # Capabilities come from structure, not from a list of names: GPT-NeoX's attention runs through the interface.
    config = transformers.GPTNeoXConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=16)
    check_layout(transformers.GPTNeoXForCausalLM(config), cp=2)
    # Qwen3-Next's linear-attention layers have no context-parallel kernel: the layer is named.
    config = transformers.Qwen3NextConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=16, num_experts=2, num_experts_per_tok=1,
                                          layer_types=["full_attention", "linear_attention"])
    with torch.device("meta"):
        qwen3_next = transformers.Qwen3NextForCausalLM(config)
    with pytest.raises(ValueError, match="layer 1 of .* is 'linear_attention' \\(config.layer_types\\); only softmax"):
        check_layout(qwen3_next, cp=2)
    with pytest.raises(ValueError, match="context_parallel_method='zigzag'"):
        ultrascale.ContextParallelStrategy(context_parallel=2, context_parallel_method="zigzag")


def test_alltoall_needs_the_heads_of_a_tp_rank_to_split_over_cp():
    """Ulysses gives each cp rank whole heads: refused by the rulebook (before any process group) otherwise."""
    from ultrascale.models.adapters import model_facts
    from ultrascale.models.llama import Llama, LlamaConfig
    from ultrascale.parallel.dims import ParallelDims
    from ultrascale.parallel.rules import LayoutKnobs, model_problems

    with torch.device("meta"):
        facts = model_facts(Llama(LlamaConfig.from_preset("tiny")))  # 4 query heads, 2 kv heads
    assert facts.attention_heads == 4

    def problems(cp, tp, method="alltoall"):
        dims = ParallelDims.resolve(cp * tp, dp_shard=1, cp=cp, tp=tp)
        return [p.text() for p in model_problems(dims, LayoutKnobs(dp_shard=1, cp=cp, tp=tp, context_parallel_method=method),
                                                 facts)]

    assert problems(cp=4, tp=1) == [] and problems(cp=2, tp=2) == []  # kv heads are repeated, never refused
    (message,) = problems(cp=4, tp=2)
    assert "4 query heads / tensor_parallel=2 = 2 per tp rank do not split over cp=4" in message
    assert "cp degrees that fit: [2]" in message and "`context_parallel_method='alltoall'`" in message
    assert problems(cp=4, tp=2, method="ring") == []  # the ring splits the sequence only
    assert "do not split over cp=8" in problems(cp=8, tp=1)[0]


def test_usp_knobs_are_refused_before_any_process_starts():
    """USP's Ulysses degree: given with method 'usp' only, 2 or more, dividing cp and smaller than it; the heads of a
    tp rank split over it (not over cp). Each is the rulebook's ValueError, from the constructor or `resolve_dims`."""
    from ultrascale.models.adapters import model_facts
    from ultrascale.models.llama import Llama, LlamaConfig
    from ultrascale.parallel.rules import LayoutKnobs, model_problems

    with pytest.raises(ValueError, match="USP needs the Ulysses degree"):
        ultrascale.UltraScaleStrategy(context_parallel=4, context_parallel_method="usp")
    with pytest.raises(ValueError, match="splits cp for context_parallel_method='usp' only"):
        ultrascale.UltraScaleStrategy(context_parallel=4, context_parallel_ulysses=2)
    for cp, ulysses, fits in ((4, 4, "[2]"), (6, 4, "[2, 3]"), (2, 2, "none")):
        strategy = ultrascale.UltraScaleStrategy(data_parallel_shard=1, context_parallel=cp, context_parallel_method="usp",
                                                 context_parallel_ulysses=ulysses)
        with pytest.raises(ValueError, match=rf"divides cp={cp} and is smaller: {re.escape(fits)}"):
            strategy.resolve_dims(cp)
    with torch.device("meta"):
        facts = model_facts(Llama(LlamaConfig.from_preset("tiny")))  # 4 query heads
    dims = ParallelDims.resolve(16, dp_shard=1, cp=8, tp=2)
    knobs = LayoutKnobs(dp_shard=1, cp=8, tp=2, context_parallel_method="usp", context_parallel_ulysses=4)
    (message,) = [p.text() for p in model_problems(dims, knobs, facts)]
    assert "2 per tp rank do not split over 4. Ulysses degrees that fit: [2]" in message
    assert model_problems(dims, dataclasses.replace(knobs, context_parallel_ulysses=2), facts) == []


def test_padding_masks_are_refused():
    from unittest import mock

    mesh = mock.Mock(ndim=1, size=lambda: 2, get_local_rank=lambda: 0)
    cp = ContextParallel(mesh)
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}
    with pytest.raises(ValueError, match="does not take padding masks"):
        cp.shard_batch(batch)
    batch["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    local = cp.shard_batch(batch)
    assert "attention_mask" not in local and local["position_ids"][0].tolist() == [0, 1, 6, 7]


def test_registered_name_uses_every_device_of_the_node_for_cp():
    import lightning as L

    trainer = L.Trainer(strategy="ultrascale_cp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ultrascale.ContextParallelStrategy)
    assert trainer.strategy.parallel_dims.cp == 2 and trainer.strategy.parallel_dims.dp_shard == 1
    assert trainer.strategy.context_layout is None  # no batch yet
