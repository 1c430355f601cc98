"""`ultrascale tune`: the planner's best layouts for a recipe, measured on this machine's devices.

    ultrascale tune --config RECIPE [LightningCLI overrides] [--top 4] [--steps 8] [--warmup 3]
                    [--compile {recipe,both}] [--emit-recipe FILE] [--json FILE] [--calibrate FILE]

Order of work: the recipe is checked and priced as `ultrascale plan --recipe` does (its world size, sequence
length, global batch, precision and compile are the recipe's); the planner ranks every layout of that world
(`planner.search`) and the `--top` fitting ones become candidate recipes: the resolved recipe with
`UltraScaleStrategy`'s degrees, ZeRO stage and pipeline knobs, the batch split (`planner.recipe.strategy_knobs`,
`batch_knobs`) and the recompute mode (an `ActivationCheckpointing` callback) of each. Each trains `--steps`
optimizer steps the way `verify` runs a layout (a process of its own, nothing written, the recipe's precision),
one after another; a candidate that fails (out of memory, a refusal) is reported and skipped. Timing leaves out
the first `--warmup` steps (compilation, allocator warm-up): tokens/s per device = tokens per step x timed steps /
their wall time / world. The table puts the planner's prediction and the measurement side by side, with both
rankings. `--compile both` runs each of the `--top` layouts twice, eager and with each block compiled (the
strategies' `compile`), each priced as it runs: compile's gain measured here beside the one the planner assumes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from ultrascale.planner.calibration import Calibration
from ultrascale.verify.app import Launch, VerifyError, config_and_overrides, launch_run
from ultrascale.verify.report import RankFigures
from ultrascale.verify.run import RunSpec

CARRIED_KNOBS = ("compile", "compile_backend", "meta_init", "sequence_parallel", "loss_parallel")
"""The recipe's strategy knobs every candidate keeps (the planner prices the recipe's compile)."""


@dataclass
class Candidate:
    """One layout of the planner's top rows, its prediction and (once run) its measurement."""

    rank: int
    """1-based position in the planner's ranking."""
    layout: Any
    """The planner's `Layout`."""
    predicted_tokens_per_s: float
    predicted_mfu: float
    predicted_memory_gib: float
    measured_tokens_per_s: Optional[float] = None
    measured_mfu: Optional[float] = None
    measured_peak_gib: Optional[float] = None
    error: Optional[str] = None
    recipe: Optional[dict[str, Any]] = None
    compiled: bool = False
    """Each block under torch.compile (the strategies' `compile=True`), as priced and as run."""

    def describe(self) -> str:
        lay = self.layout
        degrees = " x ".join(f"{axis}={getattr(lay, axis)}" for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                             if getattr(lay, axis) > 1) or "one rank"
        extra = [f"zero{lay.zero_stage}", f"mb {lay.micro_batch}", f"acc {lay.grad_accumulation}"]
        if lay.recompute != "none":
            extra.append(f"recompute {lay.recompute_label}")
        if lay.accumulate_unsharded_grads:
            extra.append("unsharded grads")
        if lay.pp > 1:
            extra.append(str(lay.pipeline_schedule or "1F1B"))
        if lay.cp > 1:
            extra.append(lay.cp_method + (f" (ulysses {lay.cp_ulysses})" if lay.cp_method == "usp" else ""))
        if self.compiled:
            extra.append("compiled")
        return f"{degrees}, {', '.join(extra)}"

    def to_json(self) -> dict[str, Any]:
        return {"planner_rank": self.rank, "layout": self.layout.describe(), "compiled": self.compiled,
                "predicted_tokens_per_s": self.predicted_tokens_per_s, "predicted_mfu": self.predicted_mfu,
                "predicted_memory_gib": self.predicted_memory_gib,
                "measured_tokens_per_s": self.measured_tokens_per_s, "measured_mfu": self.measured_mfu,
                "measured_peak_gib": self.measured_peak_gib, "error": self.error}


def resolved_config(recipe: str, overrides: Sequence[str]) -> dict[str, Any]:
    """The recipe with its overrides applied, as LightningCLI resolves it (every default written out)."""
    from ultrascale.planner.recipe_check import parse_recipe

    cli = parse_recipe(recipe, overrides)
    return yaml.safe_load(cli.parser.dump(cli.config, skip_none=True))


def candidate_config(config: dict[str, Any], strategy: Any, layout: Any, compiled: Optional[bool] = None,
                     cluster: Any = None) -> dict[str, Any]:
    """`config` running `layout`: `UltraScaleStrategy` with its degrees (and the recipe strategy's `CARRIED_KNOBS`;
    `compile` as `compiled` says when given),
    the data's global batch and the Trainer's accumulation of its batch split, and its recompute mode as the one
    `ActivationCheckpointing` callback (the recipe's own replaced; none for "none"; a budget's for `cluster`)."""
    from ultrascale.planner.recipe import batch_knobs, checkpointing_args, strategy_knobs
    from ultrascale.strategies import UltraScaleStrategy

    accepted = inspect.signature(UltraScaleStrategy.__init__).parameters
    carried = {knob: getattr(strategy, knob) for knob in CARRIED_KNOBS if knob in accepted and hasattr(strategy, knob)}
    if compiled is not None:
        carried["compile"] = compiled
        if not compiled:
            carried.pop("compile_backend", None)  # the strategy takes a backend only with compile=True
    global_batch, accumulate = batch_knobs(layout)
    out = json.loads(json.dumps(config))  # a deep copy of plain data
    out["trainer"]["strategy"] = {"class_path": "ultrascale.UltraScaleStrategy",
                                  "init_args": {**carried, **strategy_knobs(layout)}}
    out["trainer"]["accumulate_grad_batches"] = accumulate
    callbacks = [cb for cb in out["trainer"].get("callbacks") or []
                 if not str(cb.get("class_path", "") if isinstance(cb, dict) else cb).endswith("ActivationCheckpointing")]
    checkpointing = checkpointing_args(layout, cluster)
    if checkpointing is not None:
        callbacks.append({"class_path": "ultrascale.callbacks.ActivationCheckpointing", "init_args": checkpointing})
    out["trainer"]["callbacks"] = callbacks
    data = out.get("data") or {}
    (data.get("init_args", data))["global_batch_size"] = global_batch
    return out


def plan_candidates(plan: Any, top: int, compile_both: bool = False, recompute: Optional[str] = None) -> list[Candidate]:
    """The planner's `top` fitting layouts for the recipe's model, data and world (any recompute mode, or `recompute`:
    "budget" for each block's cheapest mode that fits), priced with the recipe's compile; with `compile_both`, each
    eager and compiled, priced so, ranked together by prediction."""
    import dataclasses

    from ultrascale.hardware import GIB
    from ultrascale.planner.cost import evaluate
    from ultrascale.planner.search import search

    rows = search(plan.shape, plan.cluster, plan.work, fixed={"recompute": recompute} if recompute else None,
                  max_micro_batch=max(plan.work.global_batch, 1), top=top)
    fitting = [row for row in rows if row.fits and not row.problems][:top]
    if not compile_both:
        return [Candidate(i + 1, row.layout, row.tokens_per_s_per_gpu, row.mfu, row.memory["total"] / GIB,
                          compiled=plan.work.compiled) for i, row in enumerate(fitting)]
    if plan.work.float8:
        raise VerifyError("--compile both: the recipe trains Float8 matmuls, which ultrascale prices and runs compiled "
                          "only; drop its Float8Training callback to compare eager and compiled")
    priced = [(evaluate(plan.shape, row.layout, plan.cluster, dataclasses.replace(plan.work, compiled=compiled)), compiled)
              for row in fitting for compiled in (False, True)]
    priced.sort(key=lambda pair: -pair[0].tokens_per_s_per_gpu)  # stable: eager before compiled on a tie
    return [Candidate(i + 1, row.layout, row.tokens_per_s_per_gpu, row.mfu, row.memory["total"] / GIB, compiled=compiled)
            for i, (row, compiled) in enumerate(priced)]


def measure(candidate: Candidate, result: dict[str, Any], tokens_per_step: int, warmup: int) -> None:
    """The run's tokens/s per device over the steps after `warmup`, its MFU (the monitor's FLOPs per token and peak,
    at that rate) and the largest rank's peak memory."""
    steps = result["steps"]
    times = [step.get("time") for step in steps]
    if len(steps) <= warmup or None in times:
        raise VerifyError(f"{len(steps)} steps recorded, fewer than --warmup {warmup} + 1")
    seconds = times[-1] - times[warmup - 1] if warmup > 0 else times[-1] - result["start_time"]
    rate = tokens_per_step * (len(steps) - warmup) / seconds / result["world"]
    ranks = [RankFigures.of(figures) for figures in result["ranks"]]
    per_token = [r.mfu / r.tokens_per_s for r in ranks if r.mfu and r.tokens_per_s]
    peaks = [r.peak_memory_gib for r in ranks if r.peak_memory_gib is not None]
    candidate.measured_tokens_per_s = rate
    candidate.measured_mfu = rate * sum(per_token) / len(per_token) if per_token else None
    candidate.measured_peak_gib = max(peaks) if peaks else None


def tune(cli_args: Sequence[str], *, top: int = 4, steps: int = 8, warmup: int = 3, gpu: str = "h100",
         launch: Launch = "auto", workdir: Optional[Path] = None, progress: Any = None,
         compile_both: bool = False, recompute: Optional[str] = None) -> tuple[Any, list[Candidate]]:
    """Price, then run, the planner's `top` layouts for the recipe (each eager and compiled with `compile_both`;
    `recompute` fixed where given, as `plan_candidates` takes it); returns (the recipe's `RecipePlan`, the
    candidates in the planner's order, measured)."""
    from ultrascale.data.errors import DataError
    from ultrascale.user_errors import user_error_types
    from ultrascale.verify.app import auto_launch, check_layout

    if top < 1 or steps < 1 or not 0 <= warmup < steps:
        raise VerifyError(f"--top {top}, --steps {steps}, --warmup {warmup}: need top >= 1 and 0 <= warmup < steps")
    plan, why_not = check_layout(list(cli_args), gpu, precision=None)
    if plan is None:
        raise VerifyError(f"the planner cannot price this recipe, so it has no layouts to propose: {why_not}")
    candidates = plan_candidates(plan, top, compile_both, recompute)
    if not candidates:
        raise VerifyError(f"no layout of {plan.world} ranks fits the planner's memory for this recipe")
    recipe, overrides = config_and_overrides(cli_args)
    config = resolved_config(recipe, overrides)
    fork = (auto_launch() if launch == "auto" else launch) == "fork"
    with tempfile.TemporaryDirectory(prefix="ultrascale-tune-") as temp:
        work = Path(workdir or temp)
        work.mkdir(parents=True, exist_ok=True)
        for index, candidate in enumerate(candidates):
            candidate.recipe = candidate_config(config, plan.strategy, candidate.layout, candidate.compiled, plan.cluster)
            path = work / f"candidate{candidate.rank}.yaml"
            path.write_text(yaml.safe_dump(candidate.recipe, sort_keys=False))
            spec = RunSpec(["--config", str(path)], steps, str(work / f"candidate{candidate.rank}.json"), fork=fork,
                           precision=None)
            try:
                measure(candidate, launch_run(spec, work, f"candidate {candidate.rank}", launch), plan.work.tokens, warmup)
            except DataError:  # the same data for every candidate: say it once, run no more
                raise
            except (VerifyError, *user_error_types()) as error:  # out of memory, a refusal: reported, the next runs
                candidate.error = str(error).split(" (its log: ")[0].removeprefix(f"the candidate {candidate.rank} run failed: ")
            if progress is not None:
                progress(index + 1, len(candidates), candidate)
    return plan, candidates


def table(plan: Any, candidates: list[Candidate], steps: int, warmup: int) -> list[str]:
    measured = sorted((c for c in candidates if c.measured_tokens_per_s), key=lambda c: -(c.measured_tokens_per_s or 0))
    measured_rank = {id(c): i + 1 for i, c in enumerate(measured)}
    gpu = plan.cluster.gpu.name
    width = max([44, *(len(c.describe()) for c in candidates)])
    lines = [f"recipe     {plan.path}: {plan.world} ranks, {plan.work.tokens:,} tokens per step, {plan.work.precision}; "
             f"{steps} steps per layout, the first {warmup} not timed",
             f"planner    its {len({c.layout for c in candidates})} best layouts for this recipe, priced on {gpu}"
             + (", each eager and compiled" if len({c.compiled for c in candidates}) > 1 else ""),
             *[f"note       {note}" for note in plan.notes],
             "",
             f"{'plan':>4} {'measured':>8}  {'layout':<{width}} {'tokens/s/dev':>12} {'predicted':>12} {'MFU':>7} "
             f"{'predicted':>9} {'peak GiB':>9} {'predicted':>9}"]
    for c in candidates:
        if c.error is not None:
            lines.append(f"{c.rank:>4} {'-':>8}  {c.describe():<{width}} failed: {c.error}")
            continue
        lines.append(f"{c.rank:>4} {measured_rank[id(c)]:>8}  {c.describe():<{width}} {c.measured_tokens_per_s:>12,.0f} "
                     f"{c.predicted_tokens_per_s:>12,.0f} {_percent(c.measured_mfu):>7} {_percent(c.predicted_mfu):>9} "
                     f"{_gib(c.measured_peak_gib):>9} {_gib(c.predicted_memory_gib):>9}")
    if measured:
        best = measured[0]
        agree = "the planner's first choice too" if best.rank == 1 else f"the planner ranked it {best.rank}"
        lines += ["", f"fastest    {best.describe()}: {best.measured_tokens_per_s:,.0f} tokens/s per device ({agree})"]
    return lines


def _percent(value: Optional[float]) -> str:
    return f"{value:.2%}" if value is not None else "-"


def _gib(value: Optional[float]) -> str:
    return f"{value:.3f}" if value is not None else "-"


def tune_main(args: list[str]) -> None:
    from ultrascale.parallel.rules import PLANNED_RECOMPUTE
    from ultrascale.planner import GPU_SPECS

    parser = argparse.ArgumentParser(
        prog="ultrascale tune", allow_abbrev=False,
        usage="ultrascale tune --config RECIPE [LightningCLI overrides] [--top K] [--steps N] [--warmup W] [options]",
        description="Run the planner's best layouts for a recipe on this machine's devices, a few steps each, and "
                    "put predicted and measured tokens/s, MFU and memory side by side. Exit 2 for bad input, 1 if "
                    "every candidate failed.")
    parser.add_argument("--top", type=int, default=4, help="how many of the planner's layouts to run (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per layout (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed (default 3)")
    parser.add_argument("--compile", default="recipe", choices=["recipe", "both"],
                        help="recipe: every layout compiled as the recipe's strategy says; both: each layout run eager "
                             "and with each block compiled, each priced so (default recipe)")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_SPECS), help="the GPU the planner prices (default h100)")
    parser.add_argument("--recompute", default=None, choices=PLANNED_RECOMPUTE,
                        help="the layouts' recompute (default: searched); budget: each block's cheapest mode that fits "
                             "the GPU, run as ActivationCheckpointing(memory_budget_gib=)")
    parser.add_argument("--launch", default="auto", choices=["auto", "fork", "subprocess"])
    parser.add_argument("--workdir", default=None, help="keep the candidates' recipes, logs and results here")
    parser.add_argument("--emit-recipe", default=None, metavar="FILE",
                        help="write the fastest measured layout as a recipe `ultrascale fit --config FILE` runs")
    parser.add_argument("--json", default=None, help="also write the table as JSON")
    parser.add_argument("--calibrate", default=None, metavar="FILE",
                        help="write this machine's measured / predicted tokens/s per layout family, which `ultrascale plan "
                             "--calibration FILE` and the strategies' `planner_calibration` apply")
    options, cli_args = parser.parse_known_args(args)

    def progress(done: int, total: int, candidate: Candidate) -> None:
        what = (f"{candidate.measured_tokens_per_s:,.0f} tokens/s per device" if candidate.error is None
                else f"failed: {candidate.error}")
        print(f"tune [{'#' * done}{'.' * (total - done)}] {done}/{total}  {candidate.describe()}: {what}", file=sys.stderr)

    try:
        plan, candidates = tune(cli_args, top=options.top, steps=options.steps, warmup=options.warmup, gpu=options.gpu,
                                launch=options.launch, workdir=Path(options.workdir) if options.workdir else None,
                                progress=progress, compile_both=options.compile == "both", recompute=options.recompute)
    except (VerifyError, ValueError, NotImplementedError) as error:
        print(f"ultrascale tune: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(table(plan, candidates, options.steps, options.warmup)))
    measured = [c for c in candidates if c.measured_tokens_per_s]
    if options.json:
        Path(options.json).write_text(json.dumps({"recipe": plan.path, "world": plan.world, "steps": options.steps,
                                                  "warmup": options.warmup, "candidates": [c.to_json() for c in candidates]},
                                                 indent=1))
    if options.emit_recipe and measured:
        best = max(measured, key=lambda c: c.measured_tokens_per_s or 0)
        header = (f"# Written by `ultrascale tune`: the fastest of the planner's {len(candidates)} layouts measured here "
                  f"({best.measured_tokens_per_s:,.0f} tokens/s per device): {best.describe()}\n")
        Path(options.emit_recipe).write_text(header + yaml.safe_dump(best.recipe, sort_keys=False))
        print(f"recipe     {options.emit_recipe}")
    if options.calibrate and measured:
        calibration = Calibration.fit(((c.layout, c.measured_tokens_per_s or 0.0, c.predicted_tokens_per_s) for c in measured),
                                      gpu=plan.cluster.gpu.name, machine=f"`ultrascale tune` of {plan.path}, {plan.world} ranks",
                                      devices=plan.devices)
        calibration.save(options.calibrate)
        print(f"calibration {options.calibrate}: measured / predicted tokens/s {calibration.describe()}")
    if not measured:
        raise SystemExit(1)


__all__ = ["Candidate", "candidate_config", "plan_candidates", "tune", "tune_main"]
