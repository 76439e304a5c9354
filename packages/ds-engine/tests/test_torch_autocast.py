"""The `torch_autocast` section: the engine's forward under `torch.autocast` matches plain PyTorch autocast,
lower-precision-safe parameters carry `comm_dtype`, fp16 autocast gets a dynamic loss scale, an outer
autocast follows the section, and bad settings name their key."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from ds_engine_testkit import NormNet, base_config, batches, loss_fn, make_engine

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.runtime import torch_autocast as ta

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _net(seed: int = 0) -> NormNet:
    torch.manual_seed(seed)
    return NormNet()


def _autocast_config(dtype: str | None, stage: int = 0, **section: Any) -> dict[str, Any]:
    tac: dict[str, Any] = {"enabled": True, **section}
    if dtype is not None:
        tac["dtype"] = dtype
    return base_config(torch_autocast=tac, zero_optimization={"stage": stage})


def _stages() -> list[int]:
    try:
        import ds_zero  # noqa: F401
    except ImportError:
        return [0]
    return [0, 1, 2]


@pytest.mark.parametrize("stage", _stages())
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_training_matches_plain_torch_autocast(dtype: str, stage: int) -> None:
    model = _net()
    reference = copy.deepcopy(model)
    engine = make_engine(model, _autocast_config(dtype, stage))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batches(4, 4):
        out = engine(x)
        assert out.dtype == _DTYPES[dtype]  # the last Linear ran in the autocast dtype
        engine.backward(loss_fn(out, y))
        engine.step()
        with torch.autocast("cpu", dtype=_DTYPES[dtype]):
            ref_out = reference(x)
        opt.zero_grad()
        loss_fn(ref_out, y).backward()
        opt.step()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for ours, ref in zip(engine.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    # Autocast really changed the numbers: an fp32 forward gives another loss.
    x, y = batches(1, 4, seed=7)[0]
    with torch.no_grad():
        assert loss_fn(engine(x), y).item() != loss_fn(engine.module(x), y).item()


def test_comm_dtype_tags_only_safe_modules() -> None:
    model = _net()
    engine = make_engine(model, _autocast_config("bf16"))
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    for name, p in model.named_parameters():
        safe = not name.startswith("norm.")
        assert ta.has_comm_dtype(p) is safe, name
        assert ta.get_comm_dtype(p) == (torch.bfloat16 if safe else torch.float32), name
    assert ta.is_autocast_initialized() and ta.get_autocast_dtype() == torch.bfloat16
    assert ta.get_all_comm_dtypes(model.parameters()) == {torch.bfloat16, torch.float32}
    assert ta.sort_dtypes([torch.float32, torch.bfloat16]) == [torch.bfloat16, torch.float32]


def test_named_safe_modules_replace_the_defaults() -> None:
    model = _net()
    make_engine(model, _autocast_config("bf16", lower_precision_safe_modules=["torch.nn.LayerNorm"]))
    assert [n for n, p in model.named_parameters() if ta.has_comm_dtype(p)] == ["norm.weight", "norm.bias"]
    assert "torch.nn.modules.linear.Linear" in ta.get_default_autocast_lower_precision_modules()


def test_default_dtype_is_the_devices() -> None:
    engine = make_engine(_net(), _autocast_config(None))
    assert engine.torch_autocast_dtype() == torch.get_autocast_dtype("cpu")
    assert "torch.autocast(bfloat16)" in "\n".join(engine._plan.lines())


def test_fp16_autocast_scales_the_loss_and_skips_overflow() -> None:
    model = _net()
    engine = make_engine(model, _autocast_config("fp16"))
    assert engine.loss_scale() == 2.0**16
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1, 4)[0]
    for _ in range(2):  # the first overflow spends the fp16 section's hysteresis (2), the second halves
        engine.backward(loss_fn(engine(x), y) * float("inf"))
        engine.step()
        assert not engine.was_step_applied()
    assert engine.skipped_steps == 2 and engine.loss_scale() == 2.0**15
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_autocast_takes_a_static_scale_from_the_fp16_section() -> None:
    config = _autocast_config("fp16")
    config["fp16"] = {"enabled": False, "loss_scale": 128}
    engine = make_engine(_net(), config)
    assert engine.loss_scale() == 128.0
    assert make_engine(_net(), _autocast_config("bf16")).loss_scale() == 1.0  # bf16 needs no scaling


def test_outer_autocast_follows_the_section() -> None:
    x = torch.randn(2, 8)
    plain = make_engine(_net(), base_config())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(x).dtype == torch.float32  # section disabled: autocast is off inside the engine
        assert plain.module(x).dtype == torch.bfloat16
    cast = make_engine(_net(), _autocast_config("fp16"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cast(x).dtype == torch.float16  # the section's dtype wins
        with ta.autocast_if_enabled(cast):
            assert cast.module(x).dtype == torch.float16


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": True, "dtype": "fp32"}, r"torch_autocast.dtype: .*autocast to fp32 does nothing"),
        ({"enabled": True, "dtype": "int8"}, r"torch_autocast.dtype"),
        ({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}, r"lower_precision_safe_modules"),
    ],
)
def test_bad_sections_refused_at_load(section: dict[str, Any], message: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message):
        DeepSpeedConfig({"train_batch_size": 2, "torch_autocast": section}, world_size=1)


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["Linear"], r"lower_precision_safe_modules\[0\]: 'Linear' is not a qualified class name"),
        (["torch.nn.Linear", "torch.nn.NoSuchLayer"], r"lower_precision_safe_modules\[1\]: cannot import"),
        (["torch.float32"], r"lower_precision_safe_modules\[0\]: 'torch.float32' is not a torch.nn.Module subclass"),
    ],
)
def test_bad_safe_module_names_refused_before_any_work(names: list[str], message: str) -> None:
    model = _net()
    with pytest.raises(DeepSpeedConfigError, match=message):
        make_engine(model, _autocast_config("bf16", lower_precision_safe_modules=names))
    assert not any(ta.has_comm_dtype(p) for p in model.parameters())
