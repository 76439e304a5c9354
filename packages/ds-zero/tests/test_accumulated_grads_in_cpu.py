"""DeepSpeed's names `accumulated_grads_in_cpu`, `single_partition_of_fp32_groups`, `bit16_groups_flat`, one process.

With optimizer offload each micro-step's reduced gradient is added into the host fp32 partitions; the
property views each parameter's fragment of them, so it must equal plain PyTorch's accumulated `.grad`
after every backward, and be empty once `step()` ends the window (and without offload).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ds_zero


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _zero(model: nn.Module, stage: int, offload: bool) -> ds_zero.DeepSpeedZeroOptimizer:
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    section = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    return ds_zero.ZeroOptimizer(base, config=ds_zero.ZeroConfig(stage=stage, **section), module=model)


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(i))


def test_stage2_offload_follows_every_micro_step_and_empties_at_the_step() -> None:
    model, ref = _model(), _model()
    opt = _zero(model, 2, offload=True)
    assert opt.accumulated_grads_in_cpu == {}  # nothing accumulated yet
    for micro in range(3):
        opt.backward(model(_x(micro)).pow(2).mean())
        ref(_x(micro)).pow(2).mean().backward()
        held = opt.accumulated_grads_in_cpu
        assert sorted(held) == [0, 1, 2, 3]  # the four parameters, in group order
        for i, p in enumerate(ref.parameters()):
            assert held[i].device.type == "cpu" and held[i].dtype == torch.float32
            torch.testing.assert_close(held[i], p.grad.reshape(-1), rtol=1e-6, atol=1e-7)
    assert opt.step() is True
    assert opt.accumulated_grads_in_cpu == {}  # the window ended: nothing is held


def test_stage1_offload_holds_the_window_once_reduced() -> None:
    model = _model()
    opt = _zero(model, 1, offload=True)
    opt.backward(model(_x(0)).sum())
    assert opt.accumulated_grads_in_cpu == {}  # stage 1 reduces at the step: the host holds nothing yet
    opt._get_norm_groups()  # reduces this window now
    held = opt.accumulated_grads_in_cpu
    assert len(held) == 4 and all(float(t.abs().sum()) > 0 for t in held.values())
    opt.step()
    assert opt.accumulated_grads_in_cpu == {}


@pytest.mark.parametrize("stage", [1, 2])
def test_without_offload_nothing_is_on_the_host(stage: int) -> None:
    model = _model()
    opt = _zero(model, stage, offload=False)
    opt.backward(model(_x(0)).sum())
    assert opt.accumulated_grads_in_cpu == {}


def test_single_partition_of_fp32_groups_are_the_masters_the_base_optimizer_steps() -> None:
    model = _model()
    opt = _zero(model, 2, offload=True)
    opt.backward(model(_x(0)).sum())
    opt.step()
    masters = opt.single_partition_of_fp32_groups
    assert masters is opt.masters and masters[0].dtype == torch.float32
    assert set(opt.state) == set(masters)  # Adam's state is keyed by them (DeepSpeed's layout)
    torch.testing.assert_close(masters[0], torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit16_groups_flat_is_the_buffer_the_parameters_view(stage: int, dtype: torch.dtype) -> None:
    model = _model().to(dtype)
    opt = _zero(model, stage, offload=False)
    (flat,) = opt.bit16_groups_flat
    assert flat.dtype == dtype and flat.grad_fn is None and flat.device.type == "cpu"
    params = list(model.parameters())
    assert flat.numel() >= sum(p.numel() for p in params)
    torch.testing.assert_close(
        flat[: sum(p.numel() for p in params)], torch.cat([p.detach().reshape(-1) for p in params])
    )
    opt.backward(model(_x(0).to(dtype)).float().sum())
    opt.step()  # the step writes through the buffer: the parameters still read it
    torch.testing.assert_close(flat[: params[0].numel()], params[0].detach().reshape(-1), rtol=0, atol=0)
    assert params[0].data_ptr() == flat.data_ptr()
