"""Issue 48 item 1: MFUMonitor's peak lookup at 32-true and for this GPU's name."""
import os
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from common import DEV, banner, guarded, load  # noqa: E402

banner("item 1 MFUMonitor peak")
hardware = load("ultrascale.hardware")
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print(f"device name {name!r}; torch.backends.cuda.matmul.allow_tf32 = {torch.backends.cuda.matmul.allow_tf32}; "
      f"float32_matmul_precision = {torch.get_float32_matmul_precision()!r}")
for dev_name in (name, "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H800", "NVIDIA L40S", "NVIDIA H200 NVL"):
    found = {dt: hardware.find_peak_tflops(dev_name, dt) for dt in ("bf16", "fp16", "fp8", "tf32", "fp32")}
    print(f"find_peak_tflops({dev_name!r}) -> {found}")

mfu = load("ultrascale.callbacks.mfu")


def resolve(precision: str, **kw):
    monitor = mfu.MFUMonitor(**kw)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device(DEV.type, 0) if DEV.type == "cuda" else DEV),
                                    precision=precision, callbacks=[])
    monitor._resolve_peak(trainer)
    return monitor.peak, monitor.peak_source


for precision in ("32-true", "bf16-mixed", "16-mixed"):
    for kw in ({}, {"mfu": None}):
        r = guarded(f"item1 resolve_peak({precision}, {kw})", resolve, precision, **kw)
        if r is not None:
            print(f"RESULT item1 resolve_peak({precision}, {kw}) -> peak {r[0]} ({r[1]})")

if DEV.type == "cuda" and os.environ.get("SKIP_FIT") != "1":
    test_gpu = load("tests.test_gpu")
    from ultrascale.callbacks import MFUMonitor

    for precision, kw in (("32-true", {}), ("32-true", {"mfu": None}), ("bf16-mixed", {})):
        with tempfile.TemporaryDirectory() as tmp:
            monitor = MFUMonitor(**kw)
            losses = guarded(f"item1 fit {precision} MFUMonitor({kw})", test_gpu._tiny_fit, Path(tmp), [monitor], precision)
            if losses is not None:
                print(f"RESULT item1 fit {precision} MFUMonitor({kw}): ran, losses {[round(x, 4) for x in losses]}, "
                      f"peak {monitor.peak} ({monitor.peak_source}), mfu_active {monitor._mfu_active}")
