"""ZeRO-Inference weight quantization: `GroupQuantizer` round trips, the storage layout, the config section.

Round trip: every value comes back within half its group's step `(max - min) / (2**bits - 1)` (plus the
rounding of the stored step and minimum to the dtype), and equals exactly what a plain PyTorch
quantizer written here gives (min/max per group along `group_dim`, nearest code). 8 and 4 bits,
symmetric and not, along dimension 0 and 1, float32 and bfloat16. The partitioned path (Init, gathers,
loading, 2 ranks) is in dist/test_dist_quantized_init.py.
"""

from __future__ import annotations

import pytest
import torch

import ds_comm
from ds_zero._construct.quantized_init import (
    QuantizedLayout,
    quantize_module_weights,
    quantize_param,
    refuse_trainable,
)
from ds_zero._quantizer import GroupQuantizer
from ds_zero.config import WeightQuantizationConfig


def _reference(
    x: torch.Tensor, bits: int, group: int, dim: int, symmetric: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values, per-value step) by plain PyTorch, groups of `group` along `dim`."""
    moved = x.float().movedim(dim, -1)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // group, group)
    low, high = grouped.min(-1, keepdim=True).values, grouped.max(-1, keepdim=True).values
    if symmetric:
        high = torch.maximum(low.abs(), high.abs())
        low = -high
    step = ((high - low) / (2**bits - 1)).to(dtype).float()
    low = low.to(dtype).float()
    codes = torch.round(((grouped - low) / torch.where(step > 0, step, 1.0)).clamp(0, 2**bits - 1))
    values = (codes * step + low).reshape(moved.shape).movedim(-1, dim)
    return values.to(dtype), step.expand_as(grouped).reshape(moved.shape).movedim(-1, dim)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("dim", "group"), [(1, 4), (0, 3), (1, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_a_step_and_matches_the_reference(
    bits: int, symmetric: bool, dim: int, group: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(bits * 100 + dim * 10 + group)
    x = (torch.randn(6, 12, generator=g) * torch.linspace(0.01, 3.0, 12)).to(dtype)
    x[2, :] = 0.5  # a constant row: groups along dim 1 have zero range
    quantizer = GroupQuantizer(bits, group, dim, symmetric)
    codes, step, low = quantizer.quantize(x)
    assert codes.dtype == torch.uint8 and step.dtype == low.dtype == dtype
    assert codes.shape == ((6, 6) if bits == 4 else (6, 12))
    back = quantizer.dequantize(codes, step, low, dtype)
    want, per_value_step = _reference(x, bits, group, dim, symmetric, dtype)
    assert back.dtype == dtype and back.shape == x.shape
    torch.testing.assert_close(back, want, rtol=0, atol=0)
    # half a step, plus the dtype's rounding of the stored minimum and of the result
    eps = torch.finfo(dtype).eps
    bound = per_value_step / 2 + 2 * eps * x.float().abs().amax()
    assert ((back.float() - x.float()).abs() <= bound).all()
    if dim == 1 and not symmetric:
        assert torch.equal(back[2].float(), torch.full((12,), 0.5)), "a constant group comes back exactly"


def test_bad_settings_and_shapes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="only 4 and 8 bits"):
        GroupQuantizer(3, 4, 1)
    with pytest.raises(ValueError, match="group_size must be positive"):
        GroupQuantizer(8, 0, 1)
    with pytest.raises(ValueError, match="multiple of group_size"):
        GroupQuantizer(8, 5, 1).quantize(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="must exist"):
        GroupQuantizer(8, 2, 2).quantize(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="odd"):
        GroupQuantizer(4, 3, 0).quantize(torch.zeros(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_one_storage_tensor_in_the_param_dtype_with_deepspeeds_attributes(dtype: torch.dtype, bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    weight = torch.nn.Parameter(torch.randn(10, 6, generator=g).to(dtype))
    original = weight.detach().clone()
    quantizer = GroupQuantizer(bits, 3, 1)
    quantize_param(weight, quantizer)
    assert weight.weight_quantized is True and weight.requires_grad  # as in DeepSpeed
    assert weight.dim() == 1 and weight.dtype == dtype
    groups = 10 * 2
    code_bytes = 60 // (8 // bits)
    assert weight.numel() == -(-code_bytes // dtype.itemsize) + 2 * groups
    layout = weight.dequantizer
    assert isinstance(layout, QuantizedLayout) and weight.quantizer is layout
    codes, step, low = weight.deconcat(weight)
    assert step.numel() == low.numel() == groups and codes.dtype == dtype
    want = quantizer.dequantize(*quantizer.quantize(original), dtype)
    assert torch.equal(layout.dequantize(codes.view(torch.uint8), step, low), want)  # DeepSpeed's call
    assert torch.equal(layout.values(weight), want)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_param(weight, quantizer)
    with pytest.raises(ValueError, match="cannot take"):
        layout.pack(torch.zeros(6, 10))


def test_a_trainable_quantized_weight_is_refused_and_a_frozen_one_is_not() -> None:
    weight = torch.nn.Parameter(torch.randn(4, 4))
    quantize_param(weight, GroupQuantizer(8, 2, 1))
    plain = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"weight_quantization\.quantized_initialization"):
        refuse_trainable([plain, weight])
    weight.requires_grad_(False)
    refuse_trainable([plain, weight])


def test_the_section_refuses_post_init_quant_and_needs_the_quantizers_keys() -> None:
    cfg = ds_comm.validate_section(
        WeightQuantizationConfig,
        {"quantized_initialization": {"num_bits": 4, "group_size": 64, "group_dim": 1, "symmetric": False}},
        path="weight_quantization",
    )
    assert cfg.quantized_initialization is not None
    assert cfg.quantized_initialization.quantizer() == GroupQuantizer(4, 64, 1, False)
    off = ds_comm.validate_section(WeightQuantizationConfig, {"quantized_initialization": {}, "post_init_quant": {}})
    assert off.quantized_initialization is None
    for bad, message in (
        ({"post_init_quant": {"fc": {"num_bits": 8}}}, "weight_quantization.post_init_quant: .*post-init weight"),
        ({"quantized_initialization": {"num_bits": 8, "group_size": 2}}, "quantized_initialization.group_dim"),
        ({"quantized_initialization": {"num_bits": 2, "group_size": 2, "group_dim": 1}}, "num_bits"),
        ({"enabled": False, "quantized_initialization": {"num_bits": 8, "group_size": 2, "group_dim": 0}}, "enabled"),
    ):
        with pytest.raises(ds_comm.ConfigError, match=message):
            ds_comm.validate_section(WeightQuantizationConfig, bad, path="weight_quantization")


def test_module_weights_of_the_listed_types_only_are_quantized_and_bad_shapes_name_the_key() -> None:
    class Sub(torch.nn.Linear):  # a subclass is not quantized (DeepSpeed matches exact types)
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), Sub(6, 4), torch.nn.Embedding(5, 4))
    count = quantize_module_weights(model, GroupQuantizer(8, 2, 1), skip=lambda p: False, dtype=torch.bfloat16)
    assert count == 2
    assert model[0].weight.weight_quantized and model[3].weight.weight_quantized
    assert model[0].weight.dtype == torch.bfloat16 and model[0].bias.dtype == torch.float32  # weights only
    assert not hasattr(model[1].weight, "weight_quantized") and not hasattr(model[2].weight, "weight_quantized")
    with pytest.raises(ValueError, match=r"weight_quantization\.quantized_initialization: Linear\.weight: .*group"):
        quantize_module_weights(torch.nn.Linear(5, 2), GroupQuantizer(8, 2, 1), skip=lambda p: False, dtype=None)
