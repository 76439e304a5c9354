"""The dtype of the ZeRO master weights, their gradient partition and (through the base optimizer) its state.

By default the masters are fp32. `bf16_master_weights_and_gradients` (the `bf16.bf16_master_weights_and_grads`
config key) keeps them and the gradient partition in bf16, and `bf16_optimizer_states`
(`bf16.bf16_optimizer_states`) accepts that the base optimizer's moments follow them into bf16 (a torch
optimizer creates its state like its parameters). Together that is 8 bytes of model state per trained
element on a rank's partition (2 master + 2 gradient + 2 + 2 Adam moments) instead of 16.

[Note: a bf16 master over a bf16 model] With a bf16 model and bf16 masters the master partition is this
rank's slice of the model's own flat buffer (no copy), as for fp32 training: the optimizer updates the
model in place.

DeepSpeed 0.19.8's rules, which ds keeps: bf16 optimizer states need bf16 masters; bf16 masters whose moments
stay fp32 (`bf16_optimizer_states` off) need optimizer offload to the CPU with `DeepSpeedCPUAdam` as the base
optimizer, which keeps fp32 moments beside the bf16 host masters; bf16 masters and moments with optimizer offload
need `DeepSpeedCPUAdam(fp32_optimizer_states=False)`, so its moments really are bf16 (the engine builds it so).
The CPU Adam steps the bf16 host masters with the bf16 gradient partition in one pass (fp32 arithmetic inside,
rounded to bf16 on store). Offload to NVMe is refused with bf16 masters: ds's NVMe swapper pages fp32 masters.

`fp16_master_weights_and_gradients` (`fp16.fp16_master_weights_and_grads`) is DeepSpeed's fp16 twin for fp16
training: fp16 masters and gradient partitions on the host, fp32 moments in `DeepSpeedCPUAdam`, so it needs
optimizer offload to the CPU with that optimizer, as in DeepSpeed; the two master options exclude each other.
The gradient partitions hold the loss-scaled gradients in fp16 (an overflow there is a skipped step, as for
the model's own fp16 gradients).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "FP16_MASTERS_KEY",
    "MASTERS_KEY",
    "STATES_KEY",
    "dtype_name",
    "master_weights_dtype",
    "note_master_conversion",
]

MASTERS_KEY = "bf16.bf16_master_weights_and_grads"
STATES_KEY = "bf16.bf16_optimizer_states"
FP16_MASTERS_KEY = "fp16.fp16_master_weights_and_grads"


def master_weights_dtype(
    *,
    bf16_master_weights_and_gradients: bool,
    bf16_optimizer_states: bool,
    offload_device: str,
    optimizer: object | None = None,
    fp16_master_weights_and_gradients: bool = False,
) -> torch.dtype:
    """torch.bfloat16, torch.float16 or torch.float32 for the masters and gradient partitions, after refusing
    what cannot work.

    Args:
        bf16_master_weights_and_gradients: bf16 masters and gradient partitions.
        bf16_optimizer_states: bf16 optimizer moments (needs bf16 masters).
        offload_device: `zero_optimization.offload_optimizer.device` ("none", "cpu" or "nvme").
        optimizer: the base optimizer; with bf16 or fp16 masters on the CPU it must be `ds_ops.DeepSpeedCPUAdam`.
        fp16_master_weights_and_gradients: fp16 masters and gradient partitions (CPU offload only).

    Raises:
        ValueError: a combination DeepSpeed refuses, or one ds does not implement; the message names the key.
    """
    if fp16_master_weights_and_gradients:
        return _fp16_masters(bf16_master_weights_and_gradients or bf16_optimizer_states, offload_device, optimizer)
    if bf16_optimizer_states and not bf16_master_weights_and_gradients:
        raise ValueError(
            f"{STATES_KEY}=true needs {MASTERS_KEY}=true (the moments follow the master weights' dtype); set "
            f"{MASTERS_KEY} to true as well, or drop {STATES_KEY}"
        )
    if not bf16_master_weights_and_gradients:
        return torch.float32
    if bf16_optimizer_states and offload_device == "none":
        return torch.bfloat16
    if offload_device == "none":
        raise ValueError(
            f"{MASTERS_KEY}=true with {STATES_KEY}=false keeps fp32 moments beside bf16 masters, which needs "
            "zero_optimization.offload_optimizer.device 'cpu' or 'nvme' with DeepSpeedCPUAdam (as in DeepSpeed): "
            f"offload the optimizer, or set {STATES_KEY} to true as well"
        )
    _check_cpu_adam(optimizer, MASTERS_KEY, bf16_optimizer_states=bf16_optimizer_states)
    return torch.bfloat16


def _fp16_masters(bf16_too: bool, offload_device: str, optimizer: object | None) -> torch.dtype:
    """DeepSpeed's rules for fp16 masters: not with the bf16 options, CPU optimizer offload with DeepSpeedCPUAdam."""
    if bf16_too:
        raise ValueError(
            f"{FP16_MASTERS_KEY}=true and {MASTERS_KEY} / {STATES_KEY} exclude each other (as in DeepSpeed); keep "
            "the one that matches the training precision"
        )
    if offload_device not in ("cpu", "nvme"):
        raise ValueError(
            f"{FP16_MASTERS_KEY}=true keeps fp32 moments beside fp16 masters on the host, which needs "
            f"zero_optimization.offload_optimizer.device 'cpu' or 'nvme' with DeepSpeedCPUAdam (as in DeepSpeed), "
            f"got {offload_device!r}"
        )
    _check_cpu_adam(optimizer, FP16_MASTERS_KEY)
    return torch.float16


def _check_cpu_adam(optimizer: object | None, key: str, *, bf16_optimizer_states: bool = False) -> None:
    """bf16 or fp16 masters (`key`) on the host are stepped by DeepSpeedCPUAdam only (DeepSpeed checks the exact
    class), and with `bf16_optimizer_states` it must keep its moments in the parameters' bf16."""
    if optimizer is None:
        return
    import ds_ops

    if type(optimizer) is not ds_ops.DeepSpeedCPUAdam:
        raise ValueError(
            f"{key}=true with optimizer offload needs DeepSpeedCPUAdam as the base optimizer (as in "
            f"DeepSpeed), got {type(optimizer).__name__}; configure optimizer.type Adam/AdamW without torch_adam, "
            f"or pass ds_ops.DeepSpeedCPUAdam"
        )
    if bf16_optimizer_states and getattr(optimizer, "fp32_optimizer_states", True):
        raise ValueError(
            f"{STATES_KEY}=true with optimizer offload needs DeepSpeedCPUAdam(fp32_optimizer_states=False), so the "
            "moments are stored in bf16; build it so (the engine does for a configured optimizer), or drop "
            f"{STATES_KEY}"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """ "bfloat16" for torch.bfloat16: how a checkpoint records the masters' dtype (`master_dtype`)."""
    return str(dtype).removeprefix("torch.")


def note_master_conversion(saved: Mapping[str, Any], dtype: torch.dtype) -> None:
    """Say when a checkpoint's masters were trained in another dtype than this run's: they are converted.

    The saved partitions are fp32 either way (bf16 values widen exactly), and the base optimizer's
    `load_state_dict` casts saved moments to the dtype of its parameters (the masters), so a bf16-master
    checkpoint resumes an fp32-master run exactly as saved, and an fp32-master checkpoint resumes a
    bf16-master run rounded to bf16, as DeepSpeed converts both on load. A checkpoint without the key
    predates bf16 masters: its masters were fp32.
    """
    was = str(saved.get("master_dtype", "float32"))
    now = dtype_name(dtype)
    if was != now:
        logger.warning(
            "the checkpoint's master weights and optimizer state were trained in %s; this run keeps them in %s "
            "(%s), so they are converted on load",
            was,
            now,
            MASTERS_KEY,
        )
