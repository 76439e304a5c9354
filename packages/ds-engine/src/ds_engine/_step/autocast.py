"""The `torch_autocast` section at work: the engine's forward under `torch.autocast`, and which parameters
are lower-precision safe (tagged with the dtype their gradients may be communicated in).

[Note: autocast versus fp16/bf16] fp16/bf16 cast the parameters once and keep fp32 masters; `torch_autocast`
leaves the parameters in their dtype (fp32, typically) and lets torch run each op of the forward in the
autocast dtype where that is safe (matmuls, convolutions) and in fp32 where it is not (reductions, norms).
The gradients then come back in the parameters' dtype. The parameters of the module classes named
lower-precision safe (Linear and Conv by default) carry a `comm_dtype` attribute with the autocast dtype:
the dtype their gradients may travel in (DeepSpeed's ZeRO reduces them in it; ds reduces every gradient
in its own dtype, see `runtime/torch_autocast.py`).

[Note: autocast already on outside the engine] If the caller's code already runs under `torch.autocast`,
the engine's configuration wins inside `engine(...)`: an enabled section switches to its dtype, and a
disabled one turns autocast off, because DeepSpeed's fp16/bf16 modes expect the module to run as cast.
Both are said once in the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

import ds_comm
from ds_engine.config import DeepSpeedConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "LOWER_PRECISION_SAFE_MODULES",
    "PARAM_COMM_DTYPE_ATTR_NAME",
    "AutocastPolicy",
    "initialized_autocast_dtype",
    "mark_lower_precision_params",
    "resolve_module_classes",
]

#: The module classes whose parameters are lower-precision safe when the config names none.
LOWER_PRECISION_SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

#: The parameter attribute holding the dtype its gradient may be communicated in.
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"

_KEY = "torch_autocast.lower_precision_safe_modules"

# The autocast dtype of the last engine built with the section enabled (DeepSpeed's process-wide record,
# which its ZeRO code and users query through `runtime.torch_autocast`); None before any.
_last_autocast_dtype: torch.dtype | None = None


def initialized_autocast_dtype() -> torch.dtype | None:
    """The autocast dtype `mark_lower_precision_params` last tagged with in this process, or None."""
    return _last_autocast_dtype


def resolve_module_classes(names: Sequence[str] | None) -> tuple[type[nn.Module], ...]:
    """The classes `torch_autocast.lower_precision_safe_modules` names (`"torch.nn.Linear"`), or the defaults.

    Raises:
        DeepSpeedConfigError: a name that is not `package.Class`, does not import, or is not an `nn.Module`
            subclass (the message gives its index in the list).
    """
    if names is None:
        return LOWER_PRECISION_SAFE_MODULES
    classes = []
    for i, name in enumerate(names):
        module_name, _, class_name = name.rpartition(".")
        if not module_name:
            raise DeepSpeedConfigError(f"{_KEY}[{i}]: {name!r} is not a qualified class name (package.Class)")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as err:
            raise DeepSpeedConfigError(f"{_KEY}[{i}]: cannot import {name!r} ({err})") from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise DeepSpeedConfigError(f"{_KEY}[{i}]: {name!r} is not a torch.nn.Module subclass")
        classes.append(cls)
    return tuple(classes)


def mark_lower_precision_params(
    model: nn.Module, dtype: torch.dtype, classes: Sequence[type[nn.Module]]
) -> list[nn.Parameter]:
    """Tag the direct parameters of every module whose class is exactly one of `classes` with `comm_dtype=dtype`.

    Exact classes, as DeepSpeed matches them: a subclass of Linear with its own forward may not be safe.
    Records `dtype` as the process's autocast dtype (`initialized_autocast_dtype`). Returns the tagged parameters.
    """
    global _last_autocast_dtype
    _last_autocast_dtype = dtype
    wanted = set(classes)
    marked = []
    for module in model.modules():
        if type(module) in wanted:
            for p in module.parameters(recurse=False):
                setattr(p, PARAM_COMM_DTYPE_ATTR_NAME, dtype)
                marked.append(p)
    return marked


@dataclasses.dataclass
class AutocastPolicy:
    """How `engine.forward` runs the module: under `torch.autocast(device_type, dtype)` when `enabled`.

    Attributes:
        device_type: the accelerator's device type ("cpu", "cuda").
        enabled: the `torch_autocast.enabled` switch.
        dtype: the autocast dtype (fp16 or bf16) when enabled.
    """

    device_type: str
    enabled: bool = False
    dtype: torch.dtype | None = None
    _told: bool = dataclasses.field(default=False, repr=False)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """The context `engine.forward` runs the module in (the module note says what an outer autocast gets)."""
        outer = torch.is_autocast_enabled(self.device_type)
        if self.enabled:
            if outer:
                self._tell_once(logging.INFO, "switching to the torch_autocast section's settings inside the engine")
            with torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=True):
                yield
        elif outer:
            self._tell_once(
                logging.WARNING,
                "the torch_autocast section is disabled, so autocast is off inside the engine (fp16/bf16 run the "
                "module as cast); enable the torch_autocast section to use torch's autocast",
            )
            with torch.autocast(device_type=self.device_type, enabled=False):
                yield
        else:
            yield

    def _tell_once(self, level: int, what: str) -> None:
        if not self._told:
            self._told = True
            if not ds_comm.is_initialized() or ds_comm.get_rank() == 0:
                logger.log(level, "torch.autocast is already enabled outside the engine: %s", what)
