"""`data_types.keep_in_fp32_modules`: the buffers kept in fp32 under fp16/bf16 training, as in DeepSpeed 0.19.8.

"auto" (the default) takes a Hugging Face model's own lists (`_keep_in_fp32_modules_strict`; under fp16 also
`_keep_in_fp32_modules`), scoped to the submodule that declares them; a list gives name patterns; `[]` keeps
none. A kept buffer loaded in bf16 is brought back to fp32, and `data_types.buffer_dtype` leaves it alone;
parameters follow the training dtype whatever the lists say.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, make_engine
from torch import nn

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine._step.mixed_precision import keep_in_fp32_pattern


class Router(nn.Module):
    """An MoE router whose correction bias must stay fp32 (values closer together than bf16's spacing)."""

    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.register_buffer("e_score_correction_bias", 10.0 + torch.arange(4, dtype=torch.float32) * 1e-3)


class Net(nn.Module):
    """A router and an fp16-only list on the top module (`_keep_in_fp32_modules`)."""

    _keep_in_fp32_modules = ["scale"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = Router()
        self.out = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.register_buffer("other", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.router.gate(x) + self.router.e_score_correction_bias.to(x.dtype)) * self.scale.to(x.dtype)


def _dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: b.dtype for name, b in model.named_buffers()}


def _engine(model: nn.Module, **data_types: Any) -> None:
    make_engine(model, base_config(bf16={"enabled": True}, data_types=data_types))


def test_auto_brings_a_listed_buffer_loaded_in_bf16_back_to_fp32() -> None:
    model = Net().to(torch.bfloat16)  # as `from_pretrained(torch_dtype=torch.bfloat16)` leaves it
    _engine(model)
    assert _dtypes(model) == {
        "router.e_score_correction_bias": torch.float32,
        "scale": torch.bfloat16,  # `_keep_in_fp32_modules` counts under fp16 only
        "other": torch.bfloat16,
    }
    assert model.router.gate.weight.dtype == torch.bfloat16


def test_auto_keeps_a_listed_fp32_buffer_out_of_buffer_dtype() -> None:
    model = Net()
    before = model.router.e_score_correction_bias.clone()
    _engine(model, buffer_dtype="bf16")
    assert torch.equal(model.router.e_score_correction_bias, before)  # fp32, all four experts still apart
    assert model.other.dtype == model.scale.dtype == torch.bfloat16


def test_empty_list_keeps_nothing() -> None:
    model = Net().to(torch.bfloat16)
    _engine(model, keep_in_fp32_modules=[])
    assert set(_dtypes(model).values()) == {torch.bfloat16}


def test_patterns_and_buffer_dtype() -> None:
    model = Net()
    _engine(model, buffer_dtype="bf16", keep_in_fp32_modules=["sca*"])
    assert _dtypes(model) == {
        "router.e_score_correction_bias": torch.bfloat16,  # a list replaces the model's own
        "scale": torch.float32,
        "other": torch.bfloat16,
    }


def test_fp16_also_takes_the_fp16_list() -> None:
    pattern = keep_in_fp32_pattern(Net(), "auto", torch.float16)
    assert pattern is not None and pattern.search("scale") and pattern.search("router.e_score_correction_bias")
    assert not pattern.search("other") and not pattern.search("e_score_correction_bias")  # scoped to its module
    assert keep_in_fp32_pattern(Net(), "auto", torch.float32) is None  # fp32 training keeps everything fp32


@pytest.mark.parametrize("value", [None, "all", [3]])
def test_bad_values_name_the_key(value: Any) -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"data_types.keep_in_fp32_modules"):
        DeepSpeedConfig({"train_batch_size": 2, "data_types": {"keep_in_fp32_modules": value}}, world_size=1)
