"""Checkpoints transformers converts while loading (per-expert weights fused into one tensor per layer, renamed
modules): the sharded loader reads them through transformers' own conversion mapping, the same weights as
`from_pretrained`, and an export writes the original on-disk names back."""

from pathlib import Path

import lightning as L
import pytest
import torch
import transformers
from safetensors import safe_open
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import TokenDataset
from ultrascale.models.hf import HFCausalLM, load_hf_weights, recompute_nonpersistent_buffers, write_hf_folder

VOCAB, SEQ = 128, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                     head_dim=8, **COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **COMMON),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                                   head_dim=8, **COMMON),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, **(COMMON | dict(num_key_value_heads=4))),  # MLA: a key per head
    # Renamings only (regex patterns): the experts are stored fused, under other names.
    "granitemoe": lambda: transformers.GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON),
}
# One per-expert key of layer 1 as each architecture's checkpoint stores it (transformers fuses them in memory).
DISK_EXPERT_KEY = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.0.w1.weight",
    "qwen3_moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "olmoe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "glm4_moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "deepseek_v3": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "granitemoe": "model.layers.1.block_sparse_moe.input_linear.weight",
}
ARCHS = list(CONFIGS)


def make_checkpoint(folder: Path, arch: str) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
    with torch.no_grad():  # non-trivial weights everywhere (HF inits norms to 1 and biases to 0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder, max_shard_size="50KB")  # several shards: one layer's experts span files
    return folder


def disk_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def tokens(n: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_load_equals_from_pretrained(tmp_path, arch):
    path = make_checkpoint(tmp_path / "ckpt", arch)
    assert DISK_EXPERT_KEY[arch] in disk_keys(path)  # stored per expert / under its old name
    expected = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
    model.to_empty(device="cpu")
    recompute_nonpersistent_buffers(model)
    load_hf_weights(model, path)
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    assert any(".experts.gate_up_proj" in key for key in loaded)  # fused in memory
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


def _logits(rank, world_size, path, strategy_kwargs):
    module = HFCausalLM(path)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(**strategy_kwargs),
                        logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=0)
    trainer.validate(module, torch.utils.data.DataLoader(TokenDataset(4, SEQ, VOCAB), batch_size=2), verbose=False)
    with torch.no_grad():
        logits = module(tokens())
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    from torch.distributed.fsdp import FSDPModule

    for fsdp_unit in (m for m in module.modules() if isinstance(m, FSDPModule)):
        fsdp_unit.reshard()  # FSDP2 keeps the last block unsharded after a forward
    experts = next(p for n, p in module.model.named_parameters() if n.endswith("experts.gate_up_proj"))
    local = tuple(experts.to_local().shape) if hasattr(experts, "to_local") else tuple(experts.shape)
    return {"logits": logits, "experts_local": local, "experts_global": tuple(experts.shape),
            "meta_built": module.prefers_meta_init}


LAYOUTS = {"zero3": {}, "tp2": {"tensor_parallel": 2, "data_parallel_shard": 1}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_logits_equal_from_pretrained(tmp_path, arch, layout):
    path = make_checkpoint(tmp_path / "ckpt", arch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        expected = reference(input_ids=tokens()).logits
    for result in run_ranks(_logits, 2, str(path), LAYOUTS[layout]):
        assert result["meta_built"]
        assert result["experts_local"] != result["experts_global"]  # each rank holds a part of the fused experts
        assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_writes_the_checkpoint_names(tmp_path, arch):
    """Fused in memory, stored per expert: `save_pretrained` (which an export calls) reverts the conversion."""
    path = make_checkpoint(tmp_path / "ckpt", arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    out = write_hf_folder(model.state_dict(), model.config, str(path), tmp_path / "out")
    written = disk_keys(out)
    assert written == disk_keys(path)
    assert DISK_EXPERT_KEY[arch] in written and not any(key.endswith("experts.gate_up_proj") for key in written)
    again = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(again[name], value), name


class _Unknown(transformers.core_model_loading.ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        raise AssertionError("never run")


def test_unknown_operation_is_refused_naming_it(monkeypatch):
    from transformers import conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter

    from ultrascale.models.hf import check_sharded_loading_supported

    original = conversion_mapping.get_checkpoint_conversion_mapping
    unknown = WeightConverter(["mlp.experts.*.down_proj.weight"], ["mlp.experts.down_proj"],
                              operations=[MergeModulelist(dim=0), _Unknown()])
    monkeypatch.setattr(conversion_mapping, "get_checkpoint_conversion_mapping",
                        lambda model_type: [unknown] if model_type == "qwen3_moe" else original(model_type))
    with pytest.raises(NotImplementedError, match=r"'qwen3_moe'.*'mlp\.experts\.down_proj'.*operation _Unknown"):
        check_sharded_loading_supported(CONFIGS["qwen3_moe"]())
    check_sharded_loading_supported(CONFIGS["olmoe"]())  # the real mappings pass
