"""`ZeroParamDict` (DeepSpeed's `ZeROOrderedDict`): a module's `_parameters` that gathers on access in forward.

`nn.Module.__getattr__` reads parameters through `_parameters[name]`, so `self.embed.weight` used from
another module's forward (a tied lm-head) gathers the weight on demand and registers it with the running
module, which then gathers it up front on later steps. Iteration (`named_parameters()`, `state_dict()`)
goes through `items()`/`values()` and never gathers. Outside a managed forward or backward nothing is
gathered: the released parameter (right shape, NaN values) is returned.

Modules that own partitioned parameters get one when they are partitioned. Modules attached to the
model later (`model.head = nn.Linear(...)` after the engine was built) get one when the next forward
starts (`ensure_zero_ordered_dict` over the model, as DeepSpeed's forward prologue does), so a
partitioned parameter they share with the model (`model.head.weight = model.embed.weight`) is gathered
when they read it instead of being used released.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_zero._params.partitioned_param import ZeroParamStatus, state_of

__all__ = ["ZeroParamDict", "ensure_zero_ordered_dict", "install_param_dict"]


class ZeroParamDict(dict):
    """A module's `_parameters` dict that gathers a released parameter when a running forward reads it.

    Args:
        parent_module: the module whose `_parameters` this is (kept as `_parent_module`, DeepSpeed's name).
        *args, **kwargs: the initial contents, as for `dict`.
    """

    def __init__(self, parent_module: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module

    def __getitem__(self, key: str) -> Any:
        param = dict.__getitem__(self, key)
        if param is not None and getattr(param, "ds_status", None) not in (None, ZeroParamStatus.AVAILABLE):
            coord = state_of(param).coord
            if coord is not None and coord.running:  # (not running: nothing to gather, e.g. under DeepCompile)
                _fetch(coord, param)
        return param


@torch.compiler.disable
def _fetch(coord: Any, param: torch.nn.Parameter) -> None:
    """`coord.fetch_on_access`, never traced under `torch.compile` (see `ds_zero._schedule.hooks._gather_for`)."""
    coord.fetch_on_access(param)


def install_param_dict(module: torch.nn.Module) -> None:
    """Swap `module._parameters` for a `ZeroParamDict` (same contents)."""
    if not isinstance(module._parameters, ZeroParamDict):
        module._parameters = ZeroParamDict(module, module._parameters)


def ensure_zero_ordered_dict(module: Any) -> None:
    """Give `module` a `ZeroParamDict` as `_parameters` unless it has one (DeepSpeed's helper of that name).

    Idempotent: an existing `ZeroParamDict` is kept as it is, and a missing, None or non-dict
    `_parameters` is left alone. The first container replaced is kept as `module._original_parameters`
    (a later call never overwrites it), where DeepSpeed keeps it for code that restores it.
    """
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeroParamDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ZeroParamDict(module, params)
