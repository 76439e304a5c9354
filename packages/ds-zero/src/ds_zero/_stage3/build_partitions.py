"""Build ZeRO-3's partitions from the base optimizer's param groups, one `ShardPartition` per group and placement.

Checks first that every parameter is one the optimizer's module partitioned, and none sits in two groups;
then splits each group's trainable parameters into the tiles kept on the accelerator and those offloaded
(`offload_optimizer.ratio < 1`, `_stage3.partial_offload`), and points the base optimizer's groups at the
tiles' fp32 masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import ds_comm
from ds_zero._params.partitioned_param import is_zero_param, state_of
from ds_zero._stage3.partition import ShardPartition

if TYPE_CHECKING:
    from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3

__all__ = ["build_partitions"]


def build_partitions(opt: DeepSpeedZeroOptimizer_Stage3, swap_master: bool) -> list[ShardPartition]:
    """The partitions of `opt`'s param groups (`swap_master`: the fp32 masters live in NVMe swap files).

    Raises:
        ValueError: a group holds a parameter of another module, or a parameter is in two groups.
    """
    master_device = torch.device("cpu") if opt.offload_optimizer else None
    partitions: list[ShardPartition] = []
    trainable_by_group: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    for gi, group in enumerate(opt.optimizer.param_groups):
        trainable = []
        for p in group["params"]:
            if not is_zero_param(p) or state_of(p).coord is not opt.coordinator:
                raise ValueError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} that "
                    "is not a parameter of the module given to DeepSpeedZeroOptimizer_Stage3; "
                    "build the optimizer over module.parameters()"
                )
            if id(p) in seen:
                raise ValueError(f"parameter {state_of(p).name} appears in more than one optimizer param group")
            seen.add(id(p))
            if p.requires_grad:
                trainable.append(p)
        trainable_by_group.append(trainable)
    # offload_optimizer.ratio < 1: each group's leading tiles stay on the accelerator (`_stage3.partial_offload`)
    for gi, pieces in enumerate(opt._placement.split(trainable_by_group)):
        parts = [
            ShardPartition(
                gi,
                params,
                master_device=ds_comm.get_accelerator().device() if on_device else master_device,
                master_dtype=opt.master_weights_and_grads_dtype,
                sub_group_size=opt.config.sub_group_size,
                swap_master=swap_master,
                pin_master=opt.config.offload_optimizer_or_default.pin_memory,
                index=opt.partition_index,
                own_master=opt._runs_zenflow,
            )
            for params, on_device in pieces
        ]
        opt.optimizer.param_groups[gi]["params"] = [tile.master for part in parts for tile in part.tiles]
        partitions += parts
        opt._placement.place(parts, [on_device for _, on_device in pieces])
    return partitions
