"""`deepspeed.utils.numa`: DeepSpeed's core-list syntax for `--bind_core_list`.

DeepSpeed's launcher reads `--bind_core_list` with `parse_range_list` and prefixes workers with
`numactl`; ds-launcher pins ranks with `sched_setaffinity` itself (`ds_launcher._cores`) and needs
no numactl. What scripts import from here is the parser, which keeps DeepSpeed's strict rule: the
items must go strictly upwards, so an overlap or a backwards range is an error rather than a guess.
"""

from __future__ import annotations

import re

__all__ = ["parse_range", "parse_range_list"]

_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_range(rng: str) -> list[int]:
    """`"N"` into `[N]`, `"A-B"` into `[A, ..., B]`.

    Raises:
        ValueError: not a core id or range, or `B < A` (naming the item).
    """
    match = _ITEM.fullmatch(rng.strip())
    if not match:
        raise ValueError(f"core list item {rng!r} is not a core id or range; write e.g. '3' or '2-4'")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) is not None else lo
    if hi < lo:
        raise ValueError(f"core range {rng!r} runs backwards; write it as '{hi}-{lo}'")
    return list(range(lo, hi + 1))


def parse_range_list(range_str: str) -> list[int]:
    """`"0,2-4,6"` into `[0, 2, 3, 4, 6]`.

    Raises:
        ValueError: a bad item, or an item that does not start above the previous one (overlap
            or wrong order), naming the items.
    """
    cores: list[int] = []
    for item in range_str.split(","):
        values = parse_range(item)
        if cores and values[0] <= cores[-1]:
            raise ValueError(
                f"core list {range_str!r}: {item.strip()!r} overlaps or comes before core {cores[-1]}; "
                "list cores and ranges in increasing order without overlap"
            )
        cores.extend(values)
    return cores
