"""`ultrascale verify`: a recipe's layout against one device (or another layout), step by step.

    ultrascale verify --config recipes/tiny_cpu_2d.yaml [LightningCLI overrides] [--steps 5] [--against one]

Order of work: the arguments are checked; the recipe is checked as `ultrascale plan --recipe` checks it (the
strategy's rulebook on the meta device, no process started) and its layout priced by the planner; then the
layout run and the reference run train, each in a process of its own (forked on CPU, a subprocess on GPU,
in the ranks themselves under torchrun); their per-step numbers are compared here.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from ultrascale.verify.explain import explain as explain_step
from ultrascale.verify.layouts import LAYOUTS, ONE, layout_names
from ultrascale.verify.report import (
    Comparison,
    Prediction,
    RankFigures,
    compare,
    figures_table,
    step_table,
    verdict,
)
from ultrascale.verify.run import RunSpec, run

DEFAULT_STEPS = 5
DEFAULT_TOLERANCE = 1e-4
RUN_TIMEOUT_S = 3600
Launch = Literal["auto", "fork", "subprocess"]


class VerifyError(ValueError):
    """Bad input, or a run that failed before comparing anything: exit status 2."""


@dataclass
class VerifyReport:
    """What `verify` found: the comparison, the layout run's figures and the planner's prediction."""

    comparison: Comparison
    reference_name: str
    layout: dict[str, Any]
    """The layout run's JSON (`StepRecorder`)."""
    reference: dict[str, Any]
    """The reference run's."""
    prediction: Optional[Prediction]
    why_no_prediction: Optional[str]
    notes: list[str] = field(default_factory=list)
    depth: Optional[str] = None
    """How many blocks both runs kept, when not all (`ultrascale.verify.depth`)."""
    explanation: Optional[Any] = None
    """Where the layout's first step departs from the reference's (`ultrascale.verify.explain.Explanation`), when
    `--explain` asked or after a failure; None otherwise."""

    @property
    def passed(self) -> bool:
        """Every step within the tolerance and, when explained, no module output or gradient beyond it either (a wrong
        gradient can hide in a loss and a norm that still agree)."""
        return self.comparison.passed and not (self.explanation is not None and self.explanation.found)

    @property
    def ranks(self) -> list[RankFigures]:
        return [RankFigures.of(figures) for figures in self.layout["ranks"]]

    def lines(self) -> list[str]:
        lines = [f"layout     {self.layout['mesh']}",
                 f"reference  {self.reference_name}"]
        lines += [f"depth      {self.depth}"] if self.depth else []
        lines += [""]
        lines += step_table(self.comparison, "ref")
        lines += ["", verdict(self.comparison), ""]
        if self.explanation is not None:
            lines += [*self.explanation.lines(), ""]
            if self.comparison.passed and self.explanation.found:
                lines += ["FAIL: the losses and gradient norms agree, but the first step differs module by module "
                          "(above)", ""]
        lines += figures_table(self.ranks, self.prediction, self.why_no_prediction)
        lines += [f"note: {note}" for note in self.notes]
        return lines


# --------------------------------------------------------------------------- the runs


def launched_by_torchrun() -> bool:
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    return TorchElasticEnvironment.detect()


def auto_launch() -> Literal["fork", "subprocess"]:
    """Fork where no GPU is in sight (cheap, and the process has no CUDA state to inherit); on a GPU machine a
    subprocess, whose launcher starts the ranks as `ultrascale fit` does there."""
    import torch

    return "subprocess" if torch.cuda.is_available() else "fork"


def _forked_entry(spec: RunSpec, log: str, parent_pid: int) -> None:
    from ultrascale.launch import die_with_parent, one_thread_after_fork, without_launch_variables

    die_with_parent(parent_pid)
    one_thread_after_fork()
    # A fit run earlier in the calling process (one device: Lightning starts no child) leaves its launch variables
    # behind; with them this run would join that finished world instead of starting its own ranks.
    kept = without_launch_variables(dict(os.environ))
    os.environ.clear()
    os.environ.update(kept)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # Python's streams too: a caller may have replaced them (pytest's capture), and the log must get the traceback.
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    code = 1
    try:
        run(spec)
        code = 0
    except BaseException:  # noqa: BLE001 - the log says what failed; the parent reads it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _error_of(log: Path) -> str:
    """The last exception line of a failed run's log, which names what went wrong (the strategy's messages do)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    errors = [line for line in lines if ("Error: " in line or "Exception: " in line) and not line.startswith(" ")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def launch_run(spec: RunSpec, workdir: Path, name: str, launch: Launch = "auto", env: Optional[dict[str, str]] = None,
               timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """Train `spec` in a process of its own and return its results; VerifyError with the run's error if it fails,
    or the user's mistake the run found (a DataError naming the bad record) as it was raised there."""
    from ultrascale import user_errors
    from ultrascale.launch import end_processes
    from ultrascale.verify.run import user_error_path

    log = workdir / f"{name}.log"
    mode = auto_launch() if launch == "auto" else launch
    if mode == "fork":
        proc = mp.get_context("fork").Process(target=_forked_entry, args=(spec, str(log), os.getpid()))
        proc.start()
        try:
            proc.join(timeout)
        finally:
            end_processes([proc])
        code = proc.exitcode
    else:
        path = spec.save(workdir / f"{name}.spec.json")
        with log.open("w") as out:
            done = subprocess.run([sys.executable, "-m", "ultrascale.verify.run", str(path)], stdout=out,
                                  stderr=subprocess.STDOUT, env=env, timeout=timeout)
        code = done.returncode
    if code != 0 and user_error_path(spec).exists():
        raise user_errors.load_error(user_error_path(spec))
    if code != 0 or not Path(spec.out).exists():
        raise VerifyError(f"the {name} run failed: {_error_of(log)} (its log: {log})")
    return json.loads(Path(spec.out).read_text())


# --------------------------------------------------------------------------- checks and the planner


def _strategy_classes() -> set[str]:
    from ultrascale.strategies import UltraScaleStrategy

    found, todo = set(), [UltraScaleStrategy]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


def config_and_overrides(cli_args: Sequence[str]) -> tuple[str, list[str]]:
    """The first `--config` and everything else, in order (check_recipe takes one recipe and overrides)."""
    args = list(cli_args)
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1], args[:i] + args[i + 2:]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1:]
    raise VerifyError("--config RECIPE is required: the recipe `ultrascale fit --config` would train")


def check_layout(cli_args: Sequence[str], gpu: str, precision: Optional[str] = "32-true") -> tuple[Optional[Any], Optional[str]]:
    """The recipe checked as `ultrascale plan --recipe` checks it, in `precision` (None: the recipe's): (the planner's
    `RecipePlan`, None), or (None, why there is no prediction). A layout the rulebook refuses is a VerifyError,
    before any process starts."""
    from ultrascale.planner.recipe_check import check_recipe

    recipe, overrides = config_and_overrides(cli_args)
    try:
        plan = check_recipe(recipe, [*overrides, *(["--trainer.precision", precision] if precision else [])], gpu=gpu)
    except (ValueError, NotImplementedError) as error:
        message = str(error)
        if message.split("(", 1)[0].split(":", 1)[0].strip() in _strategy_classes():
            raise VerifyError(message) from None
        return None, message  # a module or data module the planner cannot price: the runs check the layout themselves
    check_data(plan)
    return plan, None


def check_data(plan: Any) -> None:
    """The recipe's data, checked as `ultrascale fit` checks it before any rank starts (the path, the first
    records): a DataError here, one line from the command, rather than from every run. Deeper faults are found by
    the runs and come back the same way (`launch_run`)."""
    from ultrascale.data.errors import check_before_launch

    check_before_launch(plan.datamodule, plan.module, VerifyError)


# --------------------------------------------------------------------------- verify


def reference_knobs(against: str, world: int) -> tuple[dict[str, Any], bool, str]:
    """(the reference's strategy knobs, whether it runs on one device, its name in the output)."""
    if against == ONE:
        return {}, True, "one device (one process, the same global batch)"
    layout = LAYOUTS[against]
    reason = layout.fits(world)
    if reason is not None:
        raise VerifyError(f"--against {against}: {reason}; the recipe runs {world} ranks")
    return layout.knobs(world), False, f"{against} at world {world}: {layout.what}"


def _device_bytes() -> float:
    """What the reference's one device holds: a GPU's memory (90%: the CUDA context, NCCL and fragmentation take
    the rest), or without CUDA the memory available now."""
    import psutil
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory * 0.9
    return float(psutil.virtual_memory().available)


def reference_depth(plan: Optional[Any], depth: Optional[int], against: str) -> tuple[Optional[int], Optional[str]]:
    """The depth both runs keep and the sentence saying why (None, None: the whole model). A given `depth` is
    checked against the model and the layout's pipeline stages; without one, a one-device reference the planner
    prices above the device's memory gets the most blocks that fit."""
    from ultrascale.verify.depth import depth_of, one_device_depth

    if plan is None:
        return depth, (f"both runs keep the model's first {depth} blocks (--depth)" if depth is not None else None)
    layers = depth_of(plan.module)
    stages = plan.row.layout.pp * plan.row.layout.virtual_stages
    if depth is not None:
        if layers is None:
            raise VerifyError(f"--depth: {type(plan.module).__name__} is neither ultrascale's LlamaLM nor HFCausalLM; "
                              "give the model fewer blocks in the recipe instead")
        if not stages <= depth < layers:
            raise VerifyError(f"--depth {depth}: the model has {layers} blocks and the layout {stages} pipeline stage(s); "
                              f"give {stages} to {layers - 1}")
        return depth, f"both runs keep the first {depth} of the model's {layers} blocks (--depth)"
    if against != ONE or layers is None:
        return None, None
    device = _device_bytes()
    cut = one_device_depth(plan, device, stages)
    if cut is None:
        return None, None
    return cut, (f"a reduced-depth copy: both runs keep the first {cut} of the model's {layers} blocks, since the whole "
                 f"model on one device needs more than this device's {device / 2**30:.1f} GiB by the planner "
                 "(fp32, the global batch at once); --depth N chooses another")


def verify(cli_args: Sequence[str], *, steps: int = DEFAULT_STEPS, against: str = ONE, tolerance: float = DEFAULT_TOLERANCE,
           gpu: str = "h100", launch: Launch = "auto", workdir: Optional[Path] = None,
           checked: Optional[tuple[Any, Optional[str]]] = None, reference: Optional[dict[str, Any]] = None,
           depth: Optional[int] = None, explain: Optional[bool] = None) -> Optional[VerifyReport]:
    """Train the recipe (`cli_args`: `--config RECIPE` and overrides) for `steps` steps under its layout and under
    the reference, in fp32, and compare. Under torchrun every rank trains the layout; rank 0 then trains the
    reference and returns the report, the other ranks None.

    `checked` (the recipe's `check_layout`) and `reference` (a reference run's results) let the matrix reuse them.
    `depth` keeps only the model's first blocks in both runs (`ultrascale.verify.depth`); without it a model the
    planner prices too big for one device gets a reduced-depth copy, said in the output.

    `explain`: True records the first step module by module in both runs and explains it (`ultrascale.verify.explain`);
    None does so only after a failure, with one more step of each run; False never."""
    if steps < 1:
        raise VerifyError(f"--steps {steps}: must be >= 1")
    if not tolerance > 0:
        raise VerifyError(f"--tolerance {tolerance}: must be > 0")
    if against != ONE and against not in LAYOUTS:
        raise VerifyError(f"--against {against!r}: choose one of {layout_names()}")
    cli_args = list(cli_args)
    plan, why_not = checked if checked is not None else check_layout(cli_args, gpu)
    if plan is not None:  # the world is known before any run: a reference that cannot exist is refused now
        reference_knobs(against, plan.world)
    depth, depth_note = reference_depth(plan, depth, against)
    torchrun = launched_by_torchrun()
    if torchrun and explain is True and workdir is None:
        raise VerifyError("under torchrun, --explain needs --workdir DIR on a filesystem every rank sees: each rank writes "
                          "the gradients it holds there, and rank 0 reads them all")
    if torchrun and against != ONE:
        raise VerifyError("under torchrun, verify compares against one device only (--against one); run --against "
                          f"{against} without torchrun")
    with tempfile.TemporaryDirectory(prefix="ultrascale-verify-") as temp:
        work = Path(workdir or temp)
        work.mkdir(parents=True, exist_ok=True)
        fork = (auto_launch() if launch == "auto" else launch) == "fork" and not torchrun
        traced = explain is True
        layout_spec = RunSpec(cli_args, steps, str(work / "layout.json"), fork=fork, depth=depth,
                              trace=str(work / "layout-trace") if traced else None)
        if torchrun:
            run(layout_spec)  # this process is one of the ranks
            if int(os.environ.get("RANK", "0")) != 0:
                return None
            layout = json.loads(Path(layout_spec.out).read_text())
        else:
            layout = launch_run(layout_spec, work, "layout", launch)
        knobs, one_device, name = reference_knobs(against, layout["world"])
        from ultrascale.launch import without_launch_variables

        env = without_launch_variables(dict(os.environ))  # rank 0's reference is a job of its own
        reference_launch: Launch = "subprocess" if torchrun else launch
        if reference is None or (traced and "trace" not in reference):
            ref_spec = RunSpec(cli_args, steps, str(work / "reference.json"), reference=knobs, one_device=one_device,
                               fork=fork, depth=depth, trace=str(work / "reference-trace") if traced else None)
            reference = {**launch_run(ref_spec, work, "reference", reference_launch, env=env),
                         **({"trace": ref_spec.trace} if traced else {})}
        comparison = compare(reference["steps"], layout["steps"], tolerance)
        notes = []
        if layout.get("dropped_callbacks"):
            notes.append(f"left out of both runs (they save, log or validate): {', '.join(layout['dropped_callbacks'])}")
        explanation = None
        if traced:
            explanation = explain_step(Path(reference["trace"]), Path(layout_spec.trace or ""), tolerance)
        elif explain is None and not comparison.passed and torchrun:
            notes.append("add --explain to see where the layout departs (under torchrun the trace is recorded in the "
                         "same runs, not after a failure)")
        elif explain is None and not comparison.passed:
            # One more step of each run, recorded module by module (the first step is where a fault shows first).
            layout_trace = RunSpec(cli_args, 1, str(work / "layout-explain.json"), fork=fork, depth=depth,
                                   trace=str(work / "layout-explain"))
            launch_run(layout_trace, work, "layout (explain)", launch)
            reference_trace = RunSpec(cli_args, 1, str(work / "reference-explain.json"), reference=knobs,
                                      one_device=one_device, fork=fork, depth=depth, trace=str(work / "reference-explain"))
            launch_run(reference_trace, work, "reference (explain)", reference_launch, env=env)
            explanation = explain_step(Path(work / "reference-explain"), Path(work / "layout-explain"), tolerance)
    prediction = Prediction.of(plan.row, plan.cluster.gpu.name) if plan is not None else None
    return VerifyReport(comparison, name, layout, reference, prediction, why_not, notes, depth_note, explanation)


# --------------------------------------------------------------------------- the command


def _parser() -> argparse.ArgumentParser:
    from ultrascale.planner import GPU_SPECS

    parser = argparse.ArgumentParser(
        prog="ultrascale verify", allow_abbrev=False,
        usage="ultrascale verify --config RECIPE [LightningCLI overrides] [--steps N] [--against LAYOUT|one] [options]",
        description="Train a recipe for a few steps under its layout and under one device (or another layout), in fp32 "
                    "with the same data, and compare each step's loss and gradient norm. Exit 0 within the tolerance, "
                    "1 beyond it, 2 for bad input. Any other option is a LightningCLI override, as for `ultrascale fit`.")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    parser.add_argument("--against", default=ONE, help=f"the reference: {layout_names()} (default {ONE})")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"allowed |Δ| per step, x (1 + |reference|) (default {DEFAULT_TOLERANCE:g}: CPU fp32)")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_SPECS), help="the GPU the planner prices (default h100)")
    parser.add_argument("--launch", default="auto", choices=["auto", "fork", "subprocess"],
                        help="how each run starts: forked (CPU), or a subprocess that starts its ranks as `ultrascale fit` "
                             "does (auto: fork without CUDA). Under torchrun the ranks are this command's")
    parser.add_argument("--workdir", default=None, help="keep the runs' logs and results here (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the comparison and figures to this JSON file")
    explain = parser.add_mutually_exclusive_group()
    explain.add_argument("--explain", action="store_true", default=None,
                         help="record the first step module by module in both runs and say where the layout departs "
                              "(the first module output, the parameters' gradients); done after a failure by default")
    explain.add_argument("--no-explain", dest="explain", action="store_false",
                         help="no explanation after a failure (saves one more step of each run)")
    parser.add_argument("--plot", default=None, metavar="FILE.svg",
                        help="draw both runs' loss and gradient-norm curves and their difference per step (SVG)")
    parser.add_argument("--depth", type=int, default=None,
                        help="both runs keep only the model's first N blocks (default: all, or the most that fit one "
                             "device when the whole model does not)")
    return parser


def verify_main(args: list[str]) -> None:
    from ultrascale.user_errors import user_error_types
    from ultrascale.verify.plot import plot_path_problem, write_plot

    options, cli_args = _parser().parse_known_args(args)
    try:
        problem = plot_path_problem(Path(options.plot)) if options.plot else None
        if problem is not None:
            raise VerifyError(problem)
        report = verify(cli_args, steps=options.steps, against=options.against, tolerance=options.tolerance, gpu=options.gpu,
                        launch=options.launch, workdir=Path(options.workdir) if options.workdir else None,
                        depth=options.depth, explain=options.explain)
    except (VerifyError, *user_error_types()) as error:
        print(f"ultrascale verify: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if report is None:  # a rank of a torchrun job other than 0: rank 0 reports
        return
    print("\n".join(report.lines()))
    if options.json:
        Path(options.json).write_text(json.dumps({
            "passed": report.passed, "reference": report.reference_name, "mesh": report.layout["mesh"],
            "reference_steps": report.comparison.reference, "layout_steps": report.comparison.layout,
            "max_delta": report.comparison.max_delta(), "tolerance": report.comparison.tolerance,
            "ranks": report.layout["ranks"],
            "prediction": report.prediction.__dict__ if report.prediction is not None else None,
            "explain": report.explanation.to_json() if report.explanation is not None else None}, indent=1))
    if options.plot:
        write_plot(report.comparison, Path(options.plot), layout_name=report.layout["mesh"],
                   reference_name=report.reference_name)
        print(f"plot: {options.plot}")
    if not report.passed:
        raise SystemExit(1)
