"""`_resolve_autotp_partition` cuts a whole parameter as the AutoTP layer that holds it cut it: for every rank,
plain and uneven, replicated, and fused q/k/v (per sub-parameter), it returns exactly the layer's shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from ds_engine.checkpoint import constants
from ds_engine.checkpoint.universal_checkpoint import (
    AutoTPRestoreError,
    SubparamShape,
    _narrow_sub_params,
    _resolve_autotp_partition,
)

tensor = pytest.importorskip("ds_parallel", reason="the AutoTP layers are ds-parallel's").tensor


def test_constants_agree_with_the_layers() -> None:
    from ds_parallel.tensor import _uc_meta

    assert constants.DS_AUTOTP_UC_META == tensor.DS_AUTOTP_UC_META
    assert constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE == _uc_meta.UC_VERSION
    for key in ("AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS", "PARAMETER_WITH_SUB_PARAMS", "SUB_PARAM_SHARD_WIDTHS"):
        assert getattr(constants, key) == getattr(_uc_meta, key)


def _as_tp(layer: Any, world: int, total: int) -> None:
    layer.tp_world_size = world
    layer._freeze_partition_sizes(total)
    layer._mark_uc_metadata()


@pytest.mark.parametrize(
    "make",
    [
        lambda: (tensor.LinearLayer(nn.Linear(5, 11), None, name="mlp.up_proj"), 11),
        lambda: (tensor.LinearAllreduce(nn.Linear(11, 5), None, name="mlp.down_proj"), 11),
        lambda: (tensor.GateUpPackLinearLayer(nn.Linear(5, 14), None, name="gate_up_proj"), 14),
        lambda: (tensor.SubParamLinearLayer(nn.Linear(3, 14), None, shape=((8, 3, 3), -1), name="qkv"), 14),
    ],
)
@pytest.mark.parametrize("world", [2, 3])
def test_restore_matches_the_layer_cut(make: Callable[[], tuple[Any, int]], world: int) -> None:
    layer, total = make()
    _as_tp(layer, world, total)
    for pname, layout in layer.layouts.items():
        whole = torch.randn(layer._orig_shapes[pname])
        param = getattr(layer, pname)
        for rank in range(world):
            got = _resolve_autotp_partition(param, {}, whole, tp_rank=rank, tp_world_size=world)
            assert got is not None and torch.equal(got, layout.shard(whole, rank).flatten())


def test_unsupported_and_unmarked() -> None:
    layer = tensor.Yuan_LinearLayer(nn.Linear(4, 4), None, name="v_proj")
    with pytest.raises(RuntimeError, match="noncontiguous head groups"):
        _resolve_autotp_partition(layer.weight, {}, torch.zeros(16), tp_rank=0, tp_world_size=1)
    assert _resolve_autotp_partition(nn.Parameter(torch.zeros(3)), {}, torch.zeros(3), 0, 2) is None


def test_narrow_sub_params_refuses_bad_records() -> None:
    full = torch.arange(12.0).view(6, 2)
    with pytest.raises(ValueError, match="another parameter"):
        _narrow_sub_params(full, 0, (4, 4), [[2, 2], [2, 2]], 0, 2, 0.4)
    with pytest.raises(ValueError, match="before version 0.4"):
        _narrow_sub_params(full, 0, (3, 3), None, 0, 2, 0.3)
    assert torch.equal(_narrow_sub_params(full, 0, (4, 2), [[3, 1], [1, 1]], 1, 2, 0.4), full[[3, 5]].flatten())


def test_legacy_records_and_error_kinds() -> None:
    """Old records: sub-parameters named only by a converter's `SubparamShape`, or no sizes at all (an even
    split). An uneven dim with no recorded sizes is refused, as both AssertionError and ValueError."""
    full = torch.arange(24.0).view(8, 3)
    param = nn.Parameter(torch.zeros(4, 3))
    spec = SubparamShape(patterns=["^p$"], shape=((4, 4), 3), partition_dim=0)
    setattr(param, constants.DS_AUTOTP_UC_META, {"partition_dim": 0, "logical_shape": (8, 3), "sub_param_shape": spec})
    got = _resolve_autotp_partition(param, {}, full.flatten(), tp_rank=1, tp_world_size=2)
    assert got is not None and torch.equal(got, full[[2, 3, 6, 7]].flatten())
    setattr(param, constants.DS_AUTOTP_UC_META, {"partition_dim": 0, "logical_shape": (8, 3)})
    got = _resolve_autotp_partition(param, {}, full.flatten(), tp_rank=1, tp_world_size=2)
    assert got is not None and torch.equal(got, full[4:].flatten())
    for kind in (AssertionError, ValueError):
        with pytest.raises(kind, match="not divisible by tp_world_size 3"):
            _resolve_autotp_partition(param, {}, full.flatten(), tp_rank=0, tp_world_size=3)
    assert issubclass(AutoTPRestoreError, AssertionError)
