"""`deepspeed.linear` on one process: the layers' numerics against plain PyTorch, the quantizer's error bound,
the factory's choices, `init_lora` / `Init`, state-dict loading and the errors for bad configs."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_engine
from ds_engine._linear.fp_quantizer import FPQuantizer, fp_format, max_relative_error
from ds_engine.linear import (
    Init,
    LoRAConfig,
    LoRAOptimizedLinear,
    OptimizedLinear,
    QuantizationConfig,
    QuantizedLinear,
    QuantizedParameter,
    init_lora,
)

FORMATS = [(8, 3), (8, 2), (12, 4), (6, 2), (4, 1)]


def test_deepspeed_paths_are_the_ds_modules() -> None:
    import ds_engine._linear.optimized_linear as own
    import ds_engine.linear.optimized_linear as path

    assert path is own
    assert ds_engine.linear.OptimizedLinear is own.OptimizedLinear


def test_no_config_gives_a_plain_linear_with_its_arguments() -> None:
    layer = OptimizedLinear(8, 4, bias=True, dtype=torch.float32)
    assert type(layer) is nn.Linear and layer.bias is not None and layer.weight.dtype == torch.float32
    assert OptimizedLinear(8, 4).weight.dtype == torch.bfloat16  # DeepSpeed's default dtype


def test_lora_forward_and_backward_match_plain_pytorch() -> None:
    torch.manual_seed(0)
    layer = OptimizedLinear(24, 12, lora_config=LoRAConfig(lora_r=4, lora_alpha=6), dtype=torch.float32)
    assert isinstance(layer, LoRAOptimizedLinear)
    with torch.no_grad():  # B starts at zero (the layer computes x W^T); give it values to test the sum
        layer.lora_weight_2.weight.normal_()
    w, a, b = (t.detach().clone() for t in (layer.weight, layer.lora_weight_1.weight, layer.lora_weight_2.weight))
    a.requires_grad_(True)
    b.requires_grad_(True)
    x = torch.randn(5, 3, 24)
    expected = x @ w.T + (6 / 4) * (x @ a.T @ b.T)
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(layer.lora_weight_1.weight.grad, a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_weight_2.weight.grad, b.grad, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and not layer.weight.requires_grad
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == [
        "lora_weight_1.weight",
        "lora_weight_2.weight",
    ]


def test_fresh_lora_layer_computes_the_base_linear() -> None:
    layer = OptimizedLinear(16, 8, lora_config=LoRAConfig(lora_r=2), dtype=torch.float32)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0, atol=0)


@pytest.mark.parametrize(("q_bits", "mantissa"), FORMATS)
def test_quantizer_error_is_within_half_an_ulp_per_group(q_bits: int, mantissa: int) -> None:
    """|dequant - w| <= 2^-(M+1) |w| for normals, plus half the smallest subnormal step, both times the group scale."""
    group = 64
    quantizer = FPQuantizer(QuantizationConfig(q_bits=q_bits, mantissa_bits=mantissa, group_size=group))
    w = torch.randn(10, 50) * torch.logspace(-3, 1, 50)  # spans several binades; 500 values: a padded last group
    packed = quantizer.quantize(w, q_bits, mantissa)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(500 / group), group * q_bits // 8 + 4)
    back = quantizer.dequantize(packed, q_bits=q_bits, q_mantisa_bits=mantissa)
    assert back.shape == w.shape and back.dtype == w.dtype
    exp_bits, man_bits = fp_format(q_bits, mantissa)
    emin = 2 - 2 ** (exp_bits - 1)
    flat = torch.nn.functional.pad(w.reshape(-1), (0, packed.shape[0] * group - 500)).view(-1, group)
    scale = (flat.abs().amax(dim=1, keepdim=True) / quantizer._format(q_bits, mantissa)[3]).expand(-1, group)
    bound = max_relative_error(q_bits, mantissa) * w.abs() + 2.0 ** (emin - man_bits - 1) * scale.reshape(-1)[
        :500
    ].view(10, 50)
    err = (back - w).abs()
    assert (err <= bound * (1 + 1e-6)).all(), float((err - bound).max())
    assert err.max() > 0  # it does round


def test_quantizer_keeps_each_groups_largest_value_and_zero() -> None:
    quantizer = FPQuantizer(QuantizationConfig(group_size=8))
    x = torch.tensor([0.0, -3.0, 0.5, 1.0, 2.0, -0.25, 0.125, 1.5])
    back = quantizer.dequantize(quantizer.quantize(x))
    assert back[0] == 0 and back[1] == -3.0  # the group's max maps exactly onto the format's range


def test_quantized_linear_forward_uses_the_dequantized_weight() -> None:
    torch.manual_seed(0)
    layer = OptimizedLinear(64, 16, bias=True, quantization_config=QuantizationConfig(group_size=128))
    assert isinstance(layer, QuantizedLinear) and isinstance(layer.weight, QuantizedParameter)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == 8 * (128 + 4)  # 1 byte per value + scales
    weight = layer.weight.dequantized()
    assert weight.shape == (16, 64) and weight.dtype == torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=0, atol=0)


def test_lora_on_a_quantized_base_weight() -> None:
    torch.manual_seed(0)
    config = QuantizationConfig(q_bits=6, group_size=32)
    layer = OptimizedLinear(32, 16, lora_config=LoRAConfig(lora_r=4), quantization_config=config, dtype=torch.float32)
    assert isinstance(layer.weight, QuantizedParameter) and layer.weight.dtype == torch.uint8
    assert layer.weight.numel() == 16 * (32 * 6 // 8 + 4)  # 6 bits per value
    x = torch.randn(2, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight.dequantized()), rtol=0, atol=0)
    layer(x).sum().backward()
    assert layer.lora_weight_2.weight.grad is not None


def test_quantized_parameter_clones_copies_and_pickles() -> None:
    qp = QuantizedParameter(torch.rand(5, 5, dtype=torch.bfloat16), quantization_config=QuantizationConfig(q_bits=6))
    clone = QuantizedParameter(qp.data, **qp.__dict__)  # how Hugging Face clones a parameter
    assert torch.equal(clone.data, qp.data) and clone.quantization_config == qp.quantization_config
    torch.testing.assert_close(clone.dequantized(), qp.dequantized())
    for other in (copy.deepcopy(qp), pickle.loads(pickle.dumps(qp))):
        assert isinstance(other, QuantizedParameter)
        torch.testing.assert_close(other.dequantized(), qp.dequantized(), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(nn.ParameterDict({"w": qp}).state_dict(), buffer)
    with pytest.raises(ValueError, match="requires_grad=True"):
        QuantizedParameter(torch.rand(2, 2), requires_grad=True)


def test_init_lora_freezes_the_model_and_builds_adapters() -> None:
    model = nn.Sequential(
        OptimizedLinear(8, 8, lora_config=LoRAConfig(lora_r=2, delay_lora_init=True), dtype=torch.float32),
        nn.LayerNorm(8),
    )
    with pytest.raises(RuntimeError, match="init_lora"):
        model(torch.randn(1, 8))
    init_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["0.lora_weight_1.weight", "0.lora_weight_2.weight"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 4, bias=False)


def test_init_context_builds_optimized_linears_and_restores_nn_linear() -> None:
    lora = LoRAConfig(lora_r=2, target_mods=["q_proj"])
    with Init(lora_config=lora):
        block = _Block()
    assert torch.nn.Linear is nn.modules.linear.Linear
    assert isinstance(block.q_proj, LoRAOptimizedLinear) and not block.q_proj._initialized
    assert lora.delay_lora_init is False  # the caller's config is left as it was
    # loading whole weights: q_proj keeps LoRA, mlp (not a target) turns back into a plain linear
    weights = {"q_proj.weight": torch.randn(8, 8), "mlp.weight": torch.randn(4, 8)}
    block.load_state_dict(weights, strict=False)
    init_lora(block)
    assert block.mlp.disabled and not block.q_proj.disabled
    block.float()
    x = torch.randn(2, 8)
    for name in ("mlp", "q_proj"):  # the layers hold the loaded weights (in bf16, the layers' dtype)
        expected = x @ weights[f"{name}.weight"].bfloat16().float().T
        torch.testing.assert_close(getattr(block, name)(x), expected, rtol=1e-6, atol=1e-6)


def test_loading_a_whole_weight_into_a_quantized_layer_quantizes_it() -> None:
    config = QuantizationConfig(group_size=16)
    layer = OptimizedLinear(16, 4, lora_config=LoRAConfig(lora_r=2, target_mods=[""]), quantization_config=config)
    whole = torch.randn(4, 16, dtype=torch.bfloat16)
    layer.load_state_dict({"weight": whole}, strict=False)
    err = (layer.weight.dequantized().float() - whole.float()).abs()
    assert (err <= 2**-4 * whole.float().abs() + 1e-6).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lora_config": LoRAConfig(lora_r=0)}, "lora_config.lora_r"),
        ({"lora_config": LoRAConfig(offload_ratio=2.0)}, "lora_config.offload_ratio"),
        ({"lora_config": LoRAConfig(target_mods="q_proj")}, "lora_config.target_mods"),  # type: ignore[arg-type]
        ({"lora_config": LoRAConfig(base_weight_sharding=2)}, "lora_config.base_weight_sharding=2"),
        ({"lora_config": LoRAConfig(), "bias": True}, "bias=True"),
        ({"quantization_config": QuantizationConfig(q_bits=5)}, "quantization_config.q_bits"),
        ({"quantization_config": QuantizationConfig(mantissa_bits=4)}, "quantization_config.mantissa_bits"),
        ({"quantization_config": QuantizationConfig(group_size=6)}, "quantization_config.group_size"),
        ({"lora_config": {"lora_r": 4}}, "Expecting LoRAConfig"),
    ],
)
def test_bad_configs_are_refused_by_name(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizedLinear(16, 8, **kwargs)  # type: ignore[arg-type]


def test_loading_a_base_weight_of_the_wrong_size_names_the_shape() -> None:
    layer = OptimizedLinear(16, 4, lora_config=LoRAConfig(lora_r=2, target_mods=[""]), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"shape \(32,\); load the whole \(4, 16\) weight"):
        layer.load_state_dict({"weight": torch.zeros(32)}, strict=False)


def test_init_builds_a_hugging_face_model_with_adapters_ready() -> None:
    """`from_config` under `Init` returns the model with every linear a LoRA layer and the adapters built."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with Init(lora_config=LoRAConfig(lora_r=4, lora_alpha=8)):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert transformers.AutoModelForCausalLM.from_config.__qualname__.startswith("_BaseAutoModelClass")  # restored
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoRAOptimizedLinear) and q_proj._initialized
    trainable = {n.rsplit(".", 2)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.self_attn.q_proj" in trainable and "model.embed_tokens" not in trainable
    model.to(torch.bfloat16)
    ids = torch.randint(0, 64, (1, 5))
    model(ids, labels=ids).loss.backward()
    assert q_proj.lora_weight_2.weight.grad.abs().sum() > 0
