"""ZenFlow at ZeRO stage 1/2 in one process against a plain-PyTorch reference of the same math.

The reference (`zenflow_math.reference_run`) is written from ZenFlow's rules alone, with torch tensors:
columns picked by the sum of |gradient| (top `max(1, int(ratio * columns))`), torch's `AdamW` on the
selected columns only (its state cleared at each reselection), the rest of the gradient summed on the
side and applied every `update_interval` steps by a hand-written Adam(W) whose bias correction counts
micro steps, with the selected columns kept out of that update. `ZenFlowZeroOptimizer` must give the
same weights.
Also: the schedule's boundaries and the refusals of bad settings, each naming its key.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zenflow_math import LR, WD, reference_run

import ds_ops
import ds_zero


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(6, 12, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def _zenflow(stage: int = 2, **zenflow) -> ds_zero.ZeroConfig:
    return ds_zero.ZeroConfig(stage=stage, offload_optimizer={"device": "cpu"}, zenflow=zenflow)


@pytest.mark.parametrize(("stage", "warm"), [(2, 0), (1, 2)])
def test_matches_plain_torch_reference(stage: int, warm: int) -> None:
    model, ref = _model(), _model()
    batches = _batches(10)
    base = ds_ops.ZenFlowCPUAdam(model.parameters(), lr=LR, weight_decay=WD)
    cfg = _zenflow(
        stage, topk_ratio=0.3, select_strategy="step", select_interval=4, update_interval=2, full_warm_up_rounds=warm
    )
    opt = ds_zero.ZenFlowZeroOptimizer(
        base, config=cfg, module=model, selective_optimizer_params={"lr": LR, "weight_decay": WD}
    )
    schedule = opt.zenflow_schedule
    for m, (x, y) in enumerate(batches):
        opt.backward(nn.functional.mse_loss(model(x), y) / schedule.update_interval)
        if schedule.is_update_boundary(m):
            assert opt.step() is True
        opt.zero_grad()
    reference_run(
        ref,
        lambda net, m: nn.functional.mse_loss(net(batches[m][0]), batches[m][1]) / 2,
        len(batches),
        ratio=0.3,
        select=4,
        update=2,
        warm=warm,
    )
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    # ZenFlow really split the update: some columns moved between CPU updates
    assert getattr(next(model.parameters()), "selected_indices", None) is not None


@pytest.mark.parametrize(("stage", "warm"), [(2, 0), (1, 2)])
def test_auto_update_interval_matches_plain_torch_reference(stage: int, warm: int) -> None:
    """`update_interval: "auto"` (`ds_zero._zenflow.auto_update`): the same CPU update steps and weights as the
    reference's restatement of the rule; some windows end by the rule, some micro steps are not boundaries."""
    model, ref = _model(), _model()
    batches = _batches(14)
    base = ds_ops.ZenFlowCPUAdam(model.parameters(), lr=LR, weight_decay=WD)
    cfg = _zenflow(
        stage,
        topk_ratio=0.3,
        select_strategy="step",
        select_interval=6,
        update_interval="auto",
        full_warm_up_rounds=warm,
    )
    opt = ds_zero.ZenFlowZeroOptimizer(
        base, config=cfg, module=model, selective_optimizer_params={"lr": LR, "weight_decay": WD}
    )
    assert opt.zenflow_schedule.auto_update and opt.zenflow_schedule.loss_divisor == 1
    ours = []
    for m, (x, y) in enumerate(batches):
        opt.backward(nn.functional.mse_loss(model(x), y))
        if opt.is_zenflow_update_boundary(m):
            ours.append(m)
            assert opt.step() is True
        opt.zero_grad()
    theirs = reference_run(
        ref,
        lambda net, m: nn.functional.mse_loss(net(batches[m][0]), batches[m][1]),
        len(batches),
        ratio=0.3,
        select=6,
        update=0,
        warm=warm,
        auto_ratio=0.99,
    )
    print(f"auto update boundaries (stage {stage}, warm {warm}): {ours}")
    assert ours == theirs
    fixed = {m for m in range(len(batches)) if m + 1 <= warm or (m + 1) % 6 == 0}
    assert set(ours) - fixed and set(range(warm, len(batches))) - set(ours), ours  # the rule decided both ways
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_schedule_boundaries() -> None:
    s = ds_zero.ZenFlowSchedule.from_config(
        ds_zero.ZenFlowConfig(select_strategy="step", select_interval=6, update_interval=3, full_warm_up_rounds=2)
    )
    assert [m for m in range(14) if s.is_select_boundary(m)] == [2, 6, 12]
    assert [m for m in range(14) if s.is_update_boundary(m)] == [0, 1, 4, 5, 7, 10, 11, 13]
    epoch = ds_zero.ZenFlowSchedule.from_config(ds_zero.ZenFlowConfig(update_interval=2), steps_per_epoch=8)
    assert (epoch.select_strategy, epoch.select_interval) == ("epoch", 8)
    once = ds_zero.ZenFlowSchedule.from_config(ds_zero.ZenFlowConfig(update_interval=2))
    assert once.select_interval == 0 and [m for m in range(9) if once.is_select_boundary(m)] == [0]


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"select_strategy": "auto", "select_interval": 3, "update_interval": 2}, "zenflow.select_interval=3"),
        ({"select_strategy": "step", "update_interval": 2}, 'zenflow.select_interval="auto"'),
        ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "shorter than update_interval"),
    ],
)
def test_refused_schedules_name_the_key(section: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_zero.ZenFlowSchedule.from_config(ds_zero.ZenFlowConfig(**section))


def test_refusals_name_the_setting() -> None:
    model = _model()
    section = {"select_strategy": "step", "select_interval": 2, "update_interval": 2}
    with pytest.raises(ValueError, match='offload_optimizer.device "cpu"'):
        ds_zero.ZenFlowZeroOptimizer(
            ds_ops.ZenFlowCPUAdam(model.parameters()), config=ds_zero.ZeroConfig(stage=2, zenflow=section)
        )
    with pytest.raises(TypeError, match="ZenFlowCPUAdam"):
        ds_zero.ZenFlowZeroOptimizer(torch.optim.AdamW(model.parameters()), config=_zenflow(**section))
    with pytest.raises(ValueError, match="ZenFlowZeroOptimizer"):  # the plain optimizer does not run the loop
        ds_zero.DeepSpeedZeroOptimizer(ds_ops.ZenFlowCPUAdam(model.parameters()), config=_zenflow(**section))
    conv = nn.Conv1d(2, 2, 3)
    with pytest.raises(ValueError, match="1-D and 2-D parameters"):
        ds_zero.ZenFlowZeroOptimizer(ds_ops.ZenFlowCPUAdam(conv.parameters()), config=_zenflow(**section))


def _run(opt: ds_zero.ZenFlowZeroOptimizer, model: nn.Module, batches, start: int) -> None:
    schedule = opt.zenflow_schedule
    for m, (x, y) in enumerate(batches, start=start):
        opt.backward(nn.functional.mse_loss(model(x), y) / schedule.update_interval)
        if schedule.is_update_boundary(m):
            opt.step()
        opt.zero_grad()


def test_state_dict_resumes_the_same_run() -> None:
    section = {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 4, "update_interval": 2}

    def build(seed: int) -> tuple[nn.Module, ds_zero.ZenFlowZeroOptimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 4))
        base = ds_ops.ZenFlowCPUAdam(model.parameters(), lr=LR, weight_decay=WD)
        return model, ds_zero.ZenFlowZeroOptimizer(base, config=_zenflow(**section), module=model)

    batches = _batches(12)
    whole, whole_opt = build(3)
    _run(whole_opt, whole, batches, 0)
    first, first_opt = build(3)
    _run(first_opt, first, batches[:6], 0)  # ends mid-selection (reselect at 8), after an update (m=5)
    saved = first_opt.state_dict()
    resumed, resumed_opt = build(99)  # other weights: all of it must come from the checkpoint
    resumed_opt.load_state_dict([saved])
    assert resumed_opt.micro_step == 5
    _run(resumed_opt, resumed, batches[6:], 6)
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
