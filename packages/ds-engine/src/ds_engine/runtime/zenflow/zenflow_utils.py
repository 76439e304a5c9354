"""`deepspeed.runtime.zenflow.zenflow_utils`: how ZenFlow shares a rank's CPU cores (`_split_affinity`).

ZenFlow runs its CPU optimizer in a process of its own beside training; `pt_reserved_cores_perc`
(`zero_optimization.zenflow`) says which share of the rank's cores training keeps. ds has no ZenFlow
loop to start that process, but the split is DeepSpeed's documented rule and is kept at its path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["_split_affinity"]


def _split_affinity(cores: Sequence[int], pt_reserved_cores_perc: float) -> tuple[list[int], list[int]]:
    """Split a rank's cores into (optimizer cores, training cores).

    Training keeps the first `ceil(pt_reserved_cores_perc * len(cores))` cores and the optimizer gets
    the rest. When that share rounds to none or to all of them, isolating one side would leave the other
    with nothing, so both get every core.

    Raises:
        ValueError: `pt_reserved_cores_perc` outside [0, 1].
    """
    if not 0.0 <= pt_reserved_cores_perc <= 1.0:
        raise ValueError(f"pt_reserved_cores_perc must be within [0, 1], got {pt_reserved_cores_perc!r}")
    cores = list(cores)
    reserved = math.ceil(pt_reserved_cores_perc * len(cores))
    if 0 < reserved < len(cores):
        return cores[reserved:], cores[:reserved]
    return cores, list(cores)
