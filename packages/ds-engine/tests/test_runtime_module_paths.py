"""`deepspeed.runtime.{config, fp16, bf16_optimizer, zero.config}`: DeepSpeed's class names for ds's objects."""

from __future__ import annotations

import importlib

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

import ds_engine
from ds_ops.precision import DynamicLossScaler


def test_runtime_config_reads_a_config_without_an_engine() -> None:
    from ds_engine.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    config = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2})
    assert config.train_batch_size == 8 and config.train_micro_batch_size_per_gpu == 4
    with pytest.raises(DeepSpeedConfigError, match="train_batch_sizee"):
        DeepSpeedConfig({"train_batch_sizee": 8})


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("ds_engine.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
        ("ds_engine.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
        ("ds_engine.runtime.bf16_optimizer", "BF16_Optimizer"),
    ],
)
def test_sixteen_bit_wrapper_names_match_the_engines_optimizer(module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    engine = make_engine(tiny_net(0), base_config(bf16={"enabled": True}))
    assert isinstance(engine.optimizer, cls) and cls is ds_engine.MixedPrecisionOptimizer
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x.to(torch.bfloat16)), y))
    engine.step()
    fp32 = make_engine(tiny_net(0), base_config())
    assert not isinstance(fp32.optimizer, cls)


def test_loss_scalers_are_ds_ops() -> None:
    from ds_engine.runtime.fp16 import loss_scaler

    assert loss_scaler.DynamicLossScaler is DynamicLossScaler


def test_zero_config_is_ds_zero_config() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    from ds_engine.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig is ds_zero.ZeroConfig
    assert DeepSpeedZeroConfig(stage=2).stage == 2


def test_runtime_exposes_the_new_submodules_lazily() -> None:
    runtime = importlib.import_module("ds_engine.runtime")
    for name in ("config", "fp16", "bf16_optimizer"):
        assert getattr(runtime, name) is importlib.import_module(f"ds_engine.runtime.{name}")


def test_swap_tensor_sizes_are_deepspeeds() -> None:
    from ds_engine.runtime.swap_tensor import AIO_ALIGNED_BYTES, MIN_AIO_BYTES, MIN_SWAPPABLE_BYTES

    assert (MIN_AIO_BYTES, AIO_ALIGNED_BYTES, MIN_SWAPPABLE_BYTES) == (1 << 20, 1 << 10, 1 << 20)
    assert MIN_SWAPPABLE_BYTES % AIO_ALIGNED_BYTES == 0
