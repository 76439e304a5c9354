"""`initialize_mesh_device` refuses, by name, what cannot become a mesh before touching torch's mesh code."""

from __future__ import annotations

import pytest

import ds_comm


def test_needs_an_initialised_process_group() -> None:
    assert not ds_comm.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ds_comm.initialize_mesh_device((1,), ("dp",))


def test_shape_and_names_must_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds_comm._device_mesh.is_initialized", lambda: True)
    monkeypatch.setattr("ds_comm._device_mesh.get_world_size", lambda: 4)
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) and mesh_dim_names \('dp',\) differ in length"):
        ds_comm.initialize_mesh_device((2, 2), ("dp",))
    with pytest.raises(ValueError, match="covers 2 ranks, the world has 4"):
        ds_comm.initialize_mesh_device((1, 2), ("dp", "tp"))
