"""The documentation's examples, links and figures of speech, checked against the code.

README.md and every page under docs/ are read as a reader would read them.

- **Python examples run.** Every ```python block of a page is executed, blocks in order, in one
  fresh namespace per page, so later blocks use what earlier ones on the same page defined and a
  page never borrows a name from another page (each imports what it uses). The namespace starts
  with only `lightning as L`, `ultrascale`, `torch` and placeholders for what a reader brings:
  their module (`my_existing_lightning_module`), their data (`datamodule`), their Hugging Face
  folder (`/path/to/hf_dir` becomes a tiny real checkpoint) and their `train.jsonl` (present in
  the working directory). What each block *builds* runs for real: strategies with their knob
  checks, Trainers with the layout checked against `devices`, models, callbacks, data modules.
  Two things do not run:

  - `Trainer.fit` (and `validate` / `test` / `predict`) is recorded, not run. The examples ask
    for 4-16 GPUs and the reader's data; the recipes and the tests train the same strategies.
  - The raw-loop fragments ("without Lightning") need a process group and the reader's tensors.
    They are parsed, and every `ultrascale` name they use is checked like any other block's.

  So a renamed knob, a removed class, a wrong import path or an `ultrascale.x` attribute that
  `import ultrascale` does not provide fails here, naming the page and the block.
- **Names resolve.** Every `ultrascale.a.b` attribute chain and `from ultrascale... import` /
  `import ultrascale...` in any Python block (the raw-loop fragments included) resolves, and every
  `class_path: ultrascale...` of a YAML block names something that exists.
- **YAML parses.** Every ```yaml block loads with `yaml.safe_load`.
- **JSONL records read.** Every ```jsonl block is records `InstructionDataModule` reads: one JSON object per line
  with its default fields (`prompt`, `response`).
- **Links resolve.** Every relative Markdown link (outside code) points at a file that exists, and a
  `#anchor` at a heading of the target page (GitHub's slugs). http(s) and mailto links are not followed.
- **Commands parse.** Every `ultrascale ...` command of a bash block (also after `torchrun ... -m ultrascale.cli`
  or `srun`) is parsed by the command's own parser, nothing run: LightningCLI's for fit/validate/test/predict (the
  recipe loaded, every `--model.*` / `--data.*` / `--trainer.*` key checked against the recipe's classes),
  argparse's for ultrascale's own, whose LightningCLI overrides (`plan --recipe`, `verify --config`) are checked
  as `fit` would check them. A few stand-ins for what a reader brings (`job.yaml`, `$RECIPE`, `plan ...`) are
  listed in `COMMAND_STAND_INS`.
- **README and the CLI agree.** README's command table names exactly the subcommands `ultrascale --help`
  prints, and README shows the test command `.ci/run` runs, verbatim.
- **Sizes.** README stays a front door (at most 350 lines); each page under docs/ at most 700 lines, and
  there are at least 8 of them.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

import ultrascale

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
RAW_LOOP_MARKERS = ("dist.init_process_group", "parallelize(model, mesh", "PipelineRunner(")
RECORDED_LOOPS = ("fit", "validate", "test", "predict")
HF_DIR_PLACEHOLDER = "/path/to/hf_dir"
README_MAX_LINES, PAGE_MAX_LINES, MIN_PAGES = 350, 700, 8


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# --- reading Markdown: fenced code blocks, prose, headings ------------------------------------------------


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    index: int  # position among the page's blocks of the same language


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def _split(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The page's fenced code blocks (dedented by their fence's indent) and its prose lines outside them."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    counts: dict[str, int] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence, lang = len(opening[1]), opening[2], opening[3].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        blocks.append(Block(lang, "\n".join(body) + "\n", i + 1, counts.get(lang, 0)))
        counts[lang] = counts.get(lang, 0) + 1
        i = j + 1
    return blocks, prose


def _blocks(page: Path, lang: str) -> list[Block]:
    return [block for block in _split(page.read_text())[0] if block.lang == lang]


def _strip_code_spans(line: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", line)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (formatting dropped) lowercased, characters other than
    letters, digits, spaces, '-' and '_' dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page's headings (a repeated heading gets -1, -2, ...), and explicit
    `<a name=...>` / `id=...` anchors."""
    _, prose = _split(page.read_text())
    seen: dict[str, int] = {}
    found: set[str] = set()
    previous = ""
    for _, line in prose:
        heading = None
        atx = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if atx:
            heading = atx[1]
        elif re.match(r"^ {0,3}(=+|-+)\s*$", line) and previous.strip() and not re.match(r"^\s*([-*+]|\d+\.)\s|^\s*\|", previous):
            heading = previous.strip()  # a setext heading: its text is the line above
        if heading is not None:
            slug = _slug(heading)
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
        found.update(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", line))
        previous = line
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code: inline `[text](target)` and
    reference definitions `[label]: target`."""
    _, prose = _split(page.read_text())
    found = []
    for number, line in prose:
        text = _strip_code_spans(line)
        for target in re.findall(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)", text):
            found.append((number, target.strip("<>")))
        reference = re.match(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", text)
        if reference:
            found.append((number, reference[1].strip("<>")))
    return found


# --- the names the examples use -----------------------------------------------------------------------------


def _ultrascale_names(tree: ast.AST) -> set[str]:
    """`ultrascale.a.b.C` attribute chains, `import ultrascale.x` and `from ultrascale.x import y` names in a block."""
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
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ultrascale":
            names.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "ultrascale")
    return names


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _unresolved(where: str, names: Iterable[str]) -> list[str]:
    """`where: name: why` for each dotted name that does not import."""
    problems = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (AttributeError, ImportError) as error:
            problems.append(f"{where}: {name}: {error}")
    return problems


def _class_paths(node: object) -> set[str]:
    """Every `class_path` value of a loaded YAML document."""
    if isinstance(node, dict):
        found = {node["class_path"]} if isinstance(node.get("class_path"), str) else set()
        for value in node.values():
            found |= _class_paths(value)
        return found
    if isinstance(node, list):
        return set().union(*(_class_paths(value) for value in node)) if node else set()
    return set()


# --- the runner ---------------------------------------------------------------------------------------------


class _Recorded:
    """Stands in for what a reader brings: any attribute or call gives another placeholder."""

    def __getattr__(self, name):
        return _Recorded()

    def __call__(self, *args, **kwargs):
        return _Recorded()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """One tiny Hugging Face Llama folder for every page that names `/path/to/hf_dir`."""
    from tests._parity import make_hf_checkpoint

    return str(make_hf_checkpoint(tmp_path_factory.mktemp("hf"), "llama", vocab_size=64))


def _run_page(page: Path, hf_dir: str, monkeypatch, tmp_path) -> tuple[int, list[tuple]]:
    """Run the page's Python blocks in order in one fresh namespace; return how many ran and the recorded loops."""
    calls: list[tuple] = []
    for loop in RECORDED_LOOPS:
        monkeypatch.setattr(L.Trainer, loop, lambda self, *args, _loop=loop, **kwargs: calls.append((_loop, self.strategy, args)))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "hi", "response": "there"}\n')
    namespace = {
        "L": L, "ultrascale": ultrascale, "torch": torch,
        "my_existing_lightning_module": _Recorded(), "datamodule": _Recorded(),
    }
    ran = 0
    for block in _blocks(page, "python"):
        where = f"{_name(page)} python block {block.index} (line {block.line})"
        if any(marker in block.code for marker in RAW_LOOP_MARKERS):
            continue  # checked by the names test: needs a process group and the reader's tensors
        try:
            exec(compile(block.code.replace(HF_DIR_PLACEHOLDER, hf_dir), where, "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - the test names the page and the block that fails
            pytest.fail(f"{where} failed: {type(error).__name__}: {error}\n{block.code}")
        ran += 1
    return ran, calls


# --- the tests ----------------------------------------------------------------------------------------------


def test_there_are_examples():
    assert sum(len(_blocks(page, "python")) for page in PAGES) >= 15


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_python_examples_run_in_order(page, hf_dir, monkeypatch, tmp_path):
    ran, calls = _run_page(page, hf_dir, monkeypatch, tmp_path)
    if page == README:
        assert ran and any(loop == "fit" for loop, *_ in calls), "README's example should build a Trainer and call fit"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_ultrascale_name_in_the_examples_exists(page):
    missing = []
    for block in _blocks(page, "python"):
        where = f"{_name(page)} python block {block.index} (line {block.line})"
        try:
            tree = ast.parse(block.code, where)
        except SyntaxError as error:
            missing.append(f"{where}: does not parse: {error}")
            continue
        missing += _unresolved(where, _ultrascale_names(tree))
    assert not missing, "examples name what does not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_yaml_blocks_parse_and_name_what_exists(page):
    problems = []
    for block in _blocks(page, "yaml"):
        where = f"{_name(page)} yaml block {block.index} (line {block.line})"
        try:
            documents = list(yaml.safe_load_all(block.code))
        except yaml.YAMLError as error:
            problems.append(f"{where}: {error}")
            continue
        class_paths = set().union(*map(_class_paths, documents))
        problems += _unresolved(f"{where}: class_path", {path for path in class_paths if path.split(".")[0] == "ultrascale"})
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_jsonl_blocks_are_instruction_records(page, tmp_path):
    import json

    from ultrascale.data import InstructionDataModule

    for block in _blocks(page, "jsonl"):
        (tmp_path / "block.jsonl").write_text(block.code)
        # Pairs or conversations, as the module's defaults read them: a missing field, a bad role or a non-string raises.
        examples = InstructionDataModule(str(tmp_path / "block.jsonl")).read()
        assert len(examples) == len(block.code.strip().splitlines()) and all(json.loads(line) for line in block.code.splitlines())


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for line, target in links(page):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s), mailto and other schemes are not followed
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        where = f"{_name(page)}:{line}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where}: no heading with anchor #{anchor} in {destination.relative_to(ROOT).as_posix()}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _cli_subcommands() -> set[str]:
    """The subcommands the command dispatches: read from its tables, not from the help text (a help line with one
    space after `prepare-data` once hid it from a pattern, and from README's table with it)."""
    from ultrascale.cli import LIGHTNING_SUBCOMMANDS, OWN_SUBCOMMANDS

    return {*LIGHTNING_SUBCOMMANDS, *OWN_SUBCOMMANDS}


def _readme_subcommands() -> set[str]:
    """The subcommands of README's command table: the first table under the "## Command line" heading,
    whose first column is `ultrascale NAME`."""
    text = README.read_text()
    section = re.search(r"^## Command line\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README has no '## Command line' section"
    rows = [line for line in section[1].splitlines() if line.lstrip().startswith("|")]
    return set(re.findall(r"^\s*\|\s*`ultrascale ([a-z][\w-]*)`", "\n".join(rows), re.M))


def test_readme_names_the_subcommands_the_cli_lists(capsys):
    from ultrascale.cli import main

    listed = _cli_subcommands()
    named = _readme_subcommands()
    assert named == listed, f"README's command table: {sorted(named)}; the command's: {sorted(listed)}"
    main(["--help"])
    printed = capsys.readouterr().out
    assert all(re.search(rf"^  {re.escape(name)} ", printed, re.M) for name in listed), printed  # and `--help` lists them
    with pytest.raises(SystemExit):  # each of ultrascale's own is dispatched (its parser answers --help)
        main(["prepare-data", "--help"])


def test_readme_shows_the_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if line.strip() and not line.startswith("#")][-1].strip()
    shown = [block.code for block in _blocks(README, "bash")]
    assert any(command in code.splitlines() for code in shown), f"README shows no bash block with `.ci/run`'s command: {command}"


def test_sizes():
    lines = {_name(page): len(page.read_text().splitlines()) for page in PAGES}
    too_long = {name: n for name, n in lines.items() if n > (README_MAX_LINES if name == "README.md" else PAGE_MAX_LINES)}
    assert not too_long, f"README at most {README_MAX_LINES} lines, docs pages at most {PAGE_MAX_LINES}: {too_long}"
    assert len(PAGES) - 1 >= MIN_PAGES, f"{len(PAGES) - 1} docs pages, at least {MIN_PAGES} expected"


# --- every `ultrascale ...` command of a bash block parses ------------------------------------------------

COMMAND_STAND_INS = {
    "job.yaml": "recipes/tiny_cpu.yaml",  # a reader's own recipe
    '"$RECIPE"': "recipes/tiny_cpu.yaml",
    "$((SLURM_NNODES * 8))": "16",
    "ultrascale plan ... ": "ultrascale plan --preset llama3_8b --gpus 8 ",  # "..." = the command above it
    "[LightningCLI overrides] ": "",  # a synopsis: its optional parts are given
}


class _Parsed(Exception):
    """Raised where a command would start its work: its arguments were accepted."""


def doc_commands() -> list[tuple[str, int, str]]:
    """(page, line of the block, command) for every `ultrascale` command in a bash block, stand-ins applied."""
    import shlex

    found = []
    for page in PAGES:
        for block in _blocks(page, "bash"):
            code = re.sub(r"\\\n\s*", " ", block.code)
            for line in code.splitlines():
                for command in re.split(r"&&|;|\|\|", line.split(" #")[0] if not line.lstrip().startswith("#") else ""):
                    for stand_in, value in COMMAND_STAND_INS.items():
                        command = command.replace(stand_in, value)
                    command = re.sub(r"\[(--[^\]]+)\]", r"\1", command)
                    words = shlex.split(command)
                    quoted = [word for word in words if re.search(r"(^|\s)ultrascale\s", word)]  # sbatch --wrap "srun ..."
                    words = shlex.split(quoted[0]) if quoted and "ultrascale" not in words else words
                    if "ultrascale.cli" in words:
                        args = words[words.index("ultrascale.cli") + 1:]
                    elif "ultrascale" in words:
                        args = words[words.index("ultrascale") + 1:]
                    else:
                        continue
                    found.append((_name(page), block.line, shlex.join(["ultrascale", *args])))
    return found


def parse_command(command: str, monkeypatch) -> None:
    """Parse `ultrascale ARGS` as the command would and stop before it works; AssertionError with the parser's
    message on stderr if it refuses (unknown flag, a key the recipe's classes do not have, a bad value)."""
    import argparse
    import contextlib
    import io
    import shlex
    import warnings

    from ultrascale.cli import LIGHTNING_SUBCOMMANDS, main
    from ultrascale.recipe_cli import UltraScaleCLI

    def parsed(self) -> None:
        raise _Parsed()

    monkeypatch.setattr(UltraScaleCLI, "before_instantiate_classes", parsed)
    args = shlex.split(command)[1:]
    if args[0] not in LIGHTNING_SUBCOMMANDS:
        real = argparse.ArgumentParser.parse_known_args
        inside_parse_args = []

        def parse_known_args(self, args=None, namespace=None):
            options, unknown = real(self, args, namespace)
            if inside_parse_args or type(self) is not argparse.ArgumentParser or not self.prog.startswith("ultrascale "):
                return options, unknown
            # What is left are LightningCLI overrides of a recipe (`plan --recipe R`, `verify --config R`).
            recipe = ["--config", options.recipe] if getattr(options, "recipe", None) else []
            if unknown and not recipe and "--config" not in unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            if unknown or recipe:
                parse_command(shlex.join(["ultrascale", "fit", *recipe, *unknown]), monkeypatch)
            raise _Parsed()

        def parse_args(self, args=None, namespace=None):
            inside_parse_args.append(True)
            try:
                options = real_parse_args(self, args, namespace)
            finally:
                inside_parse_args.pop()
            if type(self) is argparse.ArgumentParser and self.prog.startswith("ultrascale "):
                raise _Parsed()
            return options

        real_parse_args = argparse.ArgumentParser.parse_args
        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
            main(args)
    except _Parsed:
        return
    except SystemExit as exit_info:
        raise AssertionError(f"`{command}` was refused (exit {exit_info.code}): {stderr.getvalue().strip()[-600:]}") from None
    raise AssertionError(f"`{command}` ran to its end without parsing its arguments first")


COMMANDS = doc_commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 30 and {c.split()[1] for _, _, c in COMMANDS} >= {"fit", "plan", "verify", "export-hf"}


@pytest.mark.parametrize("page, line, command", COMMANDS, ids=[f"{p}:{n}:{c.split()[1]}" for p, n, c in COMMANDS])
def test_every_command_in_the_pages_parses(page, line, command, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes/... as the pages give them
    parse_command(command, monkeypatch)


@pytest.mark.parametrize("command", [
    "ultrascale fit --config recipes/llama3_70b.yaml --data.data_pth /data/corpus",  # the data module has no such key
    "ultrascale fit --config recipes/tiny_cpu.yaml --trainer.strategy.init_args.tensor_paralel 2",
    "ultrascale plan --preset llama3_70b --gpu-count 256",
    "ultrascale plan --recipe recipes/tiny_cpu.yaml --model.no_such_knob 1",
    "ultrascale export-hf --checkpoint runs/x --output /tmp/x",
])
def test_a_wrong_command_is_caught(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(AssertionError, match="was refused"):
        parse_command(command, monkeypatch)
