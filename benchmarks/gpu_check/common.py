"""Shared helpers for the issue-48 GPU probes (not part of the project)."""
from __future__ import annotations

import importlib
import os
import socket
import sys
import traceback
import types

import torch

DEV = torch.device(os.environ.get("DEV", "cuda" if torch.cuda.is_available() else "cpu"))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def banner(name: str) -> None:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    print(f"===== {name}: torch {torch.__version__}, device {DEV}, GPU {gpu!r}", flush=True)


def load(modname: str):
    """Import `modname` normally; if the package __init__ chain fails, import the submodule with stub parents."""
    try:
        return importlib.import_module(modname)
    except Exception:
        print(f"[load] normal import of {modname} failed:\n{traceback.format_exc()}", flush=True)
    for key in [k for k in sys.modules if k == "ultrascale" or k.startswith("ultrascale.")]:
        del sys.modules[key]
    parts = modname.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        stub = types.ModuleType(pkg)
        stub.__path__ = [os.path.join(ROOT, *parts[:i])]
        sys.modules[pkg] = stub
    print(f"[load] retrying {modname} with stub parent packages", flush=True)
    return importlib.import_module(modname)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = os.environ.get("BACKEND", "nccl" if DEV.type == "cuda" else "gloo")
        kwargs = {"device_id": torch.device("cuda", 0)} if DEV.type == "cuda" else {}
        if DEV.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1, **kwargs)
        print(f"[dist] one-rank {backend} group", flush=True)
    return init_device_mesh(DEV.type, (1,))


def rel(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(normwise relative error, max abs error / max abs ref); NaN if got has NaN."""
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return float("nan"), float("nan")
    return ((got - ref).norm() / ref.norm()).item(), ((got - ref).abs().max() / ref.abs().max()).item()


def fmt(pair) -> str:
    return f"norm {pair[0]:.2e} / max {pair[1]:.2e}"


def guarded(label: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # one failure must not stop the rest
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"RESULT {label}: EXCEPTION {type(e).__name__}: {first[:400]}", flush=True)
        traceback.print_exc(limit=4)
        if DEV.type == "cuda":
            torch.cuda.synchronize() if "CUDA error" not in str(e) else None
        return None
