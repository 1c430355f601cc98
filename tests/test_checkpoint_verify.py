"""A checkpoint that cannot be read is never the one resumed.

Every save writes `manifest.json` (each file's size and CRC-32). A resume checks it first: `auto` /
`latest_checkpoint` skip a damaged checkpoint for the newest one that verifies, and an explicit path
that does not verify is refused naming the file (the CLI: exit status 2, no traceback). The four kinds
of damage: a truncated shard, one byte changed (same size), a missing shard, a missing `.metadata`.
A checkpoint saved before manifests still loads (checked against DCP's own index).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.testing import assert_close

import ultrascale
from tests._cli import run_main
from tests._dist import run_ranks
from tests._parity import Recorder, step_losses
from tests.test_pipeline_parallel import _fit_data, make_llama
from ultrascale.parallel.checkpoint import latest_checkpoint, save_sharded_checkpoint
from ultrascale.parallel.manifest import MANIFEST_FILE, verify_checkpoint

STEPS, EVERY = 8, 4
SHARD = "__1_0.distcp"  # rank 1's shard file
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"


def damage(checkpoint: Path, kind: str) -> str:
    """Damage `checkpoint` in place; returns the file the damage is in."""
    if kind == "truncated":
        data = (checkpoint / SHARD).read_bytes()
        (checkpoint / SHARD).write_bytes(data[:1000])
        return SHARD
    if kind == "one byte changed":
        data = bytearray((checkpoint / SHARD).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (checkpoint / SHARD).write_bytes(bytes(data))
        return SHARD
    if kind == "missing shard":
        (checkpoint / SHARD).unlink()
        return SHARD
    assert kind == "missing .metadata"
    (checkpoint / ".metadata").unlink()
    return ".metadata"


KINDS = ["truncated", "one byte changed", "missing shard", "missing .metadata"]


def _fit(rank, world_size, folder, resume):
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(), max_steps=STEPS,
        logger=recorder.logger, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder, ModelCheckpoint(dirpath=folder, every_n_train_steps=EVERY, save_top_k=-1)], limit_val_batches=0,
    )
    chosen = ultrascale.latest_checkpoint(trainer) if resume else None
    trainer.fit(make_llama(vocab_size=258), _fit_data(), ckpt_path=chosen)
    return {"losses": recorder.losses, "chosen": chosen}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted run of STEPS steps, checkpointed at steps EVERY and STEPS: its folder and loss curve."""
    folder = tmp_path_factory.mktemp("run") / "ckpts"
    results = run_ranks(_fit, 2, str(folder), False)
    return folder, step_losses(results)


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpts"
    shutil.copytree(folder, copy)
    return copy


def test_every_save_writes_a_manifest_of_its_files(run):
    folder, _ = run
    newest = folder / f"epoch=0-step={STEPS}.ckpt"
    files = json.loads((newest / MANIFEST_FILE).read_text())["files"]
    assert set(files) == {p.name for p in newest.iterdir()} - {MANIFEST_FILE}
    assert files[SHARD]["size"] == (newest / SHARD).stat().st_size and len(files[SHARD]["crc32"]) == 8
    assert verify_checkpoint(newest) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_auto_resume_takes_the_newest_checkpoint_that_verifies(run, kind, tmp_path):
    """The newest checkpoint is damaged: the resume takes step EVERY's and continues the uninterrupted curve. Under
    "missing .metadata" the older one was saved before manifests (its manifest removed): it loads all the same."""
    folder, uninterrupted = run
    folder = _copy(folder, tmp_path)
    damage(folder / f"epoch=0-step={STEPS}.ckpt", kind)
    if kind == "missing .metadata":
        (folder / f"epoch=0-step={EVERY}.ckpt" / MANIFEST_FILE).unlink()
    with pytest.warns(UserWarning, match=rf"skipping checkpoint .*step={STEPS}.*{SHARD}") if kind != "missing .metadata" \
            else _nothing():
        assert latest_checkpoint([folder]) == folder / f"epoch=0-step={EVERY}.ckpt"
    results = run_ranks(_fit, 2, str(folder), True)
    assert results[0]["chosen"].endswith(f"step={EVERY}.ckpt")
    resumed = step_losses(results)
    assert len(resumed) == STEPS - EVERY
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[EVERY:]), rtol=0, atol=0)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
@pytest.mark.parametrize("kind", KINDS)
def test_the_command_refuses_a_damaged_checkpoint_naming_the_file(run, kind, tmp_path, capsys):
    folder, _ = run
    checkpoint = _copy(folder, tmp_path) / f"epoch=0-step={STEPS}.ckpt"
    file = damage(checkpoint, kind)
    code, out, err = run_main(capsys, "fit", "--config", str(RECIPE), "--trainer.max_steps", "1", "--ckpt_path", str(checkpoint))
    assert code == 2, (out, err)
    assert file in err and str(checkpoint) in err and "Traceback" not in err + out, err


def _load_damaged(rank, world_size, checkpoint):
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ultrascale.UltraScaleStrategy(), max_steps=STEPS,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    try:
        trainer.fit(make_llama(vocab_size=258), _fit_data(), ckpt_path=checkpoint)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return None


def test_the_strategy_refuses_a_changed_byte_before_loading(run, tmp_path):
    """The Trainer API's explicit path: the ranks share the checksums and all refuse, naming the file."""
    folder, _ = run
    checkpoint = _copy(folder, tmp_path) / f"epoch=0-step={STEPS}.ckpt"
    damage(checkpoint, "one byte changed")
    for message in run_ranks(_load_damaged, 2, str(checkpoint)):
        assert message is not None and message.startswith("CheckpointDamaged") and SHARD in message, message


def test_levels_and_checkpoints_saved_before_manifests(tmp_path):
    """"size" misses a changed byte that "checksum" finds; without a manifest DCP's index still finds truncation."""
    checkpoint = tmp_path / "one.ckpt"
    save_sharded_checkpoint({"w": torch.arange(4096.0)}, {"global_step": 1}, checkpoint)
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(checkpoint, "size") == [] and verify_checkpoint(checkpoint, "off") == []
    assert shard.name in verify_checkpoint(checkpoint, "checksum")[0]
    (checkpoint / MANIFEST_FILE).unlink()
    assert verify_checkpoint(checkpoint) == []  # nothing records its bytes
    shard.write_bytes(bytes(data[:100]))
    assert "truncated" in verify_checkpoint(checkpoint)[0]


def test_checkpoint_verify_command(tmp_path, capsys):
    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    for path in (good, bad):
        save_sharded_checkpoint({"w": torch.arange(4096.0)}, {"global_step": 1}, path)
    damage_file = next(bad.glob("*.distcp"))
    damage_file.write_bytes(damage_file.read_bytes()[:50])
    code, out, _ = run_main(capsys, "checkpoint", "verify", str(good))
    assert code == 0 and f"{good}: ok" in out
    code, out, _ = run_main(capsys, "checkpoint", "verify", str(good), str(bad))
    assert code == 1 and "DAMAGED" in out and damage_file.name in out
    code, _, err = run_main(capsys, "checkpoint", "verify", str(tmp_path / "nowhere.ckpt"))
    assert code == 2 and "not found" in err


def test_every_strategy_takes_the_checkpoint_verify_knob():
    """docs/strategies.md lists `checkpoint_verify` among the knobs every strategy takes: each one does."""
    import ultrascale

    for cls in (ultrascale.ZeRO1Strategy, ultrascale.ZeRO2Strategy, ultrascale.ZeRO3Strategy, ultrascale.HSDPStrategy,
                ultrascale.TensorParallelStrategy, ultrascale.ContextParallelStrategy,
                ultrascale.PipelineParallelStrategy, ultrascale.ExpertParallelStrategy, ultrascale.UltraScaleStrategy):
        assert cls(checkpoint_verify="size").checkpoint_verify == "size", cls.__name__
