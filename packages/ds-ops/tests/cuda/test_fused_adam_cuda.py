"""FusedAdam on a CUDA device against torch.optim.AdamW / Adam (runs only where CUDA is present).

Tolerance: rtol=1e-5, atol=1e-6 for fp32 (fp32 math in torch's order, no FMA), against both torch's
for-loop Adam and its fused CUDA kernel (`fused=True`); bf16/fp16 parameters
keep their moments in the parameter dtype (DeepSpeed's FusedAdam), checked against an emulation
with rtol=2e-2.
"""

from __future__ import annotations

import io

import pytest
import torch

from ds_ops import FusedAdam

pytestmark = pytest.mark.cuda

SIZES = (1, 7, 4097, 65536, 1_000_003)


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=generator).to(device="cuda", dtype=dtype)) for n in SIZES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=generator).cuda() for n in SIZES]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_adam_over_100_steps(adam_w_mode: bool) -> None:
    ours_params, ref_params = _params(), _params()
    groups = [{"params": ours_params[:3]}, {"params": ours_params[3:], "lr": 3e-3, "weight_decay": 0.1}]
    ref_groups = [{"params": ref_params[:3]}, {"params": ref_params[3:], "lr": 3e-3, "weight_decay": 0.1}]
    ours = FusedAdam(groups, lr=1e-3, adam_w_mode=adam_w_mode, weight_decay=0.01)
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        ref_groups, lr=1e-3, weight_decay=0.01, foreach=False
    )
    for step in range(100):
        for p, q, g in zip(ours_params, ref_params, _grads(step), strict=True):
            p.grad, q.grad = g, g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_fused_adam_over_50_steps(adam_w_mode: bool) -> None:
    """Against torch's own CUDA kernel (`fused=True`), the engine's default optimizer on CUDA: 1e-5."""
    ours_params, ref_params = _params(), _params()
    ours = FusedAdam(ours_params, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=adam_w_mode, weight_decay=0.05)
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        ref_params, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, fused=True
    )
    for step in range(50):
        for p, q, g in zip(ours_params, ref_params, _grads(step), strict=True):
            p.grad, q.grad = g, g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-6)


def test_bf16_params_and_state_dict_round_trip() -> None:
    params = _params(torch.bfloat16)
    ours = FusedAdam(params, lr=1e-3)
    for step in range(5):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g.bfloat16()
        ours.step()
    assert all(ours.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = FusedAdam(resumed_params, lr=1e-3)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(5, 8):
        for p, q, g in zip(params, resumed_params, _grads(step), strict=True):
            p.grad, q.grad = g.bfloat16(), g.bfloat16()
        ours.step()
        resumed.step()
    for p, q in zip(params, resumed_params, strict=True):
        assert torch.equal(p, q)


def test_cuda_and_cpu_parameters_in_one_group() -> None:
    """A group with parameters on both devices: CUDA ones through the CUDA op, CPU ones through the CPU op."""
    params = [
        torch.nn.Parameter(torch.randn(4097, device="cuda")),
        torch.nn.Parameter(torch.randn(513)),
    ]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    reference = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01, foreach=False)
    for step in range(20):
        generator = torch.Generator().manual_seed(step)
        for p, q in zip(params, ref_params, strict=True):
            grad = torch.randn(p.numel(), generator=generator).to(p.device)
            p.grad, q.grad = grad, grad.clone()
        ours.step()
        reference.step()
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [ours.state[p]["step"] for p in params] == [20] * len(params)
