"""`ZenFlowSchedule`: which micro steps reselect the important columns, and which apply the CPU update.

ZenFlow counts micro steps `m` = 0, 1, 2, ... (one per backward). Three rules, as in DeepSpeed 0.19.8:

- warm-up: the first `full_warm_up_rounds` steps are plain ZeRO-Offload steps (every one applies the
  whole update on the CPU; nothing is selected);
- selection: at `m == full_warm_up_rounds`, and then at every `m` that is a multiple of the select
  interval (in steps; for `select_strategy: epoch` the interval is `select_interval * steps_per_epoch`,
  and without a known epoch length only the first selection happens), the top `topk_ratio` columns of
  each weight are chosen anew;
- update: after warm-up, every `update_interval` steps (and at the step before each reselection) the
  gradients accumulated on the CPU are applied by the CPU optimizer. Steps in between update only the
  selected columns, at once, on the device.

The engine divides each loss by `update_interval` (DeepSpeed sets its gradient accumulation steps to
it), so the accumulated CPU gradient is the average over the window.

With `update_interval: "auto"` the window ends when the gradients left out of the selection have grown
large enough (`ds_zero._zenflow.auto_update`), decided at each micro step; this schedule then knows only
the fixed boundaries (warm-up, the step before a reselection), `update_interval` is 0 (DeepSpeed's value)
and no loss is divided: the CPU update applies the window's mean.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ZenFlowSchedule"]

_KEY = "zero_optimization.zenflow"


@dataclass(frozen=True)
class ZenFlowSchedule:
    """The resolved intervals of a `zero_optimization.zenflow` section (see the module note).

    Attributes:
        topk_ratio: share of each weight's columns selected.
        select_strategy: "step" or "epoch" ("auto" resolves to "epoch").
        select_interval: micro steps between reselections; 0 = select once, after warm-up.
        update_interval: micro steps between CPU updates.
        full_warm_up_rounds: leading micro steps with full updates.
        overlap_step: run the CPU update in a worker process, overlapped with the next steps.
        auto_update: `update_interval: "auto"` (then `update_interval` is 0).
        auto_ratio: with `auto_update`, the share of weights whose left-out gradients must have caught up.
    """

    topk_ratio: float
    select_strategy: str
    select_interval: int
    update_interval: int
    full_warm_up_rounds: int
    overlap_step: bool
    auto_update: bool = False
    auto_ratio: float = 0.99

    @classmethod
    def from_config(cls, zenflow: Any, *, steps_per_epoch: int | None = None) -> ZenFlowSchedule:
        """Resolve and check `zenflow` (ds-zero's `ZenFlowConfig`).

        Raises:
            ValueError: naming the key: `select_strategy: auto` with an explicit `select_interval`,
                `step`/`epoch` with `select_interval: "auto"`, or a select interval shorter than a fixed
                update interval.
        """
        strategy = zenflow.select_strategy
        interval = zenflow.select_interval
        if strategy == "auto":
            if isinstance(interval, int):
                raise ValueError(
                    f'{_KEY}.select_interval={interval}: with select_strategy "auto" the interval is one epoch '
                    f'and cannot be set; remove select_interval or set select_strategy to "step" or "epoch"'
                )
            strategy, interval = "epoch", 1
        elif not isinstance(interval, int):
            raise ValueError(
                f'{_KEY}.select_interval="auto": with select_strategy "{strategy}" it must be a whole number '
                f'of {strategy}s (or use select_strategy "auto")'
            )
        auto = not isinstance(zenflow.update_interval, int)  # "auto" (the config model allows no other string)
        update = 0 if auto else int(zenflow.update_interval)
        epoch = steps_per_epoch if steps_per_epoch is not None else zenflow.steps_per_epoch
        if strategy == "epoch":
            interval = interval * int(epoch) if epoch else 0
        if not auto and interval != 0 and interval < update:
            raise ValueError(
                f"{_KEY}.select_interval: {interval} step(s) between reselections is shorter than "
                f"update_interval={update}; the select interval must be >= the update interval"
            )
        return cls(
            topk_ratio=float(zenflow.topk_ratio),
            select_strategy=strategy,
            select_interval=int(interval),
            update_interval=update,
            full_warm_up_rounds=int(zenflow.full_warm_up_rounds),
            overlap_step=bool(zenflow.overlap_step),
            auto_update=auto,
            auto_ratio=float(getattr(zenflow, "auto_ratio", 0.99)),
        )

    @property
    def loss_divisor(self) -> int:
        """What the engine divides each loss by (its gradient accumulation steps): the fixed update
        interval, or 1 with `auto_update` (DeepSpeed divides by its 0 there, which makes every gradient
        inf; the CPU update averages the window instead)."""
        return max(1, self.update_interval)

    def in_warm_up(self, micro_step: int) -> bool:
        """Whether micro step `micro_step` is a full (warm-up) update, with no selection."""
        return micro_step < self.full_warm_up_rounds

    def is_select_boundary(self, micro_step: int) -> bool:
        """Whether the important columns are (re)chosen from micro step `micro_step`'s gradients."""
        after = micro_step - self.full_warm_up_rounds
        if after < 0:
            return False
        return after == 0 or (self.select_interval != 0 and micro_step % self.select_interval == 0)

    def is_update_boundary(self, micro_step: int) -> bool:
        """Whether the step after micro step `micro_step`'s backward applies the accumulated CPU update (with
        `auto_update`: whether it must, whatever the adaptive rule decides)."""
        nxt = micro_step + 1
        if nxt < self.full_warm_up_rounds or (self.auto_update and nxt == self.full_warm_up_rounds):
            return True
        if self.select_interval != 0 and nxt % self.select_interval == 0:
            return True
        return not self.auto_update and (nxt - self.full_warm_up_rounds) % self.update_interval == 0

    def overlap_state(self, micro_step: int) -> int:
        """Which of the overlapped update's two buffers (and moment sets) micro step `micro_step` uses:
        DeepSpeed's parity of the step in warm-up, then of the window (`auto_update`: of the micro step
        count, its state flipped at every backward)."""
        if micro_step < self.full_warm_up_rounds:
            return micro_step & 1
        if self.auto_update:
            return (micro_step + 1) & 1
        return (micro_step // self.update_interval) & 1

    def describe(self) -> dict[str, Any]:
        """The resolved choices, for `explain` and logs."""
        return {
            "topk_ratio": self.topk_ratio,
            "select_strategy": self.select_strategy,
            "select_interval_steps": self.select_interval or "once (after warm-up)",
            "update_interval_steps": "auto (adaptive)" if self.auto_update else self.update_interval,
            "full_warm_up_rounds": self.full_warm_up_rounds,
            "overlap_step": self.overlap_step,
        }
