"""`deepspeed.runtime.comm.coalesced_collectives` on gloo ranks, against the mean computed in one process.

Each rank must get, for every tensor, its DeepSpeed-shaped partition (ceil-sized pieces in rank order,
the tail short or empty) of the element-wise mean over ranks, in the tensor's dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_comm.testing import run_ranks

SHAPES = [(6,), (3,), (1,), (7, 7), (5, 2)]


def _inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


def _expected_piece(mean: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunk = math.ceil(mean.numel() / world)
    return mean.reshape(-1)[rank * chunk : (rank + 1) * chunk]


def _reduce(rank: int, world: int, dtype: torch.dtype) -> dict[str, object]:
    import ds_comm
    from ds_engine.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced

    out: dict[str, object] = {"pieces": reduce_scatter_coalesced(_inputs(rank, dtype), ds_comm.get_world_group())}
    out["empty"] = reduce_scatter_coalesced([])
    # qgZ's exact cases: a 1-D tensor and one whose size does not divide by 2 * world.
    out["fallback"] = all_to_all_quant_reduce([_inputs(rank, dtype)[0], _inputs(rank, dtype)[3]], {})
    try:
        all_to_all_quant_reduce([torch.zeros(4, world)], {})
    except NotImplementedError as err:
        out["quantized"] = str(err)
    return out


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float32), (3, torch.float32), (2, torch.float16)])
def test_each_rank_gets_its_partition_of_the_mean(world: int, dtype: torch.dtype) -> None:
    results = run_ranks(world, _reduce, dtype, timeout_s=120)
    means = [torch.stack([_inputs(r, dtype)[i].float() for r in range(world)]).mean(0) for i in range(len(SHAPES))]
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {"atol": 1e-6, "rtol": 1e-6}
    for rank, res in enumerate(results):
        pieces = res["pieces"]
        assert [p.dtype for p in pieces] == [dtype] * len(SHAPES)
        for piece, mean in zip(pieces, means, strict=True):
            torch.testing.assert_close(piece.float(), _expected_piece(mean, rank, world), **tol)
        assert res["empty"] == []
        for piece, mean in zip(res["fallback"], [means[0], means[3]], strict=True):
            torch.testing.assert_close(piece.float(), _expected_piece(mean, rank, world), **tol)
        assert "(4, " in res["quantized"] and "qgZ" in res["quantized"]


def test_partition_sizes_follow_deepspeeds_split() -> None:
    from ds_engine.runtime.comm.coalesced_collectives import _partition_sizes

    assert _partition_sizes(6, 2) == [3, 3]
    assert _partition_sizes(3, 2) == [2, 1]
    assert _partition_sizes(1, 2) == [1, 0]
    assert _partition_sizes(49, 2) == [25, 24]
    assert _partition_sizes(2, 4) == [1, 1, 0, 0]
