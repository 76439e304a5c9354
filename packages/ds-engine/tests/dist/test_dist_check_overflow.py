"""`deepspeed.runtime.utils.CheckOverflow` / `get_weight_norm` on 2 gloo ranks: rank 1 alone holds an inf.

Which ranks learn of it follows DeepSpeed: an MoE parameter (`allreduce = False`) widens the agreement to
the expert-parallel group; `check_using_norm(reduce_overflow=True)` and `zero_reduce_scatter` to the world;
without any of those the answer stays local.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._utils import _flatten_dense_tensors

from ds_comm.testing import run_ranks


def _params(rank: int, moe: bool) -> list[torch.nn.Parameter]:
    dense = torch.nn.Parameter(torch.zeros(1))
    dense.grad = torch.ones(1)
    other = torch.nn.Parameter(torch.zeros(1))
    other.grad = torch.tensor([float("inf") if rank == 1 else 1.0])
    if moe:
        other.allreduce = False  # an expert's parameter
    return [dense, other]


def _checks(rank: int, world: int, moe: bool) -> dict[str, Any]:
    from ds_engine.runtime.utils import CheckOverflow, get_weight_norm

    if moe:
        import ds_parallel

        ds_parallel.groups._create_expert_and_data_parallel(2)
    params = _params(rank, moe)
    norm = get_weight_norm([_flatten_dense_tensors([p.grad for p in params])])
    checker = CheckOverflow([params])
    return {
        "norm": norm,
        "by_grads": checker.check(),
        "by_norm_local": checker.check_using_norm([norm], reduce_overflow=False),
        "by_norm_world": checker.check_using_norm([norm], reduce_overflow=True),
        "zero_reduce_scatter": CheckOverflow([params], zero_reduce_scatter=True).check(),
        "serial": checker.has_overflow_serial(params),
    }


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_overflow_on_one_rank(moe: bool) -> None:
    if moe:
        pytest.importorskip("ds_parallel", reason="MoE groups need ds-parallel: pip install 'ds-engine[parallel]'")
    results = run_ranks(2, _checks, moe=moe, timeout_s=120)
    assert results[0]["norm"] == pytest.approx(2**0.5) and results[1]["norm"] == -1.0
    for rank, result in enumerate(results):
        own = rank == 1
        assert result["serial"] is own
        assert result["by_grads"] is (own or moe)  # MoE: agreed over the expert-parallel group
        assert result["by_norm_local"] is (own or moe)
        assert result["by_norm_world"] is True and result["zero_reduce_scatter"] is True


def test_check_needs_parameters() -> None:
    from ds_comm import UsageError
    from ds_engine.runtime.utils import CheckOverflow, get_weight_norm

    with pytest.raises(UsageError, match="pass param_groups"):
        CheckOverflow().check()
    assert get_weight_norm([torch.tensor([3.0, 4.0])]) == 5.0
    assert get_weight_norm([torch.tensor([3.0, -7.0])], norm_type=float("inf")) == 7.0
    assert get_weight_norm([torch.tensor([float("nan")])]) == -1.0
