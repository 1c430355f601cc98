"""`ultrascale verify` and `ultrascale verify-matrix`: your recipe's layout checked against one device.

Both runs train the recipe's model and data for a few steps in fp32 (`run`: the recipe as `ultrascale fit`
parses it, each step's exact `train_loss` and global `grad_norm` recorded); `report` compares them step by
step and puts the layout run's tokens/s, MFU and memory beside the planner's prediction; `trace` records the first
step module by module in each run and `explain` says where the layout departs (`--explain`, or after a failure);
`plot` draws both runs as SVG; `app` is the command; `matrix` runs the named layouts of `layouts` at one world
size and writes a Markdown table.
See docs/verify.md.
"""

from ultrascale.verify.app import VerifyError, VerifyReport, verify
from ultrascale.verify.layouts import LAYOUTS, NamedLayout
from ultrascale.verify.report import Comparison, compare, within
from ultrascale.verify.run import RunSpec, StepRecorder

__all__ = ["Comparison", "LAYOUTS", "NamedLayout", "RunSpec", "StepRecorder", "VerifyError", "VerifyReport", "compare",
           "verify", "within"]
