"""A checkpoint folder is data, not code: a planted pickle payload in `meta.pt`, in DCP's `.metadata`
or in a non-tensor item of a `.distcp` shard is refused with an error naming the file, and its side
effect never happens, on resume, validate and `export-hf`. Normal checkpoints load (the rest of the
suite: every layout, resharding, ZeRO families, HF export)."""

import io
import os
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests._dist import run_ranks
from ultrascale.data import CausalLMDataModule
from ultrascale.models.lm import LlamaLM
from ultrascale.parallel.manifest import write_manifest
from ultrascale.parallel.safe_load import SafeLoadPlanner, UnsafeCheckpointError, read_dcp_metadata


class Payload:
    """Unpickling this creates the directory `marker`: the observable side effect of running code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _model() -> LlamaLM:
    return LlamaLM(preset="tiny", vocab_size=258, learning_rate=1e-3, max_steps=4)


def _data() -> CausalLMDataModule:
    return CausalLMDataModule(seq_len=32, global_batch_size=4, max_tokens=20_000, val_fraction=0.2, seed=1)


def _trainer(world_size, max_steps, callbacks=()):
    return L.Trainer(accelerator="cpu", devices=world_size, strategy="ultrascale_zero3", max_steps=max_steps,
                     logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                     enable_checkpointing=bool(callbacks), limit_val_batches=1, num_sanity_val_steps=0)


def _save(rank, world_size, folder):
    _trainer(world_size, 2, [ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=2)]).fit(_model(), _data())


def _resume(rank, world_size, path, how):
    trainer = _trainer(world_size, 4)
    try:
        if how == "fit":
            trainer.fit(_model(), _data(), ckpt_path=path)
        else:
            trainer.validate(_model(), _data(), ckpt_path=path)
    except UnsafeCheckpointError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("safe")
    run_ranks(_save, 2, str(folder))
    return folder / "last.ckpt"


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "planted.ckpt"
    shutil.copytree(checkpoint, target)
    return target


def _plant_meta(path: Path, marker: Path) -> None:
    meta = torch.load(path / "meta.pt", weights_only=True)
    meta["hyper_parameters"]["learning_rate"] = Payload(marker)
    torch.save(meta, path / "meta.pt")
    write_manifest(path)  # whoever plants a payload also rewrites the manifest: the loader itself must refuse


def _plant_dcp_metadata(path: Path, marker: Path) -> None:
    metadata = read_dcp_metadata(path)
    metadata.planner_data = {"evil": Payload(marker)}
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(path)


@pytest.mark.parametrize("how", ["fit", "validate"])
@pytest.mark.parametrize("where", ["meta.pt", ".metadata"])
def test_planted_payload_is_refused_on_resume_and_validate(checkpoint, tmp_path, where, how):
    path, marker = _copy(checkpoint, tmp_path), tmp_path / "payload-ran"
    (_plant_meta if where == "meta.pt" else _plant_dcp_metadata)(path, marker)
    errors = run_ranks(_resume, 2, str(path), how)
    for error in errors:
        assert error is not None and "refusing to" in error and where in error, error
    assert not marker.exists(), "the planted code ran"


@pytest.mark.parametrize("where", ["meta.pt", ".metadata"])
def test_planted_payload_is_refused_by_export_hf(checkpoint, tmp_path, where):
    from ultrascale.cli import main

    path, marker = _copy(checkpoint, tmp_path), tmp_path / "payload-ran"
    (_plant_meta if where == "meta.pt" else _plant_dcp_metadata)(path, marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"{where}.*refusing to"):
        main(["export-hf", "--checkpoint", str(path), "--out", str(tmp_path / "out")])
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_non_tensor_items_of_shards_are_read_as_data(tmp_path):
    """DCP's default planner reads non-tensor items with torch.load(weights_only=False)."""
    marker = tmp_path / "payload-ran"
    planted = io.BytesIO()
    torch.save({"lr": Payload(marker)}, planted)
    planted.seek(0)
    planner = SafeLoadPlanner()
    planner.state_dict, planner.flatten_state_dict = {}, False
    item = type("ReadItem", (), {"dest_index": type("Index", (), {"fqn": "optimizer_0.param_groups.0"})()})()
    with pytest.raises(UnsafeCheckpointError, match="optimizer_0.param_groups.0.*refusing to unpickle"):
        planner.load_bytes(item, planted)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.95), "foreach": None}, plain)
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.state_dict["optimizer_0.param_groups.0"] == {"lr": 0.1, "betas": (0.9, 0.95), "foreach": None}


def test_a_users_own_hyper_parameter_class_is_named_with_the_fix(checkpoint, tmp_path):
    from ultrascale.parallel.checkpoint import read_checkpoint_metadata

    path = _copy(checkpoint, tmp_path)
    meta = torch.load(path / "meta.pt", weights_only=True)
    meta["hyper_parameters"]["schedule"] = Path("/some/where")  # a type torch does not allow by default
    torch.save(meta, path / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"meta.pt: refusing to unpickle.*add_safe_globals"):
        read_checkpoint_metadata(path)
    with torch.serialization.safe_globals([type(Path("/"))]):
        assert read_checkpoint_metadata(path)["hyper_parameters"]["schedule"] == Path("/some/where")


def test_hf_folder_code_is_not_run_unless_trusted_by_name(tmp_path):
    """A checkpoint folder that ships its own modelling code (auto_map) is refused by transformers
    unless `trust_remote_code=True` is given by name; the shipped code does not run."""
    import json

    import transformers

    from ultrascale.models.hf import HFCausalLM

    folder = tmp_path / "remote"
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    marker = tmp_path / "remote-code-ran"
    (folder / "configuration_evil.py").write_text(
        f"import os\nos.makedirs({str(marker)!r})\nfrom transformers import LlamaConfig\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
    )
    data = json.loads((folder / "config.json").read_text())
    data.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="trust_remote_code"):
        HFCausalLM(str(folder))
    assert not marker.exists()
