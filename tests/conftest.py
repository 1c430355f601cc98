import os
import warnings

import pytest
import torch

# Each rank of a multi-process test uses one thread; the parent too (2 cores in CI).
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


SUITE_PACKAGES = ("torch", "lightning", "transformers", "accelerate", "datasets", "safetensors", "torchao", "peft",
                  "pytest", "pytest-timeout", "pytest-xdist", "ruff")
"""What the suite's behaviour depends on: their versions head every run's log (CI's too), so a failure on a fresh
machine can be told from one on an older install."""


def pytest_sessionstart(session):
    """The versions, printed once by the process that reports (not by each pytest-xdist worker), also under -q."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        reporter.write_line(suite_versions())


def suite_versions() -> str:
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return "versions: " + ", ".join(f"{name} {version(name)}" for name in SUITE_PACKAGES)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _launch_environment_restored():
    """A fit run in the test process (devices=1: Lightning's launcher starts no child) leaves Lightning's launch
    variables (LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...) in os.environ; a later test in the same process (a
    pytest-xdist worker runs many) would then join a world that does not exist. Each test starts from the
    environment the one before it found."""
    before, threads = dict(os.environ), torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(before)
    torch.set_num_threads(threads)  # Lightning's launchers set it in this process too (one device: no child)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves a process group in this worker (a one-device fit in the test's process creates a one-rank
    group and keeps it) breaks every later test whose ranks fork from the worker: they inherit an initialized default
    group of the wrong world. It is destroyed here, and the test that left it fails, naming it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        dist.destroy_process_group()
        pytest.fail(f"this test left a process group (world {world}) in the pytest worker; run a one-device fit in a "
                    "subprocess or fork its ranks")


@pytest.fixture
def two_thread_region_ran():
    """This process has run a parallel region with two threads, as a user's process has before it forks ranks (and
    as this one has after a test whose one-device fit let Lightning set cores/ranks threads): libgomp's pool then
    does not survive fork (`ultrascale.launch.one_thread_after_fork`)."""
    torch.set_num_threads(2)
    torch.cos(torch.randn(1_000_000)).sum()
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked slow first (stable otherwise): pytest-xdist hands tests out in this order, and a long test
    handed out last keeps one worker busy while the other has nothing left (longest first packs two workers best)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
