"""Fault tolerance: a job restarted after a rank was SIGKILLed (torchrun `--max-restarts`, like a SLURM
requeue) resumes by itself from the newest complete checkpoint and continues the loss curve of a run
that was never interrupted; a kill while a checkpoint is being written leaves the previous one in use;
asynchronous saves resume on the same curve as synchronous ones.

The kill tests run the real thing: `torchrun` starting `ultrascale fit --ckpt_path auto` on 2 ranks,
one of which SIGKILLs itself once, on the first attempt, through a callback of this module."""

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import ultrascale
from tests._dist import init_gloo, run_ranks
from tests._parity import Recorder, step_losses
from tests.test_checkpoint import make_data, make_model, trainer_for
from ultrascale.parallel import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
TOTAL_STEPS, EVERY = 8, 3  # checkpoints at steps 3 and 6 (and last.ckpt beside each)

single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ------------------------------------------------------------------ choosing the checkpoint


def _save(path, step, value=0.0):
    ckpt.save_sharded_checkpoint({"w": torch.full((2,), float(value))}, {"global_step": step}, path)


@single_process
def test_latest_is_the_highest_step_not_the_newest_file(tmp_path):
    _save(tmp_path / "epoch=0-step=6.ckpt", 6)
    _save(tmp_path / "epoch=0-step=3.ckpt", 3)  # written last: newer on disk, older in training
    _save(tmp_path / "other" / "epoch=1-step=9.ckpt", 9)
    assert ckpt.latest_checkpoint([tmp_path]) == tmp_path / "epoch=0-step=6.ckpt"
    assert ckpt.latest_checkpoint([tmp_path, tmp_path / "other"]) == tmp_path / "other" / "epoch=1-step=9.ckpt"
    assert ckpt.latest_checkpoint([tmp_path / "missing"]) is None
    assert ckpt.latest_checkpoint([]) is None


@single_process
def test_latest_ignores_what_an_interrupted_or_running_save_left(tmp_path):
    _save(tmp_path / "epoch=0-step=3.ckpt", 3)
    _save(tmp_path / "scratch.ckpt", 12)
    (tmp_path / "scratch.ckpt").rename(tmp_path / ".epoch=0-step=12.ckpt.tmp-0123456789ab")  # a save in progress
    _save(tmp_path / "partial.ckpt", 9)
    (tmp_path / "partial.ckpt" / "meta.pt").unlink()  # incomplete under its final name (a partial copy)
    (tmp_path / "epoch=0-step=15.ckpt").mkdir()  # an empty directory with a checkpoint's name
    assert ckpt.latest_checkpoint([tmp_path]) == tmp_path / "epoch=0-step=3.ckpt"


@single_process
def test_latest_takes_the_old_version_of_a_missing_name(tmp_path):
    """A save killed between the two renames that publish it leaves only `.last.ckpt.old-<nonce>`:
    it stands for last.ckpt, and loading last.ckpt falls back to it."""
    _save(tmp_path / "epoch=0-step=3.ckpt", 3)
    _save(tmp_path / "last.ckpt", 6, value=6)
    (tmp_path / "last.ckpt").rename(tmp_path / ".last.ckpt.old-0123456789ab")
    found = ckpt.latest_checkpoint([tmp_path])
    assert found == tmp_path / "last.ckpt"
    state = {"w": torch.zeros(2)}
    with pytest.warns(UserWarning, match="is missing"):
        assert ckpt.load_sharded_checkpoint(found, state) == {"global_step": 6}
    assert torch.equal(state["w"], torch.full((2,), 6.0))


@single_process
def test_latest_skips_an_unreadable_checkpoint_with_a_warning(tmp_path):
    _save(tmp_path / "epoch=0-step=3.ckpt", 3)
    _save(tmp_path / "epoch=0-step=6.ckpt", 6)
    (tmp_path / "epoch=0-step=6.ckpt" / "meta.pt").write_bytes(b"torn")
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step=6"):
        assert ckpt.latest_checkpoint([tmp_path]) == tmp_path / "epoch=0-step=3.ckpt"


@single_process
def test_checkpoint_folders_of_a_trainer(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from ultrascale.strategies.autoresume import checkpoint_folders

    fixed = L.Trainer(default_root_dir=tmp_path, logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")])
    assert checkpoint_folders(fixed) == [tmp_path / "ck"]
    # A versioned logger writes every restart into a new version_N/checkpoints: all of them are searched.
    for version in (0, 1):
        (tmp_path / "logs" / "exp" / f"version_{version}" / "checkpoints").mkdir(parents=True)
    _save(tmp_path / "logs" / "exp" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt", 4)
    versioned = L.Trainer(default_root_dir=tmp_path, logger=CSVLogger(tmp_path / "logs", name="exp"))
    assert checkpoint_folders(versioned) == [tmp_path / "logs" / "exp" / f"version_{v}" / "checkpoints" for v in (0, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ultrascale.latest_checkpoint(versioned) == str(tmp_path / "logs/exp/version_0/checkpoints/epoch=0-step=4.ckpt")
    with pytest.raises(ValueError, match="has none"):
        checkpoint_folders(L.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False))


# ------------------------------------------------------------------ torchrun jobs killed with SIGKILL


class LossLog(L.Callback):
    """Each optimizer step's global `train_loss`, per rank and attempt, rewritten after every step so a
    killed attempt leaves what it trained."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        file = Path(self.out_dir, f"losses-rank{trainer.global_rank}-attempt{attempt}.json")
        file.with_suffix(".tmp").write_text(json.dumps(self.losses))
        os.replace(file.with_suffix(".tmp"), file)


class KillOnce(L.Callback):
    """On attempt `attempt` only, rank `rank` SIGKILLs itself: `where="step"` before optimizer step
    `step` + 1 runs; `where="write"` right after writing its shard of the checkpoint of step `step`,
    before the checkpoint is complete (no `.metadata`, no `meta.pt`, not renamed into place)."""

    def __init__(self, step: int, where: str = "step", rank: int = 1, attempt: int = 0) -> None:
        if where not in ("step", "write"):
            raise ValueError(f"where={where!r}: 'step' or 'write'")
        self.step, self.where, self.rank, self.attempt = step, where, rank, attempt

    def _armed(self, trainer) -> bool:
        return os.environ.get("TORCHELASTIC_RESTART_COUNT") == str(self.attempt) and trainer.global_rank == self.rank

    def setup(self, trainer, pl_module, stage) -> None:
        if self.where != "write" or not self._armed(trainer):
            return
        from torch.distributed.checkpoint import FileSystemWriter

        real_write = FileSystemWriter.write_data
        marker = f"step={self.step}.ckpt.tmp-"

        def write_then_die(writer, plan, planner):
            written = real_write(writer, plan, planner)
            if marker in str(writer.path):
                written.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        FileSystemWriter.write_data = write_then_die

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.where == "step" and self._armed(trainer) and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _config(folder: Path, kill: dict | list[dict] | None, async_checkpoint: bool = False) -> Path:
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(folder / "ckpts"), "every_n_train_steps": EVERY, "save_top_k": -1, "save_last": True}},
        {"class_path": "tests.test_fault_tolerance.LossLog", "init_args": {"out_dir": str(folder)}},
    ]
    for one in [kill] if isinstance(kill, dict) else kill or []:
        callbacks.append({"class_path": "tests.test_fault_tolerance.KillOnce", "init_args": one})
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "max_steps": TOTAL_STEPS, "logger": False, "log_every_n_steps": 1,
            "enable_progress_bar": False, "enable_model_summary": False, "callbacks": callbacks,
            "strategy": {"class_path": "ultrascale.ZeRO3Strategy", "init_args": {"async_checkpoint": True} if async_checkpoint else {}},
        },
        # The warm-up/cosine schedule spans the kill: it must resume too.
        "model": {"class_path": "ultrascale.models.LlamaLM", "init_args": {
            "preset": "tiny", "vocab_size": 258, "learning_rate": 3e-3, "warmup_steps": 4, "max_steps": TOTAL_STEPS}},
        # Shuffled blocks: the resumed run must skip exactly the global batches already consumed.
        "data": {"class_path": "ultrascale.data.CausalLMDataModule", "init_args": {
            "seq_len": 32, "global_batch_size": 8, "max_tokens": 40_000, "val_fraction": 0.0, "seed": 7}},
    }
    path = folder / "job.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def torchrun_fit(folder: Path, kill: dict | list[dict] | None = None, async_checkpoint: bool = False, max_restarts: int = 1):
    """`torchrun --max-restarts` of `ultrascale fit --ckpt_path auto` on 2 CPU ranks; returns the output
    and, per attempt, the step -> loss curve (checked identical on both ranks)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(folder, kill, async_checkpoint)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
               "-m", "ultrascale.cli", "fit", "--config", str(config), "--ckpt_path", "auto"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    (folder / "torchrun.log").write_text(output)
    assert done.returncode == 0, output[-6000:]
    curves = {}
    for attempt in range(max_restarts + 1):
        ranks = [folder / f"losses-rank{r}-attempt{attempt}.json" for r in range(2)]
        if not all(f.exists() for f in ranks):
            continue
        per_rank = [{int(k): v for k, v in json.loads(f.read_text()).items()} for f in ranks]
        common = sorted(set(per_rank[0]) & set(per_rank[1]))
        assert [per_rank[0][s] for s in common] == [per_rank[1][s] for s in common], "the ranks logged different losses"
        curves[attempt] = per_rank[0]
    return output, curves


def _fit_as_a_torchrun_rank(rank, world_size, config):
    """What each rank of `torchrun_fit` runs (`ultrascale fit --config CONFIG --ckpt_path auto`), in a rank forked with
    torchrun's variables: the same maths without torchrun and the ranks re-importing everything. What it logs."""
    import logging

    from ultrascale.cli import main

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("lightning.pytorch").addHandler(Keep())
    main(["fit", "--config", str(config), "--ckpt_path", "auto"])
    return "\n".join(said)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The curve the killed runs must reproduce bitwise (the same layout and maths, one attempt)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    output = run_ranks(_fit_as_a_torchrun_rank, 2, _config(folder, None))[0]
    assert "no complete checkpoint in" in output and "starting from step 0" in output, output
    curve = {int(k): v for k, v in json.loads((folder / "losses-rank0-attempt0.json").read_text()).items()}
    assert curve == {int(k): v for k, v in json.loads((folder / "losses-rank1-attempt0.json").read_text()).items()}
    assert sorted(curve) == list(range(1, TOTAL_STEPS + 1))
    return curve


@pytest.mark.slow
def test_sigkill_while_writing_then_mid_run_resumes_each_time_on_the_same_curve(uninterrupted, tmp_path):
    """One job killed twice (one torchrun, two restarts): rank 1 dies while writing the step-6 checkpoint, so the
    restart resumes from step 3 (the cut write is never published); on that attempt it dies before step 8, so the
    next resumes from the step-6 checkpoint the second attempt wrote. Same layout, same maths: bitwise the
    uninterrupted curve."""
    output, curves = torchrun_fit(tmp_path, kill=[{"step": 6, "where": "write"}, {"step": 7, "where": "step", "attempt": 1}],
                                  max_restarts=2)
    assert sorted(curves) == [0, 1, 2], output[-3000:]
    assert max(curves[0]) == 6  # step 6 trained, killed while saving its checkpoint
    assert sorted(curves[1]) == list(range(4, 8))  # from the step-3 checkpoint, killed before step 8
    assert sorted(curves[2]) == [7, 8]  # the second restart redid step 7 from the step-6 checkpoint
    assert _resumed_from(output) == [3, 6]
    for attempt in (0, 1, 2):
        for step, loss in curves[attempt].items():
            assert loss == uninterrupted[step], (attempt, step)
    left = [p.name for p in (tmp_path / "ckpts").iterdir() if p.name.startswith(".")]
    assert left and all(".epoch=0-step=6.ckpt.tmp-" in name for name in left), left  # the cut write, never published


def _resumed_from(output: str) -> list[int]:
    """The global steps of the checkpoints the restarted attempts resumed from, in order (each said once, by rank 0)."""
    lines = [line for line in output.splitlines() if "--ckpt_path auto: resuming from" in line]
    return [int(line.rsplit("(global step ", 1)[1].rstrip(")")) for line in lines]


# ------------------------------------------------------------------ asynchronous saves

ASYNC_STEPS = 8


def _slow_writes(seconds: float) -> None:
    """Make every DCP shard write take `seconds` longer (it runs in the save's background thread)."""
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    real_write = FileSystemWriter.write_data

    def slow(writer, plan, planner):
        time.sleep(seconds)
        return real_write(writer, plan, planner)

    FileSystemWriter.write_data = slow


class InFlight(L.Callback):
    """At the steps right after a save: what is on disk, what `latest_checkpoint` picks, and whether the
    save is still being written."""

    def __init__(self, folder: str, steps: tuple[int, ...], wait: bool = False) -> None:
        self.folder, self.steps, self.wait, self.seen = Path(folder), steps, wait, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            pending = trainer.strategy.checkpoint_publisher.pending
            if self.wait and pending is not None:
                pending._future.result()  # this rank's write is done: the next step may publish it
            latest = ultrascale.latest_checkpoint(self.folder)
            self.seen[trainer.global_step] = {
                "writing": pending is not None and not pending.done(),
                "latest": None if latest is None else Path(latest).name,
                "names": sorted(p.name for p in self.folder.iterdir() if not p.name.startswith(".")),
            }


def _fit(rank, world_size, max_steps, folder, resume_from, async_checkpoint, top_k=-1, slow=0.0, probe=(), wait=False):
    if slow:
        _slow_writes(slow)
    recorder = Recorder()
    callbacks = [recorder]
    if folder:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=top_k))
    if probe:
        callbacks.append(InFlight(folder, probe, wait))
    strategy = ultrascale.ZeRO3Strategy(async_checkpoint=async_checkpoint)
    trainer = trainer_for(world_size, max_steps, callbacks, strategy=strategy, logger=recorder.logger)
    trainer.fit(make_model(), make_data(), ckpt_path=resume_from)
    return {"losses": recorder.losses, "seen": callbacks[-1].seen if probe else None, "step": trainer.global_step}


@pytest.fixture(scope="module")
def sync_curve():
    return step_losses(run_ranks(_fit, 2, ASYNC_STEPS, None, None, False))


@pytest.mark.slow
def test_async_saves_resume_on_the_same_curve_as_sync_ones(sync_curve, tmp_path):
    """The step-3 checkpoint is written while steps 4-6 change the weights it holds: its host copy is
    what lands on disk, so resuming from it continues the uninterrupted curve."""
    first = step_losses(run_ranks(_fit, 2, 6, str(tmp_path), None, True))
    assert first == sync_curve[:6]  # writing in the background does not touch training
    assert ultrascale.latest_checkpoint(tmp_path) == str(tmp_path / "epoch=0-step=6.ckpt")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # both published at the end of fit
    resumed = step_losses(run_ranks(_fit, 2, ASYNC_STEPS, None, str(tmp_path / "epoch=0-step=3.ckpt"), True))
    assert len(resumed) == ASYNC_STEPS - 3
    assert resumed == sync_curve[3:]  # same layout: bitwise


def test_a_checkpoint_being_written_is_never_picked(tmp_path):
    """Writes slowed to 2 s: while step 3's checkpoint is being written it is not there (auto-resume finds
    nothing); while step 6's is, step 3's is the newest, and ModelCheckpoint's removal of it (save_top_k=1)
    waits until step 6's is published."""
    result = run_ranks(_fit, 2, 7, str(tmp_path), None, True, 1, 2.0, (4, 7))[0]
    seen = result["seen"]
    assert seen[4] == {"writing": True, "latest": None, "names": []}, seen
    assert seen[7] == {"writing": True, "latest": "epoch=0-step=3.ckpt", "names": ["epoch=0-step=3.ckpt"]}, seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=6.ckpt"]  # published at the end, 3 removed then


def test_a_written_checkpoint_is_published_at_the_next_step(tmp_path):
    """Not only at the next save: a job killed between two saves resumes from the newer one."""
    seen = run_ranks(_fit, 2, 5, str(tmp_path), None, True, -1, 0.5, (4, 5), True)[0]["seen"]
    assert seen[4] == {"writing": False, "latest": None, "names": []}, seen  # written, not yet published
    assert seen[5] == {"writing": False, "latest": "epoch=0-step=3.ckpt", "names": ["epoch=0-step=3.ckpt"]}, seen


def _failed_async_write(rank, world_size, folder):
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    init_gloo(rank, world_size)
    path = Path(folder) / "model.ckpt"
    ckpt.save_sharded_checkpoint({"w": torch.full((4,), float(rank))}, {"global_step": 1}, path)
    group = dist.new_group(backend="gloo")
    if rank == 1:
        def disk_full(writer, plan, planner):
            raise OSError(28, "No space left on device")

        FileSystemWriter.write_data = disk_full
    pending = ckpt.async_save_sharded_checkpoint({"w": torch.full((4,), 9.0)}, {"global_step": 2}, path, group=group)
    try:
        pending.finish()
    except RuntimeError as error:
        return str(error)
    return None


def test_a_failed_async_write_is_not_published(tmp_path):
    errors = run_ranks(_failed_async_write, 2, str(tmp_path))
    for error in errors:  # every rank learns of rank 1's failure
        assert error is not None and "No space left on device" in error and "not published" in error, error
    assert ckpt.read_checkpoint_metadata(tmp_path / "model.ckpt") == {"global_step": 1}


def _killed_while_writing_async(rank, world_size, folder):
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        real_write = FileSystemWriter.write_data

        def write_then_die(writer, plan, planner):  # runs in the save's background thread
            written = real_write(writer, plan, planner)
            if "step=6.ckpt.tmp-" in str(writer.path):
                written.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        FileSystemWriter.write_data = write_then_die
    return _fit(rank, world_size, ASYNC_STEPS, folder, None, True)


@pytest.mark.slow
def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint(sync_curve, tmp_path):
    with pytest.raises(AssertionError, match=r"rank 1: no result \(crash, exit code -9\)"):
        run_ranks(_killed_while_writing_async, 2, str(tmp_path))
    resume = ultrascale.latest_checkpoint(tmp_path)
    assert resume == str(tmp_path / "epoch=0-step=3.ckpt")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")][0].startswith(".epoch=0-step=6.ckpt.tmp-")
    resumed = step_losses(run_ranks(_fit, 2, ASYNC_STEPS, None, resume, True))
    assert resumed == sync_curve[3:]
