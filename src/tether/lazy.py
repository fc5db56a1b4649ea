"""`torch`, imported on first use instead of with the module that names it.

The estimators and sync policies are pure functions of tensors, but checking a config
(`tether config`, `load_config`) needs only their registered names and signatures.
Those modules write `from tether.lazy import torch`, so `tether --help` and
`tether config` answer without the seconds a torch import takes; the first attribute
read (`torch.where`, `torch.Tensor`) imports torch, later reads cost what a module's do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


class LazyModule:
    """A stand-in for module `name` that imports it on the first attribute read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads find it without __getattr__
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")
