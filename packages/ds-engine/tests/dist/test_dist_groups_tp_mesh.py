"""DeepSpeed's TP/DP groups on 4 gloo ranks (tp=2): the DeviceMesh path and the explicit `new_group` path
(`TORCH_DISTRIBUTED_DEBUG=DETAIL`) give the same ranks, and each group reduces over exactly them.

Needs ds-parallel (the `ds-engine[all]` session); skipped without it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="deepspeed.utils.groups needs ds-parallel: pip install 'ds-engine[parallel]'")


def _groups(rank: int, world: int, detail: bool) -> dict[str, object]:
    import os

    import ds_comm
    from ds_engine.utils import groups

    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    else:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    dp_group, tp_group = groups._init_tp_mesh_device(tensor_model_parallel_size=2)
    assert dp_group is groups.get_data_parallel_group() and tp_group is groups.get_tensor_model_parallel_group()
    value = torch.tensor([float(rank + 1)])
    ds_comm.all_reduce(value, group=tp_group)
    return {
        "tp": dist.get_process_group_ranks(tp_group),
        "dp": dist.get_process_group_ranks(dp_group),
        "tp_sum": float(value),
        "sizes": (groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_world_size()),
        "ranks": (groups.get_tensor_model_parallel_rank(), groups.get_data_parallel_rank()),
    }


@pytest.mark.parametrize("detail", [False, True], ids=["device_mesh", "new_group"])
def test_tp_dp_groups(detail: bool) -> None:
    results = run_ranks(4, _groups, detail, timeout_s=120)
    for rank, got in enumerate(results):
        tp = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert got == {
            "tp": tp,
            "dp": [rank % 2, rank % 2 + 2],
            "tp_sum": float(sum(r + 1 for r in tp)),
            "sizes": (2, 2),
            "ranks": (rank % 2, rank // 2),
        }
