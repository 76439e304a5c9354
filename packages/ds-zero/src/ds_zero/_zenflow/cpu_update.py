"""How ZenFlow's CPU update runs: `SequentialCpuUpdate` steps the CPU optimizer inside `step()`.

The update takes the accumulated host gradient partitions, steps the CPU optimizer on the host masters
with ZenFlow's step count, writes the result into this rank's partition of the model's flat buffer and
all-gathers the partitions. (`ds_zero._zenflow.overlap` runs the same update in a worker process.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._stage12.partitions import PartitionUpdater

logger = logging.getLogger(__name__)

__all__ = ["SequentialCpuUpdate"]


class SequentialCpuUpdate:
    """The CPU update in the training process, blocking (`zero_optimization.zenflow.overlap_step: false`).

    Args:
        optimizer: the CPU optimizer over `masters` (its `step` takes `step_id`).
        flats: the flat parameter groups.
        masters: the host fp32 master partitions.
        updater: the ZeRO optimizer's partition updater (knows whether the step writes the model's
            partition itself).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        flats: list[FlatParamGroup],
        masters: list[torch.Tensor],
        updater: PartitionUpdater,
    ) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self.masters = masters
        self.updater = updater

    def refresh_masters(self) -> None:
        """Reset the host masters from the model's partitions (the selected columns moved on the device)."""
        self.updater.refresh_masters()

    def update(self, grads: list[torch.Tensor], *, step_id: int, sync: Callable[[], None]) -> bool:
        """Step the CPU optimizer on `grads` (the accumulated partitions) and all-gather the result (`sync`).

        Returns False: the accumulators still hold the window's gradients (the caller clears them)."""
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad
        try:
            if self.updater.in_pass_copy:
                self.optimizer.step(step_id=step_id, fp16_param_groups=[[f.own_partition] for f in self.flats])
            else:
                self.optimizer.step(step_id=step_id)
                with torch.no_grad():
                    for flat, master, copy in zip(self.flats, self.masters, self.updater.copy_back, strict=True):
                        if copy:
                            flat.own_partition.copy_(master)
        finally:
            for master in self.masters:
                master.grad = None
        sync()
        return False

    def close(self) -> None:
        """Nothing runs outside the training process."""
