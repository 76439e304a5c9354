"""Tensor-parallel (AutoTP) models and universal checkpoints, both ways.

Loading: a universal checkpoint holds each parameter whole (`zero/<name>/fp32.pt` and its optimizer
states), so it loads at any tensor-parallel degree: the module weights go through the AutoTP layers' own
`load_full` (as any whole state dict does), and the optimizer state of a sharded parameter is cut by
the same `ShardLayout` that cut the weight (sections of fused projections included), so a rank's
`exp_avg` shard lines up with its weight shard. Replicated parameters are taken whole.

Saving: the ZeRO partition files of a tensor-parallel save hold each rank's shards, and nothing in them
says how a shard sits in the whole parameter. `universal_checkpoint_info` writes that down in the
model-states file as DeepSpeed's AutoTP does (its `universal_checkpoint_info` key, version 0.4, built by
ds-parallel's `collect_autotp_universal_checkpoint_info` from each layer's per-parameter record), so
`ds_to_universal` (ds's or DeepSpeed's) can put the shards back together: parameters every rank holds
whole are `tp_replicated_parameter_patterns`, row-parallel weights (cut along dim 1)
`parameter_with_row_parallelism_patterns`, column-parallel ones (dim 0, the converter's default) need
no entry (an output head or embedding among them is also a `vocabulary_parameter_patterns` entry), cuts a
layer cannot describe are `autotp_unsupported_parameter_patterns`, and fused projections (several
sections along the cut dim, each split on its own) are
`parameter_with_sub_params` with every rank's width of every section in `sub_param_shard_widths`, and
also get an `affine_map` entry (DeepSpeed's geometric form, which its converter and ds's prefer): for each
rank, where its piece of each section sits in the whole parameter and in its shard.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_engine._checkpoint.constants import AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS
from ds_engine._optional import require

__all__ = ["UNIVERSAL_INFO_KEY", "shard_transform", "universal_checkpoint_info"]

#: The model-states key holding the conversion metadata (DeepSpeed's `UNIVERSAL_CHECKPOINT_INFO`).
UNIVERSAL_INFO_KEY = "universal_checkpoint_info"
_AFFINE_VERSION = 1  # DeepSpeed 0.19.8's AFFINE_MAP_FORMAT_VERSION


def _layouts(module: nn.Module) -> dict[str, tuple[Any, int]]:
    """Parameter name -> (its `ShardLayout`, this rank's index in the tensor-parallel group)."""
    tensor = require("ds_parallel", extra="parallel", feature="tensor parallelism").tensor
    cuts = {}
    for path, layer in tensor.tp_layers(module).items():
        for pname, layout in layer.layouts.items():
            cuts[f"{path}.{pname}" if path else pname] = (layout, layer.tp_index)
    return cuts


def shard_transform(module: nn.Module) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """`transform(name, whole)` for `ds_zero.load_universal_partitions`: this rank's shard of parameter `name`."""
    cuts = _layouts(module)

    def transform(name: str, whole: torch.Tensor) -> torch.Tensor:
        cut = cuts.get(name)
        return whole if cut is None else cut[0].shard(whole, cut[1])

    return transform


def universal_checkpoint_info(module: nn.Module) -> dict[str, Any]:
    """DeepSpeed's `universal_checkpoint_info` of a tensor-parallel model: how each trainable parameter is cut.

    The categories are the AutoTP layers' own records, aggregated as DeepSpeed's engine does
    (`collect_autotp_universal_checkpoint_info`: one exact-name `^name$` pattern per parameter). Frozen
    parameters are then left out (they have no optimizer state to convert, and a pattern that matches
    nothing fails the converter's strict check), and every sectioned cut also gets its `affine_map` entry.
    The same on every rank (layouts hold every rank's share).
    """
    tensor = require("ds_parallel", extra="parallel", feature="tensor parallelism").tensor
    info: dict[str, Any] = tensor.collect_autotp_universal_checkpoint_info(module)
    frozen = {f"^{re.escape(name)}$" for name, param in module.named_parameters() if not param.requires_grad}
    for key, value in list(info.items()):
        if isinstance(value, list):
            info[key] = [p for p in value if (p["patterns"][0] if isinstance(p, dict) else p) not in frozen]
        elif isinstance(value, dict):
            info[key] = {p: v for p, v in value.items() if p not in frozen}
    cuts = _layouts(module)
    maps = {}
    for name, param in module.named_parameters():
        layout = cuts[name][0] if name in cuts else None
        pattern = f"^{re.escape(name)}$"
        if pattern in frozen or layout is None or layout.replicated or len(layout.sections) < 2:
            continue
        if pattern in info[AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS]:
            continue
        whole = [*param.shape[: layout.dim], layout.full_size, *param.shape[layout.dim + 1 :]]
        maps[pattern] = _sections_map(whole, layout)
    if maps:
        info["affine_map"] = {"version": _AFFINE_VERSION, "params": maps}
    return info


def _row_major(shape: list[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def _sections_map(whole: list[int], layout: Any) -> dict[str, Any]:
    """DeepSpeed's affine map of a sectioned cut: rank r's shard is its piece of every section, in order.

    One piece per (rank, section): where the piece starts along the cut dim in the whole parameter and
    in the shard, as `torch.as_strided` offsets and row-major strides of each.
    """
    dim, strides = layout.dim, _row_major(whole)
    ranks = {}
    for rank in range(len(layout.sections[0])):
        local = list(whole)
        local[dim] = layout.local_size(rank)
        local_strides = _row_major(local)
        pieces, start, at = [], 0, 0
        for section in layout.sections:
            shape = list(whole)
            shape[dim] = section[rank]
            source = [(start + sum(section[:rank])) * strides[dim], strides]
            pieces.append({"shape": shape, "source": source, "dest": [at * local_strides[dim], local_strides]})
            pieces[-1]["locations"] = [rank]
            start, at = start + sum(section), at + section[rank]
        ranks[rank] = {"shard_shape": local, "pieces": pieces}
    return {"logical_shape": list(whole), "ranks": ranks}
