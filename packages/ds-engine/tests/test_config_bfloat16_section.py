"""The legacy section name `"bfloat16"` means `"bf16"` for every reader of the config, as in DeepSpeed 0.19.8
(whose `get_bfloat16_config` falls back to it): `zero.Init`'s parameter dtype, the engine (plain, ZeRO-3
on a model built under that `Init`, and the hybrid engine). Each run is compared with the same run written
with `"bf16"`: the same dtypes and bit-identical weights after two steps."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

import ds_engine

ds_zero = pytest.importorskip("ds_zero", reason="zero.Init is ds-zero's: pip install 'ds-engine[zero]'")

SECTION_NAMES = ("bf16", "bfloat16")


def _config(name: str, **overrides: Any) -> dict[str, Any]:
    return base_config(**{name: {"enabled": True}}, **overrides)


def _train_two_steps(engine: Any) -> torch.Tensor:
    for x, y in batches(2, 4):
        engine.backward(loss_fn(engine(x.to(torch.bfloat16)), y))
        engine.step()
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def test_zero_init_gives_bf16_parameters_with_either_name() -> None:
    for name in SECTION_NAMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation notice for "bfloat16"
            with ds_zero.Init(config_dict_or_path={name: {"enabled": True}, "zero_optimization": {"stage": 3}}):
                model = tiny_net(0)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, name


@pytest.mark.parametrize("zero", [None, {"stage": 2}])
def test_engine_trains_in_bf16_with_either_name(zero: dict | None) -> None:
    extra = {} if zero is None else {"zero_optimization": zero}
    results = []
    for name in SECTION_NAMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = make_engine(tiny_net(0), _config(name, **extra))
        assert engine.bfloat16_enabled() and engine.module.l1.weight.dtype == torch.bfloat16, name
        results.append(_train_two_steps(engine))
    assert torch.equal(results[0], results[1])


def test_zero3_model_built_under_init_trains_with_either_name() -> None:
    """The LoRA + ZeRO-3 + bf16 shape of the problem: `Init` reads the config the engine reads; with the legacy
    name it used to build fp32 parameters, and the first bf16 forward then failed on a dtype mismatch."""
    results = []
    for name in SECTION_NAMES:
        cfg = _config(name, zero_optimization={"stage": 3})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ds_zero.Init(config_dict_or_path=cfg):
                model = tiny_net(0)
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, name
            engine = make_engine(model, cfg)
        results.append(_train_two_steps(engine))
    assert torch.equal(results[0], results[1])


def test_hybrid_engine_reads_the_legacy_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = make_engine(tiny_net(0), _config("bfloat16", hybrid_engine={"enabled": True}))
    assert isinstance(engine, ds_engine.DeepSpeedHybridEngine)
    assert engine.bfloat16_enabled() and engine.module.l1.weight.dtype == torch.bfloat16
