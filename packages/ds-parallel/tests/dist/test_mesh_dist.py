"""The mesh on 4 and 8 gloo ranks: each named dim's group members, and the groups/mpu views of them."""

from __future__ import annotations

from typing import Any

import pytest

from ds_comm.testing import run_ranks


def _layout(rank: int, world: int, degrees: dict[str, int]) -> dict[str, Any]:
    from ds_parallel import MeshMPU, groups

    mesh = groups.initialize_mesh(**degrees)
    mpu = MeshMPU(mesh)
    out = {name: (mesh.size(name), mesh.rank(name), mesh.ranks(name)) for name in mesh.dim_names}
    out["groups"] = (
        groups._get_sequence_parallel_world_size(),
        groups._get_sequence_parallel_rank(),
        groups._get_data_parallel_world_size(),
        groups._get_data_parallel_rank(),
        groups._get_sequence_data_parallel_world_size(),
        groups._get_model_parallel_world_size(),
        groups._get_expert_parallel_world_size(),
    )
    out["mpu"] = (
        mpu.get_data_parallel_world_size(),
        mpu.get_data_parallel_rank(),
        mpu.get_sequence_parallel_world_size(),
        mpu.get_sequence_parallel_rank(),
        mpu.get_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
    )
    return out


def test_sp2_dp2_layout() -> None:
    """SP groups are consecutive ranks ({0,1}, {2,3}); DP groups stride over them ({0,2}, {1,3})."""
    res = run_ranks(4, _layout, {"sp": 2}, timeout_s=120)
    for rank, r in enumerate(res):
        assert r["sp"] == (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1])
        assert r["dp"] == (2, rank // 2, [rank % 2, rank % 2 + 2])
        assert r["dp_sp"] == (4, rank, [0, 1, 2, 3])
        assert r["tp"] == (1, 0, [rank]) and r["pp"] == (1, 0, [rank])
        assert r["groups"] == (2, rank % 2, 2, rank // 2, 4, 1, 1)
        assert r["mpu"] == (2, rank // 2, 2, rank % 2, 1, 1)


@pytest.mark.timeout(240)
def test_all_dims_layout_on_8_ranks() -> None:
    """pp=2, dp=2 (ep=2 inside it), sp=1, tp=2: tp innermost, then ep, then pp outermost."""
    res = run_ranks(8, _layout, {"pp": 2, "ep": 2, "tp": 2}, timeout_s=200)
    for rank, r in enumerate(res):
        assert r["tp"][2] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["pp"][2] == [rank % 4, rank % 4 + 4]
        assert r["ep"][2] == r["dp"][2] == [rank - rank % 4 + rank % 2, rank - rank % 4 + rank % 2 + 2]
        assert r["edp"][0] == 1 and r["sp"][0] == 1
        assert r["groups"][6] == 2 and r["mpu"][4:] == (2, 2)


def _expert_groups(rank: int, world: int) -> dict[str, Any]:
    from ds_parallel import groups

    mesh = groups.initialize_mesh(sp=2, ep=2)
    groups._create_expert_and_data_parallel(2)
    name = "ep_size_2"
    return {
        "edp_sp": mesh.ranks("edp_sp"),
        "ep": groups._get_expert_parallel_group_ranks(name),
        "edp": (groups._get_expert_data_parallel_group_ranks(name), groups._get_expert_data_parallel_rank(name)),
    }


@pytest.mark.timeout(240)
def test_expert_data_parallel_group_holds_the_sequence_peers() -> None:
    """sp=2, dp=4 (ep=2 inside it) on 8 ranks: a rank's experts are also held by its sequence-parallel peer,
    which routes other tokens to them, so the expert-data-parallel group is `edp` x `sp` (4 ranks), not `edp`."""
    for rank, r in enumerate(run_ranks(8, _expert_groups, timeout_s=200)):
        sp, ep = rank % 2, rank // 2 % 2
        same_experts = [e * 4 + ep * 2 + s for e in range(2) for s in range(2)]  # edp outer, sp inner
        assert r["edp_sp"] == same_experts and r["edp"] == (same_experts, same_experts.index(rank))
        assert r["ep"] == [rank - rank % 4 + sp, rank - rank % 4 + sp + 2]


def _world_mismatch(rank: int, world: int) -> str:
    from ds_parallel import ParallelDims, build_mesh

    try:
        build_mesh(ParallelDims(world_size=4, sp=2))
    except ValueError as err:
        return str(err)
    return "no error"


def test_dims_for_another_world_size_refused() -> None:
    assert "world_size 4 != torch.distributed world size 2" in run_ranks(2, _world_mismatch, timeout_s=60)[0]


def _module_mpu(rank: int, world: int) -> tuple[int, ...]:
    from ds_parallel import parallel_state_sp as mpu

    mpu.initialize_sequence_parallel(2)
    return (
        mpu.get_sequence_parallel_world_size(),
        mpu.get_sequence_parallel_rank(),
        mpu.get_data_parallel_world_size(),
        mpu.get_data_parallel_rank(),
        mpu.get_sequence_data_parallel_world_size(),
        mpu.get_sequence_data_parallel_rank(),
        mpu.get_model_parallel_world_size(),
        mpu.get_model_parallel_rank(),
    )


def test_parallel_state_sp_module_is_a_mesh_view() -> None:
    res = run_ranks(4, _module_mpu, timeout_s=120)
    # get_model_parallel_* alias the sequence-parallel group, as DeepSpeed's module does
    assert res == [(2, r % 2, 2, r // 2, 4, r, 2, r % 2) for r in range(4)]
