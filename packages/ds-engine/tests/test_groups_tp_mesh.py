"""`deepspeed.utils.groups._init_tp_mesh_device`: which path builds DeepSpeed's TP/DP groups, and their ranks.

The process group calls are replaced by recorders (world of 6, tensor-parallel size 3), so these run in
one process; `dist/test_dist_groups_tp_mesh.py` builds the groups for real on 4 gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ds_parallel", reason="deepspeed.utils.groups needs ds-parallel: pip install 'ds-engine[parallel]'")

from ds_engine.utils import groups  # noqa: E402


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    made: list[tuple[int, ...]] = []

    def new_group(ranks: list[int]) -> tuple[int, ...]:
        made.append(tuple(ranks))
        return tuple(ranks)

    for name in ("_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
        monkeypatch.setattr(groups, name, None)
    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: 6)
    monkeypatch.setattr(groups.dist, "get_rank", lambda group=None: 4)
    monkeypatch.setattr(groups.dist, "new_group", new_group)
    return made


# data-parallel groups (stride 3) first, then tensor-parallel groups (consecutive ranks)
EXPLICIT = [(0, 3), (1, 4), (2, 5), (0, 1, 2), (3, 4, 5)]


def test_debug_detail_skips_the_mesh(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mesh(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the DeviceMesh must not be tried under TORCH_DISTRIBUTED_DEBUG=DETAIL")

    monkeypatch.setattr(groups.dist, "initialize_mesh_device", no_mesh)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
    assert groups._init_tp_mesh_device(tensor_model_parallel_size=3) == ((1, 4), (3, 4, 5))
    assert calls == EXPLICIT
    assert groups.get_data_parallel_group() == (1, 4)
    assert groups.get_tensor_model_parallel_group() == groups.get_model_parallel_group() == (3, 4, 5)
    # already set: nothing is rebuilt
    assert groups._init_tp_mesh_device(tensor_model_parallel_size=3) is None
    assert calls == EXPLICIT


def test_split_refusal_falls_back(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = []

    def refuse(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
        shapes.append((shape, names))
        raise RuntimeError(f"torch says: {groups._DEVICE_MESH_SPLIT_UNSUPPORTED}.")

    monkeypatch.setattr(groups.dist, "initialize_mesh_device", refuse)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert groups._init_tp_mesh_device(3) == ((1, 4), (3, 4, 5))
    assert shapes == [((2, 3), ("data_parallel", "tensor_parallel"))]
    assert calls == EXPLICIT


def test_other_mesh_errors_propagate(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(groups.dist, "initialize_mesh_device", broken)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    with pytest.raises(RuntimeError, match="unhandled system error"):
        groups._init_tp_mesh_device(3)
    assert calls == []
    with pytest.raises(RuntimeError, match="tensor model parallel group is not initialized"):
        groups.get_tensor_model_parallel_group()


def test_mesh_groups_are_used(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    class Mesh:
        def get_group(self, mesh_dim: str) -> str:
            return f"mesh-{mesh_dim}"

    monkeypatch.setattr(groups.dist, "initialize_mesh_device", lambda shape, names: Mesh())
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert groups._init_tp_mesh_device(3) == ("mesh-data_parallel", "mesh-tensor_parallel")
    assert groups.get_model_parallel_group() == "mesh-tensor_parallel"
    assert calls == []


@pytest.mark.parametrize(
    ("tp", "dp", "match"), [(4, None, "positive divisor of the world size 6"), (3, 3, "must equal")]
)
def test_layouts_that_do_not_fit_are_refused(calls: list, tp: int, dp: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        groups._init_tp_mesh_device(tp, dp)
    assert calls == []
