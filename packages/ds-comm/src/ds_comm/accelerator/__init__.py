"""Accelerator selection: `get_accelerator()` picks cuda or cpu, or what `DS_ACCELERATOR` names.

DeepSpeed's per-device modules live beside this one under their DeepSpeed names (`cpu_accelerator`,
`cuda_accelerator`, `xpu_accelerator`, `npu_accelerator`, ...), each holding one `<NAME>_Accelerator`;
`DS_ACCELERATOR` may name any of them.
"""

from __future__ import annotations

import os

import torch

from ds_comm.accelerator._abstract import Accelerator
from ds_comm.accelerator._cpu import CpuAccelerator
from ds_comm.accelerator._cuda import CudaAccelerator
from ds_comm.accelerator.hpu_accelerator import HPU_Accelerator
from ds_comm.accelerator.klxpu_accelerator import KLXPU_Accelerator
from ds_comm.accelerator.mlu_accelerator import MLU_Accelerator
from ds_comm.accelerator.mps_accelerator import MPS_Accelerator
from ds_comm.accelerator.npu_accelerator import NPU_Accelerator
from ds_comm.accelerator.sdaa_accelerator import SDAA_Accelerator
from ds_comm.accelerator.supa_accelerator import SUPA_Accelerator
from ds_comm.accelerator.xpu_accelerator import XPU_Accelerator

__all__ = [
    "SUPPORTED_ACCELERATOR_LIST",
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

_IMPLEMENTATIONS: dict[str, type[Accelerator]] = {
    "cpu": CpuAccelerator,
    "cuda": CudaAccelerator,
    "hpu": HPU_Accelerator,
    "klxpu": KLXPU_Accelerator,
    "mlu": MLU_Accelerator,
    "mps": MPS_Accelerator,
    "npu": NPU_Accelerator,
    "sdaa": SDAA_Accelerator,
    "supa": SUPA_Accelerator,
    "xpu": XPU_Accelerator,
}
#: The accelerator names `DS_ACCELERATOR` accepts (DeepSpeed's list).
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

    `DS_ACCELERATOR` (any of `SUPPORTED_ACCELERATOR_LIST`) forces a choice; otherwise cuda when a device is
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
