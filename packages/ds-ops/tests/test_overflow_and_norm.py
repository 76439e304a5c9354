"""Local overflow detection, fused unscale, and the global grad norm on one rank."""

from __future__ import annotations

import math

import pytest
import torch

from ds_ops.precision import clip_grads_by_norm_, global_grad_norm, has_overflow, local_overflow, unscale_and_check_


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_local_overflow_finds_non_finite(bad: float, dtype: torch.dtype) -> None:
    clean = [torch.ones(5, dtype=dtype), None, torch.empty(0, dtype=dtype)]
    assert local_overflow(clean).item() == 0.0 and not has_overflow(clean)
    dirty = [*clean, torch.tensor([1.0, bad], dtype=dtype)]
    assert local_overflow(dirty).item() == 1.0 and has_overflow(dirty)


def test_unscale_and_check() -> None:
    a, b = torch.full((4,), 8.0), torch.full((3,), 4.0)
    found = unscale_and_check_([a, b], 0.25)
    assert found.item() == 0.0 and a.tolist() == [2.0] * 4 and b.tolist() == [1.0] * 3
    c = torch.tensor([1.0, float("inf")])
    assert unscale_and_check_([a, c], 0.5).item() == 1.0


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norm_matches_torch(norm_type: float) -> None:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(17, generator=g), torch.randn(3, 5, generator=g), None]
    ref = torch.nn.utils.get_total_norm([t for t in grads if t is not None], norm_type=norm_type)
    torch.testing.assert_close(global_grad_norm(grads, norm_type=norm_type), ref, rtol=1e-6, atol=1e-6)


def test_clip_matches_torch_clip_grad_norm() -> None:
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(10, generator=g)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10
    ours = [p.grad.clone() for p in params]
    total = global_grad_norm(ours)
    factor = clip_grads_by_norm_(ours, 1.0, total)
    ref_total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(total, ref_total)
    assert factor < 1.0
    for a, p in zip(ours, params, strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=1e-7)
    assert clip_grads_by_norm_(ours, 1.0, torch.tensor(float("nan"))) == 1.0
