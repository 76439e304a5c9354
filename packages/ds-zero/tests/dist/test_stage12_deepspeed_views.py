"""DeepSpeed's names for the stage-1/2 flat buffers on 2 ranks: `parallel_partitioned_bit16_groups` and
`nccl_start_alignment_factor` (DeepSpeed's `TestPartitionNcclAlignment` reads both).

Every rank sees every rank's partition as a view of its own flat buffer, in rank order; the partitions tile the
buffer; and the own partition is the one this rank's masters were cast from. (Unlike DeepSpeed's, ds's flat buffers
are padded to a multiple of the world size, not of `2 * world`, so a 16-bit partition may start 2-byte aligned.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zero_dist_cases import make_model, make_optimizer, zero_config

import ds_zero
from ds_comm.testing import run_ranks


def _views(rank: int, world: int, stage: int, dtype: torch.dtype) -> dict[str, Any]:
    model = make_model(dtype=dtype)
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=zero_config(stage), module=model)
    out: dict[str, Any] = {"factor": opt.nccl_start_alignment_factor, "groups": []}
    for flat, parts, master in zip(
        opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups, opt.single_partition_of_fp32_groups, strict=True
    ):
        out["groups"].append(
            {
                "count": len(parts),
                "tiles": torch.equal(torch.cat(parts), flat),
                "views": all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in parts),
                "own_is_master": torch.equal(parts[rank].float(), master.float()),
            }
        )
    opt.close()
    return out


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rank_sees_each_ranks_partition_of_its_flat_buffer(stage: int, dtype: torch.dtype) -> None:
    for result in run_ranks(2, _views, stage, dtype, timeout_s=120):
        assert result["factor"] == 2
        assert result["groups"], "no param group"
        for group in result["groups"]:
            assert group == {"count": 2, "tiles": True, "views": True, "own_is_master": True}
