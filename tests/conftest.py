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
