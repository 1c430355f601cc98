"""Writing a Hugging Face folder (sharded safetensors, config, generation config, tokenizer) atomically, and the
check of where an export may go. Shared by the full-model export (`models/hf.py`) and the LoRA adapters'
(`models/peft.py`), which import it and not each other."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def check_export_target(out_dir: str | Path, source_dir: Optional[str | Path], overwrite: bool = False) -> Path:
    """The folder an export may write, or a clear error before anything is touched: never the model's
    source folder (its weights would be replaced by the files being written), and not a non-empty
    folder unless `overwrite`."""
    out = Path(out_dir).resolve()
    if source_dir is not None and out == Path(source_dir).resolve():
        raise ValueError(
            f"refusing to export into {out}: it is the model's source folder (pretrained_path); its weights would be "
            "replaced. Choose another output folder."
        )
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export target {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        found = sorted(p.name for p in out.iterdir())
        raise FileExistsError(
            f"export target {out} is not empty ({found[:5]}{' ...' if len(found) > 5 else ''}); choose an empty or "
            "new folder, or pass overwrite (`ultrascale export-hf --overwrite`, `HFCausalLM(export_overwrite=True)`)"
        )
    return out


def write_hf_folder(state: dict[str, torch.Tensor], config: Any, source_dir: Optional[str], out_dir: str | Path,
                    max_shard_size: str = "2GB", overwrite: bool = False, tokenizer: Any = None,
                    chat_template: Optional[str] = None) -> Path:
    """Write HF-named weights as a Hugging Face folder: sharded safetensors, config, generation config, tokenizer.

    The tokenizer files are `source_dir`'s, or `tokenizer` (a transformers tokenizer) saved; `chat_template` (the
    one the conversations were rendered with) becomes the exported tokenizer's, so `apply_chat_template` on the
    folder prompts the model the way it was trained. Checked first (`check_export_target`), then written and
    published by `publish_folder`."""
    final = check_export_target(out_dir, source_dir, overwrite)
    return publish_folder(final, lambda out: _write_hf_files(state, config, source_dir, out, max_shard_size, tokenizer,
                                                             chat_template))


def trained_chat_template(datamodule_hparams: Any) -> Optional[str]:
    """The chat template a run's data module rendered its conversations with (kept in its hyperparameters), or None."""
    template = datamodule_hparams.get("chat_template") if datamodule_hparams else None
    return template if isinstance(template, str) else None


def publish_folder(final: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a hidden folder beside `final`, then rename it into place: a failed write leaves no
    half-written folder, and an existing `final` (an export with overwrite) is replaced only once the new one
    is complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(out)
        if final.exists():  # overwrite: move the old folder aside, publish, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(out, final)
            shutil.rmtree(old)
        else:
            os.replace(out, final)
    finally:
        if out.exists():
            shutil.rmtree(out)
    return final


def _write_hf_files(state: dict[str, torch.Tensor], config: Any, source_dir: Optional[str], out: Path,
                    max_shard_size: str, tokenizer: Any = None, chat_template: Optional[str] = None) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from ultrascale.models.hf_load import composite_names, multimodal_source

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
    whole = multimodal_source(config, source_dir) if source_dir else None
    if whole is not None:
        # The text model of a multimodal checkpoint: written back into the whole model, whose other parts (the vision
        # tower, the projector) are the source's, untouched; transformers saves it in the checkpoint's own key layout.
        composite = whole[1].from_pretrained(source_dir, local_files_only=True)
        rename = composite_names(model, composite)
        _, unexpected = composite.load_state_dict({rename(k): v for k, v in state.items()}, strict=False, assign=True)
        if unexpected:
            raise ValueError(f"the trained weights {unexpected[:5]} have no place in {type(composite).__name__}")
        model = composite
    else:
        model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.tie_weights()
    if source_dir and (Path(source_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source_dir, local_files_only=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    if source_dir:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, out / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if chat_template is not None and any((out / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        exported = AutoTokenizer.from_pretrained(out, local_files_only=True)
        if exported.chat_template != chat_template:
            exported.chat_template = chat_template
            exported.save_pretrained(out)
