"""Gradient clipping by the norm of the whole pipelined model (every stage, every ZeRO partition).

[Note: why a step pre-hook] Each stepper (fp32, fp16/bf16 masters, ds-zero) reduces the gradients
and then calls its base optimizer's `step()`. Registered as a `torch.optim.Optimizer` step
pre-hook on that base optimizer, the clipper sees the final gradients (reduced, unscaled) right
before the update, whatever the stepper, so the steppers are built with clipping off and the norm
here spans the stages (an all-reduce over the pipeline's model-parallel group) and, under ZeRO,
the data-parallel partitions (an all-reduce over the data-parallel group).

[Note: tied weights] A weight tied across stages (`TiedLayerSpec`) has the same gradient on every
owning stage; the sequential model counts it once. So before the step (at `ReduceGrads`) every
stage but the lowest owner measures its tied gradients' data-parallel mean and subtracts that
from its share of the sum of squares.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_ops.precision import clip_grads_by_norm_, local_norm_term

logger = logging.getLogger(__name__)

__all__ = ["PipelineGradClipper"]


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return local_norm_term(tensors, 2.0).reshape(()).cpu()


class PipelineGradClipper:
    """Clips the base optimizer's gradients to `max_norm` by the global norm over the whole pipeline.

    Args:
        max_norm: `gradient_clipping` (> 0).
        tied: `(weight, tie group)` pairs from `PipelineModule.get_tied_weights_and_groups()`.
        model_group: the ranks of this pipeline (all stages); None with one stage.
        dp_group: the data-parallel group; None with one replica.
        dp_world_size: its size.
        partitioned: True when the optimizer holds a disjoint data-parallel partition (ZeRO).
        device: where the norm is all-reduced (the engine device, so nccl works).
    """

    def __init__(
        self,
        *,
        max_norm: float,
        tied: list[tuple[torch.Tensor, ProcessGroup | None]],
        model_group: ProcessGroup | None,
        dp_group: ProcessGroup | None,
        dp_world_size: int,
        partitioned: bool,
        device: torch.device,
    ) -> None:
        self.max_norm = float(max_norm)
        self.model_group = model_group
        self.dp_group = dp_group
        self.dp_world_size = dp_world_size
        self.partitioned = partitioned
        self.device = device
        self._duplicates = [w for w, group in tied if group is not None and ds_comm.get_rank(group) != 0]
        self._dp_rank = ds_comm.get_rank(dp_group) if dp_group is not None else 0
        self._duplicate_sq = torch.zeros(())
        self.last_norm: float | None = None

    def note_duplicates(self) -> None:
        """At `ReduceGrads`: the squared norm of this stage's copies of weights a lower stage also holds."""
        grads = [w.grad.detach().float().clone() for w in self._duplicates if w.grad is not None]
        if grads and self.dp_world_size > 1:
            for g in grads:
                ds_comm.all_reduce(g, group=self.dp_group)
                g.div_(self.dp_world_size)
        self._duplicate_sq = _sum_of_squares(grads)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step pre-hook: one or two all-reduces of a single float, then an in-place scale."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        local = _sum_of_squares(grads)
        if not self.partitioned or self._dp_rank == 0:
            local = local - self._duplicate_sq
        total = local.reshape(1).to(self.device)
        if self.partitioned and self.dp_world_size > 1:
            ds_comm.all_reduce(total, group=self.dp_group)
        if self.model_group is not None:
            ds_comm.all_reduce(total, group=self.model_group)
        norm = math.sqrt(max(float(total), 0.0))
        self.last_norm = norm
        clip_grads_by_norm_(grads, self.max_norm, torch.tensor(norm))
