"""The stage-3 optimizer's partition index: where each trained parameter's master and gradient slot are.

One process (world size 1), a bf16 model, so the fp32 master is a separate copy of the shards: the index
must point each parameter at its own slice of its group's master and gradient, a write of the shard (a
`GatheredParameters` modifier) must reach that slice, and frozen parameters stay out of the index.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero import GatheredParameters
from ds_zero._params.partitioned_param import state_of

CFG = {"stage": 3, "stage3_param_persistence_threshold": 0}


def _build() -> tuple[nn.Module, ds_zero.DeepSpeedZeroOptimizer_Stage3, nn.Module]:
    """The partitioned model, its optimizer, and a plain copy of the model made before partitioning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(torch.bfloat16)
    model[0].bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=CFG)
    return model, opt, ref


def test_index_points_every_trained_parameter_at_its_master_slice_and_gradient_slot() -> None:
    model, opt, ref = _build()
    index = opt.partition_index
    frozen = model[0].bias
    assert frozen not in index and state_of(frozen).master_sink is None
    trained = [p for p in model.parameters() if p.requires_grad]
    assert len(index) == len(trained) == 3
    (part,) = opt.partitions
    assert part.master is not None and not part.master_is_shard
    for p, off, s in zip(part.params, part.offsets, part.sizes, strict=True):
        slots = index[p]
        assert state_of(p).master_sink is index
        assert slots.grad_flat is part.master and slots.grad_offset == off
        assert slots.master is not None and slots.master.data_ptr() == part.master[off:].data_ptr()
        assert slots.master.numel() == s and slots.master_writer is None
        assert slots.grad_bucket is not None
    # the reduced gradient of each parameter lands in its slot of the master's gradient (one rank: the
    # whole gradient, as plain torch computes it)
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    opt.backward(model(x).float().pow(2).sum())
    ref(x).float().pow(2).sum().backward()
    ref_trained = [p for p in ref.parameters() if p.requires_grad]
    for p, r in zip(trained, ref_trained, strict=True):
        slots = index[p]
        assert slots.grad_flat.grad is not None and r.grad is not None
        got = slots.grad_flat.grad[slots.grad_offset : slots.grad_offset + state_of(p).shard_numel]
        torch.testing.assert_close(got, r.grad.reshape(-1).float(), atol=0, rtol=0)


def test_a_shard_write_reaches_the_master_and_conversion_is_refused() -> None:
    model, opt, _ = _build()
    weight = model[2].weight
    with GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.fill_(0.25)
    master = opt.partition_index[weight].master
    assert master is not None
    torch.testing.assert_close(master, torch.full_like(master, 0.25), atol=0, rtol=0)
    with pytest.raises(ValueError, match="after its ZeRO stage-3 optimizer was built"):
        model.half()
