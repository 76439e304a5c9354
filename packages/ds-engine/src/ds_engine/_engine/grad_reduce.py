"""`engine.allreduce_gradients()`: DeepSpeed's explicit gradient reduction, for loops that drive it themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EngineGradReduce"]


class EngineGradReduce:
    """Mixed into `DeepSpeedEngine`."""

    _stepper: Any
    is_gradient_accumulation_boundary: Callable[[], bool]

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """At an accumulation boundary, average the accumulated gradients across data-parallel ranks now.

        Stage 0: one all-reduce per gradient bucket on the data-parallel group (the configured buckets;
        `bucket_size` is accepted for DeepSpeed's signature), after which every rank's `.grad` holds the
        reduced values and the coming `step()` does not reduce again. Off a boundary it does nothing,
        as in DeepSpeed. Under ZeRO the optimizer reduces on its own schedule (during backward at
        stages 2 and 3, in the step at stage 1), so this is a no-op there: the step's result is the same
        whether or not it was called.
        """
        if self._stepper is None or not self.is_gradient_accumulation_boundary():
            return
        reduce = getattr(self._stepper, "reduce_gradients", None)
        if reduce is not None:
            reduce()
