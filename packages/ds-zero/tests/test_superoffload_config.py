"""`offload_optimizer.super_offload` / `cpuadam_cores_perc`: what the config accepts, what it refuses by key path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

import ds_zero
from ds_zero._stage3.superoffload import worker_threads
from ds_zero.config import ZeroConfig


def _zero(**offload: Any) -> dict[str, Any]:
    return {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True, **offload}}


def test_accepted_at_stage3_with_cpu_offload() -> None:
    z = ZeroConfig.model_validate(_zero(cpuadam_cores_perc=0.9))
    assert z.offload_optimizer.super_offload and z.offload_optimizer.cpuadam_cores_perc == 0.9


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({**_zero(), "stage": 2}, "super_offload=true needs zero_optimization.stage=3"),
        ({**_zero(), "stage": 1}, "super_offload=true needs zero_optimization.stage=3"),
        ({"stage": 3, "offload_optimizer": {"device": "none", "super_offload": True}}, 'device="cpu"'),
        (
            {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "super_offload": True}},
            'device="cpu"',
        ),
        (_zero(cpuadam_cores_perc=0.0), "zero_optimization.offload_optimizer.cpuadam_cores_perc must be in (0, 1]"),
        (_zero(cpuadam_cores_perc=1.5), "cpuadam_cores_perc"),
    ],
)
def test_refused_naming_the_key(config: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError, match="super_offload|cpuadam_cores_perc") as info:
        ZeroConfig.model_validate(config)
    assert needle in str(info.value)


def test_cores_perc_without_super_offload_warns() -> None:
    with pytest.warns(UserWarning, match="cpuadam_cores_perc=0.5 has no effect without"):
        ZeroConfig.model_validate({"stage": 3, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}})


def test_worker_threads_share_of_cores() -> None:
    assert worker_threads(1.0) >= worker_threads(0.5) >= worker_threads(0.01) == 1


def test_muon_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    base = torch.optim.AdamW([{"params": list(model.parameters()), "use_muon": True}])
    with pytest.raises(ValueError, match="super_offload=true with Muon"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=_zero())


def _tiny_run(check_overflow: bool, super_offload: bool, lr_change_at: int = -1) -> tuple[list[float], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    cfg = {"stage": 3, "sub_group_size": 300, "offload_optimizer": {"device": "cpu", "super_offload": super_offload}}
    base = torch.optim.AdamW(model.parameters(), lr=0.05)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg, check_overflow=check_overflow)
    losses = []
    for step in range(4):
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean()
        opt.set_step_boundary(True)
        opt.backward(loss)
        if step == lr_change_at:
            base.param_groups[0]["lr"] = 0.01
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt._super


def test_no_undo_copies_when_no_step_can_be_undone(caplog: pytest.LogCaptureFixture) -> None:
    """No inf/nan check, no clipping, loss scale 1 (bf16 without check_grad_overflow): after the first backward
    (which proves no parameter gets a second gradient) the updates are made without the undo copy; the
    numbers do not change."""
    plain, _ = _tiny_run(False, False)
    losses, sup = _tiny_run(False, True)
    assert losses == plain
    tiles = len(sup.tiles)
    assert tiles > 1 and sup.num_speculative == 4 * tiles and sup.num_undo_copies == tiles
    _, checked = _tiny_run(True, True)
    assert checked.num_undo_copies == 4 * tiles
    # an lr changed after the backward: without a copy the in-backward update (old lr) stands, as in DeepSpeed
    with caplog.at_level("WARNING", logger="ds_zero._stage3.superoffload"):
        changed, _ = _tiny_run(False, True, lr_change_at=2)
    assert "updated during the backward with the old ones and keep that update" in caplog.text
    # the step-2 update used the old lr whatever the worker's timing, so every loss equals the unchanged run's
    # (the new lr first shows in step 3's update, after the last loss)
    assert changed == plain
