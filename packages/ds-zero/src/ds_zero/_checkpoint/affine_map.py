"""DeepSpeed 0.19.8's `affine_map`: where every element of a tensor-parallel shard sits in the whole parameter.

Besides its category lists, DeepSpeed's AutoTP writes `universal_checkpoint_info["affine_map"]`:
`{"version": 1, "params": {pattern: map}}`, one map per parameter, where a map is
`{"logical_shape": whole shape, "ranks": {tp_rank: {"shard_shape": [...], "pieces": [piece, ...]}}}` and a
piece is a block of elements given as `torch.as_strided` arguments on both sides:
`{"shape": [...], "source": [offset, strides] in the whole parameter, "dest": [offset, strides] in the
rank's flat shard, "locations": [tp ranks holding it], "scale": s (absent: 1)}`, the shard holding
`whole * s`. DeepSpeed's converter prefers a map to the categories, so a parameter with one is rebuilt
here from its pieces (`rebuild`), as DeepSpeed's converter does. A block that several ranks hold
(replicated) must be equal on all of them. A scaled block divides back out of the fp32 value; an
optimizer state through a scaled block is refused, since Adam's lr and eps would stay in the scaled
coordinates (DeepSpeed refuses it too).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["AFFINE_MAP_KEY", "AffineMaps"]

AFFINE_MAP_KEY = "affine_map"
_VERSION = 1  # the map encoding this reader knows (DeepSpeed 0.19.8's AFFINE_MAP_FORMAT_VERSION)


class AffineMaps:
    """The `affine_map` entry of a `universal_checkpoint_info`, by parameter pattern.

    Raises:
        ValueError: a map version newer than this reader knows.
    """

    def __init__(self, entry: Mapping[str, Any] | None) -> None:
        entry = entry or {}
        version = int(entry.get("version", _VERSION))
        if version > _VERSION:
            raise ValueError(f"affine_map version {version} is newer than this converter reads ({_VERSION})")
        self.maps: dict[str, Mapping[str, Any]] = dict(entry.get("params") or {})

    def find(self, name: str) -> Mapping[str, Any] | None:
        """The map of parameter `name` (ValueError if several patterns match it), None if it has none."""
        hits = [p for p in self.maps if re.match(p, name)]
        if len(hits) > 1:
            raise ValueError(f"parameter {name!r} matches several affine_map patterns: {hits}")
        return self.maps[hits[0]] if hits else None


def rebuild(amap: Mapping[str, Any], slices: Sequence[torch.Tensor], name: str, state: str) -> torch.Tensor:
    """The whole tensor of parameter `name` from its tensor-parallel `slices` (rank order), as `amap` places them.

    Raises:
        ValueError: a slice of another size than the map's shard, elements no piece covers, replicated
            blocks that differ between ranks, or an optimizer state (`state` other than fp32) through a
            scaled block.
    """
    shape = [int(d) for d in amap["logical_shape"]]
    ranks = {int(r): v for r, v in amap["ranks"].items()}
    if sorted(ranks) != list(range(len(slices))):
        raise ValueError(f"{name!r}: the affine map covers tensor-parallel ranks {sorted(ranks)}, not {len(slices)}")
    whole = torch.empty(math.prod(shape), dtype=slices[0].dtype)
    covered = torch.zeros(whole.numel(), dtype=torch.bool)
    for rank in sorted(ranks):
        flat = slices[rank].detach().reshape(-1).clone()  # storage offset 0, as the piece offsets assume
        if flat.numel() != math.prod(ranks[rank]["shard_shape"]):
            raise ValueError(
                f"{name!r}: tensor-parallel rank {rank} holds {flat.numel()} elements of {state}, its affine map "
                f"describes a shard of shape {ranks[rank]['shard_shape']}"
            )
        for piece in ranks[rank]["pieces"]:
            size = [int(d) for d in piece["shape"]]
            (src_at, src_strides), (dst_at, dst_strides) = piece["source"], piece["dest"]
            block = torch.as_strided(flat, size, [int(s) for s in dst_strides], int(dst_at))
            scale = float(piece.get("scale", 1.0))
            if scale != 1.0:
                if state != "fp32":
                    raise ValueError(
                        f"{name!r}: {state} passes through a block scaled by {scale}; its optimizer's lr and eps "
                        "would stay scaled, so it is not converted (as in DeepSpeed)"
                    )
                block = block / scale
            target = torch.as_strided(whole, size, [int(s) for s in src_strides], int(src_at))
            seen = torch.as_strided(covered, size, [int(s) for s in src_strides], int(src_at))
            if len(piece["locations"]) > 1 and bool(seen.any()):
                if not torch.equal(target, block):
                    raise ValueError(
                        f"{name!r}: tensor-parallel ranks {sorted(piece['locations'])} hold different {state} for "
                        "one replicated block: the checkpoint is inconsistent"
                    )
                continue
            target.copy_(block)
            seen.fill_(True)
    if not bool(covered.all()):
        raise ValueError(f"{name!r}: its affine map leaves {int((~covered).sum())} elements uncovered")
    return whole.view(shape)
