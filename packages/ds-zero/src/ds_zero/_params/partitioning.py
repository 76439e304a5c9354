"""`partition_param`: turn a plain `nn.Parameter` into a stage-3 partitioned one, in place.

The conversion sits above everything a partitioned parameter is made of: its state (`partitioned_param`),
its consumer view (`active_consumers`) and DeepSpeed's per-parameter methods (`param_methods`, which build
on the gather). Keeping it out of `partitioned_param` lets the gather and `GatheredParameters` build on the
state without the state module reaching back up to bind methods that are built from them.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._params.active_consumers import ActiveConsumers
from ds_zero._params.param_methods import bind_param_methods
from ds_zero._params.partitioned_param import (
    ZeroParamState,
    ZeroParamStatus,
    ZeroParamType,
    is_zero_param,
    shard_numel,
)

__all__ = ["partition_param"]

_ids = itertools.count()


def partition_param(
    param: torch.nn.Parameter,
    *,
    group: ProcessGroup | None,
    shard_device: torch.device | None = None,
    compute_device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    pin_memory: bool = False,
    out: torch.Tensor | None = None,
) -> None:
    """Turn `param` into a partitioned parameter in place; keeps only this rank's shard.

    Args:
        param: a parameter holding its full, initialised values on the compute device.
        group: the data-parallel group the parameter is split across (None: the world).
        shard_device: where `ds_tensor` lives ("cpu" for parameter offload; None: the compute device).
        compute_device: where the full values are gathered for compute (None: where the parameter is).
        dtype: cast floating-point parameters to this dtype (None keeps theirs).
        pin_memory: page-lock a CPU shard (faster host-to-device copies; no effect on a CPU-only host).
        out: a 1-D tensor of `ceil(numel / N)` elements (dtype and device as the shard) to hold the shard,
            so that many shards can share one buffer.
    """
    if is_zero_param(param):
        return
    world = ds_comm.get_world_size(group)
    rank = ds_comm.get_rank(group)
    data = param.data
    compute_device = torch.device(compute_device) if compute_device is not None else data.device
    shard_device = torch.device(shard_device) if shard_device is not None else compute_device
    target = dtype if (dtype is not None and data.is_floating_point()) else data.dtype
    numel = data.numel()
    s = shard_numel(numel, world)
    with torch.no_grad():
        flat = data.reshape(-1)
        shard = torch.empty(s, dtype=target, device=shard_device) if out is None else out
        start, end = min(rank * s, numel), min((rank + 1) * s, numel)
        if end > start:
            shard[: end - start].copy_(flat[start:end])
        shard[end - start :].zero_()
        if pin_memory and out is None and shard.device.type == "cpu":
            shard = ds_comm.get_accelerator().pin_memory(shard)
    param.ds_id = next(_ids)
    param.ds_shape = data.shape
    param.ds_numel = numel
    param.ds_process_group = group
    param.ds_zero_partition_rank = rank  # DeepSpeed's names for where the shard sits in `group`
    param.ds_zero_partition_world_size = world
    param.ds_tensor = shard
    param.ds_persist = False
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE  # the one status not reached by a transition
    param.ds_param_type = ZeroParamType.PARTITIONED
    param.ds_secondary_tensor = None
    param.is_external_param = False
    state = ZeroParamState.released(
        param,
        name=f"<parameter {param.ds_id} of shape {tuple(data.shape)}>",
        shard_numel=s,
        world_size=world,
        rank=rank,
        offload=shard_device != compute_device,
        shape=data.shape,
        device=compute_device,
        dtype=target,
    )
    param._ds_state = state
    param.data = state.placeholder
    param.ds_active_sub_modules = ActiveConsumers(param.ds_id, state)
    bind_param_methods(param)
    del data, flat
