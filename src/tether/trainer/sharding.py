"""`train.sharding=fsdp`: the trained model's parameters, gradients and optimizer state
divided over the trainer ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`).

What tether needs from a sharded model, and nothing else:

- `shard_model`: `fully_shard` on each decoder layer (the model's `_no_split_modules`), then
  on the root, which holds the embeddings, the final norm and a tied LM head. Gradients
  are reduced as a plain sum: the trainer already divides each rank's loss by the whole
  batch's token or sequence count (tether.trainer.core), so FSDP's own division by the
  world size would be applied twice. Gloo has no pre-multiplied sum, hence
  `set_force_sum_reduction_for_comms` on every unit (a plain SUM, as the replicated
  trainer's all-reduce).
- `local_shards` / `VersionSwap`: this rank's shard of every parameter, kept as a version,
  and put back into the module for a forward. The forward all-gathers the shards exactly, so
  scoring at a kept version equals the replicated trainer's scoring bit for bit.
  Assigning `p.data` is silently ignored by FSDP2 (it gathers from its own storage), hence
  the copies into `to_local()`.
- `gather_full`: whole tensors, parameter by parameter, for publishing and export; a
  collective that every rank calls in the same order, only the receiving rank keeping
  what it gathers.

After a forward under `no_grad` FSDP2 leaves the root's parameters gathered (the root does
not reshard after forward): `resharded` puts them back before a shard is read or written.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from tether.scoring.logprobs import FORWARD_METHOD


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules of a class its `_no_split_modules` names (every
    Hugging Face causal LM declares them, dense and MoE)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"train.sharding=fsdp: {type(model).__name__} names no decoder layer "
                         "class (_no_split_modules), so it cannot be sharded layer by layer")
    return layers


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """`model` sharded in place over `mesh` (one FSDP unit per decoder layer, the rest in the
    root); gradients reduced as a plain sum."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # tether scores with the decoder and the output embedding apart (tether.scoring), not
    # with model(...): the root's hooks must run around that too.
    setattr(model, FORWARD_METHOD, MethodType(_run, model))
    register_fsdp_forward_method(model, FORWARD_METHOD)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return model


def _run(self: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_value(x: torch.Tensor) -> torch.Tensor:
    """A reduction's result as a plain tensor (FSDP's `clip_grad_norm_` returns a replicated
    DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def resharded(model: nn.Module) -> None:
    """Put back every unit's parameters as shards (a no-grad forward leaves the root's
    gathered)."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (views, not copies), by name."""
    resharded(model)
    return {name: p.to_local() if isinstance(p, DTensor) else p
            for name, p in model.named_parameters()}


class VersionSwap:
    """Kept versions put into the sharded module in turn, for a forward each: `load` copies a
    version's shards (`local_shards` of it, or a kept copy of them) into the module, keeping
    the current ones aside the first time; `restore` puts those back, bit for bit. Every
    rank loads the same versions in the same order (the forward in between gathers)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.current: dict[str, torch.Tensor] | None = None

    def load(self, shards: dict[str, torch.Tensor]) -> nn.Module:
        own = local_shards(self.model)
        if self.current is None:
            self.current = {name: t.clone() for name, t in own.items()}
        with torch.no_grad():
            for name, t in own.items():
                t.copy_(shards[name])  # upcasts a version kept rounded, as load_state_dict does
        return self.model

    def restore(self) -> None:
        if self.current is None:
            return
        with torch.no_grad():
            for name, t in local_shards(self.model).items():
                t.copy_(self.current[name])
        self.current = None


def gather_full(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The model's whole parameters by name, in `named_parameters` order (a tied weight
    once). Every rank calls it together (each `full_tensor` is an all-gather); with `keep`
    False a rank joins the gathers and drops what it gathered, so only the receiving rank
    holds the whole weights."""
    resharded(model)
    whole: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if not keep:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        if t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            t = t.clone()  # one rank: full_tensor is the shard itself, which a swap reuses
        whole[name] = t.detach()
    return whole
