"""`torch.compile` per transformer block, and the counts that show whether it keeps compiling.

Each block's forward is compiled in place, after TP/SP, expert dispatch, the
context-parallel hooks, activation checkpointing and FP8 have rewritten it, and before FSDP / ZeRO
shard it: torchtitan's order. One block is one region: the blocks of a model share their code,
so dynamo compiles the first and reuses its graph for the others (their parameters are graph
inputs, not constants); a whole-model compile would instead unroll every layer into one graph.

Where activation checkpointing wrapped a whole block (`mode="full"`), the block inside the wrapper is
what is compiled and the checkpoint stays eager around it: FSDP's hooks sit on that block, and dynamo
cannot break the graph at them inside a checkpoint region (it would give up on the whole region and run
it eagerly). The recomputation then reruns the compiled forward. Selective checkpoints are regions inside
the block and compile with it.

Shapes: `dynamic=None` (torch's default) compiles the first shape statically and, when a second
length arrives, recompiles once with that dimension dynamic. Variable-length SFT batches and
packed documents thus cost two compilations per block code, not one per length. A layout that
keeps recompiling stops at torch's `recompile_limit` with an error (`fail_on_recompile_limit_hit`),
never by silently running the block eagerly; `CompileStats` counts the compilations per step so
the strategy can log them and warn well before that.

The compile cache lives where inductor puts it (`TORCHINDUCTOR_CACHE_DIR`, by default
`/tmp/torchinductor_<user>`). A rerun of the same layout may find its graphs there; under tensor parallel
the processes miss it in torch 2.13 and compile again (docs/troubleshooting.md, "Compiled blocks").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ultrascale.parallel.rules import SPLIT_BACKWARD_SCHEDULES

__all__ = ["COMPILED_ATTRIBUTE", "COMPILE_BACKENDS", "BlockCompiler", "CompileStats", "block_compiler"]

COMPILED_ATTRIBUTE = "ultrascale_compiled"
"""Set on each block whose forward `BlockCompiler` compiled; it stays after the fit (which of the model's modules
are its compiled blocks, for the next fit to compile again), while the compiled forward itself goes."""

COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
"""`inductor` generates fused kernels (C++ on CPU, Triton on CUDA); `aot_eager` traces forward and backward
with AOTAutograd and runs them with eager kernels (no codegen: a check of the capture, not a speed-up);
`eager` only runs dynamo's bytecode capture."""


@dataclass
class CompileStats:
    """Compilations per optimizer step, from dynamo's process-wide counters (graphs captured, compile seconds)."""

    warn_after: int = 8
    """Graphs compiled after the first step beyond which the layout is said to keep recompiling."""
    steps: int = 0
    first_step_graphs: int = 0
    first_step_seconds: float = 0.0
    later_graphs: int = 0
    _seen: tuple[int, float] = (0, 0.0)

    @staticmethod
    def _counters() -> tuple[int, float]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        # Dynamo's capture with AOTAutograd and the forward's codegen, then inductor's backward codegen, which
        # runs lazily in the first backward (before the step's end, where `step()` is called).
        seconds = sum(sum(compilation_time_metrics.get(name, ())) for name in ("_compile.compile_inner",
                                                                             "compile_fx.<locals>.bw_compiler"))
        return counters["stats"]["unique_graphs"], seconds

    def start(self) -> None:
        self._seen = self._counters()

    def step(self) -> tuple[int, float]:
        """(graphs compiled, seconds spent compiling) since the previous call; the first call is the first step."""
        graphs, seconds = self._counters()
        new = (graphs - self._seen[0], seconds - self._seen[1])
        self._seen = (graphs, seconds)
        if self.steps == 0:
            self.first_step_graphs, self.first_step_seconds = new
        else:
            self.later_graphs += new[0]
        self.steps += 1
        return new

    @property
    def keeps_recompiling(self) -> bool:
        return self.later_graphs > self.warn_after


@dataclass
class BlockCompiler:
    """The model transform that compiles each block (the `ModelTransform` protocol of `parallelize`).

    `backend`: one of `COMPILE_BACKENDS`. `fullgraph=False` lets the few operations dynamo cannot trace
    (a process group's point-to-point calls, a host sync) break the graph where they are instead of failing.
    """

    backend: str = "inductor"
    fullgraph: bool = False
    split_backward: bool = False
    """A zero-bubble pipeline schedule runs each backward in two passes over a kept graph: AOTAutograd must then not
    donate (reuse in place) the saved buffers of the compiled backward."""
    micro_pipeline_tp: bool = False
    """Async tensor parallel: inductor's micro-pipeline pass, per compiled block (an inductor option of these compiles
    only, not torch's process-wide config), splits each sequence-parallel all-gather before a matmul and each
    reduce-scatter after one into chunks the matmul overlaps (torch's symmetric-memory fused kernels)."""
    stats: CompileStats = field(default_factory=lambda: CompileStats())
    _settings: Optional[contextlib.ExitStack] = field(default=None, repr=False)
    _compiled: list[nn.Module] = field(default_factory=list, repr=False)

    def transform_model(self, module: nn.Module, blocks: Sequence[nn.Module]) -> None:
        if not blocks:
            raise ValueError(
                f"compile=True compiles each transformer block, but no blocks were found in {type(module).__name__}: "
                "give the module a `blocks` list (or an `nn.ModuleList` of layers) or leave compile off")
        if self._settings is None:  # process-wide: held until `restore()` (the strategy's teardown, also after an error)
            self._settings = contextlib.ExitStack()
            # A recompile past torch's limit must fail, not fall back to eager without a word.
            self._settings.enter_context(torch._dynamo.config.patch(fail_on_recompile_limit_hit=True))
            if self.split_backward:
                self._settings.enter_context(torch._functorch.config.patch(donated_buffer=False))
        for block in blocks:
            if getattr(vars(block).get("forward"), COMPILED_ATTRIBUTE, False):  # applying twice is a no-op
                continue
            # The block's `forward`, not its whole call (`nn.Module.compile` compiles `_call_impl`): dynamo skips a
            # top frame in torch.nn's own files, so `_call_impl` compiled nothing for a block that is a torch.nn
            # class (`nn.TransformerEncoderLayer`), and the hooks FSDP adds later (its all-gathers) stay eager
            # around the compiled forward instead of breaking the graph inside it.
            options = {"_micro_pipeline_tp": True} if self.micro_pipeline_tp else None
            block.forward = _waited_inputs(torch.compile(block.forward, backend=self.backend, fullgraph=self.fullgraph,
                                                         options=options))
            setattr(block, COMPILED_ATTRIBUTE, True)
            self._compiled.append(block)

    def compile_again(self, module: nn.Module) -> None:
        """A model this (or another) strategy compiled in an earlier fit, already parallelised: its blocks (marked
        `COMPILED_ATTRIBUTE`) compiled again, with this compiler's settings."""
        self.transform_model(module, [m for m in module.modules() if getattr(m, COMPILED_ATTRIBUTE, False)])

    def restore(self) -> None:
        """Torch's compile settings back as they were before `transform_model`, and each block's own `forward`."""
        if self._settings is not None:
            self._settings.close()
            self._settings = None
        for block in self._compiled:
            if getattr(vars(block).get("forward"), COMPILED_ATTRIBUTE, False):
                del block.forward
        self._compiled = []


def _wait(value: object) -> object:
    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value


def _waited_inputs(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Under tensor parallel the first block's input is the embedding's output as DTensor left it: an
    `AsyncCollectiveTensor` (a collective's result, waited for on first use). Traced as a graph input, its
    gradient skips DTensor's redistribute backward in torch 2.13: the embedding's gradient came out wrong, or
    the backward failed ("'Tensor' object has no attribute '_local_tensor'"). An eager clone waits for it and
    hands the compiled block a plain tensor whose backward goes through DTensor as in eager (one copy, first
    block only)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return compiled(*map(_wait, args), **{name: _wait(value) for name, value in kwargs.items()})

    setattr(call, COMPILED_ATTRIBUTE, True)  # the block's forward is this compiled one (`BlockCompiler.restore`)
    return call


def block_compiler(compile: bool, backend: str, owner: str, *, pipeline: tuple[int, str] = (1, "1F1B"),
                   async_tensor_parallel: bool = False) -> Optional[BlockCompiler]:
    """The strategy's `compile` / `compile_backend` / `async_tensor_parallel` knobs: the transform to run, or None
    when compile is off. `pipeline`: (pipeline_parallel, pipeline_schedule)."""
    if async_tensor_parallel and not (compile and backend == "inductor"):
        raise ValueError(f"{owner}: `async_tensor_parallel=True` is a pass of inductor's over the compiled blocks: "
                         "set `compile=True` with `compile_backend='inductor'`")
    if not compile:
        if backend != "inductor":
            raise ValueError(f"{owner}: `compile_backend={backend!r}` needs `compile=True`")
        return None
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"{owner}: `compile_backend={backend!r}` is not one of {', '.join(COMPILE_BACKENDS)}")
    return BlockCompiler(backend, split_backward=pipeline[0] > 1 and pipeline[1] in SPLIT_BACKWARD_SCHEDULES,
                         micro_pipeline_tp=async_tensor_parallel)
