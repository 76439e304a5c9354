"""The initialize()-time cast under fp16/bf16: parameters follow the precision switch, buffers keep their dtype
unless `data_types.buffer_dtype` names one; `data_types.param_dtype` must agree; DeepSpeed's engine hooks
(`_mixed_precision_dtypes`, `_assert_valid_mixed_precision_config`, `_cast_module_mixed_precision`)."""

from __future__ import annotations

import re
import types

import pytest
import torch
from ds_engine_testkit import base_config, make_engine, tiny_net
from torch import nn

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedEngine
from ds_engine._step.mixed_precision import cast_module_mixed_precision, mixed_precision_dtypes
from ds_engine.config._errors import ParamDtypeConflictError


class Rotary(nn.Module):
    """A linear layer fed with rotary-style angles from an fp32 `inv_freq` buffer."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, dtype=torch.float32) / dim)))

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:, None].to(self.inv_freq.dtype) * self.inv_freq[None, :]


def _stand_in(*, fp16: bool = False, bf16: bool = False, param_dtype=None, buffer_dtype=None, module=None):
    cfg = types.SimpleNamespace(param_dtype=param_dtype, buffer_dtype=buffer_dtype)
    return types.SimpleNamespace(_config=cfg, fp16_enabled=lambda: fp16, bfloat16_enabled=lambda: bf16, module=module)


@pytest.mark.parametrize(
    ("precision", "buffer", "expected"),
    [
        ("bf16", None, (torch.bfloat16, None)),
        ("fp16", "bf16", (torch.float16, torch.bfloat16)),
        ("fp32", "torch.float16", (None, torch.float16)),
        ("bf16", "float32", (torch.bfloat16, torch.float32)),
    ],
)
def test_dtypes_resolved(precision: str, buffer: str | None, expected: tuple) -> None:
    assert mixed_precision_dtypes(precision, buffer) == expected


def test_unknown_buffer_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"data_types.buffer_dtype='int8' is not one of fp32, fp16, bf16"):
        mixed_precision_dtypes("bf16", "int8")


def test_engine_hooks_on_a_stand_in() -> None:
    assert DeepSpeedEngine._mixed_precision_dtypes(_stand_in(fp16=True)) == (torch.float16, None)
    assert DeepSpeedEngine._mixed_precision_dtypes(_stand_in(bf16=True, buffer_dtype="fp16"))[1] == torch.float16
    DeepSpeedEngine._assert_valid_mixed_precision_config(_stand_in(bf16=True, param_dtype="bfloat16"))
    DeepSpeedEngine._assert_valid_mixed_precision_config(_stand_in(param_dtype="fp32"))
    for kwargs in (
        {"param_dtype": "fp16", "bf16": True},
        {"param_dtype": "bf16"},
        {"param_dtype": "fp32", "fp16": True},
    ):
        # Both the ds convention (ValueError) and DeepSpeed's (AssertionError) catch it.
        with pytest.raises(ValueError, match="data_types.param_dtype=.* conflicts with the precision mode"):
            DeepSpeedEngine._assert_valid_mixed_precision_config(_stand_in(**kwargs))
        with pytest.raises(AssertionError):
            DeepSpeedEngine._assert_valid_mixed_precision_config(_stand_in(**kwargs))


def test_cast_hook_params_buffers_and_zero_init() -> None:
    model = Rotary()
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=model), torch.bfloat16, None, False)
    assert model.proj.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    model = Rotary()
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=model), torch.float16, torch.float16, True)
    assert model.proj.weight.dtype == torch.float32 and model.inv_freq.dtype == torch.float16
    model = Rotary()
    keep = re.compile("inv_freq")
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=model), torch.bfloat16, torch.bfloat16, False, keep)
    assert model.proj.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32


def test_kept_fp32_buffer_gives_the_fp32_angles() -> None:
    """Why buffers keep their dtype: the angles a bf16 `inv_freq` gives drift from the fp32 reference."""
    positions = torch.arange(2048, dtype=torch.float32)
    reference = Rotary().angles(positions)
    kept, cast = Rotary(), Rotary()
    cast_module_mixed_precision(kept, torch.bfloat16, None)
    cast_module_mixed_precision(cast, torch.bfloat16, torch.bfloat16)
    torch.testing.assert_close(kept.angles(positions), reference, rtol=0, atol=0)
    assert (cast.angles(positions).float() - reference).abs().max() > 1.0


def test_initialize_keeps_buffers_and_reports_config() -> None:
    model = tiny_net(0)
    engine = make_engine(model, base_config(bf16={"enabled": True}))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.buf.dtype == torch.float32
    assert engine._config.param_dtype is None and engine._config.buffer_dtype is None
    config = DeepSpeedConfig(
        {"train_batch_size": 2, "bf16": {"enabled": True}, "data_types": {"param_dtype": "bfloat16"}}, world_size=1
    )
    assert config.param_dtype == "bf16" and config.grad_accum_dtype is None


def test_param_dtype_conflict_refused_at_load() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"data_types.param_dtype='fp16' conflicts") as info:
        DeepSpeedConfig({"train_batch_size": 2, "data_types": {"param_dtype": "fp16"}}, world_size=1)
    assert isinstance(info.value, ParamDtypeConflictError)
