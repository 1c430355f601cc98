import os
import warnings

import pytest
import torch

# Each rank of a multi-process test uses one thread; the parent too (2 cores in CI).
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _launch_environment_restored():
    """A fit run in the test process (devices=1: Lightning's launcher starts no child) leaves Lightning's launch
    variables (LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...) in os.environ; a later test in the same process (a
    pytest-xdist worker runs many) would then join a world that does not exist. Each test starts from the
    environment the one before it found."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
