"""An inf or nan gradient skips the step at every ZeRO stage, for fp16 and bf16, whatever the norm and clip settings.

For ZeRO 0/1/2/3 x fp16/bf16 x `compute_grad_norm` on/off x clipping on/off x {inf, nan}, on 2 gloo
ranks (one spawn per stage, the rest looped inside): rank 1 alone gets a bad gradient in the second
step. Every rank must skip that step (`was_step_applied()` False, `skipped_steps` counted once), leave
the module weights, the fp32 masters and the base optimizer's state bit-identical, and the third step
must give exactly the weights of a run that never saw the bad batch (the skipped step does not
advance Adam's step count; under ZeRO fp16's loss scale stays put, its first overflow only spending hysteresis,
and at stage 0 it halves, as DeepSpeed's FP16_Optimizer ignores hysteresis).

Stage 3 refuses `compute_grad_norm=False` (as DeepSpeed does), so there it runs with the norm on only.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 12)
        self.l2 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _config(stage: int, dtype: str, compute_norm: bool, clip: float) -> dict[str, Any]:
    precision: dict[str, Any] = {"enabled": True}
    if dtype == "fp16":
        precision["initial_scale_power"] = 8  # 256: the tiny model's scaled fp16 gradients stay finite
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64}
    if not compute_norm:
        zero["compute_grad_norm"] = False
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": clip,
        dtype: precision,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": zero,
    }


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]


def _gathered(engine: Any, stage: int) -> list[torch.Tensor]:
    import ds_engine as deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        return [p.detach().clone() for p in params]


def _masters(engine: Any, stage: int) -> list[torch.Tensor]:
    opt = engine.optimizer
    masters = [t.master for t in opt.tiles] if stage == 3 else opt.masters
    return [m.detach().clone() for m in masters]


def _opt_state(engine: Any) -> list[torch.Tensor]:
    state = engine.optimizer.optimizer.state
    return [v.detach().clone() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _train_step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, bad: float | None) -> None:
    x, y = batch
    out = engine(x.to(dtype))
    if bad is not None:
        # This rank's output gradient gets one bad element: l2's weight/bias gradients and everything
        # upstream turn inf/nan here only; the loss itself stays finite.
        out.register_hook(lambda g: g.clone().index_fill_(0, torch.tensor([0]), bad))
    engine.backward(nn.functional.mse_loss(out.float(), y))
    engine.step()


def _case(rank: int, stage: int, dtype_name: str, compute_norm: bool, clip: float, bad: float) -> dict[str, Any]:
    import ds_engine as deepspeed

    dtype = torch.float16 if dtype_name == "fp16" else torch.bfloat16
    data = _data(rank)
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_Net(), config=_config(stage, dtype_name, compute_norm, clip))
    _train_step(engine, data[0], dtype, None)
    assert engine.was_step_applied()
    weights, masters, state = _gathered(engine, stage), _masters(engine, stage), _opt_state(engine)
    scale_before = engine.optimizer.loss_scale
    _train_step(engine, data[1], dtype, bad if rank == 1 else None)
    where = f"stage {stage} {dtype_name} compute_grad_norm={compute_norm} clip={clip} bad={bad} rank {rank}"
    assert not engine.was_step_applied(), f"{where}: the bad step was applied"
    assert engine.skipped_steps == 1, f"{where}: skipped_steps={engine.skipped_steps}"
    assert engine.global_steps == 2, where
    for name, before, after in (
        ("weight", weights, _gathered(engine, stage)),
        ("fp32 master", masters, _masters(engine, stage)),
        ("optimizer state", state, _opt_state(engine)),
    ):
        assert len(before) == len(after), where
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            assert torch.equal(b, a), f"{where}: {name} {i} changed by the skipped step"
    # fp16 under ZeRO: the first overflow spends hysteresis; at stage 0 every overflow halves the scale, as
    # DeepSpeed's FP16_Optimizer does (powers of two: the next step's unscaled gradients are the same)
    halved = stage == 0 and dtype_name == "fp16"
    assert engine.optimizer.loss_scale == (scale_before / 2 if halved else scale_before), where
    _train_step(engine, data[2], dtype, None)
    assert engine.was_step_applied() and engine.skipped_steps == 1, where
    after = _gathered(engine, stage)
    return {"where": where, "weights": after, "scale": engine.optimizer.loss_scale}


def _reference(rank: int, stage: int, dtype_name: str, compute_norm: bool, clip: float) -> list[torch.Tensor]:
    """The same run without the bad batch: steps on batches 0 and 2."""
    import ds_engine as deepspeed

    dtype = torch.float16 if dtype_name == "fp16" else torch.bfloat16
    data = _data(rank)
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_Net(), config=_config(stage, dtype_name, compute_norm, clip))
    for batch in (data[0], data[2]):
        _train_step(engine, batch, dtype, None)
        assert engine.was_step_applied()
    return _gathered(engine, stage)


def _matrix(stage: int) -> list[tuple[str, bool, float]]:
    norms = (True,) if stage == 3 else (True, False)
    return list(itertools.product(("fp16", "bf16"), norms, (0.0, 0.05)))


def _stage(rank: int, world: int, stage: int) -> list[dict[str, Any]]:
    out = []
    for dtype_name, compute_norm, clip in _matrix(stage):
        reference = _reference(rank, stage, dtype_name, compute_norm, clip)
        for bad in (float("inf"), float("nan")):
            result = _case(rank, stage, dtype_name, compute_norm, clip, bad)
            for i, (ours, ref) in enumerate(zip(result["weights"], reference, strict=True)):
                assert torch.equal(ours, ref), (
                    f"{result['where']}: weight {i} after the skip differs from the "
                    f"run without the bad batch (max diff {(ours - ref).abs().max()})"
                )
            out.append(result)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bad_gradient_skips_the_step_everywhere(stage: int) -> None:
    results = run_ranks(2, _stage, stage=stage, timeout_s=240)
    assert len(results[0]) == len(results[1]) == 2 * len(_matrix(stage))
    for r0, r1 in zip(results[0], results[1], strict=True):
        assert r0["scale"] == r1["scale"], r0["where"]
        for a, b in zip(r0["weights"], r1["weights"], strict=True):
            assert torch.equal(a, b), f"{r0['where']}: ranks disagree on the weights"
