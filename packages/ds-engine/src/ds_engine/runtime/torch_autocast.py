"""`deepspeed.runtime.torch_autocast`: the `torch_autocast` section's helpers under DeepSpeed's names.

`init_autocast_params(engine, dtype, names)` tags the parameters of the lower-precision-safe module classes
(`names`, qualified class names; None: Linear and Conv1d/2d/3d) with `comm_dtype=dtype`; `get_comm_dtype(p)`
reads the tag (the parameter's own dtype without one). `autocast_if_enabled(engine)` is the context the
engine's forward runs in. initialize() does both when `torch_autocast.enabled` is true (`_step/autocast.py`).

Deliberate difference: DeepSpeed's ZeRO reduces the tagged parameters' gradients in their `comm_dtype`;
ds reduces every gradient in its own dtype (or `communication_data_type`), so the tag is informational here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ds_comm import get_accelerator
from ds_engine._step.autocast import (
    LOWER_PRECISION_SAFE_MODULES,
    PARAM_COMM_DTYPE_ATTR_NAME,
    AutocastPolicy,
    initialized_autocast_dtype,
    mark_lower_precision_params,
    resolve_module_classes,
)

__all__ = [
    "LOWER_PRECISION_SAFE_MODULES",
    "PARAM_COMM_DTYPE_ATTR_NAME",
    "autocast_if_enabled",
    "get_all_comm_dtypes",
    "get_autocast_dtype",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
    "init_autocast_params",
    "is_autocast_initialized",
    "sort_dtypes",
]


def init_autocast_params(engine: Any, dtype: torch.dtype, lower_precision_safe_modules: Sequence[str] | None) -> None:
    """Tag `engine.module`'s lower-precision-safe parameters with `comm_dtype=dtype`.

    Raises:
        DeepSpeedConfigError: a class name in `lower_precision_safe_modules` does not resolve.
    """
    mark_lower_precision_params(engine.module, dtype, resolve_module_classes(lower_precision_safe_modules))


def is_autocast_initialized() -> bool:
    """Whether an engine (or `init_autocast_params`) has tagged parameters for autocast in this process."""
    return initialized_autocast_dtype() is not None


def get_autocast_dtype() -> torch.dtype | None:
    """The autocast dtype parameters were last tagged with, or None."""
    return initialized_autocast_dtype()


def get_default_autocast_lower_precision_modules() -> list[str]:
    """The default lower-precision-safe classes by qualified name (`"torch.nn.modules.linear.Linear"`, ...)."""
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def has_comm_dtype(param: torch.Tensor) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype `param`'s gradient may travel in: its `comm_dtype` tag, else its own dtype."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable[torch.Tensor]) -> set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    """`dtypes` in one order every rank agrees on (by name), for per-dtype collectives."""
    return sorted(dtypes, key=str)


@contextlib.contextmanager
def autocast_if_enabled(engine: Any) -> Iterator[None]:
    """Run the body as `engine.forward` runs the module (`_step/autocast.py`'s note on an outer autocast)."""
    policy = getattr(engine, "_autocast", None)
    if not isinstance(policy, AutocastPolicy):
        enabled = bool(engine.torch_autocast_enabled())
        policy = AutocastPolicy(
            get_accelerator().device_name(), enabled, engine.torch_autocast_dtype() if enabled else None
        )
    with policy.forward_context():
        yield
