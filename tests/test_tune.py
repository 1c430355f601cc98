"""`ultrascale tune`: the planner's best layouts for a recipe, each trained a few steps here and measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from tests._cli import run_main
from ultrascale.planner.recipe_check import check_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny_cpu_2d.yaml")
SMALL = ["--data.init_args.max_tokens", "200000"]


class OutOfMemoryUnderZero3(L.Callback):
    """Test only: a candidate that runs out of memory (ZeRO-3 here), as a layout too big for the device would."""

    def on_train_start(self, trainer, pl_module):
        if getattr(trainer.strategy, "zero_stage", None) == 3:
            raise torch.OutOfMemoryError("out of memory: tried to allocate 80.00 GiB (test)")


class WritesItsSteps(L.Callback):
    """Test only: rank 0 leaves the optimizer steps it trained in `default_root_dir/steps.txt` (the forked ranks'
    output does not reach the test's capture)."""

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(trainer.default_root_dir, "steps.txt").write_text(str(trainer.global_step))


@pytest.mark.slow
def test_tune_runs_the_planners_layouts_and_emits_the_fastest(capsys, tmp_path):
    """World 4, `recipes/tiny_cpu_2d.yaml`, the planner's 4 best layouts: the table, a layout failing on purpose
    reported and skipped, the fastest emitted and trained by `ultrascale fit`, the calibration applied by `plan`."""
    emitted, table, calibration = tmp_path / "best.yaml", tmp_path / "tune.json", tmp_path / "calibration.json"
    code, out, err = run_main(capsys, "tune", "--config", RECIPE, *SMALL, "--top", "4", "--steps", "3", "--warmup", "1",
                              "--emit-recipe", str(emitted), "--json", str(table), "--calibrate", str(calibration),
                              "--trainer.callbacks+=tests.test_tune.OutOfMemoryUnderZero3")
    assert code == 0, out + err
    result = json.loads(table.read_text())
    candidates = result["candidates"]
    assert [c["planner_rank"] for c in candidates] == [1, 2, 3, 4]
    failed = [c for c in candidates if c["error"]]
    ran = [c for c in candidates if not c["error"]]
    # The out-of-memory candidate is reported and skipped; the others are measured.
    assert failed and all("zero_stage=3" in c["layout"] and "OutOfMemoryError" in c["error"] for c in failed), candidates
    assert ran and all(c["measured_tokens_per_s"] > 0 and c["measured_peak_gib"] > 0 for c in ran), candidates
    assert out.count("failed: ") == len(failed) and "plan measured" in out, out
    assert err.count("tune [") == 4 and "4/4" in err, err  # one progress line per candidate
    # The emitted recipe is the fastest measured layout, and a valid recipe for the same world.
    fastest = max(ran, key=lambda c: c["measured_tokens_per_s"])
    recipe = yaml.safe_load(emitted.read_text())
    knobs = recipe["trainer"]["strategy"]["init_args"]
    assert f"zero_stage={knobs['zero_stage']}" in fastest["layout"]
    assert f"dp_replicate={knobs['data_parallel_replicate']}" in fastest["layout"]
    plan = check_recipe(str(emitted), SMALL)
    assert plan.world == 4 and plan.work.global_batch == 16  # the recipe's batch, split as the layout splits it
    code, fit_out, fit_err = run_main(capsys, "fit", "--config", str(emitted), *SMALL, "--trainer.max_steps", "2",
                                      "--trainer.strategy.init_args.launcher", "fork", "--trainer.logger", "false",
                                      "--trainer.default_root_dir", str(tmp_path),
                                      "--trainer.callbacks+=tests.test_tune.WritesItsSteps")
    assert code == 0 and (tmp_path / "steps.txt").read_text() == "2", fit_out + fit_err
    assert "fastest    " in out and f"recipe     {emitted}" in out
    # --calibrate: measured / predicted tokens/s, geometric means per layout family and over all runs ...
    ratios = json.loads(calibration.read_text())["ratios"]
    logs = [math.log(c["measured_tokens_per_s"] / c["predicted_tokens_per_s"]) for c in ran]
    assert ratios["all"] == pytest.approx(math.exp(sum(logs) / len(logs)), rel=1e-9)
    assert f"calibration {calibration}: measured / predicted tokens/s" in out
    # ... which `plan --calibration` applies: the recipe's data-parallel layout at its family's ratio.
    _, plain, _ = run_main(capsys, "plan", "--recipe", RECIPE, *SMALL, "--json")
    code, calibrated, err = run_main(capsys, "plan", "--recipe", RECIPE, *SMALL, "--json", "--calibration", str(calibration))
    assert code == 0, err
    plain, calibrated = json.loads(plain), json.loads(calibrated)
    assert calibrated["tokens_per_s_per_gpu"] == pytest.approx(plain["tokens_per_s_per_gpu"] * ratios.get("dp", ratios["all"]),
                                                               rel=1e-3)
    assert (calibrated["dp_shard"], calibrated["tp"], calibrated["pp"]) == (plain["dp_shard"], plain["tp"], plain["pp"])
    code, _, err = run_main(capsys, "plan", "--recipe", RECIPE, *SMALL, "--gpu", "a100", "--calibration", str(calibration))
    assert code == 2 and "measured against predictions for H100 SXM" in err, err
    # Measured on CPU ranks priced as H100s for scale: a plan for real H100s refuses it.
    code, _, err = run_main(capsys, "plan", "--preset", "llama3_8b", "--gpus", "8", "--calibration", str(calibration))
    assert code == 2 and "measured on CPU ranks priced as if on a GPU, for scale; this plan is for GPUs" in err, err


def test_tune_refuses_bad_counts_before_any_run(capsys):
    code, _, err = run_main(capsys, "tune", "--config", RECIPE, "--steps", "3", "--warmup", "3")
    assert code == 2 and "need top >= 1 and 0 <= warmup < steps" in err, err


def test_a_candidate_carries_its_recompute_mode_as_the_one_checkpointing_callback():
    from ultrascale.planner.layouts import Layout
    from ultrascale.verify.tune import candidate_config, resolved_config

    config = resolved_config(str(ROOT / "recipes" / "tiny_cpu_callbacks.yaml"), SMALL)  # has its own checkpointing
    plan = check_recipe(str(ROOT / "recipes" / "tiny_cpu_callbacks.yaml"), SMALL)

    def checkpointing(layout):
        callbacks = candidate_config(config, plan.strategy, layout)["trainer"]["callbacks"]
        return [cb.get("init_args", {}).get("mode") for cb in callbacks if cb["class_path"].endswith("ActivationCheckpointing")]

    assert checkpointing(Layout(dp_shard=2, micro_batch=8, recompute="selective")) == ["selective"]
    assert checkpointing(Layout(dp_shard=2, micro_batch=8, recompute="full")) == ["full"]
    assert checkpointing(Layout(dp_shard=2, micro_batch=8, recompute="none")) == []
    budget = candidate_config(config, plan.strategy, Layout(dp_shard=2, micro_batch=8, recompute="budget",
                                                            recompute_blocks=(0, 1, 1)), cluster=plan.cluster)
    assert [cb["init_args"] for cb in budget["trainer"]["callbacks"] if cb["class_path"].endswith("ActivationCheckpointing")
            ] == [{"memory_budget_gib": round(plan.cluster.usable_bytes / 2**30, 3)}]
    knobs = candidate_config(config, plan.strategy, Layout(dp_shard=2, micro_batch=4, grad_accumulation=2))
    assert knobs["trainer"]["accumulate_grad_batches"] == 2 and knobs["data"]["init_args"]["global_batch_size"] == 8


@pytest.mark.slow
def test_tune_measures_a_recompute_budget(capsys, tmp_path):
    """`--recompute budget`: the planner's layouts with each block's cheapest mode for the GPU, run with the budget
    callback, which chooses the same blocks on the ranks."""
    table, work = tmp_path / "tune.json", tmp_path / "work"
    code, out, err = run_main(capsys, "tune", "--config", RECIPE, *SMALL, "--top", "1", "--steps", "2", "--warmup", "1",
                              "--recompute", "budget", "--json", str(table), "--workdir", str(work))
    assert code == 0, out + err
    [candidate] = json.loads(table.read_text())["candidates"]
    assert "recompute=budget(full 0, selective 0, none 2)" in candidate["layout"], candidate
    assert candidate["error"] is None and candidate["measured_tokens_per_s"] > 0, candidate
    recipe = yaml.safe_load((work / "candidate1.yaml").read_text())
    [checkpointing] = [cb for cb in recipe["trainer"]["callbacks"] if cb["class_path"].endswith("ActivationCheckpointing")]
    assert set(checkpointing["init_args"]) == {"memory_budget_gib"}


@pytest.mark.slow
def test_tune_compile_both_runs_each_layout_eager_and_compiled(capsys, tmp_path):
    """`--compile both`: the planner's best layout run twice, eager and with each block compiled (the recipe's
    backend: aot_eager here, torch.compile's capture without generated kernels), each priced as it runs and ranked
    together."""
    work, table = tmp_path / "work", tmp_path / "tune.json"
    code, out, err = run_main(capsys, "tune", "--config", RECIPE, *SMALL, "--top", "1", "--steps", "3", "--warmup", "1",
                              "--compile", "both", "--json", str(table), "--workdir", str(work),
                              "--trainer.strategy.init_args.compile", "true",
                              "--trainer.strategy.init_args.compile_backend", "aot_eager")
    assert code == 0, out + err
    candidates = json.loads(table.read_text())["candidates"]
    assert sorted(c["compiled"] for c in candidates) == [False, True] and len({c["layout"] for c in candidates}) == 1
    assert all(c["error"] is None and c["measured_tokens_per_s"] > 0 for c in candidates), candidates
    compiled, eager = sorted(candidates, key=lambda c: not c["compiled"])
    assert compiled["planner_rank"] == 1 and compiled["predicted_tokens_per_s"] > eager["predicted_tokens_per_s"]
    for c in candidates:  # each ran the recipe it was priced for
        knobs = yaml.safe_load((work / f"candidate{c['planner_rank']}.yaml").read_text())["trainer"]["strategy"]["init_args"]
        assert knobs["compile"] is c["compiled"] and knobs.get("compile_backend") == ("aot_eager" if c["compiled"] else None)
    assert out.count(", compiled ") == 1 and err.count("tune [") == 2, out + err


def test_tune_compile_both_refuses_a_float8_recipe():
    from ultrascale.planner.recipe_check import check_recipe as check
    from ultrascale.verify.app import VerifyError
    from ultrascale.verify.tune import plan_candidates

    plan = check(RECIPE, [*SMALL, "--trainer.strategy.init_args.compile", "true",
                          "--trainer.callbacks+=ultrascale.callbacks.Float8Training"])
    assert plan.work.float8
    with pytest.raises(VerifyError, match="--compile both: the recipe trains Float8 matmuls"):
        plan_candidates(plan, 1, compile_both=True)
