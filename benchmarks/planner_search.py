"""How long `ultrascale plan` takes to rank Llama 3 405B's layouts, pricing every candidate against pricing only what can
reach its top rows (`planner.search(..., top=K)`), and whether both give the same top rows.

For each cluster size the 405B preset is searched at 8,192 tokens and one sequence per GPU per step, as `ultrascale
plan --preset llama3_405b --gpus N` does (its default global batch), on H100s. "every candidate" is the search with
`top=None` (every layout the rulebook accepts is priced: what `plan` did before); "top K" is what `plan --top K` runs
now. Both runs are timed in this one process, one after the other, each with the planner's memos emptied first
(`clear_caches`: neither reuses the other's played schedules); the table gives the seconds, the rows each
priced and whether the K rows are identical (layouts and every figure, `PlanRow.to_json`). `--skip-every N` leaves out
the every-candidate search from N GPUs up (it takes minutes there).

    python benchmarks/planner_search.py [--gpus 512 1024 4096 16384] [--top 10] [--skip-every 16384]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, write_results  # noqa: E402

from ultrascale import planner  # noqa: E402
from ultrascale.models.adapters import model_shape  # noqa: E402


def clear_caches() -> None:
    """Empty the planner's memos (played schedules, torch's action lists, ...) so that each timed search starts cold."""
    import ultrascale.planner.cost as cost
    import ultrascale.planner.pipeline as pipeline

    for module in (cost, pipeline):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def timed_search(gpus: int, top: int | None) -> tuple[float, list[planner.PlanRow]]:
    clear_caches()
    shape = model_shape("llama3_405b")
    cluster = planner.Cluster(planner.GPU_SPECS["h100"], gpus)
    start = time.perf_counter()
    rows = planner.search(shape, cluster, planner.Workload(8192, gpus), top=top)
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--skip-every", type=int, default=None, metavar="N",
                        help="leave out the every-candidate search from N GPUs up")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "planner_search.md"))
    options = parser.parse_args()
    lines = [f"Llama 3 405B on H100s, 8,192 tokens, one sequence per GPU per step: `planner.search` pricing every candidate "
             f"against `top={options.top}` (what `ultrascale plan --top {options.top}` runs). {machine()}.", "",
             "| GPUs | candidates | every candidate: s | rows priced | top: s | rows priced | speed-up | same top rows | best layout |",
             "|---|---|---|---|---|---|---|---|---|"]
    for gpus in options.gpus:
        cluster = planner.Cluster(planner.GPU_SPECS["h100"], gpus)
        candidates = sum(1 for _ in planner.candidate_layouts(model_shape("llama3_405b"), cluster, planner.Workload(8192, gpus)))
        fast_s, fast = timed_search(gpus, options.top)
        if options.skip_every is not None and gpus >= options.skip_every:
            every_s, every, same = None, None, "not run"
        else:
            every_s, every = timed_search(gpus, None)
            same = "yes" if [r.to_json() for r in every[:options.top]] == [r.to_json() for r in fast[:options.top]] else "**no**"
        best = fast[0].layout.describe() if fast and fast[0].fits else "nothing fits"
        lines.append(f"| {gpus:,} | {candidates:,} | {f'{every_s:.1f}' if every_s is not None else '-'} "
                     f"| {f'{len(every):,}' if every is not None else '-'} | {fast_s:.1f} | {len(fast):,} "
                     f"| {f'{every_s / fast_s:.1f}x' if every_s is not None else '-'} | {same} | {best} |")
        print(lines[-1], flush=True)
    write_results("\n".join(lines), options.out)


if __name__ == "__main__":
    main()
