"""Run a function on N forked local ranks (gloo on CPU) and collect each rank's return value.

A public utility: notebooks and scripts use it to try collectives and parallel layouts on
one machine without torchrun; the multi-rank tests and the benchmarks are built on it.

Fork, not spawn: a launch costs ~0.1 s instead of seconds of torch re-imports. Each
rank gets the env vars of an external launcher (like torchrun), so a Lightning
Trainer inside the worker joins the job without launching processes itself.

The parent hosts the rendezvous store, as torchrun's agent does
(`TORCHELASTIC_USE_AGENT_STORE`): when rank 0 hosted it, a rank 0 that finished
first took the store down while another rank was still creating a process group
(`Connection reset by peer` in gloo's connect). The store binds port 0 (the kernel
picks a free port and holds it from that moment) after the ranks are forked, and each
rank is then sent the port through a pipe: a port picked first and bound later was
taken in between by another job's gloo socket (EADDRINUSE in CI, with 16 ranks of a
parallel test worker opening connections).

No rank outlives the launch: when a rank fails, the others get `STOP_GRACE_S` to end
by themselves (a peer of a dead rank usually fails at once, with its own traceback),
then `end_processes` stops them (SIGTERM, SIGCONT for a stopped rank, SIGKILL after
the grace) and reaps them; the same happens when the parent itself raises (Ctrl-C, a
test timeout). A rank is also SIGKILLed by the kernel when its parent dies
(`die_with_parent`), so not even a SIGKILLed parent leaves ranks behind. The fork
launcher of the strategies uses the same two functions.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import suppress
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist

TIMEOUT_S = 600
# After a rank fails: how long the others get to end by themselves, then how long
# between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0

AnyProcess = Union[mp.process.BaseProcess, subprocess.Popen]
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """In a freshly started rank: have the kernel SIGKILL it when `parent_pid` (its launcher) dies,
    however the launcher dies (Linux only; elsewhere a no-op). SIGKILL also ends a stopped rank.

    The signal fires when the launcher's *thread* that started the rank ends; the launchers
    start ranks from the thread that then waits for them, so this is the launcher's lifetime.
    """
    if not sys.platform.startswith("linux"):
        return
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the launcher died before the prctl: nobody will end this rank
        os._exit(1)


# What an external launcher (torchrun, Lightning's launchers, `run_ranks`) sets for a rank. A process that holds
# them joins that job; one that must start a job of its own (a fresh world) drops them first.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                    "ROLE_NAME", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def without_launch_variables(environ: dict[str, str]) -> dict[str, str]:
    """`environ` less `LAUNCH_VARIABLES` and torchelastic's own (`TORCHELASTIC_*`)."""
    return {k: v for k, v in environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC")}


def one_thread_after_fork() -> None:
    """Called first in every forked child: it runs one intra-op thread, and so do the processes it starts.

    libgomp's thread pool does not survive fork. In a child of a process that has run one parallel region with two
    or more threads, the child's next parallel region with two or more threads waits forever in a GOMP barrier
    (measured with torch 2.13's CPU wheel: cos, exp, an elementwise mul, a matmul; `torch.set_num_threads(n)` in the
    child does not help for any n > 1). One thread never enters the pool. The parent has nearly always run one
    (building a model initialises its weights in parallel regions), so a forked rank cannot use more; a rank
    that needs more threads starts as a fresh process (`launcher="subprocess"`, torchrun)."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def _running(proc: AnyProcess) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    return proc.pid is not None and proc.is_alive()


def _reap(proc: AnyProcess, timeout: float | None) -> None:
    if isinstance(proc, subprocess.Popen):
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    else:
        proc.join(timeout)


def _signal(proc: AnyProcess, signum: int) -> None:
    # Only unreaped children are signalled (`_running` was true): their pid cannot have been reused.
    with suppress(ProcessLookupError):
        os.kill(proc.pid, signum)


def end_processes(procs: Iterable[AnyProcess], grace: float = STOP_GRACE_S) -> list[AnyProcess]:
    """End and reap every process of `procs` (multiprocessing processes or `subprocess.Popen`s
    started by this process) that is still running; returns those it had to end.

    SIGTERM first, with a SIGCONT so that a stopped (SIGSTOP, SIGTSTP) process runs its
    SIGTERM handling; SIGKILL for those still there after `grace` seconds (a rank blocked
    in a collective often cannot act on SIGTERM, and Lightning's SIGTERM handler does not
    exit). Every process is reaped before this returns: none is left running, stopped or
    as a zombie.
    """
    running = [proc for proc in procs if _running(proc)]
    for proc in running:
        _signal(proc, signal.SIGTERM)
        _signal(proc, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for proc in running:
        _reap(proc, max(0.0, deadline - time.monotonic()))
    for proc in running:
        if _running(proc):
            _signal(proc, signal.SIGKILL)
        _reap(proc, None)
    return running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int) -> None:
    """For workers that use torch.distributed directly (no Lightning)."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def host_rendezvous(address: str, world_size: int, timeout: float,
                    port_writers: Iterable[multiprocessing.connection.Connection]) -> dist.TCPStore:
    """In the launcher, once its ranks are forked: the rendezvous store on a port the kernel picks (and holds from
    that moment), sent to every rank through its pipe (`join_rendezvous` receives it)."""
    store = dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    for writer in port_writers:
        with suppress(OSError):  # a rank that already died: the launcher reports its failure
            writer.send(store.port)
    return store


def join_rendezvous(port_reader: multiprocessing.connection.Connection, timeout: float) -> None:
    """In a forked rank, before its process group: wait for the launcher's store (`host_rendezvous`) and point
    torch's env:// rendezvous at it as a client (`TORCHELASTIC_USE_AGENT_STORE`, as under torchrun's agent)."""
    if not port_reader.poll(timeout):
        raise TimeoutError(f"no rendezvous port from the launcher within {timeout:.0f} s")
    port = port_reader.recv()
    port_reader.close()
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")


def _entry(rank: int, world_size: int, port_reader: multiprocessing.connection.Connection, fn: Callable, args: tuple,
           out_dir: str, parent_pid: int, timeout: float) -> None:
    die_with_parent(parent_pid)
    join_rendezvous(port_reader, timeout)
    os.environ.update(MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    one_thread_after_fork()
    try:
        outcome = (True, fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        outcome = (False, traceback.format_exc())
    saved = False
    try:
        torch.save(outcome, os.path.join(out_dir, f"{rank}.pt.tmp"))
        os.replace(os.path.join(out_dir, f"{rank}.pt.tmp"), os.path.join(out_dir, f"{rank}.pt"))
        saved = True
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # A failed rank exits non-zero: the parent then ends the others instead of waiting for them.
        os._exit(0 if saved and outcome[0] else 1)


def _wait_for_ranks(procs: list[mp.process.BaseProcess], deadline: float, grace: float) -> None:
    """Until every rank has exited, or `grace` seconds after the first one failed, or `deadline`."""
    pending = {proc.sentinel: proc for proc in procs}
    failed_at: float | None = None
    while pending:
        limit = deadline if failed_at is None else min(deadline, failed_at + grace)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            return
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=remaining):
            proc = pending.pop(sentinel)  # type: ignore[call-overload]
            proc.join()
            if proc.exitcode != 0 and failed_at is None:
                failed_at = time.monotonic()


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = TIMEOUT_S, grace: float = STOP_GRACE_S
) -> list[Any]:
    """`fn(rank, world_size, *args)` on each rank; returns results ordered by rank, raises on any failure.

    Every rank has ended and been reaped when this returns or raises: `grace` seconds after the
    first rank fails (or at `timeout`, or when this process raises) the ranks still running are
    ended (`end_processes`)."""
    context = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as out_dir:
        parent_pid = os.getpid()
        pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
        procs = [
            context.Process(target=_entry, args=(r, world_size, pipes[r][0], fn, args, out_dir, parent_pid, timeout))
            for r in range(world_size)
        ]
        store = None
        try:
            for proc in procs:
                proc.start()
            for reader, _ in pipes:
                reader.close()
            # Created after the fork so no child inherits the store's server thread.
            store = host_rendezvous("127.0.0.1", world_size, timeout, (writer for _, writer in pipes))
            _wait_for_ranks(procs, time.monotonic() + timeout, grace)
        finally:
            ended = end_processes((proc for proc in procs if proc.pid is not None), grace)
            for _, writer in pipes:
                writer.close()
            del store
        results: dict[int, Any] = {}
        failures: list[str] = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pt")
            if not os.path.exists(path):
                why = "ended by run_ranks (another rank failed, or timeout)" if procs[rank] in ended else "crash"
                failures.append(f"--- rank {rank}: no result ({why}, exit code {procs[rank].exitcode}) ---")
                continue
            ok, value = torch.load(path, weights_only=False)
            if ok:
                results[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
    if failures:
        raise AssertionError("distributed worker failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]
