"""Resume: a sharded checkpoint's model and optimizer states loaded into this run's layout.

A checkpoint resumes under any world size, ZeRO family, TP / CP layout or pipeline degree:

- DCP reshards every tensor by its fully qualified name (names never change with the layout);
- the optimizer state is saved in one of two layouts, read in the layout it was *saved* in (known
  from the checkpoint's DCP metadata) and converted: "param" (ZeRO-3 / FSDP: parameter-shaped
  DTensors) or "flat" (ZeRO-1/2: flattened per-parameter 1-D DTensors, and fp32 masters under
  bf16-mixed);
- param groups are saved as a list: under pipeline parallel every stage writes the same entries
  with its own parameter names and DCP keeps one stage's, so the names come from this rank's
  optimizer (the hyperparameters agree between stages: one `configure_optimizers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from ultrascale.parallel.checkpoint import load_sharded_checkpoint
from ultrascale.parallel.zero import ZeroEngine, engine_for
from ultrascale.parallel.zero_layouts import flat_state_template, param_shaped_from_flat, relayout_like, saved_optimizer_layout


def load_training_state(
    path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool = True, zero_stage: int = 3,
    engines: Sequence[ZeroEngine] = (),
) -> dict[str, Any]:
    """Load the checkpoint at `path` into `model` and `optimizers` (ZeRO-1/2 ones through their
    `ZeroEngine`, one of `engines`); returns the checkpoint's non-tensor metadata. Every rank calls it.
    `zero_stage` only names this run's family in errors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    unowned = _unowned_optimizer_problem(model, optimizers, engines)
    if unowned is not None:
        raise ValueError(f"cannot resume {path}: {unowned}")
    tensors, layouts, currents = _read_targets(path, model, optimizers, zero_stage, engines)
    metadata = load_sharded_checkpoint(path, tensors)
    saved_optimizers = metadata.get("ultrascale", {}).get("num_optimizers", len(optimizers))
    if optimizers and saved_optimizers != len(optimizers):
        raise ValueError(f"checkpoint {path} holds {saved_optimizers} optimizer(s), the model configures {len(optimizers)}")
    options = StateDictOptions(strict=strict)
    optimizer_states = _convert_loaded(tensors, model, optimizers, layouts, currents, engines)
    set_model_state_dict(model, tensors["state_dict"], options=options)
    for i, optimizer in enumerate(optimizers):
        engine = engine_for(optimizer, engines)
        if engine is None:
            set_optimizer_state_dict(model, optimizer, optimizer_states[i], options=options)
        elif layouts[i] == "param":
            engine.load_param_shaped_state_dict(tensors[f"optimizer_{i}"], weights=tensors["state_dict"])
        else:
            engine.load_sharded_state_dict(tensors[f"optimizer_{i}"])
    return metadata


def _unowned_optimizer_problem(model: nn.Module, optimizers: list[torch.optim.Optimizer],
                               engines: Sequence[ZeroEngine]) -> Optional[str]:
    """An optimizer that steps tensors which are not the model's parameters and that no engine owns (a ZeRO-1/2
    optimizer steps its engine's flat master slices): its state has no names to load by. Asked before any read."""
    own = {id(p) for p in model.parameters()}
    for i, optimizer in enumerate(optimizers):
        if engine_for(optimizer, engines) is not None:
            continue
        foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
        if foreign:
            return (f"optimizer {i} ({type(optimizer).__name__}) steps {foreign} tensor(s) that are not parameters of the "
                    "model. A ZeRO-1/2 optimizer steps its engine's flat master slices: pass the engine "
                    "(`load_training_state(..., engines=[engine])`); otherwise give the optimizer the model's parameters")
    return None


def _read_targets(
    path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], zero_stage: int, engines: Sequence[ZeroEngine]
) -> tuple[dict[str, Any], list[Optional[str]], list[Any]]:
    """What DCP reads the checkpoint into, per optimizer in the layout it was saved in; also each
    optimizer's saved layout and, for FSDP optimizers, their current (parameter-shaped) state dict."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from ultrascale.parallel.safe_load import UnsafeCheckpointError, read_dcp_metadata

    try:
        saved = read_dcp_metadata(path).state_dict_metadata
    except UnsafeCheckpointError:
        raise
    except Exception as error:
        raise RuntimeError(f"could not read the sharded checkpoint at {path}: {error}") from error
    tensors: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    layouts: list[Optional[str]] = []
    currents: list[Any] = []
    for i, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{i}"
        engine = engine_for(optimizer, engines)
        layout = saved_optimizer_layout(saved, prefix)
        current: Any = None
        try:
            if engine is not None:
                engine.init_state()  # so that the template holds every state tensor DCP should fill
                if layout == "param":
                    tensors[prefix] = engine.param_shaped_template(saved, prefix)
                    if engine.has_master_copies:  # the fp32 masters come from the saved (fp32) weights
                        tensors["state_dict"] = {
                            k: torch.zeros(v.shape, dtype=saved[f"state_dict.{k}"].properties.dtype, device=v.device)
                            if isinstance(saved.get(f"state_dict.{k}"), TensorStorageMetadata) else v
                            for k, v in tensors["state_dict"].items()
                        }
                else:
                    tensors[prefix] = engine.flat_template(saved, prefix)
            else:
                current = get_optimizer_state_dict(model, optimizer)
                tensors[prefix] = flat_state_template(current, saved, prefix) if layout == "flat" else current
        except ValueError as error:
            raise ValueError(_family_mismatch(path, layout, zero_stage, error)) from error
        layouts.append(layout)
        currents.append(current)
    return tensors, layouts, currents


def _convert_loaded(
    tensors: dict[str, Any], model: nn.Module, optimizers: list[torch.optim.Optimizer], layouts: list[Optional[str]],
    currents: list[Any], engines: Sequence[ZeroEngine],
) -> list[Any]:
    """The FSDP optimizers' states in their own layout (a ZeRO-1/2 one converted; its fp32 master
    weights, if saved, replace the model weights read in `tensors`), with this rank's param names."""
    states: list[Any] = []
    for i, optimizer in enumerate(optimizers):
        state = tensors[f"optimizer_{i}"]
        if engine_for(optimizer, engines) is None:
            if layouts[i] == "flat":
                state, masters = param_shaped_from_flat(state, currents[i])
                for name, master in masters.items():
                    if name in tensors["state_dict"]:
                        tensors["state_dict"][name] = relayout_like(master, tensors["state_dict"][name])
            state = _with_own_param_groups(state, model, optimizer)
        states.append(state)
    return states


def _with_own_param_groups(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`state` with each param group's parameter names taken from this rank's optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    own = get_optimizer_state_dict(model, optimizer)["param_groups"]
    loaded = state.get("param_groups", [])
    if len(loaded) != len(own):
        raise ValueError(f"the checkpoint's optimizer has {len(loaded)} param group(s), this run's has {len(own)}")
    groups = [{**saved, "params": mine["params"]} for saved, mine in zip(loaded, own)]
    return {**state, "param_groups": groups}


def _family_mismatch(path: Path, layout: Optional[str], zero_stage: int, error: Exception) -> str:
    saved_as = {"flat": "ZeRO-1/2 (flattened per-parameter optimizer state)", "param": "ZeRO-3 / FSDP (parameter-shaped optimizer state)"}
    return (
        f"cannot resume checkpoint {path}, saved with {saved_as.get(layout or '', 'no optimizer state')}, "
        f"under zero_stage={zero_stage}: {error}. ZeRO-1/2 and ZeRO-3 checkpoints resume under any zero_stage "
        "(and world size / TP layout) when the model and its optimizer param groups are the same."
    )


__all__ = ["load_training_state"]
