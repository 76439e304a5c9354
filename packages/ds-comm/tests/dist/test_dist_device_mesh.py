"""`initialize_mesh_device` on 4 gloo ranks: a row-major (2, 2) mesh whose groups reduce over the right ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm.testing import run_ranks


def _mesh(rank: int, world: int) -> dict[str, object]:
    mesh = ds_comm.initialize_mesh_device((2, 2), ("outer", "inner"))
    out: dict[str, object] = {}
    for name in ("outer", "inner"):
        group = mesh.get_group(mesh_dim=name)
        value = torch.tensor([float(rank)])
        ds_comm.all_reduce(value, group=group)
        out[name] = (dist.get_process_group_ranks(group), float(value))
    with pytest.raises(ValueError, match="covers 6 ranks"):
        ds_comm.initialize_mesh_device((3, 2), ("a", "b"))
    return out


def test_mesh_groups_are_row_major() -> None:
    results = run_ranks(4, _mesh, timeout_s=120)
    for rank, got in enumerate(results):
        inner = [rank // 2 * 2, rank // 2 * 2 + 1]  # consecutive ranks share the last dim
        outer = [rank % 2, rank % 2 + 2]
        assert got == {"outer": (outer, float(sum(outer))), "inner": (inner, float(sum(inner)))}
