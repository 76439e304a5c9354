"""Names for parameters in checkpoints: from the module when given, positional otherwise; tied aliases; frozen."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

__all__ = ["ParamNames"]


class ParamNames:
    """Maps parameters to the names `model.state_dict()` uses, so `zero_to_fp32` output loads into the model.

    Args:
        module: the model; None gives positional names `group{g}.param{i}`.
        renames: module name -> the name to use instead (e.g. an expert's global name).
    """

    def __init__(self, module: torch.nn.Module | None, renames: Mapping[str, str] | None = None) -> None:
        self.module = module
        self._names: dict[int, str] = {}
        self._aliases: dict[str, str] = {}
        self._frozen: dict[str, list[int]] = {}
        if module is not None:
            for name, p in module.named_parameters(remove_duplicate=False):
                name = renames.get(name, name) if renames else name
                first = self._names.setdefault(id(p), name)
                if first != name:
                    self._aliases[name] = first
                if not p.requires_grad:
                    self._frozen.setdefault(first, list(p.shape))

    def name_of(self, param: torch.Tensor, group: int, index: int) -> str:
        """The parameter's module name, or `group{g}.param{i}` when there is no module (or it is not in it)."""
        name = self._names.get(id(param))
        if name is None:
            name = f"group{group}.param{index}"
            if self.module is not None:
                logger.warning(
                    "an optimizer parameter (group %d, index %d) is not in the module; saved as %r", group, index, name
                )
        return name

    def note_frozen(self, param: torch.Tensor, group: int, index: int) -> None:
        """Record a parameter of the optimizer that has `requires_grad=False` (not partitioned)."""
        self._frozen.setdefault(self.name_of(param, group, index), list(param.shape))

    def shared_params(self) -> dict[str, str]:
        """Tied parameters: alias name -> the name the values are stored under."""
        return dict(self._aliases)

    def frozen_param_shapes(self) -> dict[str, list[int]]:
        return dict(self._frozen)
