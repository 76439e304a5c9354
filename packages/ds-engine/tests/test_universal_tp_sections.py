"""The affine map an AutoTP save records for a sectioned cut (fused q/k/v, packed gate/up) places every rank's
shard back where `ShardLayout` cut it from: ds-zero's converter rebuilds the whole tensor from the shards
exactly, along dim 0 and dim 1, even and uneven, with an empty share."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ds_zero", reason="the converter is ds-zero's")
tensor = pytest.importorskip("ds_parallel", reason="ShardLayout is ds-parallel's").tensor

from ds_engine._checkpoint.universal_tp import _sections_map  # noqa: E402
from ds_zero._checkpoint.affine_map import rebuild  # noqa: E402


@pytest.mark.parametrize(
    ("shape", "dim", "sections"),
    [
        ((16, 3), 0, ((4, 4), (2, 2), (2, 2))),  # q | k | v, grouped kv heads
        ((16,), 0, ((4, 4), (2, 2), (2, 2))),  # its bias
        ((3, 12), 1, ((4, 2), (3, 3))),  # uneven, along dim 1
        ((9, 2), 0, ((3, 3, 0), (1, 1, 1))),  # three ranks, one with an empty share of a section
    ],
)
def test_sections_map_rebuilds_the_whole_tensor(shape: tuple[int, ...], dim: int, sections: tuple) -> None:
    layout = tensor.ShardLayout(dim, sections)
    whole = torch.randn(shape)
    shards = [layout.shard(whole, r) for r in range(len(sections[0]))]
    amap = _sections_map(list(shape), layout)
    assert [amap["ranks"][r]["shard_shape"] for r in range(len(shards))] == [list(s.shape) for s in shards]
    assert torch.equal(rebuild(amap, shards, "p", "exp_avg"), whole)
