"""Loss scalers: scripted overflow patterns against hand-computed scale sequences."""

from __future__ import annotations

import pytest
import torch

from ds_ops.precision import DynamicLossScaler, LossScaleAtMinimumError, LossScaler, create_loss_scaler


def _run(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    seq = []
    for c in pattern:
        scaler.update_scale(c == "T")
        seq.append(scaler.cur_scale)
    return seq


def test_growth_after_window_and_halving_without_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=2, delayed_shift=1)
    assert _run(s, "FFFTFFF") == [16, 16, 32, 16, 16, 16, 32]
    assert (s.cur_iter, s.last_overflow_iter) == (7, 3)


def test_hysteresis_spends_budget_before_lowering() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=100, delayed_shift=2)
    assert _run(s, "TTFTT") == [16, 8, 8, 4, 2]


def test_consecutive_hysteresis_refills_on_clean_steps() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=100, delayed_shift=2, consecutive_hysteresis=True)
    assert _run(s, "TTFTT") == [16, 8, 8, 8, 4]


def test_window_growth_refills_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=16, scale_window=2, delayed_shift=2)
    assert _run(s, "TFFF") == [16, 16, 16, 32]  # overflow at 0 spends hysteresis; clean 1,2 -> doubles at iter 3
    assert s.cur_hysteresis == 2


def test_min_scale_error_and_floor() -> None:
    s = DynamicLossScaler(init_scale=2, min_scale=1, delayed_shift=1)
    s.update_scale(True)
    assert s.cur_scale == 1
    with pytest.raises(LossScaleAtMinimumError, match=r"already at its minimum \(1.0\)"):
        s.update_scale(True)
    quiet = DynamicLossScaler(init_scale=2, min_scale=1, delayed_shift=1, raise_error_at_min_scale=False)
    assert _run(quiet, "TTT") == [1, 1, 1]


def test_defaults_match_deepspeed_fp16_section() -> None:
    s = DynamicLossScaler()
    assert (s.cur_scale, s.scale_factor, s.scale_window, s.min_scale, s.delayed_shift) == (65536.0, 2.0, 1000, 1.0, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scale_window": 0}, "fp16.loss_scale_window"),
        ({"delayed_shift": 0}, "fp16.hysteresis"),
        ({"min_scale": 0}, "fp16.min_loss_scale"),
        ({"scale_factor": 1.0}, "scale_factor must be > 1"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


def test_state_dict_round_trip_continues_identically() -> None:
    a = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=2)
    _run(a, "FTFF")
    b = DynamicLossScaler(init_scale=1, scale_window=3, delayed_shift=2)
    b.load_state_dict(a.state_dict())
    assert _run(a, "FFTTFFFF") == _run(b, "FFTTFFFF")


def test_static_scaler_and_factory() -> None:
    s = LossScaler(128)
    loss = torch.tensor(2.0)
    assert s.scale_loss(loss).item() == 256.0
    s.update_scale(True)
    assert s.cur_scale == 128 and s.state_dict()["dynamic"] is False
    assert isinstance(create_loss_scaler(torch.float16), DynamicLossScaler)
    assert create_loss_scaler(torch.float16, static_loss_scale=8).cur_scale == 8
    assert create_loss_scaler(torch.bfloat16).cur_scale == 1.0
    assert LossScaler(1.0).scale_loss(loss) is loss
