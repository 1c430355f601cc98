"""Every Hugging Face architecture people fine-tune today, under every layout: what runs trains like one process,
what does not is refused before any process starts, naming the missing piece.

One tiny checkpoint per architecture (2 layers, made here with `save_pretrained`), one cell per layout. A cell
that runs is held to the parity of tests/_parity.py (masked labels with uneven counts per row and micro-batch,
accumulation 2, against the inline one-process reference: first-step loss and every gradient, the weights
after step 1, the 10-step curve), and the folder it exports is re-loaded by transformers and gives the
one-process model's logits. A cell that is refused checks its message. `MATRIX` is the one statement of what
runs; `benchmarks/doc_tables.py` writes docs/huggingface.md's support table from it, and
`test_the_docs_show_this_matrix` checks the page holds that table.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import (
    ParityData,
    Recorder,
    TokenDataset,
    assert_parity,
    make_hf,
    make_hf_checkpoint,
    merge_stages,
    parity_trainer,
    reference_run,
    save_perturbed_hf,
    save_perturbed_multimodal,
    step_losses,
)

VOCAB, SEQ, MICRO_BATCH, ACCUMULATE, STEPS = 128, 32, 4, 2, 10
WINDOW = 12  # sliding windows shorter than the sequence, so the window masks something on every cp rank

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=None,
               bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (config.model_type, config fields beyond _COMMON)
    "Llama": ("llama", {}),
    "Qwen3": ("qwen3", {"head_dim": 8}),
    "Gemma2": ("gemma2", {"head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 12}),
    "Gemma3": ("gemma3_text", {"head_dim": 8, "sliding_window": WINDOW,
                               "layer_types": ["sliding_attention", "full_attention"]}),
    "Gemma3, tied": ("gemma3_text", {"head_dim": 8, "sliding_window": WINDOW, "tie_word_embeddings": True,
                                      "layer_types": ["sliding_attention", "full_attention"]}),
    "Phi3": ("phi3", {}),
    "OLMo2": ("olmo2", {}),
    "OLMo3": ("olmo3", {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "Granite": ("granite", {"embedding_multiplier": 3.0, "attention_multiplier": 0.3, "residual_multiplier": 0.5,
                            "logits_scaling": 2.0}),
    "SmolLM3": ("smollm3", {"no_rope_layers": [1, 0]}),
    "Mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "Qwen3-MoE": ("qwen3_moe", {"num_experts": 4, **_MOE, "head_dim": 8, "decoder_sparse_step": 1,
                                "mlp_only_layers": []}),
    "GPT-OSS": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": WINDOW,
                            "layer_types": ["sliding_attention", "full_attention"],
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "DeepSeek-V3": ("deepseek_v3", {"n_routed_experts": 4, **_MOE, "n_shared_experts": 1, "n_group": 1, "num_key_value_heads": 4,
                                    "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                                    "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 4,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # q/k norms per head (`use_qk_norm`, as GLM-4.5 ships), which transformers' tp plan leaves out.
    "GLM-4-MoE": ("glm4_moe", {"n_routed_experts": 4, **_MOE, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                               "first_k_dense_replace": 1, "head_dim": 8, "use_qk_norm": True}),
    # Its checkpoint holds q, k and v fused in one tensor that transformers splits while loading (`Split(dim=0)`).
    "Sarvam-MoE": ("sarvam_moe", {"n_routed_experts": 4, **_MOE, "n_shared_experts": 1, "n_group": 1,
                                  "topk_group": 1, "first_k_dense_replace": 1, "head_dim": 8, "use_qk_norm": True}),
    "OLMoE": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    # Multi-head latent attention in a dense model; embeddings scaled by `scale_emb`, residual branches by
    # `scale_depth / sqrt(layers)`, and the final hidden states divided by hidden / `dim_model_base` before the head.
    "MiniCPM3": ("minicpm3", {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 4,
                              "qk_nope_head_dim": 8, "v_head_dim": 4}),
    # Attention-free (no heads, no AttentionInterface, no plans): ZeRO only, the rest refused by name.
    "RWKV": ("rwkv", {"attention_hidden_size": 32, "context_length": 64}),
    # Windowed through its mask alone (no `sliding_window` handed to the attention function); the router's jitter
    # noise off, as it is random in training (each process would draw its own).
    "PhiMoE": ("phimoe", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                          "router_jitter_noise": 0.0}),
}
MOE = {"Mixtral", "Qwen3-MoE", "GPT-OSS", "DeepSeek-V3", "GLM-4-MoE", "Sarvam-MoE", "OLMoE", "PhiMoE"}

LAYOUTS: dict[str, dict[str, Any]] = {
    "ZeRO-3": {"data_parallel_shard": 2},
    "TP 2": {"tensor_parallel": 2, "data_parallel_shard": 1},
    "CP 2 ring": {"context_parallel": 2, "data_parallel_shard": 1},
    "CP 2 all-to-all": {"context_parallel": 2, "context_parallel_method": "alltoall", "data_parallel_shard": 1},
    "PP 2 (1F1B)": {"pipeline_parallel": 2, "pipeline_microbatches": 2, "data_parallel_shard": 1},
    "EP 2": {"expert_parallel": 2, "data_parallel_shard": 2},
}
WORLD = 2

REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    # (architecture, layout): (a regular expression the message must match, the reason in a few words for the table)
    ("OLMoE", "PP 2 (1F1B)"): (r"its config ships no `base_model_pp_plan`", "no `base_model_pp_plan`"),
    ("PhiMoE", "PP 2 (1F1B)"): (r"its config ships no `base_model_pp_plan`", "no `base_model_pp_plan`"),
    ("RWKV", "TP 2"): (r"tensor parallel has no plan for HFCausalLM \(RwkvConfig\)", "no `base_model_tp_plan`"),
    ("RWKV", "CP 2 ring"): (r"does not run through transformers' AttentionInterface", "no attention (AttentionInterface)"),
    ("RWKV", "CP 2 all-to-all"): (r"does not run through transformers' AttentionInterface", "no attention (AttentionInterface)"),
    ("RWKV", "PP 2 (1F1B)"): (r"its config ships no `base_model_pp_plan`", "no `base_model_pp_plan`"),
}


def expected(architecture: str, layout: str) -> str:
    """"runs", "refused" or "n/a" (expert parallel of a dense model)."""
    if layout == "EP 2" and architecture not in MOE:
        return "n/a"
    return "refused" if (architecture, layout) in REFUSED else "runs"


MATRIX = {(a, layout): expected(a, layout) for a in ARCHITECTURES for layout in LAYOUTS}
"""What runs, as the tests below hold it: the source of the support table in docs/huggingface.md."""


def make_checkpoint(folder: Any, architecture: str, **overrides: Any) -> str:
    import transformers

    model_type, fields = ARCHITECTURES[architecture]
    return save_perturbed_hf(transformers.CONFIG_MAPPING[model_type](**{**_COMMON, **fields, **overrides}), folder)


def data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH * ACCUMULATE, SEQ, VOCAB, seed=7, masked=True, empty_rows=[5])


@lru_cache(maxsize=None)
def _reference(architecture: str, folder: str) -> dict[str, Any]:
    return reference_run(make_hf(folder), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)


def assert_stage_parity(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """`assert_parity` of the ranks' records together: each pipeline stage records the parameters it holds."""
    assert_parity(merge_stages(results), reference, step_losses(results))


def _train(rank, world_size, path, strategy_kwargs, export_dir):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS,
                             accumulate_grad_batches=ACCUMULATE)
    trainer.fit(make_hf(path, export_dir), ParityData(data(), MICRO_BATCH))
    return recorder.result()


def _refusal(rank, world_size, path, strategy_kwargs):
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), Recorder(), 1)
    try:
        trainer.fit(make_hf(path), ParityData(data(), MICRO_BATCH))
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, str] = {}

    def get(architecture: str) -> str:
        if architecture not in made:
            made[architecture] = make_checkpoint(tmp_path_factory.mktemp(architecture), architecture)
        return made[architecture]

    return get


CELLS = [(a, layout) for (a, layout), outcome in MATRIX.items() if outcome != "n/a"]


@pytest.mark.parametrize("architecture, layout", CELLS, ids=[f"{a}-{layout}" for a, layout in CELLS])
def test_cell(architecture, layout, checkpoints, tmp_path):
    import transformers

    path = checkpoints(architecture)
    kwargs = LAYOUTS[layout]
    if MATRIX[(architecture, layout)] == "refused":
        messages = run_ranks(_refusal, WORLD, path, kwargs)
        assert messages[0] is not None, f"{architecture} under {layout} ran; the matrix says it is refused"
        assert re.search(REFUSED[(architecture, layout)][0], messages[0]), messages[0]
        return
    reference = _reference(architecture, path)
    results = run_ranks(_train, WORLD, path, kwargs, str(tmp_path / "exported"))
    assert_stage_parity(results, reference)

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    state = exported.state_dict()
    final = {name[len("model."):]: value for name, value in reference["final_params"].items()}
    for name, value in final.items():
        # Ten Adam steps of one process vs the layout's reduction order: far below one update (lr 3e-3).
        assert_close(state[name], value, rtol=0, atol=5e-5, msg=lambda m: f"exported {name}: {m}")
    one_process = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    unexpected = one_process.load_state_dict(final, strict=False).unexpected_keys
    assert not unexpected, unexpected
    tokens = data().blocks[:2, :SEQ]
    with torch.no_grad():
        assert_close(exported(tokens).logits, one_process(tokens).logits, rtol=0, atol=1e-4)


def test_the_docs_show_this_matrix():
    """docs/huggingface.md's support table is the one `benchmarks/doc_tables.py` writes from `MATRIX` (rerun it)."""
    from benchmarks.doc_tables import SUPPORT_TABLE

    assert SUPPORT_TABLE.current() == SUPPORT_TABLE.render(), "docs/huggingface.md's table is stale: run python -m benchmarks.doc_tables"


# --------------------------------------------------------------------------- combinations, world 4

COMBINATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("DeepSeek-V3", "EP 2 x PP 2"): {"expert_parallel": 2, "pipeline_parallel": 2, "data_parallel_shard": 2,
                                     "pipeline_microbatches": 2},
    ("GPT-OSS", "EP 2 x CP 2 all-to-all"): {"expert_parallel": 2, "context_parallel": 2, "data_parallel_shard": 2,
                                             "context_parallel_method": "alltoall"},
    ("Gemma2", "CP 2 ring x TP 2"): {"context_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 1},
    ("Gemma3", "CP 2 ring x TP 2 sequence parallel"): {"context_parallel": 2, "tensor_parallel": 2,
                                                          "data_parallel_shard": 1, "sequence_parallel": True},
    ("GLM-4-MoE", "TP 2 x PP 2"): {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel_shard": 1,
                                   "pipeline_microbatches": 2},
    # EP x TP: MLA and the shared expert split over tp, each routed expert whole on its ep rank.
    ("DeepSeek-V3", "EP 2 x TP 2"): {"expert_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 2},
    # Sequence parallel across pipeline stages: the stream crosses each boundary whole (the next stage's forward
    # builds its masks from the whole sequence); Gemma 3's sliding and full layers on different stages.
    ("Qwen3", "TP 2 sequence parallel x PP 2"): {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2,
                                                  "data_parallel_shard": 1, "pipeline_microbatches": 2},
    ("Gemma3", "TP 2 sequence parallel x PP 2"): {"tensor_parallel": 2, "sequence_parallel": True, "pipeline_parallel": 2,
                                                   "data_parallel_shard": 1, "pipeline_microbatches": 2},
    ("Qwen3-MoE", "EP 2 x TP 2 sequence parallel"): {"expert_parallel": 2, "tensor_parallel": 2, "data_parallel_shard": 2,
                                                       "sequence_parallel": True},
    # Tied embeddings: the first and the last stage each shard their copy (FSDP, vocab-parallel) and sum its gradients.
    # Built on the meta device like every Hugging Face model: each stage materialises its part, the checkpoint is
    # loaded into both ends (the last stage keeps the head under the embedding's name), and they train as one weight.
    ("Gemma3, tied", "ZeRO-3 2 x PP 2"): {"pipeline_parallel": 2, "data_parallel_shard": 2, "pipeline_microbatches": 2},
    ("Gemma3, tied", "TP 2 x PP 2"): {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel_shard": 1,
                                      "pipeline_microbatches": 2},
    # ZeRO-2: each end keeps the tied weight in a bucket of its own and the two sum their reduced slices of it.
    ("Gemma3, tied", "ZeRO-2 2 x PP 2"): {"pipeline_parallel": 2, "data_parallel_shard": 2, "zero_stage": 2,
                                          "pipeline_microbatches": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("architecture, layout", list(COMBINATIONS), ids=[f"{a}-{lay}" for a, lay in COMBINATIONS])
def test_combination(architecture, layout, checkpoints, tmp_path):
    """The new pieces together (MLA under pipeline stages with experts split, sinks and soft-capping with other
    dimensions): the same parity as a cell, at world 4."""
    kwargs = COMBINATIONS[(architecture, layout)]
    path = checkpoints(architecture)
    reference = _reference(architecture, path)
    results = run_ranks(_train, 4, path, kwargs, str(tmp_path / "exported"))
    assert_stage_parity(results, reference)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero12(architecture, zero_stage, checkpoints, tmp_path):
    """ZeRO-1/2 (replicated weights, sharded optimizer state; ZeRO-2 also gradients) on every architecture of the
    matrix: the cell's parity. Each reduces inside the last backward of a step: a tied weight is one bucket for both
    uses, and a rank's expert buckets may get no gradient at all."""
    path = checkpoints(architecture)
    results = run_ranks(_train, WORLD, path, {"data_parallel_shard": 2, "zero_stage": zero_stage},
                        str(tmp_path / "exported"))
    assert_stage_parity(results, _reference(architecture, path))


# --------------------------------------------------------------------------- sequence parallel

SEQUENCE_PARALLEL = {"tensor_parallel": 2, "data_parallel_shard": 1, "sequence_parallel": True}
SEQUENCE_PARALLEL_ARCHITECTURES = ("Qwen3", "Gemma3", "Phi3", "OLMo2", "Qwen3-MoE", "GLM-4-MoE")
"""Qwen3's and Gemma 3's q/k norms inside attention, Gemma 3's four norms per layer and sliding layer, Phi3's fused
projections gathered then split (`rowwise_split_input`), OLMo2's norms after each branch, Qwen3-MoE's experts block
(gathered in, sliced out) and GLM-4-MoE's: a dense first layer and a shared expert whose row-parallel layer
keeps its all-reduce inside the block."""


@pytest.mark.parametrize("architecture", SEQUENCE_PARALLEL_ARCHITECTURES)
def test_sequence_parallel(architecture, checkpoints, tmp_path):
    """tp 2 with the residual stream and the norms sharded on the sequence (loss parallel on): the cell's parity."""
    path = checkpoints(architecture)
    results = run_ranks(_train, WORLD, path, {**SEQUENCE_PARALLEL, "loss_parallel": True}, str(tmp_path / "exported"))
    assert_stage_parity(results, _reference(architecture, path))


class _ActivationSizes:
    """One rank's first forward: elements of the residual stream (each decoder layer's output) and of every norm's
    input, and the bytes autograd saves for backward (a Lightning callback's hooks)."""

    def __init__(self) -> None:
        self.stream = self.norms = self.saved = 0
        self._saving: Any = None
        self._handles: list[Any] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        hidden = module.model.config.hidden_size
        layers = module.model.base_model.layers

        def count(attribute: str, x: torch.Tensor) -> None:
            local = x.to_local() if hasattr(x, "to_local") else x
            setattr(self, attribute, getattr(self, attribute) + local.numel())

        for layer in layers:
            self._handles.append(layer.register_forward_hook(lambda _m, _a, out: count("stream", out)))
        norms = [m for m in module.model.base_model.modules()
                 if list(m.parameters(recurse=False)) and all(p.dim() == 1 and p.shape[0] == hidden for p in m.parameters())]
        for norm in norms:
            self._handles.append(norm.register_forward_pre_hook(lambda _m, args: count("norms", args[0])))

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        def pack(x: torch.Tensor) -> torch.Tensor:
            local = x.to_local() if hasattr(x, "to_local") else x
            self.saved += local.numel() * local.element_size()
            return x

        self._saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)
        self._saving.__enter__()

    def on_before_backward(self, trainer: Any, module: Any, loss: torch.Tensor) -> None:
        self._saving.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _activation_sizes(rank, world_size, path, strategy_kwargs):
    import lightning as L

    sizes = type("ActivationSizes", (_ActivationSizes, L.Callback), {})()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), Recorder(), 1, callbacks=[sizes])
    trainer.fit(make_hf(path), ParityData(data(), MICRO_BATCH))
    return {"stream": sizes.stream, "norms": sizes.norms, "saved": sizes.saved}


@pytest.mark.parametrize("architecture", ["Qwen3", "Gemma3"])
def test_sequence_parallel_holds_the_stream_and_the_norms_1_over_tp(architecture, checkpoints):
    """Measured on each rank in the first forward, tp 2 with and without sequence parallel: the residual stream and
    every norm's input are half as many elements (the activations outside the matmuls, divided by tp), and autograd
    saves less for backward."""
    path = checkpoints(architecture)
    alone = run_ranks(_activation_sizes, WORLD, path, {**SEQUENCE_PARALLEL, "sequence_parallel": False})
    sharded = run_ranks(_activation_sizes, WORLD, path, SEQUENCE_PARALLEL)
    for rank in range(WORLD):
        assert alone[rank]["stream"] > 0 and alone[rank]["norms"] > 0
        assert sharded[rank]["stream"] * 2 == alone[rank]["stream"], (rank, sharded[rank], alone[rank])
        assert sharded[rank]["norms"] * 2 == alone[rank]["norms"], (rank, sharded[rank], alone[rank])
        assert sharded[rank]["saved"] < alone[rank]["saved"], (rank, sharded[rank], alone[rank])


# --------------------------------------------------------------------------- what a plan leaves out

APERTUS_STEPS = 3
"""Apertus's xIELU has a derivative jump inside its first micro-unit below zero (f' = beta - alpha_n for
eps < x <= 0 with eps = -1e-6, about beta below eps), so a reduction order that moves a weight by 1e-6 moves
later gradients by a finite amount: measured over ten steps, ZeRO-3, TP, CP and PP agreed with each other within
1e-6 and all differed from the one-process reference by up to 2.3e-4 from step 4 on. Three steps stay within
the parity tolerances."""


def test_scalar_parameters_beside_split_layers_sum_their_gradients_over_tp(tmp_path):
    """Apertus's plan (config.base_model_tp_plan) leaves out the MLP's activation, whose alpha_p and alpha_n run on
    each rank's half of the intermediate features: ultrascale sums their gradients over tp, so every rank holds the
    one-process gradient (without it each held its half's, 14% off, and the copies drifted apart)."""
    import transformers

    config = transformers.ApertusConfig(**{**_COMMON, "head_dim": 8,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    path = save_perturbed_hf(config, tmp_path / "apertus")
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=APERTUS_STEPS,
                              accumulate=ACCUMULATE)
    assert any("act_fn.alpha_p" in name for name in reference["grads"])
    results = run_ranks(_train_steps, WORLD, path, LAYOUTS["TP 2"], APERTUS_STEPS)
    assert_stage_parity(results, reference)  # the ranks' copies of alpha_p / alpha_n are checked equal too


def test_latent_attention_without_a_query_lora_splits_its_query_projection_under_tp(tmp_path):
    """GLM-4.7-Flash's plan names `q_b_proj` alone; with `q_lora_rank=None` the layer builds `q_proj` instead, which
    now takes q_b_proj's entry (the heads stayed whole on every rank: a shape error at the first forward)."""
    import transformers

    config = transformers.Glm4MoeLiteConfig(**{**_COMMON, **_MOE, "num_key_value_heads": 4}, n_routed_experts=4,
                                            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                                            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                            v_head_dim=4)
    assert not any(key.endswith("q_proj") for key in config.base_model_tp_plan)
    path = save_perturbed_hf(config, tmp_path / "glm4_moe_lite")
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    results = run_ranks(_train_steps, WORLD, path, LAYOUTS["TP 2"], STEPS)
    assert_stage_parity(results, reference)


def test_parameters_outside_the_pipeline_parts_are_refused_under_pipeline_parallel(tmp_path):
    """DeepSeek-V4 mixes its hyper-connection streams after the layers with parameters of its own (`hc_head`): under
    PP every stage would keep a copy that only the last stage trains, so it is refused by name before any stage runs
    (before, a later stage failed expanding the streams)."""
    import transformers

    config = transformers.DeepseekV4Config(**{**_COMMON, **_MOE, "num_key_value_heads": 1}, n_routed_experts=4,
                                           n_shared_experts=1, head_dim=8, qk_rope_head_dim=4, q_lora_rank=16)
    path = save_perturbed_hf(config, tmp_path / "deepseek_v4")
    messages = run_ranks(_refusal, WORLD, path, LAYOUTS["PP 2 (1F1B)"])
    assert messages[0] is not None and "holds parameters outside its embedding, layers, final norm and head" in messages[0]
    assert "model.hc_head" in messages[0]


def _train_steps(rank, world_size, path, strategy_kwargs, steps):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, steps,
                             accumulate_grad_batches=ACCUMULATE)
    trainer.fit(make_hf(path), ParityData(data(), MICRO_BATCH))
    return recorder.result()


def test_a_mask_the_model_builds_is_refused_under_context_parallel(tmp_path):
    """Doge computes a dynamic mask from its values and hands it to the attention function; context parallel builds
    its own causal mask and would drop it (measured: a first-step gradient norm 1.7% off), so it refuses by name.
    Under TP its shipped plan splits the heads but not the mask's per-head `A` (nor the mask `dt_proj` computes for
    all heads): refused by name before any collective (before, SDPA's shape error at the first forward)."""
    import transformers

    path = save_perturbed_hf(transformers.DogeConfig(**{**_COMMON, "head_dim": 8}), tmp_path / "doge")
    messages = run_ranks(_refusal, WORLD, path, LAYOUTS["CP 2 ring"])
    assert messages[0] is not None and "DogeAttention (layer 0) hands its attention a mask of its own" in messages[0]
    messages = run_ranks(_refusal, WORLD, path, LAYOUTS["TP 2"])
    assert messages[0] is not None and "model.layers.0.self_attn.A holds one value per attention head" in messages[0]


TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                   patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


def test_llama4_text_model_trains_from_its_multimodal_checkpoint(tmp_path):
    """Llama 4 ships one checkpoint for text and images, its text model's keys under `language_model.`. transformers
    builds the text model for a causal LM and strips that prefix as its base-model prefix: the loader does too, with
    no conversion mapping for the type (it found no weight before). TP parity over ten steps; expert parallel is
    refused by name (its experts compute every token in their own forward, not through transformers'
    ExpertsInterface: the sharded weights met plain tensors in a bmm)."""
    import transformers

    text = dict(_COMMON, **_MOE, num_local_experts=4, head_dim=8, interleave_moe_layer_step=1, attention_chunk_size=SEQ,
                no_rope_layers=[1, 1])
    config = transformers.Llama4Config(text_config=text, vision_config=TINY_VISION)
    path = save_perturbed_multimodal(config, tmp_path / "llama4")
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    assert_stage_parity(run_ranks(_train_steps, WORLD, path, LAYOUTS["TP 2"], STEPS), reference)
    messages = run_ranks(_refusal, WORLD, path, LAYOUTS["EP 2"])
    assert messages[0] is not None and "Llama4TextExperts computes its experts in its own forward" in messages[0]


def test_gemma3_text_model_trains_from_its_multimodal_checkpoint_and_exports_it_whole(tmp_path):
    """Gemma 3's checkpoints (4B and up) hold the language model beside a SigLIP vision tower, and transformers' causal-LM
    class for them is the whole Gemma3ForConditionalGeneration, which no plan, attention hook or stage split covers
    (TP, CP and PP were refused). ultrascale trains the text model alone (`text_model_config`): built as
    Gemma3ForCausalLM, loaded from the composite keys (each weight equal to transformers' own load of the whole
    model), exact under TP, ring CP and PP against one process; the export is the whole model again, its vision
    tower and projector the source's bit for bit, in the source's key layout."""
    import transformers
    from safetensors import safe_open

    text = dict(_COMMON, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    config = transformers.Gemma3Config(text_config=text, vision_config={**TINY_VISION, "model_type": "siglip_vision_model"},
                                       mm_tokens_per_image=4)
    path = save_perturbed_multimodal(config, tmp_path / "gemma3")
    whole = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert type(whole).__name__ == "Gemma3ForConditionalGeneration"
    module = make_hf(path)
    module.configure_model()
    assert type(module.model).__name__ == "Gemma3ForCausalLM"
    whole_state = whole.state_dict()
    for name, value in module.model.state_dict().items():
        assert torch.equal(value, whole_state[name.replace("model.", "model.language_model.", 1)]), name

    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    for layout in ("TP 2", "CP 2 ring", "PP 2 (1F1B)"):
        results = run_ranks(_train, WORLD, path, LAYOUTS[layout], str(tmp_path / layout.split()[0]))
        assert_stage_parity(results, reference)

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "TP", local_files_only=True)
    assert type(exported).__name__ == "Gemma3ForConditionalGeneration"
    state = exported.state_dict()
    for name, value in whole_state.items():
        if ".language_model." not in name and not name.startswith("lm_head"):
            assert torch.equal(state[name], value), name  # the vision tower and projector, as they were
    for name, value in reference["final_params"].items():
        trained = name[len("model."):].replace("model.", "model.language_model.", 1)
        assert_close(state[trained], value, rtol=0, atol=5e-5, msg=lambda m: f"exported {trained}: {m}")

    def keys(folder):
        with safe_open(str(next(Path(folder).glob("*.safetensors"))), "pt") as file:
            return set(file.keys())

    assert keys(tmp_path / "TP") == keys(path)


def _fp64_first_step(rank, world_size, path, strategy_kwargs):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, 1,
                             accumulate_grad_batches=ACCUMULATE, precision="64-true")
    trainer.fit(make_hf(path), ParityData(data(), MICRO_BATCH))
    return recorder.result()


def test_gemma4_text_model_first_step_is_exact_in_fp64(tmp_path):
    """Gemma 4 (multimodal, a heterogeneous config: 8-wide heads on sliding layers, 512-wide on full ones, per-layer
    input embeddings). Its config refuses one global `head_dim`, which TP's plan read (a crash). In fp32 its 512-wide
    heads put the one-process first-step gradients 5e-6 to 1.1e-5 from an fp64 run's, depending on the CPU's kernels
    (an AMD EPYC and an Intel Xeon), and each layout's as far again in its own summation order: no fp32 bound holds on
    every machine. So the one process and each layout run in fp64 (`precision="64-true"`), where a sum taken in
    another order moves a gradient by ~1e-16 of its size and a wrong one by far more than 1e-9. The tiny model's
    ten-step curve is chaotic at lr 3e-3 (its one-process gradient norm jumps to 36), so it is not compared. PP is
    refused by name: the per-layer input embeddings feed every layer from outside the stages."""
    import transformers

    text = dict(_COMMON, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, attention_dropout=0.0)
    top = transformers.Gemma4Config()
    towers = {name: {"model_type": getattr(top, name).model_type,
                     **{k: v for k, v in dict(TINY_VISION, depth=1, num_heads=4).items() if hasattr(getattr(top, name), k)}}
              for name in top.sub_configs if name != "text_config" and getattr(top, name, None) is not None}
    path = save_perturbed_multimodal(transformers.Gemma4Config(text_config=text, **towers), tmp_path / "gemma4")
    fp64 = make_hf(path)
    fp64.configure_model()
    fp64.model.double()
    for module in fp64.modules():  # Gemma's embedding scale sqrt(width) was built in fp32: in fp64, as `64-true` has it
        if hasattr(module, "scalar_embed_scale"):
            module.embed_scale.fill_(module.scalar_embed_scale)
    exact = reference_run(fp64, data(), global_batch=MICRO_BATCH, steps=1, accumulate=ACCUMULATE, backward_on_sums=True)
    scale = max(float(grad.abs().max()) for grad in exact["grads"].values())
    # Gemma's RMSNorm multiplies by `weight.float()`: its weight's gradient is a sum over the step's tokens that the
    # model itself takes in fp32, whatever the run's dtype. Those sums are held to fp32's bound for n terms,
    # n·2^-24 of the largest (n = the step's 256 tokens: 1.5e-5 relative; measured 2.5e-7); every other gradient to
    # 1e-10 of the largest (measured 1.7e-12 under CP, 1e-16 under ZeRO-3 and TP; fp32 runs are 1e-5 off).
    in_fp32 = {f"model.{name}.weight" for name, module in fp64.model.named_modules() if type(module).__name__.endswith("RMSNorm")}
    assert any(name.endswith("q_norm.weight") for name in in_fp32), sorted(in_fp32)
    tokens = MICRO_BATCH * ACCUMULATE * SEQ
    for layout in ("ZeRO-3", "TP 2", "CP 2 ring"):
        results = run_ranks(_fp64_first_step, WORLD, path, LAYOUTS[layout])
        grads = merge_stages(results)["grads"]
        assert set(grads) == set(exact["grads"]), layout
        for name, value in exact["grads"].items():
            assert grads[name].dtype == torch.float64, (layout, name, grads[name].dtype)
            bound = tokens * 2**-24 * float(value.abs().max()) if name in in_fp32 else 1e-10 * scale
            assert_close(grads[name], value, rtol=0, atol=bound, msg=lambda m: f"{layout}, grad {name}: {m}")
        assert step_losses(results)[0] == pytest.approx(exact["losses"][0], rel=1e-6), layout  # logged in fp32
    messages = run_ranks(_refusal, WORLD, path, LAYOUTS["PP 2 (1F1B)"])
    assert messages[0] is not None and "holds parameters outside its embedding, layers, final norm and head" in messages[0]


def test_an_embedding_that_computes_more_than_a_lookup_stays_whole_under_tp(tmp_path):
    """Inkling's input embedding normalises its lookup (an nn.Embedding holding a norm) and its plan leaves it out.
    ultrascale's default vocab-parallel entry would have normed partial lookups (and torch's embedding style failed
    re-registering the norm's weight, a KeyError): such an embedding runs whole on every tp rank. TP parity over ten
    steps (its router returns more than (logits, weights, indices), which the MoE hooks once failed to unpack)."""
    import transformers

    config = transformers.InklingTextConfig(**{**_COMMON, **_MOE}, head_dim=8, sliding_window=WINDOW, num_local_experts=4,
                                            n_routed_experts=4, n_shared_experts=1, attention_dropout=0.0,
                                            layer_types=["hybrid_sliding", "hybrid"])
    path = save_perturbed_hf(config, tmp_path / "inkling")
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    assert_stage_parity(run_ranks(_train_steps, WORLD, path, LAYOUTS["TP 2"], STEPS), reference)


def test_lora_on_a_multimodal_checkpoint_exports_the_whole_model_merged(tmp_path):
    """LoRA on Gemma 3's text model: the merged export is the whole model, the vision tower the source's (it was the
    text model alone: the merged export found no source folder for a text model built from the whole one's config)."""
    import transformers

    text = dict(_COMMON, head_dim=8)
    config = transformers.Gemma3Config(text_config=text, vision_config={**TINY_VISION, "model_type": "siglip_vision_model"},
                                       mm_tokens_per_image=4)
    path = save_perturbed_multimodal(config, tmp_path / "gemma3")
    import lightning as L

    module = make_hf(path, lora=LORA, export_dir=str(tmp_path / "merged"))
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False).fit(module, ParityData(data(), MICRO_BATCH))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).state_dict()
    source = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    assert set(merged) == set(source)
    assert all(torch.equal(merged[name], value) for name, value in source.items() if ".vision_tower." in name)
    assert not torch.equal(merged["model.language_model.layers.0.self_attn.q_proj.weight"],
                           source["model.language_model.layers.0.self_attn.q_proj.weight"])  # the adapters merged in


def test_qwen3_5_text_model_trains_from_its_multimodal_checkpoint_and_exports_it_whole(tmp_path):
    """Qwen 3.5 ships only multimodal checkpoints; transformers' causal-LM class for them is the text model (gated
    DeltaNet and attention layers). Exact under TP and PP against one process, and its export is the whole model
    again (it was the text model alone, under the whole model's config: the vision tower would have loaded random)."""
    import transformers

    text = dict(_COMMON, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    vision = dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=4, out_hidden_size=32)
    path = save_perturbed_multimodal(transformers.Qwen3_5Config(text_config=text, vision_config=vision), tmp_path / "qwen")
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    for layout in ("TP 2", "PP 2 (1F1B)"):
        assert_stage_parity(run_ranks(_train, WORLD, path, LAYOUTS[layout], str(tmp_path / layout.split()[0])), reference)
    whole = transformers.AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).state_dict()
    exported = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "PP", local_files_only=True).state_dict()
    assert set(exported) == set(whole)
    vision_names = [name for name in whole if ".visual." in name]
    assert vision_names and all(torch.equal(exported[name], whole[name]) for name in vision_names)
    for name, value in reference["final_params"].items():
        trained = name[len("model."):].replace("model.", "model.language_model.", 1)
        # 1e-4: the DeltaNet's dt_bias ends 5.1e-5 from one process after ten Adam steps (3e-3 each): Adam's
        # lr·g/(|g| + eps) amplifies a summation-order difference of a small gradient, as AFMoE's (docs/huggingface.md).
        assert_close(exported[trained], value, rtol=0, atol=1e-4, msg=lambda m: f"exported {trained}: {m}")


def test_a_window_only_the_mask_holds_is_kept_under_context_parallel(tmp_path):
    """Qwen2-MoE with `use_sliding_window` windows its sliding layers through the mask alone (the attention module
    holds `sliding_window` but does not hand it on): context parallel takes the window the mask would have, by
    layer type (PhiMoE, which windows every layer so, is a row of the matrix). Without it the first step's gradient
    norm was 0.1% off (only one of two layers windowed, over 32 tokens with a window of 12)."""
    path = make_hf_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", vocab_size=VOCAB, hidden_size=32,
                              use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    reference = reference_run(make_hf(path), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    results = run_ranks(_train_steps, WORLD, path, LAYOUTS["CP 2 ring"], STEPS)
    assert_stage_parity(results, reference)


def test_layers_that_hand_the_next_layer_state_are_refused_under_pipeline_parallel(tmp_path):
    """GLM-MoE-DSA's decoder layers return (hidden states, top-k indices) and the next layer reads the indices: a
    stage boundary hands on the hidden states alone, so pipeline parallel refuses it by name at the first forward
    (before, a gap unpacked the hidden states along the batch and a stage failed on a 2-D tensor)."""
    import transformers

    config = transformers.GlmMoeDsaConfig(**{**_COMMON, "num_key_value_heads": 4, "n_routed_experts": 4, **_MOE,
                                             "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                                             "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                                             "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 4})
    path = save_perturbed_hf(config, tmp_path / "glm_moe_dsa")
    with pytest.raises(AssertionError, match="GlmMoeDsaDecoderLayer returns 2 values, the hidden states and state"):
        run_ranks(_train_steps, WORLD, path, LAYOUTS["PP 2 (1F1B)"], 1)


# --------------------------------------------------------------------------- other pipeline schedules

SCHEDULES: dict[str, dict[str, Any]] = {
    "Interleaved1F1B": {"pipeline_parallel": 2, "pipeline_schedule": "Interleaved1F1B", "pipeline_virtual_stages": 2,
                        "pipeline_microbatches": 2, "data_parallel_shard": 1},
    "ZBVZeroBubble": {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble", "pipeline_microbatches": 2,
                      "data_parallel_shard": 1},
    "ZBVZeroBubble, ZeRO-1": {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble", "pipeline_microbatches": 2,
                              "data_parallel_shard": 1, "zero_stage": 1},
}
SCHEDULE_CELLS = [(a, schedule) for a in ("Gemma2", "Granite", "GPT-OSS") for schedule in ("Interleaved1F1B", "ZBVZeroBubble")]
SCHEDULE_CELLS.append(("Gemma3, tied", "Interleaved1F1B"))  # the tied ends on stage 0 (rank 0) and stage 3 (rank 1)
SCHEDULE_CELLS.append(("Gemma3, tied", "ZBVZeroBubble, ZeRO-1"))  # both ends on rank 0 (the V): one weight there
SCHEDULE_CELLS.append(("Gemma3, tied", "ZBVZeroBubble"))  # ZeRO-3: two FSDP units on rank 0, the head holds a copy


@pytest.mark.slow
@pytest.mark.parametrize("architecture, schedule", SCHEDULE_CELLS, ids=[f"{a}-{s}" for a, s in SCHEDULE_CELLS])
def test_pipeline_schedule(architecture, schedule, tmp_path_factory):
    """Four stages on two ranks (a rank runs a stage after the first and the last one's head, or, in the V, the
    first and the last stage): Gemma 2's final soft-capping on the last stage only, Granite's embedding multiplier
    on the first only, GPT-OSS's sinks and experts; 4 layers, so each stage holds one."""
    fields = ARCHITECTURES[architecture][1]
    layers = {"num_hidden_layers": 4}
    if "layer_types" in fields:
        layers["layer_types"] = fields["layer_types"] * 2
    folder = make_checkpoint(tmp_path_factory.mktemp(architecture), architecture, **layers)
    reference = reference_run(make_hf(folder), data(), global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    results = run_ranks(_train, WORLD, folder, SCHEDULES[schedule], str(tmp_path_factory.mktemp("exported")))
    assert_stage_parity(results, reference)


# --------------------------------------------------------------------------- packed documents

def packed_data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH * ACCUMULATE, SEQ, VOCAB, seed=9, masked=True, packed=True)


def _train_packed(rank, world_size, path, strategy_kwargs):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS,
                             accumulate_grad_batches=ACCUMULATE)
    trainer.fit(make_hf(path), ParityData(packed_data(), MICRO_BATCH))
    return recorder.result()


PACKED = [("Gemma3", "CP 2 ring"), ("Gemma3", "CP 2 all-to-all"), ("Gemma2", "CP 2 ring"), ("Gemma2", "CP 2 all-to-all")]
# Not GPT-OSS: transformers' GptOssModel builds its masks without `position_ids`, so its own forward lets packed
# documents see each other (a document's logits inside a packed row differ from its logits alone by 0.15 on the
# tiny checkpoint), while context parallel keeps them apart: the reference would be the wrong one.


@pytest.mark.parametrize("architecture, layout", PACKED, ids=[f"{a}-{layout}" for a, layout in PACKED])
def test_packed_documents_with_sliding_windows(architecture, layout, checkpoints):
    """Packed documents (positions restarting at 0) under context parallel, with the layers' sliding windows (and
    soft-capping, sinks): the one-process reference is transformers' own forward on the whole rows, which builds
    the per-document sliding masks from `position_ids`."""
    data = packed_data()
    assert (data.positions[:, 1:] == 0).any(dim=1).sum() > len(data) // 3  # many rows hold several documents
    path = checkpoints(architecture)
    reference = reference_run(make_hf(path), data, global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    results = run_ranks(_train_packed, WORLD, path, LAYOUTS[layout])
    assert_parity(results[0], reference, step_losses(results))


USP = {"context_parallel": 4, "context_parallel_method": "usp", "context_parallel_ulysses": 2, "data_parallel_shard": 1}


@pytest.mark.parametrize("architecture", ["Qwen3", "Gemma3"])
def test_usp_with_packed_documents(architecture, checkpoints):
    """cp 4 as 2 ring x 2 Ulysses (USP) on packed documents: each Ulysses pair trades its 4 query heads (2 KV heads)
    for its 16 tokens, the two pairs pass K/V around the ring; Gemma 3 adds its sliding layer (window 12 of 32)."""
    data = packed_data()
    path = checkpoints(architecture)
    reference = reference_run(make_hf(path), data, global_batch=MICRO_BATCH, steps=STEPS, accumulate=ACCUMULATE)
    results = run_ranks(_train_packed, 4, path, USP)
    assert_parity(results[0], reference, step_losses(results))


# --------------------------------------------------------------------------- LoRA on this year's architectures

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "o_proj"]}
LORA_ARCHITECTURES = ("Gemma2", "OLMo3", "GPT-OSS", "DeepSeek-V3")
LORA_LAYOUTS = ("ZeRO-3", "TP 2", "PP 2 (1F1B)")


def _train_lora(rank, world_size, path, strategy_kwargs, merged_dir):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS,
                             accumulate_grad_batches=ACCUMULATE)
    module = make_hf(path, lora=LORA, export_dir=merged_dir)
    trainer.fit(module, ParityData(data(), MICRO_BATCH))
    return recorder.result()


LORA_CELLS = [(a, layout) for a in LORA_ARCHITECTURES for layout in LORA_LAYOUTS]


@pytest.mark.parametrize("architecture, layout", LORA_CELLS, ids=[f"{a}-{layout}" for a, layout in LORA_CELLS])
def test_lora_cell(architecture, layout, checkpoints, tmp_path):
    """`HFCausalLM(lora=...)` (adapters on the attention's q and o projections, the base frozen and loaded shard by
    shard) trains like one process, and the merged folder gives the one-process model's logits."""
    import transformers

    path = checkpoints(architecture)
    reference = reference_run(make_hf(path, lora=LORA), data(), global_batch=MICRO_BATCH, steps=STEPS,
                              accumulate=ACCUMULATE)
    assert any("lora_A" in name for name in reference["grads"]) and all("lora_" in n for n in reference["grads"])
    results = run_ranks(_train_lora, WORLD, path, LAYOUTS[layout], str(tmp_path / "merged"))
    assert_stage_parity(results, reference)

    trained = make_hf(path, lora=LORA)
    trained.configure_model()
    loaded = trained.load_state_dict(reference["final_params"], strict=False)  # parameters (buffers as loaded)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if k in dict(trained.named_parameters())]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    tokens = data().blocks[:2, :SEQ]
    with torch.no_grad():
        assert_close(merged(tokens).logits, trained(tokens), rtol=0, atol=1e-4)
