"""A mistake in the fine-tuning data is one line from the command, exit 2, nothing written (issue 78).

Each error class of the data readers through `ultrascale fit --config recipes/hf_finetune.yaml` as a subprocess, on
1 and 2 ranks (the script launcher, as a user's command runs): exit 2, `ultrascale fit: error: FILE:LINE: ...`
naming the field, no traceback, no `[rank` line, and the folder the command ran in left empty (no run folder, no
checkpoint, no cache). What only a full read finds (a bad line after the first thousand records) is found by the
ranks and reported the same way; a fault only one child rank finds ends rank 0, which waits in a collective, within
seconds. The Python API raises `DataError` with the same message; `verify`, `tune` and `prepare-data` say it in one
line too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ultrascale.data import DataError, InstructionDataModule

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "hf_finetune.yaml"
GOOD = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(3)]
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def _jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines))
    return path


def _empty_folder(path: Path) -> Path:
    path.mkdir()
    return path


# name: (write the data under a folder, what the one line says of it)
CASES: dict[str, tuple[Callable[[Path], Path], Callable[[Path], str]]] = {
    "missing path": (lambda d: d / "trian.jsonl", lambda p: f"`data_path='{p}'` does not exist"),
    "nothing readable": (lambda d: _empty_folder(d / "data"), lambda p: f"`data_path='{p}'` is a folder with no *.jsonl"),
    "not JSON": (lambda d: _jsonl(d / "t.jsonl", [*GOOD, b'{"prompt": "q", "response": \n']),
                 lambda p: f"{p}:4: not valid JSON (Expecting value, column 29)"),
    "not UTF-8": (lambda d: _jsonl(d / "t.jsonl", [*GOOD, b'{"prompt": "caf\xe9", "response": "x"}\n']),
                  lambda p: f"{p}:4: byte 16 of the line is not UTF-8"),
    "missing field": (lambda d: _jsonl(d / "t.jsonl", [*GOOD, {"prompt": "q", "answer": "a"}]),
                      lambda p: f"{p}:4: field `response` is missing; fields present: ['answer', 'prompt']"),
    "wrong type": (lambda d: _jsonl(d / "t.jsonl", [*GOOD, {"prompt": "q", "response": 3}]),
                   lambda p: f"{p}:4: field `response` must be a string, got int"),
    "no token to learn": (lambda d: _jsonl(d / "t.jsonl", [{"prompt": "word " * 400, "response": "a"}] * 4),
                          lambda p: f"`data_path='{p}'` has 4 examples but none with a token to learn"),
    "conversation": (lambda d: _jsonl(d / "t.jsonl", [{"messages": TURNS}] * 3 + [{"messages": [{"role": "robot",
                                                                                             "content": "a"}]}]),
                     lambda p: f"{p}:4: field `messages[0]`.role is 'robot'; known roles: system, user, assistant"),
}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A tiny Llama checkpoint with its tokenizer (a real HF folder)."""
    from transformers import AutoTokenizer

    from tests._parity import make_hf_checkpoint
    from tests.test_chat_data import save_chat_tokenizer

    root = tmp_path_factory.mktemp("base")
    tokenizer = save_chat_tokenizer(root, None, "<|im_end|>")
    make_hf_checkpoint(root, "llama", vocab_size=len(AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)),
                       hidden_size=32)
    return str(root)


def _command() -> list[str]:
    exe = shutil.which("ultrascale")
    return [exe] if exe else [sys.executable, "-m", "ultrascale.cli"]


def _fit(base: str, data: Path, ranks: int, cwd: Path, *more: str) -> subprocess.CompletedProcess:
    """`ultrascale fit --config recipes/hf_finetune.yaml` as a user runs it, from the empty folder `cwd`."""
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("ULTRASCALE_DEBUG", None)
    return subprocess.run([*_command(), "fit", "--config", str(RECIPE), "--model.pretrained_path", base,
                           "--data.data_path", str(data), "--data.init_args.seq_len", "64", "--trainer.devices",
                           str(ranks), "--trainer.max_steps", "2", *more],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _assert_one_line(done: subprocess.CompletedProcess, expected: str, cwd: Path, command: str = "ultrascale fit") -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{command}: error:")]
    assert len(errors) == 1 and expected in errors[0], output[-4000:]
    assert "Traceback" not in output and "[rank" not in output, output[-4000:]
    assert list(cwd.iterdir()) == [], f"left behind: {sorted(p.name for p in cwd.rglob('*'))}"


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_a_data_mistake_is_one_line_exit_2_and_nothing_written(base_model, tmp_path, case, ranks) -> None:
    write, expected = CASES[case]
    data = write(tmp_path)
    done = _fit(base_model, data, ranks, tmp_path / "run")
    _assert_one_line(done, expected(data), tmp_path / "run")


@pytest.mark.slow
def test_a_bad_line_after_the_first_thousand_records_is_found_by_the_ranks(base_model, tmp_path) -> None:
    """The launching process checks the first 1,000 records; line 1,101 is found by the ranks in `setup`, and the
    command says it once (rank 0's, or the child's when it is first)."""
    records = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(1200)]
    records[1100] = {"prompt": "q", "answer": "a"}
    data = _jsonl(tmp_path / "deep.jsonl", records)
    done = _fit(base_model, data, 2, tmp_path / "run")
    _assert_one_line(done, f"{data}:1101: field `response` is missing", tmp_path / "run")


class OneRanksFileIsBad(InstructionDataModule):
    """Rank `bad_rank` reads `bad_path` instead of `data_path` and notes in `stamp` when it raised: a fault that
    only one child rank finds while rank 0 goes on into the first collective."""

    def __init__(self, *args: Any, bad_path: str = "", bad_rank: int = 1, stamp: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bad_path, self.bad_rank, self.stamp = bad_path, bad_rank, stamp

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None and self.trainer.global_rank == self.bad_rank:
            self.data_path = self.bad_path
            try:
                super().setup(stage)
            except DataError:
                Path(self.stamp).write_text(repr(time.time()))
                raise
        else:
            super().setup(stage)


@pytest.mark.slow
def test_a_child_ranks_data_error_ends_rank_0_within_seconds(base_model, tmp_path) -> None:
    records = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(1200)]
    good = _jsonl(tmp_path / "good.jsonl", records)
    records[1100] = {"prompt": "q", "answer": "a"}
    bad = _jsonl(tmp_path / "bad.jsonl", records)
    stamp = tmp_path / "raised-at"
    done = _fit(base_model, good, 2, tmp_path / "run", "--data.class_path", f"{__name__}.OneRanksFileIsBad",
                "--data.init_args.bad_path", str(bad), "--data.init_args.stamp", str(stamp))
    ended = time.time()
    _assert_one_line(done, f"{bad}:1101: field `response` is missing", tmp_path / "run")
    # Rank 0 waits in a collective for rank 1: without the observer it would wait for the collective's timeout.
    assert ended - float(stamp.read_text()) < 8, "rank 0 outlived its child's data error by more than a few seconds"


# --------------------------------------------------------------------------- the Python API and the other commands

def _module(base: str) -> Any:
    from ultrascale.models.hf import HFCausalLM

    return HFCausalLM(pretrained_path=base)


def _fork_trainer(tmp_path: Path, devices: int) -> Any:
    import lightning.pytorch as pl

    from ultrascale import ZeRO3Strategy

    return pl.Trainer(accelerator="cpu", devices=devices, strategy=ZeRO3Strategy(launcher="fork"), max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=str(tmp_path))


@pytest.mark.parametrize("devices", [1, 2])
def test_the_python_api_raises_data_error_with_the_message(base_model, tmp_path, devices) -> None:
    """`Trainer.fit(model, datamodule)`: a mistake in the first records before any rank starts, one deep in the file
    from a rank (forked: the parent raises the rank's exception)."""
    early = _jsonl(tmp_path / "early.jsonl", [*GOOD, {"prompt": "q", "answer": "a"}])
    with pytest.raises(DataError, match=f"{early}:4: field `response` is missing"):
        _fork_trainer(tmp_path, devices).fit(_module(base_model), datamodule=InstructionDataModule(
            data_path=str(early), seq_len=64, global_batch_size=2))
    records = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(1200)]
    records[1100] = {"prompt": "q", "response": 7}
    deep = _jsonl(tmp_path / "deep.jsonl", records)
    with pytest.raises(DataError, match=f"{deep}:1101: field `response` must be a string"):
        _fork_trainer(tmp_path, devices).fit(_module(base_model), datamodule=InstructionDataModule(
            data_path=str(deep), seq_len=64, global_batch_size=2))


def test_verify_tune_and_prepare_data_say_it_in_one_line(base_model, tmp_path, capfd, monkeypatch) -> None:
    from tests._cli import run_main

    data = _jsonl(tmp_path / "t.jsonl", [*GOOD, {"prompt": "q", "answer": "a"}])
    expected = f"{data}:4: field `response` is missing"
    monkeypatch.chdir(tmp_path)
    recipe = ["--config", str(RECIPE), "--model.pretrained_path", base_model, "--data.data_path", str(data)]
    for command in (["verify", *recipe, "--steps", "1"], ["tune", *recipe, "--top", "1", "--steps", "2", "--warmup", "1"]):
        code, out, err = run_main(capfd, *command)
        assert code == 2, (out + err)[-3000:]
        assert f"ultrascale {command[0]}: error: {expected}" in err and "Traceback" not in err, (out + err)[-3000:]
    texts = _jsonl(tmp_path / "texts.jsonl", [{"text": "a"}] * 3 + [{"txt": "b"}])
    code, out, err = run_main(capfd, "prepare-data", str(texts), "--tokenizer", base_model, "--out",
                              str(tmp_path / "prepared"), "--no-progress")
    assert code == 2 and "Traceback" not in err, (out + err)[-3000:]
    assert f"ultrascale prepare-data: error: {texts}:4: field `text` is missing; fields present: ['txt']" in err, err
    assert not (tmp_path / "prepared").exists()
