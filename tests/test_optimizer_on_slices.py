"""An optimizer whose update is not elementwise (torch.optim.Muon) is refused by name, before its first step, under
the layouts that hand it slices of the weights (ZeRO-3, tensor parallel; ZeRO-1/2's engine), and trains exactly
where every rank holds the whole weights (replicated data parallel), against one process running torch's Muon."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ultrascale
from tests._parity import ParityData, Recorder, TokenDataset, assert_parity, parity_trainer, reference_run, step_losses
from ultrascale.launch import run_ranks
from ultrascale.models import LlamaLM
from ultrascale.parallel import optimizers
from ultrascale.parallel import zero as zero_module
from ultrascale.parallel.rules import LayoutNotImplemented

VOCAB, SEQ, MICRO_BATCH, STEPS = 128, 16, 4, 4  # MICRO_BATCH: the global batch, over the ranks


class MuonLM(LlamaLM):
    """Muon over the 2-D weights (torch's Muon takes matrices only); the norms are frozen, so that every weight
    with a gradient is stepped."""

    def configure_model(self) -> None:
        super().configure_model()
        for param in self.parameters():
            param.requires_grad_(param.ndim == 2)

    def configure_optimizers(self) -> Any:
        return torch.optim.Muon([p for p in self.parameters() if p.ndim == 2], lr=0.02)


def _module() -> MuonLM:
    return MuonLM(preset="tiny", vocab_size=VOCAB, max_seq_len=SEQ, learning_rate=3e-3, warmup_steps=1, max_steps=1000)


def _data() -> TokenDataset:
    return TokenDataset(STEPS * MICRO_BATCH * 2, SEQ, VOCAB, seed=3, masked=True)


def _fit(rank: int, world_size: int, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    recorder = Recorder()
    trainer = parity_trainer(world_size, ultrascale.UltraScaleStrategy(**strategy_kwargs), recorder, STEPS)
    module = _module()
    try:
        trainer.fit(module, ParityData(_data(), MICRO_BATCH))
    except LayoutNotImplemented as refused:
        return {"refused": (refused.key, str(refused)), "steps": trainer.global_step}
    return recorder.result()


@pytest.mark.parametrize("layout, strategy_kwargs, where", [
    ("ZeRO-3", {"data_parallel_shard": 2}, "dp_shard=2"),
    ("TP 2", {"tensor_parallel": 2, "data_parallel_shard": 1}, "tp=2"),
])
def test_muon_on_slices_is_refused_before_its_first_step(layout, strategy_kwargs, where):
    results = run_ranks(_fit, 2, strategy_kwargs)
    for result in results:
        key, message = result["refused"]
        assert key == "optimizer_on_slices"
        assert result["steps"] == 0
        assert message.startswith("Muon under UltraScaleStrategy (") and where in message, message
        assert "not elementwise" in message and "declare_elementwise_optimizer" in message


def test_muon_with_whole_weights_trains_as_one_process():
    """Replicated data parallel (every rank the whole matrices, gradients all-reduced): torch's Muon steps the
    matrices one process steps, on masked data, over the 4-step curve."""
    reference = reference_run(_module(), _data(), global_batch=MICRO_BATCH, steps=STEPS)
    results = run_ranks(_fit, 2, {"data_parallel_replicate": 2, "data_parallel_shard": 1})
    assert "refused" not in results[0]
    # torch's Muon orthogonalises in bf16 (`_zeropower_via_newtonschulz` casts the momentum to bfloat16): the
    # all-reduce's fp32 rounding of the gradient rounds some bf16 elements the other way, 1e-4 off in the weights.
    assert_parity(results[0], reference, step_losses(results), param_atol=5e-4)


def test_zero12_and_declared_optimizers():
    """ZeRO-1/2's engine refuses Muon with the same key; an optimizer declared elementwise is accepted."""
    layer = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(LayoutNotImplemented, match=r"^Muon under ZeRO-2: .*not elementwise") as refused:
        zero_module.ZeroEngine(layer, torch.optim.Muon(layer.parameters()), stage=2, dp_mesh=None)  # type: ignore[arg-type]
    assert refused.value.key == "optimizer_on_slices"

    class MyAdam(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 1e-3})

    try:
        assert not optimizers.is_elementwise(MyAdam(layer.parameters()))
        optimizers.declare_elementwise_optimizer(MyAdam)
        assert optimizers.is_elementwise(MyAdam(layer.parameters()))
    finally:
        optimizers.DECLARED_ELEMENTWISE.discard(MyAdam)
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer class"):
        optimizers.declare_elementwise_optimizer(torch.nn.Linear)  # type: ignore[arg-type]
