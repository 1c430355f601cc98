"""The rank processes: their knobs (`ProcessConfig`), their ranks, and the process group they join.

The launcher (`ultrascale.strategies.launcher`) starts the processes; here each one takes its
rank from the cluster environment and joins the world's process group.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, TypedDict

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from ultrascale.parallel.manifest import VerifyLevel
from ultrascale.parallel.rules import raise_first
from ultrascale.strategies.launcher import LauncherName, launcher_problems
from ultrascale.strategies.step import NonFinitePolicy, nonfinite_problems


class ProcessKnobs(TypedDict, total=False):
    """How the processes start and talk, what a non-finite step does and whether blocks are compiled: taken by
    every ultrascale strategy (see `UltraScaleStrategy`; checked as a `ProcessConfig` and `block_compiler`)."""

    sync_module_states: bool
    launcher: LauncherName
    process_group_backend: Optional[str]
    timeout: Optional[timedelta]
    nonfinite: NonFinitePolicy
    max_nonfinite_skips: int
    async_checkpoint: bool
    checkpoint_verify: VerifyLevel
    tune_cpu_allocator: bool
    compile: bool
    compile_backend: str


class ShardingKnobs(ProcessKnobs, total=False):
    """FSDP2 (ZeRO-3) knobs, plus the process knobs: the ZeRO-3, HSDP and TP strategies take them."""

    reshard_after_forward: bool
    meta_init: bool
    accumulate_unsharded_grads: bool


def checked_knobs(owner: str, knobs: dict[str, Any], allowed: type) -> dict[str, Any]:
    """`knobs` if each is one of the TypedDict `allowed`'s keys; TypeError naming the strangers
    (a `**knobs: Unpack[...]` signature is not enforced at run time)."""
    names = allowed.__required_keys__ | allowed.__optional_keys__  # type: ignore[attr-defined]
    unknown = sorted(set(knobs) - names)
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {unknown}; it takes {sorted(names)} besides its own")
    return knobs


@dataclass(frozen=True)
class ProcessConfig:
    """How the processes start and talk, and what a non-finite step does; valid once built (the
    messages name `owner`, the strategy class, and the knob to change)."""

    owner: str
    """The strategy class the knobs were given to, for the messages."""
    launcher: LauncherName = "auto"
    """"subprocess" re-runs the script per rank, "fork" forks this process (CPU only), "auto" picks."""
    process_group_backend: Optional[str] = None
    """"gloo" / "nccl"; None: nccl on CUDA, gloo on CPU."""
    timeout: Optional[timedelta] = default_pg_timeout
    """Collective timeout: a hang becomes an error after it."""
    nonfinite: NonFinitePolicy = "stop"
    """What a step whose loss or global gradient norm is NaN/inf does (see `UltraScaleStrategy`)."""
    max_nonfinite_skips: int = 10
    """How many steps "skip" / "rollback" may drop in a run before it stops."""
    async_checkpoint: bool = False
    """Write checkpoints saved during `fit` in a background thread."""
    tune_cpu_allocator: bool = False
    """On CPU, glibc keeps freed heap memory (`ultrascale.parallel.device.tune_cpu_allocator`), for the whole process."""

    def __post_init__(self) -> None:
        owner = self.owner
        raise_first(launcher_problems(self.launcher) + nonfinite_problems(self.nonfinite, self.max_nonfinite_skips), owner)
        if self.process_group_backend is not None and not isinstance(self.process_group_backend, str):
            raise TypeError(f"{owner}(`process_group_backend={self.process_group_backend!r}`): a backend name "
                            "('gloo', 'nccl') or None")
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(f"{owner}(`timeout={self.timeout!r}`): a datetime.timedelta or None")
        for knob in ("async_checkpoint", "tune_cpu_allocator"):
            if not isinstance(getattr(self, knob), bool):
                raise TypeError(f"{owner}(`{knob}={getattr(self, knob)!r}`): True or False")


def set_world_ranks(environment: Optional[ClusterEnvironment], *, node_rank: int, local_rank: int,
                    num_processes: int, num_nodes: int) -> None:
    """This process's global rank and the world size in `environment`, and Lightning's rank-zero
    helpers told which rank this is (as Lightning's DDP strategy does)."""
    if environment is not None:
        environment.set_global_rank(node_rank * num_processes + local_rank)
        environment.set_world_size(num_nodes * num_processes)
    # Read back, not computed: some environments' setters are no-ops (their rank comes from the scheduler).
    rank_zero_only.rank = utils_rank_zero_only.rank = environment.global_rank() if environment is not None else 0


def init_process_group(environment: ClusterEnvironment, backend: str, *, timeout: Optional[timedelta],
                       device: torch.device) -> None:
    """Join the world's process group at the address `environment` names (env:// rendezvous of torchrun,
    SLURM or Lightning's launchers); nothing if this process is in one already (an outer launcher or a
    previous fit created it)."""
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    store = None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        # torchrun keeps one agent store for all restart attempts and torch adds no per-attempt prefix
        # (torch 2.13 `_create_c10d_store`): a restarted rank that starts before its peers reads the
        # process-group keys of the killed attempt and dials dead addresses ("connectFullMesh failed ...
        # Connection refused", pytorch/pytorch#167288).
        store = dist.PrefixStore(
            f"ultrascale/attempt_{attempt}",
            dist.TCPStore(environment.main_address, environment.main_port, environment.world_size(),
                          is_master=False, timeout=timeout or default_pg_timeout),
        )
    dist.init_process_group(
        backend,
        store=store,
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        timeout=timeout,
        device_id=device if device.type != "cpu" else None,
    )
    # Destroyed before the interpreter's own teardown, whatever the backend: NCCL warns at exit about a process
    # group never destroyed, and a gloo rank of a torchrun job once aborted at exit under load ("terminate called
    # without an active exception", SIGABRT after `fit` had finished) with its group left to interpreter teardown.
    atexit.register(destroy_process_group)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
