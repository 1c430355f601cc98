"""Private Lightning names live in one module and exist in the installed Lightning."""

from __future__ import annotations

import re
from pathlib import Path

import lightning
import pytest
import tomllib
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import ultrascale
from ultrascale.strategies import _lightning_compat as compat

PACKAGE = Path(ultrascale.__file__).parent
COMPAT = PACKAGE / "strategies" / "_lightning_compat.py"


def test_installed_lightning_has_every_internal_ultrascale_uses():
    missing = compat.missing_lightning_internals()
    assert missing == [], (
        f"lightning {lightning.__version__} lacks internals ultrascale uses: {missing}; "
        f"adapt ultrascale/strategies/_lightning_compat.py or pin lightning{compat.LIGHTNING_TESTED}"
    )


@pytest.mark.parametrize("entry", [
    ("lightning.pytorch.strategies.strategy:Strategy", "_no_such_hook", "a renamed hook"),
    ("lightning.pytorch.core.module:LightningModule()", "_no_such_attribute", "a renamed attribute"),
    ("lightning.no_such_module", "_anything", "a moved module"),
])
def test_a_missing_internal_is_named_with_the_tested_range(monkeypatch, entry):
    monkeypatch.setattr(compat, "PRIVATE_NAMES", (*compat.PRIVATE_NAMES, entry))
    monkeypatch.setattr(compat, "_checked", False)
    where, name, why = entry
    with pytest.raises(RuntimeError) as error:
        compat.check_lightning_internals()
    message = str(error.value)
    assert f"{where}.{name} ({why})" in message
    assert f"lightning{compat.LIGHTNING_TESTED}" in message and lightning.__version__ in message
    assert message.count("\n  ") == 1  # only the planted name is missing


def test_pinned_range_is_the_tested_range_and_holds_the_installed_lightning():
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    pins = [d for d in project["project"]["dependencies"] if re.match(r"lightning\s*[<>=!~]", d)]
    assert len(pins) == 1
    assert SpecifierSet(pins[0].removeprefix("lightning")) == SpecifierSet(compat.LIGHTNING_TESTED)
    assert Version(lightning.__version__) in SpecifierSet(compat.LIGHTNING_TESTED)


def _private_uses_outside_compat() -> list[str]:
    names = {name for _, name, _ in compat.PRIVATE_NAMES} | {"_optimizer", "_trainer", "_results"}
    word = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(sorted(map(re.escape, names))) + r")(?![A-Za-z0-9_])")
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            private_import = re.search(r"from lightning[\w.]* import .*\b_[A-Za-z]", line)
            if word.search(line) or private_import or re.search(r"lightning.*\._", line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    return hits


def test_private_lightning_names_appear_in_the_compat_module_only():
    assert _private_uses_outside_compat() == []
