"""What both ZenFlow optimizers (ZeRO 1/2 and ZeRO 3) check before building anything, and the selective
optimizer's hyper-parameters."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_zenflow_setup", "group_hyper_params", "selective_params"]

_KEY = "zero_optimization.zenflow"
_SELECTIVE_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def check_zenflow_setup(
    optimizer: Any, config: Any, zenflow: Any, kwargs: Mapping[str, Any], *, stages: tuple[int, ...], owner: str
) -> None:
    """Refuse what `owner` (a ZenFlow optimizer for `stages`) cannot run, naming the key.

    Raises:
        ValueError: no zenflow section, another stage, no CPU optimizer offload, `zenflow.offload` without
            `overlap_comm`, or per-group partition groups (MoE).
        TypeError: the base optimizer's `step` takes no `step_id`.
    """
    if zenflow is None:
        raise ValueError(f"{_KEY} is not set: {owner} needs the section; build the plain ZeRO optimizer without it")
    if config.stage not in stages:
        other = "ZenFlowZeroOptimizer_Stage3" if config.stage == 3 else "ZenFlowZeroOptimizer"
        raise ValueError(
            f"zero_optimization.stage={config.stage}: {owner} handles stage(s) {', '.join(map(str, stages))}; "
            f"use ds_zero.{other}"
        )
    if config.offload_optimizer_device != "cpu":
        raise ValueError(
            f'{_KEY} needs zero_optimization.offload_optimizer.device "cpu" (the unimportant gradients are '
            f"applied by the CPU optimizer), got {config.offload_optimizer_device!r}"
        )
    if zenflow.offload and not config.overlap_comm:
        raise ValueError(
            f"{_KEY}.offload=true (the selective optimizer's moments on the host) needs "
            "zero_optimization.overlap_comm=true, as in DeepSpeed"
        )
    if kwargs.get("partition_groups") is not None:
        raise ValueError(
            f"{_KEY} with per-group partition groups (mixture-of-experts parameters) is not supported; "
            "remove the zenflow section for MoE models"
        )
    step = getattr(optimizer, "step", None)
    try:
        takes_step_id = step is not None and "step_id" in inspect.signature(step).parameters
    except (TypeError, ValueError):
        takes_step_id = False
    if not takes_step_id:
        raise TypeError(
            f"{_KEY}: the base optimizer {type(optimizer).__name__} has no step(step_id=...); ZenFlow's CPU "
            "update counts Adam's bias correction by micro step: use ds_ops.ZenFlowCPUAdam (the optimizer "
            'section "Adam"/"AdamW" builds it)'
        )


def selective_params(optimizer: torch.optim.Optimizer, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The selective AdamW's hyper-parameters: from `given` (the config's optimizer params) or group 0's."""
    if given is not None:
        return {k: given[k] for k in _SELECTIVE_KEYS if k in given}
    group = optimizer.param_groups[0]
    return {k: group[k] for k in _SELECTIVE_KEYS if k in group}


def group_hyper_params(group: Mapping[str, Any]) -> dict[str, Any]:
    """The selective AdamW's hyper-parameters found in one base optimizer param group."""
    return {k: group[k] for k in _SELECTIVE_KEYS if k in group}
