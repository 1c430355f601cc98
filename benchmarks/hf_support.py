"""Write docs/huggingface.md's support table (architecture x layout) from the test matrix that holds it.

tests/test_hf_matrix.py's `MATRIX` says, cell by cell, what runs and what is refused, and its tests hold each
cell to it (parity with one process and an exported folder that reloads, or the refusal's message). This script
renders that matrix between the page's markers, so the table is never typed by hand; the test
`test_the_docs_show_this_matrix` fails when the page and the matrix disagree.

    python -m benchmarks.hf_support          # rewrite the table in docs/huggingface.md
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "huggingface.md"
BEGIN = "<!-- support table: written by `python -m benchmarks.hf_support` from tests/test_hf_matrix.py; do not edit -->"
END = "<!-- end of support table -->"


def render() -> str:
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


def table_in(text: str) -> str:
    """The table between the page's markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{PAGE} has no support-table markers ({BEGIN!r} ... {END!r})")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main() -> None:
    text = PAGE.read_text()
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    PAGE.write_text(f"{before}{BEGIN}\n{render()}\n{END}{after}")
    print(f"wrote the support table of {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
