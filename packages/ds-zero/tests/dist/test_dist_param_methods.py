"""DeepSpeed's per-parameter methods on 2 ranks: `p.all_gather()`, `p.all_gather_coalesced(ps)`, `p.partition()`.

* A model built under `ds_zero.Init` (no optimizer yet): a gather gives the exact initial values of an
  unpartitioned copy (the last rank's padded shard included) and holds them until `partition()`;
  `partition(has_been_updated=True)` keeps an edit made on every rank.
* A model under a stage-3 optimizer: a held parameter stays gathered through a forward that would
  otherwise release it, and `partition()` releases it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero import ZeroParamStatus

SIZES = (7, 10, 13)  # 7 and 13 do not split evenly over 2 ranks: the last shard is padded


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.arange(1.0, n + 1)) for n in SIZES)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * sum(p.sum() for p in self.ps)


def _standalone(rank: int, world: int) -> dict[str, Any]:
    with ds_zero.Init():
        model = Holder()
    ps = list(model.ps)
    out: dict[str, Any] = {"released_at_start": all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in ps)}
    ps[0].all_gather()
    out["one"] = (ps[0].ds_status, ps[1].ds_status, ps[0].data.clone())
    ps[0].all_gather()  # held once: a second gather changes nothing
    handle = ps[0].all_gather_coalesced(ps)
    handle.wait()
    out["all"] = [p.data.clone() for p in ps]
    with torch.no_grad():
        ps[2].data.mul_(-1)
    ps[0].partition(ps, has_been_updated=True)
    out["after_partition"] = [p.ds_status for p in ps]
    with ds_zero.GatheredParameters(ps):
        out["edited"] = [p.data.clone() for p in ps]
    with pytest.raises(NotImplementedError, match="qwZ"):
        ps[0].all_gather_coalesced(ps, quantize=True)
    return out


def test_gather_and_partition_a_standalone_model() -> None:
    for r in run_ranks(2, _standalone, timeout_s=120):
        expected = [torch.arange(1.0, n + 1) for n in SIZES]
        assert r["released_at_start"]
        status0, status1, value0 = r["one"]
        assert status0 is ZeroParamStatus.AVAILABLE and status1 is ZeroParamStatus.NOT_AVAILABLE
        assert torch.equal(value0, expected[0])
        assert all(torch.equal(a, b) for a, b in zip(r["all"], expected, strict=True))
        assert r["after_partition"] == [ZeroParamStatus.NOT_AVAILABLE] * len(SIZES)
        assert torch.equal(r["edited"][2], -expected[2]) and torch.equal(r["edited"][0], expected[0])


def _managed(rank: int, world: int) -> dict[str, Any]:
    with ds_zero.Init():
        model = Holder()
    cfg = {"stage": 3, "stage3_param_persistence_threshold": 0}
    ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    weight = model.lin.weight
    weight.all_gather()
    with torch.no_grad():
        model(torch.ones(2, 4))
    held_through_forward = weight.ds_status is ZeroParamStatus.AVAILABLE
    weight.partition()
    with torch.no_grad():
        model(torch.ones(2, 4))
    return {"held": held_through_forward, "released": weight.ds_status is ZeroParamStatus.NOT_AVAILABLE}


def test_a_held_parameter_survives_a_forward_until_partition() -> None:
    assert run_ranks(2, _managed, timeout_s=120) == [{"held": True, "released": True}] * 2
