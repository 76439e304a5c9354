"""ZenFlow's own checkpoint state, shared by both ZenFlow optimizers: the selective optimizer's.

The selective AdamW keeps its moments in `optimizer.state` (device moments) or, with `zenflow.offload`,
on each parameter as `exp_avg_cpu_data` / `exp_avg_sq_cpu_data` (host moments), which torch's
`Optimizer.state_dict()` does not see. `selective_state` saves both (copies, so a save taken mid-run
is not changed by the steps after it) and `load_selective_state` restores both, by parameter position.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["load_selective_state", "selective_state"]

_HOST_MOMENTS = ("exp_avg_cpu_data", "exp_avg_sq_cpu_data")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def selective_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The selective optimizer's state dict and host moments (copies), by parameter position."""
    host = []
    for p in _params(optimizer):
        moments = [getattr(p, name, None) for name in _HOST_MOMENTS]
        kept = [m.detach().clone() for m in moments if m is not None]
        host.append(kept if len(kept) == len(moments) else None)
    return {"optimizer": copy.deepcopy(optimizer.state_dict()), "host_moments": host}


def load_selective_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Restore what `selective_state` saved (the parameters must already have their current dtype: torch
    casts the loaded moments to it). A stage-1/2 save from before host moments were kept is a bare
    `Optimizer.state_dict()`; it loads as that.

    Raises:
        ValueError: the saved state is for another number of parameters.
    """
    if "host_moments" not in saved:  # an older save: the torch state dict alone
        optimizer.load_state_dict(dict(saved))
        return
    params = _params(optimizer)
    host = saved["host_moments"]
    if len(host) != len(params):
        raise ValueError(
            f"zero_optimization.zenflow: the checkpoint's selective optimizer has {len(host)} parameters, this "
            f"one {len(params)}; resume with the same model and param groups"
        )
    optimizer.load_state_dict(saved["optimizer"])
    for p, moments in zip(params, host, strict=True):
        for name, value in zip(_HOST_MOMENTS, moments or (None, None), strict=True):
            setattr(p, name, None if value is None else value.clone())
