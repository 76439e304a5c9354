"""Optimizer state across tensor-parallel degrees: saved whole per parameter, cut again on load.

[Note: whole, like the weights] A tensor-parallel checkpoint holds whole weights (`module_state_dict`
gathers them), so it loads at any degree. The optimizer state follows the same rule:

* stage 0: the stepper's state (Adam moments, fp16/bf16 fp32 masters) is saved with every cut
  parameter's tensors gathered whole; on load, whole tensors are cut to this rank's shard. A TP=1 save
  is already whole, so it loads at TP=N, and a TP=N save loads at TP=1 as a plain one.
* ZeRO 1/2: the partition files stay per tensor-parallel rank (a same-degree resume reads them as
  before); besides them, global rank 0 stores the per-parameter form (`ds_zero.param_states_of`) with
  cut parameters gathered whole in the model-states file under `optimizer_param_states`. A load at
  another degree cuts that form (or, for a TP=1 save, the one rebuilt from its partitions) to this
  rank's shards and hands ds-zero a single-rank save to re-partition.

Collectives: gathering is one all-gather on the tensor-parallel group per cut tensor, in the same order
on every rank of the group; cutting sends nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_engine._optional import require

logger = logging.getLogger(__name__)

__all__ = [
    "PARAM_STATES_KEY",
    "gather_stage0_state",
    "shard_param_states",
    "shard_stage0_state",
    "whole_tensors",
]

#: The model-states key of the whole per-parameter ZeRO optimizer state (tensor-parallel saves only).
PARAM_STATES_KEY = "optimizer_param_states"

_Layer = Any  # ds_parallel.tensor.TensorParallelLayer (ds-parallel is an optional sibling)


def _cut_layers(module: nn.Module) -> dict[str, tuple[_Layer, str]]:
    """Parameter name -> (its tensor-parallel layer, the parameter's name there), for cut parameters."""
    tensor = require("ds_parallel", extra="parallel", feature="tensor parallelism").tensor
    out = {}
    for path, layer in tensor.tp_layers(module).items():
        for pname, layout in layer.layouts.items():
            if not layout.replicated and layer.tp_world_size > 1:
                out[f"{path}.{pname}" if path else pname] = (layer, pname)
    return out


def _by_param(module: nn.Module) -> dict[int, tuple[_Layer, str]]:
    names = {name: p for name, p in module.named_parameters()}
    return {id(names[name]): found for name, found in _cut_layers(module).items() if name in names}


def _gather(layer: _Layer, pname: str, local: torch.Tensor) -> torch.Tensor:
    device = getattr(layer, pname).device  # the group's backend needs the tensor where the parameters are
    return layer.full_like(pname, local.to(device)).to(local.device)


def _map_stage0(state: dict[str, Any], params: list[torch.Tensor], fn: Callable[[int, Any], Any]) -> dict[str, Any]:
    """`state` (a stage-0 stepper's state_dict) with `fn(index, value)` applied to every per-parameter value."""
    wrapped = "optimizer_state_dict" in state  # MixedPrecisionOptimizer: base state + fp32 masters
    opt = state["optimizer_state_dict"] if wrapped else state
    if len(params) < len(opt["state"]) or any(int(i) >= len(params) for i in opt["state"]):
        raise ValueError(
            f"the saved optimizer state covers parameters {sorted(opt['state'])}, this optimizer has {len(params)}"
        )
    new = {**opt, "state": {i: {k: fn(int(i), v) for k, v in entry.items()} for i, entry in opt["state"].items()}}
    if not wrapped:
        return new
    out = {**state, "optimizer_state_dict": new}
    at = 0
    groups = []
    for group in state["fp32_groups"]:
        groups.append([fn(at + j, t) for j, t in enumerate(group)])
        at += len(group)
    out["fp32_groups"] = groups
    return out


def gather_stage0_state(state: dict[str, Any], params: list[torch.Tensor], module: nn.Module) -> dict[str, Any]:
    """A stage-0 stepper's `state_dict()` with cut parameters' tensors whole (collective on the TP group).

    Args:
        state: the stepper's state_dict (base optimizer state, and fp32 masters for fp16/bf16).
        params: the model parameters its indices follow (the stepper's `state_params()`).
        module: the sharded model.
    """
    cut = _by_param(module)

    def whole(i: int, value: Any) -> Any:
        p = params[i]
        if id(p) in cut and isinstance(value, torch.Tensor) and value.shape == p.shape:
            return _gather(*cut[id(p)], value)
        return value

    return _map_stage0(state, params, whole)


def shard_stage0_state(state: dict[str, Any], params: list[torch.Tensor], module: nn.Module | None) -> dict[str, Any]:
    """The inverse of `gather_stage0_state` (no communication); `module` None: no tensor parallelism.

    Raises:
        ValueError: a saved tensor fits neither the parameter nor its whole (the message names the
            parameter index and both shapes).
    """
    cut = _by_param(module) if module is not None else {}

    def local(i: int, value: Any) -> Any:
        p = params[i]
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        if value.shape != p.shape and id(p) in cut:
            layer, pname = cut[id(p)]
            value = layer.shard_like(pname, value)
        if value.shape != p.shape:
            raise ValueError(
                f"load_checkpoint: the saved optimizer state of parameter {i} has shape {tuple(value.shape)}, the "
                f"parameter here {tuple(p.shape)}; a tensor-parallel checkpoint from before ds saved whole optimizer "
                "state loads only at its own degree: pass load_module_only=True (or load_optimizer_states=False)"
            )
        return value

    return _map_stage0(state, params, local)


def whole_tensors(module: nn.Module) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """`transform=` for `ds_zero.param_states_of`: a cut parameter's tensor gathered whole (collective on
    the TP group, in the order ds-zero calls it, the same on every rank); others as they are."""
    cut = _cut_layers(module)

    def whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
        found = cut.get(name)
        return tensor if found is None else _gather(*found, tensor)

    return whole


def shard_param_states(states: dict[str, Any], module: nn.Module | None) -> dict[str, Any]:
    """Whole per-parameter states cut to this rank's shards (no communication); `module` None: as is.

    Raises:
        ValueError: a parameter of the save is not in the model.
    """
    if module is None:
        return states
    cut = _cut_layers(module)
    names = {name for name, _ in module.named_parameters()}
    params = {}
    for name, entry in states["params"].items():
        if name not in names:
            raise ValueError(f"load_checkpoint: the saved optimizer state has parameter {name!r}, the model has not")
        found = cut.get(name)
        params[name] = entry if found is None else {k: found[0].shard_like(found[1], t) for k, t in entry.items()}
    return {**states, "params": params}
