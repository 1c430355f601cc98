"""Rules of the package layout: imports point down, `import ultrascale` is quiet and light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ultrascale

PACKAGE = Path(ultrascale.__file__).parent

# parallel/ is the engine room: plain torch on nn.Module + DeviceMesh, usable without Lightning.
FORBIDDEN_IN_PARALLEL = ("ultrascale.models", "ultrascale.strategies", "ultrascale.callbacks", "ultrascale.data",
                         "ultrascale.cli", "lightning", "pytorch_lightning", "lightning_utilities", "torchmetrics")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement names, at any depth (function-local imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def _violations(folder: Path, forbidden: tuple[str, ...], root: Path = PACKAGE.parent) -> list[str]:
    bad = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in _imported_modules(path):
            if module.startswith(".") or any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(root)}:{line}: imports {module}")
    return bad


def test_parallel_imports_nothing_from_above():
    assert _violations(PACKAGE / "parallel", FORBIDDEN_IN_PARALLEL) == []


def test_the_import_rule_catches_a_violation(tmp_path):
    """The checker itself: an upward import, a function-local one and a relative one are all found."""
    (tmp_path / "bad.py").write_text(
        "import torch\nfrom ultrascale.models.llama import Llama\n\ndef f():\n    import lightning.pytorch as pl\n"
        "from . import sibling\n"
    )
    found = _violations(tmp_path, FORBIDDEN_IN_PARALLEL, root=tmp_path)
    assert sorted(entry.split(": ", 1)[1] for entry in found) == [
        "imports .", "imports lightning.pytorch", "imports ultrascale.models.llama"
    ]


def test_import_ultrascale_is_silent_and_does_not_import_torchao():
    code = "import sys, ultrascale; print('torchao' in sys.modules, 'ultrascale.models.hf' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == "False False\n"
