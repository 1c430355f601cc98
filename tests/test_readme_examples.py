"""The README's Python examples, extracted and run.

Every ```python block of README.md is executed in order in one namespace, so later blocks use what
earlier ones defined, as a reader would. The namespace starts with only `lightning as L`,
`ultrascale`, `torch` and placeholders for what a reader brings: their module, data and paths.
What each block *builds* runs for real: strategies with their knob checks, Trainers with the
layout checked against `devices`, models, callbacks, data modules. Two things do not run:

- `Trainer.fit` is recorded, not run. The examples ask for 4-16 GPUs and the reader's data.
  The recipes and the tests train the same strategies.
- The raw-loop fragments ("Without Lightning") need a process group and the reader's
  tensors. Their imports and every `ultrascale` name they use are checked.

So a renamed knob, a removed class, a wrong import path or an `ultrascale.x` attribute that
`import ultrascale` does not provide fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning as L
import pytest
import torch

import ultrascale

README = Path(__file__).resolve().parent.parent / "README.md"
RAW_LOOP_MARKERS = ("dist.init_process_group", "parallelize(model, mesh", "PipelineRunner(")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


class _Recorded:
    """Stands in for what a reader brings: any attribute or call gives another placeholder."""

    def __getattr__(self, name):
        return _Recorded()

    def __call__(self, *args, **kwargs):
        return _Recorded()


def _ultrascale_names(tree: ast.AST) -> set[str]:
    """`ultrascale.a.b.C` attribute chains and `from ultrascale.x import y` names in a block."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            current: ast.AST = node
            while isinstance(current, ast.Attribute):
                parts.append(current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id == "ultrascale":
                names.add(".".join(["ultrascale", *reversed(parts)]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ultrascale"):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _resolve(dotted: str) -> object:
    import importlib

    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def test_readme_has_examples():
    assert len(python_blocks()) >= 15


def test_every_ultrascale_name_in_the_examples_exists():
    missing = []
    for block in python_blocks():
        for name in sorted(_ultrascale_names(ast.parse(block))):
            try:
                _resolve(name)
            except (AttributeError, ImportError) as error:
                missing.append(f"{name}: {error}")
    assert not missing, "README examples name what does not exist:\n" + "\n".join(missing)


def test_examples_run_in_order(monkeypatch, tmp_path):
    fits: list[tuple] = []
    monkeypatch.setattr(L.Trainer, "fit", lambda self, *args, **kwargs: fits.append((self.strategy, args)))
    monkeypatch.chdir(tmp_path)
    from tests._parity import make_hf_checkpoint

    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama", vocab_size=64)
    namespace = {
        "L": L, "ultrascale": ultrascale, "torch": torch,
        "my_existing_lightning_module": _Recorded(), "datamodule": _Recorded(),
    }
    ran = 0
    for index, block in enumerate(python_blocks()):
        if any(marker in block for marker in RAW_LOOP_MARKERS):
            continue  # checked by the names test: needs a process group and the reader's tensors
        code = block.replace("/path/to/hf_dir", str(hf_dir))
        if "HFCausalLM(" in code and "HFCausalLM" not in namespace:
            from ultrascale.models.hf import HFCausalLM

            namespace["HFCausalLM"] = HFCausalLM  # the README's fine-tuning section imports it in prose
        if "train.jsonl" in code:
            (tmp_path / "train.jsonl").write_text('{"prompt": "hi", "response": "there"}\n')
        try:
            exec(compile(code, f"README.md python block {index}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - the test names the block that fails
            pytest.fail(f"README python block {index} failed: {type(error).__name__}: {error}\n{block}")
        ran += 1
    assert ran >= 15 and fits, (ran, fits)
