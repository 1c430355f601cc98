"""Run a function on N forked local ranks (gloo on CPU) and collect each rank's return value.

A public utility: notebooks and scripts use it to try collectives and parallel layouts on
one machine without torchrun; the multi-rank tests and the benchmarks are built on it.

Fork, not spawn: a launch costs ~0.1 s instead of seconds of torch re-imports. Each
rank gets the env vars of an external launcher (like torchrun), so a Lightning
Trainer inside the worker joins the job without launching processes itself.

The parent hosts the rendezvous store, as torchrun's agent does
(`TORCHELASTIC_USE_AGENT_STORE`): when rank 0 hosted it, a rank 0 that finished
first took the store down while another rank was still creating a process group
(`Connection reset by peer` in gloo's connect).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int) -> None:
    """For workers that use torch.distributed directly (no Lightning)."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)
    try:
        outcome = (True, fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        outcome = (False, traceback.format_exc())
    try:
        torch.save(outcome, os.path.join(out_dir, f"{rank}.pt.tmp"))
        os.replace(os.path.join(out_dir, f"{rank}.pt.tmp"), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = TIMEOUT_S) -> list[Any]:
    """`fn(rank, world_size, *args)` on each rank; returns results ordered by rank, raises on any failure."""
    context = mp.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            context.Process(target=_entry, args=(r, world_size, port, fn, args, out_dir)) for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        # Created after the fork so no child inherits the store's server thread; clients retry until it listens.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store
        results: dict[int, Any] = {}
        failures: list[str] = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                failures.append(f"--- rank {rank}: no result (timeout or crash, exit code {procs[rank].exitcode}) ---")
                continue
            ok, value = torch.load(path, weights_only=False)
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
    if failures:
        raise AssertionError("distributed worker failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]
