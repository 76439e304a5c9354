"""The config checks of one curriculum metric (`data_efficiency...curriculum_learning.curriculum_metrics.<m>`).

`config/` runs them on the whole section before any work, naming the key; the schedule itself is
`_data.curriculum.CurriculumScheduler` (DeepSpeed 0.19.8's four schedule types), which the data sampler steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "DIFFICULTY_TYPES",
    "SCHEDULE_TYPES",
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
