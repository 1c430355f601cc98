"""The module <-> strategy contract: what a LightningModule may declare is checked before any collective,
with an error naming the member; the strategy reads the declarations through one set of helpers."""

import inspect

import lightning as L
import pytest
import torch

import ultrascale
from tests._dist import run_ranks
from ultrascale import contract
from ultrascale.contract import ModuleContract, StrategyContract, check_module
from ultrascale.models.lm import LlamaLM


class Plain(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def declaring(**members):
    """A `Plain` subclass with `members` as class attributes (a property where the value is a `property`)."""
    return type("Declaring", (Plain,), members)()


def _members(protocol) -> set[str]:
    own = {name for name in vars(protocol) if not name.startswith("_")}
    return own | set(protocol.__annotations__)


def test_plain_and_builtin_modules_pass():
    check_module(Plain(), "UltraScaleStrategy")
    check_module(LlamaLM(preset="tiny"), "UltraScaleStrategy")


@pytest.mark.parametrize("members, match", [
    (dict(supports_loss_parallel="yes"),
     r"UltraScaleStrategy: Declaring\.supports_loss_parallel is 'yes' \(str\); it must be True or False"),
    (dict(prefers_meta_init=property(lambda self: 1)), r"Declaring\.prefers_meta_init is 1 \(int\); it must be True or False"),
    (dict(pipeline_parts=3), r"Declaring\.pipeline_parts is 3 \(int\), not a method; define `def pipeline_parts\(self\)`"),
    (dict(init_weights="later"), r"Declaring\.init_weights is 'later' \(str\), not a method"),
])
def test_wrong_declarations_are_named(members, match):
    with pytest.raises(TypeError, match=match):
        check_module(declaring(**members), "UltraScaleStrategy")


def test_none_means_not_declared():
    module = declaring(supports_loss_parallel=None, prefers_meta_init=None, pipeline_parts=None, init_weights=None)
    check_module(module, "UltraScaleStrategy")
    assert not contract.supports_loss_parallel(module) and not contract.prefers_meta_init(module)
    assert contract.own_pipeline_parts(module) is None


def test_helpers_read_the_declarations():
    assert contract.supports_loss_parallel(LlamaLM(preset="tiny"))  # `CausalLMModule` declares it
    assert not contract.supports_loss_parallel(Plain())
    assert contract.prefers_meta_init(declaring(prefers_meta_init=property(lambda self: True)))
    assert contract.own_pipeline_parts(declaring(pipeline_parts=lambda self: "parts")) == "parts"
    assert contract.own_pipeline_parts(Plain()) is None


def test_every_module_member_is_checked():
    checked = set(contract._BOOLEANS) | set(contract._METHODS)
    assert _members(ModuleContract) == checked | {"config"}  # `config` may be any config object


def test_ultrascale_strategies_offer_the_strategy_side():
    strategy = ultrascale.ZeRO3Strategy()
    for name in _members(StrategyContract):
        assert hasattr(type(strategy), name), name
    assert inspect.signature(type(strategy).pipeline_loss).parameters.keys() >= {"batch"}
    assert contract.normalizes_token_loss(strategy) and not contract.pipeline_active(strategy)
    lightning_strategy = L.Trainer(accelerator="cpu", devices=1, logger=False).strategy
    assert not contract.normalizes_token_loss(lightning_strategy) and not contract.pipeline_active(lightning_strategy)
    assert contract.attached_strategy(Plain()) is None


def _fit(rank, world_size, members):
    import torch.distributed as dist

    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.ZeRO3Strategy(), max_steps=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    try:
        trainer.fit(declaring(**members))
    except TypeError as error:
        return {"error": str(error), "initialised": dist.is_initialized()}
    return {"error": None}


def test_checked_on_every_rank_before_the_process_group():
    for result in run_ranks(_fit, 2, dict(supports_loss_parallel=1)):
        assert result["error"] is not None and "Declaring.supports_loss_parallel is 1 (int)" in result["error"]
        assert not result["initialised"]
