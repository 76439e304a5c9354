"""`ZenFlowCPUAdam`: DeepSpeedCPUAdam whose bias correction follows ZenFlow's micro-step count.

ZenFlow applies the CPU optimizer only every `update_interval` micro steps, but DeepSpeed 0.19.8 steps it
with `step_id` = the micro step's number (1-based), not the number of CPU updates so far: Adam's bias
correction then sees how many gradients the accumulated update stands for. `step(step_id=n)` sets every
updated parameter's step count to `n` before the update; without `step_id` it counts as DeepSpeedCPUAdam.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ds_ops.adam._cpu_adam import DeepSpeedCPUAdam

logger = logging.getLogger(__name__)

__all__ = ["ZenFlowCPUAdam"]


class ZenFlowCPUAdam(DeepSpeedCPUAdam):
    """DeepSpeedCPUAdam with `step(step_id=...)` (DeepSpeed's class of that name; see the module note).

    Args:
        *args, **kwargs: as for `DeepSpeedCPUAdam`.
        overlap_step: DeepSpeed's flag for the overlapped ZenFlow update; kept so DeepSpeed's calls build it.
            The step is the same either way (the overlapped loop runs it in a worker process).
    """

    def __init__(self, *args: Any, overlap_step: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_step = bool(overlap_step)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        step_id: int | Callable[[], Any] | None = None,
        closure: Callable[[], Any] | None = None,
        fp16_param_groups: Any = None,
    ) -> Any:
        """One Adam update of every parameter with a gradient, at step count `step_id` (see the module note).

        Args:
            step_id: the 1-based step number for bias correction (None: each parameter's own count + 1).
                A callable in its place is taken as the closure (torch's positional convention).
            closure, fp16_param_groups: as for `DeepSpeedCPUAdam.step`.

        Raises:
            ValueError: `step_id` < 1.
        """
        if callable(step_id):
            step_id, closure = None, step_id
        if step_id is not None:
            if int(step_id) < 1:
                raise ValueError(f"ZenFlowCPUAdam.step: step_id must be >= 1, got {step_id!r}")
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    state = self.state[param]
                    if not state:
                        self._init_state(param, state)
                    state["step"] = int(step_id) - 1  # the base step adds the 1
        return super().step(closure, fp16_param_groups)
