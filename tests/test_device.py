"""Device-dependent choices (ultrascale.parallel.device)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import resource

import pytest
import torch

from ultrascale.parallel.device import process_group_backend


def _refaults_per_ten_steps(tuned: bool) -> int:
    """Minor page faults of 10 steps that each write 64 blocks of 256 KiB (a step's activations), then free them all,
    after one such step. Counted in a forked child: mallopt's settings are the process's own, so the test's process
    keeps its allocator, and a fork costs no fresh interpreter (a subprocess here imported ultrascale: ~30 s)."""
    from ultrascale.parallel.device import tune_cpu_allocator

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: count, write the count, exit without running the parent's cleanup
        status = 1
        try:
            os.close(read)
            if tuned:
                assert tune_cpu_allocator()
            else:  # control: glibc gives every freed heap top back at once
                assert tune_cpu_allocator(trim_threshold=0, mmap_threshold=2**20)
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            libc.malloc.restype = ctypes.c_void_p
            libc.free.argtypes = [ctypes.c_void_p]

            def step() -> None:
                blocks = [libc.malloc(2**18) for _ in range(64)]
                for block in blocks:
                    ctypes.memset(block, 1, 2**18)
                for block in reversed(blocks):
                    libc.free(block)

            step()
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(10):
                step()
            os.write(write, str(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        count = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and count, f"the counting child failed (wait status {status})"
    return int(count)


def test_backend_follows_the_device():
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc's")
def test_tuned_allocator_stops_refaulting_freed_memory_every_step():
    trimming, tuned = _refaults_per_ten_steps(tuned=False), _refaults_per_ten_steps(tuned=True)
    # 10 steps x 16 MiB of 4 KiB pages = 40,960 pages touched. Trimming refaults nearly all of them
    # (the control shows the count sees refaults); the tuned allocator reuses the kept pages.
    assert trimming > 30_000 and tuned < 1_000, (trimming, tuned)
