"""README quick start, verbatim: `ultrascale fit --config recipes/tiny_cpu.yaml` from a checkout
trains the tiny recipe to the end and visibly lowers the loss."""

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
QUICK_START = "ultrascale fit --config recipes/tiny_cpu.yaml"


def test_readme_shows_the_command():
    assert QUICK_START in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_quick_start_verbatim(tmp_path):
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    args = QUICK_START.split()
    command = [shutil.which("ultrascale")] if shutil.which("ultrascale") else [sys.executable, "-m", "ultrascale.cli"]
    done = subprocess.run([*command, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    events = EventAccumulator(str(next((tmp_path / "runs" / "ultrascale").glob("version_*"))))
    events.Reload()
    train = [e.value for e in events.Scalars("train_loss")]
    val = [e.value for e in events.Scalars("val_loss")]
    # A model that learned nothing sits at ln(258) = 5.55 (uniform over the byte vocabulary).
    assert train[-1] < 0.5 * math.log(258) and val[-1] < 2.5
    assert train[-1] < train[0]
