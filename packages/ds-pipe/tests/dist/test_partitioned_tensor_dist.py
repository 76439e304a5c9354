"""`PartitionedTensor` on 3 gloo ranks: slices, the all-gathered whole (even and uneven splits), meta round trip.

3 ranks make uneven splits natural (7 x 5 = 35 elements -> slices of 12, 12, 11); a 2-rank subgroup
checks that `group` is honoured (ranks outside it hold nothing of it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks
from ds_pipe import PartitionedTensor, partition_uniform


def _full_tensor(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5 - 3.0


def _ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (rows, cols) in {"even": (world * 4, 3), "uneven": (7, 5)}.items():
        full = _full_tensor(rows, cols)
        part = PartitionedTensor(full, group=None)
        rebuilt = PartitionedTensor.from_meta(part.to_meta(), part.data(), None)
        out[name] = {
            "local": part.local_data.clone(),
            "local_size": tuple(part.local_size()),
            "partition": list(part.partition),
            "even_split": part.even_split,
            "full": part.full(),
            "rebuilt_full": rebuilt.full(),
            "rebuilt_size": rebuilt.full_size(),
        }
    sub = ds_comm.new_group([0, 2])
    if rank in (0, 2):
        part = PartitionedTensor(_full_tensor(3, 3), group=sub)
        out["sub"] = (part.num_parts, part.rank, part.full())
    return out


def test_slices_and_full_match_the_tensor_on_3_ranks() -> None:
    results = run_ranks(3, _ranks, timeout_s=120)
    for name, (rows, cols) in {"even": (12, 3), "uneven": (7, 5)}.items():
        full = _full_tensor(rows, cols)
        bounds = partition_uniform(rows * cols, 3)
        for rank, r in enumerate(results):
            got = r[name]
            assert got["partition"] == bounds
            assert got["even_split"] == (name == "even")
            torch.testing.assert_close(got["local"], full.view(-1)[bounds[rank] : bounds[rank + 1]], rtol=0, atol=0)
            assert got["local_size"] == (bounds[rank + 1] - bounds[rank],)
            torch.testing.assert_close(got["full"], full, rtol=0, atol=0)
            torch.testing.assert_close(got["rebuilt_full"], full, rtol=0, atol=0)
            assert got["rebuilt_size"] == [rows, cols]
    assert results[1].get("sub") is None
    for rank, group_rank in ((0, 0), (2, 1)):
        num_parts, got_rank, full = results[rank]["sub"]
        assert (num_parts, got_rank) == (2, group_rank)
        torch.testing.assert_close(full, _full_tensor(3, 3), rtol=0, atol=0)


def test_single_process_holds_the_whole_tensor() -> None:
    full = _full_tensor(4, 2)
    part = PartitionedTensor(full)
    assert part.num_parts == 1 and part.partition == [0, 8] and part.even_split
    torch.testing.assert_close(part.full(), full, rtol=0, atol=0)
    assert part.full() is not full and part.to_meta().tolist() == [2, 4, 2, 1, 0, 0, 8]


def test_from_meta_refuses_a_meta_for_another_group() -> None:
    meta = torch.tensor([1, 6, 2, 1, 0, 3, 6], dtype=torch.long)  # rank 1 of 2 parts
    with pytest.raises(ValueError, match="rank 1 of 2 parts"):
        PartitionedTensor.from_meta(meta, torch.zeros(3), None)
    with pytest.raises(ValueError, match="torch.long"):
        PartitionedTensor.from_meta(meta.float(), torch.zeros(3), None)
    with pytest.raises(TypeError, match="torch.Tensor"):
        PartitionedTensor([1.0, 2.0])  # type: ignore[arg-type]
