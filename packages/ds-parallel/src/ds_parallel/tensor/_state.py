"""Whole weights of a sharded model: gather them (to save) and cut them (to load), keyed as the unsharded model.

A model sharded by `shard_model` has the same parameter names as the original, only shorter tensors,
so a state dict gathered here loads into the unsharded model (or any tensor-parallel size) and a whole
state dict loads into a sharded model of any size.
"""

from __future__ import annotations

import torch
from torch import nn

from ds_parallel.tensor._layers import TensorParallelLayer

__all__ = ["full_state_dict", "load_full_state_dict", "tp_layers"]


def tp_layers(model: nn.Module) -> dict[str, TensorParallelLayer]:
    """The tensor-parallel layers of `model`, by their module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TensorParallelLayer)}


def full_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every sharded parameter replaced by the whole tensor.

    Collective: one all_gather on each layer's tensor-parallel group per sharded parameter, in module
    order; every rank of the group must call it, and every rank receives the whole state.
    """
    state = model.state_dict(keep_vars=keep_vars)
    for path, layer in tp_layers(model).items():
        for pname in layer.layouts:
            key = f"{path}.{pname}" if path else pname
            state[key] = layer.full_tensor(pname)
    return state


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a whole (unsharded) state dict into a sharded `model`: each rank keeps its shard. No communication.

    Raises:
        KeyError: `strict` and a parameter or buffer of `model` is missing from `state`, or `state` has
            keys `model` does not (the names are listed).
    """
    layers = tp_layers(model)
    sharded: set[str] = set()
    for path, layer in layers.items():
        for pname in layer.layouts:
            key = f"{path}.{pname}" if path else pname
            if key in state:
                layer.load_full(pname, state[key])
                sharded.add(key)
    rest = {k: v for k, v in state.items() if k not in sharded}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    missing = [k for k in missing if k not in sharded]
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
