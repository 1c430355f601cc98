"""Write the docs' generated blocks: what runs and what is refused is never typed by hand.

- docs/huggingface.md's support table (architecture x layout), from tests/test_hf_matrix.py's `MATRIX`, whose tests
  hold each cell (parity with one process and an exported folder that reloads, or the refusal's message);
- README's "Not built yet" list (the layouts) and docs/troubleshooting.md's (everything), from the rulebook's
  `NOT_BUILT` table, each entry of which tests/test_not_built.py triggers.

Tests fail when a page and its source disagree (`test_the_docs_show_this_matrix`, `test_the_docs_list_not_built`).

    python -m benchmarks.doc_tables          # rewrite every block
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "`python -m benchmarks.doc_tables`"


@dataclass(frozen=True)
class Block:
    """A generated block of `page`, between an opening marker naming its source and a closing one."""

    page: Path
    source: str
    render: Callable[[], str]

    @property
    def begin(self) -> str:
        return f"<!-- written by {COMMAND} from {self.source}; do not edit -->"

    @property
    def end(self) -> str:
        return f"<!-- end of what {COMMAND} writes from {self.source} -->"

    def current(self) -> str:
        """The block as the page has it."""
        text = self.page.read_text()
        if self.begin not in text or self.end not in text:
            raise ValueError(f"{self.page} has no markers {self.begin!r} ... {self.end!r}")
        return text.split(self.begin, 1)[1].split(self.end, 1)[0].strip()

    def write(self) -> None:
        before, rest = self.page.read_text().split(self.begin, 1)
        after = rest.split(self.end, 1)[1]
        self.page.write_text(f"{before}{self.begin}\n{self.render()}\n{self.end}{after}")


def support_table() -> str:
    """The markdown table of tests/test_hf_matrix.py's MATRIX: 'yes' (parity and export tested), 'refused: why'
    (the message tested), '-' (expert parallel of a dense model)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.test_hf_matrix import ARCHITECTURES, LAYOUTS, MATRIX, REFUSED

    lines = ["| architecture (`model_type`) | " + " | ".join(LAYOUTS) + " |",
             "|---|" + "---|" * len(LAYOUTS)]
    for architecture, (model_type, _) in ARCHITECTURES.items():
        cells = []
        for layout in LAYOUTS:
            outcome = MATRIX[(architecture, layout)]
            cells.append("yes" if outcome == "runs" else "-" if outcome == "n/a"
                         else f"refused: {REFUSED[(architecture, layout)][1]}")
        lines.append(f"| {architecture} (`{model_type}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def not_built_list(layouts_only: bool) -> str:
    """`NOT_BUILT`'s lines as a markdown list (the layouts alone for README), each with the key its error carries."""
    from ultrascale.parallel.rules import NOT_BUILT

    lines = [f"- {entry.line} (`{key}`)" for key, entry in NOT_BUILT.items() if entry.layout or not layouts_only]
    return "\n".join(lines) or "- none: every layout knob is built"


SUPPORT_TABLE = Block(ROOT / "docs" / "huggingface.md", "tests/test_hf_matrix.py", support_table)
README_NOT_BUILT = Block(ROOT / "README.md", "the rulebook's NOT_BUILT (layouts)", lambda: not_built_list(True))
ALL_NOT_BUILT = Block(ROOT / "docs" / "troubleshooting.md", "the rulebook's NOT_BUILT", lambda: not_built_list(False))
BLOCKS = (SUPPORT_TABLE, README_NOT_BUILT, ALL_NOT_BUILT)


def main() -> None:
    for block in BLOCKS:
        block.write()
        print(f"wrote {block.source} into {block.page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
