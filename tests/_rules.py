"""Ask the rulebook about one built model, as the strategy's `check_model` does, without a process group."""

import math

from ultrascale.models.adapters import model_facts
from ultrascale.parallel.dims import ParallelDims
from ultrascale.parallel.rules import LayoutKnobs, model_problems, raise_first


def check_layout(module, **degrees) -> None:
    """Raise the rulebook's first problem with `degrees` (e.g. cp=2) on `module`; the other degrees are 1."""
    dims = ParallelDims.resolve(math.prod(degrees.values()), dp_shard=1, **degrees)
    raise_first(model_problems(dims, LayoutKnobs(dp_shard=1, **degrees), model_facts(module)))
