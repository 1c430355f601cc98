"""Rules of the package layout: imports point down, `import ultrascale` is quiet and light."""

from __future__ import annotations

import ast
import re
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


# The layers of ultrascale/, top to bottom (docs/architecture.md draws the same picture): a module may import
# modules of its own layer or of a lower one, never of a higher one, and no chain of imports may come back to
# where it started. A name belongs to the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ultrascale.cli", "ultrascale.verify", "ultrascale.planner.app"),  # the commands
    ("ultrascale.recipe_cli", "ultrascale.measure", "ultrascale.planner.recipe_check"),  # what the commands share:
    # LightningCLI, measuring one layout, a recipe checked and priced
    ("ultrascale.strategies",),  # Lightning strategies
    ("ultrascale.callbacks",),  # Lightning callbacks
    ("ultrascale.planner",),  # the planner's search and cost model
    ("ultrascale.models",),  # the built-in Llama, Hugging Face models, PEFT, adapters
    ("ultrascale.data", "ultrascale.contract", "ultrascale.user_errors"),  # DataModules; the module <-> strategy
    # contract; a user's mistake said in one line from whichever process finds it
    ("ultrascale.estimate", "ultrascale.hardware"),  # shapes, FLOPs and memory formulas; the GPU table
    ("ultrascale.parallel", "ultrascale.launch"),  # the engine (no Lightning), process launching
)
# Deprecation aliases resolved at attribute access (FutureWarning), for configs that name an old path.
ALIASES = {("ultrascale.models.llama", "ultrascale.models.lm")}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth (function-local and TYPE_CHECKING imports too).
    `from P import N` is an import of module P.N where that is a module, else of P."""
    root = package.parent
    modules = {_module_name(path, root): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here.split(".")[: len(here.split(".")) - node.level + 1], *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _layer(name: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    matches = [(len(prefix), index) for index, group in enumerate(layers) for prefix in group
               if name == prefix or name.startswith(prefix + ".")]
    return max(matches)[1] if matches else None


def layering_problems(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...], top: str) -> list[str]:
    """Upward imports, modules in no layer, and import circles (each named once, by its modules)."""
    problems = []
    for name in sorted(graph):
        if name == top:
            continue
        if _layer(name, layers) is None:
            problems.append(f"{name} is in no layer")
            continue
        for target in sorted(graph[name] - {top}):
            if (name, target) not in ALIASES and (_layer(target, layers) or 0) < _layer(name, layers):
                problems.append(f"{name} imports {target}, a higher layer")
    edges = {name: {t for t in targets if (name, t) not in ALIASES and t != top} for name, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    problems += [f"import circle: {' <-> '.join(circle)}" for circle in sorted(circles)]
    return problems


def test_imports_point_down_and_close_no_circle():
    assert layering_problems(import_graph(PACKAGE), LAYERS, "ultrascale") == []


def drawn_layers(page: str) -> tuple[tuple[str, ...], ...]:
    """The layers docs/architecture.md draws under "## Layers": each line of its first code block names files and
    folders of `ultrascale/` (`cli.py, verify/, planner/app.py   what they are`); lines naming none are skipped."""
    block = page.split("## Layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.splitlines()[1:]:
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        modules = tuple("ultrascale." + name.strip().rstrip("/").removesuffix(".py").replace("/", ".")
                        for name in names.split(",") if name.strip().endswith((".py", "/")))
        if modules and not any("*" in m or m.startswith("ultrascale.recipes") for m in modules):
            layers.append(modules)
    return tuple(layers)


def test_the_architecture_page_draws_these_layers():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert drawn_layers(page) == LAYERS


def defined_names(package: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Every module-level function and class of the package, and each class's members (methods, properties, class
    attributes and annotated fields), read from the source."""
    functions: set[str] = set()
    members: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                owned = members.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        owned.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        owned.add(item.target.id)
    return functions, members


def drawn_step_problems(page: str, functions: set[str], members: dict[str, set[str]]) -> list[str]:
    """The names in the step docs/architecture.md draws ("### Each optimizer step", its code block) that the code
    does not have: every `Class.member` anywhere on a line, every `function(` called before the comment."""
    block = page.split("### Each optimizer step", 1)[1].split("```", 2)[1]
    local = {"closure", "lightning_step", "step"}  # the closure and the step Lightning hands to the hook
    problems = []
    for line in block.splitlines():
        for owner, member in re.findall(r"\b([A-Z]\w+)\.(\w+)", line):
            if member not in members.get(owner, ()):
                problems.append(f"{owner}.{member}")
        code = line.split("#", 1)[0]
        for name in re.findall(r"(?<![.\w])([a-z_]\w*)\(", code):
            if name not in functions and name not in local:
                problems.append(f"{name}()")
    return problems


def test_the_architecture_page_draws_the_step_the_code_has():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = page.split("### Each optimizer step", 1)[1].split("```", 2)[1]
    assert 10 < len(block.splitlines()) <= 60
    functions, members = defined_names(PACKAGE)
    assert drawn_step_problems(page, functions, members) == []
    # The check itself: a renamed method and a function that does not exist are both found.
    broken = page.replace("StepRunner.observe(", "StepRunner.look(").replace("log_step(", "record_step(")
    assert drawn_step_problems(broken, functions, members) == ["StepRunner.look", "record_step()"]


def test_the_layering_check_catches_an_upward_import_and_a_circle(tmp_path):
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from pkg.high import g\n")  # function-level, upward
    (package / "low" / "b.py").write_text("from pkg.low import c\n")
    (package / "low" / "c.py").write_text("from . import b\n")  # relative, closes b <-> c
    (package / "high.py").write_text("def g():\n    pass\n")
    problems = layering_problems(import_graph(package), (("pkg.high",), ("pkg.low",)), "pkg")
    assert problems == ["pkg.low.a imports pkg.high, a higher layer", "import circle: pkg.low.b <-> pkg.low.c"]


def test_import_ultrascale_is_silent_and_does_not_import_torchao():
    code = "import sys, ultrascale; print('torchao' in sys.modules, 'ultrascale.models.hf' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == "False False\n"
