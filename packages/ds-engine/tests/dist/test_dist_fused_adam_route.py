"""The config's Adam/AdamW on a CPU host without offload is ds_ops.FusedAdam (DeepSpeed's route) at every ZeRO
stage, on 2 gloo ranks, and it matches plain torch: a model trained with torch.optim.Adam/AdamW (foreach=False)
on the mean of both ranks' losses. Tolerance rtol=1e-5, atol=1e-6 on the weights after 6 steps (fp32; the
kernel does torch's arithmetic without FMA, the gradient average sums in another order).

Resume: a ZeRO checkpoint saved by the route ds took before (DeepSpeedCPUAdam: per-parameter `step`, fp32
moments) loads into the FusedAdam route and goes on as the uninterrupted torch run; a FusedAdam save goes
through `ds_to_universal` and back with its step.

Needs ds-zero (the `ds-engine[all]` session); skipped where it is not installed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")

LR, WEIGHT_DECAY, STEPS, WORLD = 1e-2, 0.01, 6, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 24)
        self.b = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 10, generator=g), torch.randn(4, 5, generator=g)


def _reference(adam_w_mode: bool, steps: int = STEPS) -> torch.Tensor:
    torch.manual_seed(0)
    model = Net()
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optimizer = cls(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    for step in range(steps):
        loss = sum(model(*_data(rank, step)) for rank in range(WORLD)) / WORLD
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _config(stage: int, adam: str | None, **zero: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    if adam is not None:  # "Adam" is AdamW unless adam_w_mode is false (DeepSpeed's rule): here it is Adam
        params = {"lr": LR, "weight_decay": WEIGHT_DECAY, **({"adam_w_mode": False} if adam == "Adam" else {})}
        config["optimizer"] = {"type": adam, "params": params}
    return config


def _engine(stage: int, config: dict[str, Any], optimizer: Any = None) -> Any:
    import ds_engine

    torch.manual_seed(0)
    with ds_engine.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = Net()
    if optimizer is not None:
        optimizer = optimizer(model)
    engine, *_ = ds_engine.initialize(model=model, config=config, optimizer=optimizer)
    return engine


def _run(engine: Any, rank: int, first: int, count: int) -> None:
    for step in range(first, first + count):
        engine.backward(engine(*_data(rank, step)))
        engine.step()


def _weights(engine: Any, stage: int) -> torch.Tensor:
    import ds_engine

    params = list(engine.module.parameters())
    with ds_engine.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        return torch.cat([p.detach().reshape(-1).clone() for p in params])


def _steps_of(engine: Any) -> list[int]:
    base = engine.basic_optimizer
    return sorted({int(s["step"]) for s in base.state.values() if "step" in s})


def _train(rank: int, world: int, stage: int, adam: str, zero: dict[str, Any]) -> dict[str, Any]:
    import ds_ops

    engine = _engine(stage, _config(stage, adam, **zero))
    assert type(engine.basic_optimizer) is ds_ops.FusedAdam
    _run(engine, rank, 0, STEPS)
    moments = {s["exp_avg"].dtype for s in engine.basic_optimizer.state.values() if "exp_avg" in s}
    return {"weights": _weights(engine, stage), "steps": _steps_of(engine), "moments": moments}


@pytest.mark.parametrize(
    ("stage", "adam", "zero"),
    [
        (0, "AdamW", {}),
        (1, "Adam", {}),
        (2, "AdamW", {}),
        (3, "Adam", {}),
        (3, "AdamW", {"sub_group_size": 100}),  # stepped tile by tile: each tensor must count once
    ],
    ids=["stage0", "stage1_adam", "stage2", "stage3_adam", "stage3_tiles"],
)
def test_fused_adam_route_matches_torch(stage: int, adam: str, zero: dict[str, Any]) -> None:
    expected = _reference(adam_w_mode=adam == "AdamW")
    for result in run_ranks(WORLD, _train, stage=stage, adam=adam, zero=zero, timeout_s=180):
        torch.testing.assert_close(result["weights"], expected, **TOL)
        assert result["steps"] == [STEPS] and result["moments"] == {torch.float32}


def _bf16_moments(rank: int, world: int, stage: int) -> set[torch.dtype]:
    import ds_ops

    config = {**_config(stage, "AdamW"), "bf16": {"enabled": True}}
    engine = _engine(stage, config)
    assert type(engine.basic_optimizer) is ds_ops.FusedAdam
    for step in range(2):
        x, y = _data(rank, step)
        engine.backward(engine(x.bfloat16(), y.bfloat16()).float())
        engine.step()
    return {s["exp_avg"].dtype for s in engine.basic_optimizer.state.values() if "exp_avg" in s}


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_runs_keep_fp32_moments(stage: int) -> None:
    """The basic optimizer steps fp32 masters (ZeRO's, or the bf16 wrapper's at stage 0): fp32 moments."""
    assert run_ranks(WORLD, _bf16_moments, stage=stage, timeout_s=180) == [{torch.float32}] * WORLD


def _old_route_then_new(rank: int, world: int, stage: int, save_dir: str) -> dict[str, Any]:
    import ds_ops

    def cpu_adam(model: nn.Module) -> torch.optim.Optimizer:  # what the config built here before
        return ds_ops.DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)

    old = _engine(stage, _config(stage, None), optimizer=cpu_adam)
    assert type(old.basic_optimizer) is ds_ops.DeepSpeedCPUAdam
    _run(old, rank, 0, STEPS // 2)
    old.save_checkpoint(save_dir)
    new = _engine(stage, _config(stage, "AdamW"))
    assert type(new.basic_optimizer) is ds_ops.FusedAdam
    path, _ = new.load_checkpoint(save_dir)
    assert path is not None and new.global_steps == STEPS // 2
    _run(new, rank, STEPS // 2, STEPS - STEPS // 2)
    return {"weights": _weights(new, stage), "steps": _steps_of(new)}


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_of_the_cpu_adam_route_resumes_under_fused_adam(stage: int, tmp_path) -> None:
    expected = _reference(adam_w_mode=True)
    for result in run_ranks(WORLD, _old_route_then_new, stage=stage, save_dir=str(tmp_path), timeout_s=240):
        torch.testing.assert_close(result["weights"], expected, **TOL)
        assert result["steps"] == [STEPS]


def _save(rank: int, world: int, save_dir: str) -> None:
    engine = _engine(2, _config(2, "AdamW"))
    _run(engine, rank, 0, STEPS // 2)
    engine.save_checkpoint(save_dir, tag="half")


def _load_universal(rank: int, world: int, load_dir: str) -> dict[str, Any]:
    config = {**_config(1, "AdamW"), "checkpoint": {"load_universal": True}}
    engine = _engine(1, config)
    path, _ = engine.load_checkpoint(load_dir, tag="half_universal")
    assert path is not None
    _run(engine, rank, STEPS // 2, STEPS - STEPS // 2)
    return {"weights": _weights(engine, 1), "steps": _steps_of(engine)}


def test_fused_adam_save_goes_through_universal_with_its_step(tmp_path) -> None:
    import ds_zero

    run_ranks(WORLD, _save, save_dir=str(tmp_path), timeout_s=180)
    ds_zero.convert_to_universal(tmp_path / "half", tmp_path / "half_universal", inject_missing_state=True)
    assert sorted(p.name for p in (tmp_path / "half_universal" / "zero" / "a.weight").iterdir()) == [
        "exp_avg.pt",
        "exp_avg_sq.pt",
        "fp32.pt",
        "step.pt",
    ]
    expected = _reference(adam_w_mode=True)
    for result in run_ranks(WORLD, _load_universal, load_dir=str(tmp_path), timeout_s=180):
        torch.testing.assert_close(result["weights"], expected, **TOL)
        assert result["steps"] == [STEPS]
