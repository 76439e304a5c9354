"""`trim_mean`: the outlier-robust average DeepSpeed reports its comms and timer figures with."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["trim_mean"]


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """Mean of `data` without the `round(len(data) * trim_percent)` smallest and largest values.

    `data` is not modified (the values are sorted in a copy): the comms logger passes its stored
    latency and bandwidth lists, whose index i must keep naming the same call. An empty sequence gives 0.

    Raises:
        ValueError: `trim_percent` is outside [0, 1], or trimming leaves no value.
    """
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent must be in [0, 1], got {trim_percent}")
    values = sorted(data)
    if not values:
        return 0
    cut = int(round(len(values) * trim_percent))
    kept = values[cut : len(values) - cut]
    if not kept:
        raise ValueError(f"trim_mean: trimming {cut} values from each end of {len(values)} leaves none")
    return sum(kept) / len(kept)
