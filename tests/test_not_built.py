"""Everything ultrascale refuses as not built yet goes through the rulebook's `NOT_BUILT` table, each entry is
refused where a user meets it (its error carries the entry's key), and the docs' lists are that table.

Each probe below takes the user's path as far as the refusal (a strategy's constructor, a callback's setup, the
export command, the attention function transformers calls), not the rule function alone, where that path is cheap.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

import ultrascale
from ultrascale.launch import init_gloo, run_ranks
from ultrascale.models.adapters import _hands_on_the_hidden_states_alone
from ultrascale.models.hf import lora_config
from ultrascale.parallel.attention_kernels import attention_kernel
from ultrascale.parallel.rules import NOT_BUILT, LayoutNotImplemented, ModelFacts

ROOT = Path(__file__).resolve().parent.parent


def _hf_facts(model_type: str, **fields: Any) -> ModelFacts:
    import transformers

    from ultrascale.models.adapters import model_facts

    config = transformers.CONFIG_MAPPING[model_type](
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **fields)
    with torch.device("meta"):
        return model_facts(transformers.AutoModelForCausalLM.from_config(config))


def _cp_module(**attributes: Any) -> torch.nn.Module:
    from ultrascale.parallel.context_hf import CONTEXT_PARALLEL_ATTRIBUTE

    module = torch.nn.Module()
    setattr(module, CONTEXT_PARALLEL_ATTRIBUTE, object())
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def _cp_attention(module: torch.nn.Module, dropout: float, mask: Any = None) -> None:
    from ultrascale.parallel.context_hf import hf_context_parallel_attention

    q = torch.zeros(1, 2, 4, 8)
    hf_context_parallel_attention(module, q, q, q, mask, dropout=dropout)


def _lora_checkpoint_export(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ultrascale.models.hf import export_hf_checkpoint
    from ultrascale.parallel.checkpoint import METADATA_FILE
    from ultrascale.parallel.manifest import write_manifest

    checkpoint = tmp_path / "step=1"
    dcp.save({"weight": torch.zeros(2)}, checkpoint_id=checkpoint, no_dist=True)
    torch.save({"hyper_parameters": {"model": "unused", "lora": {"r": 2}}}, checkpoint / METADATA_FILE)
    write_manifest(checkpoint)
    export_hf_checkpoint(checkpoint, tmp_path / "out")


def _moe_llama_export() -> None:
    from ultrascale.models.llama import LlamaConfig
    from ultrascale.models.llama_hf import hf_llama_config

    hf_llama_config(LlamaConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32, n_experts=4), bos_token_id=1, eos_token_id=2)


def _measure(**request: Any) -> None:
    from ultrascale.measure import measure_layout

    measure_layout(**{"model": "tiny", "world": 2, **request})


def _unreadable_conversion() -> None:
    from ultrascale.models.hf_load import _stacking

    split = SimpleNamespace(target_patterns=["gate", "up"], source_patterns=["gate_up"], operations=[])
    _stacking(split, "future_moe")


def _sharded_prompt_adapter(rank: int, world_size: int) -> str:
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    from ultrascale.models.peft import _refuse_unsupported

    init_gloo(rank, world_size)
    weight = distribute_tensor(torch.zeros(2, 2), init_device_mesh("cpu", (1,)))
    peft_model = SimpleNamespace(peft_config={"default": SimpleNamespace(is_prompt_learning=True)})
    try:
        _refuse_unsupported(peft_model, {"prompt_encoder.weight": weight})
    except LayoutNotImplemented as error:
        return error.key
    return "not refused"


def _llama4_router_with_a_balance_loss() -> None:
    import transformers

    from ultrascale.models.moe import attach_hf_routing

    config = transformers.Llama4TextConfig(vocab_size=16, hidden_size=8, intermediate_size=16, intermediate_size_mlp=16,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    attach_hf_routing(model, aux_loss_coef=0.01, z_loss_coef=0.0)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def _fork_launcher_second_fit() -> None:
    from lightning.pytorch.trainer.states import TrainerFn

    from ultrascale.strategies._lightning_compat import ForkLauncher

    launcher = ForkLauncher(ultrascale.UltraScaleStrategy(launcher="fork"))
    launcher._fitted_once = True  # what the first fit's launch leaves
    launcher.launch(lambda: None, trainer=SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING)))


def _chunked_loss_on(tmp_path: Path) -> None:
    """An explicit `loss_chunk_tokens` on an architecture outside `HEAD_TO_LOGITS` (RWKV), as the first step asks."""
    import transformers

    from ultrascale.models.hf import HFCausalLM

    config = transformers.RwkvConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                     intermediate_size=64, context_length=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    HFCausalLM(str(tmp_path), loss_chunk_tokens=64).loss_chunk_tokens_in_use()


def _muon_under_zero2() -> None:
    """The ZeRO-2 engine a strategy builds for its optimizer (tests/test_optimizer_on_slices.py: ZeRO-3 and TP)."""
    from ultrascale.parallel.zero import ZeroEngine

    layer = torch.nn.Linear(4, 4, bias=False)
    ZeroEngine(layer, torch.optim.Muon(layer.parameters()), stage=2, dp_mesh=None)  # type: ignore[arg-type]


def _recompute_budget_under_a_pipeline() -> None:
    """What the strategy's `parallelize` asks before any weight moves, on its pp=2 mesh."""
    from ultrascale.callbacks import ActivationCheckpointing
    from ultrascale.parallel.dims import ParallelDims
    from ultrascale.strategies.auto_layout import choose_budget_blocks

    strategy = SimpleNamespace(parallel_dims=ParallelDims.resolve(2, pp=2, dp_shard=1))
    choose_budget_blocks([ActivationCheckpointing(memory_budget_gib=8)], None, None, strategy, device=torch.device("cpu"),
                         world_size=2, ranks_per_node=2, precision="32-true", owner="ZeRO3Strategy")


PROBES: dict[str, Callable[[Path], None]] = {
    "recompute_budget_pipeline": lambda _: _recompute_budget_under_a_pipeline(),
    "chunked_loss_pipeline": lambda _: ultrascale.models.LlamaLM(preset="tiny", loss_chunk_tokens=64)
    .loss_chunk_tokens_in_use(pipeline=True),
    "chunked_loss_hf_architecture": _chunked_loss_on,
    "context_parallel_attention_dropout": lambda _: _cp_attention(_cp_module(training=True), dropout=0.1),
    "context_parallel_non_causal": lambda _: _cp_attention(_cp_module(is_causal=False), dropout=0.0),
    "context_parallel_model_mask": lambda _: _cp_attention(_cp_module(), dropout=0.0, mask=torch.zeros(1, 2, 4, 4)),
    "pipeline_layer_state": lambda _: _hands_on_the_hidden_states_alone(torch.nn.Identity(), (), (torch.zeros(1),) * 2),
    "context_parallel_device": lambda _: attention_kernel(torch.device("meta")),
    "lora_data_dependent_init": lambda _: lora_config({"r": 2, "use_dora": True}),
    "export_lora_checkpoint": _lora_checkpoint_export,
    "export_moe_llama": lambda _: _moe_llama_export(),
    "accelerate_ulysses_kernel": lambda _: ultrascale.UltraScaleStrategy.from_accelerate(
        {"dp_shard_size": 1, "sp_size": 2, "sp_handler": {"sp_attn_implementation": "flash_attention_2"}}),
    "hf_conversion_not_per_expert": lambda _: _unreadable_conversion(),
    "hf_router_form": lambda _: _llama4_router_with_a_balance_loss(),
    "measure_expert_parallel": lambda _: _measure(model="tiny_moe", ep=2),
    "measure_pipeline_accumulation": lambda _: _measure(pp=2, grad_accumulation=2),
    "fork_launcher_second_fit": lambda _: _fork_launcher_second_fit(),
    "optimizer_on_slices": lambda _: _muon_under_zero2(),
}


@pytest.mark.parametrize("key", [key for key in NOT_BUILT if key != "prompt_learning_sharded_save"])
def test_each_not_built_entry_is_refused_with_its_key(key, tmp_path):
    with pytest.raises(NotImplementedError) as refused:
        PROBES[key](tmp_path)
    assert isinstance(refused.value, LayoutNotImplemented) and refused.value.key == key, refused.value


def test_prompt_adapters_are_refused_from_sharded_parameters():
    assert run_ranks(_sharded_prompt_adapter, 1) == ["prompt_learning_sharded_save"]


def test_every_entry_has_its_probe():
    assert set(PROBES) | {"prompt_learning_sharded_save"} == set(NOT_BUILT)


def test_every_not_built_refusal_goes_through_the_table():
    """A `NotImplementedError` raised with a message anywhere in the package bypasses `NOT_BUILT` (and the docs'
    lists); a bare `raise NotImplementedError` (an abstract method) is not a refusal."""
    bypasses = []
    for file in sorted((ROOT / "ultrascale").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "NotImplementedError"
                    and node.args):
                bypasses.append(f"{file.relative_to(ROOT)}:{node.lineno}")
    assert not bypasses, f"NotImplementedError(...) outside NOT_BUILT: {bypasses}"


def test_the_docs_list_not_built():
    from benchmarks.doc_tables import ALL_NOT_BUILT, README_NOT_BUILT

    for block in (README_NOT_BUILT, ALL_NOT_BUILT):
        assert block.current() == block.render(), f"{block.page.name}'s list is stale: run python -m benchmarks.doc_tables"
    listed = re.findall(r"\(`([a-z0-9_]+)`\)$", ALL_NOT_BUILT.current(), flags=re.M)
    assert listed == list(NOT_BUILT)
