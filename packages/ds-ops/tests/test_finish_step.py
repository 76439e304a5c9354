"""`finish_step` on one rank: the order unscale -> check -> scale update -> norm -> clip, against plain torch."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ds_ops.precision import DynamicLossScaler, LossScaler, StepOutcome, finish_step, unscale_and_check_


def _grads(seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, generator=g) * scale, torch.randn(3, 4, generator=g) * scale]


def _torch_reference(grads: list[torch.Tensor], scale: float, clip: float) -> tuple[list[torch.Tensor], float]:
    """Unscale, then torch's clip_grad_norm_ (eps 1e-6, as DeepSpeed) on parameters holding `grads`."""
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads, strict=True):
        p.grad = t.clone() / scale
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    return [p.grad for p in params], float(norm)


@pytest.mark.parametrize(
    ("scale", "clip", "compute_norm"), list(itertools.product((1.0, 256.0, 1000.0), (0.0, 0.5, 100.0), (True, False)))
)
def test_clean_step_matches_torch(scale: float, clip: float, compute_norm: bool) -> None:
    grads = _grads(scale=scale)
    ref, ref_norm = _torch_reference(grads, scale, clip)
    outcome = finish_step(grads, scaler=LossScaler(scale), clip=clip, compute_norm=compute_norm)
    assert outcome.applied and not outcome.overflow
    if clip > 0 or compute_norm:
        assert outcome.grad_norm == pytest.approx(ref_norm, rel=1e-6)
    else:
        assert outcome.grad_norm is None
    assert outcome.clip_coef == (pytest.approx(clip / (ref_norm + 1e-6)) if 0 < clip < ref_norm else 1.0)
    for ours, theirs in zip(grads, ref, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("bad", "scale", "clip", "compute_norm"),
    list(itertools.product((math.inf, -math.inf, math.nan), (1.0, 8.0), (0.0, 0.5), (True, False))),
)
def test_overflow_skips_and_updates_the_scaler(bad: float, scale: float, clip: float, compute_norm: bool) -> None:
    grads = _grads(scale=scale)
    grads[1][2, 3] = bad
    scaler = DynamicLossScaler(init_scale=scale, delayed_shift=1, min_scale=0.5)
    outcome = finish_step(grads, scaler=scaler, clip=clip, compute_norm=compute_norm)
    assert outcome == StepOutcome(applied=False, grad_norm=outcome.grad_norm, clip_coef=1.0)
    assert scaler.cur_scale == scale / 2 and scaler.last_overflow_iter == 0 and scaler.cur_iter == 1
    if clip > 0 or compute_norm:
        assert not math.isfinite(outcome.grad_norm)


def test_bf16_style_no_norm_no_clip_still_checks() -> None:
    """The case ZeRO-1/2 used to miss: scale 1, no norm wanted, no clipping; the check runs on its own."""
    grads = _grads()
    grads[0][0] = math.inf
    outcome = finish_step(grads, scaler=LossScaler(1.0), clip=0.0, compute_norm=False, check_overflow=True)
    assert not outcome.applied and outcome.grad_norm is None


def test_check_off_applies_bad_gradients_unclipped() -> None:
    grads = _grads()
    grads[0][0] = math.nan
    before = [t.clone() for t in grads]
    outcome = finish_step(grads, scaler=None, clip=0.5, check_overflow=False)
    assert outcome.applied and math.isnan(outcome.grad_norm) and outcome.clip_coef == 1.0
    for a, b in zip(grads, before, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_skip_flag_skips_a_clean_step() -> None:
    grads = _grads(scale=4.0)
    scaler = DynamicLossScaler(init_scale=4.0, delayed_shift=2)
    outcome = finish_step(grads, scaler=scaler, clip=0.0, skip=torch.ones(1))
    assert not outcome.applied and scaler.cur_hysteresis == 1
    assert finish_step(_grads(), scaler=None, check_overflow=False, skip=torch.zeros(1)).applied


def test_dynamic_scaler_requires_the_check() -> None:
    with pytest.raises(ValueError, match="dynamic loss scaler needs check_overflow=True"):
        finish_step(_grads(), scaler=DynamicLossScaler(), check_overflow=False)
    with pytest.raises(ValueError, match=r"clip \(gradient_clipping\) must be >= 0, got -1"):
        finish_step(_grads(), scaler=None, clip=-1.0)


def test_nothing_to_do_reads_nothing_back(monkeypatch) -> None:
    """fp32 without clipping or a check: no pass over the gradients and no host sync."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self) or [])
    grads = _grads()
    before = [t.clone() for t in grads]
    assert finish_step(grads, scaler=None, check_overflow=False).applied
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))


def test_unscale_and_check_with_scale_one_writes_nothing() -> None:
    t = torch.tensor([1.0, 2.0])
    ptr_before = t.clone()
    assert unscale_and_check_([t], 1.0).item() == 0.0 and torch.equal(t, ptr_before)
    assert unscale_and_check_([], 0.5).item() == 0.0
