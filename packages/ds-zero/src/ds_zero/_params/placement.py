"""Placement families: parameters partitioned over a group of their own instead of the data-parallel group.

ZeRO-3 normally splits every parameter over the data-parallel ranks. An AutoEP (expert-parallel) model holds
different experts on the ranks of an expert-parallel group, so its expert parameters are only *replicated*
across their expert-data-parallel group: that is the group they are split over (DeepSpeed 0.19.8's
"placement family" `autoep_expert`). The engine marks such parameters before they are partitioned, with
DeepSpeed's attributes:

- `ds_zero_placement_family`: `"autoep_expert"` (or `"replicated"`, the default: the data-parallel group);
- `ds_zero_partition_group_name`: the expert group's name (`ep_size_2`);
- `ds_zero_partition_process_group`: the process group to split it over.

Everything that moves a partitioned parameter's shards (partitioning, gathers, the gradient reduce-scatter)
asks `family_group` which group that is; the gradient is still averaged over the whole data-parallel group
(an expert's gradient sums the tokens every replica routed to it), and the fp32 norm is still summed over
the data-parallel group (each family's shards tile its parameters once over those ranks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.distributed import ProcessGroup

__all__ = ["AUTOEP_EXPERT", "REPLICATED", "family_group", "family_runs", "has_families", "placement_group"]

AUTOEP_EXPERT = "autoep_expert"
REPLICATED = "replicated"


def placement_group(param: Any, default: ProcessGroup | None) -> ProcessGroup | None:
    """The group `param` is to be partitioned over: its family's, or `default` (the data-parallel group).

    Raises:
        ValueError: an unknown family, or an expert family without its process group.
    """
    family = getattr(param, "ds_zero_placement_family", REPLICATED)
    if family == REPLICATED:
        return default
    if family != AUTOEP_EXPERT:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} has ds_zero_placement_family={family!r}; ZeRO stage 3 "
            f"knows {REPLICATED!r} and {AUTOEP_EXPERT!r}"
        )
    group = getattr(param, "ds_zero_partition_process_group", None)
    if group is None:
        raise ValueError(
            f"AutoEP expert parameter of shape {tuple(param.shape)} has no ds_zero_partition_process_group "
            f"(group name {getattr(param, 'ds_zero_partition_group_name', None)!r}) to be partitioned over"
        )
    return group


def family_group(param: Any) -> ProcessGroup | None:
    """For a partitioned parameter of a placement family, the group its shards live on; None for the
    data-parallel family (the caller's group)."""
    if getattr(param, "ds_zero_placement_family", REPLICATED) == REPLICATED:
        return None
    return param.ds_process_group


def has_families(params: Iterable[Any]) -> bool:
    """Whether any of `params` is partitioned over a family group."""
    return any(family_group(p) is not None for p in params)


def family_runs(params: Iterable[Any]) -> list[tuple[ProcessGroup | None, list[Any]]]:
    """`params` split by family group (None: the data-parallel family), in order of first appearance.

    Every rank lists the same parameters in the same order, so the runs line up across ranks (an expert
    family's group differs between expert-parallel ranks, but sits at the same place).
    """
    runs: dict[int, tuple[ProcessGroup | None, list[Any]]] = {}
    for p in params:
        group = family_group(p)
        runs.setdefault(id(group) if group is not None else 0, (group, []))[1].append(p)
    return list(runs.values())
