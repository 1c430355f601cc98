"""`ultrascale verify-matrix`: `ultrascale verify` for every named layout at one world size, as a Markdown table.

    ultrascale verify-matrix --world 8                             # CPU: gloo ranks, a tiny Llama
    ultrascale verify-matrix --world 8 --accelerator gpu --out verify_gpu.md   # a GPU node: NCCL, a 0.5B Llama

Each layout is `verify --against one` on a recipe this command writes (the built-in Llama on the standard
library's source in byte tokens; the MoE variant for `ep`), with one reference run per model shared by the
layouts. A layout the world size cannot hold, or that the rulebook refuses for the model, is listed as
skipped with the reason; a failed run is listed with its error and makes the command exit 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from ultrascale.verify.app import DEFAULT_TOLERANCE, Launch, VerifyError, VerifyReport, check_layout, verify
from ultrascale.verify.layouts import LAYOUTS

Accelerator = Literal["cpu", "gpu"]


@dataclass(frozen=True)
class MatrixSizes:
    """The model and batch of the matrix on one kind of device."""

    config: dict[str, Any]
    """`LlamaConfig` fields of the dense model."""
    moe: dict[str, Any]
    """What the `ep` layout's model adds to it."""
    seq_len: int
    global_batch: int
    max_tokens: int
    steps: int


SIZES: dict[str, MatrixSizes] = {
    # CI on 2 CPU cores: seconds per layout. 4 layers give the ZBV schedule its 4 stages; vocab, heads and the
    # sequence divide by tp and 2 x cp up to 4 (at 8 the rulebook refuses tp, as it would for this model).
    "cpu": MatrixSizes(dict(vocab_size=264, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden_dim=128, max_seq_len=64),
                       dict(n_experts=8, moe_top_k=2, moe_hidden_dim=64), seq_len=32, global_batch=16, max_tokens=20_000,
                       steps=3),
    # One node of 8 GPUs, fp32: a 0.5B Llama whose reference (the whole global batch on one GPU) fits 80 GB.
    "gpu": MatrixSizes(dict(vocab_size=32768, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden_dim=5632,
                            max_seq_len=1024),
                       dict(n_experts=8, moe_top_k=2, moe_hidden_dim=1408), seq_len=1024, global_batch=16,
                       max_tokens=2_000_000, steps=5),
}


def matrix_recipe(sizes: MatrixSizes, accelerator: Accelerator, world: int, knobs: dict[str, Any], moe: bool) -> dict:
    """The recipe one layout of the matrix verifies."""
    config = {**sizes.config, **(sizes.moe if moe else {})}
    return {
        "seed_everything": 1234,
        "trainer": {"accelerator": accelerator, "devices": world, "precision": "32-true", "gradient_clip_val": 1.0,
                    "strategy": {"class_path": "ultrascale.UltraScaleStrategy", "init_args": knobs}},
        "model": {"class_path": "ultrascale.models.LlamaLM",
                  "init_args": {"config": config, "learning_rate": 3.0e-3, "warmup_steps": 1}},
        "data": {"class_path": "ultrascale.data.CausalLMDataModule",
                 "init_args": {"data_path": "stdlib", "seq_len": sizes.seq_len, "global_batch_size": sizes.global_batch,
                               "max_tokens": sizes.max_tokens, "val_fraction": 0.0}},
    }


@dataclass(frozen=True)
class MatrixRow:
    layout: str
    world: int
    status: str
    """"pass", "FAIL", "skipped: why" or "error: what"."""
    report: Optional[VerifyReport] = None

    @property
    def ok(self) -> bool:
        return self.status == "pass" or self.status.startswith("skipped")


def run_matrix(world: int, *, accelerator: Accelerator = "cpu", layouts: Optional[list[str]] = None,
               steps: Optional[int] = None, tolerance: float = DEFAULT_TOLERANCE, gpu: str = "h100",
               launch: Launch = "auto", workdir: Optional[Path] = None, explain: Optional[bool] = None) -> list[MatrixRow]:
    """`verify --against one` of every layout in `layouts` (default: all of `LAYOUTS`) at `world` ranks; `explain` as
    `verify`'s (True: every layout's first step compared module by module, a finding fails the layout)."""
    sizes = SIZES[accelerator]
    steps = steps or sizes.steps
    unknown = [name for name in layouts or [] if name not in LAYOUTS]
    if unknown:
        raise VerifyError(f"unknown layout(s) {', '.join(unknown)}; the matrix's layouts: {', '.join(LAYOUTS)}")
    if world < 1:
        raise VerifyError(f"--world {world}: must be >= 1")
    rows: list[MatrixRow] = []
    references: dict[bool, dict[str, Any]] = {}  # one per model (dense, MoE): the same for every layout
    with tempfile.TemporaryDirectory(prefix="ultrascale-verify-matrix-") as temp:
        work = Path(workdir or temp)
        for name in layouts or list(LAYOUTS):
            layout = LAYOUTS[name]
            reason = layout.fits(world)
            if reason is not None:
                rows.append(MatrixRow(name, world, f"skipped: {reason}"))
                continue
            recipe = work / f"{name}.yaml"
            recipe.write_text(yaml.safe_dump(matrix_recipe(sizes, accelerator, world, layout.knobs(world), layout.moe)))
            args = ["--config", str(recipe)]
            try:
                checked = check_layout(args, gpu)
            except VerifyError as refused:  # the rulebook's verdict for this model, before any process
                rows.append(MatrixRow(name, world, f"skipped: {refused}"))
                continue
            if name == "auto":  # priced as given (ZeRO-3 over every rank); the planner picks the layout at start
                checked = (None, "the layout is chosen when the ranks start")
            try:
                report = verify(args, steps=steps, tolerance=tolerance, gpu=gpu, launch=launch, workdir=work / name,
                                checked=checked, reference=references.get(layout.moe), explain=explain)
            except VerifyError as error:  # the table keeps the error's first words; the run's log has the rest
                rows.append(MatrixRow(name, world, f"error: {_shortened(str(error).split(' (its log: ')[0])}"))
                continue
            assert report is not None  # not under torchrun: this process ran both
            references[layout.moe] = report.reference
            rows.append(MatrixRow(name, world, "pass" if report.passed else "FAIL", report))
    return rows


def _shortened(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _machine(accelerator: Accelerator) -> str:
    import torch

    if accelerator == "gpu" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, gloo"


def _cell(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def matrix_markdown(rows: list[MatrixRow], *, accelerator: Accelerator, tolerance: float, steps: Optional[int] = None,
                    date: Optional[str] = None) -> list[str]:
    """The table `verify-matrix` writes: per layout, parity against one device and the layout run's figures
    beside the planner's."""
    import torch

    sizes = SIZES[accelerator]
    config = sizes.config
    gpu = next((r.report.prediction.gpu for r in rows if r.report is not None and r.report.prediction is not None), "-")
    on_cpu = accelerator == "cpu"
    lines = [
        f"`ultrascale verify-matrix` on {_machine(accelerator)}, {date or datetime.date.today().isoformat()}, "
        f"torch {torch.__version__.split('+')[0]}: Llama dim {config['dim']}, {config['n_layers']} layers, "
        f"{config['n_heads']} heads ({config['n_kv_heads']} kv), vocab {config['vocab_size']} (`ep`: "
        f"{sizes.moe['n_experts']} experts, top-{sizes.moe['moe_top_k']}); {sizes.global_batch} x {sizes.seq_len} tokens "
        f"per step, {steps or sizes.steps} steps, fp32; reference: one process on one device. Pass: every step's loss "
        f"and gradient norm within {tolerance:g} x (1 + |reference|).",
        "",
        "| layout | world | mesh | max \\|Δ\\| loss | max \\|Δ\\| grad norm | result | tokens/s/device | MFU | "
        f"peak {'RSS' if on_cpu else 'memory'} GiB | model state GiB | planner model state GiB ({gpu}) | "
        f"planner memory GiB ({gpu}) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        report = row.report
        if report is None:
            lines.append(f"| {row.layout} | {row.world} | - | - | - | {row.status.replace('|', '/')} | - | - | - | - | - | - |")
            continue
        ranks, prediction, comparison = report.ranks, report.prediction, report.comparison
        mesh = report.layout["mesh"].split(" (world")[0]
        peaks = [r.peak_memory_gib for r in ranks if r.peak_memory_gib is not None]
        states = [r.model_state_gib for r in ranks if r.model_state_gib is not None]
        tokens = [r.tokens_per_s for r in ranks if r.tokens_per_s is not None]
        mfus = [r.mfu for r in ranks if r.mfu is not None]
        lines.append(
            f"| {row.layout} | {row.world} | {mesh} | {_cell(comparison.max_delta('loss'), '.1e')} | "
            f"{_cell(comparison.max_delta('grad_norm'), '.1e')} | {row.status} | "
            f"{_cell(sum(tokens) / len(tokens) if tokens else None, ',.0f')} | "
            f"{_cell(sum(mfus) / len(mfus) if mfus else None, '.2%')} | {_cell(max(peaks) if peaks else None, '.3f')} | "
            f"{_cell(max(states) if states else None, '.4f')} | "
            f"{_cell(prediction.model_state_gib if prediction else None, '.4f')} | "
            f"{_cell(prediction.memory_gib if prediction else None, '.3f')} |")
    lines += ["", "tokens/s/device and MFU are averaged over the ranks and the steps (the first included); peak memory and "
              "model state are the largest rank's. The planner prices the same layout, fp32, on the GPU named"
              + (": on CPU only its model-state bytes compare with the measured ones." if on_cpu else ".")]
    return lines


def matrix_main(args: list[str]) -> None:
    from ultrascale.planner import GPU_SPECS

    parser = argparse.ArgumentParser(prog="ultrascale verify-matrix", allow_abbrev=False,
                                     description="`ultrascale verify` of every named layout at one world size: a Markdown "
                                                 "table of parity, tokens/s, MFU and memory beside the planner. Exit 1 if "
                                                 "any layout fails or errs.")
    parser.add_argument("--world", type=int, required=True, help="ranks (devices on this machine)")
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: gloo ranks and a tiny Llama (CI); gpu: NCCL and a 0.5B Llama")
    parser.add_argument("--layouts", default=None, help=f"comma-separated subset of: {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: cpu 3, gpu 5)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_SPECS), help="the GPU the planner prices (default h100)")
    parser.add_argument("--launch", default="auto", choices=["auto", "fork", "subprocess"])
    parser.add_argument("--out", default=None, help="write the Markdown table here (it is printed either way)")
    parser.add_argument("--explain", action="store_true", default=None,
                        help="compare every layout's first step module by module too (a finding fails the layout); "
                             "failing layouts are explained either way")
    options = parser.parse_args(args)
    try:
        rows = run_matrix(options.world, accelerator=options.accelerator,
                          layouts=options.layouts.split(",") if options.layouts else None, steps=options.steps,
                          tolerance=options.tolerance, gpu=options.gpu, launch=options.launch, explain=options.explain)
    except VerifyError as error:
        print(f"ultrascale verify-matrix: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    text = "\n".join(matrix_markdown(rows, accelerator=options.accelerator, tolerance=options.tolerance,
                                     steps=options.steps)) + "\n"
    print(text)
    for row in rows:  # where a failing layout departs, below the table
        if row.report is not None and row.report.explanation is not None and row.report.explanation.found:
            print("\n".join([f"{row.layout}:", *row.report.explanation.lines(), ""]))
    if options.out:
        Path(options.out).write_text(text)
    if not all(row.ok for row in rows):
        raise SystemExit(1)
