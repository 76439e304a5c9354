"""fp16 and bf16 at stage 0: master weights, dynamic loss scaling with injected inf/nan, convergence, dtypes."""

from __future__ import annotations

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_ops.precision import LossScaleAtMinimumError


def _fp16_config(**fp16: object) -> dict:
    return base_config(
        fp16={"enabled": True, **fp16},
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 100, "warmup_type": "linear", "warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2},
        },
    )


def test_fp16_overflow_skips_steps_lowers_the_scale_and_honours_the_minimum() -> None:
    model = tiny_net(0)
    engine = make_engine(
        model, _fp16_config(initial_scale_power=8, loss_scale_window=3, hysteresis=2, min_loss_scale=100)
    )
    assert model.l1.weight.dtype == torch.float16 and model.buf.dtype == torch.float32  # params only
    # Step i injects: inf, nan, or nothing into the loss (and so into every gradient).
    inject = {1: float("inf"), 2: float("nan"), 7: float("inf")}
    scales, applied, lrs = [], [], []
    data = batches(11, 4)
    for i, (x, y) in enumerate(data[:10]):
        before = flat_params(model)
        loss = loss_fn(engine(x.half()), y)
        if i in inject:
            loss = loss * inject[i]
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scale())
        applied.append(engine.was_step_applied())
        lrs.append(engine.get_lr()[0])
        changed = not torch.equal(flat_params(model), before)
        assert changed == applied[-1], f"step {i}: params changed={changed} but applied={applied[-1]}"
        assert (
            torch.isfinite(flat_params(model)).all()
            and torch.isfinite(torch.cat([m.reshape(-1) for m in engine.optimizer.masters])).all()
        )
    # At stage 0 every overflow halves the scale, as DeepSpeed's FP16_Optimizer does: `hysteresis` (2 here)
    # applies to ZeRO's scaler only. The floor clamps 128 / 2 to 100; window 3: the update after three clean
    # steps doubles it.
    assert scales == [256, 128, 100, 100, 100, 100, 200, 100, 100, 100]
    assert applied == [True, False, False, True, True, True, True, False, True, True]
    assert (engine.global_steps, engine.skipped_steps, engine.micro_steps) == (10, 3, 10)
    # The scheduler advances only on applied steps: 7 of them, lr = min + (max - min) * it / 100.
    assert engine.lr_scheduler.last_batch_iteration == 6
    assert lrs[-1] == pytest.approx(1e-3 + 9e-3 * 6 / 100)
    # Clean steps at the minimum keep training; an overflow at the minimum stops the run loudly.
    x, y = data[10]
    engine.backward(loss_fn(engine(x.half()), y))
    engine.step()
    assert engine.was_step_applied() and engine.loss_scale() == 100
    with pytest.raises(LossScaleAtMinimumError, match="already at its minimum"):
        engine.backward(loss_fn(engine(x.half()), y) * float("inf"))
        engine.step()


def test_fp16_static_loss_scale_is_applied_and_removed() -> None:
    ref = tiny_net(0)
    ref_engine = make_engine(ref, base_config(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    model = tiny_net(0)
    engine = make_engine(
        model, base_config(fp16={"enabled": True, "loss_scale": 128}, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    )
    assert not engine.dynamic_loss_scale() and engine.loss_scale() == 128
    for x, y in batches(4, 4):
        ref_engine.backward(loss_fn(ref_engine(x.half().float()), y))
        ref_engine.step()
        engine.backward(loss_fn(engine(x.half()), y))
        engine.step()
    # fp16 forward/backward vs fp32: the scale must have been divided out exactly once.
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=5e-3)


def _regression(precision: dict, steps: int = 60, **extra: object) -> tuple[list[float], torch.nn.Module, object]:
    torch.manual_seed(0)
    teacher = torch.randn(8, 4)
    model = tiny_net(0)
    engine = make_engine(model, base_config(optimizer={"type": "Adam", "params": {"lr": 1e-2}}, **precision, **extra))
    g = torch.Generator().manual_seed(3)
    losses = []
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = loss_fn(engine(x.to(dtype)), x @ teacher)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, model, engine


def test_bf16_converges_and_tracks_fp32() -> None:
    fp32, _, _ = _regression({})
    bf16, model, engine = _regression({"bf16": {"enabled": True}})
    assert model.l1.weight.dtype == torch.bfloat16 and model.buf.dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in engine.optimizer.masters)
    assert engine.optimizer.accum.flat.dtype == torch.bfloat16  # accumulation in the model's dtype by default
    first, last = sum(bf16[:5]) / 5, sum(bf16[-5:]) / 5
    assert last < first / 4, (first, last)
    assert abs(last - sum(fp32[-5:]) / 5) < 0.1 * first
    assert isinstance(engine.get_global_grad_norm(), float)


@pytest.mark.parametrize(
    ("precision", "accum", "buffer_dtype"),
    [
        ({"bf16": {"enabled": True}}, "bf16", torch.bfloat16),
        ({"fp16": {"enabled": True}}, "fp32", torch.float32),
        ({"fp16": {"enabled": True}}, None, torch.float16),
    ],
)
def test_grad_accum_dtype_choices_train(precision, accum, buffer_dtype) -> None:
    losses, _, engine = _regression(
        precision, steps=30, gradient_accumulation_steps=2, data_types={"grad_accum_dtype": accum}
    )
    assert engine.optimizer.accum.flat.dtype == buffer_dtype
    assert sum(losses[-5:]) < sum(losses[:5])


def test_bf16_overflow_check_skips_and_can_be_disabled() -> None:
    for check, expect_applied in ((True, False), (False, True)):
        model = tiny_net(0)
        engine = make_engine(model, base_config(bf16={"enabled": True, "check_grad_overflow": check}))
        x, y = batches(1, 4)[0]
        engine.backward(loss_fn(engine(x.bfloat16()), y) * float("inf"))
        engine.step()
        assert engine.was_step_applied() is expect_applied
        assert engine.skipped_steps == (0 if expect_applied else 1)


def test_fp16_auto_cast_casts_float_inputs() -> None:
    engine = make_engine(tiny_net(0), base_config(fp16={"enabled": True, "auto_cast": True}))
    out = engine(torch.randn(2, 8))
    assert out.dtype == torch.float16
    plain = make_engine(tiny_net(0), base_config(fp16={"enabled": True}))
    with pytest.raises(RuntimeError):
        plain(torch.randn(2, 8))


def test_buffer_dtype_casts_buffers() -> None:
    model = tiny_net(0)
    make_engine(model, base_config(bf16={"enabled": True}, data_types={"buffer_dtype": "bf16"}))
    assert model.buf.dtype == torch.bfloat16
