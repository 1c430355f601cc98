"""No launcher leaves a rank behind: when a rank fails (here: the peer of a SIGSTOPped rank
times out in a collective), when the launching process itself raises, or when it dies,
every rank it started is ended and reaped, stopped ones included.

Each rank records its pid in a file; afterwards the pid must be gone (reaped by the
launcher; a rank whose launcher died is reaped by init, so a zombie is accepted there).
Leftovers are SIGKILLed at the end of each test, so a failing test does not leak them.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

import ultrascale
from tests._parity import ParityData, TokenDataset
from ultrascale.launch import end_processes, run_ranks, without_launch_variables
from ultrascale.models.lm import LlamaLM

REPO = Path(__file__).resolve().parent.parent


class ParentError(Exception):
    """Raised in the launching process by a rank's SIGUSR1 (stands for Ctrl-C, a test timeout)."""


def _state(pid: int) -> str | None:
    """The /proc state letter of `pid` (R, S, T, Z...), None when there is no such process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except FileNotFoundError:
        return None
    return "?"


def _record_pid(pid_dir: str | Path, rank: int) -> None:
    path = Path(pid_dir) / f"{rank}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(path.with_suffix(".tmp"), path)


def _pids(pid_dir: Path) -> dict[int, int]:
    return {int(p.stem): int(p.read_text()) for p in pid_dir.glob("*.pid")}


def _wait_for_pids(pid_dir: Path, n: int, timeout: float = 60) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while len(_pids(pid_dir)) < n:
        assert time.monotonic() < deadline, f"ranks did not record their pids: {_pids(pid_dir)}"
        time.sleep(0.05)
    return _pids(pid_dir)


def _wait_until_stopped(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _state(pid) != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop (state {_state(pid)})"
        time.sleep(0.05)


def _assert_ended(pids: dict[int, int], zombie_ok: bool = False, wait: float = 0.0) -> None:
    deadline = time.monotonic() + wait
    while True:
        left = {rank: (pid, _state(pid)) for rank, pid in pids.items()}
        left = {rank: s for rank, s in left.items() if s[1] is not None and not (zombie_ok and s[1] == "Z")}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    assert not left, f"ranks left behind (rank: (pid, state)): {left}"


@pytest.fixture
def pid_dir(tmp_path):
    directory = tmp_path / "pids"
    directory.mkdir()
    yield directory
    for pid in _pids(directory).values():  # a failed test must not leak stopped ranks
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def parent_error_on_sigusr1():
    def raise_parent_error(signum, frame):
        raise ParentError("the launching process raised")

    previous = signal.signal(signal.SIGUSR1, raise_parent_error)
    yield
    signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------------------------- end_processes
def _ignore_sigterm_and_sleep() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def test_end_processes_ends_stopped_running_and_sigterm_ignoring_processes():
    fork = multiprocessing.get_context("fork")
    stopped_popen = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"])
    stopped_fork = fork.Process(target=lambda: os.kill(os.getpid(), signal.SIGSTOP))
    stubborn = fork.Process(target=_ignore_sigterm_and_sleep)
    finished = fork.Process(target=lambda: None)
    for proc in (stopped_fork, stubborn, finished):
        proc.start()
    finished.join()
    _wait_until_stopped(stopped_popen.pid)
    _wait_until_stopped(stopped_fork.pid)
    pids = {0: stopped_popen.pid, 1: stopped_fork.pid, 2: stubborn.pid}
    start = time.monotonic()
    ended = end_processes([stopped_popen, stopped_fork, stubborn, finished], grace=0.5)
    assert time.monotonic() - start < 5
    assert set(ended) == {stopped_popen, stopped_fork, stubborn}
    _assert_ended(pids)
    assert stopped_popen.returncode == -signal.SIGTERM  # SIGCONT let it act on the SIGTERM
    assert stubborn.exitcode == -signal.SIGKILL


# ------------------------------------------------------------------------------------ run_ranks
def _stop_rank_1(rank, world_size, pid_dir, pg_timeout_s, signal_parent):
    _record_pid(pid_dir, rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    dist.barrier()
    if rank == 1:
        if signal_parent:
            os.kill(os.getppid(), signal_parent)
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for the stopped rank 1
    return rank


def test_run_ranks_ends_a_stopped_rank_after_a_collective_timeout(pid_dir):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 0 ---.*Timed out.*rank 1: no result \(ended by run_ranks"):
        run_ranks(_stop_rank_1, 2, str(pid_dir), 2, None, grace=1.0)
    assert time.monotonic() - start < 30  # not the 600 s default timeout
    _assert_ended(_pids(pid_dir))
    assert len(_pids(pid_dir)) == 2


def test_run_ranks_ends_its_ranks_when_the_parent_raises(pid_dir, parent_error_on_sigusr1):
    start = time.monotonic()
    with pytest.raises(ParentError):
        run_ranks(_stop_rank_1, 2, str(pid_dir), 120, signal.SIGUSR1, grace=1.0)
    assert time.monotonic() - start < 30  # rank 0 was blocked for up to 120 s
    _assert_ended(_pids(pid_dir))
    assert len(_pids(pid_dir)) == 2


def _block(rank, world_size, pid_dir):
    _record_pid(pid_dir, rank)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)


def _kill_launcher_once_rank_1_stops(pid_dir, target, args):
    """SIGKILL a launcher process once its rank 1 has stopped itself; no rank may outlive it."""
    launcher = multiprocessing.get_context("fork").Process(target=target, args=args)
    launcher.start()
    try:
        pids = _wait_for_pids(pid_dir, 2)
        _wait_until_stopped(pids[1])
    finally:
        launcher.kill()
        launcher.join()
    _assert_ended(pids, zombie_ok=True, wait=10)  # orphans: init reaps them


def test_ranks_die_with_their_parent(pid_dir):
    """Nothing runs in a SIGKILLed launcher: the kernel kills its ranks (PR_SET_PDEATHSIG)."""
    _kill_launcher_once_rank_1_stops(pid_dir, run_ranks, (_block, 2, str(pid_dir)))


# ------------------------------------------------------------------------- the fork launcher
class _StoppingLM(LlamaLM):
    """Rank 1 stops itself (SIGSTOP) in its second training step; first it may signal the parent."""

    def __init__(self, pid_dir: str, signal_parent: int | None = None) -> None:
        super().__init__(preset="tiny", max_steps=4)
        self.pid_dir = pid_dir
        self.signal_parent = signal_parent

    def on_train_start(self) -> None:
        _record_pid(self.pid_dir, self.global_rank)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 1:
            if self.signal_parent:
                os.kill(os.getppid(), self.signal_parent)
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().training_step(batch, batch_idx)


def _fit_fork(pid_dir: Path, timeout_s: float, signal_parent: int | None = None) -> None:
    strategy = ultrascale.ZeRO3Strategy(launcher="fork", timeout=datetime.timedelta(seconds=timeout_s))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, max_steps=4,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert type(trainer.strategy.launcher).__name__ == "ForkLauncher"
    trainer.fit(_StoppingLM(str(pid_dir), signal_parent), ParityData(TokenDataset(48, 16, 512), 8))


@pytest.mark.slow
def test_fork_launcher_ends_a_stopped_rank_after_a_collective_timeout(pid_dir):
    start = time.monotonic()
    with pytest.raises(Exception, match="Timed out"):
        _fit_fork(pid_dir, timeout_s=5)
    # Lightning's launcher waited 30 s after the failure before the SIGKILL a stopped rank needs.
    assert time.monotonic() - start < 30
    assert len(_pids(pid_dir)) == 2
    _assert_ended(_pids(pid_dir))
    assert not dist.is_initialized()


def test_fork_launcher_ends_its_ranks_when_the_parent_raises(pid_dir, parent_error_on_sigusr1):
    """Lightning ends the ranks of a fork launcher on no error of the parent (on Ctrl-C it exits
    and then waits forever for the stopped rank, at interpreter exit)."""
    start = time.monotonic()
    with pytest.raises(ParentError):
        _fit_fork(pid_dir, timeout_s=120, signal_parent=signal.SIGUSR1)
    assert time.monotonic() - start < 30  # rank 0 was blocked for up to 120 s
    assert len(_pids(pid_dir)) == 2
    _assert_ended(_pids(pid_dir))


def test_fork_launcher_ranks_die_with_their_parent(pid_dir):
    _kill_launcher_once_rank_1_stops(pid_dir, _fit_fork, (pid_dir, 120))


# -------------------------------------------------------------------- the subprocess launcher
def _run_script(tmp_path: Path, source: str, pid_dir: Path, timeout: float) -> tuple[int, str]:
    """Run `source` as a script (its ranks re-run it); output to a file, not a pipe that a
    leftover rank would hold open."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    log = tmp_path / "script.log"
    env = without_launch_variables(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.pop("PYTEST_CURRENT_TEST", None)
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(script), str(pid_dir)], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=tmp_path, timeout=timeout)
    return proc.returncode, log.read_text()


@pytest.mark.slow
def test_subprocess_launcher_ends_a_stopped_child_when_rank_0_raises(tmp_path, pid_dir):
    """Rank 0 (the script's own process) raises while its child rank is stopped. Lightning ends the
    children only when a child fails; here they must be ended too, and Lightning's child
    observer must not then SIGKILL rank 0 before its error is reported (it checks every 5 s)."""
    code, log = _run_script(tmp_path, """
        import os, signal, sys, time
        pid_dir = sys.argv[1]
        if os.environ.get("LOCAL_RANK", "0") != "0":  # a child rank: stop at once
            open(os.path.join(pid_dir, os.environ["LOCAL_RANK"] + ".pid"), "w").write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            sys.exit(0)

        import lightning as L
        import ultrascale

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ultrascale.ZeRO3Strategy(launcher="subprocess"),
                            logger=False)
        launcher = trainer.strategy.launcher
        assert type(launcher).__name__ == "SubprocessScriptLauncher", type(launcher)

        def rank_0():
            path = os.path.join(pid_dir, "1.pid")
            while not os.path.exists(path) or " T " not in open("/proc/%s/stat" % open(path).read()).read():
                time.sleep(0.05)
            raise RuntimeError("rank 0 failed")

        try:
            launcher.launch(rank_0)
        except RuntimeError:
            print("children", [(p.pid, p.returncode) for p in launcher.procs], flush=True)
            time.sleep(6)  # Lightning's child observer wakes every 5 s
            print("rank 0 survived", flush=True)
            raise
    """, pid_dir, timeout=120)
    assert code == 1 and "RuntimeError: rank 0 failed" in log, log
    assert "rank 0 survived" in log, log  # not SIGKILLed by the observer
    assert len(_pids(pid_dir)) == 1
    _assert_ended(_pids(pid_dir))


@pytest.mark.slow
def test_subprocess_launcher_ends_a_stopped_rank_after_a_collective_timeout(tmp_path, pid_dir):
    """The whole scenario through a script: rank 1 stops in a training step, rank 0's collective times out.
    (~45 s: each rank imports Lightning, 10-15 s on 2 cores, inside the 25 s rendezvous timeout.)"""
    code, log = _run_script(tmp_path, """
        import datetime, os, signal, sys
        import lightning as L
        import torch
        import ultrascale
        from tests._parity import ParityData, TokenDataset
        from tests.test_launcher_cleanup import _StoppingLM

        torch.set_num_threads(1)
        strategy = ultrascale.ZeRO3Strategy(launcher="subprocess", timeout=datetime.timedelta(seconds=25))
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, max_steps=4,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(_StoppingLM(sys.argv[1]), ParityData(TokenDataset(48, 16, 512), 8))
    """, pid_dir, timeout=240)
    assert code == 1 and "Timed out" in log, log
    assert len(_pids(pid_dir)) == 2
    _assert_ended(_pids(pid_dir))
