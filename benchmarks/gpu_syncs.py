"""Host syncs counted op by op, for benchmarks/gpu_check.py's tiny section: which ops make
the host wait for a CUDA device, and at which line of tether each was made."""

from __future__ import annotations

import importlib
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

# Ops that make the host wait for their result, each with its label.
SCALAR_OPS = {"_local_scalar_dense": ".item()/int/float/bool", "is_nonzero": ".item()/int/float/bool",
              "equal": "torch.equal", "nonzero": "nonzero", "masked_select": "masked_select"}


class HostSyncs:
    """Counts the ops that make the host wait for a CUDA device, op by op (a dispatch mode,
    so it works without a GPU): `.item()`/int/float/bool of a tensor, nonzero, masked_select,
    unique, indexing with a boolean mask (it calls nonzero), repeat_interleave without
    output_size, and device-to-host copies (`.tolist()` and `.cpu()` of a device tensor).

    On a GPU an op whose tensors are all on the host is no sync and is not counted. On a CPU
    every tensor is on the host: the ops torch.optim calls are left out (AdamW's step
    counters, host tensors on a GPU too), and `.tolist()` and `.cpu()`, which dispatch no op
    on a host tensor, are counted by wrapping them for the block."""

    def __init__(self, on_gpu: bool):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                kind = counter.kind(func, args, kwargs)
                if kind is not None:
                    counter.record(kind)
                return func(*args, **kwargs)

        self.mode, self.on_gpu = Mode(), on_gpu
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.left_out: Counter[str] = Counter()  # host-side ops that are no sync on a GPU

    def __enter__(self) -> Self:
        import torch

        self.saved = {} if self.on_gpu else {m: getattr(torch.Tensor, m) for m in ("tolist", "cpu")}
        for method, original in self.saved.items():
            setattr(torch.Tensor, method, self.wrap(f".{method}()", original))
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self.mode.__exit__(*exc)
        for method, original in self.saved.items():
            setattr(torch.Tensor, method, original)

    def wrap(self, kind: str, original: Callable) -> Callable:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.record(kind)
            return original(tensor, *args, **kwargs)

        return counted

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def kind(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The sync this op makes on a GPU (a short label), or None."""
        import torch

        name, overload = func._schema.name.removeprefix("aten::"), func._overloadname
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        tensors = [t for v in bound.values() for t in (v if isinstance(v, list | tuple) else [v])
                   if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors)
        if self.on_gpu and not on_device:
            return None
        if name in SCALAR_OPS:
            return SCALAR_OPS[name]
        if name.lstrip("_").startswith("unique"):
            return "unique"
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            masks = [t for t in bound.get("indices") or [] if isinstance(t, torch.Tensor)
                     and t.dtype in (torch.bool, torch.uint8)]
            return f"{name.strip('_')} with a boolean mask" if masks else None
        if name == "repeat_interleave" and overload != "self_int" and bound.get("output_size") is None:
            return "repeat_interleave"
        if name == "_to_copy":
            src, dst = bound["self"].device, bound.get("device")
            return "device->host copy" if src.type != "cpu" and dst is not None and \
                torch.device(dst).type == "cpu" else None
        if name == "copy_":
            return "device->host copy" if bound["self"].device.type == "cpu" and \
                bound["src"].device.type != "cpu" else None
        return None

    def record(self, kind: str) -> None:
        """Count one sync at the innermost line of tether that led to it (the caller's
        frame is two up: under the mode or a wrapper)."""
        import torch

        frame, site, optim = sys._getframe(2), None, package_dir("torch.optim")
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(optim):
                self.left_out[kind] += 1
                return
            if site is None and path.startswith(package_dir("tether")):
                site = f"{short(path)}:{frame.f_lineno}"
            frame = frame.f_back
        node = torch._C._current_autograd_node()
        where = " ".join(filter(None, [site, node and f"(backward, {node.name()})"])) or "?"
        self.kinds[kind] += 1
        self.sites[f"{where}: {kind}"] += 1


def package_dir(name: str) -> str:
    """Where package `name`'s files are, ending in a separator."""
    return str(Path(importlib.import_module(name).__file__).parent) + os.sep


def short(path: str) -> str:
    """A source path from its package on: tether/trainer/core.py, torch/nn/utils/clip_grad.py."""
    for package in ("tether", "torch"):
        root = package_dir(package)
        if path.startswith(root):
            return f"{package}/{Path(path).relative_to(root).as_posix()}"
    return Path(path).name
