"""Scheduler names from the config: DeepSpeed's five, else a `torch.optim.lr_scheduler` class; checked first."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch

from ds_engine._optim import lr_schedules
from ds_engine._optim.optimizers import ParamError

__all__ = ["build_config_scheduler", "check_scheduler_params", "scheduler_class"]

_DS_SCHEDULES: dict[str, type] = {name: getattr(lr_schedules, name) for name in lr_schedules.VALID_LR_SCHEDULES}


def _torch_schedules() -> list[str]:
    base = torch.optim.lr_scheduler.LRScheduler
    mod = torch.optim.lr_scheduler
    return sorted(
        n
        for n in dir(mod)
        if isinstance(getattr(mod, n), type)
        and issubclass(getattr(mod, n), base)
        and not n.startswith("_")
        and n != "LRScheduler"
    )


def scheduler_class(kind: str) -> type:
    """The class for `scheduler.type`.

    Raises:
        ValueError: an unknown name, with the closest known one.
    """
    if kind in _DS_SCHEDULES:
        return _DS_SCHEDULES[kind]
    torch_names = _torch_schedules()
    if kind in torch_names:
        return getattr(torch.optim.lr_scheduler, kind)
    names = [*_DS_SCHEDULES, *torch_names]
    close = [n for n in names if n.lower() == kind.lower()] or difflib.get_close_matches(kind, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"{kind!r} is not a known lr scheduler (DeepSpeed's: {', '.join(_DS_SCHEDULES)}; or a "
        f"torch.optim.lr_scheduler class){hint}"
    )


def check_scheduler_params(kind: str, params: dict[str, Any]) -> None:
    """Refuse unknown keyword arguments and report missing required ones, by name.

    Raises:
        ValueError: `"'warmup_num_step' is not a parameter of WarmupLR; did you mean 'warmup_num_steps'?"`.
    """
    signature = inspect.signature(scheduler_class(kind).__init__)
    named = {
        n: p
        for n, p in signature.parameters.items()
        if n not in ("self", "optimizer")
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    for key in params:
        if key not in named and not takes_any:
            close = difflib.get_close_matches(key, sorted(named), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; accepted: {', '.join(sorted(named))}"
            raise ParamError(key, f"{key!r} is not a parameter of {kind}{hint}")
    missing = [n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in params]
    if missing:
        raise ParamError(missing[0], f"{kind} needs {', '.join(repr(m) for m in missing)}")


def build_config_scheduler(kind: str, params: dict[str, Any], optimizer: Any) -> Any:
    """Construct `kind(optimizer, **params)`; `optimizer` is the base torch optimizer (its groups are shared)."""
    return scheduler_class(kind)(optimizer, **params)
