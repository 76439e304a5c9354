"""Gather units: which partitioned parameters each module's forward needs, under which names.

A *gather unit* is a module together with the partitioned, non-persistent parameters its forward needs:
the ones it registers itself plus *external* ones (another module's parameter read from its forward,
registered on the first read or with `register_external_parameter`). Every module owning a partitioned
parameter has a unit, even when all its parameters are persistent (its calls still mark the execution
order). The registry also names every parameter after `named_parameters()` (the names checkpoints and
error messages use) and maps each full storage back to its parameter for the saved-tensor hooks.

A leaf module (`leaf_modules`) has one unit holding every partitioned parameter of its subtree; the
modules inside it have none, and an external parameter registered on one of them joins the leaf's unit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from ds_zero._params.gather import name_fingerprint
from ds_zero._params.gathered_parameters import external_params
from ds_zero._params.param_dict import install_param_dict
from ds_zero._params.partitioned_param import is_zero_param, state_of
from ds_zero._schedule.leaf_modules import z3_leaf_module

logger = logging.getLogger(__name__)

__all__ = ["GatherUnit", "UnitRegistry"]


@dataclasses.dataclass(eq=False)
class GatherUnit:
    """A module and the partitioned, non-persistent parameters gathered for it."""

    index: int
    module: nn.Module
    name: str
    params: list[nn.Parameter]


class UnitRegistry:
    """The units, parameters and names of one model.

    Args:
        root: the model; every parameter in it must already be partitioned.
        owner: the coordinator the parameters report to (`state_of(param).coord`).
        on_change: called when a unit gains or loses an external parameter (traces recompute tables).
    """

    def __init__(self, root: nn.Module, owner: Any, on_change: Callable[[], None]) -> None:
        self.units: list[GatherUnit] = []
        self._unit_of: dict[int, GatherUnit] = {}
        self._names = {id(m): name or "<root>" for name, m in root.named_modules(remove_duplicate=False)}
        self._on_change = on_change
        self.params: list[nn.Parameter] = []
        self._storage_index: dict[int, nn.Parameter] = {}
        self._leaf_of = _leaf_map(root)
        seen: set[int] = set()
        for mod_name, module in root.named_modules():
            own = []
            for p_name, p in module._parameters.items():
                if not is_zero_param(p):
                    continue
                if id(p) not in seen:
                    seen.add(id(p))
                    state_of(p).name = f"{mod_name}.{p_name}" if mod_name else p_name
                    state_of(p).fingerprint = name_fingerprint(state_of(p).name)
                    state_of(p).coord = owner
                    self.params.append(p)
                if not p.ds_persist:
                    own.append(p)
            if any(is_zero_param(p) for p in module._parameters.values()):
                install_param_dict(module)
            if id(module) in self._leaf_of:
                continue  # inside a leaf: its parameters are the leaf's
            if z3_leaf_module(module):
                self._new_unit(module, _subtree_params(module))
            elif any(is_zero_param(p) for p in module._parameters.values()):
                self._new_unit(module, own)
        for module in root.modules():
            for p in list(external_params(module).values()):  # also gives every module DeepSpeed's attribute
                if is_zero_param(p) and state_of(p).coord is owner:
                    self.add_external(module, p)
        self._storage_index = {
            state_of(p).full_flat.untyped_storage()._cdata: p for p in self.params if not p.ds_persist
        }

    def name_of(self, module: nn.Module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _new_unit(self, module: nn.Module, params: list[nn.Parameter]) -> GatherUnit:
        unit = GatherUnit(len(self.units), module, self.name_of(module), params)
        self.units.append(unit)
        self._unit_of[id(module)] = unit
        return unit

    def unit_for(self, module: nn.Module) -> GatherUnit | None:
        return self._unit_of.get(id(module))

    def param_info(self, index: int) -> list[tuple[int, int]]:
        """(id, elements) of the parameters unit `index` gathers (for the trace tables)."""
        return [(p.ds_id, p.ds_numel) for p in self.units[index].params]

    def add_external(self, module: nn.Module, param: nn.Parameter) -> GatherUnit | None:
        """Gather `param` with `module` from now on; None for a persistent parameter (always whole)."""
        if param.ds_persist:
            return None
        module = self._leaf_of.get(id(module), module)
        unit = self._unit_of.get(id(module))
        if unit is None:
            unit = self._new_unit(module, [])
        if all(p is not param for p in unit.params):
            unit.params.append(param)
            self._on_change()
        return unit

    def remove_external(self, module: nn.Module, param: nn.Parameter) -> None:
        module = self._leaf_of.get(id(module), module)
        unit = self._unit_of.get(id(module))
        if unit is None or any(p is param for p in _owned(module)):
            return
        unit.params = [p for p in unit.params if p is not param]
        self._on_change()

    def param_for_storage(self, key: int) -> nn.Parameter | None:
        """The non-persistent parameter whose full storage has `_cdata` `key`."""
        return self._storage_index.get(key)

    def storage_replaced(self, old_key: int, param: nn.Parameter) -> None:
        """A dtype/device conversion recreated `param`'s full storage."""
        self._storage_index.pop(old_key, None)
        if not param.ds_persist:
            self._storage_index[state_of(param).full_flat.untyped_storage()._cdata] = param


def _leaf_map(root: nn.Module) -> dict[int, nn.Module]:
    """id of every module strictly inside a leaf -> the outermost leaf containing it."""
    inside: dict[int, nn.Module] = {}

    def visit(module: nn.Module, leaf: nn.Module | None) -> None:
        for child in module.children():
            if leaf is not None:
                inside.setdefault(id(child), leaf)
            visit(child, leaf if leaf is not None else (child if z3_leaf_module(child) else None))

    visit(root, root if z3_leaf_module(root) else None)
    return inside


def _subtree_params(leaf: nn.Module) -> list[nn.Parameter]:
    """The partitioned, non-persistent parameters of `leaf`'s subtree (each once), marked as the leaf's."""
    params = []
    for p in leaf.parameters():
        if is_zero_param(p):
            p.ds_z3_leaf_module = leaf
            if not p.ds_persist:
                params.append(p)
    return params


def _owned(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a unit holds as its own: a leaf's subtree, else the module's direct parameters."""
    if z3_leaf_module(module):
        return list(module.parameters())
    return [p for p in module._parameters.values() if p is not None]
