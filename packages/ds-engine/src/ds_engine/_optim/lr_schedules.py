"""DeepSpeed's lr schedules, by name and formula: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Each schedule is stepped once per optimizer step (the engine does it after every applied step)
and counts `last_batch_iteration` from -1; `state_dict()` is `{"last_batch_iteration": n}`, as in
DeepSpeed, so checkpoints move between the two. Differences from DeepSpeed 0.19.8, all on inputs
DeepSpeed accepts silently: an unknown `warmup_type` is a `ValueError` (DeepSpeed warns and uses
"log"), and OneCycle keeps each group's own `betas[1]` while cycling `betas[0]` (DeepSpeed forces 0.99).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from ds_engine._optim.lr_schedule_names import *  # noqa: F403 - DeepSpeed's string constants, re-exported
from ds_engine._optim.lr_schedule_names import VALID_LR_SCHEDULES, WARMUP_LINEAR_RATE, WARMUP_LOG_RATE
from ds_engine._optim.lr_schedule_names import __all__ as _CONSTANT_NAMES
from ds_engine._optim.lr_tuning_args import *  # noqa: F403 - add_tuning_arguments, get_config_from_args, ...
from ds_engine._optim.lr_tuning_args import __all__ as _TUNING_NAMES

logger = logging.getLogger(__name__)

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "get_lr_from_config",
]

# DeepSpeed keeps its schedule names, parameter keys and tuning flags in this module's namespace.
__all__ += [*_CONSTANT_NAMES, *_TUNING_NAMES]


class _HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


def _per_group(optimizer: _HasParamGroups, value: float | Sequence[float], name: str) -> list[float]:
    count = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name}: expected {count} values (one per param group), got {len(value)}: {value}")
        return [float(v) for v in value]
    return [float(cast(float, value))] * count


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


class _Schedule:
    """Shared plumbing: the step counter, writing lrs into the groups, state dicts."""

    def __init__(self, optimizer: _HasParamGroups, last_batch_iteration: int) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"{type(self).__name__} needs an optimizer with param_groups, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _write_lrs(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=False):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and write the lrs."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._write_lrs(self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lrs written by the last `step()` (or at construction)."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])


class WarmupLR(_Schedule):
    """Warm the lr up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold it.

    `lr(i) = min + (max - min) * gamma(i)` with `gamma(i) = log(i + 1) / log(n)` ("log") or `i / n`
    ("linear") for `i < n`, and 1 after; `n = max(2, warmup_num_steps)`. At construction the lr is
    set to `warmup_min_lr`, so the first optimizer step runs at the minimum.

    Args:
        optimizer: anything with `param_groups` (a torch optimizer or an engine wrapper).
        warmup_min_lr: starting lr (one value, or one per param group).
        warmup_max_lr: final lr; None means each group's own current lr.
        warmup_num_steps: warmup length in optimizer steps (a positive int).
        warmup_type: "log" or "linear".
        last_batch_iteration: -1 to start; a step index to resume.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._write_lrs(self.get_lr())

    def _warmup_gamma(self) -> float:
        it = self.last_batch_iteration
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at `total_num_steps`.

    After warmup, `gamma(i) = max(0, (total - i) / max(1, total - n))`.

    Args:
        optimizer: anything with `param_groups`.
        total_num_steps: the step at which the lr reaches 0.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration: as in
            `WarmupLR`, except that `warmup_max_lr` defaults to 0.001.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                self.warmup_num_steps,
            )

    def _get_gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Scale each group's lr by a ratio: warmup from `warmup_min_ratio` to 1, then cosine down to `cos_min_ratio`.

    Warmup (`i < n`): `ratio = wmin + (1 - wmin) * g(i)` with `g` as in WarmupLR. After:
    `p = min(1, (i - n + 1) / max(1, total - n))`, `ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi p)) / 2)`.
    The lr is the group's lr at construction times the ratio (0 before the first step).

    Args:
        optimizer: anything with `param_groups`.
        total_num_steps: length of warmup plus cosine decay.
        warmup_min_ratio: starting ratio.
        warmup_num_steps: warmup length (a positive int; internally at least 2).
        cos_min_ratio: final ratio.
        warmup_type: "log" or "linear".
        last_batch_iteration: -1 to start.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                total_num_steps,
                self.warmup_num_steps,
            )
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write_lrs(self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            warm = (
                self.inverse_log_warm_up * math.log(it + 1)
                if self.warmup_type == WARMUP_LOG_RATE
                else it / self.warmup_num_steps
            )
            return self.warmup_min_ratio + warm * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """1Cycle (Smith, 2018): lr up from `cycle_min_lr` to `cycle_max_lr` and back, then optional decay.

    Within the cycle (`i < first + second`), with `b = i + 1`, `x = b / size - floor(b / size)`:
    `scale = x / r` while `x <= r` (r = first / size), else `(x - 1) / (r - 1)`; a stair count
    quantises `scale` to `floor(position * stairs) / stairs`. `lr = min + (max - min) * scale`,
    momentum (`betas[0]`, when `cycle_momentum`) `= max_mom - (max_mom - min_mom) * scale`; `betas[1]` is kept.
    After the cycle, with `d = i - size + 1`: `lr = min / (1 + decay_lr_rate * d / decay_step_size)` and
    momentum `= max_mom * (1 + decay_mom_rate * d / decay_step_size)` (no decay when the step size or
    rate is 0).

    Args:
        optimizer: anything with `param_groups` (momentum cycling needs `betas` in its defaults).
        cycle_min_lr, cycle_max_lr: the lr range (one value, or one per param group).
        decay_lr_rate: post-cycle lr decay rate.
        cycle_first_step_size: steps of the rising half.
        cycle_second_step_size: steps of the falling half (default: the first's; 0: the lr drops back at once).
        cycle_first_stair_count, cycle_second_stair_count: staircase steps per half (0: continuous;
            the second defaults to the first).
        decay_step_size: post-cycle decay interval in steps (0: no decay).
        cycle_momentum: cycle `betas[0]` inversely to the lr.
        cycle_min_mom, cycle_max_mom: the momentum range (one value, or one per param group).
        decay_mom_rate: post-cycle momentum growth rate.
        last_batch_iteration: -1 to start.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(
            cycle_second_step_size if cycle_second_step_size is not None else cycle_first_step_size
        )
        if self.first_step_size <= 0 or self.second_step_size < 0:
            raise ValueError(
                "OneCycle: cycle_first_step_size must be > 0 and cycle_second_step_size >= 0, got "
                f"{cycle_first_step_size}, {cycle_second_step_size}"
            )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in getattr(optimizer, "defaults", {}):
            logger.warning("OneCycle: cycle_momentum disabled: %s has no betas", type(optimizer).__name__)
            self.cycle_momentum = False
        if last_batch_iteration == -1:
            self._write_lrs(self.min_lrs)
            if self.cycle_momentum:
                self._write_moms(self.min_moms)

    def _scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset: the float `scale` can sit a hair under a stair.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def _momentums(self) -> list[float]:
        """`betas[0]` per group at the current iteration."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """`betas` per group at the current iteration, `(cycled beta1, the group's beta2)`; None without cycling."""
        if not self.cycle_momentum:
            return None
        return [
            (mom, float(group["betas"][1]))
            for mom, group in zip(self._momentums(), self.optimizer.param_groups, strict=True)
        ]

    def _write_moms(self, moms: Sequence[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms, strict=False):
            group["betas"] = (mom, group["betas"][1])

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._write_moms(self._momentums())


class LRRangeTest(_Schedule):
    """The lr range test: grow the lr linearly (or in stairs) from `lr_range_test_min_lr`.

    `lr(i) = min_lr * (1 + step_rate * k)` with `k = (i + 1) / step_size`, floored when
    `lr_range_test_staircase`.

    Args:
        optimizer: anything with `param_groups`.
        lr_range_test_min_lr: starting lr (one value, or one per group).
        lr_range_test_step_size: steps per unit of growth.
        lr_range_test_step_rate: growth per unit.
        lr_range_test_staircase: grow in whole units.
        last_batch_iteration: -1 to start.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size}")
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._write_lrs(self.min_lr)

    def _interval(self) -> float:
        units = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(units)) if self.staircase else units

    def get_lr(self) -> list[float]:
        growth = 1.0 + self.step_rate * self._interval()
        return [lr * growth for lr in self.min_lr]


def get_lr_from_config(config: dict[str, Any]) -> tuple[float | None, str]:
    """The peak lr a `scheduler` section implies, DeepSpeed's helper: `(lr, "")` or `(None, reason)`."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    kind, params = config["type"], config["params"]
    if kind not in VALID_LR_SCHEDULES:
        return None, f"{kind} is not a valid LR schedule"
    key = {"LRRangeTest": "lr_range_test_min_lr", "OneCycle": "cycle_max_lr"}.get(kind, "warmup_max_lr")
    return params[key], ""
