"""Putting random-LTD into a model and taking it out of its weights.

`convert_to_random_ltd(engine, LayerClass)` wraps every `LayerClass` module of the engine's model in a
`RandomLayerTokenDrop` and lets the engine wire them (`engine.random_ltd_initialize()`, i.e.
`wire_random_ltd`): the wrappers whose position in the model matches an id in `random_ltd_layer_id`
get the scheduler, in model order. The wrapper adds `.random_ltd_layer` to its layer's state-dict keys;
`remove_random_ltd_state_dict` drops it, so saved weights load into the model without random-LTD (and,
with `add_random_ltd_names`, back into a wrapped one).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast

from torch import nn

from ds_engine._data import keys as k
from ds_engine._data.ltd_scheduler import RandomLTDScheduler
from ds_engine._data.token_drop import RandomLayerTokenDrop

logger = logging.getLogger(__name__)

__all__ = [
    "add_random_ltd_names",
    "convert_to_random_ltd",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
    "wire_random_ltd",
]

_PATH = "data_efficiency.data_routing.random_ltd"
_INFIX = ".random_ltd_layer"


def _inner(model: nn.Module) -> nn.Module:
    return cast(nn.Module, model.module) if hasattr(model, "module") else model


def convert_to_random_ltd(model: Any, convert_type: type[nn.Module]) -> Any:
    """Wrap every `convert_type` module of `model` (an engine, or anything with `.module` and
    `random_ltd_initialize()`) in `RandomLayerTokenDrop`, then wire them; returns `model`."""
    root = _inner(model)
    targets = [
        name
        for name, module in root.named_modules()
        if isinstance(module, convert_type) and not name.endswith(_INFIX.lstrip(".")) and name
    ]
    if not targets:
        raise ValueError(f"convert_to_random_ltd: the model has no {convert_type.__name__} module to wrap")
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        _replace(parent, leaf, RandomLayerTokenDrop(getattr(parent, leaf)))
    model.random_ltd_initialize()
    return model


def _replace(parent: nn.Module, leaf: str, wrapper: RandomLayerTokenDrop) -> None:
    """Put `wrapper` where `parent.<leaf>` was, also in plain lists of the parent that run the layer (a
    `PipelineModule` calls its layers from `forward_funcs`, which a bare setattr would leave unwrapped)."""
    old = getattr(parent, leaf)
    setattr(parent, leaf, wrapper)
    for value in vars(parent).values():
        if isinstance(value, list):
            value[:] = [wrapper if item is old else item for item in value]


def _layer_index(name: str) -> int | None:
    """The last integer component of a dotted module name (`transformer.h.3` -> 3), if any."""
    numbers = [part for part in name.split(".") if re.fullmatch(r"\d+", part)]
    return int(numbers[-1]) if numbers else None


def _matches(name: str, layer_id: int) -> bool:
    """Whether the wrapper at `name` is layer `layer_id`: its last integer name component; a name without one
    falls back to DeepSpeed's test, the id's digits anywhere in the name."""
    index = _layer_index(name)
    return index == layer_id if index is not None else str(layer_id) in name


def wire_random_ltd(module: nn.Module, config: Mapping[str, Any], scheduler: RandomLTDScheduler) -> int:
    """Give the wrappers listed in `random_ltd_layer_id` the scheduler, numbered in model order; returns how many.

    Raises:
        ValueError: the number of wrappers matched is not `random_ltd_layer_num`.
    """
    wanted = sorted(config[k.RANDOM_LTD_LAYER_ID])
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and count < len(wanted) and _matches(name, wanted[count]):
            layer.init_config(config, scheduler, count)
            count += 1
    if count != config[k.RANDOM_LTD_LAYER_NUM]:
        raise ValueError(
            f"{_PATH}: random_ltd_layer_num={config[k.RANDOM_LTD_LAYER_NUM]} but {count} RandomLayerTokenDrop "
            f"layers of the model match random_ltd_layer_id={list(config[k.RANDOM_LTD_LAYER_ID])}; wrap those "
            "layers (convert_to_random_ltd) or fix the ids"
        )
    logger.info("random-LTD on %d layers (ids %s)", count, wanted)
    return count


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """`state_dict` with the wrappers' `.random_ltd_layer` taken out of every key."""
    return OrderedDict((key.replace(_INFIX, ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: nn.Module) -> OrderedDict[str, Any]:
    """The model's (or the engine's model's) state_dict under the names it has without random-LTD."""
    return remove_random_ltd_state_dict(_inner(model).state_dict())


def add_random_ltd_names(state_dict: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """`state_dict` saved without random-LTD names, renamed to `module`'s wrapped names where they differ."""
    renames = {remove_random_ltd_state_dict({key: None}).popitem()[0]: key for key in module.state_dict()}
    return {renames.get(key, key): value for key, value in state_dict.items()}
