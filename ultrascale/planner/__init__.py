"""The layout planner behind `ultrascale plan`: every layout ultrascale can run, costed and ranked.

For a model (`ModelShape`), a cluster (`Cluster`: GPU kind, count, GPUs per node) and a
batch (sequence length, global batch in tokens), `search` enumerates the layouts
(pp, dp_replicate, dp_shard, cp, tp, ep, ZeRO stage, recomputation, micro-batch) that
ultrascale's strategy accepts for this model, and `evaluate` prices each one:

- memory per GPU: model states by ZeRO stage and precision (Playbook formulas, with the
  bytes ultrascale keeps), activations (`ActivationModel`) times the micro-batches a
  schedule keeps alive, communication buffers;
- step time: compute at an achievable fraction of the GPU's peak, the communication each
  method needs over intra- or inter-node links minus what it can hide behind compute, and
  the pipeline's bubble and held activations from torch's own schedule order, played with each stage's
  times (`pipeline`: uneven splits, every schedule, any virtual stages);
- predicted MFU and tokens/s per GPU.

Arithmetic and torch's schedule constructors, no torch.distributed.

Modules: `layouts` (`Layout`, `--layout` parsing,
`layout_problems`), `pipeline` (schedules played), `cost` (`evaluate`), `search`, `report` (what `plan` prints), `recipe`
(`--emit-recipe`), and `app`, the `ultrascale plan` command (imported on its own: it needs Lightning).
"""

from ultrascale.hardware import (
    GIB,
    GPU_SPECS,
    GPU_TABLE,
    PEAK_TFLOPS,
    Cluster,
    GpuFigures,
    GpuSpec,
    find_peak_tflops,
)
from ultrascale.planner.calibration import Calibration, calibrated, layout_family, load_calibration
from ultrascale.planner.cost import (
    PlanRow,
    Workload,
    evaluate,
    pipeline_of,
    rank_parts,
    stage_model_state,
)
from ultrascale.planner.layouts import LAYOUT_KEYS, RECOMPUTE_MODES, Layout, layout_of_strategy, layout_problems, parse_layout
from ultrascale.planner.recipe import recipe_yaml
from ultrascale.planner.report import describe_search, explain, format_table, what_would_fit
from ultrascale.planner.search import candidate_layouts, rank_key, search, why_not

__all__ = [
    "Calibration", "Cluster", "GIB", "GPU_SPECS", "GPU_TABLE", "GpuFigures", "GpuSpec", "LAYOUT_KEYS", "Layout",
    "PEAK_TFLOPS", "PlanRow", "RECOMPUTE_MODES", "Workload", "calibrated", "candidate_layouts", "describe_search",
    "evaluate", "explain", "find_peak_tflops", "format_table", "layout_family", "layout_of_strategy", "layout_problems", "load_calibration",
    "parse_layout", "pipeline_of", "rank_key", "rank_parts", "recipe_yaml", "search", "stage_model_state",
    "what_would_fit", "why_not",
]
