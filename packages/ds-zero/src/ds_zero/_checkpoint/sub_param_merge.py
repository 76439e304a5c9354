"""Merging the tensor-parallel slices of a fused projection (`parameter_with_sub_params`) section by section.

A fused projection (q/k/v stacked, gate/up stacked) is several sub-parameters along one dim, and AutoTP
cuts each on its own: rank r's slice is its piece of every sub-parameter, in order. So the slices go back
together one sub-parameter at a time, each rank's piece of it taken at that rank's running offset.

The `parameter_with_sub_params` entry says which dim (`partition_dim`) and, at that dim of its `shape`,
the sub-parameters' sizes. From universal-checkpoint version 0.4 (DeepSpeed 0.19.8) every rank's width of
every sub-parameter is recorded too (`sub_param_shard_widths`, pattern -> widths), since an uneven cut
(grouped-query heads over a group they do not divide) cannot be recomputed without the model's config.
Older metadata records none, so only an even split can be rebuilt; there the entry at `partition_dim`
may also be a count of equal sub-parameters (`(3, -1)`: three), which is decoded into sizes from the
slices' total size. A `-1` elsewhere in the shape is resolved from the parameter's element count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["UniversalMergeError", "merge_sub_params"]


class UniversalMergeError(AssertionError, ValueError):
    """Slices or metadata of a universal conversion that do not fit together.

    DeepSpeed's converter reports these as failed assertions; this is both an AssertionError (what its
    callers catch) and a ValueError (what it is: bad input), so neither kind of handler misses it.
    """


def _resolve(shape: list[int], numel: int, name: str) -> list[int]:
    holes = [i for i, d in enumerate(shape) if d < 0]
    if not holes:
        return shape
    if len(holes) > 1:
        raise UniversalMergeError(
            f"sub-parameter shape {shape} of {name!r} has {len(holes)} -1 dims; one is resolvable"
        )
    known = math.prod(d for i, d in enumerate(shape) if i != holes[0])
    if known <= 0 or numel % known:
        raise UniversalMergeError(f"sub-parameter shape {shape} of {name!r} does not fit its {numel} elements")
    out = list(shape)
    out[holes[0]] = numel // known
    return out


def _sizes(
    spec: Any, dim: int, slices: Sequence[torch.Tensor], version: float, name: str
) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The sub-parameters' sizes along `dim`, and the spec's shape with them written in (legacy counts decoded)."""
    shape = tuple(tuple(d) if isinstance(d, (list, tuple)) else d for d in spec)
    at = shape[dim]
    if isinstance(at, tuple):
        return tuple(int(s) for s in at), shape
    if version >= 0.4:
        raise UniversalMergeError(
            f"{name!r}: universal checkpoint version {version} gives sub-parameter sizes as a tuple at dim {dim}, "
            f"got {at!r}"
        )
    count = int(at)
    if any(s.dim() <= dim for s in slices):
        raise UniversalMergeError(f"{name!r}: a legacy sub-parameter count needs the slices' shapes, they are flat")
    total = sum(s.shape[dim] for s in slices)
    if count <= 0 or total % count:
        raise UniversalMergeError(f"{name!r}: legacy sub-parameter count {count} does not divide dim {dim} of {total}")
    sizes = (total // count,) * count
    return sizes, (*shape[:dim], sizes, *shape[dim + 1 :])


def merge_sub_params(
    entry: Mapping[str, Any],
    pattern: str,
    widths_by_pattern: Mapping[str, Any],
    version: float,
    slices: Sequence[torch.Tensor],
    name: str,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The whole parameter `name` from its rank `slices`, and its `sub_param_shape` record.

    Args:
        entry: the `parameter_with_sub_params` entry matching `name` (`patterns`, `shape`, `partition_dim`).
        pattern: the entry's pattern that matched (the key of its widths).
        widths_by_pattern: `sub_param_shard_widths`.
        version: the `universal_checkpoint_version` (0.0 when absent).
        slices: every tensor-parallel rank's slice, in rank order.
        name: the parameter, for messages.

    Returns:
        `(whole, record)`, record a dict with `patterns`, `shape` (sizes at `partition_dim`, legacy counts
        decoded) and `partition_dim`, DeepSpeed's `SubparamShape` fields.

    Raises:
        UniversalMergeError: version 0.4 metadata without widths, an old record of an uneven split, or
            widths and slices that do not describe each other.
    """
    dim = int(entry["partition_dim"])
    tp = len(slices)
    sizes, shape = _sizes(entry["shape"], dim, slices, version, name)
    if version >= 0.4:
        if pattern not in widths_by_pattern:
            raise UniversalMergeError(
                f"universal checkpoint version {version} records no sub_param_shard_widths for {name!r}, whose "
                f"pattern {pattern!r} declares sub-parameters"
            )
        widths = [[int(w) for w in ws] for ws in widths_by_pattern[pattern]]
    else:
        uneven = [s for s in sizes if s % tp]
        if uneven:
            raise UniversalMergeError(
                f"sub-parameter sizes {uneven} of {name!r} are not divisible by tp_degree {tp}, and universal "
                f"checkpoint version {version} records no sub_param_shard_widths: the uneven cut cannot be rebuilt"
            )
        widths = [[s // tp] * tp for s in sizes]
    if len(widths) != len(sizes):
        raise UniversalMergeError(f"{name!r}: {len(widths)} shard-width entries for {len(sizes)} sub-parameters")
    for size, ws in zip(sizes, widths, strict=True):
        if len(ws) != tp or sum(ws) != size:
            raise UniversalMergeError(
                f"{name!r}: shard widths {ws} of a sub-parameter of size {size} are not {tp} widths adding up to it"
            )
    logical = [sum(d) if isinstance(d, tuple) else int(d) for d in shape]
    logical[dim] = sum(sizes)
    logical = _resolve(logical, sum(s.numel() for s in slices), name)
    views = []
    for rank, piece in enumerate(slices):
        local = list(logical)
        local[dim] = sum(ws[rank] for ws in widths)
        if math.prod(local) != piece.numel():
            raise UniversalMergeError(
                f"tp rank {rank} of {name!r} holds {piece.numel()} elements, its shard widths describe {tuple(local)}"
            )
        views.append(piece.reshape(local))
    offsets = [0] * tp
    sections = []
    for ws in widths:
        parts = []
        for rank, view in enumerate(views):
            parts.append(view.narrow(dim, offsets[rank], ws[rank]))
            offsets[rank] += ws[rank]
        sections.append(torch.cat(parts, dim=dim))
    record = {"patterns": list(entry["patterns"]), "shape": shape, "partition_dim": dim}
    return torch.cat(sections, dim=dim), record
