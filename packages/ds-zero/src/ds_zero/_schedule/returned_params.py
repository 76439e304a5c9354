"""Find the partitioned parameters a module's forward returns (`return out, self.bias`).

A parameter handed back to the caller is read after the module's forward ends, so the coordinator
must keep it gathered for the caller (see `ParamCoordinator.post_forward`). This walks the output
the way users build it: tensors, tuples, lists, dicts (Hugging Face's `ModelOutput` is one), dataclasses,
and, as DeepSpeed does, the attributes of a plain object. The walk runs after every module's forward,
so it stops at tensors, modules and a small depth, and visits each container once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds_zero._params.partitioned_param import is_zero_param

__all__ = ["returned_params"]

_MAX_DEPTH = 4
"""Containers nested deeper than this are not searched (outputs are shallow; caches can be deep)."""


def returned_params(output: Any) -> list[nn.Parameter]:
    """The partitioned parameters inside `output`, each once, in the order found."""
    if output is None or (isinstance(output, torch.Tensor) and not isinstance(output, nn.Parameter)):
        return []  # the common case, decided without any walk
    found: list[nn.Parameter] = []
    seen: set[int] = set()
    _walk(output, 0, found, seen)
    return found


def _walk(value: Any, depth: int, found: list[nn.Parameter], seen: set[int]) -> None:
    if isinstance(value, torch.Tensor):
        if isinstance(value, nn.Parameter) and is_zero_param(value) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
        return
    if depth >= _MAX_DEPTH or isinstance(value, (str, bytes, int, float, bool, nn.Module)) or value is None:
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    for child in _children(value):
        _walk(child, depth + 1, found, seen)


def _children(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return list(value)
    if isinstance(value, Mapping):
        return list(value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(value, type):
        return [v for k, v in attrs.items() if not k.startswith("__")]
    return []
