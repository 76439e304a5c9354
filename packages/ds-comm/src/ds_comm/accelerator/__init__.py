"""Accelerator selection: `get_accelerator()` picks cuda or cpu, or what `DS_ACCELERATOR` names."""

from __future__ import annotations

import os

import torch

from ds_comm.accelerator._abstract import Accelerator
from ds_comm.accelerator._cpu import CpuAccelerator
from ds_comm.accelerator._cuda import CudaAccelerator

__all__ = [
    "SUPPORTED_ACCELERATOR_LIST",
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

_IMPLEMENTATIONS: dict[str, type[Accelerator]] = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}
#: The accelerator names ds implements (DeepSpeed's list also names xpu, npu, mps, hpu, ...).
SUPPORTED_ACCELERATOR_LIST = sorted(_IMPLEMENTATIONS)
_current: Accelerator | None = None


def _choose() -> Accelerator:
    requested = os.environ.get("DS_ACCELERATOR")
    if requested is not None:
        key = requested.strip().lower()
        if key not in _IMPLEMENTATIONS:
            valid = ", ".join(sorted(_IMPLEMENTATIONS))
            raise ValueError(f"DS_ACCELERATOR={requested!r} is not a known accelerator; valid values: {valid}")
        accelerator = _IMPLEMENTATIONS[key]()
        if not accelerator.is_available():
            raise RuntimeError(f"DS_ACCELERATOR={requested!r} was requested but no {key} device is available here")
        return accelerator
    if torch.cuda.is_available():
        return CudaAccelerator()
    return CpuAccelerator()


def get_accelerator() -> Accelerator:
    """The accelerator for this process, chosen on first call and then fixed.

    `DS_ACCELERATOR` (`cpu` or `cuda`) forces a choice; otherwise cuda when a device is
    visible, else cpu.

    Raises:
        ValueError: `DS_ACCELERATOR` names an unknown accelerator (the message lists the valid ones).
        RuntimeError: `DS_ACCELERATOR` names one that is not available on this host.
    """
    global _current
    if _current is None:
        _current = _choose()
    return _current


def set_accelerator(accelerator: Accelerator | None) -> None:
    """Replace the process-wide accelerator (None: choose again on next `get_accelerator()`)."""
    global _current
    _current = accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator's device type is one ds implements (DeepSpeed's check, by device name)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
