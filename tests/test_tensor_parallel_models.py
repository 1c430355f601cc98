"""Tensor parallel beyond the built-in Llama: Hugging Face Llama/Mistral/Qwen2 through their adapter,
a user-supplied plan for an unknown model, the errors, and a TP checkpoint loaded into another layout."""

import lightning as L
import pytest
import torch
import transformers

import ultrascale
from tests._dist import run_ranks
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from tests.test_generic_module import VOCAB as PLAIN_VOCAB
from tests.test_generic_module import PlainTransformerLM

SEQ, BATCH, STEPS, VOCAB = 16, 8, 10, 128

HF_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
}


def hf_config(arch: str, **overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    return HF_CONFIGS[arch](**kwargs)


class HFCausalLMModule(L.LightningModule):
    """A user's own wrapper around a Hugging Face model: ultrascale has never seen this class."""

    def __init__(self, config, loss_parallel: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        self.supports_loss_parallel = loss_parallel

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch, batch_idx):
        # The public opt-in; under loss parallel the logits are vocab-sharded DTensors.
        return ultrascale.token_loss(self(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-6)


def _fit(rank, world_size, module, strategy_kwargs, dataset, batch):
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    trainer.fit(module, ParityData(dataset, batch))
    sharded = {n: tuple(p.to_local().shape) for n, p in module.named_parameters() if "layers.0." in n or "blocks.0." in n}
    return {**recorder.result(), "local_shapes": sharded}


@pytest.mark.parametrize(
    "arch, loss_parallel, tied",
    [("llama", False, False), ("llama", True, False), ("mistral", False, False), ("qwen2", False, False),
     ("qwen2", True, True)],
    ids=["llama", "llama-loss-parallel", "mistral", "qwen2", "qwen2-tied-loss-parallel"],
)
def test_hf_tp2_parity(arch, loss_parallel, tied):
    module = HFCausalLMModule(hf_config(arch, tie_word_embeddings=tied), loss_parallel=loss_parallel)
    dataset = TokenDataset(STEPS * BATCH, SEQ, VOCAB, seed=4, masked=True)
    reference = reference_run(module, dataset, global_batch=BATCH, steps=STEPS)
    results = run_ranks(_fit, 2, module, {"tensor_parallel": 2, "data_parallel_shard": 1}, dataset, BATCH)
    shapes = results[0]["local_shapes"]
    assert shapes["model.model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # 4 heads x 16 / tp 2
    assert shapes["model.model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 2 kv heads x 16 / tp 2
    assert shapes["model.model.layers.0.mlp.down_proj.weight"] == (64, 64)  # 128 / tp 2 input columns
    assert_parity(results[0], reference, step_losses(results))


def test_user_plan_on_unknown_model():
    """No adapter: the user names the layers to split (Megatron MLP: column then row)."""
    module = PlainTransformerLM()
    dataset = TokenDataset(STEPS * BATCH, SEQ, PLAIN_VOCAB, seed=5, masked=True)
    reference = reference_run(module, dataset, global_batch=BATCH, steps=STEPS)
    plan = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
    results = run_ranks(_fit, 2, module, {"tensor_parallel": 2, "data_parallel_shard": 1, "tp_plan": plan}, dataset, BATCH)
    assert results[0]["local_shapes"]["blocks.0.mlp.0.weight"] == (64, 32)  # 4*32 hidden / tp 2
    assert results[0]["local_shapes"]["blocks.0.mlp.2.weight"] == (32, 64)
    assert_parity(results[0], reference, step_losses(results))


def _setup_error(rank, world_size, module, strategy_kwargs):
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**strategy_kwargs),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(module, ParityData(TokenDataset(8, SEQ, VOCAB), 8))
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


def _llama(**overrides):
    from ultrascale.models.llama import LlamaConfig
    from ultrascale.models.lm import LlamaLM

    return LlamaLM(config=LlamaConfig.from_preset("tiny", **overrides))


@pytest.mark.parametrize(
    "make_module, tp, kwargs, expected",
    [
        (lambda: _llama(), 4, {}, "`tensor_parallel=4` must divide n_kv_heads=2 of ultrascale.Llama (whole heads / rows per rank). "
                                  "Tensor-parallel degrees that fit: [1, 2]"),
        (lambda: _llama(n_heads=4, n_kv_heads=4, ffn_hidden_dim=90, vocab_size=510), 4, {},
         "must divide ffn_hidden_dim=90, vocab_size=510"),
        (lambda: PlainTransformerLM(), 2, {}, "tensor parallel has no plan for generic"),
        (lambda: HFCausalLMModule(hf_config("llama")), 2, {"sequence_parallel": True},
         "sequence parallel is not implemented for LlamaForCausalLM"),
        (lambda: PlainTransformerLM(), 2, {"tp_plan": {"layers.*.mlp.0": "colwise"}}, "plan entries match no submodule"),
        (lambda: PlainTransformerLM(), 2, {"tp_plan": {"blocks.*.mlp.0": "diagonal"}}, "unknown tensor-parallel style 'diagonal'"),
    ],
    ids=["kv-heads", "hidden-and-vocab", "no-plan", "hf-sp", "unmatched-plan", "unknown-style"],
)
def test_tp_errors(make_module, tp, kwargs, expected):
    if "diagonal" in str(kwargs.get("tp_plan", {})):  # a bad style name fails at construction, on one process
        with pytest.raises(ValueError, match=expected):
            ultrascale.UltraScaleStrategy(tensor_parallel=tp, **kwargs)
        return
    messages = run_ranks(_setup_error, tp, make_module(), {"tensor_parallel": tp, "data_parallel_shard": 1, **kwargs})
    for message in messages:  # every rank fails the same way: nobody is left waiting in a collective
        assert message.startswith("ValueError") and expected in message, message


def test_tied_llama_tp2_parity():
    """Tied embeddings: the vocab-parallel embedding and the column-parallel head share one
    (V/tp, D) shard per rank, re-tied after parallelisation."""
    from ultrascale.models.llama import LlamaConfig
    from ultrascale.models.lm import LlamaLM

    module = LlamaLM(config=LlamaConfig.from_preset("tiny", tie_embeddings=True, vocab_size=VOCAB),
                     learning_rate=3e-3, warmup_steps=1, max_steps=1000, min_lr_ratio=1.0, eps=1e-6)
    dataset = TokenDataset(STEPS * BATCH, SEQ, VOCAB, seed=7, masked=True)
    reference = reference_run(module, dataset, global_batch=BATCH, steps=STEPS)
    results = run_ranks(_fit_tied, 2, module, dataset)
    assert results[0]["tied"]
    assert_parity(results[0], reference, step_losses(results))


def _fit_tied(rank, world_size, module, dataset):
    result = _fit(rank, world_size, module, {"tensor_parallel": 2, "data_parallel_shard": 1}, dataset, BATCH)
    llama = module.model
    result["tied"] = llama.output.weight is llama.tok_embeddings.weight
    return result
