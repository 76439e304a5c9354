"""Tensor-parallel (AutoTP) ranks loading a universal checkpoint: each takes its shard of every whole parameter.

A universal checkpoint holds each parameter whole (`zero/<name>/fp32.pt` and its optimizer states),
so it loads at any tensor-parallel degree: the module weights go through the AutoTP layers' own
`load_full` (as any whole state dict does), and the optimizer state of a sharded parameter is cut by
the same `ShardLayout` that cut the weight (sections of fused projections included), so a rank's
`exp_avg` shard lines up with its weight shard. Replicated parameters are taken whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ds_engine._optional import require

__all__ = ["shard_transform"]


def shard_transform(module: nn.Module) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """`transform(name, whole)` for `ds_zero.load_universal_partitions`: this rank's shard of parameter `name`."""
    tensor = require("ds_parallel", extra="parallel", feature="tensor parallelism").tensor
    cuts = {}
    for path, layer in tensor.tp_layers(module).items():
        for pname, layout in layer.layouts.items():
            cuts[f"{path}.{pname}" if path else pname] = (layout, layer.tp_index)

    def transform(name: str, whole: torch.Tensor) -> torch.Tensor:
        cut = cuts.get(name)
        return whole if cut is None else cut[0].shard(whole, cut[1])

    return transform
