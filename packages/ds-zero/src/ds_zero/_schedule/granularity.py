"""`stage3_module_granularity_threshold`: turn fine-grained modules into ZeRO-3 leaf modules automatically.

Stage 3 gathers and releases per module, so a model made of many small layers pays one gather (and the
hook overhead around it) per layer. With a positive threshold, each module's *granularity* is measured:
the parameter elements in its subtree divided by the number of layers in it (itself counted, plus each
parameter-holding torch leaf and nested module below it). Walking from the root down, the first module
on each path whose granularity is at or below the threshold becomes a leaf (`leaf_modules`): its whole
subtree is gathered in one collective when it is entered. Parents are tried first, so the largest
fine-grained block wins.

Never made leaves: modules without parameters, torch leaf modules (they already gather as one), the
`torch.nn` containers (`Sequential`, `ModuleList`, ...; they may never run a forward of their own, and
a leaf's submodules get no hooks), and subtrees over `MAX_LEAF_NUMEL` elements (the whole subtree
would be resident while it runs).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ds_zero._schedule.leaf_modules import set_z3_leaf_module

logger = logging.getLogger(__name__)

__all__ = ["MAX_LEAF_NUMEL", "module_granularity", "set_leaves_by_granularity"]

MAX_LEAF_NUMEL = 1_000_000_000
"""A subtree with more parameter elements than this is never made a leaf, however fine its layers."""

_CONTAINERS = tuple(getattr(torch.nn, name) for name in torch.nn.modules.container.__all__)


def _numel(param: nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # partitioned parameters keep their full size here


def module_granularity(model: nn.Module) -> dict[nn.Module, float]:
    """Granularity (elements per layer; `math.inf`: never a leaf) of every module of `model`."""
    result: dict[nn.Module, float] = {}

    def visit(module: nn.Module) -> tuple[int, int]:  # (layers, elements) in the subtree
        if next(module.parameters(), None) is None:
            result[module] = math.inf
            return 0, 0
        numel = sum(_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            result[module] = math.inf
            return 1, numel
        layers = 0
        for child in children:
            child_layers, child_numel = visit(child)
            layers, numel = layers + child_layers, numel + child_numel
        if isinstance(module, _CONTAINERS):
            result[module] = math.inf
            return layers, numel
        layers += 1
        result[module] = numel // layers if numel <= MAX_LEAF_NUMEL else math.inf
        return layers, numel

    visit(model)
    return result


def set_leaves_by_granularity(model: nn.Module, threshold: int) -> list[nn.Module]:
    """Flag the outermost modules of `model` whose granularity is at most `threshold`; returns them.

    Args:
        model: the model about to be put under stage-3 management.
        threshold: `zero_optimization.stage3_module_granularity_threshold` (0 or less: off, returns []).
    """
    if threshold <= 0:
        return []
    granularity = module_granularity(model)
    finite = {m: g for m, g in granularity.items() if g != math.inf}
    if not finite or min(finite.values()) > threshold:
        smallest = min(finite.items(), key=lambda kv: kv[1]) if finite else None
        logger.warning(
            "zero_optimization.stage3_module_granularity_threshold=%d makes no module a leaf: the finest module "
            "is %s; set the threshold to at least that to take effect",
            threshold,
            f"{type(smallest[0]).__name__} with granularity {smallest[1]}" if smallest else "(none has one)",
        )
        return []
    leaves: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if next(module.parameters(), None) is None:
            return
        if granularity[module] <= threshold:
            set_z3_leaf_module(module, True)
            leaves.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    logger.info(
        "stage3_module_granularity_threshold=%d made leaves of %s",
        threshold,
        [f"{type(m).__name__}:{granularity[m]}" for m in leaves],
    )
    return leaves
