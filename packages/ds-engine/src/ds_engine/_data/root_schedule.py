"""The one growth curve both schedulers use: a root of training progress, snapped down to a multiple.

`value(step) = min + (max - min) * (step / total_steps) ** (1 / degree)`, floored to an integer and
then down to a multiple of `multiple`; degree 1 is a straight line. DeepSpeed 0.19.8's curriculum
scheduler additionally never goes below the first multiple at or above `min` (snapping down could
otherwise give 0 at step 0, an empty sequence), while its random-LTD scheduler has no such floor; the
caller chooses with `floor_at_min`. Values are computed with the same float operations in the same
order as DeepSpeed's, so the two engines agree step for step.
"""

from __future__ import annotations

import math

__all__ = ["root_value"]


def root_value(
    step: int | float,
    *,
    total_steps: int | float,
    degree: int | float,
    low: int | float,
    high: int | float,
    multiple: int | float,
    floor_at_min: bool,
) -> int | float:
    """The scheduled value at `step` (never above `high`)."""
    progress = (float(step) / total_steps) ** (1.0 / degree)
    value = math.floor(progress * (high - low) + low)
    value -= value % multiple
    if floor_at_min:
        value = max(value, -(-low // multiple) * multiple)
    return min(value, high)
