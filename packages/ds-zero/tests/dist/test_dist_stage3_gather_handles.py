"""Several in-flight parameter gathers waited on as one (`MultipleAllGatherHandles`), on 2 gloo ranks.

`gather_params(async_op=True)` issues one collective per dtype; wrapping its handles in
`MultipleAllGatherHandles` and waiting once (with DeepSpeed's `handle_dependency=False` keyword) must
leave every parameter available with exactly the values it was built with.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_comm.testing import run_ranks
from ds_zero import MultipleAllGatherHandles, ZeroParamStatus
from ds_zero._params.gather import gather_params
from ds_zero._params.partitioned_module import partition_module


def _build() -> nn.Module:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    model[1].to(torch.bfloat16)  # a second dtype: a second collective
    return model


def _gather_two_dtypes(rank: int, world: int) -> dict[str, Any]:
    reference = {n: p.detach().clone() for n, p in _build().named_parameters()}
    model = _build()
    partition_module(model, group=None)
    params = list(model.parameters())
    handles = gather_params(params, group=None, fp_group=None, label="test", async_op=True, checked=False)
    inflight = [p.ds_status for p in params]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    return {
        "handles": len(handles),
        "inflight": all(s is ZeroParamStatus.INFLIGHT for s in inflight),
        "available": all(p.ds_status is ZeroParamStatus.AVAILABLE for p in params),
        "equal": all(torch.equal(p.data, reference[n]) for n, p in model.named_parameters()),
    }


def test_one_wait_completes_the_gathers_of_every_dtype() -> None:
    for out in run_ranks(2, _gather_two_dtypes, timeout_s=120):
        assert out == {"handles": 2, "inflight": True, "available": True, "equal": True}
