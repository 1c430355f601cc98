"""`ultrascale verify --explain`: four faults injected into otherwise exact layouts, each named where it is.

Each fault is a callback (or a module) of this file that acts only under the layout it breaks, so the one-device
reference stays exact: (1) the last pipeline stage's gradients scaled by the micro-batches (pp2, 1F1B); (2) a
sequence-parallel norm weight whose gradient is not reduced over tp (tp2), which tensor parallel's first-step check
stops before verify compares; (3) one context-parallel rank's
position ids shifted (cp2, ring); (4) a user's module with a parameter whose gradient depends on the rank (dp2).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from tests._cli import run_main
from ultrascale.models.lm import LlamaLM
from ultrascale.verify.explain import _scaling

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SMALL = ["--data.init_args.max_tokens", "200000", "--steps", "2"]


def _explained(capsys, tmp_path, *args: str) -> tuple[int, str, dict]:
    out_json = tmp_path / "verify.json"
    code, out, err = run_main(capsys, "verify", *args, *SMALL, "--json", str(out_json))
    assert out_json.exists(), out + err
    return code, out, json.loads(out_json.read_text())["explain"]


# --------------------------------------------------------------------------- the faults


class ScaleLastStageGradients(L.Callback):
    """Fault 1: the last pipeline stage's gradients multiplied by the number of micro-batches, as a schedule that
    summed the micro-batches' losses without dividing them would leave them (before the step's normalisation)."""

    def on_after_backward(self, trainer, pl_module):
        strategy = trainer.strategy
        if not getattr(strategy, "pipeline_active", False):
            return
        dims = strategy.parallel_dims
        if strategy.parallel_mesh["pp"].get_local_rank() == dims.pp - 1:
            for param in pl_module.parameters():
                if param.grad is not None:
                    param.grad.mul_(strategy.pipeline_layout.microbatches)


class _NormWithoutGradReduce(torch.distributed.tensor.parallel.ParallelStyle):
    """A sequence-parallel norm whose weight gradient stays each tp rank's own part: the missing all-reduce."""

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import DTensor, Replicate

        from ultrascale.parallel.tensor_styles import _swap_back_params, _swap_in_params

        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, torch.nn.Parameter(replicated))
        module.register_forward_pre_hook(lambda m, args: _swap_in_params(
            m, lambda p: p.to_local(grad_placements=[Replicate()])))
        module.register_forward_hook(_swap_back_params, always_call=True)
        return module


class UnreducedNormGradient(L.Callback):
    """Fault 2: layer 0's attention norm loses the all-reduce of its weight's gradient over tp (its plan entry is
    replaced before the strategy parallelises the model; the reference has no tp, so no plan)."""

    def setup(self, trainer, pl_module, stage):
        import ultrascale.models.tp_plans as plans

        original = plans.llama_tp_plan

        def faulty(**kwargs):
            plan = original(**kwargs)
            prefix = kwargs.get("prefix", "")
            wildcard = f"{prefix}layers.*.attention_norm"
            if wildcard in plan:
                style = plan.pop(wildcard)
                n_layers = len(pl_module.model.layers)
                plan.update({f"{prefix}layers.{i}.attention_norm": style for i in range(1, n_layers)})
                plan[f"{prefix}layers.0.attention_norm"] = _NormWithoutGradReduce()
            return plan

        plans.llama_tp_plan = faulty


class ShiftPositionsOnCpRank1(L.Callback):
    """Fault 3: context-parallel rank 1 sees its tokens' positions shifted by one (its rotary phases are wrong)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        strategy = trainer.strategy
        dims = getattr(strategy, "parallel_dims", None)
        if dims is not None and dims.cp > 1 and strategy.parallel_mesh["cp"].get_local_rank() == 1:
            batch["position_ids"] = batch["position_ids"] + 1


class RankDependentLM(LlamaLM):
    """Fault 4: a user's module whose own parameter gets a gradient that depends on the rank."""

    def configure_model(self):
        super().configure_model()
        if not hasattr(self, "rank_scale"):
            self.rank_scale = torch.nn.Parameter(torch.zeros(4))

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        factor = 1.0 + self.trainer.global_rank  # rank 0 of the reference and of the layout: 1; rank 1: 2
        out["loss"] = out["loss"] + factor * self.rank_scale.sum()  # zero in value, not in gradient
        return out


# --------------------------------------------------------------------------- the tests


def test_a_pipeline_stage_scaled_by_its_micro_batches_is_named(capsys, tmp_path):
    code, out, found = _explained(capsys, tmp_path, "--config", str(RECIPES / "tiny_cpu_pp.yaml"),
                                  "--trainer.devices", "2", "--explain",
                                  "--trainer.callbacks+=tests.test_verify_explain.ScaleLastStageGradients")
    assert code == 1, out
    assert found["first_module"] is None, out  # the forward is exact: the fault is in the gradients
    scaled = {d["name"]: d for d in found["gradients"]}
    assert scaled and all(d["stage"] == 1 and d["scaling"] == "x 4 = the micro-batches" for d in scaled.values()), out
    assert "model.output.weight" in scaled and not any("layers.0." in name for name in scaled), out
    assert "stage 1: " in out and "all scaled x 4 = the micro-batches" in out and "stages that match: 0" in out, out
    assert "cause      x 4 = the micro-batches: summed over the 4 micro-batches without dividing" in out, out


def test_a_sequence_parallel_norm_without_its_all_reduce_is_named(capsys, tmp_path):
    """Tensor parallel's own first-step check (what every tp rank holds whole has one gradient) stops the layout run
    before verify compares, naming the norm: the fault is named in any run, not only under verify."""
    code, out, err = run_main(capsys, "verify", "--config", str(RECIPES / "tiny_cpu_2d.yaml"), *SMALL,
                              "--trainer.devices", "2", "--trainer.strategy.init_args.data_parallel_shard", "1",
                              "--trainer.strategy.init_args.sequence_parallel", "true", "--explain",
                              "--trainer.callbacks+=tests.test_verify_explain.UnreducedNormGradient")
    assert code != 0, out + err
    assert ("the gradients of ['model.layers.0.attention_norm.weight'] differ between the tp ranks" in out + err), out + err


def test_a_context_parallel_rank_with_shifted_positions_is_named(capsys, tmp_path):
    code, out, found = _explained(capsys, tmp_path, "--config", str(RECIPES / "tiny_cpu_cp.yaml"),
                                  "--trainer.devices", "2", "--explain",
                                  "--trainer.callbacks+=tests.test_verify_explain.ShiftPositionsOnCpRank1")
    assert code == 1, out
    first = found["first_module"]
    assert first is not None and first["name"].startswith("model.layers.0.attention"), out
    # The rotary phases are applied inside the attention module, before its kernel: the kernel's input differs.
    assert "first module that differs: model.layers.0.attention" in out, out
    assert found["gradients"], out


def test_a_users_parameter_with_a_rank_dependent_gradient_is_named(capsys, tmp_path):
    code, out, found = _explained(capsys, tmp_path, "--config", str(RECIPES / "tiny_cpu.yaml"), "--explain",
                                  "--model", "tests.test_verify_explain.RankDependentLM")
    assert code == 1, out
    assert found["first_module"] is None, out
    assert [d["name"] for d in found["gradients"]] == ["rank_scale"], out


def test_an_exact_layout_has_no_finding_and_a_failure_is_explained_without_asking(capsys, tmp_path):
    """--explain on an exact layout finds nothing; a failing one is explained by default (one more step of each
    run), and --no-explain leaves it out."""
    code, out, found = _explained(capsys, tmp_path, "--config", str(RECIPES / "tiny_cpu.yaml"), "--explain")
    assert code == 0 and found["gradients"] == [] and found["first_module"] is None, out
    assert "no module output and no gradient differs" in out, out
    code, out, found = _explained(capsys, tmp_path, "--config", str(RECIPES / "tiny_cpu.yaml"),
                                  "--model", "tests.test_verify_explain.RankDependentLM")
    assert code == 1 and [d["name"] for d in found["gradients"]] == ["rank_scale"], out
    code, out, found = _explained(capsys, tmp_path, "--config", str(RECIPES / "tiny_cpu.yaml"), "--no-explain",
                                  "--model", "tests.test_verify_explain.RankDependentLM")
    assert code == 1 and found is None and "explain " not in out, out


def test_the_plot_is_svg_and_is_asked_for_before_any_run(capsys, tmp_path):
    import xml.dom.minidom

    code, _, err = run_main(capsys, "verify", "--config", str(RECIPES / "tiny_cpu.yaml"), "--plot", str(tmp_path / "p.png"))
    assert code == 2 and "written as SVG" in err
    plot = tmp_path / "curves.svg"
    code, out, err = run_main(capsys, "verify", "--config", str(RECIPES / "tiny_cpu.yaml"), *SMALL, "--no-explain",
                              "--plot", str(plot))
    assert code == 0 and f"plot: {plot}" in out, out + err
    svg = xml.dom.minidom.parse(str(plot))
    assert len(svg.getElementsByTagName("polyline")) == 2 * 2 + 2 * 2  # 2 panels x 2 runs, 2 deltas + 2 bounds
    assert "difference per step" in plot.read_text()


@pytest.mark.parametrize("ratio, expected", [
    (4.0, "x 4 = the micro-batches"), (0.5, "/ 2 = the tp"), (2.0, "x 2 = the tp"), (5.0, None), (1.0 / 3, "/ 3 = the dp"),
])
def test_a_ratio_is_named_by_the_layout_size_it_equals(ratio, expected):
    scaling, cause = _scaling(ratio, {"micro-batches": 4, "dp": 3, "tp": 2, "cp": 1, "pp": 1})
    assert scaling == expected and (cause is None) == (expected is None)


# --------------------------------------------------------------------------- the comparison alone, on written traces


def _trace(folder: Path, modules: dict, grads: dict, sizes: dict, stages: dict | None = None) -> Path:
    from safetensors.torch import save_file

    (folder / "grads-rank0").mkdir(parents=True)
    for index, (name, grad) in enumerate(grads.items()):
        save_file({name: grad}, str(folder / "grads-rank0" / f"{index}.safetensors"))
    (folder / "trace.json").write_text(json.dumps({"modules": modules, "stages": stages or {}, "sizes": sizes, "world": 1}))
    return folder


def _sums(values: torch.Tensor) -> dict:
    features = values.double().reshape(-1, values.shape[-1])
    return {"sum": features.sum(0).tolist(), "squares": float(features.square().sum()), "tokens": float(features.shape[0])}


def test_feature_shards_are_put_side_by_side_and_a_stacked_experts_odd_one_is_named(tmp_path):
    """A column-parallel output held as two tp coordinates' feature halves compares with the whole one; a token-split
    output (two coordinates of the full width) sums; an expert whose gradient differs is named among its stack."""
    from ultrascale.verify.explain import explain

    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    experts = torch.randn(4, 3, 5)
    broken = experts.clone()
    broken[2] *= 3.0
    reference = _trace(tmp_path / "ref", {
        "proj": {"output": [_sums(x)], "input": [_sums(y)]},
        "norm": {"output": [_sums(y)], "input": None},
    }, {"experts.w": experts, "norm.weight": torch.ones(4)}, {"tp": 1})
    layout = _trace(tmp_path / "lay", {
        "proj": {"output": [_sums(x[:, :4]), _sums(x[:, 4:])], "input": [_sums(y[:3]), _sums(y[3:])]},
        "norm": {"output": [_sums(y[:2]), _sums(y[2:])], "input": None},
    }, {"experts.w": broken, "norm.weight": torch.ones(4)}, {"tp": 2})
    found = explain(reference, layout, 1e-6)
    assert found.first_module is None and found.modules_compared == 2
    assert [d.name for d in found.gradients] == ["experts.w"]
    assert "experts.w: experts (its first dim) [2] of 4 differ, the others match" in found.groups
    # The same traces with one feature shard off: the module is named, its input still matching.
    shifted = _trace(tmp_path / "shifted", {
        "proj": {"output": [_sums(x[:, :4]), _sums(x[:, 4:] + 0.1)], "input": [_sums(y[:3]), _sums(y[3:])]},
        "norm": {"output": [_sums(y)], "input": None},
    }, {"experts.w": experts, "norm.weight": torch.ones(4)}, {"tp": 2})
    first = explain(reference, shifted, 1e-6).first_module
    assert first is not None and first.name == "proj" and not first.input_differs


def test_under_torchrun_explain_asks_for_a_shared_workdir_before_any_run(monkeypatch):
    import ultrascale.verify.app as app

    monkeypatch.setattr(app, "launched_by_torchrun", lambda: True)
    with pytest.raises(app.VerifyError, match="--explain needs --workdir DIR on a filesystem every rank sees"):
        app.verify(["--config", str(RECIPES / "tiny_cpu.yaml")], explain=True)
