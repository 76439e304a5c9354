"""The dtype of the ZeRO master weights, their gradient partition and (through the base optimizer) its state.

By default the masters are fp32. `bf16_master_weights_and_gradients` (the `bf16.bf16_master_weights_and_grads`
config key) keeps them and the gradient partition in bf16, and `bf16_optimizer_states`
(`bf16.bf16_optimizer_states`) accepts that the base optimizer's moments follow them into bf16 (a torch
optimizer creates its state like its parameters). Together that is 8 bytes of model state per trained
element on a rank's partition (2 master + 2 gradient + 2 + 2 Adam moments) instead of 16.

[Note: a bf16 master over a bf16 model] With a bf16 model and bf16 masters the master partition is this
rank's slice of the model's own flat buffer (no copy), as for fp32 training: the optimizer updates the
model in place.

DeepSpeed 0.19.8 makes the same choices with the same refusals: bf16 optimizer states need bf16 masters,
and bf16 masters whose optimizer states stay fp32 need optimizer offload with its CPU Adam keeping fp32
moments on the host. ds refuses that last combination, and bf16 masters with any optimizer offload, as not
implemented.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["MASTERS_KEY", "STATES_KEY", "dtype_name", "master_weights_dtype", "note_master_conversion"]

MASTERS_KEY = "bf16.bf16_master_weights_and_grads"
STATES_KEY = "bf16.bf16_optimizer_states"


def master_weights_dtype(
    *,
    bf16_master_weights_and_gradients: bool,
    bf16_optimizer_states: bool,
    offload_device: str,
) -> torch.dtype:
    """torch.bfloat16 or torch.float32 for the masters and gradient partitions, after refusing what cannot work.

    Args:
        bf16_master_weights_and_gradients: bf16 masters and gradient partitions.
        bf16_optimizer_states: bf16 optimizer moments (needs bf16 masters).
        offload_device: `zero_optimization.offload_optimizer.device` ("none", "cpu" or "nvme").

    Raises:
        ValueError: a combination DeepSpeed refuses, or one ds does not implement; the message names the key.
    """
    if bf16_optimizer_states and not bf16_master_weights_and_gradients:
        raise ValueError(
            f"{STATES_KEY}=true needs {MASTERS_KEY}=true (the moments follow the master weights' dtype); set "
            f"{MASTERS_KEY} to true as well, or drop {STATES_KEY}"
        )
    if not bf16_master_weights_and_gradients:
        return torch.float32
    if offload_device != "none":
        raise ValueError(
            f"{MASTERS_KEY}=true with zero_optimization.offload_optimizer.device={offload_device!r} is not "
            "implemented in ds (DeepSpeed needs its CPU Adam for it); keep the optimizer on the device "
            "(offload_optimizer.device 'none'), or turn bf16_master_weights_and_grads off"
        )
    if not bf16_optimizer_states:
        raise ValueError(
            f"{MASTERS_KEY}=true with {STATES_KEY}=false keeps fp32 moments beside bf16 masters, which "
            "DeepSpeed allows only with zero_optimization.offload_optimizer.device='cpu' and its CPU Adam; ds "
            f"does not implement that: set {STATES_KEY} to true as well, or turn {MASTERS_KEY} off"
        )
    return torch.bfloat16


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
