"""The trainer side, by role:

    advantages.py   GRPO group advantages
    core.py         Trainer: the model, its optimizer, the loss and optimizer step(s)
    collective.py   what a Trainer needs from the other data-parallel ranks

It scores with tether.scoring (the forward it shares with rollout workers, kept versions
and the probe), one layer below it.
"""

from tether.trainer.advantages import group_advantages
from tether.trainer.collective import Collective, Solo
from tether.trainer.core import Trainer, combine, mean_metrics

__all__ = ["Collective", "Solo", "Trainer", "combine", "group_advantages", "mean_metrics"]
