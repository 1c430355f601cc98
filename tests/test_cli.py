"""The `ultrascale` command runs the tiny CPU recipe end to end (2 ranks via the subprocess launcher), writes a
sharded checkpoint; the command resumes from it and validates it.

The other recipes' runs are the same command called in this process (`ultrascale_here`), forking their ranks
(`FORK`): the same strategy and recipe without the command and each rank re-importing torch, Lightning and
transformers (a world-4 fit: 36 s as a command with the subprocess launcher, 14 s as a command with forked ranks,
7 s in this process, on 2 cores). The subprocess launcher a user's command gets is the tiny recipe's, the quick
start's and tests/test_verify.py's, and the registered `ultrascale_pp`'s below."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
FAST = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2",
        "--data.init_args.max_tokens", "200000"]
FORK = ["--trainer.strategy.init_args.launcher", "fork"]
TINY_FORKED = ["--trainer.strategy", "ultrascale.ZeRO3Strategy", *FORK]  # the tiny recipe names `ultrascale_zero3`


def ultrascale(*args: str, cwd: Path) -> str:
    exe = shutil.which("ultrascale")
    command = [exe] if exe else [sys.executable, "-m", "ultrascale.cli"]
    done = subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def ultrascale_here(capfd, monkeypatch, cwd: Path, *args: str) -> str:
    """`ultrascale ARGS...` in this process (`ultrascale.cli.main`), run from `cwd`; what it and its forked ranks print
    (capfd: the ranks write to the inherited descriptors)."""
    from tests._cli import run_main

    monkeypatch.chdir(cwd)
    code, out, err = run_main(capfd, *args)
    assert code == 0, (out + err)[-4000:]
    return out + err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_tiny_recipe_fit_resume_validate(capfd, monkeypatch, tmp_path):
    """The fit as a command (the subprocess launcher); the resume and the validation in this process, forked."""
    out = ultrascale("fit", "--config", str(RECIPE), *FAST, cwd=tmp_path)
    assert "ultrascale mesh: pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1 (world 2)" in out
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in out
    run = tmp_path / "runs" / "ultrascale" / "version_0"
    assert list(run.glob("events.out.tfevents.*")), "TensorBoard logger is the default"
    last = run / "checkpoints" / "last.ckpt"
    assert (last / ".metadata").is_file() and (last / "meta.pt").is_file()

    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(RECIPE), *FAST, "--trainer.max_steps", "8",
                          "--ckpt_path", str(last), *TINY_FORKED)
    assert "`Trainer.fit` stopped: `max_steps=8` reached." in out
    assert "Restored all states from the checkpoint" in out

    out = ultrascale_here(capfd, monkeypatch, tmp_path, "validate", "--config", str(RECIPE), *FAST, "--ckpt_path", str(last),
                          *TINY_FORKED)
    assert "val_loss" in out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_2d_recipe(capfd, monkeypatch, tmp_path):
    recipe = RECIPE.parent / "tiny_cpu_2d.yaml"
    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(recipe), *FAST, *FORK)
    assert "ultrascale mesh: pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 (world 4)" in out
    assert "tensor parallel 2 on ultrascale.Llama: sequence_parallel=True, loss_parallel=True" in out
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in out
    assert "sequential all_reduce" not in out  # the grad-norm all-reduce is one collective per mesh


# `ultrascale plan` is tested in tests/test_planner.py.


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_context_parallel_recipe(capfd, monkeypatch, tmp_path):
    recipe = RECIPE.parent / "tiny_cpu_cp.yaml"
    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(recipe), *FAST, *FORK)
    assert "ultrascale mesh: pp=1 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=1 (world 4)" in out
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in out
    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(recipe), *FAST,
                          "--trainer.strategy.init_args.context_parallel_method", "allgather", "--trainer.max_steps", "2",
                          *FORK)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_pp_recipe_fit_validate_and_registered_name(capfd, monkeypatch, tmp_path):
    recipe = RECIPE.parent / "tiny_cpu_pp.yaml"
    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(recipe), *FAST, *FORK)
    assert "ultrascale mesh: pp=2 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1 (world 4)" in out
    assert "pipeline parallel: 1F1B, 2 ranks x 1 stage(s), 4 micro-batches, layers per stage [1, 1]" in out
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in out
    assert "val_loss" in out or list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    last = tmp_path / "runs" / "ultrascale" / "version_0" / "checkpoints" / "last.ckpt"
    out = ultrascale("fit", "--config", str(recipe), *FAST, "--trainer.strategy", "ultrascale_pp", "--trainer.devices", "2",
                     "--trainer.max_steps", "8", "--ckpt_path", str(last), cwd=tmp_path)
    assert "ultrascale mesh: pp=2 x dp_replicate=1 x dp_shard=1 x cp=1 x tp=1 (world 2)" in out  # "auto": every device
    assert "Restored all states from the checkpoint" in out
    assert "`Trainer.fit` stopped: `max_steps=8` reached." in out


@pytest.mark.parametrize("flag, value", [("--seq-len", "-5"), ("--micro-batch", "0"), ("--world", "0"),
                                         ("--device-memory-gib", "-1")])
def test_plan_refuses_non_positive_sizes(capsys, flag, value):
    from ultrascale.cli import main

    arguments = ["plan", "--preset", "tiny", "--world", "2", flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: {value} must be > 0" in err, err  # --world is shown as "--gpus/--world"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_ckpt_path_last_finds_a_checkpoint_whose_publishing_was_interrupted(capfd, monkeypatch, tmp_path):
    """Only the complete `.old` copy of last.ckpt is left (a save killed between the two renames, where
    the filesystem cannot swap atomically): `--ckpt_path last` resumes from it instead of step 0."""
    checkpoints = tmp_path / "ckpts"
    extra = tmp_path / "checkpoints.yaml"
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args:\n"
        f"        dirpath: {checkpoints}\n        save_last: true\n        every_n_train_steps: 6\n"
    )
    ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(RECIPE), "--config", str(extra), *FAST,
                    *TINY_FORKED)
    (checkpoints / "last.ckpt").rename(checkpoints / ".last.ckpt.old-0123456789ab")
    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(RECIPE), "--config", str(extra), *FAST,
                          "--trainer.max_steps", "8", "--ckpt_path", "last", *TINY_FORKED)
    assert "restored" in out and "Restored all states from the checkpoint" in out
    assert "`Trainer.fit` stopped: `max_steps=8` reached." in out
    assert (checkpoints / "last.ckpt" / "meta.pt").is_file()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_moe_recipe_fit_and_resume_at_ep1(capfd, monkeypatch, tmp_path):
    recipe = RECIPE.parent / "tiny_cpu_moe.yaml"
    out = ultrascale_here(capfd, monkeypatch, tmp_path, "fit", "--config", str(recipe), *FAST, "--trainer.log_every_n_steps",
                          "1", *FORK)
    assert "ultrascale mesh: pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1, ep=2 within dp_shard x cp (world 2)" in out
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in out
    events = list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    assert events and any(b"moe/balance" in e.read_bytes() for e in events)
    last = tmp_path / "runs" / "ultrascale" / "version_0" / "checkpoints" / "last.ckpt"
    # One device runs in the calling process: a command of its own, so that its one-rank process group stays out of
    # this worker, whose later tests fork ranks (tests/test_process_state.py).
    out = ultrascale("fit", "--config", str(recipe), *FAST, "--trainer.strategy", "ultrascale_ep", "--trainer.devices", "1",
                     "--trainer.max_steps", "8", "--ckpt_path", str(last), cwd=tmp_path)
    assert "ultrascale mesh: pp=1 x dp_replicate=1 x dp_shard=1 x cp=1 x tp=1 (world 1)" in out  # "auto": ep = devices
    assert "Restored all states from the checkpoint" in out
    assert "`Trainer.fit` stopped: `max_steps=8` reached." in out


def test_known_noise_is_dropped_and_nothing_else():
    import logging
    import warnings

    from ultrascale.recipe_cli import known_noise_quieted

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    names = ("lightning.fabric.utilities.seed", "lightning.pytorch.utilities.rank_zero", "torch.utils._pytree", "torchao")
    handler = Keep()
    for name in names:
        logging.getLogger(name).addHandler(handler)
    before = ({name: list(logging.getLogger(name).filters) for name in names}, list(warnings.filters))
    try:
        with known_noise_quieted():
            _log_the_noise(names)
        assert ({name: list(logging.getLogger(name).filters) for name in names}, list(warnings.filters)) == before
        _log_the_noise(names[:1])  # the command is over: nothing is dropped any more
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)
    assert seen == ["Seed set to 1234", "`Trainer.fit` stopped: `max_steps=3` reached.", "something torchao really means",
                    "[rank: 1] Seed set to 1234", "Seed set to 1234"]


def _log_the_noise(names):
    import logging

    if names:
        logging.getLogger(names[0]).warning("[rank: 1] Seed set to 1234")
        logging.getLogger(names[0]).warning("Seed set to 1234")
    if len(names) > 1:
        logging.getLogger(names[1]).warning("💡 Tip: ... try installing [litlogger](https://pypi.org/project/litlogger/) ...")
        logging.getLogger(names[1]).warning("`Trainer.fit` stopped: `max_steps=3` reached.")
        logging.getLogger(names[2]).warning("<enum 'X'> ... Calling register_constant() on Enum subclasses is deprecated ...")
        logging.getLogger(names[3]).warning("something torchao really means")


RECIPE_2D = RECIPE.parent / "tiny_cpu_2d.yaml"
COMMAND_LINE_ERRORS = {
    "misspelt knob": (["--trainer.strategy.init_args.tensor_paralel", "2"],
                      "`tensor_paralel` is not a knob of UltraScaleStrategy (ultrascale.UltraScaleStrategy); "
                      "did you mean `tensor_parallel`?"),
    "choice": (["--trainer.strategy.init_args.context_parallel_method", "ringg"],
               "`context_parallel_method=ringg`: choose one of 'allgather', 'ring', 'alltoall'"),
    "layout vs world": (["--trainer.strategy.init_args.tensor_parallel", "3"],
                        "invalid layout for 4 processes: dp_replicate(1) * dp_shard(2) * cp(1) * tp(3) * pp(1) != world size(4)"),
    "layout vs model": (["--trainer.strategy.init_args.tensor_parallel", "4", "--trainer.strategy.init_args.data_parallel_shard", "1"],
                        "`tensor_parallel=4` must divide n_kv_heads=2"),
    "missing data": (["--data.init_args.data_path", "/nowhere/corpus"],
                     "`data_path='/nowhere/corpus'` is neither a file, a directory nor 'stdlib'"),
}


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_a_knob_on_a_strategy_given_by_name_says_how_to_set_it(capsys, tmp_path, monkeypatch):
    """tiny_cpu.yaml names `strategy: ultrascale_zero3`, which takes no knobs: the message says so, with the close knob."""
    from tests._cli import run_main

    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "fit", "--config", str(RECIPE), "--trainer.strategy.init_args.tensor_paralel", "2")
    assert code == 2 and "Traceback" not in out + err and "NestedArg" not in err, err
    assert err.strip() == ("ultrascale fit: error: `tensor_paralel` (did you mean `tensor_parallel`?): the recipe names its "
                           "strategy by its registered name `ultrascale_zero3`, which takes no knobs; give it as "
                           "`class_path: ultrascale.ZeRO3Strategy` with `init_args` to set them"), err


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.parametrize("case", list(COMMAND_LINE_ERRORS))
def test_the_command_reports_a_bad_recipe_in_one_message(case, capsys, tmp_path, monkeypatch):
    """Exit status 2, the message alone on stderr (no traceback, no jsonargparse dump), before any rank starts."""
    from tests._cli import run_main

    monkeypatch.chdir(tmp_path)
    extra, message = COMMAND_LINE_ERRORS[case]
    code, out, err = run_main(capsys, "fit", "--config", str(RECIPE_2D), "--trainer.max_steps", "1", *extra)
    assert code == 2, (out, err)
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("ultrascale fit: error: ") and message in errors[0], err
    assert "Traceback" not in out + err and "NestedArg" not in err and "Given value" not in err
