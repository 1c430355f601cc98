"""The published training runs the planner is compared against: `planner_published.yaml` (the data, each entry
under the quote of the table row or sentence it comes from), loaded and checked against `SCHEMA`.

    from benchmarks.planner_published import PUBLISHED_RUNS   # or load_published(path)

A run that breaks the schema (a field the schema does not know, a missing one, a value of the wrong type or
outside its choices) is refused with its index and source, so a new entry cannot slip in with a typo that
`benchmarks/planner_validation.py` would silently read as "not stated".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).with_suffix(".yaml")

_INT_OR_NULL = (int, type(None))
_NUMBER_OR_NULL = (int, float, type(None))
_STR_OR_NULL = (str, type(None))

SCHEMA: dict[str, tuple[tuple[type, ...], bool]] = {
    # field: (allowed types, required)
    "source": ((str,), True),
    "url": ((str,), True),
    "model": ((str, dict), True),
    "gpu": ((str,), True),
    "gpus": ((int,), True),
    "gpus_per_node": (_INT_OR_NULL, True),
    "layout": ((dict,), True),
    "seq_len": (_INT_OR_NULL, True),
    "micro_batch": (_INT_OR_NULL, True),
    "global_batch": (_INT_OR_NULL, True),
    "global_batch_tokens": (_INT_OR_NULL, True),
    "recompute": (_STR_OR_NULL, True),
    "precision": (_STR_OR_NULL, True),
    "tokens_per_s_per_gpu": (_NUMBER_OR_NULL, True),
    "mfu": (_NUMBER_OR_NULL, True),
    "tflops_per_gpu": (_NUMBER_OR_NULL, True),
    "memory_gib": (_NUMBER_OR_NULL, True),
    "notes": ((str,), True),
    "pipeline_layers": (_STR_OR_NULL, False),
    "flops_include_recompute": ((bool, type(None)), False),
    "flops_per_sequence": ((int, float), False),
    "recompute_assumed": ((list,), False),
    "compile": ((bool, type(None)), False),
}
"""Every field of a run: the types it may hold and whether it must be there (null where the source is silent)."""

CHOICES: dict[str, tuple[Any, ...]] = {
    "model": ("llama3_8b", "llama3_70b", "llama3_405b"),  # or an architecture dict (MODEL_FIELDS)
    "recompute": ("none", "selective", "full", None),
    "precision": ("bf16", "fp8", None),
}
LAYOUT_FIELDS: dict[str, type] = {"pp": int, "dp": int, "dp_shard": int, "dp_replicate": int, "tp": int, "cp": int,
                                  "ep": int, "zero_stage": int, "virtual_stages": int, "schedule": str}
MODEL_FIELDS = {"n_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "style", "config", "n_params"}


def run_problems(run: Any) -> list[str]:
    """What is wrong with one run against the schema ([] when nothing is)."""
    if not isinstance(run, dict):
        return [f"a run is a mapping, got {type(run).__name__}"]
    problems = [f"unknown field {name!r}" for name in run if name not in SCHEMA]
    for name, (types, required) in SCHEMA.items():
        if name not in run:
            problems += [f"missing field {name!r}"] if required else []
        elif type(run[name]) not in types:  # `type`, not isinstance: a bool is not a count
            problems.append(f"{name}={run[name]!r}: expected {' or '.join(t.__name__ for t in types)}")
    for name, allowed in CHOICES.items():
        value = run.get(name)
        if not isinstance(value, dict) and value not in allowed:
            problems.append(f"{name}={value!r}: choose one of {allowed}")
    if isinstance(run.get("layout"), dict):
        for key, value in run["layout"].items():
            if key not in LAYOUT_FIELDS or type(value) is not LAYOUT_FIELDS[key]:
                problems.append(f"layout {key}={value!r}: the layout's fields are {', '.join(LAYOUT_FIELDS)} (ints; "
                                "schedule a name)")
    if isinstance(run.get("model"), dict):
        problems += [f"model field {key!r} unknown (known: {', '.join(sorted(MODEL_FIELDS))})"
                     for key in run["model"] if key not in MODEL_FIELDS]
    if "recompute_assumed" in run and not (isinstance(run["recompute_assumed"], list) and len(run["recompute_assumed"]) == 2):
        problems.append("recompute_assumed: [mode, why the mode is assumed]")
    return problems


def load_published(path: Path | str = DATA) -> list[dict[str, Any]]:
    """The runs of `path`, each checked against the schema; ValueError naming every broken run."""
    data = yaml.safe_load(Path(path).read_text())
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise ValueError(f"{path}: expected a mapping with a `runs` list")
    broken = [f"run {i} ({run.get('source', '?') if isinstance(run, dict) else type(run).__name__}): "
              f"{'; '.join(problems)}" for i, run in enumerate(runs) if (problems := run_problems(run))]
    if broken:
        raise ValueError(f"{path}: " + "\n".join(broken))
    for run in runs:
        if "recompute_assumed" in run:
            run["recompute_assumed"] = tuple(run["recompute_assumed"])
    return runs


PUBLISHED_RUNS: list[dict[str, Any]] = load_published()
