"""`ultrascale verify` and `ultrascale verify-matrix`: a recipe's layout against one device, step by step.

Each verify trains two runs in forked processes (the layout's ranks forked again by its launcher), so nothing
of a fit stays in this process; one test goes through the installed command in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import ultrascale
from tests._cli import run_main
from ultrascale.verify import compare, within
from ultrascale.verify.layouts import LAYOUTS
from ultrascale.verify.matrix import matrix_markdown, run_matrix

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SMALL_DATA = ["--data.init_args.max_tokens", "200000"]  # the stdlib corpus capped: seconds to tokenize


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    return run_main(capsys, "verify", *args)


# --------------------------------------------------------------------------- the comparison alone


def test_the_tolerance_is_absolute_near_zero_and_relative_above():
    assert within(5.0, 5.0 + 5e-4, 1e-4) and not within(5.0, 5.0 + 7e-4, 1e-4)
    assert within(0.0, 1e-4, 1e-4) and not within(0.0, 2e-4, 1e-4)
    assert not within(1.0, float("nan"), 1e-4)


def test_compare_names_the_first_step_beyond_the_tolerance():
    reference = [{"step": 1, "loss": 5.0, "grad_norm": 2.0}, {"step": 2, "loss": 4.9, "grad_norm": 1.5}]
    same = compare(reference, [dict(s) for s in reference], 1e-4)
    assert same.passed and same.max_delta() == 0
    off = compare(reference, [{"step": 1, "loss": 5.0, "grad_norm": 2.0}, {"step": 2, "loss": 4.9, "grad_norm": 1.6}], 1e-4)
    assert not off.passed and off.mismatches[0].step == 2 and off.mismatches[0].quantity == "grad_norm"
    shorter = compare(reference, reference[:1], 1e-4)
    assert not shorter.passed and shorter.mismatches[0].quantity == "steps"
    nothing = compare([{"step": 1, "loss": None, "grad_norm": None}], [{"step": 1, "loss": None, "grad_norm": None}], 1e-4)
    assert not nothing.passed and not nothing.compared


# --------------------------------------------------------------------------- bad input, before any run


def test_bad_input_is_refused_before_any_run(capsys, tmp_path):
    recipe = str(RECIPES / "tiny_cpu_2d.yaml")
    code, _, err = _verify(capsys, "--config", recipe, "--steps", "0")
    assert code == 2 and "--steps 0: must be >= 1" in err, err
    code, _, err = _verify(capsys, "--config", recipe, "--against", "zero4")
    assert code == 2 and "--against 'zero4': choose one of one, zero1" in err, err
    code, _, err = _verify(capsys, "--config", recipe, "--tolerance", "0")
    assert code == 2 and "must be > 0" in err, err
    # The rulebook refuses tp=3 for 4 ranks: said before any process starts (no run's log in the workdir).
    code, _, err = _verify(capsys, "--config", recipe, "--trainer.strategy.init_args.tensor_parallel", "3",
                           "--workdir", str(tmp_path))
    assert code == 2 and "UltraScaleStrategy: invalid layout for 4 processes" in err and "tp(3)" in err, err
    # A reference the recipe's world cannot hold: tp_x_dp needs 4 ranks, tiny_cpu.yaml runs 2.
    code, _, err = _verify(capsys, "--config", str(RECIPES / "tiny_cpu.yaml"), "--against", "tp_x_dp", "--workdir", str(tmp_path))
    assert code == 2 and "tp_x_dp needs a world of at least 4" in err, err
    assert not list(tmp_path.glob("*.log"))


# --------------------------------------------------------------------------- recipes pass, a broken reduction fails


@pytest.mark.slow
def test_tiny_2d_recipe_passes_through_the_command(tmp_path):
    """`ultrascale verify --config recipes/tiny_cpu_2d.yaml` as a user types it (ZeRO-3 x tp 2 on 4 ranks)."""
    done = subprocess.run([sys.executable, "-m", "ultrascale.cli", "verify", "--config", str(RECIPES / "tiny_cpu_2d.yaml"),
                           *SMALL_DATA, "--steps", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "layout     pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 (world 4)" in out
    assert "PASS: largest |Δ|" in out and "over 3 steps (loss, grad_norm;" in out
    assert out.count("  rank ") == 4 and "planner H100 SXM" in out and "not comparable" in out
    assert not list(tmp_path.iterdir())  # no runs/ folder, no checkpoint: verify writes nothing of the recipe's


@pytest.mark.slow
def test_verify_under_torchrun(tmp_path):
    """Under torchrun every rank trains the layout in its own process; rank 0 then starts the one-device reference
    as a job of its own (the launch variables dropped) and prints the comparison."""
    from ultrascale.launch import without_launch_variables

    env = without_launch_variables(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "ultrascale.cli", "verify", "--config", str(RECIPES / "tiny_cpu.yaml"), *SMALL_DATA,
                           "--steps", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "layout     pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1 (world 2)" in out
    assert out.count("PASS: largest |Δ|") == 1 and out.count("  rank ") == 2, out[-4000:]


def test_hf_finetune_recipe_passes(capsys, tmp_path, monkeypatch, two_thread_region_ran):
    from tests.test_hf import _checkpoint_and_instructions

    # What a one-device fit earlier in this process leaves behind (Lightning's launch variables): the runs must
    # start their own ranks regardless, not join that finished world.
    for name, value in (("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)

    source, data = _checkpoint_and_instructions(tmp_path)
    code, out, err = _verify(capsys, "--config", str(RECIPES / "hf_finetune.yaml"), "--model.pretrained_path", str(source),
                             "--data.data_path", str(data), "--data.init_args.prompt_template", "{prompt}",
                             "--data.init_args.seq_len", "32", "--steps", "3", "--json", str(tmp_path / "verify.json"),
                             "--explain")
    assert code == 0, out + err
    assert "dp_shard=2" in out and "PASS" in out, out
    import json

    written = json.loads((tmp_path / "verify.json").read_text())
    assert written["passed"] and len(written["layout_steps"]) == 3 and written["max_delta"] <= 1e-4
    # Module by module too: a Hugging Face model's outputs and gradients, nothing found.
    explained = written["explain"]
    assert explained["modules_compared"] > 10 and explained["parameters_compared"] > 5, explained
    assert explained["first_module"] is None and explained["gradients"] == [], explained


class UserLM(L.LightningModule):
    """A user's own module, unknown to ultrascale: blocks as direct children, its own optimizer, `token_loss`."""

    def __init__(self, vocab_size: int = 258, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab_size, bias=False)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch["input_ids"])
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return ultrascale.token_loss(self.head(x), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_a_users_own_module_passes(capsys):
    """The recipe's data and layout (ZeRO-3 on 2 ranks) with a LightningModule of the user's: no planner shape, so
    no prediction, but the same comparison."""
    code, out, err = _verify(capsys, "--config", str(RECIPES / "tiny_cpu.yaml"), *SMALL_DATA, "--steps", "2",
                             "--model", "tests.test_verify.UserLM")
    assert code == 0, out + err
    assert "dp_shard=2" in out and "PASS: largest |Δ|" in out and out.count("  rank ") == 2, out
    assert "planner: no prediction (UserLM:" in out


class BreakRank1Reduction(L.Callback):
    """Test only: rank 1's gradients reach ZeRO-1's reduction doubled (a hook on each parameter's gradient, which
    runs before the engine accumulates and reduces it inside backward), as a reduction that scaled one rank's
    contribution wrongly would."""

    def on_train_start(self, trainer, pl_module):
        self.hooks = [param.register_hook(lambda grad: grad * 2.0) for param in pl_module.parameters()
                      if param.requires_grad] if trainer.global_rank == 1 else []

    def on_train_end(self, trainer, pl_module):
        for hook in self.hooks:
            hook.remove()


def test_a_broken_reduction_fails_naming_the_step_and_the_difference(capsys, two_thread_region_ran):
    code, out, err = _verify(capsys, "--config", str(RECIPES / "tiny_cpu.yaml"), *SMALL_DATA, "--steps", "2",
                             "--trainer.strategy", "ultrascale_zero1",
                             "--trainer.callbacks+=tests.test_verify.BreakRank1Reduction")
    assert code == 1, out + err
    assert "FAIL: largest |Δ|" in out and "first beyond the tolerance at step 1: grad_norm" in out, out
    assert "left out of both runs (they save, log or validate): ModelCheckpoint, LearningRateMonitor" in out


# --------------------------------------------------------------------------- the matrix at world 1, 2, 4, 8


def _matrix(world: int, layouts: list[str] | None = None, explain: bool | None = None) -> dict[str, str]:
    rows = run_matrix(world, steps=2, layouts=layouts, explain=explain)
    if explain:  # every layout that ran was compared module by module, and nothing was found
        for row in rows:
            if row.report is not None:
                explanation = row.report.explanation
                assert explanation is not None and explanation.parameters_compared > 0, row.layout
                assert not explanation.found, "\n".join([row.layout, *explanation.lines()])
    table = "\n".join(matrix_markdown(rows, accelerator="cpu", tolerance=1e-4, steps=2))
    assert table.count("\n| ") == len(layouts or LAYOUTS) + 1  # the header and a row per layout
    return {row.layout: row.status for row in rows}


def test_matrix_world_1(two_thread_region_ran):
    statuses = _matrix(1)
    # The auto layout's search once capped micro-batches at 8 sequences, so a 16-sequence batch on one device found
    # no layout (found by this matrix): it now lets one Lightning batch be one micro-batch of any size.
    assert {name for name, status in statuses.items() if status == "pass"} == {"zero1", "zero2", "zero3", "auto"}
    assert statuses["tp"] == "skipped: tp needs a world of at least 2"


def test_matrix_world_2():
    statuses = _matrix(2)
    assert all(status == "pass" for name, status in statuses.items() if LAYOUTS[name].fits(2) is None), statuses
    assert statuses["hsdp"].startswith("skipped")


# At world 4 the layouts that need it (hsdp, tp x dp, cp as 2 ring x 2 Ulysses) and those whose shape changes with it
# (tp 4, cp 4, the pipelines over ZeRO-3 2, ep 4); the rest run their world-4 parity in their own tests (test_zero12.py;
# ep_zero1 and ep_x_tp: test_expert_parallel.py's ZeRO-1/2 x EP and EP x TP cases, against the inline reference).
WORLD_4 = ["hsdp", "tp_x_dp", "tp", "cp_ring", "cp_usp", "pp_zbv", "ep"]


@pytest.mark.slow
def test_matrix_world_4():
    """With --explain: no module output and no gradient of an exact layout differs from one device's."""
    statuses = _matrix(4, WORLD_4, explain=True)
    assert all(status == "pass" for status in statuses.values()), statuses


# At world 8 what only world 8 has: pp x dp x tp (needs 8) and tp 8 (refused for 4 kv heads); the whole matrix at
# 8 is the docs table's (`ultrascale verify-matrix --world 8`), about 200 s on 2 cores.
WORLD_8 = ["pp_x_dp_x_tp", "tp"]


@pytest.mark.slow
def test_matrix_world_8():
    statuses = _matrix(8, WORLD_8)
    # The tiny model has 4 kv heads: the rulebook refuses tp 8, and says so in the table.
    assert statuses["tp"].startswith("skipped: UltraScaleStrategy") and "tensor_parallel=8" in statuses["tp"], statuses
    assert all(status == "pass" for name, status in statuses.items() if name != "tp"), statuses


# --------------------------------------------------------------------------- the reduced-depth copy


def test_a_depth_the_model_or_layout_cannot_have_is_refused_before_any_run(capsys):
    code, _, err = _verify(capsys, "--config", str(RECIPES / "tiny_cpu.yaml"), "--depth", "2")
    assert code == 2 and "--depth 2: the model has 2 blocks and the layout 1 pipeline stage(s); give 1 to 1" in err, err
    code, _, err = _verify(capsys, "--config", str(RECIPES / "tiny_cpu_pp.yaml"), "--model.init_args.preset", "small",
                           "--depth", "1")
    assert code == 2 and "--depth 1: the model has 4 blocks and the layout" in err, err


def test_a_model_too_big_for_one_device_gets_a_reduced_depth_copy(capsys, monkeypatch):
    """The planner prices the whole model's one-device fp32 peak above the device: both runs keep the most blocks
    whose peak fits (here a device between the 2- and 3-block peaks of the 4-block `small` preset), said so."""
    import dataclasses

    from ultrascale import planner
    from ultrascale.verify import app
    from ultrascale.verify.depth import one_device_depth

    args = ["--config", str(RECIPES / "tiny_cpu.yaml"), "--model.init_args.preset", "small", *SMALL_DATA]
    plan, _ = app.check_layout(args, "h100")
    single = planner.Layout(micro_batch=plan.work.global_batch)
    work = dataclasses.replace(plan.work, precision="32-true")

    def peak(layers):
        shape = dataclasses.replace(plan.shape, n_layers=layers)
        return planner.evaluate(shape, single, dataclasses.replace(plan.cluster, gpus=1), work).memory["total"]

    device = (peak(2) + peak(3)) / 2
    assert one_device_depth(plan, peak(4), 1) is None and one_device_depth(plan, device, 1) == 2
    assert one_device_depth(plan, 1.0, 3) == 3  # nothing fits: as deep as the layout's stages need
    monkeypatch.setattr(app, "_device_bytes", lambda: device)
    code, out, err = _verify(capsys, *args, "--steps", "2")
    assert code == 0, out + err
    assert "depth      a reduced-depth copy: both runs keep the first 2 of the model's 4 blocks" in out, out


def test_hf_recipe_at_reduced_depth(capsys, tmp_path):
    """`--depth 1`: the HF config cut to one block, whose weights alone are read from the 2-block checkpoint."""
    from tests.test_hf import _checkpoint_and_instructions

    source, data = _checkpoint_and_instructions(tmp_path)
    code, out, err = _verify(capsys, "--config", str(RECIPES / "hf_finetune.yaml"), "--model.pretrained_path", str(source),
                             "--data.data_path", str(data), "--data.init_args.prompt_template", "{prompt}",
                             "--data.init_args.seq_len", "32", "--steps", "2", "--depth", "1")
    assert code == 0, out + err
    assert "both runs keep the first 1 of the model's 2 blocks" in out and "PASS" in out, out
