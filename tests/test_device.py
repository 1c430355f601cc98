"""Device-dependent choices (ultrascale.parallel.device)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from ultrascale.parallel.device import process_group_backend

_FAULTS = """
import ctypes, ctypes.util, resource, sys
from ultrascale.parallel.device import tune_cpu_allocator
if sys.argv[1] == "tuned":
    assert tune_cpu_allocator()
else:  # control: glibc gives every freed heap top back at once
    assert tune_cpu_allocator(trim_threshold=0, mmap_threshold=2**20)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's activations: 64 blocks of 256 KiB written, then all freed
    blocks = [libc.malloc(2**18) for _ in range(64)]
    for block in blocks:
        ctypes.memset(block, 1, 2**18)
    for block in reversed(blocks):
        libc.free(block)
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

    trimming, tuned = faults("trimming"), faults("tuned")
    # 10 steps x 16 MiB of 4 KiB pages = 40,960 pages touched. Trimming refaults nearly all of them
    # (the control shows the count sees refaults); the tuned allocator reuses the kept pages.
    assert trimming > 30_000 and tuned < 1_000, (trimming, tuned)
