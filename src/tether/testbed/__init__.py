"""The testbed: tether's own tiny model, built and warm-started on a task, so everything runs
on a laptop with nothing downloaded (DESIGN.md section 7).

    default_model.py  ensure_default_model: build, warm-start and cache the default model
    warmstart.py      warm_start: the supervised warm start on a task's worked solutions
"""

from tether.testbed.default_model import default_model_dir, ensure_default_model
from tether.testbed.warmstart import warm_start

__all__ = ["default_model_dir", "ensure_default_model", "warm_start"]
