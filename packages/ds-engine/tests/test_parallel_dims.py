"""`_parallel.dims` on one process: the degrees read from a config before validation, the replica count the batch
triple is resolved for, and the refusals of degrees that do not fit the world (naming the config keys).

The mesh itself (4 ranks, tensor x sequence parallel) is built in tests/dist/test_dist_tensor_sequence_parallel.py,
with data and expert parallelism too (8 ranks) in tests/dist/test_dist_parallel_mesh_4d.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_engine as deepspeed
from ds_engine._parallel import tp_model_init as _tp_model_init
from ds_engine._parallel.dims import (
    check_degrees_fit,
    expected_replica_world_size,
    model_expert_degree,
    requested_degrees,
    resolve_parallel_layout,
)
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture(autouse=True)
def _no_record_left() -> Any:
    """A `tp_model_init` record must not leak into other tests."""
    yield
    _tp_model_init._RECORD.clear()


@pytest.mark.parametrize(
    ("extra", "degrees"),
    [
        ({}, (1, 1)),
        ({"tensor_parallel": {"autotp_size": 2}}, (2, 1)),
        ({"sequence_parallel_size": 4}, (1, 4)),
        ({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}, (2, 2)),
        # not a degree as written: counts as 1 here, and validation names the key
        ({"tensor_parallel": {"autotp_size": True}, "sequence_parallel_size": "2"}, (1, 1)),
        ({"tensor_parallel": "x", "sequence_parallel_size": -3}, (1, 1)),
    ],
)
def test_requested_degrees_from_a_dict(extra: dict[str, Any], degrees: tuple[int, int]) -> None:
    assert requested_degrees({**BASE, **extra}) == degrees


def test_requested_degrees_from_a_file_and_a_validated_config(tmp_path: Path) -> None:
    config = {**BASE, "tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert requested_degrees(str(path)) == (2, 2)
    assert requested_degrees(DeepSpeedConfig(config, world_size=1)) == (2, 2)
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        requested_degrees(str(tmp_path / "missing.json"))


def test_requested_degrees_take_tp_model_inits_size_when_the_key_is_unset() -> None:
    pytest.importorskip("ds_parallel", reason="tp_model_init needs ds-parallel")
    from ds_parallel.tensor import set_autotp_mode

    deepspeed.tp_model_init(nn.Linear(4, 4), tp_size=2, dtype=torch.float32)
    set_autotp_mode(training=False)
    assert requested_degrees(BASE) == (2, 1)
    assert requested_degrees({**BASE, "tensor_parallel": {"autotp_size": 0}}) == (2, 1)
    assert requested_degrees({**BASE, "tensor_parallel": {"autotp_size": 4}}) == (4, 1)  # merge refuses it later
    assert requested_degrees(DeepSpeedConfig(BASE, world_size=1)) == (2, 1)
    assert _tp_model_init._RECORD  # not consumed: initialize() merges it after validation


def test_expected_replica_world_size_without_a_process_group() -> None:
    assert expected_replica_world_size(1, 1, mpu=None) == 1
    assert expected_replica_world_size(2, 2, mpu=None) == 1  # world of one: the layout refuses the degrees later


@pytest.mark.parametrize(
    ("world", "tp", "sp", "fits"),
    [
        (4, 2, 2, True),
        (8, 2, 2, True),
        (2, 0, 2, True),  # autotp_size 0: unset, no tensor parallelism
        (6, 4, 1, False),
        (6, 2, 2, False),
        (3, 1, 2, False),
        (3, 0, 2, False),
        (1, 2, 1, False),
    ],
)
def test_degrees_must_divide_the_world(world: int, tp: int, sp: int, fits: bool) -> None:
    if fits:
        check_degrees_fit(world, tp, sp)
        return
    with pytest.raises(ValueError, match=f"does not divide the world size {world}") as err:
        check_degrees_fit(world, tp, sp)
    msg = str(err.value)
    assert (f"tensor_parallel.autotp_size={tp}" in msg) == (tp > 1)
    assert (f"sequence_parallel_size={sp}" in msg) == (sp > 1)
    assert f"{max(tp, 1)} x {sp} = {max(tp, 1) * sp} ranks" in msg


def test_layout_without_degrees_or_with_an_mpu_builds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_comm

    monkeypatch.setattr(ds_comm, "is_initialized", lambda: False)  # earlier tests may have left a world of one
    plain = resolve_parallel_layout(tp=1, sp=1, mpu=None)
    assert plain.dims is None and plain.mpu is None and plain.dist.world_size == 1
    assert resolve_parallel_layout(tp=0, sp=1, mpu=None).dims is None  # autotp_size 0: unset
    with pytest.raises(RuntimeError, match=r"tensor_parallel.autotp_size=2 and sequence_parallel_size=2: building"):
        resolve_parallel_layout(tp=2, sp=2, mpu=None)
    with pytest.raises(RuntimeError, match=r"^sequence_parallel_size=2: building"):
        resolve_parallel_layout(tp=0, sp=2, mpu=None)


def test_initialize_in_a_world_of_one_names_both_keys() -> None:
    pytest.importorskip("ds_parallel", reason="tensor parallelism needs ds-parallel")
    config = {**BASE, "tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}
    # no process group (RuntimeError), or a world of one left by an earlier test (ValueError: 4 ranks needed)
    with pytest.raises(
        (RuntimeError, ValueError), match=r"^tensor_parallel.autotp_size=2 and sequence_parallel_size=2"
    ):
        deepspeed.initialize(model=nn.Linear(4, 4), config=config, dist_init_required=False)


def test_a_bad_degree_is_still_named_by_validation() -> None:
    with pytest.raises(DeepSpeedConfigError, match="sequence_parallel_size"):
        deepspeed.initialize(
            model=nn.Linear(4, 4), config={**BASE, "sequence_parallel_size": 0}, dist_init_required=False
        )


def _marked(module: nn.Module, group_name: str) -> nn.Module:
    for p in module.parameters():
        p.allreduce, p.group_name = False, group_name  # DeepSpeed's expert mark (ds-parallel's Experts sets it)
    return module


def test_model_expert_degree_reads_the_moe_layers_ep_size() -> None:
    """The `ep` dim the mesh gets from an MoE model: its layers' one degree; 1 for dense or mixed degrees."""
    assert model_expert_degree(nn.Linear(2, 2)) == 1
    assert model_expert_degree(nn.Sequential(nn.Linear(2, 2), _marked(nn.Linear(2, 2), "ep_size_4"))) == 4
    mixed = nn.Sequential(_marked(nn.Linear(2, 2), "ep_size_2"), _marked(nn.Linear(2, 2), "ep_size_4"))
    assert model_expert_degree(mixed) == 1
