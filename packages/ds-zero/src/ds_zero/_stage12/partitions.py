"""This rank's fp32 master and gradient partitions (on the device, or on the host with optimizer offload),
and the step that updates them and writes the result back into the model dtype.

[Note: no second copy in fp32] With an fp32 model and no offload, the master partition IS this rank's
partition of the model's flat buffer (a view), so the base optimizer updates the model in place and no
fp32 copy exists: parameters + master cost 1 copy, where DeepSpeed keeps a full model-dtype replica plus
an fp32 partition (1.5 copies on 2 ranks). With bf16/fp16 the master is a separate fp32 partition, unless
`bf16_master_weights_and_grads` keeps bf16 masters over a bf16 model: then it is the view again. With
`offload_optimizer.device == "cpu"` the master, gradient partition and optimizer state live in host
buffers (pinned when `pin_memory` and pinning does something, see ds_zero._host_buffers), and the step
runs there.
"""

from __future__ import annotations

import logging

import torch

from ds_ops import supports_in_pass_copy
from ds_zero._blocked_adam import step_in_blocks
from ds_zero._host_buffers import offload_zeros
from ds_zero._stage12.flat_buffer import FlatParamGroup

logger = logging.getLogger(__name__)

__all__ = ["PartitionUpdater", "build_grad_partitions", "build_master_partitions"]


def build_master_partitions(
    flats: list[FlatParamGroup], *, offload: bool, pin_memory: bool, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """The master partition of each group, in `dtype` (fp32, or bf16 with `bf16_master_weights_and_grads`): a
    view of the flat buffer when that already has `dtype` and there is no offload."""
    masters = []
    for flat in flats:
        own = flat.own_partition
        if offload:
            master = offload_zeros(flat.partition_numel, pin_memory=pin_memory, dtype=dtype)
            master.copy_(own)
        elif flat.dtype == dtype:
            master = own
        else:
            master = own.detach().to(dtype).clone()
        masters.append(master)
    return masters


def build_grad_partitions(
    flats: list[FlatParamGroup], *, offload: bool, pin_memory: bool, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """A zeroed gradient accumulator per group in the masters' dtype, next to its master partition."""
    if offload:
        return [offload_zeros(f.partition_numel, pin_memory=pin_memory, dtype=dtype) for f in flats]
    return [torch.zeros(f.partition_numel, dtype=dtype, device=f.device) for f in flats]


class PartitionUpdater:
    """Steps the base optimizer on the master partitions and writes the results into the flat buffers.

    Args:
        optimizer: the base optimizer, whose k-th parameter group holds exactly `[masters[k]]`.
        flats: the flat parameter groups.
        masters: the fp32 master partitions.
        offload: masters live on the host; an optimizer that declares the in-pass copy
            (`ds_ops.supports_in_pass_copy`: ds-ops' CPU optimizers, `step(fp16_param_groups=...)`) writes
            the results straight into the model's partition when that is in host memory, otherwise the
            results are copied after the step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        flats: list[FlatParamGroup],
        masters: list[torch.Tensor],
        *,
        offload: bool,
    ) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self.masters = masters
        self.copy_back = [
            m.data_ptr() != f.own_partition.data_ptr() or m.numel() == 0 for m, f in zip(masters, flats, strict=True)
        ]
        # The CPU optimizers write their copy targets in the same pass as the update, but only into host
        # tensors: a model on an accelerator gets its partition copied after the step.
        used = [f for f in flats if f.numel]
        self.in_pass_copy = (
            offload and supports_in_pass_copy(optimizer) and bool(used) and all(f.device.type == "cpu" for f in used)
        )
        if offload and not self.in_pass_copy:
            logger.debug("offload step: %s copies the updated partition after the step", type(optimizer).__name__)

    def step(self) -> None:
        """One base-optimizer step over the partitions, then the model's own partitions hold the results."""
        if self.in_pass_copy:
            self.optimizer.step(fp16_param_groups=[[f.own_partition] for f in self.flats])
            return
        if not step_in_blocks(self.optimizer):  # a client's torch Adam/AdamW: the same bits, in cache-sized blocks
            self.optimizer.step()
        with torch.no_grad():
            for flat, master, copy in zip(self.flats, self.masters, self.copy_back, strict=True):
                if copy:
                    flat.own_partition.copy_(master, non_blocking=True)

    def refresh_masters(self) -> None:
        """Reset the fp32 masters from the model's current weights (after loading 16-bit weights)."""
        with torch.no_grad():
            for flat, master, copy in zip(self.flats, self.masters, self.copy_back, strict=True):
                if copy:
                    master.copy_(flat.own_partition)
