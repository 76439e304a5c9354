"""Telling expert parameters from dense ones (DeepSpeed's `deepspeed.moe.utils`).

An expert parameter carries `allreduce = False` and a `group_name` (`Experts` marks them). Optimizers
need them in param groups of their own, flagged `moe=True` and named by `group_name`, so ZeRO and the
engine can reduce each group over the right process group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]

#: DeepSpeed's default cap on one MoE param group's elements (2^31 / 12: an fp32 Adam state fits 32-bit indices).
DEFAULT_MAX_GROUP_SIZE = 178956971


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """`(True, num_experts of the first MoE layer)` if `m` holds an `MoE`, else `(False, 0)`."""
    from ds_parallel.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter: it carries `allreduce = False`."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: Sequence[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`(dense params, expert params)`, order kept."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Sequence[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`(dense grads, expert grads)` of the params that have one, each cast to its parameter's dtype."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _chunks(params: list[nn.Parameter], max_numel: int | float) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        n = int(getattr(p, "ds_numel", p.numel()))
        if size + n <= max_numel:
            current.append(p)
            size += n
        else:
            if current:  # a param larger than the cap gets a group of its own, not an empty one before it
                out.append(current)
            current, size = [p], n
    if current:
        out.append(current)
    return out


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Move expert params out of each group into new groups, one per (source group, `group_name`).

    A new group copies its source group's options and gets `name = group_name` and `moe = True`; with
    `max_group_size` it is split into groups of at most that many elements. The given groups keep their
    dense params (the list is modified in place when one is passed, as in DeepSpeed); the new groups are
    appended after them. Every group needs a `name` when experts are present.

    Raises:
        TypeError: `param_groups` is not a dict, tuple or list.
        KeyError: a group holding expert params has no `name`.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise TypeError(f"param_groups must be a dict, tuple or list of dicts, got {type(param_groups).__name__}")

    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    if names:
        missing = [i for i, g in enumerate(param_groups) if "name" not in g]
        if missing:
            raise KeyError(f"param groups {missing} have no 'name'; MoE param groups are keyed by their source's name")
    moe: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for group in param_groups:
        for name in names:
            moe[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe[group["name"]][p.group_name]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for by_name in moe.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
            else:
                for chunk in _chunks(group["params"], max_group_size):
                    param_groups.append({**group, "params": chunk})
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """The group was made for expert params (`moe=True`)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]] | list[Any]:
    """Param groups ready for an MoE model from a list of parameters or of param groups.

    Parameters become `{"params": ..., "name": "dense-params"}` split by expert group; groups without any
    `moe` key are split; groups that already have MoE groups are returned as they are.

    Raises:
        TypeError: `model_parameters` is not a list of tensors or dicts.
    """
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError("model_parameters must be a non-empty list of parameters or param-group dicts")
    for p in model_parameters:
        if not isinstance(p, torch.Tensor | dict):
            raise TypeError(f"the optimizer's params must be tensors or param-group dicts, got {type(p).__name__}")
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
