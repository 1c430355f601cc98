"""Sharded checkpoints: resume (same and different world size) continues the same loss curve;
saves are atomic; bad checkpoint paths fail clearly."""


import logging
import os
import shutil
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.testing import assert_close

import ultrascale
from tests._dist import run_ranks
from tests._parity import Recorder, full, step_losses
from ultrascale.data import CausalLMDataModule
from ultrascale.models.lm import LlamaLM
from ultrascale.parallel import checkpoint as ckpt

TOTAL_STEPS, STOP_STEP = 10, 5


def make_data() -> CausalLMDataModule:
    # Shuffled stdlib blocks: resume must skip exactly the global batches already consumed.
    return CausalLMDataModule(seq_len=32, global_batch_size=8, max_tokens=60_000, val_fraction=0.0, seed=7)


def make_model() -> LlamaLM:
    # The warm-up/cosine schedule must resume too (warm-up spans the stop step).
    return LlamaLM(preset="tiny", vocab_size=258, learning_rate=3e-3, warmup_steps=8, max_steps=TOTAL_STEPS)


def trainer_for(world_size, max_steps, callbacks=(), strategy="ultrascale_zero3", logger=False, **kwargs):
    return L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps, logger=logger,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), **kwargs,
    )


def _train(rank, world_size, max_steps, ckpt_dir, resume_from, strategy="ultrascale_zero3"):
    recorder = Recorder()
    callbacks = [recorder]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=STOP_STEP, save_top_k=-1, save_last=True))
    trainer = trainer_for(world_size, max_steps, callbacks, strategy=strategy, logger=recorder.logger)
    trainer.fit(make_model(), make_data(), ckpt_path=resume_from)
    return {"losses": recorder.losses, "step": trainer.global_step}


@pytest.fixture(scope="module")
def uninterrupted():
    return step_losses(run_ranks(_train, 4, TOTAL_STEPS, None, None))


@pytest.fixture(scope="module")
def stopped_checkpoint(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    results = run_ranks(_train, 4, STOP_STEP, str(ckpt_dir), None)
    return ckpt_dir, step_losses(results)


def test_checkpoint_layout(stopped_checkpoint):
    ckpt_dir, _ = stopped_checkpoint
    step_ckpt = ckpt_dir / f"epoch=0-step={STOP_STEP}.ckpt"
    assert step_ckpt.is_dir() and (ckpt_dir / "last.ckpt").is_dir()
    assert (step_ckpt / ".metadata").is_file() and (step_ckpt / "meta.pt").is_file()
    assert len(list(step_ckpt.glob("*.distcp"))) == 4  # one shard file per rank
    assert not list(ckpt_dir.glob(".*tmp-*")), "no temporary directory may survive a completed save"


@pytest.mark.parametrize("world_size", [4, 2])
def test_resume_continues_the_same_loss_curve(uninterrupted, stopped_checkpoint, world_size):
    ckpt_dir, first_half = stopped_checkpoint
    assert_close(torch.tensor(first_half), torch.tensor(uninterrupted[:STOP_STEP]), rtol=0, atol=1e-6)
    results = run_ranks(_train, world_size, TOTAL_STEPS, None, str(ckpt_dir / f"epoch=0-step={STOP_STEP}.ckpt"))
    assert results[0]["step"] == TOTAL_STEPS
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    # Same world: identical maths. 4 -> 2 ranks: only the reduction order changes.
    tolerance = 1e-6 if world_size == 4 else 1e-5
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=tolerance)


def test_tensor_parallel_checkpoint_resumes_without_tp(tmp_path):
    """Saved with tp=2 (DTensors sharded over heads and vocab), resumed as plain ZeRO-3 (tp=1)."""
    tp2 = ultrascale.UltraScaleStrategy(tensor_parallel=2, data_parallel_shard=1)
    uninterrupted = step_losses(run_ranks(_train, 2, TOTAL_STEPS, str(tmp_path), None, tp2))  # saves at STOP_STEP
    results = run_ranks(_train, 2, TOTAL_STEPS, None, str(tmp_path / f"epoch=0-step={STOP_STEP}.ckpt"), "ultrascale_zero3")
    resumed = step_losses(results)
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("resume_stage", [2, 1])
def test_zero2_checkpoint_resumes_on_fewer_ranks(tmp_path, resume_stage):
    """ZeRO-2 on 4 ranks -> ZeRO-2 (or ZeRO-1) on 2: the per-parameter optimizer state is re-laid out."""
    zero2 = ultrascale.ZeRO2Strategy(zero_bucket_mb=0.05)
    uninterrupted = step_losses(run_ranks(_train, 4, TOTAL_STEPS, str(tmp_path), None, zero2))  # saves at STOP_STEP
    resumed_strategy = ultrascale.UltraScaleStrategy(zero_stage=resume_stage, zero_bucket_mb=0.03)  # other buckets too
    results = run_ranks(_train, 2, TOTAL_STEPS, None, str(tmp_path / f"epoch=0-step={STOP_STEP}.ckpt"), resumed_strategy)
    resumed = step_losses(results)
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


def _interrupted_save(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    trainer = trainer_for(world_size, 2)
    model = make_model()
    trainer.fit(model, make_data())
    trainer.save_checkpoint(path)
    before = {n: full(p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_save = dcp.save

    def dies_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("killed during save")

    dcp.save = dies_after_writing
    try:
        trainer.save_checkpoint(path)
        raise AssertionError("the save should have been interrupted")
    except KeyboardInterrupt:
        pass
    finally:
        dcp.save = real_save
    loaded = _WeightsAtTrainStart()
    trainer = trainer_for(world_size, 3, [loaded])
    model = make_model()
    trainer.fit(model, make_data(), ckpt_path=path)  # loads the first (complete) checkpoint
    return {"before": before, "loaded": loaded.weights, "after_load_step": trainer.global_step}


class _WeightsAtTrainStart(L.Callback):
    """The weights right after the checkpoint was restored, before any step."""

    def on_train_start(self, trainer, pl_module):
        self.weights = {n: full(p) for n, p in pl_module.named_parameters()}


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "model.ckpt"
    results = run_ranks(_interrupted_save, 2, str(path))
    assert results[0]["after_load_step"] == 3  # resumed from step 2, trained one more
    # The weights loaded are the first save's, not the +1 weights of the interrupted one.
    for name, weight in results[0]["before"].items():
        assert torch.equal(results[0]["loaded"][name], weight), name
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.ckpt"]
    assert all(".tmp-" in name for name in leftovers)  # the interrupted write never took the final name
    assert (path / "meta.pt").is_file()


def _load(rank, world_size, path):
    trainer = trainer_for(world_size, 1)
    try:
        trainer.fit(make_model(), make_data(), ckpt_path=path)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "loaded"


def test_missing_checkpoint(tmp_path):
    message = run_ranks(_load, 1, str(tmp_path / "nope.ckpt"))[0]
    assert message.startswith("FileNotFoundError") and "nope.ckpt" in message


def test_incomplete_checkpoint_dir(tmp_path):
    bad = tmp_path / "partial.ckpt"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"x")
    message = run_ranks(_load, 1, str(bad))[0]
    assert message.startswith("ValueError") and "missing meta.pt" in message


def test_corrupt_checkpoint(tmp_path):
    bad = tmp_path / "corrupt.ckpt"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"not a pickle")
    torch.save({}, bad / "meta.pt")
    message = run_ranks(_load, 1, str(bad))[0]
    assert message.startswith("CheckpointDamaged") and ".metadata: unreadable" in message  # found before any read


def test_file_instead_of_directory(tmp_path):
    bad = tmp_path / "single_file.ckpt"
    torch.save({"state_dict": {}}, bad)
    message = run_ranks(_load, 1, str(bad))[0]
    assert message.startswith("ValueError") and "is a file" in message


def test_context_parallel_checkpoint_resumes_without_cp(tmp_path):
    """Saved with cp=2 (weights sharded over dp_shard x cp = 2 ranks), resumed as plain ZeRO-3 over
    2 data-parallel ranks: the same global batches, the same loss curve."""
    cp2 = ultrascale.ContextParallelStrategy(context_parallel=2)
    uninterrupted = step_losses(run_ranks(_train, 2, TOTAL_STEPS, str(tmp_path), None, cp2))  # saves at STOP_STEP
    results = run_ranks(_train, 2, TOTAL_STEPS, None, str(tmp_path / f"epoch=0-step={STOP_STEP}.ckpt"), "ultrascale_zero3")
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)


# ------------------------------------------------------------------ leftovers, `.old` fallback, fsync

NONCE, NONCE2 = "0123456789ab", "ba9876543210"
# Saves and loads in this (pytest) process, without a process group, as DCP notes.
single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _backdate(path, seconds=3600):
    """Make `path` (and what it holds) look untouched for `seconds`: older than LEFTOVER_GRACE_S."""
    stamp = time.time() - seconds
    for item in [*Path(path).rglob("*"), Path(path)]:
        os.utime(item, (stamp, stamp), follow_symlinks=False)


def _names(folder):
    return sorted(p.name for p in Path(folder).iterdir())


def _killed_save_then(rank, world_size, folder, then):
    """A save killed after every shard was written leaves `.model.ckpt.tmp-<nonce>/`. Another save
    right away keeps it (changed within LEFTOVER_GRACE_S); once it is older, `then` removes it:
    'save' (of another checkpoint into the folder) or 'resume' (from model.ckpt)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    trainer = trainer_for(world_size, 2)
    trainer.fit(make_model(), make_data())
    trainer.save_checkpoint(folder / "model.ckpt")
    real_save = dcp.save

    def dies_after_writing(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("killed during save")

    dcp.save = dies_after_writing
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.save_checkpoint(folder / "model.ckpt")
    finally:
        dcp.save = real_save
    trainer.strategy.barrier()
    left = _names(folder)
    trainer.save_checkpoint(folder / "fresh.ckpt")
    kept = _names(folder)
    if rank == 0:
        for leftover in folder.glob(".model.ckpt.tmp-*"):
            _backdate(leftover)
    trainer.strategy.barrier()
    if then == "save":
        trainer.save_checkpoint(folder / "other.ckpt")
    else:
        trainer = trainer_for(world_size, 3)
        trainer.fit(make_model(), make_data(), ckpt_path=str(folder / "model.ckpt"))
    trainer.strategy.barrier()
    return {"left": left, "kept": kept, "after": _names(folder), "step": trainer.global_step}


@pytest.mark.parametrize("then", ["save", "resume"])
def test_leftover_of_a_killed_save_is_removed(tmp_path, then):
    result = run_ranks(_killed_save_then, 2, str(tmp_path), then)[0]
    leftovers = [name for name in result["left"] if name.startswith(".model.ckpt.tmp-")]
    assert len(leftovers) == 1 and result["left"] == sorted(["model.ckpt", *leftovers])
    assert result["kept"] == sorted(["fresh.ckpt", "model.ckpt", *leftovers])  # too recent: maybe a save in progress
    expected = ["fresh.ckpt", "model.ckpt"] + (["other.ckpt"] if then == "save" else [])
    assert result["after"] == expected and _names(tmp_path) == expected
    if then == "resume":
        assert result["step"] == 3  # resumed from step 2
    assert (tmp_path / "model.ckpt" / "meta.pt").is_file()


@single_process
def test_remove_leftovers_touches_only_its_own(tmp_path, caplog):
    for name in ("a.ckpt", "b.ckpt"):
        ckpt.save_sharded_checkpoint({"w": torch.zeros(2)}, {"step": 1}, tmp_path / name)
    shutil.rmtree(tmp_path / "b.ckpt")

    def flat_dir(name, backdate=True):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
        if backdate:
            _backdate(tmp_path / name)

    flat_dir(f".a.ckpt.tmp-{NONCE}")  # an interrupted save: removed
    flat_dir(f".a.ckpt.old-{NONCE}")  # a previous version of the complete a.ckpt: removed
    flat_dir(f".a.ckpt.tmp-{NONCE2}", backdate=False)  # written right now, maybe by another job: kept
    flat_dir(f".b.ckpt.old-{NONCE}")  # b.ckpt is missing: the only copy, kept
    flat_dir(".a.ckpt.tmp-notours")  # not ultrascale's naming: kept
    flat_dir(f"e.ckpt.tmp-{NONCE}")  # not hidden: kept
    flat_dir(f".c.tmp-{NONCE}")
    (tmp_path / f".c.tmp-{NONCE}" / "nested").mkdir()  # not what a save writes: kept
    _backdate(tmp_path / f".c.tmp-{NONCE}")
    (tmp_path / f".d.tmp-{NONCE}").write_bytes(b"a file")  # not a directory: kept
    flat_dir("target")
    (tmp_path / f".f.tmp-{NONCE}").symlink_to(tmp_path / "target")  # a link: kept, target intact
    _backdate(tmp_path / f".d.tmp-{NONCE}")
    before = set(_names(tmp_path))
    with caplog.at_level(logging.INFO, logger="ultrascale.parallel.checkpoint"):
        removed = ckpt.remove_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [f".a.ckpt.old-{NONCE}", f".a.ckpt.tmp-{NONCE}"]
    assert set(_names(tmp_path)) == before - {p.name for p in removed}
    assert (tmp_path / "target" / "__0_0.distcp").is_file() and (tmp_path / "a.ckpt" / "meta.pt").is_file()
    assert "left behind by an interrupted save" in caplog.text and f".a.ckpt.tmp-{NONCE2}" in caplog.text


def _train_recording_warnings(rank, world_size, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(rank, world_size, *args)
    result["warnings"] = [str(w.message) for w in caught]
    return result


def test_resume_falls_back_to_the_old_version(uninterrupted, stopped_checkpoint, tmp_path):
    """A save of last.ckpt killed between its two renames (a filesystem without an atomic swap)
    leaves only `.last.ckpt.old-<nonce>/`: resuming from last.ckpt loads it and continues the
    same loss curve; the next save of last.ckpt removes it."""
    ckpt_dir, _ = stopped_checkpoint
    old = tmp_path / f".last.ckpt.old-{NONCE}"
    shutil.copytree(ckpt_dir / f"epoch=0-step={STOP_STEP}.ckpt", old)
    results = run_ranks(_train_recording_warnings, 2, TOTAL_STEPS, str(tmp_path), str(tmp_path / "last.ckpt"))
    assert results[0]["step"] == TOTAL_STEPS
    resumed = step_losses(results)
    assert len(resumed) == TOTAL_STEPS - STOP_STEP
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[STOP_STEP:]), rtol=0, atol=1e-5)
    fallback = [message for message in results[0]["warnings"] if "is missing" in message]
    assert fallback and str(tmp_path / "last.ckpt") in fallback[0] and str(old) in fallback[0]
    assert not any("is missing" in message for message in results[1]["warnings"])  # said once, by rank 0
    assert not old.exists() and (tmp_path / "last.ckpt" / "meta.pt").is_file()
    assert not [name for name in _names(tmp_path) if name.startswith(".")]


@single_process
def test_killed_between_the_two_renames(tmp_path, monkeypatch):
    """Without an atomic swap the old version is renamed aside first; a kill right after that."""
    path = tmp_path / "last.ckpt"
    ckpt.save_sharded_checkpoint({"w": torch.zeros(4)}, {"step": 1}, path)
    monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)  # as on NFS
    real_rename = os.rename

    def killed_after_moving_aside(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        if Path(dst).name.startswith(".last.ckpt.old-"):
            raise KeyboardInterrupt("killed between the renames")

    monkeypatch.setattr(os, "rename", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_sharded_checkpoint({"w": torch.ones(4)}, {"step": 2}, path)
    monkeypatch.setattr(os, "rename", real_rename)
    old = list(tmp_path.glob(".last.ckpt.old-*"))
    assert not path.exists() and len(old) == 1
    state = {"w": torch.full((4,), 7.0)}
    with pytest.warns(UserWarning, match="is missing") as record:
        metadata = ckpt.load_sharded_checkpoint(path, state)
    assert metadata == {"step": 1} and torch.equal(state["w"], torch.zeros(4))
    message = next(str(w.message) for w in record if "is missing" in str(w.message))
    assert str(path) in message and str(old[0]) in message
    ckpt.save_sharded_checkpoint({"w": torch.full((4,), 3.0)}, {"step": 3}, path)  # the next save cleans up
    assert not list(tmp_path.glob(".last.ckpt.old-*"))
    assert ckpt.load_sharded_checkpoint(path, state) == {"step": 3}


@single_process
def test_restore_old_versions(tmp_path):
    """What `ckpt_path="last"` needs (Lightning only looks for last*.ckpt names): the `.old`
    version renamed back, only where the final name is missing and the version is complete."""
    for name in ("last.ckpt", "partial.ckpt", "kept.ckpt"):
        ckpt.save_sharded_checkpoint({"w": torch.zeros(2)}, {"name": name}, tmp_path / name)
    os.rename(tmp_path / "last.ckpt", tmp_path / f".last.ckpt.old-{NONCE}")
    os.rename(tmp_path / "partial.ckpt", tmp_path / f".partial.ckpt.old-{NONCE}")
    (tmp_path / f".partial.ckpt.old-{NONCE}" / "meta.pt").unlink()  # a deletion cut short
    shutil.copytree(tmp_path / "kept.ckpt", tmp_path / f".kept.ckpt.old-{NONCE}")  # kept.ckpt is there
    with pytest.warns(UserWarning, match="restored checkpoint"):
        assert ckpt.restore_old_versions(tmp_path) == [tmp_path / "last.ckpt"]
    assert ckpt.check_checkpoint_dir(tmp_path / "last.ckpt") == tmp_path / "last.ckpt"
    assert ckpt.restore_old_versions(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="partial.ckpt"):
        ckpt.check_checkpoint_dir(tmp_path / "partial.ckpt")  # an incomplete `.old` is no fallback


def _exchange_supported(folder):
    a, b = Path(folder) / "probe-a", Path(folder) / "probe-b"
    a.mkdir(), b.mkdir()
    try:
        return ckpt._exchange(a, b)
    finally:
        a.rmdir(), b.rmdir()


@single_process
def test_replacing_a_checkpoint_never_leaves_its_name_missing(tmp_path, monkeypatch):
    """Where the filesystem can swap two names atomically, `last.ckpt` always holds a complete
    checkpoint, so `ckpt_path="last"` always finds it."""
    if not _exchange_supported(tmp_path):
        pytest.skip("this filesystem cannot swap two names atomically (renameat2 RENAME_EXCHANGE)")
    path = tmp_path / "last.ckpt"
    ckpt.save_sharded_checkpoint({"w": torch.zeros(4)}, {"step": 1}, path)

    def killed(target):
        raise KeyboardInterrupt("killed before the previous version was deleted")

    monkeypatch.setattr(ckpt, "_remove_any", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_sharded_checkpoint({"w": torch.ones(4)}, {"step": 2}, path)
    monkeypatch.undo()
    state = {"w": torch.empty(4)}
    assert ckpt.load_sharded_checkpoint(path, state) == {"step": 2} and torch.equal(state["w"], torch.ones(4))
    previous = list(tmp_path.glob(".last.ckpt.tmp-*"))  # the previous version, under the temporary name
    assert len(previous) == 1 and not list(tmp_path.glob(".last.ckpt.old-*"))
    _backdate(previous[0])
    ckpt.save_sharded_checkpoint({"w": torch.full((4,), 2.0)}, {"step": 3}, path)
    assert _names(tmp_path) == ["last.ckpt"]


@single_process
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name the synced files")
def test_save_fsyncs_files_and_directories_before_publishing(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    path = tmp_path / "ckpts" / "model.ckpt"
    ckpt.save_sharded_checkpoint({"w": torch.arange(4.0)}, {"step": 1}, path)
    tmp = [Path(p) for p in synced if Path(p).name.startswith(".model.ckpt.tmp-")]
    assert len(tmp) == 1  # the temporary directory, synced under its temporary name: before the rename
    tmp = tmp[0]
    assert str(tmp / "meta.pt") in synced  # written by ultrascale
    assert str(tmp / "__0_0.distcp") in synced and str(tmp / ".metadata.tmp") in synced  # by DCP (sync_files=True)
    assert synced.index(str(tmp / "meta.pt")) < synced.index(str(tmp))
    last_parent_sync = max(i for i, p in enumerate(synced) if p == str(path.parent))
    assert last_parent_sync > synced.index(str(tmp))  # the rename into place, persisted
    assert str(tmp_path) in synced  # the new `ckpts` folder's entry in its parent
