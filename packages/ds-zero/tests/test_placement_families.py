"""Placement families (`ds_zero._params.placement`) and the AutoEP ZeRO-3 checkpoint refusal, in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ds_zero._checkpoint.autoep_zero3 import AutoEPZero3CheckpointError, is_autoep_zero3, refuse_autoep_zero3
from ds_zero._params.placement import family_group, family_runs, placement_group


def _param(family: str | None = None, group: object = None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2, 3))
    if family is not None:
        p.ds_zero_placement_family = family
        p.ds_zero_partition_process_group = group
        p.ds_zero_partition_group_name = "ep_size_2"
    return p


def test_placement_group_is_the_familys_or_the_default() -> None:
    default, experts = object(), object()
    assert placement_group(_param(), default) is default
    assert placement_group(_param("replicated"), default) is default
    assert placement_group(_param("autoep_expert", experts), default) is experts


@pytest.mark.parametrize(
    ("param", "message"),
    [
        (_param("autoep_expert", None), r"has no ds_zero_partition_process_group \(group name 'ep_size_2'\)"),
        (_param("tensor_parallel", object()), r"ds_zero_placement_family='tensor_parallel'"),
    ],
)
def test_placement_group_refuses_an_unknown_or_incomplete_family(param: nn.Parameter, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        placement_group(param, None)


def test_family_runs_keep_first_appearance_order() -> None:
    g1, g2 = object(), object()
    params = [_param(), _param("autoep_expert", g1), _param(), _param("autoep_expert", g2), _param("autoep_expert", g1)]
    for p in params:  # partitioned: the group the shards live on
        p.ds_process_group = getattr(p, "ds_zero_partition_process_group", None)
    runs = family_runs(params)
    assert [g for g, _ in runs] == [None, g1, g2]
    position = {id(p): i for i, p in enumerate(params)}
    assert [[position[id(p)] for p in run] for _, run in runs] == [[0, 2], [1, 4], [3]]
    assert family_group(params[0]) is None and family_group(params[3]) is g2


def test_autoep_zero3_model_states_are_refused_by_name(tmp_path: Path) -> None:
    entry = {"module_path": "model.layers.0.mlp", "ep_size": 2}
    assert not is_autoep_zero3({"ds_autoep_layers": [entry]})  # ZeRO 1/2 entries: consolidated as before
    refuse_autoep_zero3({"ds_autoep_layers": [entry]}, tmp_path / "x.pt")
    zero3 = {**entry, "checkpoint_format": "zero3_partitioned", "checkpoint_format_version": 1}
    with pytest.raises(AutoEPZero3CheckpointError, match=r"zero_to_fp32: .*x.pt is an AutoEP checkpoint saved at ZeRO"):
        refuse_autoep_zero3({"ds_autoep_layers": [zero3]}, tmp_path / "x.pt")
    with pytest.raises(NotImplementedError, match=r"ds_to_universal\.py"):  # DeepSpeed's exception type and hint
        refuse_autoep_zero3({"autoep_layers": [zero3]}, "y.pt")
