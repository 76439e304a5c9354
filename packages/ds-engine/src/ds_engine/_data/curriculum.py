"""`CurriculumScheduler`: the difficulty (a sequence length, a metric's value or percentile) to train at, per step.

One scheduler follows one curriculum metric. Its config is DeepSpeed's: `min_difficulty`,
`max_difficulty`, `schedule_type` and `schedule_config`, where the schedule is one of

- `fixed_linear`: from min to max over `total_curriculum_step` steps, in multiples of `difficulty_step`;
- `fixed_root`: the same along a root curve of degree `root_degree` (2: square root; fast early growth);
- `fixed_discrete`: `difficulty[i]` up to step `max_step[i]`, the last difficulty after (one more
  difficulty than max steps);
- `custom`: a function of the step the script gives (`set_custom_get_difficulty`, or the engine's
  `set_custom_curriculum_learning_schedule`).

`update_difficulty(step)` moves the difficulty and stops moving it once it reached `max_difficulty`.
The state lives in `state` under DeepSpeed's keys, so it saves and restores as DeepSpeed's does. The
data sampler of `data_efficiency.data_sampling.curriculum_learning` builds one per metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ds_engine._data import keys as k
from ds_engine._data.root_schedule import root_value

logger = logging.getLogger(__name__)

__all__ = ["SCHEDULE_TYPES", "CurriculumScheduler"]

#: The schedule types DeepSpeed 0.19.8 implements.
SCHEDULE_TYPES = (
    k.CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR,
    k.CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT,
    k.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE,
    k.CURRICULUM_LEARNING_SCHEDULE_CUSTOM,
)

#: schedule type -> the `schedule_config` keys it needs.
_NEEDS: dict[str, tuple[str, ...]] = {
    k.CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR: (
        k.CURRICULUM_LEARNING_SCHEDULE_TOTAL_STEP,
        k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP,
    ),
    k.CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT: (
        k.CURRICULUM_LEARNING_SCHEDULE_TOTAL_STEP,
        k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP,
        k.CURRICULUM_LEARNING_SCHEDULE_ROOT_DEGREE,
    ),
    k.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE: (
        k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY,
        k.CURRICULUM_LEARNING_SCHEDULE_MAX_STEP,
    ),
    k.CURRICULUM_LEARNING_SCHEDULE_CUSTOM: (),
}


def _check_config(config: Mapping[str, Any], path: str) -> None:
    """Refuse a config the schedule cannot run, naming the key (DeepSpeed asserts, or fails at the first step)."""
    for key in (
        k.CURRICULUM_LEARNING_MIN_DIFFICULTY,
        k.CURRICULUM_LEARNING_MAX_DIFFICULTY,
        k.CURRICULUM_LEARNING_SCHEDULE_TYPE,
    ):
        if key not in config:
            raise ValueError(f"{path}.{key} is required for a curriculum schedule")
    kind = config[k.CURRICULUM_LEARNING_SCHEDULE_TYPE]
    if kind not in _NEEDS:
        raise ValueError(
            f"{path}.{k.CURRICULUM_LEARNING_SCHEDULE_TYPE}={kind!r} is not a curriculum schedule type; "
            f"use one of {', '.join(SCHEDULE_TYPES)}"
        )
    schedule = config.get(k.CURRICULUM_LEARNING_SCHEDULE_CONFIG, {})
    where = f"{path}.{k.CURRICULUM_LEARNING_SCHEDULE_CONFIG}"
    if _NEEDS[kind] and not isinstance(schedule, Mapping):
        raise ValueError(f"{where} must be an object for schedule_type {kind!r}, got {schedule!r}")
    for key in _NEEDS[kind]:
        if key not in schedule:
            raise ValueError(f"{where}.{key} is required for schedule_type {kind!r}")
    if kind == k.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE:
        levels = schedule[k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY]
        ends = schedule[k.CURRICULUM_LEARNING_SCHEDULE_MAX_STEP]
        if not isinstance(levels, list) or not isinstance(ends, list) or not ends:
            raise ValueError(f"{where}: difficulty and max_step must be non-empty lists, got {levels!r} and {ends!r}")
        if len(levels) != len(ends) + 1:
            raise ValueError(
                f"{where}: difficulty needs exactly one more entry than max_step (the last difficulty holds after "
                f"the last max_step), got {len(levels)} and {len(ends)}"
            )
        if any(later < earlier for earlier, later in zip(ends, ends[1:], strict=False)):
            raise ValueError(
                f"{where}.max_step must not decrease (each is the last step of its difficulty), got {ends}"
            )
    elif kind != k.CURRICULUM_LEARNING_SCHEDULE_CUSTOM:
        for key in _NEEDS[kind]:
            value = schedule[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{where}.{key} must be a positive number, got {value!r}")
        if schedule[k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP] % 8 != 0:
            logger.warning(
                "%s.%s=%s is not a multiple of 8: for a sequence-length metric, lengths that are multiples of 8 "
                "(fp16) or 16 (int8) let tensor cores run; ignore this for other metrics",
                where,
                k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP,
                schedule[k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP],
            )


class CurriculumScheduler:
    """The difficulty schedule of one curriculum metric (DeepSpeed's `CurriculumScheduler`).

    Args:
        config: DeepSpeed's scheduler config (see the module docstring).
        path: where `config` sits in the ds_config, for error messages.

    Raises:
        ValueError: a required key is missing, the schedule type is unknown, or a value cannot schedule.
    """

    def __init__(self, config: Mapping[str, Any], *, path: str = "curriculum schedule") -> None:
        _check_config(config, path)
        self.path = path
        kind = config[k.CURRICULUM_LEARNING_SCHEDULE_TYPE]
        self.state: dict[str, Any] = {
            k.CURRICULUM_LEARNING_MIN_DIFFICULTY: config[k.CURRICULUM_LEARNING_MIN_DIFFICULTY],
            k.CURRICULUM_LEARNING_MAX_DIFFICULTY: config[k.CURRICULUM_LEARNING_MAX_DIFFICULTY],
            k.CURRICULUM_LEARNING_CURRENT_DIFFICULTY: config[k.CURRICULUM_LEARNING_MIN_DIFFICULTY],
            k.CURRICULUM_LEARNING_SCHEDULE_TYPE: kind,
        }
        if kind != k.CURRICULUM_LEARNING_SCHEDULE_CUSTOM:
            self.state[k.CURRICULUM_LEARNING_SCHEDULE_CONFIG] = config[k.CURRICULUM_LEARNING_SCHEDULE_CONFIG]
        self.custom_get_difficulty: Callable[[int], Any] | None = None

    # -- the schedule -----------------------------------------------------------------------------------
    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        """The function of the global step a `custom` schedule follows."""
        self.custom_get_difficulty = schedule_function

    def get_difficulty(self, global_steps: int) -> Any:
        """The difficulty the schedule gives at `global_steps` (whatever the current one is)."""
        kind = self.state[k.CURRICULUM_LEARNING_SCHEDULE_TYPE]
        if kind == k.CURRICULUM_LEARNING_SCHEDULE_CUSTOM:
            if self.custom_get_difficulty is None:
                raise RuntimeError(
                    f"{self.path}: schedule_type 'custom' has no schedule function; call "
                    "engine.set_custom_curriculum_learning_schedule({metric: fn}) (or set_custom_get_difficulty(fn))"
                )
            return self.custom_get_difficulty(global_steps)
        schedule = self.state[k.CURRICULUM_LEARNING_SCHEDULE_CONFIG]
        if kind == k.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE:
            return self._discrete(schedule, global_steps)
        degree = 1 if kind == k.CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR else None
        return root_value(
            global_steps,
            total_steps=schedule[k.CURRICULUM_LEARNING_SCHEDULE_TOTAL_STEP],
            degree=degree or schedule[k.CURRICULUM_LEARNING_SCHEDULE_ROOT_DEGREE],
            low=self.state[k.CURRICULUM_LEARNING_MIN_DIFFICULTY],
            high=self.state[k.CURRICULUM_LEARNING_MAX_DIFFICULTY],
            multiple=schedule[k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP],
            floor_at_min=True,
        )

    @staticmethod
    def _discrete(schedule: Mapping[str, Any], global_steps: int) -> Any:
        levels = schedule[k.CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY]
        for level, last_step in zip(levels, schedule[k.CURRICULUM_LEARNING_SCHEDULE_MAX_STEP], strict=False):
            if global_steps <= last_step:
                return level
        return levels[-1]

    def update_difficulty(self, global_steps: int) -> Any:
        """Move to the difficulty of `global_steps` unless `max_difficulty` was reached; returns the current one."""
        state = self.state
        if state[k.CURRICULUM_LEARNING_CURRENT_DIFFICULTY] < state[k.CURRICULUM_LEARNING_MAX_DIFFICULTY]:
            state[k.CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = self.get_difficulty(global_steps)
        return state[k.CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    # -- state ------------------------------------------------------------------------------------------
    def get_current_difficulty(self) -> Any:
        return self.state[k.CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    def set_current_difficulty(self, difficulty: Any) -> None:
        self.state[k.CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = difficulty

    def get_state(self) -> dict[str, Any]:
        """The live state dict (DeepSpeed's keys)."""
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """A copy of the state to save (the custom function is code, not state: set it again after a load)."""
        return dict(self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.state = dict(state_dict)
