"""Device-dependent choices (ultrascale.parallel.device)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from ultrascale.parallel.device import process_group_backend

_FAULTS = """
import resource, sys, torch
from ultrascale.parallel.device import tune_cpu_allocator
if sys.argv[1] == "tuned":
    assert tune_cpu_allocator()
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's activations: many blocks allocated, then all freed
    blocks = [torch.ones(2**16) for _ in range(64)]
    del blocks
step()
start = faults()
for _ in range(10):
    step()
print(faults() - start)
"""


def test_backend_follows_the_device():
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc's")
def test_tuned_allocator_stops_refaulting_freed_memory_every_step():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    default, tuned = faults("default"), faults("tuned")
    # 10 steps x 16 MiB of 4 KiB pages: ~40k faults when glibc trims the heap after each step.
    assert default > 10_000 and tuned < default / 50, (default, tuned)
