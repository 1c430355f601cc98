"""Lightning callbacks: activation checkpointing, FP8 (torchao), memory, profiler capture, MFU/throughput.

Each works with any ultrascale strategy and, where it makes sense, with Lightning's own;
all are configurable from LightningCLI YAML (`trainer.callbacks: - class_path: ultrascale.callbacks.X`).
"""

from ultrascale.callbacks.activation_checkpointing import (
    ACPolicy,
    ActivationCheckpointing,
    AttentionAC,
    EveryKAC,
    FullAC,
    SelectiveAC,
)
from ultrascale.callbacks.float8 import Float8Training
from ultrascale.callbacks.memory import MemoryMonitor
from ultrascale.callbacks.mfu import MFUMonitor
from ultrascale.callbacks.profiler import ProfilerCapture
from ultrascale.callbacks.progress import StepProgressBar

__all__ = [
    "ACPolicy",
    "ActivationCheckpointing",
    "AttentionAC",
    "EveryKAC",
    "Float8Training",
    "FullAC",
    "MFUMonitor",
    "MemoryMonitor",
    "ProfilerCapture",
    "SelectiveAC",
    "StepProgressBar",
]
