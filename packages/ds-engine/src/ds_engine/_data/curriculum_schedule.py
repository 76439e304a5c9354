"""The difficulty schedule of one curriculum metric: which difficulty a global step trains at.

This is the part of DeepSpeed 0.19.8's `CurriculumScheduler` the data sampler needs: `update_difficulty(step)`,
`get_current_difficulty()`, `get_state()`/`set_state()` and `set_custom_get_difficulty(fn)`, with its four
schedule types:

- `fixed_discrete`: `schedule_config.difficulty` `[d0, d1, ...]` and `max_step` `[s0, s1, ...]` (one fewer);
  steps up to `s0` train at `d0`, up to `s1` at `d1`, ..., later steps at the last difficulty.
- `fixed_linear` / `fixed_root`: `min + (step / total_curriculum_step) ** (1 / root_degree) * (max - min)`,
  floored, rounded down to a multiple of `difficulty_step`, then kept within `[the first multiple of
  difficulty_step at or above min, max]` (linear is root degree 1).
- `custom`: a function of the step the user sets (`engine.set_custom_curriculum_learning_schedule`).

The difficulty only rises: once it reaches `max_difficulty` it stays there. The state dict has DeepSpeed's
keys, so a saved state loads on either side.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DIFFICULTY_TYPES",
    "SCHEDULE_TYPES",
    "CurriculumSchedule",
    "ScheduleConfigError",
    "validate_metric",
    "validate_schedule",
]

SCHEDULE_TYPES = ("fixed_discrete", "fixed_linear", "fixed_root", "custom")
DIFFICULTY_TYPES = ("value", "percentile")
_REQUIRED = {
    "fixed_discrete": ("difficulty", "max_step"),
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "custom": (),
}


class ScheduleConfigError(ValueError):
    """A bad curriculum metric setting; `key` is its path inside the metric's section."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def validate_schedule(config: Mapping[str, Any]) -> None:
    """Check one metric's schedule settings (`min_difficulty`, `max_difficulty`, `schedule_type`,
    `schedule_config`).

    Raises:
        ScheduleConfigError: a required key is missing, the schedule type is unknown, or values are inconsistent.
    """
    for key in ("min_difficulty", "max_difficulty", "schedule_type"):
        if key not in config:
            raise ScheduleConfigError(key, "is required for a curriculum metric")
    stype = config["schedule_type"]
    if stype not in SCHEDULE_TYPES:
        raise ScheduleConfigError(
            "schedule_type", f"{stype!r} is not a schedule; use one of {', '.join(SCHEDULE_TYPES)}"
        )
    sconf = config.get("schedule_config") or {}
    for key in _REQUIRED[stype]:
        if key not in sconf:
            raise ScheduleConfigError(f"schedule_config.{key}", f"is required by schedule_type {stype!r}")
    if stype == "fixed_discrete":
        difficulty, max_step = sconf["difficulty"], sconf["max_step"]
        if not max_step or len(difficulty) != len(max_step) + 1:
            raise ScheduleConfigError(
                "schedule_config",
                "'difficulty' needs exactly one more entry than 'max_step' (the last difficulty holds after the "
                f"last max_step), and max_step at least one; got {len(difficulty)} and {len(max_step)}",
            )
    elif stype in ("fixed_linear", "fixed_root"):
        for key in ("total_curriculum_step", "difficulty_step") + (("root_degree",) if stype == "fixed_root" else ()):
            if not isinstance(sconf[key], (int, float)) or sconf[key] <= 0:
                raise ScheduleConfigError(f"schedule_config.{key}", f"must be a number > 0, got {sconf[key]!r}")


def validate_metric(config: Mapping[str, Any]) -> None:
    """Check one entry of `curriculum_metrics`: its schedule, difficulty and clustering type, index paths.

    Raises:
        ScheduleConfigError: naming the key inside the metric's section.
    """
    validate_schedule(config)
    dtype = config.get("difficulty_type")
    if dtype not in DIFFICULTY_TYPES:
        raise ScheduleConfigError("difficulty_type", f"{dtype!r} is not a difficulty type; use 'value' or 'percentile'")
    if "clustering_type" not in config:
        raise ScheduleConfigError(
            "clustering_type", "is required ('single_cluster', or any other name for clusters formed by the schedule)"
        )
    if config["clustering_type"] != "single_cluster":
        needed = ("index_to_sample_path", "index_to_metric_path") if dtype == "value" else ("index_to_sample_path",)
        for key in needed:
            if not config.get(key):
                raise ScheduleConfigError(
                    key, f"is required for a {dtype}-based metric: the data analyzer's <metric>_{key[:-5]} prefix"
                )
    if dtype == "percentile" and not (isinstance(config["max_difficulty"], int) and config["max_difficulty"] > 0):
        raise ScheduleConfigError(
            "max_difficulty",
            f"a percentile metric's max_difficulty is the number of ranks the data is split into (an int > 0, "
            f"usually 100), got {config['max_difficulty']!r}",
        )


class CurriculumSchedule:
    """Difficulty per global step for one metric's `config` (`min_difficulty`, `max_difficulty`,
    `schedule_type`, `schedule_config`)."""

    def __init__(self, config: Mapping[str, Any], where: str = "curriculum") -> None:
        try:
            validate_schedule(config)
        except ScheduleConfigError as err:
            raise ValueError(f"{where}.{err.key}: {err.message}") from None
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": config["schedule_type"],
        }
        if config["schedule_type"] != "custom":
            self.state["schedule_config"] = dict(config["schedule_config"])
            step = self.state["schedule_config"].get("difficulty_step")
            if step is not None and step % 8 != 0:
                logger.warning(
                    "%s.schedule_config.difficulty_step is %s: for a sequence-length metric, a multiple of 8 "
                    "(FP16) or 16 (INT8) keeps tensor-core friendly shapes",
                    where,
                    step,
                )
        self._where = where
        self.custom_get_difficulty: Callable[[int], Any] | None = None

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """Use `schedule_function(global_step) -> difficulty` (schedule type `custom`)."""
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> Any:
        """The schedule's difficulty at `global_steps`, regardless of the current one."""
        stype = self.state["schedule_type"]
        if stype == "fixed_discrete":
            return self._discrete(global_steps)
        if stype == "fixed_linear":
            return self._root(global_steps, 1)
        if stype == "fixed_root":
            return self._root(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError(
                f"{self._where}.schedule_type is 'custom' but no schedule function is set; call "
                "engine.set_custom_curriculum_learning_schedule({metric: fn}) before training"
            )
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> Any:
        """Move to the difficulty of `global_steps` unless the maximum is reached; return the current one."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    def get_current_difficulty(self) -> Any:
        return self.state["current_difficulty"]

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def _discrete(self, global_steps: int) -> Any:
        sconf = self.state["schedule_config"]
        for difficulty, max_step in zip(sconf["difficulty"], sconf["max_step"], strict=False):
            if global_steps <= max_step:
                return difficulty
        return sconf["difficulty"][-1]

    def _root(self, global_steps: int, root_degree: float) -> int:
        sconf = self.state["schedule_config"]
        low, high = self.state["min_difficulty"], self.state["max_difficulty"]
        step = sconf["difficulty_step"]
        fraction = (float(global_steps) / sconf["total_curriculum_step"]) ** (1.0 / root_degree)
        difficulty = math.floor(fraction * (high - low) + low)
        difficulty -= difficulty % step
        difficulty = max(difficulty, -(-low // step) * step)
        return min(difficulty, high)
