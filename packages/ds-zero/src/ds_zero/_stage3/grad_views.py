"""DeepSpeed's stage-3 views of the accumulated gradient partitions: `averaged_gradients`,
`get_fp32_grad_partitions()` and `grad_partitions_flat_buffer`.

Both are keyed like DeepSpeed's: by sub-group (the optimizer's `fp16_groups`, ds's tiles), then by the
parameter's index in it, and hold this rank's partition of each parameter's gradient: `ceil(numel / world)`
elements of the flattened gradient, averaged over the data-parallel ranks, accumulated over the micro-steps
since the last `step()` / `zero_grad()`, the last ranks' padding zero. ds keeps these partitions in fp32 (the
fp32 master's `.grad`), so both give fp32 views that a write changes (copies when the optimizer is on NVMe).
With no gradient in the current accumulation window (before the first backward, after `zero_grad()`, which
the engine's step ends with) both are empty, as DeepSpeed's are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["GradPartitionViews"]


class GradPartitionViews:
    """Mixin for `DeepSpeedZeroOptimizer_Stage3` (uses `tiles`, `partitions`, `optimizer_swapper` and
    `get_local_fp32_grad_for_param` from `ShardParamAccess`)."""

    tiles: list[Any]
    partitions: list[Any]
    optimizer_swapper: Any

    if TYPE_CHECKING:

        def get_local_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None: ...

    def _holds_gradients(self) -> bool:
        swapper = self.optimizer_swapper
        if swapper is not None:
            return any(swapper.grads.read(tile) is not None for tile in self.tiles if tile.numel)
        return any(part.master is not None and part.master.grad is not None for part in self.partitions)

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """`{sub-group index: {parameter index in it: this rank's fp32 gradient partition}}` (see the module)."""
        if not self._holds_gradients():
            return {}
        out: dict[int, dict[int, torch.Tensor]] = {}
        for index, tile in enumerate(self.tiles):
            grads = {}
            for i, p in enumerate(tile.params):
                local = self.get_local_fp32_grad_for_param(p)
                if local is not None:
                    grads[i] = local
            if grads:
                out[index] = grads
        return out

    @property
    def grad_partitions_flat_buffer(self) -> torch.Tensor:
        """DeepSpeed's name: this rank's gradient partitions as one flat fp32 tensor, param group by param group.

        ds accumulates each param group's partition in its fp32 master's `.grad`. With one param group (and
        the optimizer not on NVMe) that gradient itself is returned, so a write changes it; otherwise a copy,
        zeros where a partition holds no gradient (DeepSpeed's buffer is allocated once and zeroed; ds frees
        the gradient after each step, so between steps this is all zeros).
        """
        grads = [None if part.master is None else part.master.grad for part in self.partitions]
        if len(grads) == 1 and grads[0] is not None:
            return grads[0]
        device = next((part.master.device for part in self.partitions if part.master is not None), None)
        return torch.cat(
            [
                torch.zeros(part.numel, dtype=torch.float32, device=device) if g is None else g.float().reshape(-1)
                for part, g in zip(self.partitions, grads, strict=True)
            ]
        )

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """`{sub-group index: [this rank's gradient partition of each of its parameters]}` (see the module)."""
        partitions = self.get_fp32_grad_partitions()
        return {index: [g for _, g in sorted(grads.items())] for index, grads in partitions.items()}
