"""`AutoUpdateRule`: ZenFlow's adaptive update interval (`zero_optimization.zenflow.update_interval: "auto"`).

[Note: DeepSpeed 0.19.8's rule] With "auto" DeepSpeed keeps, for every trainable 2-D weight, two running
sums over the current window (`L` micro steps since the last CPU update, this one included), fed at each
micro step after warm-up by the weight's averaged gradient `g` and its selected columns `g[:, S]`:

    critical   = sum |g[:, S]|,   total = sum |g|
    avg_critic = (avg_critic * (L - 1) + critical) / L / (10 * topk_ratio)
    non_critic = non_critic + (total - critical) / (10 * (1 - topk_ratio))

A weight "needs" the CPU update when `non_critic >= avg_critic` (the gradients left out of the selection
have built up against the selected ones); when at least `int(auto_ratio * number of 2-D weights)` weights
need it, the window ends at this micro step: the CPU optimizer applies the accumulated gradients. After a
CPU update the window and the `non_critic` sums restart. (The fixed boundaries stay: warm-up steps, and
the step before each reselection.)

What DeepSpeed 0.19.8 itself does with "auto" differs, and cannot train: its engine sets
`gradient_accumulation_steps` to the update interval, 0 with "auto", and divides every loss by it (inf
loss, NaN weights from the first step, seen on this CPU host at ZeRO-2); with that division removed, its
flag is written into one of two slots during the backward and read from the other slot, which the next
backward's prologue has just cleared, so no adaptive update ever happens (only the reselection
boundaries update). ds implements the rule above, which is what that code computes, with the flag read
at the step it was set for. Each loss is not divided (there is no fixed window); the CPU update applies
the window's mean gradient (the accumulated sum divided by `L`), as a fixed window's divided losses do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["AutoUpdateRule"]


class AutoUpdateRule:
    """The adaptive window of `update_interval: "auto"` (see the module note), over `num_weights` 2-D weights.

    Args:
        topk_ratio: `zenflow.topk_ratio`.
        auto_ratio: `zenflow.auto_ratio`.
        num_weights: the trainable 2-D weights (the sums' length; the same order at every call).
    """

    def __init__(self, topk_ratio: float, auto_ratio: float, num_weights: int) -> None:
        self.topk_ratio = float(topk_ratio)
        self.auto_ratio = float(auto_ratio)
        self.num_weights = int(num_weights)
        #: micro steps in the current window so far (DeepSpeed's `update_interval` under "auto")
        self.window = 0
        #: the micro step the rule last ended a window at
        self.ended_at = -1
        self.avg_critic = torch.zeros(self.num_weights, dtype=torch.float64)
        self.non_critic = torch.zeros(self.num_weights, dtype=torch.float64)

    def observe(self, micro_step: int, totals: torch.Tensor, criticals: torch.Tensor) -> bool:
        """Add micro step `micro_step`'s per-weight sums of |gradient| (whole weight, selected columns);
        returns whether it ends the window (then `ends(micro_step)` says so too)."""
        self.window += 1
        n = self.window
        k = self.topk_ratio
        totals, criticals = totals.to(torch.float64), criticals.to(torch.float64)
        self.avg_critic = (self.avg_critic * (n - 1) + criticals) / n / (k * 10)
        self.non_critic += (totals - criticals) / ((1 - k) * 10)
        need = int((self.non_critic >= self.avg_critic).sum())
        if need >= int(self.auto_ratio * self.num_weights):
            self.ended_at = micro_step
            return True
        return False

    def ends(self, micro_step: int) -> bool:
        """Whether the rule ended the window at micro step `micro_step`."""
        return self.ended_at == micro_step

    def mean_divisor(self) -> int:
        """What the window's accumulated gradients are divided by before the CPU update (its length)."""
        return max(1, self.window)

    def restart(self) -> None:
        """A CPU update applied the window: the window and the left-out sums start again."""
        self.window = 0
        self.non_critic.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "ended_at": self.ended_at,
            "avg_critic": self.avg_critic.clone(),
            "non_critic": self.non_critic.clone(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.window = int(saved["window"])
        self.ended_at = int(saved["ended_at"])
        self.avg_critic = saved["avg_critic"].clone().to(torch.float64)
        self.non_critic = saved["non_critic"].clone().to(torch.float64)
