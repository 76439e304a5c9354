"""Tied weights across stages: one process group per tie key and data/model coordinate.

Each stage that owns a `TiedLayerSpec` of key `k` holds its own copy of the tied module. The copies
start equal (broadcast from the lowest owning stage) and receive the same update because their
gradients are summed over the tie group before the optimizer step: exactly what autograd does
when one module is used twice in a sequential model.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_pipe._topology import ProcessTopology

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TiedGroup:
    """This rank's view of one tie key: its member ranks (one per owning stage) and the group."""

    key: str
    ranks: list[int]
    group: ProcessGroup | None
    module: nn.Module
    weight_attrs: list[str]

    def weights(self) -> list[torch.Tensor]:
        return [functools.reduce(getattr, attr.split("."), self.module) for attr in self.weight_attrs]


def build_tied_groups(
    topology: ProcessTopology,
    owners: dict[str, list[int]],
    my_rank: int,
    modules: dict[str, nn.Module],
    weight_attrs: dict[str, list[str]],
) -> dict[str, TiedGroup]:
    """Create the tie groups of every key (all ranks call this with the same `owners`, in order).

    Args:
        topology: the mesh.
        owners: tie key -> sorted stages that own a layer of that key (insertion order is the
            creation order and must agree across ranks).
        my_rank: this process's global rank.
        modules: the tied modules built on this stage (key -> module).
        weight_attrs: key -> tied parameter attribute paths.

    Returns:
        key -> `TiedGroup` for the keys this stage owns that span more than one stage.
    """
    distributed = ds_comm.is_initialized()
    coord = topology.get_coord(my_rank)._asdict()
    others = {axis: range(topology.get_dim(axis)) for axis in topology.get_axis_names() if axis != "pipe"}
    groups: dict[str, TiedGroup] = {}
    for key, stages in owners.items():
        if len(stages) < 2:
            continue
        for fixed in _product(others):
            ranks = [topology.get_rank(pipe=s, **fixed) for s in stages]
            group = ds_comm.new_group(ranks) if distributed else None
            mine = all(coord[a] == v for a, v in fixed.items()) and coord["pipe"] in stages
            if mine:
                groups[key] = TiedGroup(
                    key=key, ranks=ranks, group=group, module=modules[key], weight_attrs=weight_attrs[key]
                )
    return groups


def _product(axes: dict[str, range]) -> list[dict[str, int]]:
    combos: list[dict[str, int]] = [{}]
    for axis, values in axes.items():
        combos = [{**c, axis: v} for c in combos for v in values]
    return combos


def broadcast_tied_weights(groups: Sequence[TiedGroup]) -> None:
    """Copy each tied weight from the lowest owning stage to the others (collective on each tie group)."""
    for tied in groups:
        for weight in tied.weights():
            ds_comm.broadcast(weight.data, src=tied.ranks[0], group=tied.group)


def allreduce_tied_grads(groups: Sequence[TiedGroup]) -> None:
    """Sum each tied weight's gradient over its tie group (a missing gradient counts as zero)."""
    for tied in groups:
        for weight in tied.weights():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            ds_comm.all_reduce(weight.grad, group=tied.group)
