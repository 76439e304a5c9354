"""DeepSpeed's lr schedules against their closed-form formulas at many steps, plus state and argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from ds_engine.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, get_lr_from_config


def _opt(lr: float = 0.1, groups: int = 1, adam: bool = False) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=lr) if adam else torch.optim.SGD(params, lr=lr)


def _run(schedule, steps: int) -> list[float]:
    """lr used by each optimizer step i = 0..steps-1 (the scheduler steps after the optimizer)."""
    lrs = []
    for _ in range(steps):
        lrs.append(schedule.optimizer.param_groups[0]["lr"])
        schedule.step()
    return lrs


def _warm(i: int, n: int, kind: str) -> float:
    n = max(2, n)
    return math.log(i + 1) / math.log(n) if kind == "log" else i / n


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind: str) -> None:
    sched = WarmupLR(_opt(), warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=30, warmup_type=kind)
    lrs = _run(sched, 60)
    # Step 0 runs at warmup_min_lr (set at construction); after the k-th scheduler step it = k - 1.
    expected = [0.01] + [0.01 + 0.19 * (_warm(it, 30, kind) if it < 30 else 1.0) for it in range(59)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert sched.state_dict() == {"last_batch_iteration": 59}


def test_warmup_lr_max_defaults_to_the_optimizer_lr_and_reference_value() -> None:
    sched = WarmupLR(_opt(lr=1e-3), warmup_num_steps=10)
    sched.step()
    sched.step()
    assert sched.last_batch_iteration == 1
    assert sched.get_last_lr() == pytest.approx([0.001 * math.log(2) / math.log(10)])  # 3.0103e-4, DeepSpeed's


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind: str) -> None:
    sched = WarmupDecayLR(
        _opt(), total_num_steps=80, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=20, warmup_type=kind
    )
    lrs = _run(sched, 100)
    expected = [0.0]
    for it in range(99):
        gamma = _warm(it, 20, kind) if it < 20 else max(0.0, (80 - it) / max(1.0, 80 - 20))
        expected.append(0.05 * gamma)
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert lrs[-1] == 0.0


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind: str) -> None:
    sched = WarmupCosineLR(
        _opt(lr=0.3, groups=2),
        total_num_steps=70,
        warmup_min_ratio=0.1,
        warmup_num_steps=20,
        cos_min_ratio=0.01,
        warmup_type=kind,
    )
    lrs = _run(sched, 90)
    expected = [0.0]
    for it in range(89):
        if it < 20:
            ratio = 0.1 + 0.9 * _warm(it, 20, kind)
        else:
            progress = min(1.0, (it - 20 + 1) / (70 - 20))
            ratio = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        expected.append(0.3 * ratio)
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert [g["lr"] for g in sched.optimizer.param_groups] == pytest.approx([0.003, 0.003])


def _one_cycle_scale(it: int, first: int, second: int) -> float:
    total = first + second
    batch = it + 1
    x = batch / total - math.floor(batch / total)
    ratio = first / total
    return x / ratio if x <= ratio else (x - 1) / (ratio - 1)


def test_one_cycle_lr_momentum_and_decay() -> None:
    opt = _opt(adam=True)
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        decay_lr_rate=0.5,
        cycle_first_step_size=10,
        cycle_second_step_size=6,
        decay_step_size=4,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.01,
    )
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.999)
    for it in range(40):
        sched.step()
        group = opt.param_groups[0]
        if it < 16:
            scale = _one_cycle_scale(it, 10, 6)
            lr, mom = 0.01 + 0.09 * scale, 0.9 - 0.1 * scale
        else:
            interval = (it - 16 + 1) / 4
            lr, mom = 0.01 / (1 + 0.5 * interval), 0.9 * (1 + 0.01 * interval)
        assert group["lr"] == pytest.approx(lr, rel=1e-12), it
        assert group["betas"] == pytest.approx((mom, 0.999), rel=1e-12), it


def test_one_cycle_staircase_holds_each_stair() -> None:
    sched = OneCycle(
        _opt(),
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=8,
        cycle_first_stair_count=4,
        cycle_momentum=False,
    )
    lrs = []
    for _ in range(16):
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == pytest.approx(
        [0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25, 0.0, 0.0]
    )


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    sched = LRRangeTest(
        _opt(),
        lr_range_test_min_lr=0.002,
        lr_range_test_step_size=5,
        lr_range_test_step_rate=0.5,
        lr_range_test_staircase=staircase,
    )
    lrs = _run(sched, 30)
    expected = [0.002]
    for it in range(29):
        units = (it + 1) / 5
        expected.append(0.002 * (1 + 0.5 * (math.floor(units) if staircase else units)))
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_state_dict_resume_continues_the_schedule() -> None:
    a = WarmupDecayLR(_opt(), total_num_steps=50, warmup_num_steps=10)
    _run(a, 17)
    b = WarmupDecayLR(_opt(), total_num_steps=50, warmup_num_steps=10)
    b.load_state_dict(a.state_dict())
    a.step()
    b.step()
    assert a.get_last_lr() == b.get_last_lr()


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer, got 0"):
        WarmupLR(_opt(), warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_type must be 'log' or 'linear', got 'cosine'"):
        WarmupCosineLR(_opt(), total_num_steps=10, warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_min_lr: expected 2 values"):
        WarmupLR(_opt(groups=2), warmup_min_lr=[0.1, 0.2, 0.3])
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        OneCycle(_opt(adam=True), 0.1, 1.0, last_batch_iteration=5).get_last_lr()
    with pytest.raises(TypeError, match="needs an optimizer with param_groups"):
        WarmupLR(object())  # type: ignore[arg-type]


def test_get_lr_from_config() -> None:
    assert get_lr_from_config({"type": "OneCycle", "params": {"cycle_max_lr": 0.5}}) == (0.5, "")
    assert get_lr_from_config({"type": "Nope", "params": {}})[0] is None


def _two_groups(lrs: tuple[float, float] = (0.1, 0.2), beta2: tuple[float, float] = (0.99, 0.95)) -> torch.optim.Adam:
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr, "betas": (0.9, b2)}
        for lr, b2 in zip(lrs, beta2, strict=True)
    ]
    return torch.optim.Adam(groups)


def test_warmup_lr_without_max_warms_each_group_to_its_own_lr() -> None:
    opt = _two_groups()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_num_steps=10, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2]
    sched.step(5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.1])
    sched.step(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])


def test_one_cycle_per_group_ranges_follow_the_scalar_formula_per_group() -> None:
    opt = _two_groups()
    sched = OneCycle(
        opt,
        cycle_min_lr=[0.01, 0.02],
        cycle_max_lr=[0.1, 0.3],
        cycle_first_step_size=6,
        cycle_second_step_size=4,
        cycle_min_mom=[0.8, 0.85],
        cycle_max_mom=[0.9, 0.95],
    )
    # construction: each group at its own minimum lr and momentum, its beta2 kept
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.02])
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.95)]
    for it in range(10):
        sched.step()
        scale = _one_cycle_scale(it, 6, 4)
        lrs = [0.01 + 0.09 * scale, 0.02 + 0.28 * scale]
        moms = [0.9 - 0.1 * scale, 0.95 - 0.1 * scale]
        assert sched.get_lr() == pytest.approx(lrs, rel=1e-12) == [g["lr"] for g in opt.param_groups]
        assert sched.get_mom() == [g["betas"] for g in opt.param_groups]
        assert [m for m, _ in sched.get_mom()] == pytest.approx(moms, rel=1e-12)
        assert [b2 for _, b2 in sched.get_mom()] == [0.99, 0.95]
    with pytest.raises(ValueError, match="cycle_max_mom: expected 2 values"):
        OneCycle(_two_groups(), 0.01, 0.1, cycle_max_mom=[0.9, 0.95, 0.99])
    assert OneCycle(_two_groups(), 0.01, 0.1, cycle_momentum=False).get_mom() is None


def test_one_cycle_with_an_empty_second_half_rises_over_the_whole_cycle() -> None:
    sched = OneCycle(_opt(), cycle_min_lr=0.001, cycle_max_lr=0.1, cycle_first_step_size=100, cycle_second_step_size=0)
    assert sched.step_ratio == 1.0 and sched.get_last_lr() == [pytest.approx(0.001)]
    lrs = _run(sched, 101)[1:]
    assert lrs == pytest.approx([0.001 + 0.099 * (i + 1) / 100 for i in range(99)] + [0.001], rel=1e-9)
    with pytest.raises(ValueError, match="cycle_second_step_size >= 0"):
        OneCycle(_opt(), 0.001, 0.1, cycle_first_step_size=10, cycle_second_step_size=-1)
    with pytest.raises(ValueError, match="cycle_first_step_size must be > 0"):
        OneCycle(_opt(), 0.001, 0.1, cycle_first_step_size=0, cycle_second_step_size=10)
