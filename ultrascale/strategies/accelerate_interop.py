"""An accelerate `ParallelismConfig` read as `UltraScaleStrategy` knobs, field by field.

accelerate (>= 1.10) describes an N-D layout with `dp_replicate_size`, `dp_shard_size`,
`tp_size`, `cp_size` (torch backend) and `sp_size` (DeepSpeed Ulysses, which ultrascale runs as
`context_parallel_method="alltoall"`; with `cp_size` too, as USP: `context_parallel_method="usp"`, Ulysses over
sp inside each ring rank); its mesh order (dp_replicate, dp_shard, cp, sp, tp, innermost last) is ultrascale's
without pp, cp x sp being ultrascale's cp. Every field is
either mapped or refused with the reason: a layout is never silently changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ultrascale.parallel.rules import not_built, positive_int_problems, raise_first

__all__ = ["ACCELERATE_FIELDS", "knobs_from_accelerate"]

ACCELERATE_FIELDS: dict[str, str] = {
    "dp_replicate_size": "data_parallel_replicate",
    "dp_shard_size": "data_parallel_shard",
    "tp_size": "tensor_parallel",
    "cp_size": "context_parallel",
    "cp_backend": "context_parallel (only 'torch': ultrascale's own ring / all-gather attention runs in its place)",
    "cp_handler.cp_comm_strategy": "context_parallel_method ('allgather' -> 'allgather', 'alltoall' -> 'ring')",
    "tp_handler.enable_async_tp": "refused when True (async TP is not implemented)",
    "sp_size": "context_parallel with context_parallel_method='alltoall' (Ulysses: ultrascale's own all-to-alls around "
               "SDPA run in DeepSpeed's place); with cp_size > 1 too (which accelerate's own ParallelismConfig refuses, "
               "a mapping passes): context_parallel=cp_size x sp_size, context_parallel_method='usp', "
               "context_parallel_ulysses=sp_size, the ring across (cp_comm_strategy unset or 'alltoall')",
    "sp_backend": "only 'deepspeed' (accelerate's one value) when sp_size > 1",
    "sp_handler.sp_seq_length": "ignored: each batch's length is checked (a multiple of 2 x sp_size)",
    "sp_handler.sp_seq_length_is_variable": "ignored: lengths may vary from batch to batch",
    "sp_handler.sp_attn_implementation": "refused unless unset or 'sdpa' (ultrascale's Ulysses runs torch's SDPA)",
}
"""Every accelerate field and what it becomes (docs/strategies.md, "Accelerate layouts", shows this table)."""

# torch's context parallel "alltoall" rotates the K/V shards around the cp ranks, as ultrascale's
# ring does with P2P; "allgather" gathers the whole K/V once per layer in both.
_CP_METHODS = {"allgather": "allgather", "alltoall": "ring"}


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def knobs_from_accelerate(config: Any, owner: str = "UltraScaleStrategy",
                          other_knobs: Mapping[str, Any] = {}) -> dict[str, Any]:  # noqa: B006 - read only
    """`UltraScaleStrategy` keyword arguments for an accelerate `ParallelismConfig` (or a mapping
    with its field names). Unset sizes are 1, as accelerate reads them; ValueError /
    NotImplementedError for what ultrascale does not run, and for `other_knobs` the config already sets."""
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - {name.split(".")[0] for name in ACCELERATE_FIELDS} - {"tp_handler", "cp_handler",
                                                                                              "sp_handler"})
        if unknown:
            raise ValueError(f"{owner}.from_accelerate: unknown ParallelismConfig field(s) {unknown}; "
                             f"known: {sorted(ACCELERATE_FIELDS)}")
    sizes = {}
    for field in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
        value = _field(config, field)
        value = 1 if value is None else value
        raise_first(positive_int_problems(**{field: value}), f"{owner}.from_accelerate")
        sizes[field] = value
    if sizes["sp_size"] > 1:
        sp_backend = _field(config, "sp_backend") or "deepspeed"
        if sp_backend != "deepspeed":
            raise ValueError(f"{owner}.from_accelerate: `sp_backend={sp_backend!r}`: only 'deepspeed' is known")
        sp_handler = _field(config, "sp_handler")
        kernel = _field(sp_handler, "sp_attn_implementation") if sp_handler is not None else None
        if kernel not in (None, "sdpa"):
            raise not_built("accelerate_ulysses_kernel",
                            f"{owner}.from_accelerate: `sp_handler.sp_attn_implementation={kernel!r}`: ultrascale's "
                            "Ulysses attention runs torch's SDPA; leave it unset or 'sdpa'")
    backend = _field(config, "cp_backend") or "torch"
    if backend != "torch":
        raise ValueError(f"{owner}.from_accelerate: `cp_backend={backend!r}`: only 'torch' is known")
    tp_handler = _field(config, "tp_handler")
    knobs: dict[str, Any] = {
        "data_parallel_replicate": sizes["dp_replicate_size"],
        "data_parallel_shard": sizes["dp_shard_size"],
        "tensor_parallel": sizes["tp_size"],
        "context_parallel": sizes["cp_size"],
    }
    if tp_handler is not None and bool(_field(tp_handler, "enable_async_tp", False)):
        knobs["async_tensor_parallel"] = True  # with compile=True among the other knobs, else refused by name
    cp_handler = _field(config, "cp_handler")
    strategy = _field(cp_handler, "cp_comm_strategy") if cp_handler is not None else None
    if sizes["sp_size"] > 1 and sizes["cp_size"] > 1:  # sp inside cp (accelerate's mesh order): USP
        if strategy not in (None, "alltoall"):
            raise ValueError(f"{owner}.from_accelerate: `cp_handler.cp_comm_strategy={strategy!r}` with `sp_size="
                             f"{sizes['sp_size']}`: USP passes K/V around the ring across its Ulysses groups; leave it "
                             "unset or 'alltoall' (torch's rotating exchange)")
        knobs["context_parallel"] = sizes["cp_size"] * sizes["sp_size"]
        knobs["context_parallel_method"] = "usp"
        knobs["context_parallel_ulysses"] = sizes["sp_size"]
    elif sizes["sp_size"] > 1:  # DeepSpeed-Ulysses' sequence parallel is ultrascale's all-to-all context parallel
        knobs["context_parallel"] = sizes["sp_size"]
        knobs["context_parallel_method"] = "alltoall"
    elif sizes["cp_size"] > 1:
        strategy = strategy or "allgather"  # accelerate's default when its handler is left out
        if strategy not in _CP_METHODS:
            raise ValueError(f"{owner}.from_accelerate: `cp_handler.cp_comm_strategy={strategy!r}`: choose one of "
                             f"{sorted(_CP_METHODS)}")
        knobs["context_parallel_method"] = _CP_METHODS[strategy]
    clash = sorted(set(knobs) & set(other_knobs))
    if clash:
        raise ValueError(f"{owner}.from_accelerate: {clash} come from the ParallelismConfig; do not pass them too")
    return knobs
